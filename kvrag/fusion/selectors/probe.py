"""``probe``: a question-only pass over the stored caches, then recompute the chunk tokens it read most.

Reads ``ratio`` from `FuseConfig`, and its options ``probe_from`` and ``probe_to``. The layer loop
(`kvrag.fusion.loop`) runs the probe pass and hands `ProbeSelector.choose` the suffix's summed attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.config import FuseConfig
    from kvrag.fusion.inputs import Segments


@register_selector("probe")
class ProbeSelector(Selector):
    """Question probe: recompute the chunk tokens the question reads most.

    A first pass runs only the forced tokens (the question suffix, chunks without cache) over the
    stored caches, as ``reuse`` does, and sums the attention the suffix puts on every position over
    the layers from ``int(probe_from * n_layers)`` up to ``ceil(probe_to * n_layers)`` (all of them by default;
    the probe pass stops there). The ``ratio`` of chunk tokens it attends to
    most, taken from the stale chunks (`Segments.stale`: those after the first), are then
    recomputed through every layer together with the forced tokens. The stored caches deviate
    little in the lowest layers, where HKVD checks, and most in the upper ones, spread over many
    tokens; the question's own reading of those layers tells which of the stale rows the answer
    depends on.

    Args:
        config: the fusion settings (``ratio``, the options ``probe_from`` and ``probe_to``).
    """

    @dataclass(frozen=True)
    class Options:
        """``probe_from``: the suffix's attention is summed over the layers from ``int(probe_from * n_layers)`` up
        (0 sums every layer), in [0, 1); ``probe_to``: the probe pass stops before layer ``ceil(probe_to *
        n_layers)`` (at least one layer after ``probe_from``'s), in (``probe_from``, 1]. Below 1 the probe pass
        costs that share of a pass and gives no first token (`FusionResult.probe_logits` is None).
        """

        probe_from: float = 0.33
        probe_to: float = 1.0

        def __post_init__(self) -> None:
            if not (isinstance(self.probe_from, (int, float)) and 0.0 <= self.probe_from < 1.0):
                raise ValueError(f"probe_from must be in [0, 1), got {self.probe_from!r}")
            if not (isinstance(self.probe_to, (int, float)) and self.probe_from < self.probe_to <= 1.0):
                raise ValueError(f"probe_to must be in (probe_from, 1], got {self.probe_to!r}")

    value_field, option_field = "ratio", "probe_from"
    scales_with_ratio = True
    loads_before_main_pass = True

    def __init__(self, config: FuseConfig) -> None:
        self.ratio = float(config.ratio)
        options = self.options(config)
        self.from_fraction, self.to_fraction = float(options.probe_from), float(options.probe_to)
        self.attention: torch.Tensor | None = None  # the last probe's reading (`choose`)
        self.picked: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: FuseConfig) -> ProbeSelector:
        return cls(config)

    def initial(self, seg: Segments) -> torch.Tensor:
        return seg.forced.clone()  # bool [N]

    def probe_from(self, seg: Segments, n_layers: int) -> int | None:
        return self._first_read(n_layers) if self.candidates(seg).numel() else None

    def probe_until(self, n_layers: int) -> int:
        return min(n_layers, max(self._first_read(n_layers) + 1, math.ceil(self.to_fraction * n_layers - 1e-9)))

    def _first_read(self, n_layers: int) -> int:
        """The first layer whose suffix attention the probe sums."""
        return int(self.from_fraction * n_layers)

    @staticmethod
    def candidates(seg: Segments) -> torch.Tensor:
        """Positions the probe may choose: stored tokens of the stale chunks."""
        start = seg.stale_start
        return (~seg.forced[start : seg.suffix_start]).nonzero().squeeze(1) + start

    def choose(self, attention: torch.Tensor, seg: Segments) -> torch.Tensor:
        """Bool mask ``[N]`` of the main pass: forced tokens and the most attended candidates.

        The probe's reading stays on the selector for inspection: ``attention`` (the summed suffix
        attention ``[N]``) and ``picked`` (the candidate positions chosen, most attended first).
        """
        mask = seg.forced.clone()
        candidates = self.candidates(seg)
        keep_n = min(math.ceil(self.ratio * seg.chunk_tokens - 1e-9), int(candidates.numel()))
        self.attention, self.picked = attention, candidates[attention[candidates].topk(keep_n).indices]
        mask[self.picked] = True
        return mask
