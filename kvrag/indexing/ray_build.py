"""Index builds on a Ray cluster: documents split, chunks embedded and caches computed by Ray actors.

Contract (`add_on_ray`: ``KVRag.build(..., engine="ray")``, ``KVRag.add`` and ``kvrag index --engine ray``):

- **Who does what.** Each worker is one Ray actor holding the model (on a GPU when the cluster has them), the
  embedder and the codec, loaded once; workers split the documents, embed the chunks, compute and encode their
  caches and return the blobs. The driver alone writes, under the index's `writer_lock`: the blobs into the
  index's store (its ``chunks/`` folder or a remote one such as ``redis://``), the codec state, the FAISS
  vectors and the SQLite rows.
- **The same index as the single-process build**: the same chunk keys and texts (without pretrained Punkt
  data the driver trains Punkt on all the documents, as `KVSplitter.split_many` does, and hands it out); the
  same caches, bit for bit with the ``raw`` codec on the same device (the driver cuts each group into the
  batches `Builder` prefills and hands out whole batches: each cache comes out of the same model call); the
  same vectors up to float rounding. A codec that needs fitting is fitted by one worker on the chunks the
  single-process build fits it on, and the driver saves its state before any blob coded with it (``cachegen``'s
  fit goes through BLAS, so its state matches a local build's run with the same BLAS thread count).
- **Resuming.** Groups of `GROUP_CHUNKS` chunks are committed once their caches are stored, so a killed
  driver resumes on re-run as the single-process build does: stored caches are not computed again. A worker
  that dies has its unfinished work handed to the others; with none left, `KVRagError`, and a re-run resumes.
- A tqdm bar on stderr unless ``show_progress=False``. Ray is imported only here (`import_ray`). Indexes with
  neighbour context are refused in one line (build them with the local engine).
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvrag.config import SplitConfig
from kvrag.errors import IndexMismatchError, InputError, KVRagError
from kvrag.indexing.build import FIT_CHUNKS, GROUP_CHUNKS, BuildStats, Candidate
from kvrag.indexing.documents import Loaded
from kvrag.storage.chunk_index import ChunkRecord
from kvrag.storage.verify import writer_lock

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")
IN_FLIGHT = 2  # tasks queued on each worker at once: one running, one waiting, so that no worker idles
SPLIT_DOCS = 64  # documents per split task (fewer when that leaves a worker without one)
EMBED_TEXTS = 64  # chunk texts per embedding task


def import_ray() -> Any:
    """The ``ray`` module; a one-line `KVRagError` naming the install command when it is missing."""
    try:
        import ray
    except ImportError:
        raise KVRagError("building on Ray needs the ray package: pip install kvrag[ray]") from None
    return ray


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


def _state_files(codec: Any) -> dict[str, bytes]:
    """A fitted codec's saved state as ``{file name: bytes}`` (what `Codec.save_state` writes)."""
    with tempfile.TemporaryDirectory(prefix="kvrag-codec-") as tmp:
        codec.save_state(Path(tmp))
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def _load_state(codec: Any, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="kvrag-codec-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        codec.load_state(Path(tmp))


class KVBuildWorker:
    """One Ray actor's state and work: a model, an embedder and a codec, loaded once (`WorkerSetup`)."""

    def __init__(self, setup: WorkerSetup) -> None:
        import torch

        from kvrag.codec.base import make_codec
        from kvrag.indexing.embed import Embedder
        from kvrag.indexing.kvgen import prefix_cache
        from kvrag.model import load_model

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
            _load_state(self.codec, setup.codec_state)
        self.setup = setup

    def ready(self) -> str:  # noqa: D102  (the device, once the actor started)
        return str(self.lm.device)

    def split(self, docs: list[str]) -> list[list[tuple[str, list[int], str]]]:
        """``(text, token ids, chunk key)`` of every chunk of each document, as `split_documents` cuts them."""
        from kvrag.indexing.kvgen import chunk_key
        from kvrag.indexing.split import KVSplitter
        from kvrag.prompt import chunk_token_ids

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

    def caches(self, batches: list[list[tuple[str, list[int]]]]) -> list[tuple[str, bytes, int]]:
        """``(key, blob, tokens)`` of each chunk of ``batches`` of ``(key, token ids)``, one model call a batch."""
        return [(key, self._encode(key, kv), n) for key, kv, n in self._prefill(batches)]

    def fit(self, batches: list[list[tuple[str, list[int]]]], n_fit: int) -> tuple[dict[str, bytes], list[Any]]:
        """Fit the codec on the first ``n_fit`` caches of ``batches``; its state files and every chunk's blob."""
        computed = list(self._prefill(batches))
        self.codec.fit([kv for _, kv, _ in computed[:n_fit]], computed[0][1][0].shape[0])
        return _state_files(self.codec), [(key, self._encode(key, kv), n) for key, kv, n in computed]

    def load_state(self, files: dict[str, bytes]) -> None:
        """Take the codec state another worker fitted."""
        _load_state(self.codec, files)

    def _prefill(self, batches: list[list[tuple[str, list[int]]]]) -> Any:
        from kvrag.indexing.kvgen import chunk_caches

        for batch in batches:
            for i, kv in chunk_caches(self.lm, self.prefix, [ids for _, ids in batch], self.setup.batch_tokens):
                yield batch[i][0], kv, len(batch[i][1])

    def _encode(self, key: str, kv: Any) -> bytes:
        from kvrag.storage.container import encode_chunk

        return encode_chunk(self.codec, key, self.lm.fingerprint, kv[0].cpu(), kv[1].cpu())


class WorkerPool:
    """The driver's side: Ray started or joined, the actors, and `run`, which keeps every live worker busy
    (``IN_FLIGHT`` tasks each); a task whose worker died goes to another one, and with none left, `KVRagError`.
    """

    def __init__(self, ray: Any, setup: WorkerSetup, address: str | None, workers: int | None) -> None:
        self.ray, self.started = ray, False
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
                raise KVRagError(f"cannot start or reach {where}: {str(exc).splitlines()[0]}") from None
            self.started = True
        cpus, gpus = float(ray.cluster_resources().get("CPU", 1.0)), int(ray.cluster_resources().get("GPU", 0))
        n = workers if workers is not None else (gpus or max(1, int(cpus)))
        share = cpus / n  # each worker's CPUs: whole ones (its torch threads) when there are enough
        options = {"num_cpus": int(share) if share >= 1 else share, "num_gpus": min(1.0, gpus / n), "max_restarts": 0}
        setup = WorkerSetup(**{**setup.__dict__, "threads": max(1, int(share))})
        actor = ray.remote(**options)(KVBuildWorker)
        self.actors = [actor.remote(setup) for _ in range(n)]
        try:
            devices = ray.get([a.ready.remote() for a in self.actors])
        except ray.exceptions.RayError as exc:
            self.close()
            raise KVRagError(f"a Ray worker could not start: {_reason(exc)}") from None
        log.info("building on Ray with %d workers (%s)", n, ", ".join(devices))

    def run(self, tasks: Sequence[tuple[Callable[[Any], Any], Callable[[Any], None]]]) -> None:
        """Run ``(submit(actor) -> ObjectRef, done(result))`` tasks on the live workers; ``done`` in arrival order."""
        ray, queue = self.ray, list(reversed(tasks))
        running: dict[Any, tuple[Any, tuple[Callable[[Any], Any], Callable[[Any], None]]]] = {}
        load = {id(a): 0 for a in self.actors}
        while queue or running:
            for actor in list(self.actors):
                while queue and load[id(actor)] < IN_FLIGHT:
                    task = queue.pop()
                    running[task[0](actor)] = (actor, task)
                    load[id(actor)] += 1
            if not running:
                raise KVRagError("every Ray worker died; the work done so far is kept: run the build again to resume")
            ready, _ = ray.wait(list(running), num_returns=1)
            actor, task = running.pop(ready[0])
            load[id(actor)] -= 1
            try:
                result = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                if actor in self.actors:
                    log.warning("a Ray worker died (%s); its work goes to the others", _reason(exc))
                    self.actors.remove(actor)
                queue.append(task)
                continue
            except ray.exceptions.RayTaskError as exc:  # an error inside the task: raised as itself
                raise (exc.cause if isinstance(exc.cause, KVRagError) else exc.as_instanceof_cause()) from None
            task[1](result)

    def broadcast(self, method: str, value: Any) -> None:
        """Call ``method(value)`` on every live worker and wait (a worker that died meanwhile is dropped)."""
        ref = self.ray.put(value)  # one copy in the object store, whatever the number of workers
        for actor, call in [(a, getattr(a, method).remote(ref)) for a in self.actors]:
            try:
                self.ray.get(call)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError):
                self.actors.remove(actor)

    def close(self) -> None:
        for actor in self.actors if hasattr(self, "actors") else []:
            self.ray.kill(actor)
        if self.started:
            self.ray.shutdown()


