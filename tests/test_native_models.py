"""kvrag's own Llama and BERT (`kvrag.model.native_llama`, `kvrag.native_bert`) against transformers' models: the
same weights under the same names, the same outputs to float rounding, the same greedy tokens, and a cold load that
imports none of transformers' modeling code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from transformers import AutoModel, AutoModelForCausalLM, BertConfig

from kvrag.errors import UnsupportedModelError
from kvrag.model import hf_compat
from kvrag.model.loading import ModelSpec, load_model, model_fingerprint, resolve_source
from kvrag.model.native_llama import NativeLlamaForCausalLM, native_reason
from kvrag.native_bert import NativeBert, native_bert_reason

ATOL = 1e-4


def _transformers_llama(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def _greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens after ``ids``: one prefill, then one token a step over the returned cache."""
    with torch.no_grad():
        out = model(input_ids=ids, **hf_compat.with_cache(model, hf_compat.full_cache(model)), use_cache=True)
        tokens, cache = [], hf_compat.returned_cache(out)
        for step in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            position = torch.tensor([[ids.shape[1] + step]])
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=position,
                        **hf_compat.with_cache(model, cache), use_cache=True)
            cache = hf_compat.returned_cache(out)
    return tokens


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("native-llama"), seed=3)


def test_a_plain_llama_folder_loads_natively_with_transformers_names_and_fingerprint(tiny_llama_dir: Path,
                                                                                      monkeypatch) -> None:
    native = load_model(str(tiny_llama_dir), device="cpu")
    assert isinstance(native.model, NativeLlamaForCausalLM)
    monkeypatch.setenv("KVRAG_NATIVE_MODELS", "0")
    reference = load_model(str(tiny_llama_dir), device="cpu")
    assert not isinstance(reference.model, NativeLlamaForCausalLM)
    assert [n for n, _ in native.model.named_parameters()] == [n for n, _ in reference.model.named_parameters()]
    assert native.fingerprint == reference.fingerprint and native.spec == reference.spec
    text = "Paris is the capital of France. <s> 東京 ☃"
    assert native.tokenizer(text)["input_ids"] == reference.tokenizer(text)["input_ids"]
    assert native.tokenizer.chat_template == reference.tokenizer.chat_template


