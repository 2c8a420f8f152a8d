"""`kvrag` parses before it imports: help and usage errors load no torch, transformers, faiss or numpy.

Each case runs ``python -X importtime -m kvrag.cli ARGS`` in a fresh interpreter and reads the modules it
imported from the ``-X importtime`` lines on stderr; the cases cover the top-level help, every
subcommand's help (the benchmarks' too, listed from the parser) and a few usage errors.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrag.cli import build_parser

HEAVY = ("torch", "transformers", "sentence_transformers", "faiss", "numpy", "numba")
_IMPORT_LINE = "import time:"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _help_argvs() -> list[list[str]]:
    """``--help``, then ``COMMAND --help`` for every command and ``bench NAME --help`` for every benchmark."""
    commands = _subcommands(build_parser())
    benches = [["bench", name, "--help"] for name in _subcommands(commands["bench"])]
    return [["--help"]] + [[name, "--help"] for name in commands] + benches


def _run(argv: list[str]) -> tuple[int, set[str], list[str]]:
    """Exit status, top-level packages imported, and stderr without the importtime lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHONWARNINGS"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvrag.cli", *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    lines = done.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines if line.startswith(_IMPORT_LINE)}
    return done.returncode, imported, [line for line in lines if not line.startswith(_IMPORT_LINE)]


@pytest.mark.parametrize("argv", _help_argvs(), ids=" ".join)
def test_help_imports_nothing_heavy(argv: list[str]):
    status, imported, _ = _run(argv)
    assert status == 0
    assert "kvrag" in imported, "no importtime lines read"
    assert not imported & set(HEAVY), f"kvrag {' '.join(argv)} imported {sorted(imported & set(HEAVY))}"


@pytest.mark.parametrize("argv", [
    [],
    ["nope"],
    ["ask"],
    ["ask", "idx", "q", "--mode", "nope"],
    ["index", "docs", "--index", "idx", "--max-tokens", "0"],
    ["bench", "speed", "--no-such-option"],
], ids=lambda argv: " ".join(argv) or "no-arguments")
def test_usage_errors_import_nothing_heavy(argv: list[str]):
    status, imported, err = _run(argv)
    assert status == 2 and len(err) == 1 and err[0].startswith("kvrag: error: "), err
    assert not imported & set(HEAVY), f"kvrag {' '.join(argv)} imported {sorted(imported & set(HEAVY))}"


def test_ask_refuses_a_missing_index_before_importing_the_model(tmp_path: Path):
    status, imported, err = _run(["ask", str(tmp_path / "missing"), "Who?"])
    assert status == 2 and err == [f"kvrag: error: no kvrag index at {tmp_path / 'missing'}: the folder does not exist"]
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_the_command_ends_without_teardown_yet_runs_atexit_and_flushes_its_output(tmp_path: Path):
    code = ("import atexit, sys; atexit.register(lambda: print('atexit ran')); "
            f"sys.argv = ['kvrag', 'ask', {str(tmp_path / 'missing')!r}, 'q']; print('before', end=''); "
            "from kvrag.cli import console; console()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2  # main's status
    assert done.stdout == "beforeatexit ran\n"  # buffered output flushed, the handler run
    assert done.stderr.startswith("kvrag: error: no kvrag index at")


def test_the_command_collects_garbage_again_once_its_imports_are_done(tmp_path: Path):
    """`console` holds the collector off through the imports, then freezes what they made and turns it back on."""
    (tmp_path / "docs").mkdir()
    code = ("import gc, sys; import kvrag.cli.index as command; "
            "command.run = lambda args: print(gc.isenabled(), gc.get_freeze_count() > 1000) or 0; "
            f"sys.argv = ['kvrag', 'index', {str(tmp_path / 'docs')!r}, '--index', {str(tmp_path / 'idx')!r}]; "
            "from kvrag.cli import console; console()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr[-2000:]


def test_main_called_by_a_program_leaves_its_collector_alone(tmp_path: Path):
    import gc

    from kvrag.cli import main

    assert gc.isenabled()
    before = gc.get_freeze_count()
    main(["ask", str(tmp_path / "missing"), "Who?"])
    assert gc.isenabled() and gc.get_freeze_count() == before


def test_the_command_tells_its_run_whether_the_process_is_its_own(tmp_path: Path):
    """`console` runs the command in its own process (numba may start without SciPy's BLAS there); `main` called by
    another program does not.
    """
    code = ("import sys; import kvrag.cli.ask as command; "
            "command.run = lambda args: print(args.own_process) or 0; "
            f"sys.argv = ['kvrag', 'ask', {str(tmp_path)!r}, 'Who?']; "
            "from kvrag.cli import console, main; main(sys.argv[1:]); console()")
    (tmp_path / "manifest.json").write_text("{}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["False", "True"], done.stderr[-2000:]
