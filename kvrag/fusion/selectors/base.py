"""The selector contract and the registry of fusion modes.

A *selector* decides which positions of the fused sequence the layer loop (`kvrag.fusion.loop`)
recomputes: a bool mask before layer 0 (`Selector.initial`), optionally narrowed before any layer
(`Selector.checks` / `Selector.narrow`) or chosen after a probe pass (`Selector.probe_from` /
`Selector.choose`). Positions that `Segments.forced` marks (the question suffix, chunks without a
cache) must always stay selected.

A fusion *mode* is the name a selector class is registered under with `register_selector`; that
name is the only place a mode is spelled. `FuseConfig.mode` is validated against
`available_modes`, and `make_selector` builds the selector a config names through the class's
`Selector.from_config`.

This module and the built-in selectors import no torch at module level: listing the modes (config
validation, the command line's ``--mode`` choices) stays cheap. The built-in selectors register
when the `kvrag.fusion.selectors` package is imported, which importing this module does first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    import torch

    from kvrag.config import FuseConfig
    from kvrag.fusion.inputs import Segments

class Selector(ABC):
    """Chooses which positions are recomputed: before layer 0, and after each layer.

    Subclasses implement `initial`; the other hooks default to "no narrowing, no probe".

    Class attributes describe the mode to the rest of kvrag, so that nothing else names it:

    Attributes:
        value_field: what a benchmark's ``NAME@VALUE`` spec sets: ``ratio``, or one of the mode's `Options`.
        option_field: the option of `Options` that ``NAME@VALUE/OPTION`` sets, if any.
        scales_with_ratio: whether the recompute grows with `FuseConfig.ratio` (the loading controller
            raises the ratio of such modes while loading hides the extra work).
        loads_before_main_pass: whether the main pass needs every stored layer first (a probe pass
            overlaps the loading, the selected tokens do not), so loading adds to the recompute.
        recomputes_all: whether the mode recomputes every position after the prefix: it reads no stored
            cache, is exact by construction (no check can fail it) and is what every escalation ends in.
        reads_first_chunk_only: whether the mode recomputes every chunk after the first whatever it holds, so
            that only the first chunk's stored cache is loaded.
    """

    @dataclass(frozen=True)
    class Options:
        """The mode's own settings, given as ``FuseConfig.options`` (none by default). A selector with options
        declares its own frozen dataclass under this name; its ``__post_init__`` checks them.
        """

    value_field: ClassVar[str | None] = None
    option_field: ClassVar[str | None] = None
    scales_with_ratio: ClassVar[bool] = False
    loads_before_main_pass: ClassVar[bool] = False
    recomputes_all: ClassVar[bool] = False
    reads_first_chunk_only: ClassVar[bool] = False
    check_score: str = "kv_attention"  # what the layer loop ranks tokens by where `checks` is true

    @classmethod
    def options(cls, config: FuseConfig) -> Any:
        """``config.options`` as this mode's `Options`.

        Raises:
            ValueError: an option the mode does not take (naming those it takes), or a bad value.
        """
        known = {f.name for f in fields(cls.Options)}
        unknown = sorted(set(config.options) - known)
        if unknown:
            takes = ", ".join(sorted(known)) or "none"
            raise ValueError(f"fusion mode {config.mode!r} takes no option {', '.join(map(repr, unknown))} "
                             f"(its options: {takes})")
        return cls.Options(**config.options)

    @classmethod
    def from_config(cls, config: FuseConfig) -> Selector:
        """The selector for ``config`` (``config.mode`` names this class).

        Override to read ``config.ratio`` or the mode's `options`; the default takes none (and refuses options).

        Args:
            config: the fusion settings.

        Returns:
            A new selector.
        """
        cls.options(config)
        return cls()

    @abstractmethod
    def initial(self, seg: Segments) -> torch.Tensor:
        """Bool mask ``[N]`` of positions recomputed from layer 0 (including every forced one)."""

    def checks(self, layer: int) -> bool:
        """Whether `narrow` runs at ``layer``, on the K/V deviation of its fresh rows, before its body."""
        return False

    def narrow(
        self, layer: int, sel: torch.Tensor, deviation: torch.Tensor, seg: Segments
    ) -> torch.Tensor | None:
        """Indices into ``sel`` that ``layer``'s body and the layers after it run on (None keeps all)."""
        return None

    def probe_from(self, seg: Segments, n_layers: int) -> int | None:
        """If the `initial` tokens run first as a probe: the first layer whose suffix attention
        `choose` ranks by; None runs the `initial` tokens as the one pass.
        """
        return None

    def probe_until(self, n_layers: int) -> int:
        """After `probe_from` gave a layer: the layer the probe pass stops before (every layer by default)."""
        return n_layers

    def choose(self, attention: torch.Tensor, seg: Segments) -> torch.Tensor:
        """After a probe: bool mask ``[N]`` of the positions recomputed, from the suffix attention ``[N]``."""
        raise NotImplementedError(f"{type(self).__name__} runs no probe pass")


S = TypeVar("S", bound=type[Selector])

_REGISTRY: dict[str, type[Selector]] = {}  # mode name -> selector class, in registration order


def register_selector(name: str) -> Callable[[S], S]:
    """Class decorator: register a `Selector` subclass as the fusion mode ``name``.

    Example::

        @register_selector("tail")
        class TailSelector(Selector):
            ...

    Args:
        name: the mode name (`FuseConfig.mode`, ``KVRag.answer(mode=...)``); a Python identifier, so
            that it fits the benchmarks' mode specs (``NAME@VALUE``).

    Returns:
        The decorator, which returns the class unchanged.

    Raises:
        ValueError: ``name`` is not an identifier, or another class is registered under it.
        TypeError: the decorated class is not a `Selector`.
    """
    if not name.isidentifier():
        raise ValueError(f"a fusion mode name must be a Python identifier, got {name!r}")

    def register(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, Selector)):
            raise TypeError(f"only Selector subclasses can be registered as a fusion mode, got {cls!r}")
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"fusion mode {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return register


def unregister_selector(name: str) -> None:
    """Remove the fusion mode ``name`` from the registry (e.g. a test's own selector, afterwards).

    Raises:
        KeyError: no selector is registered under ``name``.
    """
    del _REGISTRY[name]


def available_modes() -> tuple[str, ...]:
    """The registered fusion mode names, in registration order (the built-in ones first)."""
    return tuple(_REGISTRY)


def selector_class(mode: str) -> type[Selector]:
    """The selector class registered as ``mode``.

    Raises:
        ValueError: no selector is registered under ``mode``.
    """
    try:
        return _REGISTRY[mode]
    except KeyError:
        raise ValueError(f"unknown fusion mode {mode!r}; expected one of {available_modes()}") from None


def exact_mode() -> str:
    """The registered mode that recomputes every position (`Selector.recomputes_all`): the reference every
    other mode is measured against, and where the correctness gate's escalations end.
    """
    return next(name for name, cls in _REGISTRY.items() if cls.recomputes_all)


def make_selector(config: FuseConfig) -> Selector:
    """The selector for ``config.mode``, built by its class's `Selector.from_config`.

    Raises:
        ValueError: no selector is registered under ``config.mode``.
    """
    return selector_class(config.mode).from_config(config)
