"""Bandwidth-adaptive streaming over a shaped link: TTFT and agreement with ``full`` for fixed levels vs ``ttft_slo``.

Redis and this client run in a network namespace of their own (``unshare -n``; root), so that shaping its
loopback touches nothing else: the script re-executes itself there, brings ``lo`` up with an MTU of 1500 and
starts a ``redis-server`` on it. It builds one index into that Redis over the passages of ``--questions``
questions (one passage = one chunk), its caches at every ``cachegen`` level (the index's own, 2, and 0, 1, 3 as
``--stream-levels``). Then, for each rate of ``--rates`` (Mbit/s), it shapes ``lo`` with
``tc qdisc replace dev lo root tbf rate R burst B latency L`` and answers every question, modes interleaved
(the starting one rotated per question): ``full`` (no cache loaded: the reference), the stored caches at each
fixed level, and the adaptive loader (``FuseConfig.ttft_slo``). The local cache is off (``cache_bytes=0``), so every
chunk crosses the link. Before each rate's questions one untimed answer measures the link (the loader plans
with the throughput of the store's recent reads).

    python benchmarks/streaming/run.py --data $QA/hotpotqa_ircot.jsonl --questions 6 --k 4 --ttft-slo 4 \
        --max-new-tokens 8 --out benchmarks/streaming/hotpotqa-6q

Writes ``rows.jsonl`` (one row per question, rate and setting, with the adaptive plan), ``summary.json``,
``summary.md`` and ``ttft.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrag import FuseConfig, KVRag, SplitConfig, StoreConfig
from kvrag.bench.common import markdown_table, pyplot, save_plot, set_threads, stamp, write_json
from kvrag.bench.metrics import agreement, first_token_agreement
from kvrag.bench.qa_data import load_questions, passage_documents
from kvrag.storage.kvstore import KVStore

LEVELS = (0, 1, 2, 3)  # cachegen's; the index's own is 2
INSIDE = "KVRAG_STREAMING_NETNS"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="QA JSONL (id, question, answers, ctxs)")
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rates", default="1000,100,20,5", help="link rates in Mbit/s, comma-separated")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="the adaptive loader's TTFT target (s)")
    p.add_argument("--mode", default="probe", help="fusion mode of every cached setting (gate off)")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--latency-ms", type=float, default=50.0, help="tbf's latency (queue) bound")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--levels", default="0,2,3", help="fixed levels measured besides the adaptive loader")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--from-rows", action="store_true", help="only summarize the rows.jsonl already in --out")
    return p.parse_args()


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def shape(rate_mbit: float, latency_ms: float) -> None:
    """Shape ``lo`` to ``rate_mbit`` with a token bucket (burst: 4 ms of the rate, at least 32 KiB)."""
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
    sh("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
       "latency", f"{latency_ms}ms")


class FixedLevel(KVStore):
    """The index's caches read at one fixed level (the loading a non-adaptive client does)."""

    def __init__(self, base: KVStore, level: int) -> None:
        super().__init__(base.store, base.codec, base.fingerprint)
        self.level = level

    def reader(self, key: str, level: int | None = None) -> Any:
        return super().reader(key, self.level if level is None else level)


def start_redis(port: int) -> subprocess.Popen[bytes]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
    import redis

    for _ in range(200):
        try:
            redis.Redis(port=port).ping()
            return proc
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not answer")


def answer(rag: KVRag, item: dict[str, Any], setting: str, args: argparse.Namespace) -> Any:
    ctx = rag.context  # what the question-time stages read; its store is swapped for a fixed level
    base = ctx.kvstore
    if setting == "full":
        return rag.answer(item["question"], k=args.k, mode="full", max_new_tokens=args.max_new_tokens, gate=False)
    config = FuseConfig(mode=args.mode, ratio=args.ratio,
                        ttft_slo=args.ttft_slo if setting == "adaptive" else None)
    if setting != "adaptive":
        ctx.kvstore = FixedLevel(base, int(setting.removeprefix("L")))
    try:
        return rag.answer(item["question"], k=args.k, max_new_tokens=args.max_new_tokens, fuse_config=config)
    finally:
        ctx.kvstore = base


