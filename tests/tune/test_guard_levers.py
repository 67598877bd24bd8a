"""Every lever's switch-off method: fused modules back on the reference ops, quantized deltas back to lossless,
1-bit without a process group (the 2-process averaging path is in ``test_guard_ddp_integration.py``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_accel._utils.levers import Lever
from lightning_accel.checkpoint import DeltaCheckpointIO
from lightning_accel.models import GPT
from lightning_accel.precision import FusedPrecision
from lightning_accel.precision import modules as fm
from lightning_accel.strategies import OneBitDDPStrategy


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8),
        nn.LayerNorm(8),
    )


def test_fused_switch_off_gives_the_reference_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _net()
    ref = copy.deepcopy(model)
    plugin = FusedPrecision("bf16-mixed", device="cpu")
    assert isinstance(plugin, Lever) and not plugin.lever_active  # nothing converted yet
    plugin.convert_module(model)
    assert plugin.lever_active and any(fm.is_fused(m) for m in model.modules())
    # a deliberately broken fused op: the fused conv-bn-relu forward returns garbage
    monkeypatch.setattr(fm, "conv_bn_forward", lambda conv, bn, x, relu, backend="auto": torch.full_like(conv(x), 1e6))
    x = torch.randn(5, 3, 6, 6)
    model.eval(), ref.eval()
    assert not torch.allclose(model(x), ref(x))
    params = [id(p) for p in model.parameters()]
    assert plugin.switch_off("test") is True
    assert not plugin.lever_active and plugin.switched_off_reason == "test"
    assert not any(fm.is_fused(m) for m in model.modules())
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert [id(p) for p in model.parameters()] == params
    assert torch.equal(model(x), ref(x))  # the original modules' own forwards: bit-identical
    model.train(), ref.train()
    assert torch.equal(model(x), ref(x))
    assert plugin.switch_off("again") is False
    plugin.convert_module(model)  # a later conversion (another fit) fuses nothing
    assert not any(fm.is_fused(m) for m in model.modules())


def test_fused_switch_off_keeps_packed_qkv_on_the_plain_torch_path() -> None:
    torch.manual_seed(0)
    gpt = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    ref = copy.deepcopy(gpt).eval()
    plugin = FusedPrecision("bf16-mixed", device="cpu")
    plugin.convert_module(gpt)
    assert plugin.switch_off("test")
    gpt.eval()
    idx = torch.randint(0, 11, (2, 8))
    torch.testing.assert_close(gpt(idx), ref(idx), atol=1e-5, rtol=1e-5)
    for m in gpt.modules():
        assert not fm.is_fused(m) or m._la_backend == "eager"


def _ckpt(w: torch.Tensor) -> dict:
    return {"state_dict": {"w": w.clone()}, "epoch": 0}


@pytest.mark.filterwarnings("error")
def test_quantized_checkpoint_switch_off_saves_lossless(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(quantize="int8", quantize_groups="all", lock=False)
    assert isinstance(io, Lever) and io.lever_active
    torch.manual_seed(0)
    w = torch.randn(4096)
    io.save_checkpoint(_ckpt(w), tmp_path / "a.ckpt")  # the chain's full snapshot: lossless
    w2 = w + 1e-3 * torch.randn(4096)
    io.save_checkpoint(_ckpt(w2), tmp_path / "b.ckpt")
    lossy = io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"]
    assert not torch.equal(lossy, w2) and torch.allclose(lossy, w2, atol=1e-4)
    assert io.switch_off("test") is True and not io.lever_active
    w3 = w2 + 1e-3 * torch.randn(4096)
    io.save_checkpoint(_ckpt(w3), tmp_path / "c.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "c.ckpt")["state_dict"]["w"], w3)
    assert io.switch_off("again") is False
    io.teardown()
    assert not DeltaCheckpointIO().lever_active and DeltaCheckpointIO().switch_off("x") is False


def test_onebit_without_a_process_group_has_nothing_to_switch_off() -> None:
    s = OneBitDDPStrategy(warmup_steps=2)
    assert isinstance(s, Lever) and s.lever_name == "ddp_1bit"
    assert not s.lever_active and s.switch_off("test") is False