def test_the_native_llama_forward_equals_transformers(tiny_llama_dir: Path) -> None:
    native = load_model(str(tiny_llama_dir), device="cpu").model
    reference = _transformers_llama(tiny_llama_dir)
    torch.manual_seed(0)
    ids = torch.randint(3, native.config.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(native(input_ids=ids).logits, reference(input_ids=ids).logits, atol=ATOL, rtol=0)
        # after cached rows: a block of queries that also attends to the rows before it (lower-right causal)
        head = hf_compat.full_cache(native)
        native.model(input_ids=ids[:1, :25], cache=head)
        got = native(input_ids=ids[:1, 25:], position_ids=torch.arange(25, 40)[None], cache=head).logits
        torch.testing.assert_close(got, reference(input_ids=ids[:1]).logits[:, 25:], atol=ATOL, rtol=0)
        older = hf_compat.full_cache(native)  # the cache under transformers' older keyword is extended the same way
        native.model(input_ids=ids[:1, :25], past_key_values=older)
        assert older.get_seq_length() == 25
    assert _greedy(native, ids[:1], 12) == _greedy(reference, ids[:1], 12)


def test_the_native_llama_gives_smollm2s_logits_and_tokens(smollm2) -> None:
    assert isinstance(smollm2.model, NativeLlamaForCausalLM), "the real model should load natively"
    reference = _transformers_llama(Path(resolve_source("smollm2")))
    assert model_fingerprint(reference, ModelSpec.from_model(reference)) == smollm2.fingerprint  # indexes still open
    ids = torch.tensor([smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(smollm2.model(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   atol=ATOL, rtol=0)
    assert _greedy(smollm2.model, ids, 8) == _greedy(reference, ids, 8)


def test_a_padding_mask_is_refused_in_one_line(tiny_llama_dir: Path) -> None:
    model = load_model(str(tiny_llama_dir), device="cpu").model
    with pytest.raises(ValueError, match="no padding mask"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0, 0]]))


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("changes", "reason"), [
    ({"hidden_act": "gelu"}, "SiLU"),
    ({"attention_bias": True}, "biases"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rotary"),
    ({"architectures": ["MistralForCausalLM"]}, "LlamaForCausalLM"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantised"),
])
def test_what_the_native_llama_does_not_run_is_named(tiny_llama_dir: Path, tmp_path: Path, changes: dict,
                                                      reason: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for item in tiny_llama_dir.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    assert native_reason(folder) is None
    _edit_config(folder, **changes)
    assert reason in (native_reason(folder) or "")


def test_the_switch_and_a_llama3_model_load_through_transformers(tmp_path: Path, monkeypatch) -> None:
    scaled = save_tiny_model("llama3", tmp_path / "llama3")
    assert not isinstance(load_model(str(scaled), device="cpu").model, NativeLlamaForCausalLM)
    monkeypatch.setenv("KVRAG_NATIVE_MODELS", "off")
    assert native_reason(scaled) == "KVRAG_NATIVE_MODELS is off"


def test_weights_that_do_not_match_the_config_are_refused_in_one_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for item in tiny_llama_dir.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    _edit_config(folder, num_hidden_layers=5)
    with pytest.raises(UnsupportedModelError, match="does not hold a Llama's weights") as err:
        load_model(str(folder), device="cpu")
    assert "\n" not in str(err.value)


def test_the_native_bert_equals_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    reference = AutoModel.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # the encoder alone is compared here
    assert native_bert_reason(tmp_path) is None
    native = NativeBert.load(tmp_path)
    ids = torch.randint(0, 120, (3, 17))
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    got = native(input_ids=ids, attention_mask=mask).last_hidden_state
    for row, n in enumerate((17, 9, 4)):  # padded positions' states are never read (mean pooling masks them)
        torch.testing.assert_close(got[row, :n], want[row, :n], atol=1e-5, rtol=0)
    _edit_config(tmp_path, position_embedding_type="relative_key")
    assert "relative" in (native_bert_reason(tmp_path) or "")


def test_a_cold_answer_with_both_models_imports_no_transformers() -> None:
    script = (
        "import sys\n"
        "from kvrag.embedder import Embedder\n"
        "from kvrag.model.loading import load_model\n"
        "lm = load_model('smollm2', device='cpu')\n"
        "Embedder(None, device='cpu').encode(['a question'])\n"
        "import tempfile\n"
        "from kvrag.passages import PassageCache, open_cache_store\n"
        "cache = PassageCache(lm, open_cache_store(tempfile.mkdtemp()))\n"
        "passage = 'Paris is the capital of France. It lies on the Seine, in the north, and is its largest city.'\n"
        "for _ in range(3):  # seen, stored, then read back\n"
        "    cache.answer_prompt(f'Passages:\\n{passage}\\n\\nQuestion: Where is Paris?', passages=[passage],\n"
        "                        max_new_tokens=3)\n"
        "heavy = [m for m in ('transformers', 'torch._dynamo', 'sentence_transformers') if m in sys.modules]\n"
        "print(type(lm.model).__name__, heavy, cache.stats.found > 0)\n"
    )
    env = {**os.environ, "KVRAG_NATIVE_MODELS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "NativeLlamaForCausalLM [] True"


def _hub_cache(root: Path, repo_id: str, model_dir: Path, skip: str = "") -> Path:
    """A Hugging Face cache under ``root`` holding ``model_dir``'s files as ``repo_id``'s main revision."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    for item in model_dir.iterdir():
        if item.name != skip:
            (snapshot / item.name).write_bytes(item.read_bytes())
    return snapshot


def test_a_hub_id_already_in_the_hugging_face_cache_runs_natively(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from kvrag.model.native_llama import cached_hub_folder

    cache = tmp_path / "hub"
    snapshot = _hub_cache(cache, "kvrag-tests/tiny-llama", tiny_llama_dir)
    assert cached_hub_folder("kvrag-tests/tiny-llama", cache_dir=cache) == snapshot
    assert cached_hub_folder("kvrag-tests/absent", cache_dir=cache) is None
    assert cached_hub_folder("not a repo id", cache_dir=cache) is None
    partial = _hub_cache(cache, "kvrag-tests/no-weights", tiny_llama_dir, skip="model.safetensors")
    assert native_reason(partial) == "no safetensors weights"  # transformers then loads (or fetches) it
    script = ("from kvrag.model.loading import load_model\n"
              "print(type(load_model('kvrag-tests/tiny-llama', device='cpu').model).__name__)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "NativeLlamaForCausalLM"
