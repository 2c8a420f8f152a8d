"""CONTRIBUTING.md's worked example: a selector added in one file, registered by name, used end to end."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from test_rag import DOCS, SPLIT

from kvrag import FuseConfig, KVRag
from kvrag.fusion import Selector, available_modes, make_selector, register_selector, unregister_selector
from kvrag.fusion.inputs import Segments

CONTRIBUTING = Path(__file__).resolve().parent.parent / "CONTRIBUTING.md"


@register_selector("tail")
class TailSelector(Selector):
    """Recompute the last ``ratio`` of every stale chunk's tokens (and the forced ones) through every layer.

    Args:
        ratio: the fraction of each stale chunk recomputed, in (0, 1].
    """

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    @classmethod
    def from_config(cls, config: FuseConfig) -> TailSelector:
        return cls(config.ratio)  # what this mode reads from FuseConfig

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()  # bool [N]: the suffix and chunks without a cache, always recomputed
        for start, n in seg.stale:  # (start, length) of each chunk whose stored cache is stale
            mask[start + n - math.ceil(self.ratio * n) : start + n] = True
        return mask


# Importing this module registered ``tail`` (above, as CONTRIBUTING.md shows). Other test modules must
# see the built-in modes alone, so it is registered only while this module's tests run (`tail_mode`).
unregister_selector("tail")


@pytest.fixture(scope="module", autouse=True)
def tail_mode():
    register_selector("tail")(TailSelector)
    yield "tail"
    unregister_selector("tail")


@pytest.fixture(scope="module")
def rag(tail_mode, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    rag = KVRag.build(DOCS, tmp_path_factory.mktemp("tail") / "idx", model=str(tiny_model_dir), split=SPLIT,
                      show_progress=False)
    yield rag
    rag.close()


def test_the_class_is_the_example_in_contributing():
    blocks = re.findall(r"```python\n(.*?)```", CONTRIBUTING.read_text(), flags=re.S)
    assert any(inspect.getsource(TailSelector) in block for block in blocks)


def test_the_registered_mode_validates_and_is_listed(tail_mode):
    assert tail_mode in available_modes()
    config = FuseConfig(mode=tail_mode, ratio=0.25)
    selector = make_selector(config)
    assert isinstance(selector, TailSelector) and selector.ratio == 0.25


def test_answering_with_the_mode_recomputes_what_the_selector_chose(rag, tail_mode, monkeypatch):
    chosen: list[tuple[Segments, torch.Tensor]] = []
    initial = TailSelector.initial

    def recording(self: TailSelector, seg: Segments) -> torch.Tensor:
        mask = initial(self, seg)
        chosen.append((seg, mask))
        return mask

    monkeypatch.setattr(TailSelector, "initial", recording)
    answer = rag.answer("Who commands beta station?", k=3, mode=tail_mode, ratio=0.25, max_new_tokens=3)
    assert answer.mode == tail_mode and 1 <= len(answer.token_ids) <= 3
    ((seg, mask),) = chosen
    assert seg.stale  # chunks after the first: there is a tail to recompute
    for start, n in seg.stale:
        cut = start + n - math.ceil(0.25 * n)
        assert mask[cut : start + n].all()
        assert torch.equal(mask[start:cut], seg.forced[start:cut])  # the head of a stored chunk is reused
    # a selector that never narrows runs the same tokens through every layer
    assert answer.n_prompt_tokens == seg.total
    assert answer.recompute_fraction == pytest.approx(int(mask.sum()) / seg.total)
    assert 0 < answer.recompute_fraction < 1


def test_the_mode_is_gone_once_unregistered():
    unregister_selector("tail")
    try:
        assert "tail" not in available_modes()
        with pytest.raises(ValueError, match="unknown fusion mode 'tail'"):
            make_selector(FuseConfig(mode="tail"))
    finally:
        register_selector("tail")(TailSelector)
