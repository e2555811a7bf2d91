"""Codecs: each round trip within its stated bound, fallbacks, for_mean exactness, bad payloads."""

import logging
import math

import pytest
import torch

from protocol.codecs import FLUSH_BELOW, WIRE_IDS, Codec, decode, make_codec, max_encoded_bytes
from protocol.errors import BadPayload
from protocol.manifest import CompressionSpec

CODECS = ("none", "fp16", "bf16", "int8", "int4", "fp4", "fp3", "topk", "lowrank")
SHAPES = [(), (0,), (7,), (1000,), (33, 65), (0, 5), (4, 0), (1, 300), (300, 1), (3, 5, 7), (2, 3, 4, 5)]
ULP = 2.0**-22  # slack for fp32 rounding in the bounds, relative to the block's absmax


def _data(kind: str, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "outliers":  # a few values 10^4 larger than the rest
        mask = torch.rand(shape, generator=g) < 0.01
        x = torch.where(mask, x * 1e4, x)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "huge":
        x = x * 1e28
    elif kind == "scales":  # magnitudes spread over 40 decades, element by element
        x = x * torch.pow(10.0, torch.randint(-20, 20, shape, generator=g).float())
    return x


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).abs()
    pad = -flat.numel() % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    a = blocks.amax(dim=1) if blocks.numel() else torch.zeros(0)
    return a.repeat_interleave(block)[: flat.numel()].reshape(x.shape)


def check_bound(name: str, x: torch.Tensor, y: torch.Tensor, codec: Codec) -> None:
    """Assert the round-trip bound the codec's module docstring states."""
    assert y.shape == x.shape and y.dtype == torch.float32 and bool(torch.isfinite(y).all())
    err = (x - y).abs()
    fmt = codec.resolve(tuple(x.shape))
    a = x.abs().max() if x.numel() else torch.tensor(0.0)
    if fmt == "none":
        assert torch.equal(x, y)
    elif fmt == "fp16":
        assert bool((err <= 2.0**-11 * x.abs() + 2.0**-39 * a).all()), float(err.max())
    elif fmt == "bf16":
        assert bool((err <= 2.0**-8 * x.abs() + 2.0**-140 * a).all()), float(err.max())
    elif fmt in ("int8", "int4", "fp4", "fp3"):
        ab = _block_absmax(x, codec.block_size)
        flushed = ab < FLUSH_BELOW
        assert bool((y[flushed] == 0).all())
        if fmt in ("fp4", "fp3"):
            bound = torch.maximum(x.abs() / 3, ab / (128 if fmt == "fp4" else 8))
        else:
            bound = ab / (254 if fmt == "int8" else 14)
        assert bool((err <= bound + ULP * ab)[~flushed].all()), float((err - bound)[~flushed].max())
    elif fmt == "topk":
        k = min(x.numel(), math.ceil(codec.topk_fraction * x.numel()) * codec.multiplier)
        kept = y != 0
        assert int(kept.sum()) <= k
        assert bool((err[kept] <= 2.0**-11 * x.abs()[kept] + 2.0**-39 * a).all())
        assert bool((y[~kept] == 0).all())
        if k < x.numel():
            kth = x.abs().reshape(-1).kthvalue(x.numel() - k + 1).values  # the k-th largest |x|
            assert bool((x.abs()[~kept] <= kth).all())
    elif fmt == "lowrank":
        m = x.reshape(x.shape[0], -1)
        assert float((m - y.reshape(m.shape)).norm()) <= float(m.norm()) * (1 + 2.0**-9) + 1e-30
    else:
        raise AssertionError(fmt)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kind", ["normal", "outliers", "zeros", "tiny", "huge", "scales"])
def test_round_trip_within_stated_bound(name, kind):
    codec = Codec(name, block_size=16, topk_fraction=0.1, rank=3)
    for i, shape in enumerate(SHAPES):
        x = _data(kind, shape, seed=i)
        data = codec.encode(x, seed=7)
        assert len(data) == codec.encoded_size(shape) <= max_encoded_bytes(shape)
        assert data[0] == WIRE_IDS[codec.resolve(shape)]  # self-describing: the first byte says how
        check_bound(name, x, decode(data, shape, seed=7), codec)


