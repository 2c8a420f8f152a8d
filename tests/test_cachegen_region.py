"""`CacheGenCodec.decode_region`: many layer blobs decoded together, on the host or by the Triton rANS
decoder (`kvrag.kernels.rans_decode`; interpreted on the CPU, see conftest), against `decode_layer`."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from test_codec import D, H, L, synthetic_kv

from kvrag.codec import cachegen_region as region
from kvrag.codec import rans
from kvrag.codec.cachegen import CacheGenCodec
from kvrag.kernels import rans_decode

LENGTHS = [37, 0, 3, 1, 70]
# where the Triton decoder runs: CUDA, or the CPU in Triton's interpreter (conftest sets it up without CUDA)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def codec() -> CacheGenCodec:
    """mix_dims 4 < head_dim 16: both cross-head and per-head rows are coded."""
    c = CacheGenCodec(mix_dims=4)
    c.fit([synthetic_kv(i, seq=40 + i) for i in range(8)], n_layers=L)
    return c


def encode(codec: CacheGenCodec, layers: list[int], lengths: list[int]) -> list[list[bytes]]:
    kvs = [synthetic_kv(300 + j, seq=n) for j, n in enumerate(lengths)]
    return [[codec.encode_layer(k[layer], v[layer], layer) for k, v in kvs] for layer in layers]


def per_chunk(codec: CacheGenCodec, blobs: list[list[bytes]], layers: list[int], lengths: list[int],
              dtype: torch.dtype) -> torch.Tensor:
    """``[n_layers, 2, H, T, D]`` from `decode_layer`, chunk by chunk."""
    out = []
    for row, layer in zip(blobs, layers):
        kv = [codec.decode_layer(b, layer, (H, n, D), dtype) for b, n in zip(row, lengths)]
        out.append(torch.stack([torch.cat([x[kind] for x in kv], dim=1) for kind in (0, 1)]))
    return torch.stack(out)


def coded_rows(codec: CacheGenCodec, n_layers: int) -> torch.Tensor:
    """The code rows the rANS decoder writes (the first mix_dims rows of each head come from the mix)."""
    m = codec._shared.state.mix_dims
    mix = torch.ones(n_layers * 2 * H * m, dtype=torch.bool)
    heads = torch.ones(n_layers * 2 * H, D, dtype=torch.bool)
    heads[:, :m] = False
    return torch.cat([mix, heads.flatten()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_region_on_the_host_is_decode_layer_side_by_side(codec: CacheGenCodec, dtype: torch.dtype) -> None:
    layers = [2, 0, 3]
    blobs = encode(codec, layers, LENGTHS)
    got = codec.decode_region(blobs, layers, LENGTHS, dtype, kernel=False)
    want = per_chunk(codec, blobs, layers, LENGTHS, dtype)
    assert got.shape == (3, 2, H, sum(LENGTHS), D) and got.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


def test_triton_decoder_gives_the_host_codes(codec: CacheGenCodec) -> None:
    """Bit for bit, with escapes, empty and one-token chunks, tuples straddling columns, several layers."""
    layers, lengths = [1, 3], [30, 0, 3, 1, 9]
    kvs = [synthetic_kv(300 + j, seq=n) for j, n in enumerate(lengths)]
    kvs[0] = (kvs[0][0] * 40, kvs[0][1])  # far outside the fitted spread: many escaped codes
    blobs = [[codec.encode_layer(k[layer], v[layer], layer) for k, v in kvs] for layer in layers]
    assert struct.unpack_from("<I", blobs[0][0], 12)[0] > 10, "the test needs escapes"
    batch = region.build_batch(codec, blobs, layers, lengths)
    assert batch.max_starts >= 2  # a step crosses several runs: the 1- and 3-token chunks have tiny segments
    host = region.host_codes(codec, blobs, layers, lengths)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    codes = region.kernel_codes(codec, batch, device).cpu()
    rows = coded_rows(codec, len(layers))
    assert torch.equal(codes[rows], host[rows])
    out = codec.decode_region(blobs, layers, lengths, torch.float32, device, kernel=True).cpu()
    torch.testing.assert_close(out, per_chunk(codec, blobs, layers, lengths, torch.float32), rtol=1e-5, atol=1e-5)


def _with_header(blob: bytes, n_esc_delta: int) -> bytes:
    """The blob with its escape count lowered by ``-n_esc_delta`` and that many escapes cut from its list."""
    head = bytearray(blob[: 20 + 4 * rans.LANES])
    n_esc = struct.unpack_from("<I", head, 12)[0]
    struct.pack_into("<I", head, 12, n_esc + n_esc_delta)
    esc_end = len(head) + 2 * n_esc
    return bytes(head) + blob[len(head) : esc_end + 2 * n_esc_delta] + blob[esc_end:]


def test_triton_decoder_reports_corrupt_streams(codec: CacheGenCodec) -> None:
    layers = [0]
    kvs = [synthetic_kv(400 + j, seq=n) for j, n in enumerate([30, 25])]
    kvs[1] = (kvs[1][0] * 40, kvs[1][1])
    blobs = [[codec.encode_layer(k[0], v[0], 0) for k, v in kvs]]
    flipped = bytearray(blobs[0][0])
    flipped[-7] ^= 0x5A  # a word of the stream
    with pytest.raises(ValueError, match="blob 0 of the region does not decode"):
        codec.decode_region([[bytes(flipped), blobs[0][1]]], layers, [30, 25], torch.float32, KERNEL_DEVICE,
                            kernel=True)
    short = _with_header(blobs[0][1], -1)  # one escape too few: the stream asks for more than the list holds
    with pytest.raises(ValueError, match=rf"blob 1 .*status {rans_decode.TOO_MANY_ESCAPES}"):
        codec.decode_region([[blobs[0][0], short]], layers, [30, 25], torch.float32, KERNEL_DEVICE, kernel=True)
    with pytest.raises(ValueError, match="blob 1"):
        codec.decode_region([[blobs[0][0], short]], layers, [30, 25], torch.float32, kernel=False)


def test_region_checks_its_inputs(codec: CacheGenCodec) -> None:
    blobs = encode(codec, [0], [5, 6])
    with pytest.raises(ValueError, match="need as many blobs"):
        codec.decode_region(blobs, [0, 1], [5, 6], torch.float32)
    with pytest.raises(ValueError, match="holds 5 tokens"):
        codec.decode_region(blobs, [0], [6, 6], torch.float32, KERNEL_DEVICE, kernel=True)
    with pytest.raises(ValueError, match="outside the fitted"):
        codec.decode_region(blobs, [L], [5, 6], torch.float32, KERNEL_DEVICE, kernel=True)
    batch = region.build_batch(codec, blobs, [0], [5, 6])
    sizes = [len(b) for b in blobs[0]]
    at, _ = region.aligned(sizes)
    with pytest.raises(ValueError, match="do not fit"):  # a blob not at a multiple of 4
        region.batch_from(codec, batch.data, at + 2, sizes, [0], [5, 6])
    with pytest.raises(ValueError, match="do not fit"):  # one blob for two chunks
        region.batch_from(codec, batch.data, at[:1], sizes[:1], [0], [5, 6])
    with pytest.raises(ValueError, match="blob 0 .*holds 5 tokens, header says 6"):  # the lengths swapped
        region.batch_from(codec, batch.data, at, sizes, [0], [6, 5])


def test_stream_runs_cover_every_code(codec: CacheGenCodec) -> None:
    plan = codec._shared.tables(codec.level).plans[2]
    for seq in (1, 2, 5, 33):
        runs, _, symbols, _ = region.layer_runs(plan, np.array([seq]))
        n_sym = int(symbols[0])
        count = torch.diff(torch.tensor(list(runs[:, 0]) + [n_sym]))
        assert (count > 0).all() and int(runs[0, 0]) == 0
        assert int((count * torch.from_numpy(runs[:, 2].astype("int64"))).sum()) == seq * int(plan.width.sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_region_on_cuda_matches_the_host(codec: CacheGenCodec) -> None:
    layers = list(range(L))
    blobs = encode(codec, layers, LENGTHS)
    got = codec.decode_region(blobs, layers, LENGTHS, torch.bfloat16, "cuda")
    assert got.device.type == "cuda"
    want = per_chunk(codec, blobs, layers, LENGTHS, torch.bfloat16)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)


def test_triton_decoder_self_check_passes() -> None:
    """The once-per-device check that picks the device path (a two-run stream decoded exactly)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert rans_decode.works(device)


def test_without_triton_the_device_path_stays_off(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """No triton: the check says so (with a warning) and decoding explicitly on the kernel fails clearly."""
    monkeypatch.setattr(rans_decode, "HAS_TRITON", False)
    with caplog.at_level("WARNING"):
        assert not rans_decode.works.__wrapped__(torch.device("cpu"))
    assert "needs triton" in caplog.text and not rans_decode.available()
    with pytest.raises(RuntimeError, match="pip install triton"):
        rans_decode.decode(torch.zeros(4, dtype=torch.uint8), torch.zeros((1, rans_decode.META), dtype=torch.int32),
                           torch.zeros((0, rans_decode.RUN), dtype=torch.int32), {}, torch.zeros(1, 1), 0)
