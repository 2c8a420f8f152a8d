"""What every ``kvrag`` subcommand shares: the parser class, the global flags, argument types.

Contract: `Parser` reports a usage error as one line ``kvrag: error: …`` on stderr and exits 2
(no usage dump). `add_global_flags` puts ``-v/--verbose`` (count), ``-q/--quiet``, ``--progress``
and ``--debug`` on the top-level parser (with defaults) and on each subcommand (without, so that a
flag given before the subcommand survives); they work in either place. `add_store_flags` adds
``--store URL``, ``--store-cache-mb N`` and ``--decoded-mb N`` (where the chunk caches live, and the in-memory
tiers; `store_arg` turns them into ``KVRag``'s ``store=``); `add_embedder_flag` adds ``--embedder PATH`` (the
index's embedder, named by the user when the manifest names a path outside the index). Argument types name the
argument's problem and the value given. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvrag.config import StoreConfig


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``kvrag: error: <what> (see <prog> --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvrag: error: {message} (see '{self.prog} --help')\n")


def add_global_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """The flags every command takes; ``top`` is the top-level parser (the only one with defaults)."""

    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    parser.add_argument("-v", "--verbose", action="count", default=default(0),
                        help="-v shows kvrag's INFO logs and the libraries' warnings; -vv DEBUG logs as well")
    parser.add_argument("-q", "--quiet", action="store_true", default=default(False),
                        help="no progress bar")
    parser.add_argument("--progress", action="store_true", default=default(False),
                        help="show the progress bar even when stderr is not a terminal")
    parser.add_argument("--debug", action="store_true", default=default(False),
                        help="on an error, print the full traceback instead of one line")


def add_store_flags(parser: argparse.ArgumentParser, building: bool) -> None:
    """``--store``, ``--store-cache-mb`` and ``--decoded-mb``; ``building``: for ``kvrag index`` (the URL is recorded in
    a new index).
    """
    where = ("where the chunk caches go: file:///abs/path, or a shared Redis or Valkey "
             "redis://[:PASSWORD@]HOST:PORT/DB, recorded in a new index (without the password) so that 'kvrag ask' "
             "finds it (default: the chunks/ folder of the index); for an existing index, another URL for its caches"
             if building else "where the index's chunk caches are, when not where the index records them (e.g. "
             "redis://[:PASSWORD@]HOST:PORT/DB: another URL for the same server, or the password)")
    parser.add_argument("--store", default=None, metavar="URL", help=where)
    parser.add_argument("--store-cache-mb", type=non_negative_float, default=None, metavar="MB",
                        help=f"size of the in-memory cache of hot chunk caches in front of a Redis store "
                             f"(default {StoreConfig.cache_mb:g}; 0: none)")
    parser.add_argument("--decoded-mb", type=non_negative_float, default=None, metavar="MB",
                        help=f"size of the in-memory tier of hot chunk caches kept decoded, on the CPU "
                             f"(default {StoreConfig.decoded_mb:g}; 0: none)")


def add_embedder_flag(parser: argparse.ArgumentParser) -> None:
    """``--embedder``: the index's embedder; a manifest's path outside the index is loaded only when named."""
    parser.add_argument("--embedder", default=None, metavar="PATH",
                        help="the index's embedder; needed when its manifest names a local path outside the index, "
                             "which kvrag loads only when you name it")


def store_arg(args: argparse.Namespace) -> str | StoreConfig | None:
    """``--store`` / ``--store-cache-mb`` / ``--decoded-mb`` / ``--max-cache-bytes`` as ``KVRag``'s ``store=`` (None:
    the index's own store).
    """
    bound, decoded = getattr(args, "max_cache_bytes", None), getattr(args, "decoded_mb", None)
    if args.store_cache_mb is not None or bound is not None or decoded is not None:
        cache_mb = StoreConfig.cache_mb if args.store_cache_mb is None else args.store_cache_mb
        return StoreConfig(backend=args.store or "disk", cache_mb=cache_mb, max_bytes=bound,
                           decoded_mb=StoreConfig.decoded_mb if decoded is None else decoded)
    return args.store


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, ``5000000`` or with a unit (``500MB``, ``5GiB``)."""
    from kvrag.passages.cache_url import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def show_progress(args: argparse.Namespace) -> bool:
    """A progress bar by default only on a terminal; ``--progress`` forces one, ``-q`` none."""
    return not args.quiet and (args.progress or sys.stderr.isatty())


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def human_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (powers of 1000, as disk sizes are sold)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
