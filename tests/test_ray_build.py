"""Index builds on Ray (`kvrag.indexing.ray_build`): the same index as the single-process build, resumed after a
worker or the driver is killed. The module starts its own local Ray cluster (2 CPUs) and fails, never skips,
when Ray cannot start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from kvrag import KVRag, KVRagError, SplitConfig
from kvrag.indexing.build import FIT_CHUNKS
from kvrag.storage.verify import verify_index

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["reactor", "station", "river", "forest", "bridge", "harbour", "tower", "canal", "garden", "mine"]
FIXED = SplitConfig(mode="fixed", max_tokens=24, min_tokens=4)
SEMANTIC = SplitConfig(max_tokens=40, min_tokens=8)


def _doc(i: int) -> tuple[str, str]:
    t = TOPICS[i % 10]
    return (f"d{i}", f"The {t} number {i} was built by team {i * 7 % 13}. It is near the {TOPICS[(i + 3) % 10]}.\n\n"
                     f"Its keeper is called Ada {i}. The {t} holds {i * 11} crates of salt and {i * 5} lamps. "
                     f"Visitors come in spring to see the {t}. Dr. Smith wrote about it in {1900 + i}.")


DOCS = [_doc(i) for i in range(12)]
MANY = [_doc(i) for i in range(12, 42)]  # enough chunks (one task each) for a kill to land mid-build


@contextlib.contextmanager
def one_thread():
    """Torch on one thread, as each of two Ray workers on two CPUs runs it: a float sum's order (so the last bit
    of a cache) can depend on the thread count, and the single-process build compared with must match it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster of the tests' own (2 CPUs, no dashboard): its GCS address. Fails when it cannot start."""
    try:
        import ray
    except ImportError:
        pytest.fail("ray is not installed; the Ray build tests need it: pip install kvrag[ray] (or kvrag[dev])")
    try:
        info = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - whatever stops Ray from starting fails the module, saying why
        pytest.fail(f"a local Ray cluster could not start: {type(exc).__name__}: {exc}")
    yield info.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_lm, tmp_path_factory):
    """The single-process build of MANY (raw codec, one chunk per model call)."""
    path = tmp_path_factory.mktemp("reference") / "idx"
    with one_thread():
        KVRag.build(MANY, path, model=tiny_lm, split=FIXED, codec="raw", batch_tokens=1, show_progress=False).close()
    return path


def _blob(index: Path, key: str) -> bytes:
    return (index / "chunks" / key[:2] / f"{key}.kvc").read_bytes()


def _vectors(rag: KVRag) -> dict[str, np.ndarray]:
    flat = faiss.read_index(str(rag.path / "vectors.faiss"))
    return {rec.key: flat.reconstruct(i) for i, rec in enumerate(rag.index.records())}


def _stored(path: Path) -> set[str]:
    return {p.stem for p in (path / "chunks").glob("*/*.kvc")}


def test_a_ray_build_gives_the_single_process_index(tiny_lm, ray_address, tmp_path):
    # semantic split: Punkt trained by the driver (no pretrained data here) and semantic shifts on the workers
    with one_thread():
        local = KVRag.build(DOCS, tmp_path / "local", model=tiny_lm, split=SEMANTIC, codec="raw", show_progress=False)
    on_ray = KVRag.build(DOCS, tmp_path / "ray", model=tiny_lm, split=SEMANTIC, codec="raw", show_progress=False,
                         engine="ray", workers=2)
    keys = local.index.keys()
    assert on_ray.index.keys() == keys and len(keys) > 12
    records = {r.key: (r.doc_id, r.seq, r.text, r.n_tokens, r.source) for r in local.index.records()}
    assert {r.key: (r.doc_id, r.seq, r.text, r.n_tokens, r.source) for r in on_ray.index.records()} == records
    assert all(_blob(on_ray.path, key) == _blob(local.path, key) for key in keys)  # bit for bit
    want, got = _vectors(local), _vectors(on_ray)
    assert all(np.allclose(got[key], want[key], atol=1e-5) for key in keys)
    question = "Who keeps the reactor?"
    assert on_ray.answer(question, k=2, max_new_tokens=4).token_ids == \
           local.answer(question, k=2, max_new_tokens=4).token_ids
    local.close()
    on_ray.close()


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / x.float().norm())


def test_a_fitted_codec_and_its_stream_levels_on_ray(tiny_lm, ray_address, reference, tmp_path, caplog):
    # more chunks than the codec is fitted on: while one worker fits `cachegen`, the other prefills ahead and
    # encodes once the state reaches it. Every level comes from the workers as from a local build: the same
    # stored keys, each level close to the exact cache, coarser levels further from it
    docs = MANY
    exact = KVRag.open(reference, model=tiny_lm)
    with one_thread():
        local = KVRag.build(docs, tmp_path / "local", model=tiny_lm, split=FIXED, codec="cachegen",
                            stream_levels=(0, 3), show_progress=False, codec_state="index")
    with caplog.at_level(logging.DEBUG, logger="kvrag.indexing.ray_build"):  # each fits its own state
        on_ray = KVRag.build(docs, tmp_path / "ray", model=tiny_lm, split=FIXED, codec="cachegen",
                             stream_levels=(0, 3), show_progress=False, engine="ray", workers=2, codec_state="index")
    keys = on_ray.index.keys()
    assert keys == local.index.keys() == exact.index.keys() and len(keys) > FIT_CHUNKS
    ahead = re.search(r"(\d+) chunks prefilled ahead while the codec was fitted", caplog.text)
    assert ahead and 0 < int(ahead.group(1)) <= FIT_CHUNKS, caplog.text[-2000:]
    assert _stored(on_ray.path) == _stored(local.path) and len(_stored(on_ray.path)) == 3 * len(keys)
    for key in keys:
        want = exact.kvstore.load(key)
        errors = [sum(_rel_err(w, g) for w, g in zip(want, on_ray.kvstore.load(key, level))) for level in (0, 2, 3)]
        assert errors == sorted(errors, reverse=True) and errors[-1] < 0.2, (key, errors)
    assert on_ray.add(docs, show_progress=False, engine="ray", workers=1).prefilled_chunks == 0  # all levels there
    for rag in (exact, local, on_ray):
        rag.close()


