"""Every benchmark's command-line options: ``kvrag bench NAME``'s arguments, read before the benchmark loads.

Contract: `BENCHES` maps each benchmark (the module ``kvrag.bench.<name>``, which runs it with ``run(args)``) to its
one-line help and the function that adds its options to a parser. This module imports nothing heavy, so that
``kvrag bench NAME --help`` and a usage error answer at once; the benchmark's module is imported only to run it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvrag.bench.archs import ARCHS
from kvrag.config import ATTENTION_KERNELS

DEFAULT_MODES = ("full,prefix,reuse,cacheblend@0.05,cacheblend@0.15,cacheblend@0.25,probe@0.15,"
                 "attnlink@4,attnlink@16,attnlink@32")
DEFAULT_SPEED_MODES = "full,prefix,reuse,cacheblend@0.15,probe@0.15,attnlink@16"


def schedule_options(parser: argparse.ArgumentParser) -> None:
    """The flags that set ``cacheblend``'s gradual filtering for every mode of a bench run."""
    parser.add_argument("--check-layers", default=None, metavar="L,L,...",
                        help="cacheblend's check layers (its option check_layers; default 1,2,3)")
    parser.add_argument("--first-ratio-scale", type=float, default=None, metavar="S",
                        help="cacheblend keeps min(1, S x ratio) of the chunk tokens at its first check layer, "
                             "narrowing geometrically to the ratio at its last (its option first_ratio_scale; "
                             "default 2; 1 keeps the ratio from the first check on)")


def quality_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--model", default="smollm2", help="HF id/folder, .gguf file, or 'smollm2'")
    parser.add_argument("--n", type=int, default=20, help="questions (the first N of the file)")
    parser.add_argument(
        "--modes", default=DEFAULT_MODES,
        help="comma list: full, prefix, reuse, cacheblend@R, probe@R, attnlink@K, full@DTYPE (full prefill with "
             "the model loaded in bfloat16/float16/float32: how far precision alone moves the answer, the floor "
             "under every agreement and ΔNLL)",
    )
    schedule_options(parser)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--max-chunk-tokens", type=int, default=2048, help="passages longer than this are split")
    parser.add_argument("--warmup", type=int, default=1, help="questions answered by every mode first, not counted")
    parser.add_argument("--neighbour-context", type=int, default=None, metavar="N",
                        help="build the caches after each passage's N nearest passages (KVRag.build "
                             "neighbour_context; default 0, an existing --index keeps its own)")
    parser.add_argument("--neighbour-kv", default=None, choices=["stored", "prefill"],
                        help="how the neighbours are put before a chunk (KVRag.build neighbour_kv)")
    parser.add_argument("--neighbour-pool", default=None, metavar="FILE,...",
                        help="QA JSONL files (their passages) or corpus JSON files (a list of {title, text}) "
                             "indexed without caches before the questions' passages, so that neighbour context "
                             "chooses each passage's neighbours from a corpus, not from the benchmark's passages "
                             "alone")
    parser.add_argument("--question-tail", default="", metavar="TEXT",
                        help="a line put right after each question (KVRag.build question_tail; an existing "
                             "--index keeps its own)")
    parser.add_argument("--index", default=None, help="index directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="bench-out/quality", help="output directory")



def speed_options(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF id/folder, .gguf file, or 'smollm2' (real weights)")
    src.add_argument("--arch", default=None, choices=sorted(ARCHS), help="published shape, random weights")
    parser.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens (chunks only)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--modes", default=DEFAULT_SPEED_MODES)
    parser.add_argument("--tiers", default="disk,ram",
                        help="where the chunk caches are loaded from: disk (the store), ram (host memory, "
                             "pinned on CUDA), gpu (resident in GPU memory); comma list")
    parser.add_argument("--codec", default="raw", help="codec of the stored caches: raw, int8, cachegen "
                        "(fitted on the first length's chunks)")
    parser.add_argument("--attention", default=None, choices=ATTENTION_KERNELS,
                        help="kernel for selections spread over the prompt (FuseConfig.attention), every mode "
                        "(default: each mode's own, auto unless it ends in +KERNEL, e.g. probe@0.15+blocks)")
    schedule_options(parser)
    parser.add_argument("--store-mbps", type=float, default=None, metavar="MB/S",
                        help="read the disk tier through one link of this many MB/s (a remote store; "
                             "`kvrag.storage.stores.ThrottledStore`); default: the local disk as it is")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, …")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out/speed", help="output directory")



def codec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", required=True, help="index directory whose chunk caches are measured")
    parser.add_argument("--n-chunks", type=int, default=64,
                        help="chunks measured (after --fit-chunks used to fit; default 64)")
    parser.add_argument("--fit-chunks", type=int, default=128, help="chunks used to fit codecs (default 128)")
    parser.add_argument("--codecs", default="raw,int8,cachegen", help="comma list of codec names")
    parser.add_argument("--levels", default=None, help="comma list of levels (default: every level)")
    parser.add_argument("--repeats", type=int, default=3, help="decode passes; the fastest counts")
    parser.add_argument("--qa", default=None,
                        help="QA JSONL whose first --qa-n questions' passages are chunks of the index: "
                             "also measure the effect of each codec level on their answers")
    parser.add_argument("--qa-n", type=int, default=6, help="questions for --qa (default 6)")
    parser.add_argument("--qa-modes", default="reuse,cacheblend@0.15",
                        help="comma list of fusion modes for --qa (default reuse,cacheblend@0.15)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="answer length for --qa (default 16)")
    parser.add_argument("--json", default=None, help="write the rows (and run stamp) as JSON here")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here")



def decode_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=8, help="key/value heads (Llama-3.1-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4, help="layers per region")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--distinct", type=int, default=4, help="distinct chunks encoded (repeated in a region)")
    parser.add_argument("--chunks", default="8,32,128", help="region sizes in chunks")
    parser.add_argument("--level", type=int, default=None, help="codec level (default: the codec's own)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="bench-out/decode")



def build_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="QA JSONL whose questions' passages are indexed")
    parser.add_argument("--n", type=int, default=12, help="questions, from the first (default 12)")
    parser.add_argument("--fit", type=int, default=4,
                        help="of those, questions whose passages the warm-up index holds (default 4)")
    parser.add_argument("--model", default="smollm2", help="model id, folder, .gguf file or 'smollm2'")
    parser.add_argument("--codecs", default="raw,cachegen", help="comma list of codecs (default raw,cachegen)")
    parser.add_argument("--repeats", type=int, default=2, help="builds and plain prefills per codec; best counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="prefill batch size in tokens")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--out", default="bench-build", help="output directory (build.json, build.md)")


BENCHES: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "quality": ("Answer quality and TTFT of every fusion mode against full prefill, on a QA JSONL data set.",
                quality_options),
    "speed": ("TTFT against context length for every fusion mode, with the chunks' caches pre-stored on disk.",
              speed_options),
    "codec": ("Codec benchmark: size, ratio against bf16, encode and decode speed and reconstruction error of "
              "every codec and level.", codec_options),
    "decode": ("Decoder throughput: GB/s of K/V that the ``cachegen`` region decoder gives on a device, checked "
               "against the host.", decode_options),
    "build": ("Index-build benchmark: the cache phase's throughput against a plain prefill of the same chunks.",
              build_options),
}
