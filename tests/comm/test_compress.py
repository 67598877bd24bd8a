"""Packing, block layout and the torch compressor (single process, fast)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_accel.comm import (
    CommStats,
    GroupLayout,
    OneBitConfig,
    OneBitState,
    StepBytes,
    compress_fast,
    compress_reference,
    decode,
    fp32_ring_bytes,
    pack_signs,
    select_rank_state,
    unpack_signs,
)
from lightning_accel.comm.config import HOOK_DEFAULTS


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


@pytest.mark.parametrize(
    ("kwargs", "name", "error"),
    [
        ({"warmup_steps": -1}, "warmup_steps", ValueError),
        ({"warmup_steps": 1}, "warmup_steps", ValueError),
        ({"warmup_steps": True}, "warmup_steps", TypeError),
        ({"block_size": 100}, "block_size", ValueError),
        ({"block_size": 4}, "block_size", ValueError),
        ({"min_compress_numel": -5}, "min_compress_numel", ValueError),
        ({"error_feedback": "yes"}, "error_feedback", TypeError),
        ({"compressor_backend": "sometimes"}, "compressor_backend", ValueError),
        ({"compressor_backend": True}, "compressor_backend", TypeError),
        ({"compressor_backend": "eager"}, "compressor_backend", ValueError),  # the compressor has no unfused oracle
        ({"compressed_signal": "adam"}, "compressed_signal", ValueError),
        ({"group_numel": 4}, "group_numel", ValueError),
    ],
)
def test_state_validates_arguments(kwargs: dict, name: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"`{name}` must be"):
        OneBitState(**kwargs)
    with pytest.raises(error, match=f"`{name}` must be"):
        OneBitConfig(**kwargs)


def test_state_takes_a_config_and_overrides() -> None:
    cfg = OneBitConfig(warmup_steps=7, compressed_signal="momentum", compression="1bit")
    st = OneBitState(config=cfg)
    assert st.config is cfg and st.mode == "momentum" and st.decision == "1bit"
    st = OneBitState(config=cfg, block_size=64)
    assert st.config == dataclasses.replace(cfg, block_size=64) and cfg.block_size == 640
    # without a config: the hook's defaults (gradients, always compressed after warm-up)
    assert OneBitState().config == HOOK_DEFAULTS
    assert HOOK_DEFAULTS.compressed_signal == "gradients" and HOOK_DEFAULTS.compression == "1bit"
    with pytest.raises(TypeError, match="`warmup_step`.*warmup_steps, block_size"):
        OneBitState(warmup_step=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.warmup_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [("compress", "compressed_signal", "momentum"), ("backend", "compressor_backend", "reference")],
)
def test_state_accepts_the_deprecated_names(old: str, new: str, value: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"`{old}` is deprecated; use `{new}`"):
        st = OneBitState(**{old: value})
    assert getattr(st.config, new) == value
    with pytest.raises(ValueError, match=f"`{old}`.*`{new}`"):
        OneBitState(**{old: value, new: value})


def test_backend_picks_the_compressor(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert OneBitState().compressor(cpu) is compress_fast  # auto: the kernel is for CUDA gradients
    assert OneBitState(compressor_backend="reference").compressor(cpu) is compress_reference
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("lightning_accel._utils.triton.triton_available", lambda: True)
    # the message names the argument the user set (`backend` is its deprecated spelling)
    with pytest.raises(RuntimeError, match=r"`compressor_backend='triton'` got a tensor on cpu.*TRITON_INTERPRET=1"):
        OneBitState(compressor_backend="triton").compressor(cpu)
    monkeypatch.setattr("lightning_accel._utils.triton.triton_available", lambda: False)
    assert OneBitState().compressor(torch.device("cuda")) is compress_fast  # auto without triton: torch
    with pytest.raises(RuntimeError, match="`compressor_backend='triton'` needs the `triton` package") as info:
        OneBitState(compressor_backend="triton").compressor(torch.device("cuda"))
    assert "`backend=" not in str(info.value) and "`compressor_backend='auto'`" in str(info.value)


def _saved(world: int) -> dict:
    return {
        "format": 1,
        "world_size": world,
        "step": 7,
        "hparams": {"block_size": OneBitState().config.block_size, "error_feedback": True},
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
    assert not st.refresh_missed  # saved before the field existed: none missed
    # a refresh a GradScaler skipped is retried after a resume too (in a stage that continues: past the warm-up)
    st.step, st.compressed_since, st.refresh_missed = 12, 10, True
    back = OneBitState()
    back.load_state_dict(st.state_dict(), world_size=1)
    assert back.refresh_missed and back.compressed_since == 10


def test_state_pickles_without_process_group() -> None:
    import pickle

    st = OneBitState(warmup_steps=3, loss_scale_fn=lambda: 2.0)
    st.step = 5
    back = pickle.loads(pickle.dumps(st))
    assert (
        back.step == 5 and back.config.warmup_steps == 3 and back.process_group is None and back.loss_scale_fn is None
    )
    assert back.stats == st.stats and back.config == st.config


def test_stats_count_buckets_into_steps() -> None:
    stats = CommStats()
    stats.end_bucket(10, 100, compressed=True, is_last=False)
    stats.end_bucket(4, 8, compressed=False, is_last=True)
    assert stats.last_step == StepBytes(sent=14, fp32=108, compressed_sent=10, compressed_fp32=100)
    assert stats.current_step == StepBytes() and (stats.bytes_sent, stats.fp32_bytes) == (14, 108)
    assert stats.compression_ratio == 10.0
    stats.end_bucket(4, 8, compressed=False, is_last=True)
    assert stats.compression_ratio == 0.0 and stats.bytes_sent == 18


def test_kept_buffers_follow_the_group_layout() -> None:
    from lightning_accel.comm import GroupState

    st = OneBitState()
    g = GroupState((0, 1), GroupLayout([10, 6], 1, 8, torch.device("cpu")))
    x, bufs = st.buffers_for(g, fast=False)
    assert bufs is None and st.kept[(0, 1)].input is x and st.kept[(0, 1)].layout is g.layout
    g2 = GroupState((1, 2), GroupLayout([6, 8], 1, 8, torch.device("cpu")))
    st.buffers_for(g2, fast=False)
    assert list(st.kept) == [(1, 2)]  # the overlapping group's buffers went
