"""``kvrag bench NAME``: the benchmarks of `kvrag.bench`, one subcommand each.

Contract: every module named in `kvrag.bench.BENCHES` that imports (optional dependencies may be
missing) becomes ``kvrag bench <name>``, its help the first line of its docstring, its options its
``add_arguments(parser)``, run by its ``run(args)``. The modules are imported to build the parser, so
they import torch and the model code only inside their functions.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

HELP = "benchmarks (ratios against 'full' measured in the same run)"


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    from kvrag.bench import BENCHES

    bench = sub.add_parser("bench", parents=parents, help=HELP, description=HELP + ".")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHES:
        try:
            module = importlib.import_module(f"kvrag.bench.{name}")
        except ImportError:
            continue
        doc = (module.__doc__ or name).strip().splitlines()[0]
        parser = bench_sub.add_parser(name, parents=parents, help=doc, description=doc)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
