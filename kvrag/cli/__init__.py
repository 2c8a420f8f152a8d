"""The ``kvrag`` command: ``index``, ``ask``, ``info``, ``verify``, ``repair``, ``serve`` and ``bench …``.

Contract: `main(argv)` runs one command and returns the exit status (it raises nothing, so it can run
inside another program): 0 on success; 2 after one line ``kvrag: error: …`` on stderr for a usage
error or a failure kvrag reports (a `KVRagError`, a missing file, a bad value); 1, also after one
line, for anything unexpected; 130 on Ctrl-C. ``--debug`` prints the traceback first. Results go to
stdout; the progress bar, warnings and errors to stderr. By default the libraries' warnings, logs
and progress bars are silenced (``-v``/``-vv`` bring them back: `kvrag.cli.verbosity`). `console()`, the
``kvrag`` command's entry point, runs `main`, then the ``atexit`` handlers, flushes stdout and stderr and ends the
process at once: tearing down an interpreter that loaded torch took 0.9 s of a 6.5 s ``kvrag ask``. It also holds
Python's garbage collector off until the command's module is imported, then freezes what the imports made (they live
as long as the process) and turns it back on: collections walking torch's objects cost a cold ``kvrag ask`` 0.4 s.
`main` called by another program leaves the collector alone.

`kvrag.cli.arguments` holds every command's arguments, and `kvrag.cli.common` the flags and types they share; they
import no torch, transformers, faiss, sentence-transformers or numpy, so ``--help`` and usage errors answer at once
(tests/test_cli_startup.py). Once the arguments parse and the command's cheap checks pass, `main` imports the
command's own module (`kvrag.cli.index`, `kvrag.cli.ask`, `kvrag.cli.info`, `kvrag.cli.verify`, `kvrag.cli.repair`,
`kvrag.cli.serve`, or a benchmark's `kvrag.bench.<name>`), which imports what it needs at its top, and calls its
``run(args)``. ``args.import_s`` is how long that import took (``kvrag ask --timings`` shows it), and
``args.own_process`` whether the process is the command's own (`console`), not another program's.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import time
import traceback

from kvrag.cli.arguments import add_commands
from kvrag.cli.common import Parser, add_global_flags
from kvrag.cli.verbosity import configured
from kvrag.errors import KVRagError

__all__ = ["build_parser", "console", "main"]

# failures kvrag reports in its own words (exit status 2); anything else is unexpected (status 1)
REPORTED = (KVRagError, ValueError, OSError, KeyError, ImportError)
_OWN_PROCESS = False  # set by `console`: the process is the ``kvrag`` command's own, not a program calling `main`


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvrag", description="Retrieval-augmented generation over stored, compressed per-chunk "
                                              "KV caches: index documents once, then ask.")
    add_global_flags(parser, top=True)
    flags = Parser(add_help=False)
    add_global_flags(flags, top=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub, [flags])
    return parser


def _one_line(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) else str(exc)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__


def _report(exc: Exception, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    if isinstance(exc, REPORTED):
        print(f"kvrag: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    hint = "" if debug else " (run again with --debug for the traceback)"
    print(f"kvrag: error: unexpected {type(exc).__name__}: {_one_line(exc)}{hint}", file=sys.stderr)
    return 1


def _run(args: argparse.Namespace) -> int:
    """The command's checks, then its module (torch and the model code load here, the one import kvrag defers
    by name: the grammar in `kvrag.cli.arguments` names each command's module), then its ``run``.
    """
    if args.check is not None:
        args.check(args)
    started = time.perf_counter()
    command = importlib.import_module(args.command)
    if _OWN_PROCESS:  # the imports' objects live as long as the process: no collection needs to walk them again
        gc.freeze()
        gc.enable()
    args.import_s = time.perf_counter() - started
    args.own_process = _OWN_PROCESS
    return int(command.run(args))


def main(argv: list[str] | None = None) -> int:
    """Run ``kvrag`` with ``argv`` (default: the process's arguments); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already reported in one line
        return exc.code if isinstance(exc.code, int) else 2
    with configured(args.verbose):
        try:
            return _run(args)
        except KeyboardInterrupt:
            print("kvrag: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:  # every failure ends as one line (the traceback with --debug)
            return _report(exc, args.debug)


def console() -> None:
    """The ``kvrag`` command: `main` on the process's arguments, then exit without the interpreter's teardown (every
    ``atexit`` handler still runs and the standard streams are flushed; nothing kvrag writes is left to finalisers).
    """
    global _OWN_PROCESS
    _OWN_PROCESS = True
    gc.disable()  # until the command's imports are done (`_run`): collections during them cost a cold ask 0.4 s
    status = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written anyway
            pass
    os._exit(status)