@pytest.mark.parametrize("name", CODECS)
def test_row_slices_encode_on_their_own(name):
    # The all-reduce compresses row ranges of one tensor separately: each piece decodes alone.
    x = _data("normal", (40, 6, 5), seed=1)
    codec = (
        make_codec(CompressionSpec(codec=name, block_size=8, topk_fraction=0.05, rank=2), x.shape)
        if name != "fp3"
        else Codec("fp3", block_size=8)
    )  # fp3: only adaptive plans choose it
    pieces = []
    for rows in (slice(0, 13), slice(13, 14), slice(14, 40)):
        piece = x[rows]
        y = decode(codec.encode(piece, seed=3), tuple(piece.shape), seed=3)
        check_bound(name, piece, y, codec)
        pieces.append(y)
    assert torch.cat(pieces).shape == x.shape


def test_known_errors_of_the_dense_codecs_on_normal_data():
    # Relative L2 errors that the docs quote: tight enough to catch a codec that silently degrades.
    x = _data("normal", (256, 128), seed=5)
    expected = {"fp16": 3e-4, "bf16": 3e-3, "int8": 8e-3, "int4": 0.13, "fp4": 0.22, "fp3": 0.30}
    for name, limit in expected.items():
        y = decode(Codec(name).encode(x, seed=0), tuple(x.shape), seed=0)
        assert float((x - y).norm() / x.norm()) < limit, name


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_rejects_nan_and_inf(name, bad):
    x = torch.randn(8, 8)
    x[3, 4] = bad
    with pytest.raises(BadPayload, match="NaN or inf"):
        Codec(name).encode(x, seed=0)


def test_fp16_never_overflows_and_huge_tensors_go_exact(caplog):
    x = torch.tensor([1e10, -3e9, 1.0, 7e-20])  # beyond fp16's 65504 and below its subnormals
    y = decode(Codec("fp16").encode(x, seed=0), (4,), seed=0)
    assert bool((torch.isfinite(y)).all())
    torch.testing.assert_close(y[:2], x[:2], rtol=2**-11, atol=0)
    x = torch.tensor([[2.0**101, 1.0], [3.0, -4.0]])
    with caplog.at_level(logging.WARNING, logger="protocol.codecs"):
        data = Codec("int4").encode(x, seed=0)
    assert data[0] == WIRE_IDS["none"] and "2^100" in caplog.text
    assert torch.equal(decode(data, (2, 2), seed=0), x)


def test_fp4_and_fp3_levels_are_powers_of_two_of_the_block_absmax():
    x = torch.tensor([1.0, 0.75, 0.74, 0.5, 2.0**-6, 2.0**-7, 0.9 * 2.0**-7, -0.3, 0.0, -0.13, 0.12])
    y = decode(Codec("fp4", block_size=16).encode(x, seed=0), (11,), seed=0)
    # 0.75 = 1.5·2^-1 rounds up; below 2^-7 rounds to 0; -0.3 is nearest to -0.25.
    assert y.tolist() == [1.0, 1.0, 0.5, 0.5, 2.0**-6, 2.0**-6, 0.0, -0.25, 0.0, -0.125, 0.125]
    y = decode(Codec("fp3", block_size=16).encode(x, seed=0), (11,), seed=0)
    # E2M0: 1, 1/2, 1/4 and 0 (below 1/8).
    assert y.tolist() == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, -0.25, 0.0, -0.25, 0.0]


def test_make_codec_fallbacks_and_roles():
    spec = CompressionSpec(codec="topk", phi_codec="int8", topk_fraction=0.6, rank=64)
    assert make_codec(spec, (128,)).name == "none"  # 1-D: never top-k
    assert make_codec(spec, ()).name == "none"
    topk = make_codec(spec, (64, 64))
    assert topk.name == "topk" and topk.resolve((64, 64)) == "fp16"  # 60 % top-k is bigger than fp16
    assert make_codec(CompressionSpec(codec="topk"), (64, 64)).resolve((64, 64)) == "topk"
    lowrank = make_codec(CompressionSpec(codec="lowrank", rank=64), (100, 80))
    assert lowrank.resolve((100, 80)) == "fp16" and lowrank.resolve((1000, 800)) == "lowrank"
    assert make_codec(spec, (8, 8), role="phi").name == "int8"
    with pytest.raises(ValueError, match="peer.sync.adaptive.plan"):
        make_codec(CompressionSpec(codec="adaptive"), (8, 8))
    with pytest.raises(ValueError, match="role"):
        make_codec(spec, (8, 8), role="momentum")


