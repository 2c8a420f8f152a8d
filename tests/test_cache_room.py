"""Rows appended into a cache layer's room (`kvrag.generation.cache_room`) equal the layer's own concatenation, and
never write rows that a view handed out before still holds: for transformers' dynamic layers and kvrag's `RowLayer`."""

from __future__ import annotations

import pytest
import torch

from kvrag.generation.cache_room import ROOM_ROWS, append_rows, appendable
from kvrag.model import hf_compat


class _NativeModel:
    kvrag_row_cache = True  # as kvrag's own models say: they grow a `RowCache`


MODELS = {"transformers": object(), "kvrag": _NativeModel()}


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]


def _layer(model, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))]
    cache = hf_compat.dynamic_cache(model, kv)
    return cache, cache.layers[0]


def _rows(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, m, 4, generator=g), torch.randn(1, 2, m, 4, generator=g)


def test_the_cache_kind_follows_the_model():
    assert type(hf_compat.full_cache(MODELS["kvrag"])).__name__ == "RowCache"
    assert type(hf_compat.full_cache(MODELS["transformers"])).__name__ == "DynamicCache"


def test_appended_rows_equal_concatenation_and_reuse_the_room(model):
    cache, layer = _layer(model, 5)
    expected_k, expected_v = layer.keys.clone(), layer.values.clone()
    buffers = set()
    for step in range(ROOM_ROWS + 3):  # past the first room: one more buffer, no per-step copies
        k, v = _rows(1 + step % 2, step)
        got_k, got_v = append_rows(layer, k, v)
        expected_k, expected_v = torch.cat([expected_k, k], dim=2), torch.cat([expected_v, v], dim=2)
        assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
        assert got_k is layer.keys and cache.get_seq_length() == expected_k.shape[2]
        buffers.add(layer._kvrag_room[0].data_ptr())
    assert len(buffers) == 2


def test_a_crop_or_the_layers_own_update_gets_fresh_room_and_held_views_keep_their_rows(model):
    cache, layer = _layer(model, 6, seed=1)
    append_rows(layer, *_rows(1, 10))
    held = layer.keys  # a view of the room's 7 rows, handed out
    before = held.clone()
    hf_compat.crop_cache(cache, 4)
    new_k, _ = append_rows(layer, *_rows(2, 11))  # after the crop: rows 4..5 are new, the held view is untouched
    assert torch.equal(held, before) and new_k.shape[2] == 6
    cache.update(*_rows(1, 12), 0)  # the layer's own concatenation: a new tensor the room does not know
    k, _ = append_rows(layer, *_rows(1, 13))
    assert k.shape[2] == 8 and torch.equal(k[:, :, :4], before[:, :, :4])


def test_only_growing_layers_with_rows_are_appendable(model):
    assert appendable(_layer(model, 3)[0])
    assert not appendable(hf_compat.full_cache(model))
    assert not appendable(object())
