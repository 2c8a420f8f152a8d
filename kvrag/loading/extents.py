"""Read many file extents into memory and check their CRC-32s in one call that holds no GIL.

Loading a chunk region means, per layer, one positioned read and one checksum per chunk. Done from
Python, every read and checksum hands the GIL back and forth with the thread that launches fusion's
kernels, and each slows the other. `read_checked` runs a whole batch in compiled code (numba,
``nogil``) calling the C library's ``pread`` and zlib-ng's (else the system zlib's) CRC-32 directly:
one GIL round trip per batch.

Available on POSIX systems with numba and a CRC-32 library (`available`); callers fall back to
``os.preadv`` and `kvrag.storage.checksum` elsewhere. Compiled on first use (about half a second).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

import numpy as np

try:
    from zlib_ng import zlib_ng
except ImportError:  # the system zlib's CRC-32 is used
    zlib_ng = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

OK, TRUNCATED, MISMATCH = 0, 1, 2  # status of one extent


def _crc_function() -> Any:
    """``crc32_z(crc, address, length)`` from zlib-ng's extension module, else the system zlib."""
    proto = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_size_t)
    if zlib_ng is not None:
        try:
            return proto(("zng_crc32_z", ctypes.CDLL(zlib_ng.__file__)))
        except (OSError, AttributeError):
            pass
    name = ctypes.util.find_library("z")
    if name is None:
        return None
    try:
        return proto(("crc32_z", ctypes.CDLL(name)))
    except (OSError, AttributeError):
        return None


@functools.cache
def _kernel() -> Any:
    if os.name != "posix":
        return None
    try:
        # lazy: numba (about 50 MB resident) loads with the first batched read, not with kvrag.loading
        import numba
    except ImportError:
        return None
    crc = _crc_function()
    if crc is None:
        return None
    try:
        pread = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.c_int64)(("pread", ctypes.CDLL(None)))
    except (OSError, AttributeError):
        return None

    @numba.njit(nogil=True)
    def read_checked(fds: Any, offsets: Any, lengths: Any, addresses: Any, expected: Any, status: Any) -> None:
        for i in range(fds.shape[0]):
            got, n = 0, lengths[i]
            while got < n:
                step = pread(fds[i], addresses[i] + got, n - got, offsets[i] + got)
                if step <= 0:
                    break
                got += step
            if got < n:
                status[i] = TRUNCATED
            elif crc(0, addresses[i], n) != expected[i]:
                status[i] = MISMATCH
            else:
                status[i] = OK

    return read_checked


def available() -> bool:
    """Whether `read_checked` can run here."""
    return _kernel() is not None


def read_checked(fds: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray,
                 expected: np.ndarray) -> np.ndarray:
    """Read ``lengths[i]`` bytes of file descriptor ``fds[i]`` at ``offsets[i]`` into memory at
    ``addresses[i]`` and check them against CRC-32 ``expected[i]``, for every ``i`` (int64 arrays);
    each extent's status (`OK`, `TRUNCATED`, `MISMATCH`). The memory must stay valid and writable
    for the call: the caller owns it (a pinned staging buffer, a numpy array).
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("extent reads need numba and a CRC-32 library on a POSIX system")
    status = np.empty(len(fds), dtype=np.int64)
    kernel(fds, offsets, lengths, addresses, expected, status)
    return status
