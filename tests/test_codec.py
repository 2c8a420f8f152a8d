"""Codec round trips, error bounds, fitted-state persistence and robustness (raw, int8, cachegen)."""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.bench.decode import synthetic_chunk
from kvrag.codec import make_codec, rans
from kvrag.codec.base import Codec, CodecNotFittedError
from kvrag.codec.cachegen import BLOB_FORMAT, CacheGenCodec

L, H, D = 4, 2, 16


def synthetic_kv(seed: int, seq: int = 37, layers: int = L, heads: int = H, dim: int = D,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KV with the structure of real caches (`kvrag.bench.decode.synthetic_chunk`) in this file's tiny shape."""
    return synthetic_chunk(seed, layers, heads, seq, dim, scale)


@pytest.fixture(scope="module")
def fitted() -> CacheGenCodec:
    codec = make_codec("cachegen", 1)  # the bounds below were set at level 1; other levels via with_level
    assert isinstance(codec, CacheGenCodec)
    codec.fit([synthetic_kv(i, seq=40 + i) for i in range(8)], n_layers=L)
    return codec


def roundtrip(codec: Codec, keys: torch.Tensor, values: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, int]:
    ks, vs, nbytes = [], [], 0
    for layer in range(keys.shape[0]):
        blob = codec.encode_layer(keys[layer].to(dtype), values[layer].to(dtype), layer)
        nbytes += len(blob)
        k, v = codec.decode_layer(blob, layer, tuple(keys.shape[1:]), dtype)
        assert k.dtype == dtype and v.dtype == dtype and k.shape == keys.shape[1:]
        ks.append(k)
        vs.append(v)
    return torch.stack(ks), torch.stack(vs), nbytes


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / x.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_raw_is_exact(dtype: torch.dtype) -> None:
    keys, values = synthetic_kv(0)
    k, v, _ = roundtrip(make_codec("raw"), keys, values, dtype)
    assert torch.equal(k, keys.to(dtype)) and torch.equal(v, values.to(dtype))


def _side_by_side_planes(codec: Codec, blobs: list[bytes], seqs: list[int],
                         dtype: torch.dtype) -> list[torch.Tensor]:
    """Each chunk's blob cut into the codec's planes, then the chunks' tokens put side by side."""
    planes = codec.planes(H, D, dtype)
    assert planes is not None
    per_chunk = []
    for blob, seq in zip(blobs, seqs):
        flat, parts, at = torch.frombuffer(bytearray(blob), dtype=torch.uint8), [], 0
        for rows, width in planes:
            parts.append(flat[at : at + rows * seq * width].view(rows, seq, width))
            at += rows * seq * width
        assert at == len(blob)
        per_chunk.append(parts)
    return [torch.cat(column, dim=1) for column in zip(*per_chunk)]


@pytest.mark.parametrize("name", ["raw", "int8"])
@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
def test_planes_of_several_chunks_decode_like_each_chunk(name: str, dtype: torch.dtype,
                                                         out_dtype: torch.dtype) -> None:
    codec, seqs = make_codec(name), [5, 11, 1]
    kvs = [synthetic_kv(10 + i, seq=s) for i, s in enumerate(seqs)]
    layer = 2
    blobs = [codec.encode_layer(k[layer].to(dtype), v[layer].to(dtype), layer) for k, v in kvs]
    keys, values = codec.decode_planes(_side_by_side_planes(codec, blobs, seqs, dtype), dtype, out_dtype)
    each = [codec.decode_layer(b, layer, (H, s, D), dtype) for b, s in zip(blobs, seqs)]
    assert keys.dtype == out_dtype and keys.shape == (H, sum(seqs), D)
    assert torch.equal(keys, torch.cat([k for k, _ in each], dim=1).to(out_dtype))
    assert torch.equal(values, torch.cat([v for _, v in each], dim=1).to(out_dtype))


def test_cachegen_decodes_on_the_host_only(fitted: CacheGenCodec) -> None:
    assert fitted.planes(H, D, torch.float32) is None
    with pytest.raises(NotImplementedError, match="host"):
        fitted.decode_planes([], torch.float32, torch.float32)


def test_int8_error_is_within_half_a_step() -> None:
    keys, values = synthetic_kv(1, scale=3.0)
    k, v, nbytes = roundtrip(make_codec("int8"), keys, values)
    for x, y in ((keys, k), (values, v)):
        step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255
        assert bool(((x - y).abs() <= 0.51 * step + 1e-3 * x.abs().amax()).all())
    assert nbytes * 8 / (2 * keys.numel()) == pytest.approx(8 + 32 / D)


def test_int8_rejects_non_finite() -> None:
    keys, values = synthetic_kv(2)
    keys[0, 0, 0, 0] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        make_codec("int8").encode_layer(keys[0], values[0], 0)


def test_registry_levels() -> None:
    assert make_codec("cachegen").level == CacheGenCodec.default_level() == 2
    assert CacheGenCodec.levels() == (0, 1, 2, 3)
    assert make_codec("cachegen").needs_fit and not make_codec("int8").needs_fit
    with pytest.raises(ValueError, match="levels"):
        make_codec("cachegen", 7)


def assert_within_bound(codec: CacheGenCodec, x: torch.Tensor, y: torch.Tensor, kind: int) -> None:
    """Every token's L2 error is at most Δ/2 · sqrt(C) (plus float32 rounding)."""
    c = x.shape[1] * x.shape[3]
    for layer in range(x.shape[0]):
        err = (x[layer] - y[layer]).permute(1, 0, 2).reshape(x.shape[2], c).norm(dim=1)
        bound = codec.step(layer, kind) / 2 * math.sqrt(c)
        assert float(err.max()) <= bound * 1.001 + 1e-5 * float(x[layer].abs().max())


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_cachegen_roundtrip_within_bound(fitted: CacheGenCodec, level: int) -> None:
    codec = fitted.with_level(level)
    keys, values = synthetic_kv(100)
    k, v, _ = roundtrip(codec, keys, values)
    assert_within_bound(codec, keys, k, 0)
    assert_within_bound(codec, values, v, 1)
    assert rel_err(keys, k) < 0.1 and rel_err(values, v) < 0.1


def test_cachegen_levels_trade_size_for_error(fitted: CacheGenCodec) -> None:
    keys, values = synthetic_kv(101, seq=64)
    sizes, errors = [], []
    for level in CacheGenCodec.levels():
        k, v, nbytes = roundtrip(fitted.with_level(level), keys, values)
        sizes.append(nbytes)
        errors.append(rel_err(keys, k) + rel_err(values, v))
    assert sizes == sorted(sizes) and errors == sorted(errors, reverse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cachegen_half_precision(fitted: CacheGenCodec, dtype: torch.dtype) -> None:
    keys, values = synthetic_kv(102)
    k, v, _ = roundtrip(fitted, keys, values, dtype)
    assert rel_err(keys, k) < 0.1 and rel_err(values, v) < 0.1


def test_cachegen_out_of_distribution_values_use_escapes(fitted: CacheGenCodec) -> None:
    keys, values = synthetic_kv(103, scale=40.0)  # far outside the fitted alphabet
    keys[1, 0, 5, 3] = 5e4  # a lone spike
    k, v, _ = roundtrip(fitted, keys, values)
    assert_within_bound(fitted, keys, k, 0)
    assert_within_bound(fitted, values, v, 1)


@pytest.mark.parametrize("seq", [0, 1, 3])
def test_cachegen_short_chunks(fitted: CacheGenCodec, seq: int) -> None:
    keys, values = synthetic_kv(104, seq=seq)
    k, v, _ = roundtrip(fitted, keys, values)
    assert k.shape == keys.shape and v.shape == values.shape


@pytest.mark.parametrize("mix_dims", [0, 4])
def test_cachegen_mix_dims_within_bound(mix_dims: int) -> None:
    """Per-head components outside the cross-head mix (and no mix at all) decode within the bound."""
    codec = CacheGenCodec(mix_dims=mix_dims)
    codec.fit([synthetic_kv(i, seq=40 + i) for i in range(6)], n_layers=L)
    for level in CacheGenCodec.levels():
        c = codec.with_level(level)
        keys, values = synthetic_kv(109, seq=50)
        k, v, _ = roundtrip(c, keys, values)
        assert_within_bound(c, keys, k, 0)
        assert_within_bound(c, values, v, 1)


def test_cachegen_long_sequence(fitted: CacheGenCodec) -> None:
    """Thousands of tokens: every lane codes many symbols and the stream holds many words."""
    keys, values = synthetic_kv(110, seq=3001, layers=1)
    blob = fitted.encode_layer(keys[0], values[0], 0)
    k, v = fitted.decode_layer(blob, 0, (H, 3001, D), torch.float32)
    assert_within_bound(fitted, keys, k[None], 0)
    assert_within_bound(fitted, values, v[None], 1)


def test_cachegen_old_or_foreign_blob_format_is_refused(fitted: CacheGenCodec) -> None:
    keys, values = synthetic_kv(111)
    blob = bytearray(fitted.encode_layer(keys[0], values[0], 0))
    assert blob[0] == BLOB_FORMAT == 2
    old = bytes([1]) + bytes(blob[1:])
    with pytest.raises(ValueError, match="format 1"):
        fitted.decode_layer(old, 0, (H, 37, D), torch.float32)
    lanes = bytes(blob[:2]) + (64).to_bytes(2, "little") + bytes(blob[4:])
    with pytest.raises(ValueError, match="lanes"):
        fitted.decode_layer(lanes, 0, (H, 37, D), torch.float32)
    for cut in (len(blob) - 2, len(blob) - 1, 24, 10):
        with pytest.raises(ValueError):
            fitted.decode_layer(bytes(blob[:cut]), 0, (H, 37, D), torch.float32)


def _random_model(rng: np.random.Generator, alphabet: int) -> np.ndarray:
    probs = rng.dirichlet(np.full(alphabet, 0.3))
    return rans.quantise_frequencies(probs)


def test_rans_decode_table_flags_escapes_without_touching_frequencies() -> None:
    freq = rans.quantise_frequencies(np.array([0.5, 0.25, 0.125, 0.125]))
    sym, plain = rans.decode_table(freq)
    _, flagged = rans.decode_table(freq, np.array([False, True, False, True]))
    assert np.array_equal(np.bincount(sym, minlength=4), freq)
    assert np.array_equal(plain >> 16, np.r_[freq, np.zeros(rans.MAX_ALPHABET - 4)].astype(np.uint32))
    assert np.array_equal(flagged ^ plain, np.r_[0, rans.ESCAPE_FLAG, 0, rans.ESCAPE_FLAG,
                                                 np.zeros(rans.MAX_ALPHABET - 4)].astype(np.uint32))
    assert np.array_equal((flagged & (rans.PROB_SCALE - 1))[:4], rans.starts(freq))


@pytest.mark.parametrize("n_symbols", [0, 1, 31, 32, 33, 64, 1000, 20011])
def test_rans_kernels_match_the_reference_decoder(n_symbols: int) -> None:
    """Encode random runs; the numba decoder, the plain reference and the input agree exactly."""
    rng = np.random.default_rng(n_symbols)
    n_dist = 6  # three (tuple, single) pairs
    freqs = [_random_model(rng, int(a)) for a in rng.integers(2, 257, n_dist)]
    freq = np.zeros((n_dist, rans.MAX_ALPHABET), np.uint32)
    for d, f in enumerate(freqs):
        freq[d, : f.size] = f
    start = np.stack([rans.starts(f) for f in freq])
    rows = rng.integers(-127, 128, (n_dist, rans.MAX_ALPHABET * rans.TUPLE)).astype(np.int8)
    rows[rng.random(rows.shape) < 0.02] = rans.ESCAPE  # escaped codes: their values follow in code order
    has_escape = (rows.reshape(n_dist, rans.MAX_ALPHABET, rans.TUPLE) == rans.ESCAPE).any(axis=2)
    tables = [rans.decode_table(f, has_escape[d, : f.size]) for d, f in enumerate(freqs)]
    # segments: (values, k, dist); values split between tuples (k each) and singles
    cuts = np.sort(rng.integers(0, n_symbols + 1, 2))
    counts = np.diff([0, *cuts, n_symbols])
    segments = [(int(c) * 2 + (1 if c % 2 else 0), 2, 2 * j) for j, c in enumerate(counts)]
    symbols, run_len, run_dist, expect = [], [], [], []
    for n, k, dist in segments:
        for part, count in ((0, n // k), (1, n - (n // k) * k)):
            d = dist + part
            sym = rng.choice(freqs[d].size, size=count, p=freqs[d] / freqs[d].sum())
            symbols.append(sym)
            run_len.append(count)
            run_dist.append(d)
            width = k if part == 0 else 1
            expect.append(rows[d].reshape(-1, rans.TUPLE)[sym, :width].ravel())
    words, states, status = rans.encode(np.concatenate(symbols).astype(np.int32), np.asarray(run_len, np.int64),
                                        np.asarray(run_dist, np.int64), freq, start)
    assert status == rans.OK and states.dtype == np.uint32 and states.size == rans.LANES
    if n_symbols == 0:
        assert words.size == 0 and (states == rans.RANS_L).all()
    assert [v.astype(np.float32).tolist() for v in rans.decode_reference(words, states, segments, freqs, rows)] \
        == [np.concatenate(expect[2 * j : 2 * j + 2]).astype(np.float32).tolist() for j in range(len(segments))]
    expect_values = np.concatenate(expect).astype(np.float32)
    escaped = expect_values == rans.ESCAPE
    escapes = rng.normal(size=int(escaped.sum())).astype(np.float32) * 1000
    escapes[::3] = rans.ESCAPE  # an escaped value may equal the marker: it is filled in once, not again
    expect_values[escaped] = escapes
    n_vals = np.array([n for n, _, _ in segments], np.int64)
    out = np.full(int(n_vals.sum()) + rans.TUPLE, np.nan, np.float32)
    base = np.concatenate([[0], np.cumsum(n_vals)[:-1]]).astype(np.int64)
    padded = np.zeros(words.size + n_symbols + rans.LANES, np.uint16)  # the padding the decoder needs
    padded[: words.size] = words
    args = (padded, words.size, states, n_vals, np.array([k for _, k, _ in segments], np.int64),
            np.array([d for _, _, d in segments], np.int64), base, np.stack([t[0] for t in tables]),
            np.stack([t[1] for t in tables]), rows.astype(np.float32), escapes, out)
    assert rans.decode(*args) == rans.OK
    assert np.array_equal(out[: n_vals.sum()], expect_values)
    if escapes.size:  # the escape list must be used exactly
        assert rans.decode(*args[:-2], escapes[:-1], out) == rans.TOO_MANY_ESCAPES
        assert rans.decode(*args[:-2], np.append(escapes, 1.0), out) == rans.BAD_STREAM
    failed = (rans.BAD_STREAM, rans.TOO_MANY_ESCAPES)
    low = np.zeros_like(states)  # states no encoder leaves: reads stay in bounds, the stream fails
    assert rans.decode(*args[:2], low, *args[3:]) in failed
    if words.size:  # a flipped word never passes unnoticed
        padded[rng.integers(0, words.size)] ^= 1 << int(rng.integers(0, 16))
        assert rans.decode(*args) in failed


def test_rans_refill_takes_words_in_lane_order_for_every_lane_mask() -> None:
    """The host decoder renormalises 8 lanes at a time with a permutation of the next 8 words: it must
    give the same states and read position as renormalising lane after lane, for every mask of lanes."""
    rng = np.random.default_rng(5)
    for trial in range(300):
        x = rng.integers(0, 2**32, rans.LANES, dtype=np.uint64).astype(np.uint32)
        low = rng.random(rans.LANES) < (trial % 11) / 10  # from no lane reading to every lane reading
        x[low] = rng.integers(0, rans.RANS_L, int(low.sum()))
        p0 = int(rng.integers(0, 7))
        words = rng.integers(0, 2**16, p0 + rans.LANES, dtype=np.uint64).astype(np.uint16)  # exactly what it may read
        expect, p = x.astype(np.uint64), p0
        for lane in range(rans.LANES):
            if expect[lane] < rans.RANS_L:
                expect[lane] = (expect[lane] << 16) | int(words[p])
                p += 1
        assert rans._refill(x, words, np.uint64(p0)) == p
        assert np.array_equal(x, expect.astype(np.uint32))
    masks = rans._REFILL_OFFSETS.reshape(256, 8)  # each lane that reads gets the count of readers before it
    assert masks[0b10110110].tolist() == [0, 0, 1, 0, 2, 3, 0, 4]


def test_rans_rejects_symbols_without_frequency() -> None:
    freq = np.zeros((1, rans.MAX_ALPHABET), np.uint32)
    freq[0, :2] = rans.quantise_frequencies(np.array([0.5, 0.5]))
    start = rans.starts(freq[0])[None]
    _, _, status = rans.encode(np.array([0, 5], np.int32), np.array([2], np.int64), np.array([0], np.int64),
                               freq, start)
    assert status == rans.BAD_SYMBOL
    with pytest.raises(ValueError, match="distribution"):
        rans.quantise_frequencies(np.ones(300))


def test_cachegen_rejects_bad_input(fitted: CacheGenCodec) -> None:
    keys, values = synthetic_kv(105)
    with pytest.raises(ValueError, match="does not match"):
        fitted.encode_layer(keys[0, :1], values[0, :1], 0)
    with pytest.raises(ValueError, match="layer"):
        fitted.encode_layer(keys[0], values[0], L)
    keys[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        fitted.encode_layer(keys[0], values[0], 0)
    keys[0, 0, 0, 0], keys[0, 0, 0, 1] = math.inf, -math.inf  # the sum is nan, not inf
    with pytest.raises(ValueError, match="non-finite"):
        fitted.encode_layer(keys[0], values[0], 0)
    huge = torch.full_like(keys[0], 3e38)  # finite, though its sum is not: encoded (clamped), not refused
    assert fitted.encode_layer(huge, values[0], 0)


@pytest.mark.parametrize("seq", [0, 5, 37])
def test_cachegen_layer_symbols_match_a_plain_reference(fitted: CacheGenCodec, seq: int) -> None:
    """The numba symbol builder against the format written out in numpy, escapes included."""
    from kvrag.codec.cachegen_format import layer_symbols

    plan = fitted._require_fit("test").tables(fitted.level).plans[1]
    rng = np.random.default_rng(seq)
    codes = [rng.integers(-9, 10, (seq, H * D)).astype(np.int32) for _ in range(2)]
    codes[1][rng.random(codes[1].shape) < 0.05] = 3000  # far outside every band's alphabet
    symbols, run_len, escaped = [], [], []
    for j in range(plan.kind.size):
        seg = codes[plan.kind[j]][:, plan.col0[j] : plan.col0[j] + plan.width[j]].T.ravel()  # column-major
        e, k = int(plan.radius[j]), int(plan.k[j])
        digits = np.where(np.abs(seg) > e, 2 * e + 1, seg + e)
        n_tuples = seg.size // k
        symbols += [digits[: n_tuples * k].reshape(n_tuples, k) @ ((2 * e + 2) ** np.arange(k - 1, -1, -1)),
                    digits[n_tuples * k :]]
        run_len += [n_tuples, seg.size - n_tuples * k]
        escaped.append(seg[np.abs(seg) > e])
    got = layer_symbols(*codes, plan.kind, plan.col0, plan.width, plan.radius, plan.k)
    assert got[0].tolist() == np.concatenate(symbols).tolist() and got[1].tolist() == run_len
    assert got[2].tolist() == np.concatenate(escaped).tolist() and (seq == 0 or got[2].size > 0)


def test_cachegen_needs_fit(tmp_path: Path) -> None:
    codec = make_codec("cachegen")
    keys, values = synthetic_kv(106)
    with pytest.raises(CodecNotFittedError, match="fit"):
        codec.encode_layer(keys[0], values[0], 0)
    with pytest.raises(CodecNotFittedError, match="load_state"):
        codec.decode_layer(b"\0" * 32, 0, (H, 37, D), torch.float32)
    with pytest.raises(CodecNotFittedError):
        codec.save_state(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        codec.load_state(tmp_path / "missing")


def test_cachegen_blob_from_other_level_or_state_is_refused(fitted: CacheGenCodec) -> None:
    keys, values = synthetic_kv(107)
    blob = fitted.encode_layer(keys[0], values[0], 0)
    with pytest.raises(ValueError, match="level"):
        fitted.with_level(0).decode_layer(blob, 0, (H, 37, D), torch.float32)
    other = make_codec("cachegen", fitted.level)  # same level: only the state differs
    other.fit([synthetic_kv(50 + i) for i in range(3)], n_layers=L)
    assert other.params()["state"] != fitted.params()["state"]
    with pytest.raises(ValueError, match="state"):
        other.decode_layer(blob, 0, (H, 37, D), torch.float32)
    with pytest.raises(ValueError, match="tokens"):
        fitted.decode_layer(blob, 0, (H, 36, D), torch.float32)


def test_cachegen_state_save_load_roundtrip(fitted: CacheGenCodec, tmp_path: Path) -> None:
    fitted.save_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cachegen.json", "cachegen.npz"]
    meta = json.loads((tmp_path / "cachegen.json").read_text())
    assert meta["state_id"] == fitted.params()["state"]
    with np.load(tmp_path / "cachegen.npz", allow_pickle=False) as npz:
        assert all(npz[name].dtype != object for name in npz.files)
    loaded = make_codec("cachegen", 2)
    loaded.load_state(tmp_path)
    assert loaded.params() == {**fitted.params(), "level": 2}
    keys, values = synthetic_kv(108)
    for level in CacheGenCodec.levels():
        a, b = fitted.with_level(level), loaded.with_level(level)
        blob = a.encode_layer(keys[1], values[1], 1)
        assert blob == b.encode_layer(keys[1], values[1], 1)
        for x, y in zip(a.decode_layer(blob, 1, (H, 37, D), torch.float32),
                        b.decode_layer(blob, 1, (H, 37, D), torch.float32)):
            assert torch.equal(x, y)


def test_cachegen_state_tampering_is_detected(fitted: CacheGenCodec, tmp_path: Path) -> None:
    fitted.save_state(tmp_path)
    meta = json.loads((tmp_path / "cachegen.json").read_text())
    meta["steps"]["1"][0][0] *= 2
    (tmp_path / "cachegen.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="state id"):
        make_codec("cachegen").load_state(tmp_path)


def test_cachegen_fit_is_deterministic() -> None:
    samples = [synthetic_kv(i) for i in range(3)]
    a, b = make_codec("cachegen"), make_codec("cachegen")
    a.fit(samples, L)
    b.fit(samples, L)
    assert a.params() == b.params()


def test_cachegen_fit_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least one"):
        make_codec("cachegen").fit([], L)
    with pytest.raises(ValueError, match="n_layers"):
        make_codec("cachegen").fit([synthetic_kv(0)], L + 1)


def test_cachegen_decodes_from_worker_threads(fitted: CacheGenCodec) -> None:
    chunks = [synthetic_kv(200 + i) for i in range(6)]
    blobs = [[fitted.encode_layer(k[i], v[i], i) for i in range(L)] for k, v in chunks]
    serial = [[fitted.decode_layer(b, i, (H, 37, D), torch.float32) for i, b in enumerate(bl)] for bl in blobs]

    def decode(bl: list[bytes]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [fitted.with_level(1).decode_layer(b, i, (H, 37, D), torch.float32) for i, b in enumerate(bl)]

    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(decode, blobs))
    for s_chunk, t_chunk in zip(serial, threaded):
        for (ks, vs), (kt, vt) in zip(s_chunk, t_chunk):
            assert torch.equal(ks, kt) and torch.equal(vs, vt)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=600), seq=st.integers(0, 50), layer=st.integers(0, L - 1))
def test_cachegen_random_blobs_only_raise_value_error(fitted: CacheGenCodec, data: bytes, seq: int,
                                                      layer: int) -> None:
    try:
        k, v = fitted.decode_layer(data, layer, (H, seq, D), torch.float32)
    except ValueError:
        return
    assert k.shape == (H, seq, D) and bool(torch.isfinite(k).all() and torch.isfinite(v).all())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_cachegen_mutated_blobs_only_raise_value_error(fitted: CacheGenCodec, data: st.DataObject) -> None:
    keys, values = synthetic_kv(300)
    blob = bytearray(fitted.encode_layer(keys[2], values[2], 2))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        k, v = fitted.decode_layer(bytes(blob[:cut] if data.draw(st.booleans()) else blob), 2,
                                   (H, 37, D), torch.float32)
    except ValueError:
        return
    assert bool(torch.isfinite(k).all() and torch.isfinite(v).all())


@pytest.mark.slow
def test_cachegen_on_real_smollm2_kv(smollm2) -> None:
    """Real pre-RoPE caches of SmolLM2: size target (<= 2.67 bits/element) and small error."""
    from conftest import DATA

    from kvrag.indexing.kvgen import chunk_caches, prefix_cache
    from kvrag.storage.container import encode_chunk

    rows = [json.loads(line) for line in (DATA / "qa" / "musique_cacheblend_dev75.jsonl").open()]
    texts = [c["text"] for r in rows[:4] for c in r["ctxs"]][:30]
    ids = [smollm2.tokenizer(t, add_special_tokens=False)["input_ids"][:200] for t in texts]
    prefix = prefix_cache(smollm2, smollm2.tokenizer("Passages:\n\n")["input_ids"])
    caches = dict(chunk_caches(smollm2, prefix, ids))
    samples, test = [caches[i] for i in range(24)], [caches[i] for i in range(24, 30)]
    codec = make_codec("cachegen")
    codec.fit(samples, smollm2.spec.n_layers)
    # relative L2 error bounds (K, V), ~1.3x what 300 SmolLM2 chunks measured
    expected = {0: (0.14, 0.32), 1: (0.09, 0.20), 2: (0.06, 0.12), 3: (0.03, 0.06)}
    bits = {}
    for level in CacheGenCodec.levels():
        c = codec.with_level(level)
        ek = ev = nk = nv = 0.0
        nbytes = elements = 0
        for keys, values in test:
            k, v, _ = roundtrip(c, keys, values)
            nbytes += len(encode_chunk(c, "ab" * 20, smollm2.fingerprint, keys, values))  # metadata included
            elements += 2 * keys.numel()
            ek, nk = ek + float((keys - k).pow(2).sum()), nk + float(keys.pow(2).sum())
            ev, nv = ev + float((values - v).pow(2).sum()), nv + float(values.pow(2).sum())
            assert_within_bound(c, keys, k, 0)
        bits[level] = nbytes * 8 / elements
        errors = (math.sqrt(ek / nk), math.sqrt(ev / nv))
        assert errors[0] < expected[level][0] and errors[1] < expected[level][1], (level, errors)
    assert bits[0] < bits[1] < bits[2] < bits[3]
    assert bits[1] <= 16 / 6  # level 1: at least 6x smaller than bf16
    assert bits[CacheGenCodec.default_level()] <= 16 / 4.7  # the default, level 2: about 4.8x


def test_codec_bench_rows_and_markdown() -> None:
    from kvrag.bench.codec import run_codec_bench, to_markdown

    rows = run_codec_bench([synthetic_kv(i, seq=48) for i in range(6)], codecs=("raw", "int8", "cachegen"),
                           levels=(2,), repeats=1)
    assert [(r["codec"], r["level"]) for r in rows] == [("raw", 0), ("int8", 0), ("cachegen", 2)]
    raw, int8, cachegen = rows
    assert raw["rel_err_k"] == 0 and raw["bits_per_element"] > 32  # float32 plus the container header
    assert int8["bits_per_element"] > cachegen["bits_per_element"] and cachegen["rel_err_v"] < 0.1
    assert all(r["decode_MBps"] > 0 and r["decode_into_MBps"] > 0
               and r["ratio_vs_bf16"] == pytest.approx(16 / r["bits_per_element"]) for r in rows)
    table = to_markdown(rows)
    assert table.count("\n| ") == 3 and "cachegen | 2*" in table  # 3 rows after the header


def test_cachegen_clamping_a_value_beyond_its_range_is_logged(fitted: CacheGenCodec, caplog) -> None:
    """A coefficient beyond ±32767 steps cannot be coded: it is clamped, and the log says so (the bound breaks)."""
    keys, values = synthetic_kv(104)
    with caplog.at_level(logging.WARNING, logger="kvrag.codec.cachegen"):
        fitted.encode_layer(keys[2], values[2], 2)
    assert not caplog.records  # in range: silent
    keys[2, 1, 7, 4] = 1e9
    with caplog.at_level(logging.WARNING, logger="kvrag.codec.cachegen"):
        blob = fitted.encode_layer(keys[2], values[2], 2)
    assert any("layer 2 (keys)" in r.getMessage() and "clamped" in r.getMessage() for r in caplog.records)
    k, _ = fitted.decode_layer(blob, 2, tuple(keys[2].shape), torch.float32)
    assert k.shape == keys[2].shape and bool(torch.isfinite(k).all())
    assert float((k - keys[2]).abs().max()) > 1e6  # the clamped value is far off: why the warning is there


def test_a_fitted_cachegen_codec_loads_without_numba_until_it_codes(fitted: CacheGenCodec, tmp_path: Path) -> None:
    """numba (about 50 MB resident) is imported by the first encode or decode, not by opening the codec and its
    fitted state: a process that opens an index and prefills in full never loads it."""
    import subprocess
    import sys

    fitted.save_state(tmp_path)
    code = ("import sys; import kvrag.rag; from kvrag.codec import make_codec, rans; "
            f"codec = make_codec('cachegen', 1); codec.load_state({str(tmp_path)!r}); "
            "codec._require_fit('test').tables(codec.level); "
            "assert 'numba' not in sys.modules, 'numba imported before any encode or decode'; "
            "rans.decode; assert 'numba' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
