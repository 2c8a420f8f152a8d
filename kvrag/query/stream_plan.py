"""The streaming plan: per chunk, which stored level of its codec to fetch, or its text, to meet a TTFT target.

Contract: `stream_plan` tries plans best first — every chunk at its best stored level, then one chunk at a time
one level lower (the last chunks first) until all are at their lowest, then the last chunks from their text —
and takes the first whose estimated TTFT (stored bytes over the link's measured throughput, plus the recompute
a `LoadController` estimates) meets ``ttft_slo``, else the fastest; a prefill of every chunk from its text is
exact and is taken whenever it is estimated sooner. Before any read was measured every chunk loads at the
index's own level. docs/loading.md gives the reasoning (CacheGen §5).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector
from kvrag.query.load_plan import ChunkChoice, LoadPlan, selector_kind
from kvrag.query.shape import FusionShape

if TYPE_CHECKING:
    from kvrag.query.plan import LoadController


def stream_plan(controller: LoadController, mode: str, ratio: float, shape: FusionShape, ttft_slo: float,
                sizes: Sequence[Mapping[int, int]], own_level: int, throughput: float | None,
                kind: type[Selector] | None = None) -> LoadPlan:
    """The streaming plan (see the module docstring): ``sizes`` gives each chunk's stored bytes by level,
    ``throughput`` the link's bytes per second (None: nothing measured yet), ``kind`` ``mode``'s selector class
    when resolved already.
    """
    n = len(shape.chunk_tokens)
    if throughput is None or throughput <= 0:
        own = tuple(ChunkChoice(own_level, int(sizes[j].get(own_level, 0))) for j in range(n))
        return LoadPlan(ratio, (), chunks=own, ttft_slo=ttft_slo, reason="no store throughput measured yet: "
                        "every chunk at the index's own level")
    model, work = controller.recompute_model(), controller.work(mode)
    factor = controller.factor(mode, model)
    per = (work or 0.0) * (ratio if selector_kind(mode, kind).scales_with_ratio else 1.0)

    prefill_s = controller.prefill_s(shape)

    def compute_s(text: tuple[int, ...]) -> float:  # 0 until a fusion was measured: only transfers count
        if prefill_s is not None and len(text) == n:  # nothing loaded: a plain prefill
            return prefill_s
        return 0.0 if model is None else factor * (model[0] + model[1] * shape.units(per, text))

    def plan_of(pick: list[int | None]) -> tuple[float, float, tuple[int, ...]]:
        text = tuple(j for j, lv in enumerate(pick) if lv is None)
        load_s = sum(sizes[j][lv] for j, lv in enumerate(pick) if lv is not None) / throughput
        recompute_s = compute_s(text)
        return load_s + recompute_s, load_s, text

    ladders = [sorted(sizes[j], reverse=True) for j in range(n)]  # each chunk's stored levels, best first
    pick: list[int | None] = [ladder[0] if ladder else None for ladder in ladders]
    steps = [list(pick)]
    while any(lv is not None and ladders[j].index(lv) + 1 < len(ladders[j]) for j, lv in enumerate(pick)):
        for j in reversed(range(n)):  # one level lower for each chunk, the last first
            lv = pick[j]
            if lv is not None and ladders[j].index(lv) + 1 < len(ladders[j]):
                pick[j] = ladders[j][ladders[j].index(lv) + 1]
                steps.append(list(pick))
    for j in reversed(range(n)):  # then from their text, the last first
        if pick[j] is not None:
            pick[j] = None
            steps.append(list(pick))
    scored = [(plan_of(step), step) for step in steps]
    within = [(p, step) for p, step in scored if p[0] <= ttft_slo]
    (ttft, load_s, text), best = within[0] if within else min(scored, key=lambda ps: ps[0][0])
    reason = (f"the best plan estimated within {ttft_slo:g} s" if within else
              f"no plan is estimated within {ttft_slo:g} s: the fastest")
    if n and prefill_s is not None and prefill_s < ttft and any(lv is not None for lv in best):
        (ttft, load_s, text), best = scored[-1]  # every chunk from its text: sooner, and exact
        reason = f"a prefill from the text is estimated sooner ({ttft:.3g} s) than loading any level"
    reason += f" at {throughput / 1e6:.3g} MB/s measured"
    choices = tuple(ChunkChoice(lv, int(sizes[j][lv]) if lv is not None else 0,
                                sizes[j][lv] / throughput if lv is not None else 0.0)
                    for j, lv in enumerate(best))
    recompute_s = ttft - load_s if model is not None else float("nan")
    return LoadPlan(ratio, text, load_s, recompute_s, choices, ttft_slo, throughput, ttft, reason)
