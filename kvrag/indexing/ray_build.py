"""Index builds on a Ray cluster: documents split, chunks embedded and caches computed by Ray actors.

Contract (`add_on_ray`: ``KVRag.build(..., engine="ray")``, ``KVRag.add`` and ``kvrag index --engine ray``):

- **Who does what.** Each worker is one Ray actor holding the model (on a GPU when the cluster has them), the
  embedder and the codec, loaded once (`kvrag.indexing.ray_worker.KVBuildWorker`); workers split the documents,
  embed the chunks, compute and encode their caches (at the index's stream levels too) and return the blobs.
  The driver alone writes, under the index's writer lock (`IndexLayout.writer_lock`): the blobs into the index's
  store (its ``chunks/`` folder or a remote one such as ``redis://``), the codec state, the FAISS vectors and the
  SQLite rows.
- **The same index as the single-process build**: the same chunk keys and texts (without pretrained Punkt
  data the driver trains Punkt on all the documents, as `KVSplitter.split_many` does, and hands it out); the
  same caches, bit for bit with the ``raw`` codec on the same device (the driver cuts each group into the
  batches `Builder` prefills and hands out whole batches: each cache comes out of the same model call); the
  same vectors up to float rounding. A codec that needs fitting is fitted by one worker on the chunks the
  single-process build fits it on, and the driver saves its state before any blob coded with it (``cachegen``'s
  fit goes through BLAS, so its state matches a local build's run with the same BLAS thread count).
- **Resuming.** Groups of `GROUP_CHUNKS` chunks are committed once their caches are stored, so a killed
  driver resumes on re-run as the single-process build does: stored caches (at every level) are not computed
  again. A worker that dies has its unfinished work handed to the others; with none left, `KVRagError`, and a
  re-run resumes.
- A tqdm bar on stderr unless ``show_progress=False``. Ray is imported only here (`import_ray`). Indexes with
  neighbour context are refused in one line (build them with the local engine).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from kvrag.config import SplitConfig
from kvrag.errors import InputError, KVRagError
from kvrag.indexing.build import FIT_CHUNKS, GROUP_CHUNKS, BuildStats, Candidate
from kvrag.indexing.documents import Loaded
from kvrag.indexing.kvgen import _batches as batch_order
from kvrag.indexing.manifest import stored_stream_levels
from kvrag.indexing.ray_worker import Blobs, KVBuildWorker, WorkerSetup, codec_state_files, load_codec_state
from kvrag.indexing.split import load_pretrained_punkt, train_punkt
from kvrag.storage.chunk_index import ChunkRecord
from kvrag.storage.codec_state import codec_ready, mark_fitted, save_fitted, state_kept
from kvrag.storage.index_layout import IndexLayout

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")
IN_FLIGHT = 2  # tasks queued on each worker at once: one running, one waiting, so that no worker idles
SPLIT_DOCS = 64  # documents per split task (fewer when that leaves a worker without one)
EMBED_TEXTS = 64  # chunk texts per embedding task


def import_ray() -> Any:
    """The ``ray`` module; a one-line `KVRagError` naming the install command when it is missing."""
    try:
        # ray is an optional extra that takes ~1 s to import, and this module is imported with kvrag.rag: it
        # loads only for a build with engine="ray" (and a missing one is reported then)
        import ray
    except ImportError:
        raise KVRagError("building on Ray needs the ray package: pip install kvrag[ray]") from None
    return ray


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
        self.on_each(method, [(a, ref) for a in self.actors])

    def on_each(self, method: str, calls: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Call ``method(value)`` on each ``(worker, value)`` of ``calls`` whose worker lives, and wait; the
        results of those that answered (a worker that died meanwhile is dropped, its result missing).
        """
        refs = [(a, getattr(a, method).remote(v)) for a, v in calls if any(a is b for b in self.actors)]
        out = []
        for actor, ref in refs:
            try:
                out.append(self.ray.get(ref))
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError):
                if actor in self.actors:
                    self.actors.remove(actor)
        return out

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
    lengths = [len(c.ids) for c in chunks]
    return [[(chunks[i].record.key, chunks[i].ids) for i in batch] for batch in batch_order(lengths, batch_tokens)]


def _ahead(batches: list[Any], chunks: int) -> tuple[list[Any], list[Any]]:
    """The first batches, up to ``chunks`` chunks in all, that other workers prefill while the codec is being
    fitted (as many as the fit itself prefills, per worker); and the rest.
    """
    k = taken = 0
    while k < len(batches) and taken + len(batches[k]) <= chunks:
        taken += len(batches[k])
        k += 1
    return batches[:k], batches[k:]


def _ignore(_: Any) -> None:
    return None


