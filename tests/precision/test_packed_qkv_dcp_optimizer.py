"""``torch.distributed.checkpoint``'s optimizer state dict across QKV packing: ``get_optimizer_state_dict`` names a
packed parameter's state ``qkv_proj.weight``, which the unfused model's optimizer does not have
(``set_optimizer_state_dict`` stops with "Missing optimizer state for parameter '...q_proj.weight'"); the two
functions convert the state between the layouts, both ways, through a save on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lightning_accel.models import TinyGPT
from lightning_accel.precision import apply_fusions
from lightning_accel.precision.optim_state import pack_qkv_dcp_optimizer_state, unpack_qkv_dcp_optimizer_state
from tests.helpers import run_in_processes

ATTN = "model.blocks.0.attn"


def _gpt(seed: int, packed: bool) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.0)
    if packed:
        assert apply_fusions(model, fusions=["qkv"]).counts() == {"qkv": 1}
    return model


def _trained(model: TinyGPT) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 11, (2, 17), generator=torch.Generator().manual_seed(0))
    model._loss((tokens,)).backward()
    opt.step()
    return opt


def test_a_packed_models_dcp_optimizer_state_loads_into_the_unfused_model(tmp_path: Path) -> None:
    fused = _gpt(0, packed=True)
    opt = _trained(fused)
    unpacked = unpack_qkv_dcp_optimizer_state(get_optimizer_state_dict(fused, opt), fused)
    assert f"{ATTN}.qkv_proj.weight" not in unpacked["state"]
    dcp.save({"optim": unpacked}, checkpoint_id=tmp_path / "ckpt")

    plain = _gpt(1, packed=False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    target = {"optim": get_optimizer_state_dict(plain, plain_opt)}
    dcp.load(target, checkpoint_id=tmp_path / "ckpt")
    set_optimizer_state_dict(plain, plain_opt, target["optim"])

    packed_state = opt.state[fused.model.blocks[0].attn.qkv_proj.weight]
    attn = plain.model.blocks[0].attn
    for i, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(plain_opt.state[proj.weight][key], packed_state[key].chunk(3)[i])
        assert float(plain_opt.state[proj.bias]["step"]) == 1.0
    assert len(plain_opt.state) == len(list(plain.parameters()))  # every parameter got its saved state


def test_an_unfused_models_dcp_optimizer_state_loads_into_a_packed_model() -> None:
    plain = _gpt(0, packed=False)
    plain_opt = _trained(plain)
    fused = _gpt(1, packed=True)
    opt = torch.optim.AdamW(fused.parameters(), lr=0.01)
    osd = pack_qkv_dcp_optimizer_state(get_optimizer_state_dict(plain, plain_opt), fused)
    assert f"{ATTN}.q_proj.weight" not in osd["state"] and f"{ATTN}.qkv_proj.weight" in osd["state"]
    set_optimizer_state_dict(fused, opt, osd)

    attn = plain.model.blocks[0].attn
    packed = fused.model.blocks[0].attn.qkv_proj
    for name in ("weight", "bias"):
        parts = [plain_opt.state[getattr(p, name)]["exp_avg"] for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        torch.testing.assert_close(opt.state[getattr(packed, name)]["exp_avg"], torch.cat(parts))


def test_conversions_leave_a_state_in_their_layout_as_it_is() -> None:
    fused, plain = _gpt(0, packed=True), _gpt(0, packed=False)
    packed_osd = get_optimizer_state_dict(fused, _trained(fused))
    plain_osd = get_optimizer_state_dict(plain, _trained(plain))
    assert pack_qkv_dcp_optimizer_state(packed_osd, fused) == packed_osd
    assert unpack_qkv_dcp_optimizer_state(plain_osd, fused) == plain_osd
    assert unpack_qkv_dcp_optimizer_state(packed_osd, plain) == packed_osd  # no packed parameter: nothing to do


def test_a_state_that_cannot_be_split_is_refused_in_one_line() -> None:
    fused = _gpt(0, packed=True)
    osd = get_optimizer_state_dict(fused, _trained(fused))
    osd["state"][f"{ATTN}.qkv_proj.weight"]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"`exp_avg` of shape \(5,\) for .*qkv_proj.weight of shape \(24, 8\)") as e:
        unpack_qkv_dcp_optimizer_state(osd, fused)
    assert "\n" not in str(e.value)


def test_a_part_state_that_cannot_be_packed_is_refused_in_one_line() -> None:
    plain = _gpt(0, packed=False)
    osd = get_optimizer_state_dict(plain, _trained(plain))
    osd["state"][f"{ATTN}.k_proj.weight"]["exp_avg"] = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"`exp_avg` of shape \(3, 8\) for .*k_proj.weight, .*\(8, 8\) each") as e:
        pack_qkv_dcp_optimizer_state(osd, _gpt(0, packed=True))
    assert "\n" not in str(e.value)


def _ddp_worker(rank: int, world: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    fused = _gpt(0, packed=True)
    wrapped = DistributedDataParallel(fused)
    opt = _trained(fused)
    unpacked = unpack_qkv_dcp_optimizer_state(get_optimizer_state_dict(wrapped, opt), wrapped)
    plain = _gpt(1, packed=False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    set_optimizer_state_dict(plain, plain_opt, unpacked)
    return sorted(unpacked["state"])


def test_a_ddp_wrapped_packed_model_names_its_parts_without_the_wrapper() -> None:
    (names,) = run_in_processes(_ddp_worker, 1, (), timeout=120)
    assert f"{ATTN}.q_proj.weight" in names and not any("qkv_proj" in n or n.startswith("module.") for n in names)
