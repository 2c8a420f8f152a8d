"""What a fusion loads and recomputes: the `LoadPlan` that the loading controller (`kvrag.query.plan`) and the
streaming planner (`kvrag.query.stream_plan`) both give, one `ChunkChoice` per chunk of a streaming plan, and
`selector_kind`, a mode's selector class whose traits the planners read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrag.fusion.selectors.base import Selector, selector_class


def selector_kind(mode: str, kind: type[Selector] | None = None) -> type[Selector]:
    """``kind`` where the caller resolved ``mode`` already (an `Attempt`'s), else the selector class ``mode``
    names. Its traits say whether the recompute grows with the ratio (``scales_with_ratio``) and whether the main
    pass starts only once every layer has loaded, so that loading adds to its recompute instead of hiding it
    (``loads_before_main_pass``).
    """
    return kind if kind is not None else selector_class(mode)


@dataclass(frozen=True)
class ChunkChoice:
    """How a streaming plan loads one chunk: at a stored ``level``, or from its text (``level`` None).

    ``nbytes``: its stored size at that level (0 from text); ``transfer_s``: those bytes over the measured
    throughput (NaN when none was measured).
    """

    level: int | None
    nbytes: int = 0
    transfer_s: float = float("nan")

    def to_json(self) -> dict[str, object]:
        """The choice as an answer's JSON reports it."""
        return {"load": "text" if self.level is None else "level", "level": self.level, "bytes": self.nbytes,
                "transfer_s": self.transfer_s}


@dataclass(frozen=True)
class LoadPlan:
    """What a fusion loads and recomputes, and the times the controller expects of it.

    ``from_text``: indices of chunks recomputed from their text instead of loaded. ``load_s`` and
    ``recompute_s`` are NaN when the controller had nothing measured to predict from. A streaming plan
    (`LoadController.stream`) also has ``chunks`` (one `ChunkChoice` per chunk), the ``ttft_slo`` it aimed at,
    the ``throughput`` (bytes/s) it planned with, its estimated ``ttft_s`` and its ``reason``.
    """

    ratio: float
    from_text: tuple[int, ...] = ()
    load_s: float = float("nan")
    recompute_s: float = float("nan")
    chunks: tuple[ChunkChoice, ...] = ()
    ttft_slo: float | None = None
    throughput: float | None = None
    ttft_s: float = float("nan")
    reason: str = ""

    @property
    def levels(self) -> tuple[int | None, ...] | None:
        """Each chunk's level to load (None: the index's own, or from text), or None outside streaming."""
        return tuple(c.level for c in self.chunks) if self.chunks else None

    def to_json(self) -> dict[str, object]:
        """The plan as an answer's JSON reports it (the streaming fields only for a streaming plan)."""
        out: dict[str, object] = {"ratio": self.ratio, "from_text": list(self.from_text), "load_s": self.load_s,
                                  "recompute_s": self.recompute_s}
        if self.ttft_slo is not None:
            out.update(ttft_slo=self.ttft_slo, throughput_bytes_per_s=self.throughput, est_ttft_s=self.ttft_s,
                       reason=self.reason, chunks=[c.to_json() for c in self.chunks])
        return out
