"""What every ``kvrag`` subcommand shares: the parser class, the global flags, argument types.

Contract: `Parser` reports a usage error as one line ``kvrag: error: …`` on stderr and exits 2 (no usage dump).
`add_global_flags` puts ``-v/--verbose`` (count), ``-q/--quiet``, ``--progress`` and ``--debug`` on the top-level
parser (with defaults) and on each subcommand (without, so that a flag given before the subcommand survives); they
work in either place. `add_store_flags` adds ``--store URL``, ``--store-cache-bytes SIZE`` and
``--decoded-bytes SIZE`` (where the chunk caches live, and the in-memory tiers; `store_arg` turns them into
``KVRag``'s ``store=``); `add_embedder_flag` adds ``--embedder PATH`` (the index's embedder, named by the user when
the manifest names a path outside the index). Argument types name the argument's problem and the value given.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvrag.config import StoreConfig
from kvrag.sizes import parse_bytes


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
    """``--store``, ``--store-cache-bytes`` and ``--decoded-bytes``; ``building``: for ``kvrag index`` (the URL is
    recorded in a new index). ``--store-cache-mb`` and ``--decoded-mb`` (MiB, deprecated) are still read.
    """
    where = ("where the chunk caches go: file:///abs/path, or a shared Redis or Valkey "
             "redis://[:PASSWORD@]HOST:PORT/DB, recorded in a new index (without the password) so that 'kvrag ask' "
             "finds it (default: the chunks/ folder of the index); for an existing index, another URL for its caches"
             if building else "where the index's chunk caches are, when not where the index records them (e.g. "
             "redis://[:PASSWORD@]HOST:PORT/DB: another URL for the same server, or the password)")
    parser.add_argument("--store", default=None, metavar="URL", help=where)
    add_size_flag(parser, "--store-cache-bytes", "size of the in-memory cache of hot chunk caches in front of a "
                  f"Redis store, e.g. 256MiB (default {int(StoreConfig.cache_bytes) >> 20} MiB; 0: none)")
    add_size_flag(parser, "--decoded-bytes", "size of the in-memory tier of hot chunk caches kept decoded, on the CPU, "
                  f"e.g. 512MiB (default {int(StoreConfig.decoded_bytes) >> 20} MiB; 0: none)")


def add_size_flag(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """``flag`` (``--…-bytes SIZE``: bytes, or a size such as ``512MiB``; 0 allowed), and beside it the deprecated
    ``--…-mb MB`` it replaces (a number of MiB), both into ``flag``'s destination.
    """
    dest = flag[2:].replace("-", "_")
    parser.add_argument(flag, type=byte_size_or_zero, default=None, metavar="SIZE", help=help)
    parser.add_argument(flag.removesuffix("-bytes") + "-mb", type=mib_size, default=None, dest=dest, metavar="MB",
                        help=f"deprecated: {flag} in MiB")


def add_embedder_flag(parser: argparse.ArgumentParser) -> None:
    """``--embedder``: the index's embedder; a manifest's path outside the index is loaded only when named."""
    parser.add_argument("--embedder", default=None, metavar="PATH",
                        help="the index's embedder; needed when its manifest names a local path outside the index, "
                             "which kvrag loads only when you name it")


def store_arg(args: argparse.Namespace) -> str | StoreConfig | None:
    """``--store`` / ``--store-cache-bytes`` / ``--decoded-bytes`` / ``--max-cache-bytes`` as ``KVRag``'s ``store=``
    (None: the index's own store).
    """
    bound, decoded, cache = getattr(args, "max_cache_bytes", None), args.decoded_bytes, args.store_cache_bytes
    if cache is not None or bound is not None or decoded is not None:
        default = StoreConfig()
        return StoreConfig(backend=args.store or "disk", max_bytes=bound,
                           cache_bytes=default.cache_bytes if cache is None else cache,
                           decoded_bytes=default.decoded_bytes if decoded is None else decoded)
    return args.store


def byte_size(text: str) -> int:
    """An argparse type: a positive size in bytes, ``5000000`` or with a unit (``500MB``, ``5GiB``)."""
    return _size(text, zero=False)


def byte_size_or_zero(text: str) -> int:
    """An argparse type: a size in bytes as `byte_size` takes it, or 0 (the bound's store or tier off)."""
    return _size(text, zero=True)


def mib_size(text: str) -> int:
    """An argparse type: a size in MiB (a number), in bytes: what the ``--*-mb`` flags took before ``--*-bytes``."""
    return int(non_negative_float(text) * (1 << 20))


def _size(text: str, zero: bool) -> int:
    try:
        return parse_bytes(text, "the value", zero=zero)
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
