"""How a chunk region's encoded layers are staged for loading: where each chunk's blob goes in a
staging buffer (`PlaneLayout`) and how the blobs of files are read there in batches (`ExtentReads`).

A codec with planes (`Codec.planes`: ``raw``, ``int8``) stores a layer of ``n`` tokens as planes
``[rows, n, width]`` bytes one after another; fusion wants every plane of the region ``[rows, total,
width]``, the chunks' tokens side by side. `kvrag.loading.feed.StoreFeed` stages them with these.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvrag.loading import extents

LayerKV = tuple[torch.Tensor, torch.Tensor]  # [H, n, D] each: one layer of the whole chunk region


class ExtentReads:
    """Where every open chunk's layers lie in its file, for batched reads into packed slots."""

    def __init__(self, chunks: list[int], fds: list[int], readers: list[Any], slots: list[int],
                 slot_sizes: list[int]) -> None:
        self.chunks = chunks
        self.fds = np.array(fds, dtype=np.int64)
        self.starts = np.array([r.header.data_start for r in readers], dtype=np.int64)
        table = np.array([r.header.layers for r in readers], dtype=np.int64)  # [chunks, layers, (off, len, crc)]
        self.offsets, self.lengths, self.crcs = table[..., 0], table[..., 1], table[..., 2]
        self.slots = np.array(slots, dtype=np.int64)
        self.slot_sizes = np.array(slot_sizes, dtype=np.int64)
        self.live = np.ones(len(chunks), dtype=bool)

    @classmethod
    def of(cls, readers: Sequence[Any], planar: PlaneLayout) -> ExtentReads | None:
        """The table for a packed layout when every open chunk is a file and `extents` runs here."""
        open_chunks = [j for j, r in enumerate(readers) if r is not None]
        fds = [readers[j].fileno() for j in open_chunks]
        if not planar.packed or not open_chunks or None in fds or not extents.available():
            return None
        return cls(open_chunks, fds, [readers[j] for j in open_chunks], [planar.slots[j] for j in open_chunks],
                   [planar.slot_size(j) for j in open_chunks])

    def read_layer(self, i: int, base: int, workers: int, pool: ThreadPoolExecutor | None) -> list[tuple[int, str]]:
        """Read layer ``i`` of the live chunks into the buffer at address ``base``; the chunks that
        failed, with why (they are no longer live).
        """
        lengths = self.lengths[:, i]
        failed = [(int(k), f"holds {lengths[k]} bytes, its slot {self.slot_sizes[k]}")
                  for k in np.flatnonzero(self.live & (lengths != self.slot_sizes))]
        todo = np.flatnonzero(self.live & (lengths == self.slot_sizes))
        batches = [b for b in np.array_split(todo, max(1, min(workers, len(todo)))) if len(b)]

        def run(batch: np.ndarray) -> np.ndarray:
            return extents.read_checked(self.fds[batch], self.starts[batch] + self.offsets[batch, i],
                                        lengths[batch], base + self.slots[batch], self.crcs[batch, i])

        statuses = list(map(run, batches) if pool is None or len(batches) == 1 else pool.map(run, batches))
        for batch, status in zip(batches, statuses):
            for k, code in zip(batch, status):
                if code != extents.OK:
                    failed.append((int(k), "truncated" if code == extents.TRUNCATED else "checksum mismatch"))
        for k, _ in failed:
            self.live[k] = False
        return [(self.chunks[k], why) for k, why in failed]


