"""The codec interface and its factory.

Tensor layout for one layer: ``[kv_heads, seq, head_dim]``. Keys are pre-RoPE.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvrag.errors import KVRagError

_REGISTRY: dict[str, type[Codec]] = {}
# Codecs that live in their own modules register on import; the factory imports them lazily.
_LAZY_MODULES: dict[str, str] = {
    "int8": "kvrag.codec.int8",
    "cachegen": "kvrag.codec.cachegen",
}

C = TypeVar("C", bound="type[Codec]")
Plane = tuple[int, int]  # (rows, bytes per token of each row): one part of a layer's blob, see `Codec.planes`


class CodecNotFittedError(KVRagError):
    """A codec that needs fitting (``needs_fit``) was used before `Codec.fit` or `Codec.load_state`.

    Deliberately not a ValueError: the container turns ValueErrors from ``decode_layer`` into
    `CorruptChunkError` (recompute the chunk), but a missing codec state is a setup error.
    """


class Codec(ABC):
    """Encodes one layer of one chunk's KV to bytes and back.

    Subclasses set ``name`` and may need fitting on sample chunks (``needs_fit``) before encoding;
    fitted state is saved in the index directory by `save_state` and restored by `load_state`.
    """

    name: str = ""
    needs_fit: bool = False

    def __init__(self, level: int | None = None) -> None:
        self.level = self.default_level() if level is None else level

    @classmethod
    def default_level(cls) -> int:
        """The level a codec of this kind uses when none is given."""
        return 0

    @classmethod
    def levels(cls) -> tuple[int, ...]:
        """The quality levels this codec offers (higher is better quality)."""
        return (0,)

    def params(self) -> dict[str, Any]:
        """JSON-serialisable parameters recorded in the manifest and chunk headers."""
        return {"name": self.name, "level": self.level}

    @abstractmethod
    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> bytes:
        """Encode one layer; ``keys``/``values``: ``[kv_heads, seq, head_dim]``."""

    @abstractmethod
    def decode_layer(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one layer back to ``(keys, values)`` of ``shape`` and ``dtype``.

        Raises:
            ValueError: the blob does not decode to the stated shape (the caller turns this into
                `CorruptChunkError`).
        """

    def decode_layer_into(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype, out: torch.Tensor
    ) -> None:
        """Decode one layer into ``out``, a CPU tensor ``[2, *shape]`` of any dtype (keys, then values):
        exactly `decode_layer`'s result copied in. Codecs that can write their output in place override it.
        """
        keys, values = self.decode_layer(blob, layer, shape, dtype)
        out[0].copy_(keys)
        out[1].copy_(values)

    def planes(self, heads: int, head_dim: int, dtype: torch.dtype) -> list[Plane] | None:
        """How one layer's blob splits into planes, when `decode_planes` can decode it anywhere.

        The blob of a chunk of ``S`` tokens is then, plane after plane, ``rows`` rows of ``S * width``
        bytes each (every row token-major). A reader can put several chunks' rows side by side, each
        plane as ``[rows, T, width]`` bytes over all their ``T`` tokens, and decode them in one go on
        the model's device. None (the default): the codec decodes on the host only, chunk by chunk.
        """
        return None

    def decode_planes(
        self, planes: list[torch.Tensor], dtype: torch.dtype, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[H, T, D]`` in ``out_dtype`` from staged ``planes`` (uint8 ``[rows, T,
        width]`` each, laid out as `planes` says, on any device) of caches stored in ``dtype``.
        Exactly what `decode_layer` gives for each chunk's tokens.
        """
        raise NotImplementedError(f"codec {self.name!r} decodes on the host only")

    def fit(self, samples: list[tuple[torch.Tensor, torch.Tensor]], n_layers: int) -> None:
        """Fit shared statistics on sample chunks; ``samples`` are ``[L, H, S, D]`` pairs."""

    def save_state(self, directory: Path) -> None:
        """Persist fitted state (no pickle)."""

    def load_state(self, directory: Path) -> None:
        """Restore state written by `save_state`."""

    def with_level(self, level: int) -> Codec:
        """A copy of the codec at quality ``level``, sharing any fitted state (to store several levels)."""
        if level not in self.levels():
            raise ValueError(f"codec {self.name!r} has levels {self.levels()}, got level={level}")
        clone = copy.copy(self)
        clone.level = level
        return clone


def register_codec(name: str) -> Callable[[C], C]:
    """Class decorator that makes a codec available to `make_codec` under ``name``."""

    def wrap(cls: C) -> C:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _lookup(name: str) -> type[Codec]:
    if name not in _REGISTRY and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; available: {available_codecs()}")
    return _REGISTRY[name]


def available_codecs() -> list[str]:
    """Names accepted by `make_codec`."""
    names = set(_REGISTRY)
    for name, module in _LAZY_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            names.add(name)
    return sorted(names)


def make_codec(name: str, level: int | None = None) -> Codec:
    """Build the codec registered as ``name`` at quality ``level`` (its default when None)."""
    cls = _lookup(name)
    if level is not None and level not in cls.levels():
        raise ValueError(f"codec {name!r} has levels {cls.levels()}, got level={level}")
    return cls(level=level)
