"""``kvrag repair INDEX``: rebuild what can be rebuilt of a damaged index from what is intact.

Contract: runs `kvrag.repair.repair_index` and prints one line per part rebuilt or lost, then
the verification afterwards. Exit status 0 when the index is sound afterwards, 1 when damage remains;
what cannot be rebuilt at all (a link out of the folder, a manifest or chunk texts without a sound copy)
ends in one line ``kvrag: error: …`` naming what is needed (exit status 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvrag.cli.common import add_embedder_flag, show_progress

HELP = "rebuild the damaged parts of an index from its intact ones"


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("repair", parents=parents, help=HELP, description=HELP + ".")
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("--model", default=None, help="the index's model, if not where the manifest says it is")
    p.add_argument("--device", default=None, help="torch device for the model and the embedder")
    add_embedder_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvrag.repair import repair_index

    report = repair_index(Path(args.index), model=args.model, device=args.device, show_progress=show_progress(args),
                          embedder=args.embedder)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1
