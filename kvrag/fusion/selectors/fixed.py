"""`FixedSelector`: recompute positions chosen outside fusion. Not a mode: it is passed to `fuse` directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import torch

from kvrag.fusion.selectors.base import Selector

if TYPE_CHECKING:
    import numpy as np

    from kvrag.fusion.inputs import Segments

    Positions = Union[Sequence[int], "np.ndarray", torch.Tensor]


class FixedSelector(Selector):
    """Recompute given positions of the fused prompt (with the forced ones) through every layer.

    For selections made outside fusion: e.g. the deviation oracle of benchmarks/experiments, which ranks the stale
    tokens by how far their stored K/V are from a full prefill's.

    Args:
        positions: integer positions in the fused prompt, in any order: a list, tuple, numpy array or
            tensor (on any device); empty selects only the forced tokens.
    """

    def __init__(self, positions: Positions) -> None:
        # [n] int64 on the CPU, where the selection masks are built
        self.positions = torch.as_tensor(positions).long().flatten().cpu()

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()  # bool [N]
        if self.positions.numel() and not 0 <= int(self.positions.min()) <= int(self.positions.max()) < seg.total:
            raise ValueError(f"selected positions must lie in [0, {seg.total}), the fused prompt")
        mask[self.positions] = True
        return mask