def _kill_when(path: Path, count: int, victims, killed: list[int], timeout: float = 300) -> threading.Thread:
    """A thread that kills the processes ``victims()`` names once ``count`` caches are stored under ``path``."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.is_dir() and len(_stored(path)) >= count:
                pids = victims()
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                if pids:
                    return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _workers() -> list[int]:
    """The processes of this test's Ray cluster (under this process) that hold a `KVBuildWorker` (proctitle)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), (entry / "cmdline").read_bytes())
        except (ValueError, OSError, IndexError):
            continue

    def ours(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid][0]
            if pid == os.getpid():
                return True
        return False

    return sorted(pid for pid, (_, cmd) in parents.items() if b"KVBuildWorker" in cmd and ours(pid))


CLI = "import sys; from kvrag.cli import main; sys.exit(main(sys.argv[1:]))"


def test_killed_driver_and_workers_are_resumed_from(tiny_lm, tiny_model_dir, ray_address, reference, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for doc_id, text in MANY:
        (docs / f"{doc_id}.txt").write_text(text)
    path, n_total = tmp_path / "idx", len(KVRag.open(reference, model=tiny_lm).index)
    # 1. `kvrag index --engine ray` joins the cluster; its driver process is killed mid-build
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = ["index", str(docs), "--index", str(path), "--model", str(tiny_model_dir), "--codec", "raw", "--split",
            "fixed", "--max-tokens", "24", "--min-tokens", "4", "--batch-tokens", "1", "-q",
            "--engine", "ray", "--address", ray_address, "--workers", "2"]
    driver = subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    killed: list[int] = []
    watcher = _kill_when(path, 25, lambda: [driver.pid], killed)
    driver.wait(300)
    watcher.join()
    assert killed and driver.returncode == -signal.SIGKILL, f"the driver was not killed (exit {driver.returncode})"
    after_driver = _stored(path)
    assert 25 <= len(after_driver) < n_total, "the driver was not killed mid-build"
    # 2. the re-run: both its workers are killed mid-build, so it stops and says to run it again
    killed.clear()
    watcher = _kill_when(path, len(after_driver) + 20, _workers, killed)
    with KVRag.open(path, model=tiny_lm) as rag:
        with pytest.raises(KVRagError, match="every Ray worker died.*run the build again"):
            rag.add(docs, show_progress=False, engine="ray", workers=2)
    watcher.join()
    assert len(killed) >= 2, f"killed {killed}"
    after_workers = _stored(path)
    assert len(after_driver) + 20 <= len(after_workers) < n_total, "the workers were not killed mid-build"
    # 3. the next re-run: one of its workers is killed and the other takes over its work; it finishes
    killed.clear()
    watcher = _kill_when(path, len(after_workers) + 20, lambda: _workers()[:1], killed)
    with KVRag.open(path, model=tiny_lm) as rag:
        stats = rag.add(docs, show_progress=False, engine="ray", workers=2)
    watcher.join()
    assert len(killed) == 1, f"killed {killed}"
    assert stats.prefilled_chunks == n_total - len(after_workers)  # only what was missing, each chunk once
    with KVRag.open(reference, model=tiny_lm) as ref, KVRag.open(path, model=tiny_lm) as got:
        assert got.index.keys() == ref.index.keys()
        assert all(_blob(path, key) == _blob(reference, key) for key in ref.index.keys())
    assert verify_index(path).ok


def test_bad_options_are_refused_in_one_line(tiny_lm, tmp_path, monkeypatch):
    with KVRag.build(DOCS[:2], tmp_path / "nb", model=tiny_lm, split=FIXED, neighbour_context=1, codec="raw",
                     show_progress=False) as rag:
        with pytest.raises(KVRagError, match="neighbour context"):
            rag.add(DOCS[2:4], show_progress=False, engine="ray")
        with pytest.raises(KVRagError, match="engine must be one of"):
            rag.add(DOCS[2:4], show_progress=False, engine="spark")
    with KVRag.build(DOCS[:2], tmp_path / "plain", model=tiny_lm, split=FIXED, codec="raw",
                     show_progress=False) as rag:
        monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
        with pytest.raises(KVRagError, match=r"pip install kvrag\[ray\]") as info:
            rag.add(DOCS[2:4], show_progress=False, engine="ray", workers=1)
        assert "\n" not in str(info.value)
        with pytest.raises(KVRagError, match="workers"):
            rag.add(DOCS[2:4], show_progress=False, engine="ray", workers=0)
