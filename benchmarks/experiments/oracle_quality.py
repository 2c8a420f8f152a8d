"""Experiment: `kvrag bench quality` with the deviation oracle among its modes.

``oracle@R`` recomputes, per question, the R of the chunk tokens whose stored K/V deviate most from a full prefill
(`deviation.oracle_positions`, found from that prefill outside the answer's timing): the bound of a selector that
ranked tokens by their true KV deviation. Every other argument is `kvrag bench quality`'s.

    python benchmarks/experiments/oracle_quality.py --data QA.jsonl --modes full,probe@0.15,oracle@0.15 --out OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deviation.py, beside this script

from deviation import oracle_positions  # noqa: E402

from kvrag.bench.common import ModeSpec, register_question_mode  # noqa: E402
from kvrag.config import FuseConfig  # noqa: E402


def oracle_mode(label: str, ratio: str) -> ModeSpec:
    """``oracle@R``: `reuse` over the stored caches with the oracle's R of the tokens recomputed."""
    def choose(rag: Any, item: dict[str, Any], config: FuseConfig) -> Any:
        from kvrag.fusion import FixedSelector

        return FixedSelector(oracle_positions(rag, item, config.ratio))

    return ModeSpec(label, FuseConfig(mode="reuse", ratio=float(ratio or 0.15)), selector_for=choose)


def register() -> None:
    """Make ``oracle@R`` a mode of `kvrag bench quality` in this process."""
    register_question_mode("oracle", oracle_mode)


def main(argv: list[str] | None = None) -> int:
    from kvrag.cli import main as kvrag_main

    register()
    return kvrag_main(["bench", "quality", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
