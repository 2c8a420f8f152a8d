"""``kvrag verify INDEX``: check every file of an index and say in one line per damaged part what is wrong.

Contract: loads no model. Exit status 0 when the index is sound (one line saying so), 1 when something
is damaged (one line per damaged part on stdout, naming the file, what is wrong and whether
``kvrag repair INDEX`` rebuilds it). ``--json`` prints the report as one object instead.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from kvrag.storage.verify import verify_index


def run(args: argparse.Namespace) -> int:
    report = verify_index(Path(args.index), caches=not args.no_caches)
    if args.json:
        print(json.dumps({"path": str(report.path), "ok": report.ok, "chunks": report.chunks,
                          "caches_checked": report.caches_checked, "caches_missing": report.caches_missing,
                          "problems": [asdict(p) for p in report.problems]}, indent=2))
    else:
        for line in report.lines():
            print(line)
        if not report.ok:
            print(f"run 'kvrag repair {args.index}' to rebuild what can be rebuilt")
    return 0 if report.ok else 1
