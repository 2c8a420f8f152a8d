"""Bandwidth-adaptive streaming (CacheGen §5): chunks stored at several levels, the level (or the text) picked per
chunk from the store link's measured throughput to meet a TTFT target, and the answers each plan gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvrag import FuseConfig, KVRag, SplitConfig
from kvrag.cli import main
from kvrag.errors import IndexMismatchError
from kvrag.query.plan import LoadController
from kvrag.query.shape import fusion_shape
from kvrag.storage.kvstore import level_key
from kvrag.storage.stores import ThrottledStore

SHAPE = fusion_shape([100, 100, 100, 100], suffix_tokens=20, n_layers=10)
SIZES = [{1: 1000, 2: 1500, 3: 2000}] * 4  # bytes by level, every chunk
DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987.\n\nIt runs on molten salt."),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes."),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay."),
    ("delta", "The delta of a river is where it meets the sea. Sediment builds up there."),
]
Q = "Who commands beta station?"


def _bytes(plan) -> int:
    return sum(c.nbytes for c in plan.chunks)


def test_the_plan_picks_smaller_levels_as_bandwidth_drops_and_text_when_very_low():
    ctl = LoadController()  # nothing measured about the recompute: only the transfers count
    plans = [ctl.stream("reuse", 0.15, SHAPE, 1.0, SIZES, 2, rate) for rate in (1e6, 7e3, 5e3, 3e3, 500)]
    assert [p.levels for p in plans[:3]] == [(3, 3, 3, 3), (3, 3, 2, 2), (2, 2, 1, 1)]  # the last chunks first
    assert plans[3].levels[:3] == (1, 1, 1) and plans[3].levels[3] is None and plans[3].from_text == (3,)
    assert plans[4].levels == (None, None, None, None) and plans[4].from_text == (0, 1, 2, 3)
    assert [_bytes(p) for p in plans] == sorted((_bytes(p) for p in plans), reverse=True)
    for p in plans:
        assert p.ttft_s <= 1.0 and "within 1 s" in p.reason
    first = plans[1].to_json()
    assert first["ttft_slo"] == 1.0 and first["throughput_bytes_per_s"] == 7e3 and first["from_text"] == []
    assert first["chunks"][3] == {"load": "level", "level": 2, "bytes": 1500, "transfer_s": pytest.approx(1.5 / 7)}


def test_text_costs_its_recompute_once_fusions_were_measured():
    ctl = LoadController()
    tl = SHAPE.token_layers(0.0, ())
    ctl.record("reuse", 0.15, SHAPE, (), tl, 1e-3 * tl, 400, 0.01)  # 1 ms a token-layer: 0.2 s, a chunk from text 1 s
    plan = ctl.stream("reuse", 0.15, SHAPE, 2.5, SIZES, 2, 2e3)
    assert plan.levels == (2, 1, 1, 1) and plan.recompute_s == pytest.approx(0.2)  # the recompute counts too
    assert plan.ttft_s == pytest.approx(plan.load_s + plan.recompute_s) == pytest.approx(2.45)
    assert LoadController().stream("reuse", 0.15, SHAPE, 2.5, SIZES, 2, 2e3).levels == (2, 2, 1, 1)
    tight = ctl.stream("reuse", 0.15, SHAPE, 1.5, SIZES, 2, 2e3)  # nothing fits: the fastest, loading
    assert tight.levels == (1, 1, 1, 1) and "no plan" in tight.reason
    slow = ctl.stream("reuse", 0.15, SHAPE, 1.5, SIZES, 2, 500)  # a level-1 chunk takes 2 s, its text 1 s
    assert slow.from_text == (0, 1, 2, 3) and slow.ttft_s == pytest.approx(4.2)


def test_a_prefill_from_the_text_is_taken_when_sooner_than_any_loaded_plan():
    ctl = LoadController()
    assert ctl.prefill_s(SHAPE) is None  # no plain prefill measured yet
    tl = SHAPE.token_layers(0.0, ())
    ctl.record("reuse", 0.15, SHAPE, (), tl, 0.2, 400, 0.01)  # fusions take 0.2 s
    ctl.observe_prefill(SHAPE, 0.6)  # a full answer of the same prompt took 0.6 s
    assert ctl.prefill_s(SHAPE) == pytest.approx(0.6)
    slow = ctl.stream("reuse", 0.15, SHAPE, 2.5, SIZES, 2, 2e3)  # loading (2, 1, 1, 1) would take 2.45 s
    assert slow.from_text == (0, 1, 2, 3) and slow.levels == (None,) * 4
    assert slow.ttft_s == pytest.approx(0.6) and "from the text" in slow.reason
    fast = ctl.stream("reuse", 0.15, SHAPE, 2.5, SIZES, 2, 1e5)  # every chunk at level 3 in 0.28 s: loading wins
    assert fast.levels == (3, 3, 3, 3) and fast.ttft_s == pytest.approx(0.28)


def test_before_any_read_was_measured_every_chunk_loads_at_the_own_level():
    plan = LoadController().stream("reuse", 0.15, SHAPE, 0.5, SIZES, 2, None)
    assert plan.levels == (2, 2, 2, 2) and plan.from_text == () and math.isnan(plan.ttft_s)
    missing = LoadController().stream("reuse", 0.15, SHAPE, 0.5, [{2: 9}, {}, {2: 9}, {2: 9}], 2, 1e9)
    assert missing.levels == (2, None, 2, 2)  # nothing stored for that chunk: from its text
    with pytest.raises(ValueError, match="ttft_slo"):
        FuseConfig(ttft_slo=0)


@pytest.fixture(scope="module")
def streamed(tiny_model_dir: Path, tiny_lm, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("streaming") / "idx"
    KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(max_tokens=48, min_tokens=8),
                show_progress=False, stream_levels=(1, 3)).close()
    rag = KVRag.open(path, model=tiny_lm)
    yield path, rag
    rag.close()


def test_an_index_stores_every_chunk_at_its_stream_levels(streamed, tiny_lm, tmp_path):
    path, rag = streamed
    assert rag.manifest["stream_levels"] == [1, 3] and rag.manifest["codec"]["level"] == 2
    keys = list(rag.index.keys())
    sizes = rag.kvstore.level_sizes(keys)
    assert all(set(s) == {1, 2, 3} and s[1] < s[2] < s[3] for s in sizes)
    assert all(rag.kvstore.store.contains(level_key(k, 3)) for k in keys)
    report = KVRag.verify(path)
    assert report.ok and report.caches_checked == 3 * len(keys)
    with pytest.raises(IndexMismatchError, match="stream levels"):
        KVRag.build(DOCS[:1], path, model=tiny_lm, show_progress=False, stream_levels=(0,))
    with pytest.raises(ValueError, match="offers levels"):
        KVRag.build(DOCS[:1], tmp_path / "other", model=tiny_lm, show_progress=False, stream_levels=(7,))


def test_the_answer_of_each_plan_is_the_one_its_caches_give(streamed):
    _, rag = streamed
    chunks = [c.key for c in rag.retrieve(Q, k=4)]
    sizes = rag.kvstore.level_sizes(chunks)
    top = sum(s[3] for s in sizes)
    inner = rag.kvstore.store
    slow = ThrottledStore(inner, bytes_per_s=1e9)
    rag.kvstore.store = slow
    rag.controller = LoadController()  # no plain prefill measured yet in this process
    try:
        seen = []
        # the link's bandwidth drops: every level fits, then only the smaller ones, then none
        for rate in (top / 0.05, top / 0.6, top / 1.2, 1.0):
            slow.bytes_per_s = rate
            slow.meter.reset()
            slow.meter.record(10_000, 10_000 / rate)  # what earlier reads over this link measured
            answer = rag.answer(Q, chunks=chunks, max_new_tokens=6,
                                fuse_config=FuseConfig(mode="reuse", ttft_slo=0.5))
            plan = answer.load_plan
            assert plan is not None and plan.throughput == pytest.approx(rate, rel=0.05)
            seen.append(plan)
            caches = [None if lv is None else rag.kvstore.load(k, lv) for k, lv in zip(chunks, plan.levels)]
            by_hand = rag.answer(Q, chunks=chunks, mode="reuse", max_new_tokens=6, caches=caches)
            assert answer.token_ids == by_hand.token_ids
        assert seen[0].levels == (3, 3, 3, 3)
        assert all(lv in (1, 2) for lv in seen[1].levels[1:]) and _bytes(seen[1]) < _bytes(seen[0])
        assert _bytes(seen[2]) < _bytes(seen[1]) and seen[2].from_text  # not even level 1 everywhere fits
        assert seen[3].levels == (None,) * 4 and seen[3].from_text == (0, 1, 2, 3)
        # every chunk from its text: the full prefill's answer
        text = rag.answer(Q, chunks=chunks, max_new_tokens=6, fuse_config=FuseConfig(mode="reuse", ttft_slo=0.5))
        full = rag.answer(Q, chunks=chunks, mode="full", max_new_tokens=6)
        assert text.load_plan.from_text == (0, 1, 2, 3) and text.token_ids == full.token_ids
        # once a full answer was measured (milliseconds for this model), it is taken over half a second of loading
        slow.bytes_per_s = top / 0.5
        slow.meter.reset()
        slow.meter.record(10_000, 10_000 / slow.bytes_per_s)
        sooner = rag.answer(Q, chunks=chunks, max_new_tokens=6, fuse_config=FuseConfig(mode="reuse", ttft_slo=0.5))
        assert sooner.load_plan.from_text == (0, 1, 2, 3) and "from the text" in sooner.load_plan.reason
        assert sooner.token_ids == full.token_ids
    finally:
        rag.kvstore.store = inner


def test_ask_prints_the_plan_and_info_the_levels(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS:
        (docs / f"{name}.txt").write_text(text)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "--stream-levels", "1,3",
                 "--split", "fixed", "--max-tokens", "32", "--min-tokens", "4", "-q"]) == 0
    capsys.readouterr()
    assert main(["info", str(idx)]) == 0
    assert "also stored at levels 1, 3" in capsys.readouterr().out
    assert main(["ask", str(idx), Q, "--mode", "reuse", "--ttft-slo", "0.5", "--max-new-tokens", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["load_plan"]
    assert plan["ttft_slo"] == 0.5 and len(plan["chunks"]) == 4
    assert plan["chunks"][0]["load"] == "level" and plan["chunks"][0]["level"] == 2  # a local disk: no link measured
    assert "no store throughput" in plan["reason"]
    assert main(["ask", str(idx), Q, "--ttft-slo", "-1"]) == 2
    assert "expected seconds > 0" in capsys.readouterr().err


def test_a_damaged_level_is_found_by_verify_and_stored_again_by_repair(streamed, tiny_lm):
    from kvrag.repair import repair_index

    path, rag = streamed
    key = next(iter(rag.index.keys()))
    blob = path / "chunks" / key[:2] / f"{level_key(key, 1)}.kvc"
    good = blob.read_bytes()
    blob.write_bytes(good[:-9])  # truncated
    report = KVRag.verify(path)
    assert not report.ok and report.bad_caches == [level_key(key, 1)]
    assert repair_index(path, model=tiny_lm).ok
    assert rag.kvstore.is_valid(key, 1) and rag.kvstore.load(key, 1)[0].shape == rag.kvstore.load(key)[0].shape
