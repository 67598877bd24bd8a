"""Packed QKV with the tools around the model: torch's distributed-checkpoint state-dict API, FSDP1
(``FullyShardedDataParallel``) wrappers, and optimizers built before the precision plugin's surgery."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import TinyGPT
from lightning_accel.precision import FusedPrecision, apply_fusions
from lightning_accel.precision.surgery import follow_replaced_parameters
from tests.helpers import run_in_processes


def _gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8, dropout=0.0)


def _packed(seed: int = 0) -> TinyGPT:
    model = _gpt(seed)
    assert apply_fusions(model, fusions=["qkv"]).counts() == {"qkv": 2}
    return model


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


# ------------------------------------------------------------------------------------ torch.distributed.checkpoint


def test_dcp_model_state_dict_of_a_packed_model_is_the_unpacked_one() -> None:
    """``get_model_state_dict`` resolves each ``state_dict()`` key to a module path: it failed on the packed model's
    ``q_proj`` keys (``'FusedCausalSelfAttention' object has no attribute 'q_proj'``)."""
    packed, plain = _packed(), _gpt()
    _assert_same(get_model_state_dict(packed), get_model_state_dict(plain))


def test_dcp_state_dicts_load_across_packing_both_ways() -> None:
    packed, plain = _packed(seed=0), _gpt(seed=1)
    set_model_state_dict(plain, get_model_state_dict(packed))  # packed -> unpacked
    _assert_same(plain.state_dict(), _gpt(seed=0).state_dict())
    other = _gpt(seed=2)
    set_model_state_dict(packed, get_model_state_dict(other))  # unpacked -> packed
    _assert_same(packed.state_dict(), other.state_dict())
    x = torch.randint(0, 11, (2, 16))
    torch.testing.assert_close(packed(x), other(x))


def test_dcp_save_from_a_packed_model_loads_into_an_unpacked_one(tmp_path: Path) -> None:
    packed = _packed(seed=0)
    dcp.save(get_model_state_dict(packed), checkpoint_id=tmp_path / "ckpt")
    plain = _gpt(seed=3)
    state = get_model_state_dict(plain)
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    set_model_state_dict(plain, state)
    _assert_same(plain.state_dict(), _gpt(seed=0).state_dict())


# ----------------------------------------------------------------------------------------------------------- FSDP1


def _fsdp1_worker(rank: int, world: int, use_orig_params: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _gpt()
    ref = copy.deepcopy(model)
    wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    report = apply_fusions(wrapped, backend="reference")
    x = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(rank))
    out, expected = wrapped(x), ref(x)
    out.float().sum().backward()
    return {
        "counts": report.counts(),
        "attention": [c.reason for c in report.skipped() if c.kind == "attention"],
        "error": float((out - expected).abs().max()),
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_wrapped_model_keeps_qkv_apart_with_the_reason(use_orig_params: bool) -> None:
    """Packing the projections of a model already wrapped in FSDP1 read the flat parameter's freed storage (a
    segmentation fault with ``use_orig_params=False``) or packed each rank's shard (``mat2 must be a matrix``)."""
    results = run_in_processes(_fsdp1_worker, 2, (use_orig_params,), timeout=240)
    for r in results:
        assert r["counts"] == {"linear_dropout": 2, "norm": 5}, r
        assert len(r["attention"]) == 2 and all("FullyShardedDataParallel" in why for why in r["attention"]), r
        assert r["error"] < 1e-5


# ------------------------------------------------------------------------------ optimizers built before the surgery


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = (torch.randint(0, 11, (32, 1), generator=g) + torch.arange(17)) % 11
    return DataLoader(TensorDataset(tokens), batch_size=16)


class EagerOptimizerGPT(TinyGPT):
    """Builds its optimizer in ``__init__``, before the Trainer converts the model."""

    def __init__(self, groups: str = "one") -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.0)
        named = dict(self.named_parameters())
        if groups == "one":
            self.opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        else:  # q_proj's weight alone in a group of its own
            q = "model.blocks.0.attn.q_proj.weight"
            rest = [p for n, p in named.items() if n != q]
            self.opt = torch.optim.AdamW([{"params": [named[q]], "lr": 0.01}, {"params": rest}], lr=0.05)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.opt


