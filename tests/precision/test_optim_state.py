"""Optimizer state across QKV packing: an unfused state packed for a fused optimizer, a fused one unpacked for an
unfused optimizer, round trips, parameter groups, and the one-line error for a state that fits neither layout."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.models import GPT
from lightning_accel.precision import apply_fusions
from lightning_accel.precision.optim_state import pack_qkv_optimizer_state, unpack_qkv_optimizer_state


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight-decay groups by a filter over `named_parameters()`, with names (q/k/v weights and biases split)."""
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    rest = [(n, p) for n, p in named if p.dim() < 2]
    return [
        {"params": [p for _, p in decay], "param_names": [n for n, _ in decay], "weight_decay": 0.1},
        {"params": [p for _, p in rest], "param_names": [n for n, _ in rest], "weight_decay": 0.0},
    ]


def _trained_pair() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """The same GPT unfused and fused, each with AdamW built on it and stepped twice on the same batches."""
    torch.manual_seed(0)
    plain = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    fused = copy.deepcopy(plain)
    assert apply_fusions(fused).counts()["qkv"] == 2
    opt_p = torch.optim.AdamW(_groups(plain), lr=1e-2)
    opt_f = torch.optim.AdamW(_groups(fused), lr=1e-2)
    for _ in range(2):
        idx = torch.randint(0, 11, (2, 8))
        for model, opt in ((plain, opt_p), (fused, opt_f)):
            model(idx).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return plain, opt_p, fused, opt_f


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert [g.get("param_names") for g in a["param_groups"]] == [g.get("param_names") for g in b["param_groups"]]
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        assert entry.keys() == b["state"][i].keys()
        for key, value in entry.items():
            torch.testing.assert_close(value, b["state"][i][key], atol=1e-5, rtol=1e-4, msg=f"{i}.{key}")


def test_fused_state_unpacks_to_the_unfused_optimizers_and_packs_back() -> None:
    plain, opt_p, fused, opt_f = _trained_pair()
    fused_sd, plain_sd = opt_f.state_dict(), opt_p.state_dict()
    assert len(fused_sd["param_groups"][0]["params"]) < len(plain_sd["param_groups"][0]["params"])

    unpacked = unpack_qkv_optimizer_state(fused_sd, opt_f, fused)
    _assert_same_state(unpacked, plain_sd)  # what the unfused run holds, names included
    packed = pack_qkv_optimizer_state(plain_sd, opt_f, fused)
    _assert_same_state(packed, fused_sd)
    _assert_same_state(pack_qkv_optimizer_state(unpacked, opt_f, fused), fused_sd)  # round trip

    # the loaded states train on like the uninterrupted runs
    resumed_p, resumed_f = copy.deepcopy(plain), copy.deepcopy(fused)
    opt_rp, opt_rf = torch.optim.AdamW(_groups(resumed_p), lr=1e-2), torch.optim.AdamW(_groups(resumed_f), lr=1e-2)
    # deep copies: as from a file (Optimizer.load_state_dict keeps the tensors it is given)
    opt_rp.load_state_dict(copy.deepcopy(unpack_qkv_optimizer_state(fused_sd, opt_f, fused)))
    opt_rf.load_state_dict(pack_qkv_optimizer_state(copy.deepcopy(plain_sd), opt_rf, resumed_f))
    idx = torch.randint(0, 11, (2, 8))
    for model, opt in ((plain, opt_p), (resumed_p, opt_rp), (fused, opt_f), (resumed_f, opt_rf)):
        model(idx).square().mean().backward()
        opt.step()
    for a, b in ((resumed_p, plain), (resumed_f, fused), (resumed_f, plain)):
        torch.testing.assert_close(a.state_dict(), b.state_dict(), atol=1e-5, rtol=1e-4)


def test_states_without_packing_or_already_packed_are_returned_as_they_are() -> None:
    plain, opt_p, fused, opt_f = _trained_pair()
    sd = opt_p.state_dict()
    assert unpack_qkv_optimizer_state(sd, opt_p, plain) is sd  # nothing packed
    assert pack_qkv_optimizer_state(sd, opt_p, plain) is sd
    fused_sd = opt_f.state_dict()
    assert pack_qkv_optimizer_state(fused_sd, opt_f, fused) is fused_sd  # a checkpoint saved packed


def test_a_state_of_neither_layout_is_refused_in_one_line() -> None:
    _, opt_p, fused, opt_f = _trained_pair()
    sd = opt_p.state_dict()
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match=r"parameter group 0: 13 parameters saved, 10 here, 14 with q_proj") as info:
        pack_qkv_optimizer_state(sd, opt_f, fused)
    assert "\n" not in str(info.value) and "leave 'qkv' out of `fusions`" in str(info.value)
