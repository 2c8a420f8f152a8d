"""The traffic benchmark's child processes: ``prepare`` (the index and vector stores) and ``segment`` (one process
lifetime of the stream). Run by ``run.py`` as ``python worker.py prepare|segment SPEC.json``; never by hand.

Contract:

- ``prepare`` builds, under the spec's ``work`` folder, what exists before traffic arrives: the kvrag index over the
  corpus when an index arm runs (``KVRag.build``, one passage = one chunk, kvrag's default codec), the user's two
  vector stores
  (`arms.build_stores`) and, when llama.cpp runs, its GGUF (`llama_server.gguf_for`). It writes ``prepared.json``.
- ``segment`` is one process lifetime: it starts llama.cpp's servers (when asked; one per framework), loads the
  model, opens every arm over the stores on disk (`arms.open_arms`), warms each arm up once on a prompt outside the
  corpus (untimed), checks that each server tokenizes the templated prompt as kvrag does, then answers the spec's
  stream positions in turn, every (framework, arm) per question, the first rotating by position. After each
  passage-cache answer it waits for the cache's background stores (``flush_s``, untimed), as idle time between
  requests would. Each answer is appended to ``rows.jsonl`` as it is made, with what each arm then holds
  (`arms.held`). The servers are stopped at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import arms as arms_mod  # noqa: E402
import traffic  # noqa: E402
from llama_server import LlamaServer, gguf_for  # noqa: E402


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the index, the vector stores and the GGUF (module docstring)."""
    import torch

    from kvrag.config import SplitConfig
    from kvrag.rag import KVRag

    torch.set_num_threads(spec["threads"])
    work = Path(spec["work"])
    passages = traffic.corpus_passages([Path(p) for p in spec["corpus"]])
    info: dict[str, Any] = {"passages": len(passages)}
    if spec["digest"]["index"]:  # only when an index arm runs
        t0 = time.perf_counter()
        split = SplitConfig(mode="document", max_tokens=spec["max_chunk_tokens"], min_tokens=0)
        rag = KVRag.build(passages, work / "index", model=spec["model"], split=split, device="cpu",
                          codec=spec.get("index_codec"), neighbour_context=spec.get("neighbour_context") or 0,
                          show_progress=False)
        info.update(index_build_s=time.perf_counter() - t0, chunks=len(rag.index), codec=rag.manifest["codec"],
                    corpus_tokens=sum(len(rag.context.chunk_ids(text)) for _, text in passages))
        rag.close()
    info.update(arms_mod.build_stores(passages, work / "stores"))
    if spec.get("llama_gguf"):
        info["gguf"] = str(gguf_for(spec["llama_gguf"], work / "gguf"))
    info["index_bytes"] = arms_mod.folder_bytes(work / "index")  # 0 without an index
    (work / "prepared.json").write_text(json.dumps({**spec["digest"], **info}, indent=2) + "\n")
    return info


def _servers(spec: dict[str, Any], work: Path, out: Path) -> dict[str, LlamaServer]:
    """One llama.cpp server per framework (none without the llama.cpp arm)."""
    if "llama.cpp" not in spec["arms"]:
        return {}
    prepared = json.loads((work / "prepared.json").read_text())
    return {fw: LlamaServer(Path(prepared["gguf"]), out / f"llama-server-{fw}.log", spec["threads"], spec["n_ctx"],
                            binary=spec.get("llama_server_bin"), cache_reuse=spec["cache_reuse"],
                            cache_type=spec["llama_cache_type"], extra=spec.get("llama_args", []))
            for fw in spec["frameworks"]}


def segment(spec: dict[str, Any]) -> dict[str, Any]:
    """Answer the spec's stream positions in one process lifetime (module docstring)."""
    t_start = time.perf_counter()
    work, out = Path(spec["work"]), Path(spec["out"])
    servers = _servers(spec, work, out)
    info: dict[str, Any] = {"segment": spec["segment"], "positions": [spec["start"], spec["stop"]],
                            "pid": os.getpid(), "servers": {}}
    try:
        for fw, server in servers.items():
            server.start()
            info["servers"][fw] = {"kind": server.kind, "startup_s": server.startup_s, "command": server.command()}
        return _answer(spec, work, out, servers, info, t_start)
    finally:
        for server in servers.values():
            server.stop()


