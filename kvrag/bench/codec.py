"""Codec benchmark: size (bits per element, container metadata included), ratio vs bf16, encode and
decode speed on one CPU core, and reconstruction error, for every codec and quality level.

Speeds are MB/s of *bf16-equivalent* data (elements × 2 bytes, whatever the cache dtype), measured
through the real container (`encode_chunk` / `ChunkReader.decode_all`, checksums included) with
``torch.set_num_threads(1)``; decode is the best of ``repeats`` passes. Decoding whole chunks into new
tensors also pays for their memory; "decode into" decodes layer by layer into one reused buffer per
chunk (`ChunkReader.decode_layer_into`), the way fusion's loader stages layers. Codecs that need fitting
are fitted on ``fit_samples`` (by default the first half of the samples; the rest are measured),
so errors are out-of-sample, as for chunks added to an index after its codec was fitted.

Mounted as ``kvrag bench codec --index DIR [--json OUT] [--markdown OUT] [--n-chunks N]``: the chunk
caches come from an existing index (decoded with the index's own codec — build the index with
``--codec raw`` to measure against exact caches).

With ``--qa FILE`` it also measures the effect on answers (`answer_effect`): the first questions of a
QA JSONL, whose passages are chunks of the index (an index from ``kvrag bench quality --index DIR``),
are answered from their uncompressed caches and from the same caches round-tripped through every
codec level, with the index's model and greedy decoding. Per (codec, level, mode) it reports
first-token and answer agreement (token F1) with the uncompressed answer in that mode and with
``full``'s answer, and ΔNLL: the NLL of the uncompressed answer under the round-tripped caches minus
under the uncompressed ones (both teacher-forced on the fused cache, so a lossless codec gives 0).
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvrag.bench import common, metrics
from kvrag.bench.common import markdown_table
from kvrag.bench.qa_data import load_questions, passage_keys
from kvrag.codec import make_codec
from kvrag.config import FuseConfig, GenerateConfig
from kvrag.model.prefix import KV
from kvrag.rag import KVRag
from kvrag.storage.container import ChunkReader, encode_chunk

log = logging.getLogger(__name__)
_KEY = "0" * 40


def _measure(codec: Any, samples: Sequence[KV], repeats: int) -> dict[str, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    blobs = [encode_chunk(codec, _KEY, "bench", k, v) for k, v in samples]
    encode_s, encode_cpu = time.perf_counter() - t0, time.process_time() - c0
    decode_s = decode_cpu = into_s = math.inf
    decoded: list[Any] = []
    staging = [torch.empty((2, *k.shape[1:]), dtype=k.dtype) for k, _ in samples]
    for _ in range(max(1, repeats)):
        t0, c0 = time.perf_counter(), time.process_time()
        decoded = [ChunkReader(_KEY, io.BytesIO(b), codec, "bench").decode_all() for b in blobs]
        decode_s, decode_cpu = min(decode_s, time.perf_counter() - t0), min(decode_cpu, time.process_time() - c0)
        t0 = time.perf_counter()
        for blob, buf in zip(blobs, staging):  # layer by layer into one buffer, as fusion's loader does
            reader = ChunkReader(_KEY, io.BytesIO(blob), codec, "bench")
            for layer in range(reader.header.n_layers):
                reader.decode_layer_into(layer, buf)
        into_s = min(into_s, time.perf_counter() - t0)
    elements = sum(2 * k.numel() for k, _ in samples)
    err: dict[str, float] = {}
    for name, idx in (("k", 0), ("v", 1)):
        num = sum(float((s[idx].float() - d[idx].float()).pow(2).sum()) for s, d in zip(samples, decoded))
        den = sum(float(s[idx].float().pow(2).sum()) for s in samples)
        err[name] = math.sqrt(num / den) if den > 0 else 0.0
        err[f"max_{name}"] = max(float((s[idx].float() - d[idx].float()).abs().max()) for s, d in
                                 zip(samples, decoded) if s[idx].numel()) if elements else 0.0
    nbytes = sum(len(b) for b in blobs)
    bits = nbytes * 8 / elements
    mb = elements * 2 / 1e6  # bf16-equivalent megabytes
    return {"chunks": len(samples), "elements": elements, "bytes": nbytes, "bits_per_element": bits,
            "ratio_vs_bf16": 16 / bits, "encode_MBps": mb / encode_s, "decode_MBps": mb / decode_s,
            "encode_MBps_cpu": mb / max(encode_cpu, 1e-9), "decode_MBps_cpu": mb / max(decode_cpu, 1e-9),
            "decode_into_MBps": mb / into_s,
            "rel_err_k": err["k"], "rel_err_v": err["v"], "max_abs_err_k": err["max_k"],
            "max_abs_err_v": err["max_v"]}


def fit_codecs(names: Sequence[str], fit_samples: Sequence[KV], fitted: Sequence[Any] = ()) -> list[Any]:
    """A `Codec` per name, fitted on ``fit_samples`` when it needs it.

    A codec in ``fitted`` (e.g. an index's own) is used as it is for its name.
    """
    own = {c.name: c for c in fitted}
    out = []
    for name in names:
        codec = own[name] if name in own else make_codec(name)
        if codec.needs_fit and name not in own:
            if not fit_samples:
                raise ValueError(f"codec {name!r} needs fitting but there are no fit samples")
            t0 = time.perf_counter()
            codec.fit(list(fit_samples), int(fit_samples[0][0].shape[0]))
            log.info("fitted %s on %d chunks in %.1f s", name, len(fit_samples), time.perf_counter() - t0)
        out.append(codec)
    return out


def codec_levels(base: Any, levels: Sequence[int] | None) -> list[Any]:
    """``base`` at each of its levels in ``levels`` (all of them when None or when it has none of those)."""
    chosen = [lv for lv in base.levels() if levels is None or lv in levels] or list(base.levels())
    return [base.with_level(lv) for lv in chosen]


def run_codec_bench(
    samples: Sequence[KV], codecs: Sequence[Any] = ("raw", "int8", "cachegen"),
    levels: Sequence[int] | None = None, *, fit_samples: Sequence[KV] | None = None, repeats: int = 3,
) -> list[dict[str, Any]]:
    """Measure every codec at every level (``levels`` restricts them) on ``samples``.

    Args:
        samples: chunk caches ``(keys, values)``, each ``[L, H, S, D]`` with keys pre-RoPE.
        codecs: codec names for `make_codec`, or codecs (fitted already where they need it).
        levels: quality levels to measure (each codec measures those it has; all when None).
        fit_samples: caches to fit codecs that need it; by default the first half of ``samples`` (and
            only the second half is measured).
        repeats: decode passes; the fastest is reported.

    Returns:
        One dict per (codec, level): ``bits_per_element`` (container bytes × 8 / elements),
        ``ratio_vs_bf16``, ``encode_MBps`` / ``decode_MBps`` (bf16-equivalent, one thread, wall clock)
        and ``*_MBps_cpu`` (per second of this process's CPU time: steadier on a shared machine),
        ``decode_into_MBps`` (layer by layer into a reused buffer, wall clock),
        ``rel_err_k`` / ``rel_err_v`` (relative L2 error), max absolute errors, sizes and counts.

    Example:
        >>> rows = run_codec_bench(caches, codecs=("int8", "cachegen"))  # doctest: +SKIP
        >>> print(to_markdown(rows))  # doctest: +SKIP
    """
    samples = list(samples)
    if fit_samples is None:
        fit_samples, samples = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    if not samples:
        raise ValueError("run_codec_bench needs at least one sample chunk to measure (two without fit_samples)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        names = [c for c in codecs if isinstance(c, str)]
        fitted = iter(fit_codecs(names, fit_samples))
        for base in [next(fitted) if isinstance(c, str) else c for c in codecs]:
            for codec in codec_levels(base, levels):
                row = {"codec": base.name, "level": codec.level, "default": codec.level == base.default_level(),
                       **_measure(codec, samples, repeats)}
                log.info("%s level %d: %.3f bits/element", base.name, codec.level, row["bits_per_element"])
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of `run_codec_bench` as a Markdown table."""
    headers = ["codec", "level", "bits/elem", "× vs bf16", "encode MB/s", "decode MB/s", "decode MB/s (CPU)",
               "decode into MB/s", "rel err K", "rel err V"]
    table = [[r["codec"], f"{r['level']}{'*' if r.get('default') else ''}", r["bits_per_element"],
              r["ratio_vs_bf16"], r["encode_MBps"], r["decode_MBps"], r.get("decode_MBps_cpu", math.nan),
              r.get("decode_into_MBps", math.nan), r["rel_err_k"], r["rel_err_v"]] for r in rows]
    return markdown_table(headers, table) + (
        "\n\n`*` default level. MB/s of bf16-equivalent data (elements × 2 bytes) on one thread; "
        "(CPU): per second of process CPU time. decode: whole chunks into new tensors (`decode_all`); "
        "decode into: layer by layer into one reused buffer per chunk (`decode_layer_into`, as fusion's loader).")


def roundtrip(codec: Any, kv: KV) -> tuple[KV, int]:
    """``kv`` (``[L, H, S, D]`` keys, values) encoded and decoded layer by layer in memory, and its bytes.

    The container adds only lossless framing, so this is what storing the chunk would give.
    """
    keys, values = kv
    shape = tuple(int(d) for d in keys.shape[1:])
    blobs = [codec.encode_layer(keys[i], values[i], i) for i in range(keys.shape[0])]
    layers = [codec.decode_layer(b, i, shape, keys.dtype) for i, b in enumerate(blobs)]
    return (torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])), sum(map(len, blobs))


