"""Fusion with the stale chunk rows' share of attention scaled: APE's scaling factor on what the stored caches hold.

    python benchmarks/experiments/stale_column_bias.py --factor 0.8 -- bench quality --data ... --modes full,probe@0.15

Runs ``kvrag`` with the arguments after ``--``, with every query of a fused answer (the recomputed tokens in the
fused pass, then each decoding step) given an additive bias of ``log(factor)`` on the columns of the stale rows: the
stored chunk rows the pass does not recompute (all but the first chunk's, whose cache is exact where it stands, and
the selection's). Each query's attention weights on those rows are multiplied by ``factor`` before they are
normalised: APE's scaling factor on the contexts' part of the attention, without its temperature (which
``stale_key_scale.py`` measured). The stale rows are taken from the selection that runs through each layer; a
decoding step uses the last layer's. Scattered selections run as masked blocks here (the tiles are off), so that the
bias rides on their additive masks; a factor of 1 is kvrag as it is, to float rounding. ``full`` places no stored
rows: a plain causal prefill clears the stale rows, so it stays the reference.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch

from kvrag import cli
from kvrag.fusion import attention, placement
from kvrag.fusion.inputs import Segments
from kvrag.model import llama_layer

_place, _blocks, _mask, _attend = (placement.place_layer, attention.layer_blocks, attention.attention_mask,
                                   llama_layer.attend)


class _Stale:
    """The stale rows of the pass under way: its segments, and the columns the current selection leaves stale."""

    seg: Segments | None = None
    columns: torch.Tensor | None = None  # bool [N]
    applied = 0  # how many attention calls carried the bias (printed at the end, so a run shows it took effect)


def _stale_columns(seg: Segments, sel: torch.Tensor) -> torch.Tensor:
    start = seg.prefix_len + (seg.chunk_lens[0] if seg.first_exact else 0)  # the first chunk's rows are exact
    stale = torch.zeros(seg.total, dtype=torch.bool)
    stale[start:seg.suffix_start] = True
    stale[sel.cpu()] = False
    return stale


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, required=True, help="the factor on the stale rows' attention weights")
    bias = math.log(parser.parse_args(ours).factor)

    def place(layer: Any, kv: tuple[torch.Tensor, torch.Tensor], seg: Segments, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        _Stale.seg = seg
        _place(layer, kv, seg, cos, sin)

    def blocks(lm: Any, sel: torch.Tensor, total: int, *args: Any, **kwargs: Any) -> Any:
        seg = _Stale.seg
        _Stale.columns = _stale_columns(seg, sel) if seg is not None and seg.total == total else None
        return _blocks(lm, sel, total, *args, **kwargs)

    def mask(sel: torch.Tensor, total: int, dtype: torch.dtype, *args: Any, **kwargs: Any) -> torch.Tensor:
        made = _mask(sel, total, dtype, *args, **kwargs)
        if _Stale.columns is not None and bias:
            made[..., _Stale.columns[:total].to(made.device)] += bias
            _Stale.applied += 1
        return made

    def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any,
               scale: float) -> torch.Tensor:
        stale = _Stale.columns
        if mask is None and queries.shape[2] > 1 and keys.shape[2] == queries.shape[2]:
            _Stale.columns = None  # a plain prefill from the start: no stale rows
        elif mask is None and stale is not None and bias and keys.shape[2] >= stale.numel():
            step = torch.zeros(keys.shape[2], dtype=queries.dtype, device=queries.device)
            step[: stale.numel()][stale.to(queries.device)] = bias
            rows = torch.arange(keys.shape[2], device=queries.device)
            visible = rows[None, :] <= rows[-queries.shape[2]:, None]  # causal over the new rows
            mask = step.expand(queries.shape[2], -1).masked_fill(~visible, -math.inf)[None, None]
            _Stale.applied += 1
        return _attend(queries, keys, values, mask, scale)

    placement.place_layer, attention.layer_blocks, attention.attention_mask = place, blocks, mask
    attention.tiles_on = lambda *_: False  # masked blocks, whose masks carry the bias
    llama_layer.attend = attend
    try:
        return cli.main(rest)
    finally:
        print(f"stale-column bias {bias:+.4f} applied in {_Stale.applied} attention calls", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
