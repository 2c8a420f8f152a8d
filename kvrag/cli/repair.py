"""``kvrag repair INDEX``: rebuild what can be rebuilt of a damaged index from what is intact.

Contract: runs `kvrag.repair.repair_index` and prints one line per part rebuilt or lost, then
the verification afterwards. Exit status 0 when the index is sound afterwards, 1 when damage remains;
what cannot be rebuilt at all (a link out of the folder, a manifest or chunk texts without a sound copy)
ends in one line ``kvrag: error: …`` naming what is needed (exit status 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrag.cli.common import show_progress
from kvrag.repair import repair_index


def run(args: argparse.Namespace) -> int:
    report = repair_index(Path(args.index), model=args.model, device=args.device, show_progress=show_progress(args),
                          embedder=args.embedder)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1
