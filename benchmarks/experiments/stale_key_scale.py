"""Fusion with the stale chunk rows' keys scaled: an attention temperature on what the stored caches hold.

    python benchmarks/experiments/stale_key_scale.py --scale 1.15 -- bench quality --data ... --modes full,probe@0.15

Runs ``kvrag`` with the arguments after ``--``, with every stored chunk row that a fused pass places (all but the
first chunk, whose cache is exact where it stands) given keys multiplied by ``--scale``. A row the fusion recomputes
is overwritten with its fresh keys, so only the stale rows carry the scale: every query's logits on them are
multiplied by it, a temperature of ``1 / scale`` on the stored caches' part of the attention (APE's attention
temperature, without its scaling factor). ``full`` places no stored rows and is unchanged, so it stays the
reference. Scale 1 is kvrag as it is.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from kvrag import cli
from kvrag.fusion import placement
from kvrag.fusion.inputs import Segments

_place = placement.place_layer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, required=True, help="the factor on the stale rows' keys")
    scale = parser.parse_args(ours).scale

    def place_scaled(layer: Any, kv: tuple[torch.Tensor, torch.Tensor], seg: Segments, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
        _place(layer, kv, seg, cos, sin)
        start = seg.prefix_len + (seg.chunk_lens[0] if seg.first_exact else 0)  # the first chunk's rows are exact
        layer.full()[0][:, :, start:seg.suffix_start] *= scale

    placement.place_layer = place_scaled
    return cli.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
