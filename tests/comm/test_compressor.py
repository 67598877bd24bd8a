"""The fast compressor (``Compressor``, ``compress_fast``), the fast packing and decode, against the torch reference."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_accel.comm.compress import (
    Compressor,
    GroupLayout,
    compress_fast,
    compress_reference,
    decode,
)
from lightning_accel.comm.packing import pack_signs, sign_lut, unpack_signs

CPU = torch.device("cpu")
CASES = [([1], 1, 8), ([10, 3000, 5], 2, 64), ([4097, 7, 1], 3, 256), ([64, 64], 2, 16), ([2049, 2048], 1, 2048)]


def _slow_pack(x: torch.Tensor) -> torch.Tensor:
    """The definition: bit 7 - j of byte i is ``x[8 i + j] >= 0``."""
    bits = (x >= 0).to(torch.int64).reshape(*x.shape[:-1], -1, 8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1])
    return (bits * weights).sum(-1).to(torch.uint8)


def _inputs(lay: GroupLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = lay.table.mask
    g = torch.randn(lay.padded_numel, generator=gen) * mask
    e = torch.randn(lay.padded_numel, generator=gen) * mask * 0.1
    return g, e


def test_pack_is_exact_on_every_byte_pattern() -> None:
    # all 256 sign patterns (the multiply trick must not carry into the top byte for any of them), with zeros,
    # negative zeros and NaNs mixed in
    codes = torch.arange(256, dtype=torch.uint8)
    signs = unpack_signs(codes)  # ±1 rows
    x = signs * torch.rand(256 * 8).reshape(256, 8).reshape(-1) + 0.0
    x[0::29] = 0.0
    x[3::31] = -0.0
    x[5::37] = float("nan")
    want = _slow_pack(x)
    assert torch.equal(pack_signs(x), want)
    out, scratch = torch.empty(256, dtype=torch.uint8), torch.empty(2048, dtype=torch.bool)
    assert pack_signs(x, out=out, scratch=scratch).data_ptr() == out.data_ptr() and torch.equal(out, want)
    # the rows of the sign table are exactly what each byte encodes
    assert torch.equal(pack_signs(signs.reshape(256, 8)).reshape(-1), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8,), (3, 64), (2, 5, 16), (1, 4104)])
def test_pack_matches_definition_any_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape).to(dtype)
    got = pack_signs(x)
    assert got.shape == (*shape[:-1], shape[-1] // 8) and torch.equal(got, _slow_pack(x))
    out = torch.empty(x.numel() // 8, dtype=torch.uint8)
    assert torch.equal(pack_signs(x, out=out), got)
    assert torch.equal(pack_signs(x.transpose(0, -1).contiguous().transpose(0, -1)), got)  # non-contiguous input
    back = unpack_signs(got, dtype, out=torch.empty(x.numel(), dtype=dtype))
    assert torch.equal(back, unpack_signs(got, dtype)) and torch.equal(back, torch.where(x >= 0, 1.0, -1.0).to(dtype))


def test_pack_and_unpack_reject_bad_out() -> None:
    with pytest.raises(ValueError, match="`out`"):
        pack_signs(torch.randn(16), out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="`out`"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), out=torch.empty(15))
    assert sign_lut(CPU).shape == (256, 8)


@pytest.mark.parametrize(("numels", "world", "block"), CASES)
def test_decode_is_bit_identical_to_signs_times_repeated_scales(numels: list[int], world: int, block: int) -> None:
    lay = GroupLayout(numels, world, block, CPU)
    g, _ = _inputs(lay, 1)
    packed, scales, _ = compress_reference(g, None, lay.table)
    want = unpack_signs(packed) * torch.repeat_interleave(scales, lay.table.lengths)
    assert torch.equal(decode(packed, scales, lay.table.lengths), want)
    out = torch.empty(lay.padded_numel)
    assert decode(packed, scales, lay.table.lengths, out=out).data_ptr() == out.data_ptr() and torch.equal(out, want)
    c = Compressor(lay.table)
    assert torch.equal(c.decode(packed, scales), want)
    # rows at a time: one rank's chunk as received from every rank in phase 1
    mine = lay.chunks[-1]
    rows_p = torch.stack([packed[-lay.chunk_numel // 8 :]] * 3)
    rows_s = torch.rand(3, mine.num_blocks)
    cc = Compressor(mine)
    assert torch.equal(cc.decode(rows_p, rows_s), decode(rows_p, rows_s, mine.lengths))


@pytest.mark.parametrize(("numels", "world", "block"), CASES)
@pytest.mark.parametrize("mode", ["noef", "ef", "ef_loss_scale"])
def test_compressor_matches_reference(numels: list[int], world: int, block: int, mode: str) -> None:
    lay = GroupLayout(numels, world, block, CPU)
    g, e = _inputs(lay, 2)
    err = None if mode == "noef" else e
    ls = torch.tensor(1024.0) if mode == "ef_loss_scale" else None
    tables = [lay.table, lay.chunks[0], lay.chunks[-1]]
    for table in tables:
        n = table.mask.numel()
        gi = g[:n].contiguous() * table.mask
        ei = None if err is None else (err[:n] * table.mask).contiguous()
        ref = compress_reference(gi, ei, table, ls)
        for got in (Compressor(table).compress(gi, ei, ls), compress_fast(gi, ei, table, ls)):
            assert torch.equal(got[0], ref[0]), "packed bits differ"
            # block sums in another (pairwise) order: last-bit differences only
            torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
            if ei is None:
                assert got[2] is None
                continue
            assert got[2] is not None and ref[2] is not None
            torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
            # the residual is exactly what was not sent, for the scales that were sent
            x = gi + (ei * ls if ls is not None else ei)
            sent = decode(got[0], got[1], table.lengths)
            resid = torch.where(table.mask, x - sent, 0.0)
            if ls is not None:
                resid = resid / ls
            assert torch.equal(got[2], resid)
        assert torch.equal(gi, g[:n] * table.mask) and (ei is None or torch.equal(ei, e[:n] * table.mask))


def test_compressor_reuses_its_buffers_and_allocates_nothing() -> None:
    lay = GroupLayout([100_000, 37, 5], 2, 256, CPU)
    c = Compressor(lay.table)
    g1, e1 = _inputs(lay, 3)
    g2, e2 = _inputs(lay, 4)
    ls = torch.tensor(8.0)
    p1, s1, n1 = c.compress(g1, e1, ls)
    ptrs = (p1.data_ptr(), s1.data_ptr(), n1.data_ptr())  # type: ignore[union-attr]
    out_e = torch.empty(lay.padded_numel)
    dec = torch.empty(lay.padded_numel)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        p2, s2, n2 = c.compress(g2, e2, ls)
        c.compress(g2, None)
        c.compress(g2, e2, out_error=out_e)
        c.decode(c.packed, c.scales, out=dec)
    allocated = sum(ev.cpu_memory_usage for ev in prof.events() if ev.cpu_memory_usage > 0)
    # one torch.add of these buffers allocates 400 kB; what is left is a few 0-dim temporaries
    assert allocated < 1024, allocated
    assert ptrs == (p2.data_ptr(), s2.data_ptr(), n2.data_ptr())  # type: ignore[union-attr]
    # the second call's results are the second input's, not stale ones
    ref = compress_reference(g2, e2, lay.table)
    assert torch.equal(c.packed, ref[0]) and torch.equal(out_e, c.compress(g2, e2)[2])  # type: ignore[arg-type]
    torch.testing.assert_close(out_e, ref[2], rtol=1e-5, atol=1e-6)
    # compress_fast hands out fresh tensors on every call
    a, b = compress_fast(g1, e1, lay.table), compress_fast(g1, e1, lay.table)
    assert a[0].data_ptr() != b[0].data_ptr() and a[2].data_ptr() != b[2].data_ptr()  # type: ignore[union-attr]


def test_in_place_error_update_equals_out_of_place() -> None:
    lay = GroupLayout([333, 4096], 2, 512, CPU)
    g, e = _inputs(lay, 5)
    want = compress_reference(g, e, lay.table, torch.tensor(2.0))[2]
    e_state = e.clone()
    _, _, got = Compressor(lay.table).compress(g, e_state, torch.tensor(2.0), out_error=e_state)
    assert got is e_state
    torch.testing.assert_close(e_state, want, rtol=1e-5, atol=1e-6)


def test_block_boundaries_zero_blocks_and_signed_zeros() -> None:
    lay = GroupLayout([16, 40, 9], 2, 16, CPU)
    g = torch.randn(lay.padded_numel, generator=torch.Generator().manual_seed(0)) * lay.table.mask
    g[16:56] = 0.0  # a parameter without gradient: its blocks get scale 0 and zero error
    g[0], g[1] = -0.0, 0.0  # -0.0 >= 0: sent as +scale, like the reference
    e = torch.zeros_like(g)
    e[0] = -0.0
    g[lay.padded_numel - 1] = 7.0  # garbage on padding is ignored, as the reference ignores it
    ref = compress_reference(g, e, lay.table)
    got = Compressor(lay.table).compress(g, e)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0.0)
    # scales may differ from the reference in the last bit (another summation order), and the residual with them;
    # exact is the contract: the residual is what was not sent, for the scales that were sent
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    dec = decode(got[0], got[1], lay.table.lengths)
    assert torch.equal(got[2], torch.where(lay.table.mask, g + e - dec, 0.0))  # type: ignore[arg-type]
    assert torch.count_nonzero(dec[16:56]) == 0 and torch.count_nonzero(got[2][16:56]) == 0  # type: ignore[index]
    bf = Compressor(lay.table).compress(g.to(torch.bfloat16), None)
    assert torch.equal(bf[0], compress_reference(g.to(torch.bfloat16), None, lay.table)[0])


def test_nonfinite_values_propagate_like_the_reference() -> None:
    lay = GroupLayout([32], 1, 16, CPU)
    g = torch.randn(32)
    g[3], g[20] = float("inf"), float("nan")
    ref = compress_reference(g, torch.zeros(32), lay.table)
    got = Compressor(lay.table).compress(g, torch.zeros(32))
    assert torch.equal(got[0], ref[0]) and torch.isinf(got[1][0]) and torch.isnan(got[1][1])
    assert torch.equal(torch.isnan(got[2]), torch.isnan(ref[2]))  # type: ignore[arg-type]


def test_compressor_rejects_wrong_sizes_and_device_path_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    lay = GroupLayout([100, 30], 2, 32, CPU)
    c = Compressor(lay.table)
    with pytest.raises(ValueError, match="`grad` must have"):
        c.compress(torch.zeros(8))
    with pytest.raises(ValueError, match="`error` must have"):
        c.compress(torch.zeros(lay.padded_numel), torch.zeros(8))
    with pytest.raises(ValueError, match="`packed`/`scales`"):
        c.decode(torch.zeros(3, dtype=torch.uint8), c.scales)
    # the path taken off CPU (torch reference into the buffers, when Triton cannot run) gives the same results
    g, e = _inputs(lay, 6)
    dev = Compressor(lay.table)
    dev._cpu = False
    ref = compress_reference(g, e, lay.table)
    got = dev.compress(g, e)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))  # type: ignore[arg-type]
    assert got[0].data_ptr() == dev.packed.data_ptr()
    assert torch.equal(dev.decode(ref[0], ref[1]), decode(ref[0], ref[1], lay.table.lengths))
