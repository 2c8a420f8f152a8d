"""Batched extent reads with CRC-32 checks (`kvrag.loading.extents`) against plain reads and zlib."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from kvrag.loading import extents


def test_extents_read_into_place_and_flag_bad_checksums_and_short_files(tmp_path):
    assert extents.available()
    data = os.urandom(1 << 20)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(3 << 18, dtype=np.uint8)
        base = out.ctypes.data
        spans = [(0, 1 << 18), (5000, 1 << 18), ((1 << 20) - 100, 1 << 18)]  # the last runs past the end
        crcs = [zlib.crc32(data[a : a + n]) for a, n in spans]
        crcs[1] ^= 1  # a wrong checksum
        status = extents.read_checked(
            np.array([fd] * 3, dtype=np.int64), np.array([a for a, _ in spans], dtype=np.int64),
            np.array([n for _, n in spans], dtype=np.int64),
            np.array([base, base + (1 << 18), base + (2 << 18)], dtype=np.int64), np.array(crcs, dtype=np.int64))
    finally:
        os.close(fd)
    assert status.tolist() == [extents.OK, extents.MISMATCH, extents.TRUNCATED]
    assert out[: 1 << 18].tobytes() == data[: 1 << 18]
    assert out[1 << 18 : 2 << 18].tobytes() == data[5000 : 5000 + (1 << 18)]  # read, then flagged


def test_extents_of_a_closed_descriptor_are_truncated(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"x" * 64)
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    out = np.zeros(64, dtype=np.uint8)
    status = extents.read_checked(np.array([fd], dtype=np.int64), np.zeros(1, dtype=np.int64),
                                  np.array([64], dtype=np.int64), np.array([out.ctypes.data], dtype=np.int64),
                                  np.array([zlib.crc32(b"x" * 64)], dtype=np.int64))
    assert status.tolist() == [extents.TRUNCATED]


def test_read_checked_says_what_it_needs_when_unavailable(monkeypatch):
    monkeypatch.setattr(extents, "_kernel", lambda: None)
    assert not extents.available()
    with pytest.raises(RuntimeError, match="numba"):
        extents.read_checked(*(np.zeros(1, dtype=np.int64) for _ in range(5)))
