"""End-to-end `kvrag bench speed` and `kvrag bench quality` on tiny random models."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.bench.common import parse_modes
from kvrag.bench.qa_data import passage_keys
from kvrag.cli import main
from kvrag.prompt import chunk_token_ids


def _check_outputs(out: Path, stem: str, plot: str) -> dict:
    payload = json.loads((out / f"{stem}.json").read_text())
    assert {"command", "hardware", "versions", "date"} <= payload.keys()
    assert payload["hardware"]["cpu"]
    md = (out / f"{stem}.md").read_text()
    assert md.count("\n|") >= 3 and "full" in md
    assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return payload


def test_parse_modes() -> None:
    specs = parse_modes("cacheblend@0.05,attnlink@4,reuse")
    assert [s.label for s in specs] == ["full", "cacheblend@0.05", "attnlink@4", "reuse"]
    assert specs[1].config.ratio == 0.05 and specs[2].config.options["link_tokens"] == 4
    # one mode under two attention kernels, side by side
    tiles, blocks = parse_modes("probe@0.2,probe@0.2+blocks")[1:]
    assert (tiles.config.attention, blocks.config.attention) == ("auto", "blocks")
    assert blocks.label == "probe@0.2+blocks" and blocks.config.ratio == 0.2
    with pytest.raises(ValueError, match="attention kernel"):
        parse_modes("probe+dense")
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("full,blend@0.1")
    with pytest.raises(ValueError, match="takes no"):
        parse_modes("reuse@3")
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("oracle@0.2", quality=True)  # a research selection, registered by its experiment only
    _script("oracle_quality").register()
    oracle = parse_modes("oracle@0.2", quality=True)[1]
    assert oracle.selector_for is not None and oracle.config.mode == "reuse" and oracle.config.ratio == 0.2
    with pytest.raises(ValueError, match="only `kvrag bench quality`"):
        parse_modes("full,oracle@0.2")
    # full@DTYPE is a second full prefill, never the reference; the plain full still comes first
    specs = parse_modes("full@bfloat16,reuse,full", quality=True)
    assert [s.label for s in specs] == ["full", "full@bfloat16", "reuse"]
    assert specs[0].reference and specs[0].dtype is None
    assert not specs[1].reference and specs[1].dtype == "bfloat16" and specs[1].config.mode == "full"
    with pytest.raises(ValueError, match="only `kvrag bench quality`"):
        parse_modes("full@bfloat16")
    with pytest.raises(ValueError, match="full@DTYPE takes one of"):
        parse_modes("full@int8", quality=True)


def test_flags_set_fuse_settings_for_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrag.bench.common import with_fuse_settings

    specs = with_fuse_settings(parse_modes("cacheblend@0.05,probe@0.1"), "0,1,2", "flex", 3.0)
    assert all(s.config.attention == "flex" for s in specs)
    blend = [s for s in specs if s.config.mode == "cacheblend"]
    assert blend and all(s.config.options["check_layers"] == (0, 1, 2) for s in blend)
    assert all(s.config.options["first_ratio_scale"] == 3.0 for s in blend)
    assert specs[1].config.ratio == 0.05 and specs[2].config.mode == "probe"  # the rest as parsed
    kept = with_fuse_settings(parse_modes("cacheblend@0.05"))
    assert kept[1].config == parse_modes("cacheblend@0.05")[1].config
    with pytest.raises(ValueError, match="--check-layers"):
        with_fuse_settings(parse_modes("reuse"), "1;2")
    with pytest.raises(ValueError, match="check_layers"):
        with_fuse_settings(parse_modes("reuse"), "2,1")
    with pytest.raises(ValueError, match="first_ratio_scale"):
        with_fuse_settings(parse_modes("reuse"), first_ratio_scale=0.5)
    # both benches pass the flag on before loading anything: a bad value is refused up front
    for bench in (["quality", "--data", "missing.jsonl", "--model", "missing"], ["speed", "--arch", "smollm2-135m"]):
        assert main(["bench", *bench, "--first-ratio-scale", "0.5"]) == 2
        assert "first_ratio_scale must be >= 1" in capsys.readouterr().err


def _speed(out: Path, device: str, tiers: str = "disk,ram") -> dict:
    rc = main(
        [
            "bench",
            "speed",
            "--arch",
            "tiny",
            "--lengths",
            "64,128",
            "--chunk-tokens",
            "32",
            "--modes",
            "full,reuse,cacheblend@0.15,probe@0.15,attnlink@4",
            "--repeats",
            "1",
            "--device",
            device,
            "--tiers",
            tiers,
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    payload = _check_outputs(out, "speed", "speed.png")
    results = payload["results"]
    assert {r["length"] for r in results} == {64, 128}
    n_tiers = len(tiers.split(","))
    # per length: the plain transformers forward, full, and four modes from every tier
    assert len(results) == 2 * (2 + 4 * n_tiers) and all(r["ttft_ms"] > 0 for r in results)
    full = [r for r in results if r["mode"] == "full"]
    assert all(r["speedup"] == pytest.approx(1.0) and r["recompute_fraction"] == 1.0 for r in full)
    reuse = [r for r in results if r["mode"] == "reuse"]
    assert {r["tier"] for r in reuse} == set(tiers.split(","))
    assert all(r["recompute_fraction"] < 0.5 for r in reuse)
    assert all(r["load_ms"] >= 0 and r["fuse_ms"] > 0 for r in results)
    return payload


def test_bench_speed_tiny_cpu(tmp_path: Path) -> None:
    payload = _speed(tmp_path, "cpu")
    assert payload["device"] == "cpu" and payload["dtype"] == "float32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_speed_tiny_gpu(tmp_path: Path) -> None:
    payload = _speed(tmp_path, "auto", "disk,ram,gpu")
    assert payload["device"].startswith("cuda") and payload["dtype"] == "bfloat16"


def test_bench_decode_checks_the_triton_decoder_and_reports_throughput(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Tiny shapes (on the CPU the decoder runs in Triton's interpreter); on CUDA the real kernel."""
    args = ["bench", "decode", "--heads", "2", "--head-dim", "16", "--layers", "1", "--chunk-tokens", "16",
            "--distinct", "1", "--chunks", "1,3", "--repeats", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    assert result["bit_exact"] is True
    assert [(r["chunks"], r["blobs"], r["tokens"]) for r in result["rows"]] == [(1, 1, 16), (3, 3, 48)]
    assert [r["decoded_MB"] for r in result["rows"]] == [2 * 2 * 16 * 16 * 2 / 1e6, 3 * 2 * 2 * 16 * 16 * 2 / 1e6]
    assert all(r["kernel_GBps"] > 0 and r["decode_region_ms"] > 0 for r in result["rows"])
    assert "| 3 | 3 | 48 |" in capsys.readouterr().out


def test_bench_speed_skips_lengths_over_the_window(tmp_path: Path) -> None:
    rc = main(
        [
            "bench",
            "speed",
            "--arch",
            "tiny",
            "--lengths",
            "32,200000",
            "--chunk-tokens",
            "32",
            "--modes",
            "full,reuse",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    payload = json.loads((tmp_path / "speed.json").read_text())
    assert {r["length"] for r in payload["results"]} == {32}
    assert any("200000" in n for n in payload["notes"])


def _qa_file(path: Path) -> Path:
    items = [
        {
            "id": f"q{i}",
            "question": f"Who met Mr. Jones on day {i}?",
            "answers": ["Dr. Smith", "Smith"],
            "ctxs": [
                {"title": "Meeting", "text": "Dr. Smith arrived in Washington at 5 p.m. on Monday."},
                {"title": "", "text": f"She met Mr. Jones, who had travelled from London {i}."},
                {"title": "Records", "text": "The records were lost in 1998."},
            ],
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def test_bench_quality_tiny(tmp_path: Path, tiny_model_dir: Path) -> None:
    _script("oracle_quality").register()  # oracle@R: the deviation oracle's selection, from benchmarks/experiments
    data = _qa_file(tmp_path / "q.jsonl")
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "quality",
            "--data",
            str(data),
            "--model",
            str(tiny_model_dir),
            "--n",
            "3",
            "--modes",
            "full,reuse,cacheblend@0.15,probe@0.15,attnlink@4,oracle@0.5,full@float32,full@bfloat16",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    payload = _check_outputs(out, "quality", "quality_pareto.png")
    assert payload["n_questions"] == payload["n_planned"] == 3
    assert payload["index_chunks"] == 5  # shared passages stored once
    assert payload["neighbour_context"] == 0
    assert "partial" not in (out / "quality.md").read_text()
    assert len(payload["rows"]) == 24
    summary = {s["mode"]: s for s in payload["summary"]}
    assert list(summary) == ["full", "reuse", "cacheblend@0.15", "probe@0.15", "attnlink@4", "oracle@0.5",
                             "full@float32", "full@bfloat16"]
    # the model loaded again in its own dtype answers exactly as full does; bfloat16 is a real second model
    rows = {(r["id"], r["mode"]): r for r in payload["rows"]}
    for qid in {r["id"] for r in payload["rows"]}:
        assert rows[qid, "full@float32"]["token_ids"] == rows[qid, "full"]["token_ids"]
        assert rows[qid, "full@float32"]["delta_nll"] == pytest.approx(0.0, abs=1e-6)
        assert rows[qid, "full@bfloat16"]["delta_nll"] != 0.0
    assert summary["full@float32"]["recompute_fraction"] == summary["full@bfloat16"]["recompute_fraction"] == 1.0
    assert summary["full@float32"]["abs_delta_nll"] == pytest.approx(0.0, abs=1e-6)
    assert summary["full@bfloat16"]["abs_delta_nll"] == pytest.approx(
        sum(abs(rows[q, "full@bfloat16"]["delta_nll"]) for q in {r["id"] for r in payload["rows"]}) / 3)
    # the oracle recomputes half the chunk tokens (from the second passage on) over the stored caches
    assert summary["reuse"]["recompute_fraction"] < summary["oracle@0.5"]["recompute_fraction"] < 1.0
    full = summary["full"]
    assert full["agreement"] == 1.0 and full["delta_nll"] == 0.0 and full["ttft_speedup"] == pytest.approx(1.0)
    for row in payload["rows"]:
        assert 0.0 <= row["f1"] <= 1.0 and 0.0 <= row["agreement"] <= 1.0 and row["ttft_s"] > 0
        assert 0.0 < row["recompute_fraction"] <= 1.0
    # question-by-question comparisons with reuse and with the precision floor
    pairs = {(p["mode"], p["baseline"]): p for p in payload["paired"]}
    assert set(pairs) == {(m, b) for b in ("reuse", "full@bfloat16") for m in summary if m not in (b, "full")}
    for (mode, base), p in pairs.items():
        diffs = [rows[q, mode]["agreement"] - rows[q, base]["agreement"] for q in {r["id"] for r in payload["rows"]}]
        assert p["n"] == 3 and p["agreement_diff"] == pytest.approx(sum(diffs) / 3)
        lo, hi = p["agreement_diff_ci"]
        assert min(diffs) - 1e-9 <= lo <= p["agreement_diff"] <= hi <= max(diffs) + 1e-9
        assert p["separated"] is None  # three questions are too few for a verdict
    lo, hi = summary["full"]["agreement_ci"]
    assert lo == hi == 1.0
    assert "against a baseline mode" in (out / "quality.md").read_text()


def test_bench_codec_answer_effect_tiny(tmp_path: Path, tiny_model_dir: Path) -> None:
    from kvrag import KVRag, SplitConfig
    from kvrag.bench.qa_data import load_questions, passage_documents

    data = _qa_file(tmp_path / "q.jsonl")
    split = SplitConfig(mode="document", max_tokens=2048, min_tokens=0)
    KVRag.build(passage_documents(load_questions(data, 3)), tmp_path / "idx", model=str(tiny_model_dir),
                split=split, device="cpu", show_progress=False).close()
    out = tmp_path / "out"
    rc = main(["bench", "codec", "--index", str(tmp_path / "idx"), "--codecs", "raw,int8,cachegen", "--levels",
               "0,1", "--fit-chunks", "2", "--n-chunks", "3", "--repeats", "1", "--qa", str(data), "--qa-n", "2",
               "--max-new-tokens", "4", "--json", str(out / "codec.json"), "--markdown", str(out / "codec.md")])
    assert rc == 0
    payload = json.loads((out / "codec.json").read_text())
    effect = payload["answer_effect"]
    assert effect["questions"] == 2 and effect["modes"] == ["reuse", "cacheblend@0.15"]
    assert effect["fit_chunks_in_qa"] == 1  # 5 chunks, 4 of them the two questions' passages
    summary = {(r["codec"], r["level"], r["mode"]): r for r in effect["summary"]}
    variants = [("uncompressed", None), ("raw", 0), ("int8", 0), ("cachegen", 0), ("cachegen", 1)]
    assert list(summary) == [(c, lv, m) for c, lv in variants for m in effect["modes"]]
    assert len(effect["rows"]) == 2 * len(summary) and all(r["n"] == 2 for r in summary.values())
    for (codec, level, mode), r in summary.items():
        for key in ("first_token_agreement", "agreement", "identical", "first_token_agreement_full", "agreement_full"):
            assert 0.0 <= r[key] <= 1.0, (codec, level, mode, key)
        assert r["nll"] > 0 and r["payload_bits_per_element"] > 0
        if codec in ("uncompressed", "raw"):  # lossless: the very same answers and scores
            assert r["first_token_agreement"] == r["agreement"] == r["identical"] == 1.0 and r["delta_nll"] == 0.0
            assert r["agreement_full"] == summary["uncompressed", None, mode]["agreement_full"]
    assert summary["cachegen", 0, "reuse"]["payload_bits_per_element"] < summary["raw", 0, "reuse"][
        "payload_bits_per_element"]
    md = (out / "codec.md").read_text()
    assert "## Effect on answers" in md and "| cachegen | 1 | cacheblend@0.15 |" in md
    assert main(["bench", "codec", "--index", str(tmp_path / "idx"), "--qa", str(data), "--qa-modes", "full"]) == 2


def test_deviation_helpers_on_known_values() -> None:
    top_overlap, top_share = _script("deviation").top_overlap, _script("deviation").top_share

    dev = torch.tensor([8.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert top_share(dev, 0.1) == pytest.approx(0.8)
    assert top_share(dev, 0.25) == pytest.approx(1.0)  # ceil(2.5) = 3 entries
    assert top_share(torch.zeros(4), 0.5) == 0.0
    truth = torch.arange(10.0)
    assert top_overlap(truth, truth, 0.2) == 1.0
    assert top_overlap(-truth, truth, 0.2) == 0.0
    assert top_overlap(torch.tensor([9.0, 0, 0, 0, 0, 0, 0, 0, 0, 8]), truth, 0.2) == 0.5


def test_bench_deviation_tiny(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = _qa_file(tmp_path / "q.jsonl")
    out = tmp_path / "out"
    deviation = _script("deviation").main
    rc = deviation(["--data", str(data), "--model", str(tiny_model_dir), "--n", "2",
                    "--neutral-passages", "2", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    payload = json.loads((out / "deviation.json").read_text())
    assert {"command", "hardware", "versions", "date"} <= payload.keys()
    assert (out / "deviation_layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Per layer" in (out / "deviation.md").read_text()
    s = payload["summary"]
    assert payload["n_questions"] == 2 and payload["neutral_tokens"] > 0
    # Layer 0's K/V depend on the token alone: stored and full-prefill rows agree there (this also checks
    # that positions and the RoPE inverse line up); deeper layers see the missing context.
    assert s["k_energy"][0] < 1e-9 and s["v_energy"][0] < 1e-9
    assert max(s["k_energy"][1:]) > 1e-6 and max(s["v_energy"][1:]) > 1e-6
    assert s["neutral_k_energy"][0] < 1e-9 and len(s["neutral_v_energy"]) == len(s["v_energy"])
    shares = [s["concentration"][r] for r in ("0.05", "0.15", "0.25", "0.5")]
    assert shares == sorted(shares) and shares[-1] <= 1.0 + 1e-9
    assert all(share >= ratio - 1e-9 for share, ratio in zip(shares, (0.05, 0.15, 0.25, 0.5)))  # top r hold >= r
    assert all(0.0 <= o <= 1.0 for o in s["ranking_by_layer"])
    assert any(r is not None and r > 0 for r in s["offset_relative"])
    # by place in the prompt: one value per chunk after the first, token-weighted back to the overall mean
    places = s["prompt_position_relative"]
    counts = [sum(row["chunk_n"][j] for row in payload["rows"] if j < len(row["chunk_n"])) for j in range(len(places))]
    assert len(places) == max(len(row["chunk_n"]) for row in payload["rows"]) >= 2
    assert sum(r * c for r, c in zip(places, counts)) / sum(counts) == pytest.approx(1.0, rel=1e-6)
    assert "## Position in the prompt" in (out / "deviation.md").read_text()
    with pytest.raises(ValueError, match="--neutral-passages 1: the file has only 0 passages"):
        deviation(["--data", str(data), "--model", str(tiny_model_dir), "--n", "3", "--neutral-passages", "1",
                   "--out", str(out)])


def test_oracle_picks_the_tokens_whose_stored_cache_deviates_most(tmp_path: Path, tiny_model_dir: Path) -> None:
    from kvrag.bench.qa_data import build_index, load_questions

    oracle_positions = _script("deviation").oracle_positions
    items = load_questions(_qa_file(tmp_path / "q.jsonl"), 1)
    args = argparse.Namespace(model=str(tiny_model_dir), device="cpu", max_chunk_tokens=2048)
    rag, _ = build_index(args, items, tmp_path / "idx")
    with rag:
        chunks = rag.resolve_chunks(passage_keys(rag, items[0]))
        lens = [len(chunk_token_ids(rag.lm.tokenizer, c.text)) for c in chunks]
        load = rag.load_chunk
        spoiled = {chunks[1].key: [1, 4], chunks[2].key: [0]}  # token offsets whose values are thrown off

        def load_spoiled(chunk):
            keys, values = load(chunk)
            values = values.clone()
            values[:, :, spoiled.get(chunk.key, [])] += 100.0
            return keys, values

        rag.load_chunk = load_spoiled
        ratio = 3 / sum(lens) - 1e-6  # three tokens
        picked = sorted(oracle_positions(rag, items[0], ratio).tolist())
    second = rag.prefix.length + lens[0]
    assert picked == [second + 1, second + 4, second + lens[1]]


def test_departures_script_on_a_tiny_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    from kvrag.bench.metrics import departure

    data, out, index = _qa_file(tmp_path / "q.jsonl"), tmp_path / "out", tmp_path / "idx"
    rc = main(["bench", "quality", "--data", str(data), "--model", str(tiny_model_dir), "--n", "3", "--modes",
               "full,reuse,attnlink@1", "--max-new-tokens", "6", "--warmup", "0", "--device", "cpu",
               "--index", str(index), "--out", str(out)])
    assert rc == 0
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "departures.py"
    result, again = tmp_path / "departures.json", tmp_path / "again.json"
    again.write_text((out / "quality.json").read_text())  # a second run with the same full answers
    subprocess.run([sys.executable, str(script), "--quality", str(out / "quality.json"), str(again), "--index",
                    str(index), "--threads", "1", "--out", str(result)], check=True, capture_output=True)
    payload = json.loads(result.read_text())
    run = json.loads((out / "quality.json").read_text())
    full = {r["id"]: r["token_ids"] for r in run["rows"] if r["mode"] == "full"}
    expected = {(r["id"], r["mode"]): departure(r["token_ids"], full[r["id"]])
                for r in run["rows"] if r["mode"] != "full"}
    for path in (out / "quality.json", again):
        rows = [r for r in payload["rows"] if r["run"] == str(path)]
        assert {(r["id"], r["mode"]): r["step"] for r in rows} == expected
    margins = [r["margin"] for r in payload["rows"] if r["margin"] is not None]
    assert margins  # the random model's stale caches do change some answers
    assert min(margins) >= -1e-4  # full's greedy token is its own argmax: it never prefers the other one
    first = {s["mode"]: s for s in payload["summary"] if s["run"] == str(out / "quality.json")}
    assert list(first) == ["reuse", "attnlink@1"] and len(payload["summary"]) == 4
    assert first["reuse"]["departures"] == sum(s is not None for (_, mode), s in expected.items() if mode == "reuse")
    assert result.with_suffix(".md").read_text().count("\n|") >= 6
    # the paired comparison of the same run, alone and pooled with its copy (each question counted once)
    paired = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "paired.py"
    for extra in ([], ["--pool"]):
        shown = subprocess.run([sys.executable, str(paired), str(out / "quality.json"), str(again), *extra],
                               check=True, capture_output=True, text=True).stdout
        assert shown.count("| attnlink@1 | reuse | 3 |") == (1 if extra else 2)
        # each mode on its own first: its questions and its agreement as the run summarised it
        agreement = next(s["agreement"] for s in run["summary"] if s["mode"] == "attnlink@1")
        assert shown.count(f"| attnlink@1 | 3 | {agreement:.3f} | [") == (1 if extra else 2)


def _script(name: str) -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pool_documents_reads_qa_and_corpus_files_each_text_once(tmp_path: Path) -> None:
    from kvrag.bench.qa_data import passage_text, pool_documents

    qa = _qa_file(tmp_path / "q.jsonl")
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([{"title": "Tides", "text": "Delta works on tides."},
                                  {"title": "Records", "text": "The records were lost in 1998."},
                                  {"text": "Untitled passage."}]))
    exclude = {passage_text({"title": "Meeting", "text": "Dr. Smith arrived in Washington at 5 p.m. on Monday."})}
    docs = pool_documents([qa, corpus], exclude)
    texts = [t for _, t in docs]
    # 3 distinct "She met..." texts, Records once (QA file and corpus), Tides, the untitled one; Meeting left out
    assert len(texts) == len(set(texts)) == 6
    assert texts.count("Records\nThe records were lost in 1998.") == 1 and not exclude & set(texts)
    assert "Tides\nDelta works on tides." in texts and "Untitled passage." in texts
    assert docs[-1][0] == "pool/corpus/2"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"text": "not a list"}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        pool_documents([bad], set())
    bad.write_text(json.dumps([{"title": "no text"}]))
    with pytest.raises(ValueError, match="passage 0 has no text"):
        pool_documents([bad], set())


def test_bench_quality_with_a_neighbour_pool(tmp_path: Path, tiny_model_dir: Path) -> None:
    from kvrag import KVRag

    data, out, index = _qa_file(tmp_path / "q.jsonl"), tmp_path / "out", tmp_path / "idx"
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([{"title": "Smith", "text": f"Dr. Smith met Mr. Jones in London {i}."}
                                  for i in range(4)]))
    rc = main(["bench", "quality", "--data", str(data), "--model", str(tiny_model_dir), "--n", "2", "--modes",
               "full,reuse", "--max-new-tokens", "2", "--warmup", "0", "--device", "cpu", "--neighbour-context", "2",
               "--neighbour-pool", f"{data},{corpus}", "--question-tail", "Be brief.", "--index", str(index),
               "--out", str(out)])
    assert rc == 0
    payload = json.loads((out / "quality.json").read_text())
    assert payload["question_tail"] == "Be brief."
    assert "after each question: 'Be brief.'" in (out / "quality.md").read_text()
    # the two questions' 4 distinct passages, and the pool: the third question's own passage and the corpus
    assert payload["index_chunks"] == 4 + 1 + 4 and payload["neighbour_pool"] == [str(data), str(corpus)]
    assert "among 9 indexed passages" in (out / "quality.md").read_text()
    with KVRag.open(index) as rag:
        assert rag.layout.question_tail == "Be brief."
        cached = {r.text for r in rag.index.records() if rag.kvstore.contains(r.key)}
    assert cached == {"Meeting\nDr. Smith arrived in Washington at 5 p.m. on Monday.",
                      "She met Mr. Jones, who had travelled from London 0.",
                      "She met Mr. Jones, who had travelled from London 1.",
                      "Records\nThe records were lost in 1998."}


def test_paired_across_two_runs_of_the_same_questions() -> None:
    across = _script("paired").across

    def row(qid: str, mode: str, agreement: float, delta: float, answer: str) -> dict[str, Any]:
        return {"id": qid, "mode": mode, "agreement": agreement, "delta_nll": delta, "answer": answer}

    before = [row("a", "full", 1, 0, "x"), row("a", "reuse", 0.5, 0.2, "y"), row("b", "reuse", 1.0, -0.1, "x"),
              row("a", "probe@0.15", 1.0, 0.0, "x")]
    after = [row("a", "full", 1, 0, "x"), row("a", "reuse", 0.7, -0.1, "z"), row("b", "reuse", 1.0, 0.3, "x"),
             row("c", "reuse", 0.0, 1.0, "w"), row("b", "probe@0.15", 0.0, 0.0, "q")]
    table = across(before, after)
    # reuse on a and b (c is not in the first run): agreement +0.2 and 0, |ΔNLL| -0.1 and +0.2; one answer changed
    assert [r[0] for r in table] == ["reuse"]  # full is the reference; probe@0.15 shares no question
    mode, n, agree, _, closer, _, changed = table[0]
    assert (mode, n, agree, closer, changed) == ("reuse", 2, "+0.100", "+0.0500", 1)


def test_bench_speed_adaptive_rows_carry_the_plans_predictions(tmp_path: Path) -> None:
    args = ["bench", "speed", "--arch", "tiny", "--lengths", "128", "--chunk-tokens", "32", "--modes",
            "full,reuse,reuse+adaptive", "--repeats", "2", "--device", "cpu", "--tiers", "disk",
            "--store-mbps", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    payload = json.loads((tmp_path / "speed.json").read_text())
    assert payload["store_mbps"] == 2
    rows = {r["mode"]: r for r in payload["results"]}
    assert "plan_load_ms_all" not in rows["reuse"]
    adaptive = rows["reuse+adaptive"]
    for key in ("plan_load_ms_all", "plan_recompute_ms_all", "decode_ms_all", "fuse_ms_all"):
        assert len(adaptive[key]) == 2
    # `reuse` was measured first (warm-up), so every timed plan predicted something
    assert all(math.isfinite(v) and v > 0 for v in adaptive["plan_recompute_ms_all"])
    assert all(math.isfinite(v) and v >= 0 for v in adaptive["plan_load_ms_all"])  # 0: every chunk from text


def test_bench_build_tiny(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The build's cache phase against the plain prefill of the same chunks, per codec."""
    data = _qa_file(tmp_path / "q.jsonl")
    out = tmp_path / "out"
    rc = main(["bench", "build", "--data", str(data), "--model", str(tiny_model_dir), "--n", "3", "--fit", "1",
               "--codecs", "raw,cachegen", "--repeats", "2", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    payload = json.loads((out / "build.json").read_text())
    rows = {r["codec"]: r for r in payload["rows"]}
    assert list(rows) == ["raw", "cachegen"]
    for row in rows.values():
        assert row["chunks"] == 2  # the two passages of questions 2 and 3 that the warm-up index lacks
        assert row["tokens"] == row["plain_tokens"] > 0
        assert row["plain_tok_s"] > 0 and row["build_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["build_tok_s"] / row["plain_tok_s"])
    assert 0 < rows["cachegen"]["stored_MB"] < rows["raw"]["stored_MB"]
    assert "build / plain" in (out / "build.md").read_text()
    assert main(["bench", "build", "--data", str(data), "--model", str(tiny_model_dir), "--n", "3", "--fit", "3"]) != 0
