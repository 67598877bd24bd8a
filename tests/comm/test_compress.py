"""Packing, block layout and the torch compressor (single process, fast)."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.comm import (
    GroupLayout,
    OneBitState,
    compress_fast,
    compress_reference,
    decode,
    fp32_ring_bytes,
    pack_signs,
    select_rank_state,
    unpack_signs,
)


@pytest.mark.parametrize("shape", [(8,), (3, 64), (2, 5, 16)])
def test_pack_roundtrip_and_bit_order(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    x.view(-1)[0] = 0.0  # zero counts as non-negative
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    # most significant bit first: [+, -, -, -, -, -, -, -] -> 0b10000000
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -1])).item() == 128


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_signs(torch.randn(7))
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs(torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("numels", [[1], [10, 3000, 5], [64, 64], [4097, 7, 1]])
def test_layout_matches_its_definition(world: int, numels: list[int]) -> None:
    block = 256
    lay = GroupLayout(numels, world, block, torch.device("cpu"))
    # parameters start on byte boundaries, chunks are whole bytes, everything fits
    assert all(o % 8 == 0 for o in lay.offsets) and lay.chunk_numel % 8 == 0
    assert lay.padded_numel == world * lay.chunk_numel >= lay.offsets[-1] + numels[-1]
    lengths, starts = lay.table.lengths.tolist(), lay.table.starts.tolist()
    assert sum(lengths) == lay.padded_numel and all(n % 8 == 0 and 0 < n <= max(block, 8 * world) for n in lengths)
    edges = set(starts)
    assert set(lay.offsets) <= edges and set(range(0, lay.padded_numel, lay.chunk_numel)) <= edges
    for s, n in zip(starts, lengths, strict=True):  # no block straddles a parameter end or a chunk boundary
        assert (s // lay.chunk_numel) == ((s + n - 1) // lay.chunk_numel)
        for o, m in zip(lay.offsets, numels, strict=True):
            assert s + n <= o or s >= o + m or (o <= s and s + n <= o + -(-m // 8) * 8)
    assert int(lay.table.valid.sum()) == sum(numels) == int(lay.table.mask.sum())
    assert sum(c.num_blocks for c in lay.chunks) == lay.num_blocks
    assert lay.message_bytes == lay.chunk_numel // 8 + 4 * lay.max_blocks


def test_layout_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`block_size`"):
        GroupLayout([8], 2, 12, torch.device("cpu"))
    with pytest.raises(ValueError, match="`world_size`"):
        GroupLayout([8], 0, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="`numels`"):
        GroupLayout([], 2, 16, torch.device("cpu"))


def test_compress_scale_is_mean_abs_and_error_is_the_residual() -> None:
    lay = GroupLayout([20, 7], 2, 16, torch.device("cpu"))
    g = torch.zeros(lay.padded_numel)
    g[lay.table.mask] = torch.randn(27)
    e = torch.zeros_like(g)
    e[lay.table.mask] = torch.randn(27) * 0.1
    packed, scales, new_e = compress_reference(g, e, lay.table)
    x = g + e
    dec = decode(packed, scales, lay.table.lengths)
    for (s, n, v), sc in zip(
        zip(lay.table.starts.tolist(), lay.table.lengths.tolist(), lay.table.valid.tolist(), strict=True),
        scales.tolist(),
        strict=True,
    ):
        expect = x[s : s + n].abs().sum().item() / v if v else 0.0
        assert sc == pytest.approx(expect, rel=1e-6)
    mask = lay.table.mask
    torch.testing.assert_close(new_e[mask], (x - dec)[mask])
    assert torch.count_nonzero(new_e[~mask]) == 0
    # error feedback is lossless over time: decoded + new error == input + old error
    torch.testing.assert_close((dec + new_e)[mask], x[mask])


def test_mean_abs_minimises_the_residual() -> None:
    x = torch.randn(4096) ** 3  # heavy tails: RMS and mean|x| differ a lot
    lay = GroupLayout([4096], 1, 4096, torch.device("cpu"))
    _, _, e_mean = compress_reference(x, torch.zeros(4096), lay.table)
    rms = x.pow(2).mean().sqrt()
    e_rms = x - torch.where(x >= 0, rms, -rms)
    assert e_mean.norm() < e_rms.norm()


def test_zero_parameter_gets_zero_scale_and_no_error() -> None:
    lay = GroupLayout([16, 40, 9], 2, 16, torch.device("cpu"))
    g = torch.randn(lay.padded_numel) * lay.table.mask
    g[16:56] = 0.0  # the second parameter has no gradient
    packed, scales, e = compress_reference(g, torch.zeros_like(g), lay.table)
    dec = decode(packed, scales, lay.table.lengths)
    assert torch.count_nonzero(dec[16:56]) == 0 and torch.count_nonzero(e[16:56]) == 0


def test_nonfinite_input_gives_nonfinite_scale() -> None:
    lay = GroupLayout([32], 1, 16, torch.device("cpu"))
    g = torch.randn(32)
    g[3] = float("inf")
    g[20] = float("nan")
    _, scales, _ = compress_reference(g, None, lay.table)
    assert torch.isinf(scales[0]) and torch.isnan(scales[1])


def test_fp32_ring_bytes() -> None:
    assert fp32_ring_bytes(1000, 2) == 4000
    assert fp32_ring_bytes(1000, 4) == 6000


def test_state_validates_arguments() -> None:
    for kwargs, name in [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1}, "warmup_steps"),
        ({"block_size": 100}, "block_size"),
        ({"min_compress_numel": -5}, "min_compress_numel"),
        ({"error_feedback": "yes"}, "error_feedback"),
        ({"backend": "sometimes"}, "backend"),
        ({"backend": True}, "backend"),
        ({"backend": "eager"}, "backend"),  # the compressor has no unfused oracle
    ]:
        with pytest.raises(ValueError, match=f"`{name}`"):
            OneBitState(**kwargs)


def test_backend_picks_the_compressor(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert OneBitState().compressor(cpu) is compress_fast  # auto: the kernel is for CUDA gradients
    assert OneBitState(backend="reference").compressor(cpu) is compress_reference
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("lightning_accel._utils.triton.triton_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"`backend='triton'` got a tensor on cpu.*TRITON_INTERPRET=1"):
        OneBitState(backend="triton").compressor(cpu)
    monkeypatch.setattr("lightning_accel._utils.triton.triton_available", lambda: False)
    assert OneBitState().compressor(torch.device("cuda")) is compress_fast  # auto without triton: torch
    with pytest.raises(RuntimeError, match="`pip install triton`"):
        OneBitState(backend="triton").compressor(torch.device("cuda"))


def _saved(world: int) -> dict:
    return {
        "format": 1,
        "world_size": world,
        "step": 7,
        "hparams": {"block_size": OneBitState().block_size, "error_feedback": True},
        "groups": {"0,1": {"worker": torch.ones(world, 16), "server": torch.ones(world, 8)}},
    }


def test_state_dict_roundtrip_and_world_size_change() -> None:
    st = OneBitState()
    st.load_state_dict(select_rank_state(_saved(2), 1), world_size=2)
    assert st.step == 7 and (0, 1) in st.pending and st.pending[(0, 1)][0].shape == (16,)
    assert st.state_dict()["groups"]["0,1"]["worker"].shape == (16,)  # not adopted yet, still saved
    with pytest.warns(UserWarning, match="reset"):
        st.load_state_dict(select_rank_state(_saved(2), 0), world_size=3)
    assert st.step == 7 and not st.pending and not st.groups
    with pytest.raises(ValueError, match="format"):
        st.load_state_dict({"format": 99})


def test_state_pickles_without_process_group() -> None:
    import pickle

    st = OneBitState(warmup_steps=3, loss_scale_fn=lambda: 2.0)
    st.step = 5
    back = pickle.loads(pickle.dumps(st))
    assert back.step == 5 and back.warmup_steps == 3 and back.process_group is None and back.loss_scale_fn is None
