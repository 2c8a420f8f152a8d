"""The loading controller: how much to recompute, and which chunks to recompute from their text.

Contract: a `LoadController` takes in each fusion's measurements (`observe`, `observe_prefill`) and keeps
per-process estimates of the load throughput, the recompute time as ``a + c · units`` and each mode's work.
`plan` gives a `LoadPlan` (`kvrag.query.load_plan`) for one fusion: the chunks recomputed from their text (last
first) and the ratio, never below the one asked for; `stream` gives the streaming plan (`kvrag.query.stream_plan`);
`adapt` applies whichever the `FuseConfig` asks for. Until a mode has been measured, plans change nothing. The
reasoning and the estimators are described in docs/loading.md.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from kvrag.fusion.selectors.base import Selector
from kvrag.query.attempt import Attempt
from kvrag.query.load_plan import LoadPlan, selector_kind
from kvrag.query.shape import FusionShape
from kvrag.query.stream_plan import stream_plan


class LoadController:
    """Per-process throughput estimates and the plans made from them (see the module docstring).

    Args:
        ceiling: the highest ratio a plan raises ``cacheblend`` to.
        window: how many recent fusions the estimates average over.
    """

    def __init__(self, ceiling: float = 0.5, window: int = 20) -> None:
        if not 0.0 < ceiling <= 1.0:
            raise ValueError(f"ceiling must be in (0, 1], got {ceiling!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.ceiling = ceiling
        self._load_rates: deque[float] = deque(maxlen=window)  # tokens per second of loading
        self._fusions: deque[tuple[str, float, float]] = deque(maxlen=window)  # (mode, units, seconds)
        self._work: dict[str, float] = {}  # mode -> token-layers per stale loaded token per layer (/ ratio)
        self._prefills: deque[tuple[float, float]] = deque(maxlen=window)  # plain prefills: (units, seconds)

    def record(self, mode: str, ratio: float, shape: FusionShape, from_text: Sequence[int],
               token_layers: float, recompute_s: float, loaded_tokens: int, load_busy_s: float,
               kind: type[Selector] | None = None) -> None:
        """Take in one fusion's measurements: the token-layers its loop ran and the time that took
        without waiting for loads, and the tokens loaded from the store with the loader's busy time (``kind``:
        ``mode``'s selector class, when resolved already).
        """
        dense = shape.token_layers(0.0, from_text)
        per_stale = shape.token_layers(1.0, from_text) - dense
        work = max(0.0, token_layers - dense) / per_stale if per_stale > 0 else 0.0
        if per_stale > 0:
            self._work[mode] = work / ratio if selector_kind(mode, kind).scales_with_ratio else work
        if token_layers > 0 and recompute_s > 0:
            # the counted token-layers weighted by where they stand, the stale ones taken as spread evenly
            units = shape.units(work, from_text) * token_layers / shape.token_layers(work, from_text)
            self._fusions.append((mode, units, float(recompute_s)))
        if loaded_tokens > 0 and load_busy_s > 0:
            self._load_rates.append(loaded_tokens / load_busy_s)

    @property
    def load_rate(self) -> float | None:
        """Chunk tokens loaded per second (harmonic mean), or None before any load was measured."""
        return statistics.harmonic_mean(self._load_rates) if self._load_rates else None

    def recompute_model(self) -> tuple[float, float] | None:
        """``(a, c)`` of ``seconds = a + c · units``, or None before any fusion was measured."""
        if not self._fusions:
            return None
        return _fit([x for _, x, _ in self._fusions], [y for _, _, y in self._fusions])

    def mode_factor(self, mode: str) -> float:
        """``mode``'s measured recompute seconds over what `recompute_model` gives for the same fusions
        (1.0 before any fusion of ``mode`` was measured).
        """
        return self.factor(mode, self.recompute_model())

    def work(self, mode: str) -> float | None:
        """``mode``'s measured token-layers per stale loaded token and layer (per unit of ratio where its recompute
        scales with it), or None before a fusion of ``mode`` was measured.
        """
        return self._work.get(mode)

    def factor(self, mode: str, model: tuple[float, float] | None) -> float:
        """`mode_factor` against an already fitted ``model``."""
        own = [(x, y) for m, x, y in self._fusions if m == mode]
        if model is None or not own:
            return 1.0
        a, c = model
        return sum(y for _, y in own) / sum(a + c * x for x, _ in own)

    def adapt(self, attempt: Attempt, shape: FusionShape, kvstore: Any = None,
              keys: Sequence[str | None] | None = None) -> tuple[Attempt, LoadPlan | None]:
        """``attempt`` at its planned ratio and the plan, when its ``config.adaptive``; the streaming plan
        (`stream`) of the chunks ``keys`` in ``kvstore`` (a `KVStore`; None for a piece without a cache, which
        is recomputed from its text) when its ``config.ttft_slo`` is set; else ``attempt`` as it is and None.
        """
        config, kind = attempt.config, attempt.kind
        if config.ttft_slo is not None and kvstore is not None and keys is not None:
            stored = iter(kvstore.level_sizes([k for k in keys if k is not None]))
            sizes = [next(stored) if k is not None else {} for k in keys]
            plan = self.stream(config.mode, config.ratio, shape, config.ttft_slo, sizes,
                               kvstore.codec.level, kvstore.throughput, kind=kind)
            return attempt, plan
        if not config.adaptive:
            return attempt, None
        plan = self.plan(config.mode, config.ratio, shape, kind=kind)
        return attempt.with_ratio(plan.ratio), plan

    def observe_prefill(self, shape: FusionShape, seconds: float) -> None:
        """Take in a plain prefill of every chunk and the suffix (a ``full`` answer) that took ``seconds``."""
        if seconds > 0:
            self._prefills.append((shape.units(0.0, range(len(shape.chunk_tokens))), float(seconds)))

    def prefill_s(self, shape: FusionShape) -> float | None:
        """The estimated seconds of a plain prefill of ``shape``'s chunks and suffix, or None before this process
        measured one (`observe_prefill`).
        """
        if not self._prefills:
            return None
        a, c = _fit([x for x, _ in self._prefills], [y for _, y in self._prefills])
        return a + c * shape.units(0.0, range(len(shape.chunk_tokens)))

    def observe(self, attempt: Attempt, shape: FusionShape, from_text: Sequence[int], n_selected: Sequence[int],
                recompute_s: float, load_busy_s: float) -> None:
        """`record` for a fusion made as ``attempt`` asks (its ratio as planned) that recomputed the chunks
        ``from_text`` instead of loading them: ``n_selected`` its per-layer counts, ``load_busy_s`` the
        loading thread's busy time.
        """
        self.record(attempt.mode, attempt.ratio, shape, from_text, float(sum(n_selected)), recompute_s,
                    shape.loaded_tokens(from_text), load_busy_s, kind=attempt.kind)

    def plan(self, mode: str, ratio: float, shape: FusionShape, kind: type[Selector] | None = None) -> LoadPlan:
        """The plan for one fusion in ``mode`` at ``ratio`` (see the module docstring; ``kind``: ``mode``'s
        selector class, when resolved already).
        """
        model, rate, work = self.recompute_model(), self.load_rate, self._work.get(mode)
        kind = selector_kind(mode, kind)
        if kind.recomputes_all or model is None or rate is None or work is None:
            return LoadPlan(ratio)
        factor = self.factor(mode, model)
        a, c = model[0] * factor, model[1] * factor

        def times(r: float, text: tuple[int, ...]) -> tuple[float, float]:
            per = work * r if kind.scales_with_ratio else work
            return shape.loaded_tokens(text) / rate, a + c * shape.units(per, text)

        def ttft(text: tuple[int, ...]) -> float:
            load_s, recompute_s = times(ratio, text)
            return load_s + recompute_s if kind.loads_before_main_pass else max(load_s, recompute_s)

        # chunks leave the store last first: the recomputed tail is one contiguous run of positions
        candidates = [tuple(range(j, len(shape.chunk_tokens))) for j in range(len(shape.chunk_tokens), -1, -1)]
        best = min(candidates, key=ttft)
        load_s, recompute_s = times(ratio, best)
        if (best or not kind.scales_with_ratio or kind.loads_before_main_pass or load_s <= recompute_s
                or ratio >= self.ceiling):
            return LoadPlan(ratio, best, load_s, recompute_s)
        # loading hides more recompute than the ratio asks for: raise it while it still fits
        base = a + c * shape.units(0.0, ())
        per_ratio = c * (shape.units(work, ()) - shape.units(0.0, ()))
        raised = min(self.ceiling, (load_s - base) / per_ratio) if per_ratio > 0 else self.ceiling
        raised = max(ratio, raised)
        return LoadPlan(raised, (), load_s, times(raised, ())[1])

    def stream(self, mode: str, ratio: float, shape: FusionShape, ttft_slo: float, sizes: Sequence[Mapping[int, int]],
               own_level: int, throughput: float | None, kind: type[Selector] | None = None) -> LoadPlan:
        """The streaming plan (`kvrag.query.stream_plan.stream_plan`) from this controller's estimates."""
        return stream_plan(self, mode, ratio, shape, ttft_slo, sizes, own_level, throughput, kind)


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, c)`` of ``y = a + c · x`` by least squares when the ``xs`` spread enough for it to be meaningful
    (and give ``a >= 0 < c``), else ``(0, sum(ys) / sum(xs))``.
    """
    if len(xs) >= 2 and max(xs) > 1.25 * min(xs):
        c, a = statistics.linear_regression(xs, ys)
        if c > 0 and a >= 0:
            return a, c
    return 0.0, sum(ys) / sum(xs)
