"""Neighbour context: chunk caches computed after a chunk's nearest chunks, and their fusion."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_fuse import _reference_logits
from test_rag import DOCS, SPLIT

from kvrag import FuseConfig, KVRag
from kvrag.errors import IndexMismatchError
from kvrag.fusion import FusionInput, fuse
from kvrag.fusion.inputs import segments
from kvrag.indexing.build import cache_after_neighbours, nearest_chunks
from kvrag.indexing.kvgen import (
    chunk_cache_after,
    chunk_caches,
    chunk_caches_after,
    placed_prefix,
    plain_cache_key,
    prefix_cache,
)
from kvrag.model import hf_compat
from kvrag.model.loading import rope_at, unapply_rope, wrap_model
from kvrag.prompt import chunk_token_ids


@pytest.fixture(scope="module")
def lm():
    return wrap_model(tiny_model("llama"), None, "llama")


def _ids(lm, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, lm.spec.vocab_size, (n,), generator=gen).tolist()


def test_a_cache_after_context_equals_the_chunks_rows_of_one_prefill(lm):
    prefix = prefix_cache(lm, _ids(lm, 6, 0))
    context, chunk = _ids(lm, 19, 1), _ids(lm, 13, 2)
    (_, (keys, values)), = chunk_caches_after(lm, prefix, [(context, chunk)])
    ids = torch.tensor([*prefix.ids.tolist(), *context, *chunk])
    with torch.no_grad():
        layers = hf_compat.cache_layers(lm.model(ids[None], use_cache=True).past_key_values)
    start = prefix.length + len(context)
    positions = torch.arange(start, ids.numel())
    cos, sin = rope_at(lm.model, positions, keys)
    for layer, (k_ref, v_ref) in enumerate(layers):
        assert (keys[layer] - unapply_rope(k_ref[0, :, start:], cos, sin)).abs().max().item() <= 1e-4
        assert (values[layer] - v_ref[0, :, start:]).abs().max().item() <= 1e-4
    # without context it is the plain cache after the prefix
    (_, plain), = chunk_caches_after(lm, prefix, [([], chunk)])
    _, ref = next(chunk_caches(lm, prefix, [chunk]))
    assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(plain, ref))


def test_a_chunk_after_a_placed_exact_cache_equals_one_prefilled_after_its_tokens(lm):
    prefix = prefix_cache(lm, _ids(lm, 6, 0))
    first, second, chunk = _ids(lm, 11, 1), _ids(lm, 9, 2), _ids(lm, 13, 3)
    (_, exact), = chunk_caches_after(lm, prefix, [(first, chunk)])
    _, plain_first = next(chunk_caches(lm, prefix, [first]))
    after = placed_prefix(lm, prefix, [(first, plain_first)])
    assert after.ids.tolist() == [*prefix.ids.tolist(), *first] and after.kv[0][0].shape[2] == prefix.length + 11
    placed = chunk_cache_after(lm, after, chunk)  # the first chunk's plain cache is exact right after the prefix
    assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(placed, exact))
    # a second placed chunk was computed without the first before it: close to, not equal to, prefilling both
    _, plain_second = next(chunk_caches(lm, prefix, [second]))
    two = chunk_cache_after(lm, placed_prefix(lm, prefix, [(first, plain_first), (second, plain_second)]), chunk)
    (_, both), = chunk_caches_after(lm, prefix, [(first + second, chunk)])
    assert (two[1] - both[1]).abs().max().item() > 1e-4
    assert (two[1][0] - both[1][0]).abs().max().item() <= 1e-5  # layer 0's values depend on the token alone
    with pytest.raises(ValueError, match="holds 11 tokens"):
        placed_prefix(lm, prefix, [(second, plain_first)])


class _NoIndex:
    def search(self, vector, k):
        return []


def test_nearest_chunks_put_the_nearest_last_and_cut_the_front_to_fit_the_window(lm):
    others = [(0.9, "a", list(range(10))), (0.5, "c", list(range(30))), (0.7, "b", list(range(20)))]
    room = lm.spec.max_position - 6 - 40 - 1  # prefix 6, chunk 40
    whole = nearest_chunks(lm, _NoIndex(), 6, 3, "x", 40, None, others)
    assert [(n.key, n.start) for n in whole] == [("c", 0), ("b", 0), ("a", 0)]
    assert nearest_chunks(lm, _NoIndex(), 6, 2, "x", 40, None, others)[0].key == "b"
    cut = nearest_chunks(lm, _NoIndex(), 6, 3, "x", room - 25 + 40, None, others)  # 25 tokens of room
    assert [(n.key, n.start) for n in cut] == [("b", 5), ("a", 0)]
    assert nearest_chunks(lm, _NoIndex(), 6, 3, "x", room + 40, None, others) == []
    assert nearest_chunks(lm, _NoIndex(), 6, 0, "x", 40, None, others) == []


def test_without_an_exact_first_chunk_the_selectors_take_it_too(lm):
    prefix = prefix_cache(lm, _ids(lm, 6, 0))
    chunks = [torch.tensor(_ids(lm, n, 10 + n)) for n in (11, 9, 14)]
    suffix = torch.tensor(_ids(lm, 5, 3))
    context = _ids(lm, 8, 4)
    caches = [kv for _, kv in chunk_caches_after(lm, prefix, [(context, c.tolist()) for c in chunks])]
    exact, stale = (FusionInput(prefix, chunks, caches, suffix, first_exact=flag) for flag in (True, False))
    assert segments(stale).stale == [(6, 11), (17, 9), (26, 14)]
    assert segments(exact).stale == [(17, 9), (26, 14)]
    link = fuse(lm, stale, FuseConfig(mode="attnlink", options={"link_tokens": 4}))
    assert link.n_selected[0] == 4 * 3 + 5
    blend = fuse(lm, stale, FuseConfig(mode="cacheblend", ratio=0.3, options={"check_layers": (1,)}))
    assert blend.n_selected[0] == 34 + 5 and blend.n_selected[-1] == math.ceil(0.3 * 34) + 5
    probe = fuse(lm, stale, FuseConfig(mode="probe", ratio=0.3))
    assert probe.selected.numel() == math.ceil(0.3 * 34) + 5
    # recomputing every token is exact whatever context the caches were computed after
    reference = _reference_logits(lm, torch.cat([prefix.ids, *chunks, suffix]))
    for mode in ("cacheblend", "probe"):
        result = fuse(lm, stale, FuseConfig(mode=mode, ratio=1.0))
        assert (result.logits - reference).abs().max().item() <= 1e-4
    # the first chunk's cache is stale, so reusing it is not exact any more
    assert (fuse(lm, stale, FuseConfig(mode="prefix")).logits - reference).abs().max().item() > 1e-4


@pytest.fixture(scope="module")
def neighboured(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("rag-nc") / "idx"
    rag = KVRag.build(DOCS, path, model=str(tiny_model_dir), codec="raw", split=SPLIT,
                      neighbour_context=2, neighbour_kv="prefill",
                      show_progress=False)
    return rag, path


def _expected_cache(rag: KVRag, key: str):
    """The cache of ``key`` computed from scratch after its two nearest chunks in the built index."""
    record = rag.index.get(key)
    ids = chunk_token_ids(rag.lm.tokenizer, record.text)
    neighbours = nearest_chunks(rag.lm, rag.index, rag.prefix.length, 2, key, len(ids),
                                rag.embedder.encode([record.text])[0])
    context = [t for n in neighbours for t in n.ids[n.start:]]
    return context, next(chunk_caches_after(rag.lm, rag.prefix, [(context, ids)]))[1]


def test_build_stores_each_cache_after_its_nearest_chunks(neighboured):
    rag, path = neighboured
    assert json.loads((path / "manifest.json").read_text())["neighbour_context"] == 2
    records = rag.index.records()
    assert len(records) >= 4
    for record in records:
        context, (keys, values) = _expected_cache(rag, record.key)
        vector = rag.embedder.encode([record.text])[0]
        nearest = [r for r, _ in rag.index.search(vector, 3) if r.key != record.key][:2]
        nearest_ids = chunk_token_ids(rag.lm.tokenizer, nearest[0].text)
        assert context[-len(nearest_ids):] == nearest_ids  # the nearest chunk sits right before it
        assert len(context) == len(nearest_ids) + len(chunk_token_ids(rag.lm.tokenizer, nearest[1].text))
        stored_k, stored_v = rag.kvstore.load(record.key)
        assert (stored_k - keys).abs().max().item() <= 1e-4 and (stored_v - values).abs().max().item() <= 1e-4
        _, (plain_k, plain_v) = next(chunk_caches(rag.lm, rag.prefix, [chunk_token_ids(rag.lm.tokenizer, record.text)]))
        assert (stored_k - plain_k).abs().max().item() > 1e-3  # the context changed it
        lead_k, lead_v = rag.kvstore.load(plain_cache_key(record.key))  # the plain cache, for the first chunk
        assert (lead_k - plain_k).abs().max().item() <= 1e-4 and (lead_v - plain_v).abs().max().item() <= 1e-4


def test_reopened_index_fuses_the_first_chunk_from_its_plain_cache(neighboured, tiny_lm):
    _, path = neighboured
    rag = KVRag.open(path, model=tiny_lm)
    assert rag.neighbour_context == 2
    q = "Who designed the alpha reactor?"
    full = rag.answer(q, k=3, mode="full", max_new_tokens=5)
    assert rag.answer(q, k=3, mode="cacheblend", ratio=1.0, max_new_tokens=5).token_ids == full.token_ids
    reuse = rag.answer(q, k=3, mode="reuse", max_new_tokens=2)
    link = rag.answer(q, k=3, mode="attnlink", max_new_tokens=2, fuse_config=FuseConfig(mode="attnlink",
                                                                                         options={"link_tokens": 2}))
    assert link.recompute_fraction > reuse.recompute_fraction
    assert link.recompute_fraction * link.n_prompt_tokens == pytest.approx(
        reuse.recompute_fraction * reuse.n_prompt_tokens + 2 * 2)  # the first chunk is exact: no link tokens
    # the first chunk alone: its plain cache is exact there, so reuse equals a full prefill
    first = [full.chunks[0].key]
    assert rag.answer(q, chunks=first, mode="reuse", max_new_tokens=5).token_ids == \
        rag.answer(q, chunks=first, mode="full", max_new_tokens=5).token_ids


def test_a_corrupt_chunk_is_recomputed_after_its_neighbours(neighboured):
    rag, _ = neighboured
    key = rag.index.records()[1].key
    target = rag.kvstore.store._path(key)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    repaired_k, repaired_v = rag.load_chunk(rag.resolve_chunks([key])[0])
    _, (keys, values) = _expected_cache(rag, key)
    assert (repaired_k - keys).abs().max().item() <= 1e-4 and (repaired_v - values).abs().max().item() <= 1e-4
    assert rag.kvstore.is_valid(key)
    # a missing plain cache is recomputed when its chunk comes first in a prompt
    rag.kvstore.store._path(plain_cache_key(key)).unlink()
    rag.answer("What is it?", chunks=[key], mode="reuse", max_new_tokens=1)
    _, (plain_k, _) = next(chunk_caches(rag.lm, rag.prefix, [chunk_token_ids(rag.lm.tokenizer,
                                                                               rag.index.get(key).text)]))
    assert (rag.kvstore.load(plain_cache_key(key))[0] - plain_k).abs().max().item() <= 1e-4


def test_neighbour_context_must_match_the_index_and_be_non_negative(neighboured, tiny_model_dir, tmp_path):
    _, path = neighboured
    with pytest.raises(IndexMismatchError, match="neighbour_context=2"):
        KVRag.build(DOCS[:1], path, model=str(tiny_model_dir), neighbour_context=1, show_progress=False)
    with pytest.raises(ValueError, match="neighbour_context must be >= 0"):
        KVRag.build(DOCS, tmp_path / "new", model=str(tiny_model_dir), neighbour_context=-1, show_progress=False)


def test_a_build_that_places_the_neighbours_stored_caches(tiny_model_dir, tmp_path):
    path = tmp_path / "idx"
    rag = KVRag.build(DOCS, path, model=str(tiny_model_dir), codec="raw", split=SPLIT, neighbour_context=2,
                      show_progress=False)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["neighbour_context"] == 2 and manifest["neighbour_kv"] == rag.neighbour_kv == "stored"
    for record in rag.index.records():
        ids = chunk_token_ids(rag.lm.tokenizer, record.text)
        neighbours = nearest_chunks(rag.lm, rag.index, rag.prefix.length, 2, record.key, len(ids),
                                    rag.embedder.encode([record.text])[0])
        assert len(neighbours) == 2
        # what the build stored: the chunk prefilled after its neighbours' plain caches, placed
        placed = [(n.ids, rag.kvstore.load(plain_cache_key(n.key))) for n in neighbours]
        expected = chunk_cache_after(rag.lm, placed_prefix(rag.lm, rag.prefix, placed), ids)
        stored = rag.kvstore.load(record.key)
        assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(stored, expected))
        prefilled = cache_after_neighbours(rag.lm, rag.prefix, rag.kvstore, neighbours, ids, "prefill")
        plain = next(chunk_caches(rag.lm, rag.prefix, [ids]))[1]
        # nearer to the caches computed after the neighbours' tokens than to the plain one
        assert (stored[1] - prefilled[1]).norm() < (plain[1] - prefilled[1]).norm()
    # a neighbour's plain cache gone: computed again, stored again, and the chunk's cache unchanged
    record = rag.index.records()[0]
    ids = chunk_token_ids(rag.lm.tokenizer, record.text)
    neighbours = nearest_chunks(rag.lm, rag.index, rag.prefix.length, 2, record.key, len(ids),
                                rag.embedder.encode([record.text])[0])
    rag.kvstore.store._path(plain_cache_key(neighbours[0].key)).unlink()
    again = cache_after_neighbours(rag.lm, rag.prefix, rag.kvstore, neighbours, ids)
    assert rag.kvstore.is_valid(plain_cache_key(neighbours[0].key))
    assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(again, rag.kvstore.load(record.key)))
    with pytest.raises(ValueError, match="neighbour_kv must be one of"):
        cache_after_neighbours(rag.lm, rag.prefix, rag.kvstore, neighbours, ids, "exact")
    rag.close()
    with pytest.raises(IndexMismatchError, match="as 'stored', not 'prefill'"):
        KVRag.build(DOCS[:1], path, model=str(tiny_model_dir), neighbour_kv="prefill", show_progress=False)
    with pytest.raises(ValueError, match="neighbour_kv must be one of"):
        KVRag.build(DOCS, tmp_path / "new", model=str(tiny_model_dir), neighbour_context=1, neighbour_kv="x",
                    show_progress=False)


def test_chunks_indexed_without_caches_are_neighbours_and_get_their_caches_later(tiny_model_dir, tmp_path):
    path = tmp_path / "idx"
    pool, cached = DOCS[:2], DOCS[2:]
    rag = KVRag.build(pool, path, model=str(tiny_model_dir), codec="raw", split=SPLIT, neighbour_context=2,
                      show_progress=False,
                      caches=False)
    pool_keys = {r.key for r in rag.index.records()}
    assert pool_keys and not any(rag.kvstore.contains(k) or rag.kvstore.contains(plain_cache_key(k)) for k in pool_keys)
    stats = rag.add(cached, show_progress=False)
    new_keys = {r.key for r in rag.index.records()} - pool_keys
    assert stats.new_chunks == len(new_keys) > 0
    for key in new_keys:
        ids = chunk_token_ids(rag.lm.tokenizer, rag.index.get(key).text)
        neighbours = nearest_chunks(rag.lm, rag.index, rag.prefix.length, 2, key, len(ids),
                                    rag.embedder.encode([rag.index.get(key).text])[0])
        assert len({n.key for n in neighbours}) == len(neighbours) == 2
        # a neighbour from the uncached pool was given its plain cache, and the chunk was placed after it
        for n in neighbours:
            assert rag.kvstore.is_valid(plain_cache_key(n.key))
        placed = [(n.ids, rag.kvstore.load(plain_cache_key(n.key))) for n in neighbours]
        expected = chunk_cache_after(rag.lm, placed_prefix(rag.lm, rag.prefix, placed), ids)
        assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(rag.kvstore.load(key), expected))
    assert any(n in pool_keys for key in new_keys for n in (
        r.key for r, _ in rag.index.search(rag.embedder.encode([rag.index.get(key).text])[0], 3)))
    # the pool chunks still have no cache of their own; building the pool again computes the missing ones
    assert not any(rag.kvstore.contains(k) for k in pool_keys)
    again = rag.add(pool, show_progress=False)
    assert again.new_chunks == 0 and again.prefilled_chunks == len(pool_keys)
    assert all(rag.kvstore.is_valid(k) and rag.kvstore.is_valid(plain_cache_key(k)) for k in pool_keys)
    assert rag.add(pool, show_progress=False).prefilled_chunks == 0


def test_a_chunk_both_in_the_index_and_among_the_others_is_one_neighbour(lm, tiny_model_dir, tmp_path):
    rag = KVRag.build(DOCS, tmp_path / "idx", model=str(tiny_model_dir), codec="raw", split=SPLIT, show_progress=False,
                      caches=False)
    records = rag.index.records()
    target, other = records[0], records[1]
    vector = rag.embedder.encode([target.text])[0]
    ids = chunk_token_ids(rag.lm.tokenizer, other.text)
    neighbours = nearest_chunks(rag.lm, rag.index, rag.prefix.length, len(records) - 1, target.key, 4, vector,
                                [(2.0, other.key, ids)])
    keys = [n.key for n in neighbours]
    assert len(keys) == len(set(keys)) == len(records) - 1 and keys[-1] == other.key  # nearest, right before it