_EFFECT_KEYS = ("payload_bits_per_element", "first_token_agreement", "agreement", "identical",
                "first_token_agreement_full", "agreement_full", "nll", "delta_nll")


def _effect_row(qid: str, codec: str, level: int | None, mode: str, ans: Any, ref: Any, full: Any,
                nll: float, ref_nll: float, bits: float) -> dict[str, Any]:
    return {"id": qid, "codec": codec, "level": level, "mode": mode, "answer": ans.text,
            "payload_bits_per_element": bits,
            "first_token_agreement": metrics.first_token_agreement(ans.token_ids, ref.token_ids),
            "agreement": metrics.agreement(ans.text, ref.text), "identical": float(ans.token_ids == ref.token_ids),
            "first_token_agreement_full": metrics.first_token_agreement(ans.token_ids, full.token_ids),
            "agreement_full": metrics.agreement(ans.text, full.text), "nll": nll, "delta_nll": nll - ref_nll}


def _question_effect(rag: Any, item: dict[str, Any], codecs: Sequence[Any], specs: Sequence[Any],
                     max_new_tokens: int, step: Any) -> list[dict[str, Any]]:
    """Rows of one question: the uncompressed caches per mode, then every codec level per mode."""
    keys = passage_keys(rag, item)
    raw = {k: rag.kvstore.load(k) for k in dict.fromkeys(keys)}  # a repeated passage is one chunk
    elements = sum(2 * kv[0].numel() for kv in raw.values())

    def ask(cfg: Any, caches: Any = None, score_ids: Any = None, n: int = max_new_tokens) -> tuple[Any, float]:
        """An answer, and the NLL of ``score_ids`` on the cache it answered from (nan without them)."""
        fused = rag.prepare(item["question"], chunks=keys, fuse_config=cfg, caches=caches)
        ans = fused.generate(GenerateConfig(max_new_tokens=n))
        return ans, fused.nll(score_ids) if score_ids else math.nan

    full, _ = ask(FuseConfig(mode="full"))
    base = {s.label: ask(s.config, [raw[k] for k in keys])[0] for s in specs}
    # the reference NLL is teacher-forced like the codecs' own, so a lossless codec gives ΔNLL = 0 exactly
    base_nll = {s.label: ask(s.config, [raw[k] for k in keys], base[s.label].token_ids, 1)[1] for s in specs}
    bits = 8.0 * next(iter(raw.values()))[0].element_size()
    rows = [_effect_row(item["id"], "uncompressed", None, s.label, base[s.label], base[s.label], full,
                        base_nll[s.label], base_nll[s.label], bits) for s in specs]
    step()
    for codec in codecs:
        decoded = {k: roundtrip(codec, kv) for k, kv in raw.items()}
        bits = sum(n for _, n in decoded.values()) * 8 / elements
        for s in specs:
            ref = base[s.label]
            ans, nll = ask(s.config, [decoded[k][0] for k in keys], ref.token_ids)
            rows.append(_effect_row(item["id"], codec.name, codec.level, s.label, ans, ref, full, nll,
                                    base_nll[s.label], bits))
        step()
    return rows


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def summarise_effect(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (codec, level, mode), in first-seen order: the mean of each measure over the questions."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["codec"], r["level"], r["mode"]), []).append(r)
    return [{"codec": c, "level": lv, "mode": m, "n": len(rs), **{k: _mean([r[k] for r in rs]) for k in _EFFECT_KEYS}}
            for (c, lv, m), rs in groups.items()]


def _check_modes(specs: Sequence[Any]) -> None:
    if any(s.config.mode == "full" for s in specs):
        raise ValueError("--qa-modes: full recomputes every chunk, so no codec changes its answer; "
                         "it is measured as the reference already")


def answer_effect(rag: Any, items: Sequence[dict[str, Any]], codecs: Sequence[Any], specs: Sequence[Any],
                  max_new_tokens: int = 16) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The effect of each codec level on the answers of ``rag``'s model (greedy decoding).

    Each question is answered over its own passages (chunks of ``rag``'s index, in dataset order) with
    ``full``, then per mode from the stored caches, then per codec level and mode from those caches
    round-tripped in memory (`roundtrip`), scoring the uncompressed answer on the same fused cache.

    Args:
        rag: an open `KVRag` whose index holds every passage as one chunk.
        items: QA items (`kvrag.bench.quality.load_questions`).
        codecs: codecs at the levels to measure (fitted where they need it).
        specs: `kvrag.bench.common.ModeSpec`s of the fusion modes (not ``full``: it uses no cache).
        max_new_tokens: answer length.

    Returns:
        ``(summary, rows)``: per (codec, level, mode) the means over questions, and per question the
        same measures: ``first_token_agreement`` / ``agreement`` (token F1) / ``identical`` with the
        uncompressed answer in that mode, ``*_full`` with ``full``'s answer, ``nll`` and ``delta_nll``
        of the uncompressed answer, ``payload_bits_per_element`` (codec bytes, no container framing).
        Rows with codec ``uncompressed`` are the stored caches themselves.
    """
    _check_modes(specs)
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(items) * (1 + len(codecs)), desc="codec answers", unit="step", disable=None) as bar:
        for item in items:
            rows += _question_effect(rag, item, codecs, specs, max_new_tokens, lambda: bar.update(1))
    return summarise_effect(rows), rows


def effect_markdown(summary: Sequence[dict[str, Any]]) -> str:
    """The summary of `answer_effect` as a Markdown table."""
    headers = ["codec", "level", "mode", "bits/elem", "first-token", "agreement", "identical",
               "first-token vs full", "agreement vs full", "ΔNLL"]
    table = [[r["codec"], "–" if r["level"] is None else r["level"], r["mode"], r["payload_bits_per_element"],
              r["first_token_agreement"], r["agreement"], r["identical"], r["first_token_agreement_full"],
              r["agreement_full"], r["delta_nll"]] for r in summary]
    return markdown_table(headers, table) + (
        "\n\nMeans over questions. first-token / agreement (token F1) / identical: against the answer from the "
        "uncompressed caches in the same mode; vs full: against full prefill's answer. ΔNLL: NLL of the "
        "uncompressed answer under the round-tripped caches minus under the uncompressed ones. bits/elem: "
        "codec payload, no container framing.")


def index_samples(rag: Any, fit_chunks: int, n_chunks: int, avoid: set[str]) -> tuple[list[KV], int, int]:
    """Chunk caches of ``rag``'s index: fit samples then measured ones, chunks not in ``avoid`` first.

    Returns:
        ``(samples, fit, overlap)``: ``samples[:fit]`` fit the codecs, the rest are measured; ``overlap``
        fit samples are in ``avoid`` (the index has too few other chunks).
    """
    records = rag.index.records()
    keys = [r.key for r in records if r.key not in avoid] + [r.key for r in records if r.key in avoid]
    keys = keys[: fit_chunks + n_chunks]
    if len(keys) < 2:
        raise ValueError(f"index {rag.path} holds {len(keys)} chunk(s); the codec bench needs at least 2")
    fit = fit_chunks if len(keys) == fit_chunks + n_chunks else min(fit_chunks, len(keys) // 2)
    return [rag.kvstore.load(k) for k in keys], fit, sum(k in avoid for k in keys[:fit])


def run(args: argparse.Namespace) -> int:
    if args.n_chunks < 1 or args.fit_chunks < 1 or args.qa_n < 1:
        raise ValueError("--n-chunks, --fit-chunks and --qa-n must be >= 1")
    specs = [common.parse_mode(t) for t in args.qa_modes.split(",") if t.strip()]
    _check_modes(specs)
    levels = [int(t) for t in args.levels.split(",") if t.strip()] if args.levels else None
    with KVRag.open(Path(args.index)) as rag:
        items = load_questions(Path(args.qa), args.qa_n) if args.qa else []
        qa_keys = {k for item in items for k in passage_keys(rag, item)}
        samples, fit, overlap = index_samples(rag, args.fit_chunks, args.n_chunks, qa_keys)
        source = rag.kvstore.codec.name
        if source != "raw":
            log.warning("index %s stores caches with the lossy codec %r: errors are relative to those",
                        args.index, source)
        if overlap:
            log.warning("%d of the %d fit chunks are passages of the --qa questions (the index has too few "
                        "other chunks): their answer effect is in-sample", overlap, fit)
        own = [rag.kvstore.codec] if rag.kvstore.codec.needs_fit else []
        codecs = fit_codecs([c.strip() for c in args.codecs.split(",") if c.strip()], samples[:fit], own)
        rows = run_codec_bench(samples[fit:], codecs, levels, fit_samples=samples[:fit], repeats=args.repeats)
        measured, samples = len(samples) - fit, []
        effect = answer_effect(rag, items, [c for base in codecs for c in codec_levels(base, levels)], specs,
                               args.max_new_tokens) if items else None
        model = rag.manifest["model"]["source"]
    fitted = {c.name: ("index state" if c in own else f"{fit} chunks") for c in codecs if c.needs_fit}
    table = to_markdown(rows)
    text = f"{measured} chunks of `{args.index}` (codecs fitted on {fit} others; stored with `{source}`)\n\n{table}\n"
    payload = {**common.stamp(args), "source_codec": source, "fit_chunks": fit, "codec_fit": fitted, "rows": rows}
    if effect is not None:
        summary, qrows = effect
        payload["answer_effect"] = {"data": args.qa, "model": model, "questions": len(items),
                                    "modes": [s.label for s in specs], "max_new_tokens": args.max_new_tokens,
                                    "fit_chunks_in_qa": overlap, "summary": summary, "rows": qrows}
        etable = effect_markdown(summary)
        table += f"\n\n{etable}"
        note = f"; {overlap} of the fit chunks are among their passages" if overlap else ""
        text += (f"\n## Effect on answers\n\n{len(items)} questions of `{Path(args.qa).name}`, model `{model}`, "
                 f"greedy, {args.max_new_tokens} new tokens{note}\n\n{etable}\n")
    if args.json:
        common.write_json(Path(args.json), payload)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(f"# kvrag bench codec\n\n{text}")
    print(table)
    return 0
