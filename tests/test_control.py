"""The loading controller: estimates, plans, the throttled store, and adaptive fusion end to end."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path

import pytest
import torch

from kvrag import FuseConfig, KVRag, SplitConfig
from kvrag.bench.common import parse_mode
from kvrag.codec.base import make_codec
from kvrag.query.plan import LoadController, LoadPlan
from kvrag.query.shape import fusion_shape, half_cost_keys, prompt_shape
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import MemoryStore, ThrottledStore

SHAPE = fusion_shape([100, 100, 100, 100], suffix_tokens=20, n_layers=10)


def primed(load_rate: float, c: float, mode: str = "cacheblend", ratio: float = 0.15, work: float = 0.2,
           ceiling: float = 0.5) -> LoadController:
    """A controller that has seen one fusion of ``mode``: ``work`` token-layers per stale token and layer,
    ``c`` seconds per token-layer, chunks loaded at ``load_rate`` tokens/s.
    """
    ctl = LoadController(ceiling=ceiling)
    token_layers = SHAPE.token_layers(work, ())
    ctl.record(mode, ratio, SHAPE, (), token_layers, c * token_layers, 400, 400 / load_rate)
    return ctl


def test_shape_counts_token_layers():
    assert SHAPE.stale == (False, True, True, True)
    assert SHAPE.token_layers(0.0, ()) == 10 * 20
    assert SHAPE.token_layers(0.5, ()) == 10 * (20 + 0.5 * 300)
    # a chunk from text runs through every layer and is no longer a loaded stale chunk
    assert SHAPE.token_layers(0.5, (3,)) == 10 * (20 + 100 + 0.5 * 200)
    assert SHAPE.loaded_tokens((2, 3)) == 200
    assert fusion_shape([5, 5], 1, 2, first_exact=False).stale == (True, True)


def brute_units(shape, work: float, from_text: tuple[int, ...]) -> float:
    """`FusionShape.units` position by position."""
    def weight(p: int) -> float:
        keys = p + 1 if shape.window is None else min(p + 1, shape.window)
        return 1 + keys / shape.half_cost_keys

    total, pos = 0.0, shape.prefix_tokens
    for j, n in enumerate(shape.chunk_tokens):
        share = 1.0 if j in from_text else work if shape.stale[j] else 0.0
        total += share * sum(weight(p) for p in range(pos, pos + n))
        pos += n
    total += sum(weight(p) for p in range(pos, pos + shape.suffix_tokens))
    return shape.n_layers * total


@pytest.mark.parametrize("window", [None, 150, 7])
def test_units_weigh_each_token_by_the_keys_it_reads(window):
    shape = fusion_shape([100, 60, 100], suffix_tokens=20, n_layers=3, prefix_tokens=12, half_cost_keys=50.0,
                         window=window)
    for work, text in ((0.0, ()), (0.3, ()), (0.3, (2,)), (1.0, (1, 2))):
        assert shape.units(work, text) == pytest.approx(brute_units(shape, work, text))
    if window is None:  # a chunk from text at the end costs more than the same chunk at the start
        assert shape.units(0.0, (2,)) - shape.units(0.0, ()) > shape.units(0.0, (0,)) - shape.units(0.0, ())
    # without the weighting, units are token-layers
    assert SHAPE.units(0.4, (3,)) == SHAPE.token_layers(0.4, (3,))


def test_half_cost_keys_counts_the_layer_flops(tiny_lm):
    cfg = tiny_lm.model.config
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * cfg.intermediate_size + 2 * h  # q, o; k, v; mlp; norms
    bias = sum(p.numel() for n, p in tiny_lm.model.model.layers[0].named_parameters() if n.endswith("bias"))
    assert half_cost_keys(tiny_lm.model) == pytest.approx((layer + bias) / (2 * heads * d))
    shape = prompt_shape(tiny_lm, [10, 10], 4, prefix_tokens=6)
    assert shape.half_cost_keys == half_cost_keys(tiny_lm.model) and shape.prefix_tokens == 6


def test_recompute_cost_of_a_longer_prompt_follows_its_attention():
    # fusions whose time is 1e-4 s per unit (K = 500 keys) at one length, then a plan for a prompt twice as long
    def shape(n_chunks: int):
        return fusion_shape([250] * n_chunks, 20, 4, prefix_tokens=10, half_cost_keys=500.0)

    short, long = shape(4), shape(8)
    ctl = LoadController()
    for work in (0.2, 1.0):
        tl = short.token_layers(work, ())
        ctl.record("reuse", 0.15, short, (), tl, 1e-4 * short.units(work, ()), 1000, 0.01)
    ctl.record("reuse", 0.15, short, (), short.token_layers(0.0, ()), 1e-4 * short.units(0.0, ()), 1000, 0.01)
    a, c = ctl.recompute_model()
    assert a == pytest.approx(0.0, abs=1e-9) and c == pytest.approx(1e-4)
    plan = ctl.plan("reuse", 0.15, long)
    assert plan.recompute_s == pytest.approx(1e-4 * long.units(0.0, ()), rel=1e-6)
    # seconds per token-layer at the short length would underrate the long prompt by more than a tenth
    per_token_layer = 1e-4 * short.units(0.0, ()) / short.token_layers(0.0, ())
    assert per_token_layer * long.token_layers(0.0, ()) < 0.9 * plan.recompute_s


def test_nothing_measured_changes_nothing():
    plan = LoadController().plan("cacheblend", 0.15, SHAPE)
    assert plan == LoadPlan(0.15) and math.isnan(plan.load_s)
    # a mode not yet measured has no work estimate either
    assert primed(1e3, 1e-4, mode="reuse").plan("cacheblend", 0.15, SHAPE).from_text == ()


def test_fast_loading_keeps_the_plan():
    ctl = primed(load_rate=1e9, c=1e-4)
    plan = ctl.plan("cacheblend", 0.15, SHAPE)
    assert plan.from_text == () and plan.ratio == 0.15
    assert plan.load_s < plan.recompute_s


def test_slow_loading_recomputes_the_last_chunks_from_text():
    # recompute: 1e-4 s per token-layer, a chunk through every layer = 0.1 s; loading 400 tokens takes 4 s
    ctl = primed(load_rate=100.0, c=1e-4, mode="reuse", work=0.0)
    plan = ctl.plan("reuse", 0.15, SHAPE)
    assert plan.from_text == (0, 1, 2, 3)  # loading any chunk costs more than recomputing all of them
    ctl = primed(load_rate=1000.0, c=1e-4, mode="reuse", work=0.0)
    plan = ctl.plan("reuse", 0.15, SHAPE)
    assert plan.from_text and plan.from_text == tuple(range(plan.from_text[0], 4))  # a tail
    base = ctl.plan("reuse", 0.15, SHAPE)
    nothing_load, nothing_recompute = 0.4, ctl.recompute_model()[1] * SHAPE.token_layers(0.0, ())
    assert max(base.load_s, base.recompute_s) < max(nothing_load, nothing_recompute)
    assert plan.ratio == 0.15  # the tail is recomputed instead; the ratio stays


def test_loading_that_hides_more_raises_the_ratio_up_to_the_ceiling():
    c, work = 1e-4, 0.2 / 0.15
    stale_per_ratio = c * 10 * work * 300  # seconds per unit of ratio
    base = c * 10 * 20
    # loading takes as long as recomputing at ratio 0.3: the plan raises 0.15 to about 0.3
    load_s = base + 0.3 * stale_per_ratio
    ctl = primed(load_rate=400 / load_s, c=c, work=0.2)
    plan = ctl.plan("cacheblend", 0.15, SHAPE)
    assert plan.from_text == () and plan.ratio == pytest.approx(0.3, rel=1e-6)
    assert plan.recompute_s == pytest.approx(plan.load_s, rel=1e-6)
    capped = primed(load_rate=400 / load_s, c=c, work=0.2, ceiling=0.25).plan("cacheblend", 0.15, SHAPE)
    assert capped.from_text == () and capped.ratio == 0.25
    # modes without a ratio never change it
    assert primed(load_rate=400 / load_s, c=c, mode="attnlink").plan("attnlink", 0.15, SHAPE).ratio == 0.15


def test_recompute_model_fits_the_per_fusion_cost():
    ctl = LoadController()
    for x in (1e3, 4e3, 1e4):
        ctl.record("reuse", 0.15, SHAPE, (), x, 0.05 + 2e-5 * x, 0, 0.0)
    a, c = ctl.recompute_model()
    assert a == pytest.approx(0.05) and c == pytest.approx(2e-5)
    assert ctl.load_rate is None  # nothing was loaded
    with pytest.raises(ValueError, match="ceiling"):
        LoadController(ceiling=0.0)


def test_each_mode_plans_with_its_own_cost_per_unit():
    # reuse measured at 1e-4 s per unit, cacheblend at 2e-4 (its check layers): one fit, scaled per mode
    ctl = LoadController()
    for mode, work, per_unit in (("reuse", 0.0, 1e-4), ("cacheblend", 0.2, 2e-4)):
        tl = SHAPE.token_layers(work, ())
        ctl.record(mode, 0.15, SHAPE, (), tl, per_unit * SHAPE.units(work, ()), 400, 1e-6)  # loads hidden
    assert ctl.mode_factor("reuse") < 1 < ctl.mode_factor("cacheblend")
    assert ctl.mode_factor("attnlink") == 1.0  # not measured: the shared fit
    assert ctl.plan("reuse", 0.15, SHAPE).recompute_s == pytest.approx(1e-4 * SHAPE.units(0.0, ()))
    assert ctl.plan("cacheblend", 0.15, SHAPE).recompute_s == pytest.approx(2e-4 * SHAPE.units(0.2, ()))


def test_load_rate_is_the_harmonic_mean_of_recent_fusions():
    ctl = LoadController(window=2)
    for rate in (1.0, 100.0, 200.0, 400.0):
        ctl.record("reuse", 0.15, SHAPE, (), 1.0, 1.0, 400, 400 / rate)
    assert ctl.load_rate == pytest.approx(2 / (1 / 200 + 1 / 400))


def test_throttled_store_reads_the_same_bytes_no_faster_than_its_link():
    inner = MemoryStore()
    kv = KVStore(inner, make_codec("raw"), "fp")
    keys, values = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8)
    kv.put("ab12", keys, values)
    size = inner.nbytes("ab12")
    slow = KVStore(ThrottledStore(inner, bytes_per_s=size * 10), kv.codec, "fp")
    t0 = time.perf_counter()
    got = slow.load("ab12")
    assert time.perf_counter() - t0 >= 0.09  # the whole file crossed a link of size*10 bytes/s
    assert torch.equal(got[0], keys) and torch.equal(got[1], values)
    fh = ThrottledStore(inner, 1e9).open("ab12")
    assert fh is not None
    with pytest.raises(io.UnsupportedOperation):
        fh.fileno()  # readers must take the buffered path, which is the one throttled
    assert ThrottledStore(inner, 1e9).open("ffff") is None
    with pytest.raises(ValueError, match="bytes_per_s"):
        ThrottledStore(inner, 0)


def test_adaptive_mode_spec():
    spec = parse_mode("probe@0.2+adaptive")
    assert spec.label == "probe@0.2+adaptive" and spec.config.adaptive and spec.config.ratio == 0.2
    for bad in ("full+adaptive", "reuse+fast", "oracle@0.15+adaptive"):
        with pytest.raises(ValueError):
            parse_mode(bad)


DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987.\n\nIt runs on molten salt."),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes."),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay."),
    ("delta", "The delta of a river is where it meets the sea. Sediment builds up there."),
]


def test_adaptive_fusion_from_a_slow_store_recomputes_the_tail_from_text(tiny_model_dir: Path, tiny_lm,
                                                                          tmp_path: Path):
    path = tmp_path / "idx"
    KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(max_tokens=48, min_tokens=8),
                show_progress=False)
    rag = KVRag.open(path, model=tiny_lm)
    chunks = [c.key for c in rag.retrieve("Who commands beta station?", k=4)]
    q = "Who commands beta station?"
    nbytes = sum(rag.kvstore.nbytes(k) for k in chunks)
    # 2 s for the chunks: far above their recompute even on a busy machine, so the plan cannot go either way
    rag.kvstore.store = ThrottledStore(rag.kvstore.store, bytes_per_s=nbytes / 2.0)
    fixed = rag.answer(q, chunks=chunks, mode="reuse", max_new_tokens=4)  # measured, not planned
    assert fixed.load_plan is None and rag.controller.load_rate is not None
    adaptive = rag.answer(q, chunks=chunks, max_new_tokens=4, fuse_config=FuseConfig(mode="reuse", adaptive=True))
    plan = adaptive.load_plan
    assert plan is not None and plan.from_text == tuple(range(plan.from_text[0], 4))
    assert adaptive.recompute_fraction > fixed.recompute_fraction
    assert adaptive.to_json()["load_plan"]["from_text"] == list(plan.from_text)
    # the same fusion with those chunks given no cache: the plan only decides what is loaded
    caches = [None if j in plan.from_text else rag.kvstore.load(k) for j, k in enumerate(chunks)]
    by_hand = rag.answer(q, chunks=chunks, mode="reuse", max_new_tokens=4, caches=caches)
    assert by_hand.token_ids == adaptive.token_ids


def test_probe_waits_for_its_layers_so_loading_never_hides_its_recompute():
    c, work = 1e-4, 0.2
    load_s = c * 10 * 20 + 0.3 * c * 10 * (work / 0.15) * 300  # what raised cacheblend to 0.3 above
    plan = primed(load_rate=400 / load_s, c=c, mode="probe", work=work).plan("probe", 0.15, SHAPE)
    assert plan.ratio == 0.15
    # loading + recompute: a chunk from text (0.1 s here) is worth it once its load (0.25 of load_s) is longer
    slow = primed(load_rate=400 / 1.0, c=c, mode="probe", work=work).plan("probe", 0.15, SHAPE)
    assert slow.from_text and slow.ratio == 0.15