def _reason(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def _punkt(loaded: Loaded, lm: Any, config: SplitConfig) -> Any:
    """Punkt trained on what `KVSplitter.split_many` would train it on, when no pretrained data is installed."""
    from kvrag.indexing.split import load_pretrained_punkt, train_punkt

    if config.mode == "fixed" or load_pretrained_punkt() is not None:
        return None
    texts = [text for _, text, _ in loaded.docs if text.strip()]
    if config.mode == "document":  # documents within budget stay whole: Punkt never sees them
        counts = [len(ids) for ids in lm.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
        texts = [t for t, n in zip(texts, counts) if n > config.max_tokens]
    return train_punkt(texts) if texts else None


def _split(pool: WorkerPool, loaded: Loaded) -> list[Candidate]:
    """Every document split on the workers; duplicates keep their first occurrence (`split_documents`)."""
    docs = loaded.docs
    size = max(1, min(SPLIT_DOCS, math.ceil(len(docs) / len(pool.actors))))
    parts: dict[int, list[list[tuple[str, list[int], str]]]] = {}

    def task(start: int) -> tuple[Callable[[Any], Any], Callable[[Any], None]]:
        texts = [text for _, text, _ in docs[start : start + size]]
        return (lambda a: a.split.remote(texts)), (lambda result: parts.__setitem__(start, result))

    pool.run([task(start) for start in range(0, len(docs), size)])
    pieces = [chunks for start in sorted(parts) for chunks in parts[start]]
    seen: set[str] = set()
    out: list[Candidate] = []
    for (doc_id, _, source), chunks in zip(docs, pieces):
        for seq, (text, ids, key) in enumerate(chunks):
            if key not in seen and ids:
                seen.add(key)
                out.append(Candidate(ChunkRecord(key, doc_id, seq, text, len(ids), source), ids))
    return out


def _batches(chunks: list[Candidate], batch_tokens: int) -> list[list[tuple[str, list[int]]]]:
    """``(key, ids)`` batches exactly as `chunk_caches` batches these chunks (sorted by length, greedy)."""
    from kvrag.indexing.kvgen import _batches as batch_order

    lengths = [len(c.ids) for c in chunks]
    return [[(chunks[i].record.key, chunks[i].ids) for i in batch] for batch in batch_order(lengths, batch_tokens)]


def _codec_ready(codec: Any, state_dir: Path) -> bool:
    """As `Builder.codec_ready`: the codec needs no fitting, or its state is fitted (or marked so)."""
    return not codec.needs_fit or bool(getattr(codec, "fitted", (state_dir / "fitted").is_file()))


class _Run:
    """One build's work after the split: per group of `GROUP_CHUNKS`, embed, compute and store the caches
    the store lacks (fitting the codec first when it needs it), then commit the group (`Builder.run`).
    """

    def __init__(self, pool: WorkerPool, rag: Any, stats: BuildStats, bar: Any) -> None:
        self.pool, self.rag, self.stats, self.bar = pool, rag, stats, bar
        self.codec, self.state_dir = rag.kvstore.codec, Path(rag.path) / "codec"

    def group(self, group: list[Candidate], caches: bool) -> None:
        kvstore, texts, t0 = self.rag.kvstore, [c.record.text for c in group], time.perf_counter()
        vectors: dict[int, tuple[np.ndarray, float]] = {}  # by first text: ([n, dim], seconds)
        tasks = [((lambda a, s=s: a.embed.remote(texts[s : s + EMBED_TEXTS])), partial(vectors.__setitem__, s))
                 for s in range(0, len(texts), EMBED_TEXTS)]
        todo = [c for c in (group if caches else group[:FIT_CHUNKS]) if not kvstore.contains(c.record.key)]
        if caches:
            self.bar.update(sum(len(c.ids) for c in group) - sum(len(c.ids) for c in todo))
        elif _codec_ready(self.codec, self.state_dir):
            todo = []  # a lazy index computes caches only to fit its codec
        batches = _batches(todo, self.rag.batch_tokens)
        if todo and not _codec_ready(self.codec, self.state_dir):
            n_fit, k = min(FIT_CHUNKS, len(todo)), 0
            while sum(len(b) for b in batches[:k]) < n_fit:
                k += 1
            fit_batches, batches = batches[:k], batches[k:]
            self.pool.run([((lambda a: a.fit.remote(fit_batches, n_fit)), lambda r: self._fitted(r, caches)),
                           *tasks])
            tasks = []
            self.pool.broadcast("load_state", self._files)
        self.pool.run([*[((lambda a, b=b: a.caches.remote([b])), lambda r: self._store(r, caches))
                         for b in (batches if caches else [])], *tasks])
        if not caches:
            self.bar.update(sum(len(c.ids) for c in group))
        self.stats.kv_s += time.perf_counter() - t0
        self.stats.embed_s += sum(seconds for _, seconds in vectors.values())
        matrix = np.concatenate([vectors[s][0] for s in sorted(vectors)])
        self.rag.index.add([c.record for c in group], matrix)  # committed once its caches are stored

    def _fitted(self, result: tuple[dict[str, bytes], list[tuple[str, bytes, int]]], caches: bool) -> None:
        """The codec state a worker fitted: saved (then marked fitted) before any blob coded with it."""
        self._files, blobs = result
        _load_state(self.codec, self._files)
        self.codec.save_state(self.state_dir)
        (self.state_dir / "fitted").touch()
        self._store(blobs, caches)

    def _store(self, blobs: list[tuple[str, bytes, int]], caches: bool) -> None:
        for key, blob, n in blobs:
            self.rag.kvstore.store.put(key, blob)
            self.stats.stored_bytes += len(blob)
            self.stats.prefilled_chunks += 1
            self.stats.prefilled_tokens += n
            if caches:
                self.bar.update(n)


def add_on_ray(rag: Any, loaded: Loaded, stats: BuildStats, show_progress: bool = True, caches: bool = True,
               engine: str = "ray", address: str | None = None, workers: int | None = None) -> BuildStats:
    """Index ``loaded`` into ``rag`` (an opened `KVRag`) on Ray: what ``KVRag.add(..., engine="ray")`` runs.

    ``address`` is ``ray.init``'s (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:10001"``); None joins the Ray this
    process runs, else starts a local one (stopped after). ``workers``: actors (default: one per GPU of the
    cluster, else one per CPU). ``caches=False`` indexes for retrieval only, as `Builder.run` does. ``stats``
    is filled in and returned (``embed_s``: the workers' embedding seconds; ``kv_s``: the groups' wall time).

    Raises:
        InputError: an index with neighbour context, a model without a name the workers can load, bad ``workers``.
        KVRagError: Ray is not installed or cannot start, a worker cannot start, or every worker died.
    """
    from tqdm.auto import tqdm

    if engine not in ENGINES:
        raise InputError(f"engine must be one of {ENGINES}, got {engine!r}")
    if rag.neighbour_context:
        raise InputError("engine='ray' builds indexes without neighbour context; build this one with engine='local'")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise InputError(f"workers must be a positive int, got {workers!r}")
    if not rag.lm.source:
        raise InputError("engine='ray' needs a model the workers can load: pass its name, folder or .gguf file")
    ray = import_ray()
    t0 = time.perf_counter()
    split, codec = SplitConfig(**rag.manifest["split"]), rag.kvstore.codec
    state = _state_files(codec) if codec.needs_fit and _codec_ready(codec, Path(rag.path) / "codec") else None
    source = str(Path(rag.lm.source).resolve()) if Path(rag.lm.source).exists() else rag.lm.source  # any cwd
    setup = WorkerSetup(source, rag.lm.spec.dtype, rag.lm.fingerprint, rag.embedder.name,
                        tuple(rag.layout.prefix_ids), codec.name, codec.level, state, split,
                        _punkt(loaded, rag.lm, split), rag.batch_tokens, 1)
    pool = WorkerPool(ray, setup, address, workers)
    try:
        with writer_lock(Path(rag.path)):  # one writer at a time, as for the local build
            candidates = _split(pool, loaded)
            new = [c for c in candidates if c.record.key not in rag.index]
            todo = [c for c in candidates if c.record.key not in rag.index or (caches and not rag.kvstore.contains(
                c.record.key))]
            stats.chunks, stats.new_chunks = len(candidates), len(new)
            bar = tqdm(total=sum(len(c.ids) for c in todo), unit="tok", dynamic_ncols=True, disable=not show_progress,
                       desc=f"{'computing caches' if caches else 'embedding'} on {len(pool.actors)} Ray workers")
            run = _Run(pool, rag, stats, bar)
            for start in range(0, len(todo), GROUP_CHUNKS):
                run.group(list(todo[start : start + GROUP_CHUNKS]), caches)
            bar.close()
    finally:
        pool.close()
    stats.total_s = time.perf_counter() - t0
    log.info("indexed %d new chunks on Ray (%d prefilled)", stats.new_chunks, stats.prefilled_chunks)
    return stats
