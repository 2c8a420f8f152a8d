"""`Attempt`: one fusion an answer runs, its mode resolved once to the selector class that serves it.

Contract: an entry point turns ``mode``, ``ratio`` and ``fuse_config`` into one `Attempt` (`Attempt.of`: the mode
looked up in the selector registry and its options checked, an unknown one a ValueError there, before any work). The
gate's plan (`kvrag.query.answer_plan.plan_answer`) derives its other attempts from it (`with_ratio` keeps the class,
`exact` is the registry's exact mode), and every later stage reads the class's traits (``recomputes_all``,
``reads_first_chunk_only``, ``scales_with_ratio``, ``loads_before_main_pass``) and builds its selector
(`selector`) from the attempt, never from the mode's name again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrag.config import FuseConfig
from kvrag.fusion.selectors.base import Selector, exact_mode, selector_class


@dataclass(frozen=True)
class Attempt:
    """One fusion: its settings and the selector class ``config.mode`` names."""

    config: FuseConfig
    kind: type[Selector]

    @classmethod
    def of(cls, config: FuseConfig) -> Attempt:
        """The attempt ``config`` asks for; ValueError for an unknown mode or an option its selector does not take."""
        kind = selector_class(config.mode)
        kind.options(config)
        return cls(config, kind)

    @property
    def mode(self) -> str:
        """The mode's registered name."""
        return self.config.mode

    @property
    def ratio(self) -> float:
        """The recompute ratio asked for."""
        return self.config.ratio

    def with_ratio(self, ratio: float) -> Attempt:
        """The same mode at another ratio (the gate's ladder, the loading controller's plan)."""
        return Attempt(replace(self.config, ratio=ratio), self.kind)

    def with_mode(self, mode: str) -> Attempt:
        """The same settings under another mode (the gate's ``short_mode``, ``reuse`` for rows stored in place)."""
        return Attempt.of(replace(self.config, mode=mode))

    def exact(self) -> Attempt:
        """The same settings under the mode that recomputes every position (where escalations end)."""
        return self if self.kind.recomputes_all else self.with_mode(exact_mode())

    def selector(self, given: Selector | None = None) -> Selector:
        """``given``, else the selector this attempt's class builds from its settings."""
        return given if given is not None else self.kind.from_config(self.config)
