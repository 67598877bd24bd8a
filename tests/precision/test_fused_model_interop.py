"""A model after surgery against the same model unfused: the FLOPs a ``FlopCounterMode`` counts (forward and
backward, hence ``PerformanceMonitor``'s MFU), and its state dict (``nn.Module.state_dict`` and
``torch.distributed.checkpoint``'s), which loads into the unfused model and back with ``strict=True``."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.utils.flop_counter import FlopCounterMode

from lightning_accel.models.gpt2 import GPT2Block
from lightning_accel.models.transformer import GPT
from lightning_accel.precision import apply_fusions


def _mha() -> nn.Module:
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)


def _gpt() -> nn.Module:
    return GPT(27, 16, 2, 4, 32, dropout=0.1)  # separate q/k/v projections: QKV packing replaces parameters


def _gpt2() -> nn.Module:
    return GPT2Block(32, 4, 0.1)  # packed c_attn


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "multihead_attention": (_mha, lambda: torch.randn(2, 8, 32)),
    "gpt_qkv": (_gpt, lambda: torch.randint(0, 27, (2, 16))),
    "gpt2_block": (_gpt2, lambda: torch.randn(2, 16, 32)),
}


def _flops(model: nn.Module, x: torch.Tensor, autocast: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step."""
    with FlopCounterMode(display=False) as forward, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(x).float().square().mean()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_fused_attention_counts_the_eager_flops(name: str, backend: str, autocast: bool) -> None:
    build, data = MODELS[name]
    torch.manual_seed(0)
    model = build()
    fused = copy.deepcopy(model)
    report = apply_fusions(fused, backend=backend)  # type: ignore[arg-type]
    assert report.coverage_by_kind()["attention"][0] >= 1, report.table()
    x = data()
    eager = _flops(model, x, autocast)
    assert eager[0] > 0 and eager[1] > 0
    assert _flops(fused, x, autocast) == eager


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():  # through the state dict: packed q/k/v parts are views of one tensor
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen))
    return model


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_loads_between_fused_and_unfused_strictly(name: str) -> None:
    build, _ = MODELS[name]
    torch.manual_seed(0)
    fused = _perturbed(build(), 1)
    apply_fusions(fused)
    unfused = _perturbed(build(), 2)
    unfused.load_state_dict(fused.state_dict(), strict=True)
    _assert_same(unfused.state_dict(), fused.state_dict())
    _perturbed(unfused, 3)
    fused.load_state_dict(unfused.state_dict(), strict=True)
    _assert_same(fused.state_dict(), unfused.state_dict())


@pytest.mark.parametrize("name", list(MODELS))
def test_distributed_checkpoint_state_dict_round_trips(name: str, tmp_path: Path) -> None:
    build, data = MODELS[name]
    torch.manual_seed(0)
    fused = _perturbed(build(), 1)
    apply_fusions(fused)
    unfused = _perturbed(build(), 2)
    strict = StateDictOptions(strict=True)
    set_model_state_dict(unfused, get_model_state_dict(fused), options=strict)
    _assert_same(get_model_state_dict(unfused), get_model_state_dict(fused))
    # through files: saved fused, loaded unfused, saved unfused, loaded fused
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP notes that no process group is initialized: one process
        dcp.save(get_model_state_dict(fused), checkpoint_id=tmp_path / "fused")
        target = get_model_state_dict(_perturbed(unfused, 3))
        dcp.load(target, checkpoint_id=tmp_path / "fused")
        set_model_state_dict(unfused, target, options=strict)
        _assert_same(get_model_state_dict(unfused), get_model_state_dict(fused))
        dcp.save(get_model_state_dict(_perturbed(unfused, 4)), checkpoint_id=tmp_path / "unfused")
        target = get_model_state_dict(fused)
        dcp.load(target, checkpoint_id=tmp_path / "unfused")
        set_model_state_dict(fused, target, options=strict)
    _assert_same(get_model_state_dict(fused), get_model_state_dict(unfused))
    fused.eval(), unfused.eval()
    x = data()
    torch.testing.assert_close(fused(x), unfused(x), rtol=1e-5, atol=1e-5)
