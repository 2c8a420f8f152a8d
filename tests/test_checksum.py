"""The checksum of stored layers: every installed implementation gives zlib's CRC-32."""

from __future__ import annotations

import os
import zlib

from kvrag.storage import checksum


def test_checksum_equals_zlib_crc32_whole_and_continued():
    data = os.urandom(300_001)
    print("implementation:", checksum.IMPLEMENTATION)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data[1234:], checksum.crc32(data[:1234])) == zlib.crc32(data)
    assert checksum.crc32(memoryview(bytearray(data))[7:]) == zlib.crc32(data[7:])
    assert checksum.crc32(b"") == 0


def test_the_fast_implementation_is_installed():
    """`zlib-ng` is a dependency: without it loading is bound by zlib's checksum."""
    assert checksum.IMPLEMENTATION == "zlib-ng"