def _answer(spec: dict[str, Any], work: Path, out: Path, servers: dict[str, LlamaServer], info: dict[str, Any],
            t_start: float) -> dict[str, Any]:
    import torch

    from kvrag.model import load_model
    from kvrag.query.locate import chat_prompt

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    lm = load_model(spec["model"], device="cpu")
    retrievers = arms_mod.Retrievers(work / "stores")
    arms = arms_mod.open_arms(spec["frameworks"], spec["arms"], lm, work / "index", work / "caches", retrievers,
                              spec["k"], spec["max_new_tokens"], servers)
    info["open_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for arm in arms:  # untimed: lazy initialisation and the template's head, on a prompt outside the corpus
        arm.warm()
        if hasattr(arm.backend, "flush"):
            arm.backend.flush()
    info["warm_up_s"] = time.perf_counter() - t0
    info["ready_s"] = time.perf_counter() - t_start

    def count_tokens(text: str) -> int:
        return len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])

    server_base: dict[str, int | None] = {}
    probe = chat_prompt(lm.tokenizer, arms_mod.RAG_PROMPT.format(question=arms_mod.WARM_UP_QUESTION,
                                                                  context=arms_mod.WARM_UP_CONTEXT))
    ours = lm.tokenizer(probe, add_special_tokens=False)["input_ids"]
    for fw, server in servers.items():  # the server prefills the token ids kvrag prefills for the same text
        theirs = server.tokenize(probe)
        server_base[fw] = server.rss_bytes()
        info["servers"][fw].update(tokens_match=list(ours) == list(theirs),
                                   tokens={"kvrag": len(ours), "server": len(theirs)},
                                   rss_after_warm_up=server_base[fw])
    index_bytes = arms_mod.folder_bytes(work / "index")
    stream = [json.loads(line) for line in Path(spec["stream"]).read_text().splitlines() if line.strip()]
    phases = traffic.phases(len(stream), spec["restarts"], spec["window"])
    ids = {text: pid for pid, text in traffic.corpus_passages([Path(p) for p in spec["corpus"]])}
    rows_path = out / "rows.jsonl"
    for position in range(spec["start"], spec["stop"]):
        q = stream[position]
        t_q = time.perf_counter()
        start = position % len(arms)
        for order, arm in enumerate(arms[start:] + arms[:start]):
            row = arms_mod.timed(arm, q["question"], count_tokens)
            flush_s = 0.0
            if hasattr(arm.backend, "flush") and arm.name != "full":
                t_f = time.perf_counter()
                arm.backend.flush()
                flush_s = time.perf_counter() - t_f
            passages = row.pop("passages")
            row.update(position=position, phase=phases[position], segment=spec["segment"], item=q["item"],
                       variant=q["variant"], question=q["question"], golds=q["answers"], framework=arm.framework,
                       arm=arm.name, order=order, flush_s=flush_s,
                       passage_ids=[ids.get(p.strip(), "?") for p in passages],
                       held=arms_mod.held(arm, index_bytes, server_base.get(arm.framework)))
            with open(rows_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(_strict(row), default=_plain, allow_nan=False) + "\n")
        print(f"question {position + 1}/{len(stream)} ({phases[position]}) {time.perf_counter() - t_q:.1f}s",
              flush=True)
    for arm in arms:
        close = getattr(arm.backend, "close", None)
        if close is not None:
            close()
    info["segment_s"] = time.perf_counter() - t_start
    return info


def _strict(value: Any) -> Any:
    """``value`` with NaN and infinities as None (an answer with no non-blank piece has no TTFT)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)


def main() -> None:
    command, spec_path = sys.argv[1], Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    if command == "prepare":
        result = prepare(spec)
    elif command == "segment":
        result = segment(spec)
    else:
        raise SystemExit(f"unknown command {command!r}")
    spec_path.with_suffix(".result.json").write_text(json.dumps(result, indent=2, default=_plain) + "\n")


if __name__ == "__main__":
    main()