class PlaneLayout:
    """Where each chunk's layer blob goes in a staging buffer, and how the region's planes come out.

    Two layouts:

    - ``scatter`` (the CPU): the staging buffer holds the region plane by plane; each chunk's read is
      scattered straight into place (one piece per plane row), so the buffer is the planes.
    - ``packed`` (CUDA): each chunk's blob is read whole into its own slot — one piece, one checksum —
      and the device puts the planes side by side after the upload (`unpack`): a strided copy per
      plane for each run of equally long chunks. Far fewer, larger pieces for the loading threads.
    """

    def __init__(self, codec: Any, planes: list[tuple[int, int]], dtype: torch.dtype,
                 lengths: Sequence[int], offsets: Sequence[int], packed: bool = False) -> None:
        self.codec, self.planes, self.dtype, self.packed = codec, planes, dtype, packed
        self.lengths, self.offsets = list(lengths), list(offsets)
        self.total = sum(self.lengths)
        self.starts = [0]
        for rows, width in planes:
            self.starts.append(self.starts[-1] + rows * self.total * width)
        self.nbytes = self.starts[-1]
        self.per_token = self.nbytes // max(1, self.total)  # blob bytes per token
        # packed: slots ordered by (length, chunk), so equally long chunks lie together; runs of them
        # (length, first chunk's slot byte, chunks in order) with the tokens they cover
        order = sorted(range(len(self.lengths)), key=lambda j: (self.lengths[j], j))
        self.slots: dict[int, int] = {}
        at = 0
        for j in order:
            self.slots[j] = at
            at += self.slot_size(j)
        self.runs: list[tuple[int, int, list[int]]] = []
        for j in order:
            run = self.runs[-1] if self.runs else None
            if run is not None and run[0] == self.lengths[j]:
                run[2].append(j)
            else:
                self.runs.append((self.lengths[j], self.slots[j], [j]))
        self.pieces: list[list[list[memoryview]]] = []  # [buffer][chunk] -> the blob's pieces in order
        self._tokens: dict[torch.device, list[torch.Tensor | None]] = {}

    def bind(self, buffers: Sequence[Any]) -> None:
        """Cut the pieces of every chunk out of each staging buffer (uint8 numpy arrays)."""
        cut = self._slot if self.packed else self._chunk_pieces
        self.pieces = [[cut(memoryview(buf), j) for j in range(len(self.lengths))] for buf in buffers]

    def slot_size(self, j: int) -> int:
        """Bytes of chunk ``j``'s layer blob: its packed slot."""
        return self.lengths[j] * self.per_token

    def _slot(self, buf: memoryview, j: int) -> list[memoryview]:
        at = self.slots[j]
        return [buf[at : at + self.slot_size(j)]]

    def _chunk_pieces(self, buf: memoryview, j: int) -> list[memoryview]:
        off, n = self.offsets[j], self.lengths[j]
        pieces = []
        for (rows, width), start in zip(self.planes, self.starts):
            for r in range(rows):
                at = start + (r * self.total + off) * width
                pieces.append(buf[at : at + n * width])
        return pieces

    def unpack(self, staged: torch.Tensor) -> list[torch.Tensor]:
        """The region's planes ``[rows, total, width]`` from a packed staging buffer (any device)."""
        planes = [torch.empty((rows, self.total, width), dtype=torch.uint8, device=staged.device)
                  for rows, width in self.planes]
        for (n, at, chunks), tokens in zip(self.runs, self._run_tokens(staged.device)):
            blobs = staged[at : at + len(chunks) * n * self.per_token].view(len(chunks), -1)  # [c, blob]
            first = self.offsets[chunks[0]]
            start = 0
            for (rows, width), plane in zip(self.planes, planes):
                part = blobs[:, start : start + rows * n * width].view(len(chunks), rows, n, width)
                start += rows * n * width
                if tokens is None:  # [rows, c, n, width] into consecutive tokens: one strided copy
                    plane[:, first : first + n * len(chunks)].view(rows, len(chunks), n, width).copy_(
                        part.transpose(0, 1))
                else:
                    plane.index_copy_(1, tokens, part.transpose(0, 1).reshape(rows, len(chunks) * n, width))
        return planes

    def _run_tokens(self, device: torch.device) -> list[torch.Tensor | None]:
        """Per run, the region tokens its chunks cover, in slot order (None where they are consecutive,
        in order); made once per device.
        """
        if device not in self._tokens:
            made: list[torch.Tensor | None] = []
            for n, _, chunks in self.runs:
                offsets = [self.offsets[j] for j in chunks]
                if offsets == list(range(offsets[0], offsets[0] + n * len(chunks), n)):
                    made.append(None)
                else:
                    made.append(torch.tensor([o + t for o in offsets for t in range(n)], device=device))
            self._tokens[device] = made
        return self._tokens[device]

    def decode(self, staged: torch.Tensor, out_dtype: torch.dtype) -> LayerKV:
        """Keys and values ``[H, total, D]`` of the region from a filled staging buffer (any device)."""
        if self.packed:
            planes = self.unpack(staged)
        else:
            planes = [staged[a:b].view(rows, self.total, width)
                      for (rows, width), a, b in zip(self.planes, self.starts, self.starts[1:])]
        return self.codec.decode_planes(planes, self.dtype, out_dtype)