def _trainer(tmp_path: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=2,
        plugins=[FusedPrecision("bf16-mixed", fusions=["qkv"])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def test_optimizer_built_in_init_follows_the_packed_parameters(tmp_path: Path) -> None:
    """The optimizer held the replaced q/k/v weights: they stayed out of the model, so the packed projection never
    trained, without a word."""
    model = EagerOptimizerGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _trainer(tmp_path).fit(model, _tokens())
    held = {id(p) for g in model.opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    after = model.state_dict()
    for k in ("q_proj.weight", "k_proj.bias", "v_proj.weight"):
        key = f"model.blocks.0.attn.{k}"
        assert not torch.equal(after[key], before[key]), key


def test_optimizer_built_in_init_that_cannot_follow_is_refused_at_setup(tmp_path: Path) -> None:
    model = EagerOptimizerGPT(groups="split")
    with pytest.raises(ValueError, match=r"q_proj.*different parameter groups.*configure_optimizers") as err:
        _trainer(tmp_path).fit(model, _tokens())
    assert "\n" not in str(err.value)


def test_plain_module_without_surgery_changes_nothing_in_the_optimizer(tmp_path: Path) -> None:
    """A model with nothing to pack keeps its optimizer as it was built."""
    model = EagerOptimizerGPT()
    groups = [list(g["params"]) for g in model.opt.param_groups]
    trainer = _trainer(tmp_path)
    trainer.strategy.precision_plugin.fusions = ["norm"]
    trainer.fit(model, _tokens())
    assert all(
        [id(p) for p in g["params"]] == [id(p) for p in old]
        for g, old in zip(model.opt.param_groups, groups, strict=True)
    )
    assert isinstance(model.model.blocks[0].attn.q_proj, nn.Linear)


def _dcp_distributed_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.nn.parallel import DistributedDataParallel

    full = StateDictOptions(full_state_dict=True)
    packed, other = _packed(seed=0), _gpt(seed=1)
    wrapped = DistributedDataParallel(packed)
    keys_match = list(get_model_state_dict(wrapped)) == list(other.state_dict())
    set_model_state_dict(packed, get_model_state_dict(other, options=full), options=full)  # unpacked -> packed
    loaded = all(
        torch.equal(a, b) for a, b in zip(packed.state_dict().values(), other.state_dict().values(), strict=True)
    )
    plain = _gpt(seed=2)
    set_model_state_dict(plain, get_model_state_dict(packed, options=full), options=full)  # packed -> unpacked
    back = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), other.state_dict().values(), strict=True))
    return {"keys_match": keys_match, "loaded": loaded, "back": back}


def test_dcp_full_state_dicts_and_ddp_wrapper_across_packing() -> None:
    """A full-state-dict load put the packed model's own parameter beside the given q/k/v parts, which were then
    reported unexpected (``Unexpected key(s) in state_dict: "...q_proj.weight"``) instead of loaded."""
    (r,) = run_in_processes(_dcp_distributed_worker, 1, (), timeout=120)
    assert r == {"keys_match": True, "loaded": True, "back": True}


def test_lightning_fsdp_strategy_refuses_the_plugin_in_one_line() -> None:
    """What docs/fused.md says: Lightning's FSDPStrategy takes only its FSDPPrecision, refused when it is attached."""
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin") as err:
        FSDPStrategy(precision_plugin=FusedPrecision("bf16-mixed"))
    assert "\n" not in str(err.value)


def test_follow_replaced_parameters_functional_form_and_report_pickles() -> None:
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before surgery, not passed to it
    report = apply_fusions(model, fusions=["qkv"])
    assert {id(p) for g in opt.param_groups for p in g["params"]} != {id(p) for p in model.parameters()}
    assert follow_replaced_parameters([opt], report) == 4  # a weight and a bias packed in each of two blocks
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert follow_replaced_parameters([opt], report) == 0  # already following
    restored = pickle.loads(pickle.dumps(report))  # the weak references stay behind
    assert restored.records == report.records and restored.replaced == []