def run(args: argparse.Namespace) -> None:
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "set", "lo", "mtu", "1500")
    set_threads(args.threads)
    items = load_questions(args.data, args.questions)
    rates = [float(r) for r in args.rates.split(",")]
    fixed = [f"L{lv}" for lv in args.levels.split(",")]
    settings = ["full", *fixed, "adaptive"]
    args.out.mkdir(parents=True, exist_ok=True)
    out = (args.out / "rows.jsonl").open("w")
    port = 6390
    server = start_redis(port)
    rows: list[dict[str, Any]] = []
    try:
        url = f"redis://127.0.0.1:{port}/0"
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            KVRag.build(passage_documents(items), Path(tmp) / "idx", model=args.model, split=SplitConfig(
                mode="document", max_tokens=512), store=url, stream_levels=(0, 1, 3), show_progress=False).close()
            build_s = time.perf_counter() - t0
            store = StoreConfig(cache_bytes=0, timeout_s=60.0)
            with KVRag.open(Path(tmp) / "idx", store=store) as rag:
                keys = list(rag.index.keys())
                sizes = rag.kvstore.level_sizes(keys)
                per_level = {lv: statistics.mean(s[lv] for s in sizes) for lv in LEVELS}
                answer(rag, items[0], "L2", args)  # model, kernels and the recompute fit warmed up, unshaped
                refs = {item["id"]: answer(rag, item, "full", args) for item in items}  # loads nothing: any rate
                for rate in rates:
                    shape(rate, args.latency_ms)
                    rag.kvstore.store.meter.reset()
                    answer(rag, items[-1], "L2", args)  # the link measured by one load before the timed ones
                    for q, item in enumerate(items):
                        timed = settings[1:]
                        order = timed[q % len(timed):] + timed[: q % len(timed)]
                        got = {"full": refs[item["id"]], **{s: answer(rag, item, s, args) for s in order}}
                        ref = got["full"]
                        for s in settings:
                            a = got[s]
                            row = {"rate_mbit": rate, "question": item["id"], "setting": s, "ttft_s": a.ttft_s,
                                   "load_s": a.timings.get("load_s"), "answer": a.text,
                                   "agreement": agreement(a.text, ref.text),
                                   "first_token": first_token_agreement(a.token_ids, ref.token_ids)}
                            if s == "adaptive" and a.load_plan is not None:
                                row["plan"] = a.load_plan.to_json()
                            rows.append(row)
                            out.write(json.dumps(row) + "\n")
                            out.flush()
                        print(rate, item["id"], {s: round(got[s].ttft_s, 3) for s in settings}, flush=True)
    finally:
        out.close()
        server.kill()
        server.wait(10)
    (args.out / "sizes.json").write_text(json.dumps({"chunk_bytes_by_level": per_level, "build_s": build_s}) + "\n")
    summarize(args)


def summarize(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in (args.out / "rows.jsonl").read_text().splitlines() if line.strip()]
    rates = list(dict.fromkeys(r["rate_mbit"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    done = {(r["rate_mbit"], r["question"]) for r in rows if r["setting"] == "adaptive"}
    rows = [r for r in rows if (r["rate_mbit"], r["question"]) in done]  # whole questions only
    stored = json.loads((args.out / "sizes.json").read_text()) if (args.out / "sizes.json").exists() else {}
    per_level = {int(k): v for k, v in stored.get("chunk_bytes_by_level", {}).items()}
    table = []
    summary: dict[str, Any] = {"rates_mbit": rates, "settings": {}}
    for s in settings:
        entry = {}
        for rate in rates:
            mine = [r for r in rows if r["setting"] == s and r["rate_mbit"] == rate]
            ttft = [r["ttft_s"] for r in mine]
            entry[str(rate)] = {
                "ttft_median_s": statistics.median(ttft), "ttft_mean_s": statistics.mean(ttft),
                "within_slo": sum(t <= args.ttft_slo for t in ttft) / len(ttft),
                "agreement": statistics.mean(r["agreement"] for r in mine),
                "first_token": statistics.mean(r["first_token"] for r in mine)}
            if s == "adaptive":
                picks = [c["level"] for r in mine for c in r["plan"]["chunks"]]
                entry[str(rate)]["picks"] = {str(k): picks.count(k) for k in sorted(set(picks), key=str)}
        summary["settings"][s] = entry
    for s in settings:
        for rate in rates:
            e = summary["settings"][s][str(rate)]
            table.append([s, f"{rate:g}", e["ttft_median_s"], e["within_slo"], e["agreement"], e["first_token"],
                          json.dumps(e.get("picks", "")).replace('"', "")])
    md = markdown_table(["setting", "Mbit/s", "TTFT median (s)", f"TTFT ≤ {args.ttft_slo:g} s", "agreement (F1)",
                         "first token", "adaptive picks (level: chunks)"], table)
    sizes = ", ".join(f"L{lv} {per_level[lv] / 1024:.0f} KiB" for lv in sorted(per_level))
    n = len({r["question"] for r in rows})
    (args.out / "summary.md").write_text(f"{n} questions; mean stored chunk: {sizes}.\n\n{md}\n")
    write_json(args.out / "summary.json", {**public_stamp(args), **summary, "questions_done": n, **stored})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in settings:
        ax.plot(rates, [summary["settings"][s][str(r)]["ttft_median_s"] for r in rates], marker="o",
                lw=2.5 if s == "adaptive" else 1.2, ls="--" if s == "full" else "-",
                label=f"adaptive (slo {args.ttft_slo:g} s)" if s == "adaptive" else s)
    ax.axhline(args.ttft_slo, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s, tbf on a namespaced loopback)")
    ax.set_ylabel("median TTFT (s)")
    save_plot(plt, fig, ax, args.out / "ttft.png",
              f"SmolLM2-135M, {args.questions} questions, k={args.k}, {args.mode}@{args.ratio:g}: TTFT vs bandwidth")
    print(md)


def public_stamp(args: argparse.Namespace) -> dict[str, Any]:
    """`stamp` with the data file named as ``$QA/<file>`` (the data lives outside the repository)."""
    out = stamp(args)
    data = str(args.data)
    public = f"$QA/{args.data.name}"
    out["options"] = {k: public if k == "data" else str(v) if isinstance(v, Path) else v
                      for k, v in out["options"].items()}
    out["command"] = "python benchmarks/streaming/run.py " + " ".join(
        public if a == data else a for a in sys.argv[1:])
    return out


def main() -> None:
    args = parse_args()
    if args.from_rows:
        summarize(args)
        return
    if os.environ.get(INSIDE) != "1":  # into a network namespace of our own, whose loopback we may shape
        os.environ[INSIDE] = "1"
        os.execvp("unshare", ["unshare", "-n", sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    run(args)


if __name__ == "__main__":
    main()
