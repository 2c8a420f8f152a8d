r"""Shift the stale value rows of each chunk by the mean change of its recomputed ones, layer by layer.

At every layer of the fusion loop the selected tokens' fresh V rows replace their stored ones. The
difference tells how that chunk's stored values are off at this layer; this script adds its mean
(per chunk and head) to the chunk's rows that are not recomputed, before the layer's attention reads
them. Values carry no rotary embedding, so the shift is position-free. With the fit rows chosen at
random and known exactly (`scripts/mean_shift.py`), a value-only shift brought ``probe``'s answers
closer to ``full``'s in NLL; here the rows are the ones the mode recomputes anyway, at no extra
recompute.

    python scripts/value_shift.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/nc-stored-idx --quality benchmarks/quality-musique-precision/quality.json \
        --modes probe@0.15 --n 20 --out bench-out/value-shift.json

``--quality`` is a run over the same index with ``full`` in it (its answers are compared with) and
each ``--modes`` mode (the unshifted answers are re-run here and must match it).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

import kvrag.fusion.fuse as fusion
from kvrag.model import hf_compat
from kvrag.bench import common, metrics
from kvrag.bench.quality import against_full, experiment_parser, load_run

SHIFT: dict[str, Any] = {"on": False, "spans": []}
_segments = fusion.segments
_update = hf_compat.ScatterLayer.update


def segments(inp: fusion.FusionInput) -> fusion.Segments:
    """`fusion.segments`, noting the stale chunk spans of the fusion under way."""
    seg = _segments(inp)
    SHIFT["spans"] = seg.stale
    return seg


def update(self: hf_compat.ScatterLayer, key_states: torch.Tensor, value_states: torch.Tensor,
           *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`ScatterLayer.update`, then each stale chunk's rows not yet written at this layer shifted by
    the mean change of its rows written now.
    """
    _, values, rows = self.full()
    before = values[:, :, rows].clone() if SHIFT["on"] else None
    out = _update(self, key_states, value_states, *args, **kwargs)
    if before is None or rows is None:
        return out
    written = getattr(self, "written", None)
    if written is None:
        written = self.written = torch.zeros(values.shape[2], dtype=torch.bool, device=values.device)
    written[rows] = True
    change = values[:, :, rows] - before
    for start, length in SHIFT["spans"]:
        mine = (rows >= start) & (rows < start + length)
        if not bool(mine.any()):
            continue
        span = torch.arange(start, start + length, device=values.device)
        stale = span[~written[span]]
        values[:, :, stale] += change[:, :, mine].mean(2, keepdim=True)
    return out


def main() -> None:
    parser = experiment_parser(__doc__, 20, "bench-out/value-shift.json",
                               "quality.json of a run over --index with full and --modes")
    parser.add_argument("--modes", default="probe@0.15")
    args = parser.parse_args()
    from kvrag.rag import KVRag

    common.set_threads(args.threads)
    fusion.segments = segments  # type: ignore[assignment]
    hf_compat.ScatterLayer.update = update  # type: ignore[method-assign]
    run = load_run(args.quality)
    specs = [common.parse_mode(m) for m in args.modes.split(",")]
    rows: list[dict[str, Any]] = []
    with KVRag.open(args.index) as rag:
        for item, keys, full in against_full(rag, args, run):
            row: dict[str, Any] = {"id": item["id"]}
            for spec in specs:
                for shifted in (False, True):
                    SHIFT["on"] = shifted
                    ans = rag.answer(item["question"], chunks=keys, fuse_config=spec.config, max_new_tokens=24,
                                     score_ids=full["token_ids"])
                    label = spec.label + ("+vshift" if shifted else "")
                    row[label] = {"agreement": metrics.agreement(ans.text, full["answer"]),
                                  "delta_nll": ans.score_nll - full["nll_full_answer"],
                                  "ttft_s": ans.ttft_s, "same_as_stored_run": None}
                    if not shifted:
                        row[label]["same_as_stored_run"] = ans.text == run[(item["id"], spec.label)]["answer"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = [k for k in rows[0] if k != "id"]
    summary = {name: {"agreement": statistics.fmean(r[name]["agreement"] for r in rows),
                      "mean_abs_delta_nll": statistics.fmean(abs(r[name]["delta_nll"]) for r in rows),
                      "ttft_s": statistics.fmean(r[name]["ttft_s"] for r in rows)}
               for name in names}
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
