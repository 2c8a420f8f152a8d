"""The ``kvrag`` command: ``index``, ``ask``, ``info`` and ``bench …``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

from kvrag.config import DEFAULT_MODE, FUSE_MODES, SplitConfig
from kvrag.errors import KVRagError


def _index(args: argparse.Namespace) -> int:
    from kvrag.prompt import DEFAULT_INSTRUCTION
    from kvrag.rag import KVRag

    docs = [Path(p) for p in args.paths]
    split = SplitConfig(mode=args.split, max_tokens=args.max_tokens, min_tokens=min(args.min_tokens, args.max_tokens))
    rag = KVRag.build(docs, args.index, model=args.model, embedder=args.embedder, split=split,
                      codec=args.codec, codec_level=args.codec_level, index_kind=args.index_kind,
                      dtype=args.dtype, device=args.device, batch_tokens=args.batch_tokens,
                      neighbour_context=args.neighbour_context, neighbour_kv=args.neighbour_kv,
                      show_progress=not args.quiet, caches=not args.lazy,
                      instruction=DEFAULT_INSTRUCTION if args.instruction is None else args.instruction,
                      question_tail=args.question_tail)
    print(f"{args.index}: {len(rag.index)} chunks")
    rag.close()
    return 0


def _ask(args: argparse.Namespace) -> int:
    from kvrag.rag import KVRag

    rag = KVRag.open(args.index, device=args.device)
    kwargs = dict(k=args.k, mode=args.mode, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
    if args.stream and not args.json:
        for piece in rag.stream(args.question, **kwargs):  # type: ignore[arg-type]
            print(piece, end="", flush=True)
        print()
        answer = rag.last_answer
    else:
        answer = rag.answer(args.question, **kwargs)  # type: ignore[arg-type]
    assert answer is not None
    if args.json:
        print(json.dumps(answer.to_json(), indent=2))
    elif not args.stream:
        print(answer.text)
    if not args.json:
        t = answer.timings
        print(f"[{answer.mode} ttft={answer.ttft_s * 1000:.0f} ms: retrieve {t['retrieve_s'] * 1000:.0f}, "
              f"load {t['load_s'] * 1000:.0f}, fuse {t['fuse_s'] * 1000:.0f}; chunks "
              f"{', '.join(c.key[:10] for c in answer.chunks)}]", file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    from kvrag.storage.chunk_index import ChunkIndex

    index = ChunkIndex.open(args.index)
    print(json.dumps({"chunks": len(index), "manifest": index.manifest}, indent=2))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvrag.bench import BENCHES

    bench = sub.add_parser("bench", help="benchmarks (ratios against 'full' measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        try:
            module = importlib.import_module(f"kvrag.bench.{name}")
        except ImportError:
            continue
        parser = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrag", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("index", help="build or extend an index over files or folders")
    p.add_argument("paths", nargs="+", help="files or folders (.txt .md .rst .json .jsonl)")
    p.add_argument("--index", required=True, help="index directory")
    p.add_argument("--model", default="smollm2", help="HF id/folder, .gguf file, or 'smollm2'")
    p.add_argument("--embedder", default=None, help="sentence-transformers model (default all-MiniLM-L6-v2)")
    p.add_argument("--codec", default="raw", help="chunk-cache codec: raw (lossless), int8, cachegen")
    p.add_argument("--codec-level", type=int, default=None, help="codec quality level (cachegen: 0-3, default 1)")
    p.add_argument("--split", default="semantic", choices=["semantic", "fixed", "document"])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--index-kind", default="flat", choices=["flat", "hnsw"])
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--neighbour-context", type=int, default=None, metavar="N",
                   help="compute each chunk's cache after its N nearest chunks (default 0; an index keeps its own)")
    p.add_argument("--neighbour-kv", default=None, choices=["stored", "prefill"],
                   help="with --neighbour-context: place the neighbours' stored caches before a chunk (default for a "
                        "new index; about the cost of a plain build again) or prefill their tokens with it (exact, "
                        "up to N+1 times the cost)")
    p.add_argument("--lazy", action="store_true",
                   help="index the chunks for retrieval only: each chunk's cache is computed the first time a "
                        "question uses it (a later run without --lazy computes the missing ones)")
    p.add_argument("--instruction", default=None,
                   help="system instruction before the passages (a new index only; default: kvrag.prompt's)")
    p.add_argument("--question-tail", default="",
                   help="a line put right after each question, e.g. how to answer (a new index only; default none)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_index)

    p = sub.add_parser("ask", help="answer a question from an index")
    p.add_argument("index")
    p.add_argument("question")
    p.add_argument("--mode", default=DEFAULT_MODE, choices=FUSE_MODES)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--json", action="store_true", help="print answer, mode, ratio, TTFT and chunk ids as JSON")
    p.set_defaults(func=_ask)

    p = sub.add_parser("info", help="print an index's manifest and size")
    p.add_argument("index")
    p.set_defaults(func=_info)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (KVRagError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"kvrag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