def test_encoding_is_deterministic_and_lowrank_draws_q0_from_the_seed():
    x = _data("normal", (64, 48), seed=2)
    for name in CODECS:
        assert Codec(name).encode(x, seed=11) == Codec(name).encode(x, seed=11)
    assert Codec("lowrank").encode(x, seed=1) != Codec("lowrank").encode(x, seed=2)


def test_for_mean_of_topk_is_exact_up_to_fp16():
    n, shape = 4, (50, 40)
    codec = Codec("topk", topk_fraction=0.02)
    decoded = [decode(codec.encode(_data("normal", shape, seed=s), seed=0), shape, seed=0) for s in range(n)]
    mean = sum(decoded) / n
    assert int((mean != 0).sum()) > math.ceil(0.02 * 2000)  # more nonzeros than one peer's k
    y = decode(codec.for_mean(n).encode(mean, seed=0), shape, seed=0)
    assert bool((y != 0).eq(mean != 0).all())
    torch.testing.assert_close(y, mean, rtol=2**-11, atol=0)
    assert codec.for_mean(1) == codec and Codec("int8").for_mean(8) == Codec("int8")


def test_for_mean_of_lowrank_is_exact_up_to_fp16():
    n, shape, r = 3, (60, 4, 10), 2
    codec = Codec("lowrank", rank=r)
    decoded = [decode(codec.encode(_data("normal", shape, seed=s), seed=9), shape, seed=9) for s in range(n)]
    mean = sum(decoded) / n
    assert torch.linalg.matrix_rank(mean.reshape(60, 40)) == n * r
    y = decode(codec.for_mean(n).encode(mean, seed=4), shape, seed=4)
    assert float((y - mean).norm() / mean.norm()) < 2e-3
    y_small = decode(codec.encode(mean, seed=4), shape, seed=4)  # rank r alone cannot hold it
    assert float((y_small - mean).norm() / mean.norm()) > 0.1


def test_lowrank_recovers_low_rank_matrices_and_beats_nothing_on_noise():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(80, 3, generator=g) @ torch.randn(3, 50, generator=g)
    y = decode(Codec("lowrank", rank=3).encode(m, seed=0), (80, 50), seed=0)
    assert float((y - m).norm() / m.norm()) < 2e-3
    noise = torch.randn(80, 50, generator=g)
    y = decode(Codec("lowrank", rank=3).encode(noise, seed=0), (80, 50), seed=0)
    svals = torch.linalg.svdvals(noise)
    best = float(svals[3:].pow(2).sum().sqrt())  # Eckart-Young: no rank-3 matrix does better
    assert best <= float((y - noise).norm()) <= float(noise.norm())


def test_decode_names_what_is_wrong():
    x = torch.randn(10, 10)
    data = Codec("int8", block_size=8).encode(x, seed=0)
    with pytest.raises(BadPayload, match="expected exactly"):
        decode(data[:-1], (10, 10), seed=0)
    with pytest.raises(BadPayload, match="expected exactly"):
        decode(data, (10, 9), seed=0)
    with pytest.raises(BadPayload, match="unknown codec wire id 200"):
        decode(bytes([200]) + data[1:], (10, 10), seed=0)
    with pytest.raises(BadPayload, match="exceeds the bound"):
        decode(data + bytes(400), (10, 10), seed=0)
    bad = bytearray(data)
    bad[5:9] = bytes.fromhex("0000c07f")  # the first scale becomes NaN
    with pytest.raises(BadPayload, match="scale"):
        decode(bytes(bad), (10, 10), seed=0)
    topk = bytearray(Codec("topk", topk_fraction=0.05).encode(x, seed=0))
    topk[11:13], topk[13:15] = topk[13:15], topk[11:13]  # swap two indices: no longer sorted
    with pytest.raises(BadPayload, match="unsorted or repeated"):
        decode(bytes(topk), (10, 10), seed=0)