class _Run:
    """One build's work after the split: per group of `GROUP_CHUNKS`, embed, compute and store the caches
    the store lacks (fitting the codec first when it needs it), then commit the group (`Builder.run`).
    """

    def __init__(self, pool: WorkerPool, rag: Any, stats: BuildStats, bar: Any, levels: tuple[int, ...]) -> None:
        self.pool, self.rag, self.stats, self.bar, self.levels = pool, rag, stats, bar, levels
        self.codec, self.state_dir = rag.kvstore.codec, IndexLayout.of(rag.path).codec_state

    def group(self, group: list[Candidate], caches: bool) -> None:
        kvstore, texts, t0 = self.rag.kvstore, [c.record.text for c in group], time.perf_counter()
        vectors: dict[int, tuple[np.ndarray, float]] = {}  # by first text: ([n, dim], seconds)
        tasks = [((lambda a, s=s: a.embed.remote(texts[s : s + EMBED_TEXTS])), partial(vectors.__setitem__, s))
                 for s in range(0, len(texts), EMBED_TEXTS)]
        todo = [c for c in (group if caches else group[:FIT_CHUNKS])
                if not kvstore.contains_levels(c.record.key, self.levels)]
        if caches:
            self.bar.update(sum(len(c.ids) for c in group) - sum(len(c.ids) for c in todo))
        elif codec_ready(self.codec, self.state_dir):
            todo = []  # a lazy index computes caches only to fit its codec
        batches = _batches(todo, self.rag.batch_tokens)
        if todo and not codec_ready(self.codec, self.state_dir):
            n_fit, k = min(FIT_CHUNKS, len(todo)), 0
            while sum(len(b) for b in batches[:k]) < n_fit:
                k += 1
            fit_batches, batches = batches[:k], batches[k:]
            ahead, batches = _ahead(batches, n_fit * (len(self.pool.actors) - 1) if caches else 0)
            owners: dict[int, Any] = {}  # ahead batch -> the worker holding its caches

            def hold(i: int) -> Callable[[Any], Any]:
                def submit(actor: Any) -> Any:
                    owners[i] = actor  # the last worker it went to (another one when the first died)
                    return actor.hold.remote([ahead[i]])
                return submit

            self.pool.run([((lambda a: a.fit.remote(fit_batches, n_fit)), lambda r: self._fitted(r, caches)),
                           *[(hold(i), _ignore) for i in range(len(ahead))], *tasks])
            tasks = []
            self.pool.broadcast("load_state", self._files)
            held: dict[int, tuple[Any, list[str]]] = {}  # by worker: (worker, keys of the caches it holds)
            for i, actor in owners.items():
                held.setdefault(id(actor), (actor, []))[1].extend(key for key, _ in ahead[i])
            released = self.pool.on_each("release", list(held.values()))
            for blobs in released:
                self._store(blobs, caches)
            done = {key for blobs in released for key, _, _ in blobs}
            log.debug("%d chunks prefilled ahead while the codec was fitted", len(done))
            batches = [b for b in ahead if any(key not in done for key, _ in b)] + batches  # a holder died
        self.pool.run([*[((lambda a, b=b: a.caches.remote([b])), lambda r: self._store(r, caches))
                         for b in (batches if caches else [])], *tasks])
        if not caches:
            self.bar.update(sum(len(c.ids) for c in group))
        self.stats.kv_s += time.perf_counter() - t0
        self.stats.embed_s += sum(seconds for _, seconds in vectors.values())
        matrix = np.concatenate([vectors[s][0] for s in sorted(vectors)])
        self.rag.index.add([c.record for c in group], matrix)  # committed once its caches are stored

    def _fitted(self, result: tuple[dict[str, bytes], list[tuple[str, Blobs, int]]], caches: bool) -> None:
        """The codec state a worker fitted: saved (then marked fitted) before any blob coded with it."""
        self._files, blobs = result
        load_codec_state(self.codec, self._files)
        save_fitted(self.codec, self.state_dir, self.rag.lm.fingerprint, state_kept(self.rag.manifest))
        mark_fitted(self.state_dir)
        self._store(blobs, caches)

    def _store(self, chunks: list[tuple[str, Blobs, int]], caches: bool) -> None:
        for _, blobs, n in chunks:
            for stored, blob in blobs:
                self.rag.kvstore.store.put(stored, blob)
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
    levels = stored_stream_levels(rag.manifest, codec)
    ready = codec.needs_fit and codec_ready(codec, IndexLayout.of(rag.path).codec_state)
    state = codec_state_files(codec) if ready else None
    source = str(Path(rag.lm.source).resolve()) if Path(rag.lm.source).exists() else rag.lm.source  # any cwd
    setup = WorkerSetup(source, rag.lm.spec.dtype, rag.lm.fingerprint, rag.embedder.name,
                        tuple(rag.layout.prefix_ids), codec.name, codec.level, state, split,
                        _punkt(loaded, rag.lm, split), rag.batch_tokens, 1, levels)
    pool = WorkerPool(ray, setup, address, workers)
    try:
        with IndexLayout.of(rag.path).writer_lock():  # one writer at a time, as for the local build
            candidates = _split(pool, loaded)
            new = [c for c in candidates if c.record.key not in rag.index]
            stored = rag.kvstore.contains_levels
            todo = [c for c in candidates
                    if c.record.key not in rag.index or (caches and not stored(c.record.key, levels))]
            stats.chunks, stats.new_chunks = len(candidates), len(new)
            bar = tqdm(total=sum(len(c.ids) for c in todo), unit="tok", dynamic_ncols=True, disable=not show_progress,
                       desc=f"{'computing caches' if caches else 'embedding'} on {len(pool.actors)} Ray workers")
            run = _Run(pool, rag, stats, bar, levels)
            for start in range(0, len(todo), GROUP_CHUNKS):
                run.group(list(todo[start : start + GROUP_CHUNKS]), caches)
            bar.close()
    finally:
        pool.close()
    stats.total_s = time.perf_counter() - t0
    log.info("indexed %d new chunks on Ray (%d prefilled)", stats.new_chunks, stats.prefilled_chunks)
    return stats
