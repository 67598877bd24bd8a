"""Codec: lossless round trips for every dtype and odd size, quantized error bound, corrupt input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_accel.checkpoint import codec

KEY = "0" * 40
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
SHAPES = [(0,), (1,), (7,), (3, 5, 11), (257,)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return np.array_equal(codec.tensor_bytes(a), codec.tensor_bytes(b))


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_and_xor_are_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    a, b = _rand(shape, dtype, 0), _rand(shape, dtype, 1)
    full = codec.decode_blob(codec.encode_full(a), None, shape)
    assert full.dtype == dtype and full.shape == a.shape and _bits_equal(full, a)
    x = codec.decode_blob(codec.encode_xor(a, b, KEY), b, shape)
    assert x.dtype == dtype and x.shape == a.shape and _bits_equal(x, a)


def test_nan_and_negative_zero_survive_bitwise() -> None:
    a = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45] * 100)
    b = torch.zeros_like(a)
    assert _bits_equal(codec.decode_blob(codec.encode_xor(a, b, KEY), b), a)


def test_shuffle_inverts_and_groups_planes() -> None:
    raw = np.arange(12, dtype=np.uint8)
    s = codec.shuffle_bytes(raw, 4)
    assert s.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    assert np.array_equal(codec.unshuffle_bytes(s, 4), raw)


def test_unchanged_high_bytes_compress_well() -> None:
    a = torch.randn(4096)
    b = a + torch.randn(4096) * 1e-6  # only low mantissa bits change
    assert len(codec.encode_xor(b, a, KEY)) < 0.6 * len(codec.encode_full(b))


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantized_delta_error_bound_and_exact_reconstruction(bits: int, qmax: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g).to(dtype)  # signed: identity transform
    x = (ref.float() + torch.randn(1000, generator=g) * 0.01).to(dtype)
    blob, recon = codec.encode_quant(x, ref, KEY, bits=bits, block=64)
    decoded = codec.decode_blob(blob, ref)
    assert _bits_equal(decoded, recon)  # the encoder's reconstruction is exactly what a load returns
    d = (x.float() - ref.float()).reshape(-1)
    pad = (-d.numel()) % 64
    bound = torch.cat([d, d.new_zeros(pad)]).reshape(-1, 64).abs().amax(1).repeat_interleave(64)[: d.numel()] / (
        2 * qmax
    )
    err = (decoded.float() - x.float()).abs()
    cast = decoded.float().abs() * torch.finfo(dtype).eps  # one rounding to the target dtype
    assert bool((err <= bound + cast + 1e-12).all())
    assert len(blob) <= x.numel() * bits / 8 + 16 * 4 + 300  # q values + one fp32 scale per block + header


def test_quantized_nonnegative_tensor_stays_nonnegative() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(4096, generator=g) ** 6  # like Adam's exp_avg_sq: many tiny values, a few large
    x = (ref * torch.empty(4096).uniform_(0.2, 3.0, generator=g)).contiguous()
    blob, recon = codec.encode_quant(x, ref, KEY, bits=4, block=128)
    out = codec.decode_blob(blob, ref)
    assert bool((out >= 0).all()) and torch.equal(out, recon)
    assert codec.read_header(blob)[0]["sqrt"] is True


@pytest.mark.parametrize("damage", ["magic", "truncate", "payload"])
def test_corrupt_blob_is_a_codec_error(damage: str) -> None:
    blob = bytearray(codec.encode_full(torch.randn(512)))
    if damage == "magic":
        blob[0] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob[-20] ^= 0xFF
    with pytest.raises(codec.CodecError):
        out = codec.decode_blob(bytes(blob), None)
        if damage == "payload":  # zstd may not notice a flipped bit; the store's checksum does (see test_store)
            raise codec.CodecError(f"decoded {out.shape}")


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(TypeError, match="dtype"):
        codec.dtype_name(torch.quint8)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["tensor", "reference"])
def test_quantized_delta_refuses_a_non_finite_delta(bad: float, where: str) -> None:
    ref = torch.randn(1000)
    x = ref + 0.01
    (x if where == "tensor" else ref)[5] = bad
    with pytest.raises(codec.NonFiniteDelta):
        codec.encode_quant(x, ref, KEY)
    big = torch.full((300,), 3e38)  # finite values whose difference overflows fp32
    with pytest.raises(codec.NonFiniteDelta):
        codec.encode_quant(big, -big, KEY)


def test_float8_is_not_quantizable() -> None:
    f8 = torch.randn(300).to(torch.float8_e4m3fn)
    assert not codec.quantizable(f8.dtype) and codec.quantizable(torch.bfloat16)
    with pytest.raises(ValueError, match="2 bytes or more"):
        codec.encode_quant(f8, f8, KEY)


@pytest.mark.parametrize("numel", [300, 20_000], ids=["small", "numpy-path"])
def test_lazy_conjugate_and_negative_views_are_read_by_value(numel: int) -> None:
    c = torch.randn(numel, dtype=torch.complex64)
    for lazy in (c.conj(), torch._neg_view(c), c.conj().imag):
        plain = lazy.clone().resolve_conj().resolve_neg()
        assert lazy.is_conj() or lazy.is_neg()
        assert _bits_equal(lazy, plain) and codec.same_bytes(lazy, plain) and codec.same_bytes(plain, lazy)
        out = torch.empty_like(plain)
        codec.copy_into(out, lazy)
        assert torch.equal(out, plain)
        assert torch.equal(codec.decode_blob(codec.encode_full(lazy), None, list(lazy.shape)), plain)
