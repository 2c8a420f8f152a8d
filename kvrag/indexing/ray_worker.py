"""The worker side of Ray index builds: `KVBuildWorker`, one Ray actor's model, embedder and codec.

Contract: a worker loads what `WorkerSetup` names once (the driver's model, checked by fingerprint; the
embedder; the codec, with the driver's fitted state when there is one) and then, per task, splits documents,
embeds texts, or prefills whole batches of chunks and encodes each cache into the blobs the driver stores:
``(store key, container bytes)`` at the codec's own level under the chunk key, and at each of
``WorkerSetup.stream_levels`` under its derived key (`kvrag.storage.kvstore.level_key`), as
`KVStore.put_levels` writes them in a local build. While one worker fits the codec, the others prefill ahead
and hold the raw caches (`hold`) until the fitted state reaches them (`release`). Nothing here writes to the
index or its store; the driver (`kvrag.indexing.ray_build`) imports this module but loads a model, embedder and
codec only in the workers.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrag.codec.base import make_codec
from kvrag.config import SplitConfig
from kvrag.embedder import Embedder
from kvrag.errors import IndexMismatchError
from kvrag.indexing.kvgen import chunk_caches, chunk_key, prefix_cache
from kvrag.indexing.split import KVSplitter
from kvrag.model import load_model
from kvrag.prompt import chunk_token_ids
from kvrag.storage.container import encode_chunk
from kvrag.storage.kvstore import level_key

Blobs = list[tuple[str, bytes]]  # one chunk's (store key, container bytes): its own level, then its stream levels


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker loads: the driver's model (by source, dtype and fingerprint), embedder, layout, codec."""

    model: str
    dtype: str
    fingerprint: str
    embedder: str
    prefix_ids: tuple[int, ...]
    codec: str
    codec_level: int
    codec_state: dict[str, bytes] | None
    split: SplitConfig
    punkt: Any  # a trained PunktSentenceTokenizer when no pretrained Punkt data is installed, else None
    batch_tokens: int
    threads: int
    stream_levels: tuple[int, ...] = ()  # levels stored besides the codec's own (`KVStore.put_levels`)


def codec_state_files(codec: Any) -> dict[str, bytes]:
    """A fitted codec's saved state as ``{file name: bytes}`` (what `Codec.save_state` writes)."""
    with tempfile.TemporaryDirectory(prefix="kvrag-codec-") as tmp:
        codec.save_state(Path(tmp))
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def load_codec_state(codec: Any, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="kvrag-codec-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        codec.load_state(Path(tmp))


class KVBuildWorker:
    """One Ray actor's state and work: a model, an embedder and a codec, loaded once (`WorkerSetup`)."""

    def __init__(self, setup: WorkerSetup) -> None:
        torch.set_num_threads(setup.threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray shows an actor only the GPUs it holds
        self.lm = load_model(setup.model, dtype=setup.dtype, device=device)
        if self.lm.fingerprint != setup.fingerprint:  # other weights on this machine: its caches would not fit
            raise IndexMismatchError(f"model {setup.model!r} on a Ray worker has fingerprint {self.lm.fingerprint}, "
                                     f"the driver's {setup.fingerprint}: install the same model on every node")
        self.embedder = Embedder(setup.embedder, device=device)
        self.prefix_ids, self.prefix = list(setup.prefix_ids), prefix_cache(self.lm, setup.prefix_ids)
        self.codec = make_codec(setup.codec, setup.codec_level)
        if setup.codec_state:
            load_codec_state(self.codec, setup.codec_state)
        self.setup = setup
        self._held: dict[str, tuple[Any, int]] = {}  # caches prefilled while another worker fits (`hold`)

    def ready(self) -> str:  # noqa: D102  (the device, once the actor started)
        return str(self.lm.device)

    def split(self, docs: list[str]) -> list[list[tuple[str, list[int], str]]]:
        """``(text, token ids, chunk key)`` of every chunk of each document, as `split_documents` cuts them."""
        config = self.setup.split
        splitter = KVSplitter(self.lm.tokenizer, config, self.embedder.encode if config.mode != "fixed" else None)
        if self.setup.punkt is not None:  # trained by the driver on every document, as a single process trains it
            splitter._pretrained = self.setup.punkt
        out = []
        for chunks in splitter.split_many(docs):
            ids = [chunk_token_ids(self.lm.tokenizer, c.text) for c in chunks]
            out.append([(c.text, i, chunk_key(self.lm.fingerprint, self.prefix_ids, i)) for c, i in zip(chunks, ids)])
        return out

    def embed(self, texts: list[str]) -> tuple[np.ndarray, float]:
        """The texts' vectors ``[n, dim]`` and the seconds it took."""
        t0 = time.perf_counter()
        return self.embedder.encode(texts), time.perf_counter() - t0

    def caches(self, batches: list[list[tuple[str, list[int]]]]) -> list[tuple[str, Blobs, int]]:
        """``(key, blobs, tokens)`` of each chunk of ``batches`` of ``(key, token ids)``, one model call a batch."""
        return [(key, self._encode(key, kv), n) for key, kv, n in self._prefill(batches)]

    def fit(self, batches: list[list[tuple[str, list[int]]]], n_fit: int) -> tuple[dict[str, bytes], list[Any]]:
        """Fit the codec on the first ``n_fit`` caches of ``batches``; its state files and every chunk's blob."""
        computed = list(self._prefill(batches))
        self.codec.fit([kv for _, kv, _ in computed[:n_fit]], computed[0][1][0].shape[0])
        return codec_state_files(self.codec), [(key, self._encode(key, kv), n) for key, kv, n in computed]

    def hold(self, batches: list[list[tuple[str, list[int]]]]) -> None:
        """Prefill ``batches`` while another worker fits the codec, keeping their caches here unencoded until
        `release`.
        """
        for key, kv, n in self._prefill(batches):
            self._held[key] = (kv, n)

    def release(self, keys: list[str]) -> list[tuple[str, Blobs, int]]:
        """``(key, blobs, tokens)`` of the held caches among ``keys``, encoded with the codec state now loaded,
        and dropped from here.
        """
        held = [(key, *self._held.pop(key)) for key in keys if key in self._held]
        return [(key, self._encode(key, kv), n) for key, kv, n in held]

    def load_state(self, files: dict[str, bytes]) -> None:
        """Take the codec state another worker fitted."""
        load_codec_state(self.codec, files)

    def _prefill(self, batches: list[list[tuple[str, list[int]]]]) -> Any:
        for batch in batches:
            for i, kv in chunk_caches(self.lm, self.prefix, [ids for _, ids in batch], self.setup.batch_tokens):
                yield batch[i][0], kv, len(batch[i][1])

    def _encode(self, key: str, kv: Any) -> Blobs:
        """The chunk's blobs: at the codec's own level, then at each stream level (sharing the fitted state)."""
        keys, values = kv[0].cpu(), kv[1].cpu()
        windows = self.lm.family.windows
        blobs = [(key, encode_chunk(self.codec, key, self.lm.fingerprint, keys, values, windows))]
        for level in self.setup.stream_levels:
            stored = level_key(key, level)
            blobs.append((stored, encode_chunk(self.codec.with_level(level), stored, self.lm.fingerprint, keys,
                                               values, windows)))
        return blobs
