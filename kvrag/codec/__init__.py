"""Chunk-cache codecs behind one small interface and a name-keyed factory.

A codec turns one layer of a chunk's cache — pre-RoPE keys and values, each
``[kv_heads, seq, head_dim]`` — into bytes and back. The container (`kvrag.storage.container`) frames the
per-layer blobs with a header, offsets and checksums; codecs never see files.
"""

from kvrag.codec.base import Codec, available_codecs, make_codec, register_codec
from kvrag.codec.raw import RawCodec

__all__ = ["Codec", "RawCodec", "available_codecs", "make_codec", "register_codec"]
