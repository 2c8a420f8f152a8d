"""CRC-32 of stored bytes (zlib's polynomial), from the fastest implementation installed.

Every chunk layer is checked when it is read, so on a fast disk the checksum sets the loading rate:
zlib's CRC-32 runs at 2-4 GB/s per core, zlib-ng's and ISA-L's (SIMD carry-less multiplication)
several times faster. All compute the same CRC-32, so a file written with one checks with any other;
all release the GIL on large buffers.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_crc32: Callable[..., int]
try:
    from zlib_ng import zlib_ng

    IMPLEMENTATION, _crc32 = "zlib-ng", zlib_ng.crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency
    try:
        from isal import isal_zlib

        IMPLEMENTATION, _crc32 = "isal", isal_zlib.crc32
    except ImportError:
        IMPLEMENTATION, _crc32 = "zlib", zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 of ``data`` (any contiguous buffer), continuing from ``value``."""
    return _crc32(data, value)
