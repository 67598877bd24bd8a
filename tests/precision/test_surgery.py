"""Module surgery (functional core): what is matched, numerics against the unfused model, in-place-ness,
idempotence, state_dict compatibility, optimizer references, ignore lists, warnings, compile fallback."""

from __future__ import annotations

import copy
import inspect
import io
import logging
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

from lightning_accel._utils import patching
from lightning_accel._utils.triton import Backend
from lightning_accel.models import GPT, SmallResNet
from lightning_accel.precision import FusedPrecision, Replacement, apply_fusions, replace_optimizer_params
from lightning_accel.precision.compile import compile_in_place
from lightning_accel.precision.modules import (
    FusedBasicBlockMixin,
    FusedGPTBlockMixin,
    FusedSequentialMixin,
    is_fused,
    original_class,
    register_block,
)
from lightning_accel.precision.surgery import unfuse

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_accel"


def _close_params(a: nn.Module, b: nn.Module, atol: float = 1e-5) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k].float(), sb[k].float(), atol=atol, rtol=1e-4, msg=k)


def test_resnet_patterns_numerics_and_in_place() -> None:
    torch.manual_seed(0)
    model = SmallResNet(width=8, blocks=(1, 1))
    ref = copy.deepcopy(model)
    param_ids = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    report = apply_fusions(model, backend="reference")  # the fused functions' torch path, not eager ops
    assert report.counts() == {"conv_bn_relu": 5}  # stem, 2 blocks, 2 downsamples
    # the line that is logged tells eligible modules (conv+bn pairs: 1 + 2 x 2 + 2) from the rewrites that fused them
    assert report.summary() == "7/7 eligible modules fused (conv_bn 7/7) by 5 rewrites ({'conv_bn_relu': 5})"
    assert {r.module for r in report.records} == {
        "stem",
        "layers.0",
        "layers.0.downsample",
        "layers.1",
        "layers.1.downsample",
    }
    assert [id(p) for p in model.parameters()] == param_ids and list(model.state_dict()) == keys
    assert isinstance(model.layers[0], type(ref.layers[0]))  # the class swap keeps isinstance
    x = torch.randn(4, 3, 16, 16)
    for _ in range(2):  # two steps: running statistics evolve identically
        y, yr = model(x), ref(x)
        torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
        y.square().mean().backward()
        yr.square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    _close_params(model, ref)  # includes running stats and num_batches_tracked
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_torchvision_resnet_blocks() -> None:
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet.ResNet(tv.models.resnet.Bottleneck, [1, 1, 1, 1], num_classes=5, width_per_group=16)
    model = nn.Sequential(model).double()  # nested: the walker finds it anywhere
    ref = copy.deepcopy(model)
    report = apply_fusions(model, backend="reference")
    names = {r.detail.split(",")[0] for r in report.records}
    assert "stem conv1+bn1+relu" in names and "conv1+bn1+relu" in names
    assert report.counts()["conv_bn_relu"] == 1 + 4 + 4  # stem, 4 bottlenecks, 4 downsample Sequentials
    # float64: at 32 px / batch 2, layer4's BN sees 2 values per channel, and its gradients are ill-conditioned
    # enough that fp32 reordering alone moves them by 1e-3
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y, yr = model(x), ref(x)
    torch.testing.assert_close(y, yr, atol=1e-10, rtol=1e-10)
    y.square().mean().backward()
    yr.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() < 1e-9, name


def _gpt(dropout: float = 0.0) -> GPT:
    return GPT(vocab_size=11, block_size=9, n_layer=2, n_head=2, n_embd=16, dropout=dropout)


def test_gpt_patterns_and_numerics() -> None:
    torch.manual_seed(0)
    model = _gpt()
    ref = copy.deepcopy(model)
    report = apply_fusions(model, backend="reference")
    assert report.counts() == {"linear_dropout": 2, "qkv": 2, "norm": 5}
    attn, attn_ref = model.blocks[0].attn, ref.blocks[0].attn
    assert "q_proj" not in attn._modules and tuple(attn.qkv_proj.weight.shape) == (48, 16)
    assert torch.equal(
        attn.qkv_proj.weight, torch.cat([attn_ref.q_proj.weight, attn_ref.k_proj.weight, attn_ref.v_proj.weight])
    )
    idx = torch.randint(0, 11, (3, 9))
    y, yr = model(idx), ref(idx)
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
    y.square().mean().backward()
    yr.square().mean().backward()
    torch.testing.assert_close(
        attn.qkv_proj.weight.grad,
        torch.cat([attn_ref.q_proj.weight.grad, attn_ref.k_proj.weight.grad, attn_ref.v_proj.weight.grad]),
        atol=1e-6,
        rtol=1e-4,
    )
    torch.testing.assert_close(
        model.blocks[1].mlp[2].weight.grad, ref.blocks[1].mlp[2].weight.grad, atol=1e-6, rtol=1e-4
    )


def test_gpt_with_dropout_trains_and_matches_in_eval() -> None:
    torch.manual_seed(0)
    model = _gpt(dropout=0.2)
    ref = copy.deepcopy(model)
    apply_fusions(model, backend="reference")
    idx = torch.randint(0, 11, (2, 9))
    model.train()
    a, b = model(idx), model(idx)
    assert not torch.allclose(a, b)  # dropout active, fresh masks per call
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(idx), ref(idx), atol=1e-5, rtol=1e-5)


def test_qkv_state_dict_compatible_both_ways() -> None:
    torch.manual_seed(0)
    fused, plain = _gpt(), _gpt()
    apply_fusions(fused, backend="reference")
    sd = fused.state_dict()
    assert list(sd) == list(plain.state_dict())  # fused checkpoints look unfused, key order included
    plain.load_state_dict(sd)  # fused -> unfused
    torch.manual_seed(1)
    other = _gpt()
    fused.load_state_dict(other.state_dict())  # unfused -> fused
    idx = torch.randint(0, 11, (2, 9))
    torch.testing.assert_close(fused(idx), other(idx), atol=1e-5, rtol=1e-5)
    q = fused.blocks[0].attn.qkv_proj
    packed = {"weight": q.weight.detach().clone() * 0 + 1, "bias": q.bias.detach().clone()}
    q.load_state_dict(packed)  # the packed keys themselves still load
    assert torch.all(q.weight == 1)


def test_qkv_partial_or_mismatched_state_dict_loads_and_reports_as_unfused() -> None:
    """A state dict holding some q/k/v parts (``strict=False``) loads them into the packed rows, as the unfused model
    loads them (they were dropped as unexpected keys, silently under ``strict=False``); absent parts are reported
    missing by their unfused names, and a part of another shape raises the unfused model's size-mismatch error."""
    torch.manual_seed(0)
    plain = _gpt()
    fused = copy.deepcopy(plain)
    apply_fusions(fused, backend="reference")
    before = fused.state_dict()["blocks.0.attn.v_proj.weight"].clone()
    partial = {"blocks.0.attn.q_proj.weight": torch.full((16, 16), 0.5), "blocks.0.attn.k_proj.bias": torch.ones(16)}
    results = {name: m.load_state_dict(partial, strict=False) for name, m in (("plain", plain), ("fused", fused))}
    assert results["fused"].unexpected_keys == results["plain"].unexpected_keys == []
    assert sorted(results["fused"].missing_keys) == sorted(results["plain"].missing_keys)
    assert "blocks.0.attn.v_proj.weight" in results["fused"].missing_keys
    assert not any("qkv_proj" in k for k in results["fused"].missing_keys)
    sd = fused.state_dict()
    torch.testing.assert_close(sd["blocks.0.attn.q_proj.weight"], partial["blocks.0.attn.q_proj.weight"])
    torch.testing.assert_close(sd["blocks.0.attn.k_proj.bias"], partial["blocks.0.attn.k_proj.bias"])
    torch.testing.assert_close(sd["blocks.0.attn.v_proj.weight"], before)  # absent: unchanged
    # nothing given at all: missing by the unfused names, and `assign=True` keeps the packed parameter itself
    packed = fused.blocks[0].attn.qkv_proj.weight
    missing = fused.load_state_dict({}, strict=False, assign=True).missing_keys
    assert sorted(missing) == sorted(plain.load_state_dict({}, strict=False).missing_keys)
    assert fused.blocks[0].attn.qkv_proj.weight is packed
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks\.0\.attn\.q_proj\.weight") as err:
        fused.load_state_dict({"blocks.0.attn.q_proj.weight": torch.zeros(8, 16)}, strict=False)
    assert "qkv_proj" not in str(err.value)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"blocks\.0\.attn\.k_proj\.weight"'):
        fused.load_state_dict(partial)  # strict: the absent parts are missing, as unfused
    with torch.device("meta"):
        meta = _gpt()
    apply_fusions(meta, backend="reference")
    meta.load_state_dict(plain.state_dict(), assign=True)  # a CPU checkpoint into a meta-initialised fused model
    key = "blocks.1.attn.k_proj.weight"
    assert meta.state_dict()[key].device.type == "cpu"
    torch.testing.assert_close(meta.state_dict()[key], plain.state_dict()[key])


def test_qkv_state_dict_entries_share_the_packed_storage_like_every_other_entry() -> None:
    """``state_dict()`` returns references to the parameters: an EMA model updated in place through
    ``state_dict().values()`` must move its packed q/k/v weights too (copies left them at their first values), and
    ``torch.save`` writes the shared storage once."""
    torch.manual_seed(0)
    plain = _gpt()
    model = copy.deepcopy(plain)
    apply_fusions(model, backend="reference")
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for e, m in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
            e.copy_(0.5 * e + 0.5 * m)  # in place, as EMA implementations update their copy
    moved = {k: v - plain.state_dict()[k] for k, v in ema.state_dict().items() if k.endswith("_proj.weight")}
    assert {"blocks.0.attn.q_proj.weight", "blocks.1.attn.v_proj.weight"} <= moved.keys()
    for key, delta in moved.items():
        torch.testing.assert_close(delta, torch.full_like(delta, 0.5), msg=key)
    packed = cast(nn.Linear, model.get_submodule("blocks.0.attn.qkv_proj")).weight
    assert model.state_dict()["blocks.0.attn.k_proj.weight"].data_ptr() == packed[16:32].data_ptr()

    def saved_bytes(m: nn.Module) -> int:
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)
        return len(buffer.getvalue())

    assert saved_bytes(model) <= saved_bytes(plain)  # the packed storage once, not three times


def test_qkv_state_dict_keep_vars_gives_parameters_like_the_unfused_model() -> None:
    """``state_dict(keep_vars=True)`` holds the parameters themselves: the q/k/v entries of a packed model must be
    ``nn.Parameter`` with the packed parameter's ``requires_grad`` (a fine-tune that saves ``{k: v for k, v in
    sd.items() if v.requires_grad}`` would drop them as frozen otherwise), share its storage and show its gradient."""
    torch.manual_seed(0)
    plain = _gpt()
    model = copy.deepcopy(plain)
    apply_fusions(model, backend="reference")
    model.blocks[1].requires_grad_(False)  # frozen block: its parts must read as frozen, as unfused
    plain.blocks[1].requires_grad_(False)
    model(torch.randint(0, 11, (2, 9))).square().mean().backward()
    fused_sd, plain_sd = model.state_dict(keep_vars=True), plain.state_dict(keep_vars=True)
    assert list(fused_sd) == list(plain_sd)
    for key, value in plain_sd.items():
        assert type(fused_sd[key]) is type(value), key
        assert fused_sd[key].requires_grad == value.requires_grad, key
    trainable = {k for k, v in fused_sd.items() if v.requires_grad}
    assert trainable == {k for k, v in plain_sd.items() if v.requires_grad}
    assert "blocks.0.attn.v_proj.bias" in trainable and "blocks.1.attn.q_proj.weight" not in trainable
    packed = cast(nn.Linear, model.get_submodule("blocks.0.attn.qkv_proj"))
    k_weight = fused_sd["blocks.0.attn.k_proj.weight"]
    assert k_weight.data_ptr() == packed.weight[16:32].data_ptr()
    assert packed.weight.grad is not None and k_weight.grad is not None
    torch.testing.assert_close(k_weight.grad, packed.weight.grad[16:32])
    assert fused_sd["blocks.1.attn.k_proj.weight"].grad is None
    with torch.no_grad():
        k_weight.add_(1.0)  # in place through the entry reaches the model, as through a parameter
    torch.testing.assert_close(packed.weight[16:32], k_weight.detach())
    plain.load_state_dict(fused_sd)  # and it loads both ways, strictly
    model.load_state_dict(plain.state_dict(keep_vars=True))
    assert all(not v.requires_grad for v in model.state_dict().values())  # keep_vars=False: detached, as before


def test_optimizer_references_and_state_follow_qkv_packing() -> None:
    torch.manual_seed(0)
    fused = _gpt()
    plain = copy.deepcopy(fused)
    idx = torch.randint(0, 11, (2, 9))
    opt_f = torch.optim.AdamW(fused.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for model, opt in ((fused, opt_f), (plain, opt_p)):  # one step each, so Adam has state to carry over
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()
    n_before = len(opt_f.param_groups[0]["params"])
    report = apply_fusions(fused, optimizers=[opt_f], backend="reference")
    params = opt_f.param_groups[0]["params"]
    assert len(params) == n_before - 2 * 2 * 2  # per block: 3 weights -> 1 and 3 biases -> 1
    assert {id(p) for p in params} == {id(p) for p in fused.parameters()}
    assert all(new in opt_f.state for _, new in report.param_swaps)
    for model, opt in ((fused, opt_f), (plain, opt_p)):
        model(idx).square().mean().backward()
        opt.step()
    _close_params(fused, plain, atol=1e-6)


def test_replace_optimizer_params_without_state_starts_fresh() -> None:
    a, b, new = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(4, 3))
    other = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([a, other, b], lr=0.1)
    assert replace_optimizer_params([opt], [([a, b], new)]) == 1
    assert opt.param_groups[0]["params"] == [new, other] and new not in opt.state


def test_sequential_linear_dropout_and_rmsnorm() -> None:
    if not hasattr(nn, "RMSNorm"):
        pytest.skip("nn.RMSNorm needs torch >= 2.4")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.GELU(), nn.RMSNorm(8), nn.Linear(8, 4), nn.Dropout(0.0))
    ref = copy.deepcopy(model)
    report = apply_fusions(model, backend="reference")
    assert report.counts() == {"linear_dropout": 1, "norm": 1}
    assert report.records[0].detail == "[0:2] linear_dropout, [4:6] linear_dropout"
    model.eval()
    ref.eval()
    x = torch.randn(5, 6)
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_ignore_modules_by_name_and_type_and_fusion_selection() -> None:
    model = _gpt()
    report = apply_fusions(model, ignore_modules=["blocks.0", nn.LayerNorm])
    assert {r.module for r in report.records} == {"blocks.1", "blocks.1.attn"}
    model = _gpt()
    assert apply_fusions(model, fusions=["norm"]).counts() == {"norm": 5}
    with pytest.raises(ValueError, match=r"`fusions` has unknown pattern\(s\) \['flash'\]"):
        apply_fusions(model, fusions=["flash"])


def test_idempotent_and_warns_only_when_nothing_ever_matched() -> None:
    model = _gpt()
    first = apply_fusions(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = apply_fusions(model)  # already fused: nothing new, and no warning
    assert len(first) == 9 and len(second) == 0
    with pytest.warns(UserWarning, match="found nothing to fuse"):
        apply_fusions(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))


@pytest.mark.parametrize("fusions", [[], {}], ids=["no_names", "empty_policy"])
def test_an_empty_selection_fuses_nothing_without_a_warning(fusions: list | dict) -> None:
    """``fusions=[]`` asks for no fusion (mixed precision alone): the model stays as built, and nothing warns that
    surgery "found nothing", which the user asked for."""
    model = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = apply_fusions(model, fusions=fusions)
        plugin = FusedPrecision(fusions=fusions)
        assert plugin.convert_module(model) is model
    assert len(report) == 0 and not report.param_swaps
    assert not any(is_fused(m) for m in model.modules())
    assert plugin.report is not None and not plugin.report.records and not plugin.lever_active


def test_subclasses_with_their_own_forward_are_not_touched() -> None:
    class MyNorm(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class MySeq(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 1

    model = nn.Sequential(MyNorm(4), MySeq(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.ReLU()))
    with pytest.warns(UserWarning, match="nothing to fuse"):
        report = apply_fusions(model)
    assert len(report) == 0
    why = {c.module: c.reason for c in report.skipped()}
    assert "subclass" in why["0"] and "overrides nn.Sequential.forward" in why["1.0"], why
    assert report.coverage() == 0.0


def test_custom_policy() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())

    def swap_tanh(m: nn.Module) -> tuple[str, list]:
        m.__class__ = nn.Hardtanh  # a toy replacement, in place
        m.min_val, m.max_val, m.inplace = -1.0, 1.0, False
        return "tanh -> hardtanh", []

    report = apply_fusions(model, fusions={"toy": [Replacement(lambda m: type(m) is nn.Tanh, swap_tanh)]})
    assert report.counts() == {"toy": 1} and isinstance(model[1], nn.Hardtanh)


def test_compile_falls_back_to_eager_with_a_clear_warning() -> None:
    def broken_backend(gm: torch.fx.GraphModule, example_inputs: list) -> None:
        raise RuntimeError("no compiler here")

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    expected = model(x)
    assert compile_in_place(model, backend=broken_backend)
    assert not compile_in_place(model, backend=broken_backend)  # idempotent
    with pytest.warns(UserWarning, match="`torch.compile` failed for Sequential.*running it eagerly"):
        torch.testing.assert_close(model(x), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(model(x), expected)  # warned once; stays eager


def test_a_compile_failure_is_warned_on_global_rank_0_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank of a job falls back alike; the warning is one line per job (rank 0), the others log it."""

    def broken_backend(gm: torch.fx.GraphModule, example_inputs: list) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("RANK", "1")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    expected = model(x)
    compile_in_place(model, backend=broken_backend)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="lightning_accel.precision.compile"):
        warnings.simplefilter("error")
        torch.testing.assert_close(model(x), expected)  # fell back to eager, no warning on rank 1
    assert "`torch.compile` failed for Sequential" in caplog.text


def test_a_compile_failure_after_a_graph_break_does_not_count_the_batch_twice() -> None:
    """With a graph break, the graph before it runs before the one after it is compiled: when that second compilation
    fails, the eager rerun of the call must start from the buffers as they were (batch-norm statistics once)."""
    compiled_graphs: list[int] = []

    def second_graph_fails(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., object]:
        compiled_graphs.append(len(compiled_graphs))
        if len(compiled_graphs) > 1:
            raise RuntimeError("no compiler for this graph")
        return gm.forward

    class BreakAfterNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x).mean((2, 3))
            if h.sum() > -1e9:  # data-dependent branch: a graph break
                h = h * 2
            return self.head(h)

    torch.manual_seed(0)
    model = BreakAfterNorm()
    apply_fusions(model, backend="reference")
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    compile_in_place(model, backend=second_graph_fails)
    with pytest.warns(UserWarning, match="`torch.compile` failed for BreakAfterNorm"):
        torch.testing.assert_close(model(x), ref(x))
    assert len(compiled_graphs) == 2  # the first graph compiled and ran before the second failed
    bn, bn_ref = model.body[1], ref.body[1]
    assert isinstance(bn, nn.BatchNorm2d) and isinstance(bn_ref, nn.BatchNorm2d)
    assert bn.num_batches_tracked is not None and bn_ref.num_batches_tracked is not None
    assert int(bn.num_batches_tracked) == int(bn_ref.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean, atol=0, rtol=0)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var, atol=0, rtol=0)


def test_compile_in_place_works_with_a_working_backend() -> None:
    model = _gpt()
    ref = copy.deepcopy(model)
    apply_fusions(model, backend="reference")
    compile_in_place(model, backend="eager")
    idx = torch.randint(0, 11, (2, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        torch.testing.assert_close(model(idx), ref(idx), atol=1e-5, rtol=1e-5)
    assert model._compiled_call_impl.failed is None


def test_plugin_arguments_and_in_place_convert() -> None:
    with pytest.raises(ValueError, match="`precision` must be 'bf16-mixed' or '16-mixed', got '32'. FusedPrecision"):
        FusedPrecision("32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`precision` must be 'bf16-mixed' or '16-mixed', got 16 \\(int\\)"):
        FusedPrecision(16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown pattern"):
        FusedPrecision(fusions=["qkvo"])
    plugin = FusedPrecision("bf16-mixed", device="cpu", fusions="norm")
    model = _gpt()
    assert plugin.convert_module(model) is model
    assert plugin.report is not None and plugin.report.counts() == {"norm": 5}
    assert not any(is_fused(m, FusedGPTBlockMixin) for m in model.modules())
    with pytest.raises(ValueError, match="`backend`"):
        FusedPrecision(backend="cuda")  # type: ignore[arg-type]


def _saved_bytes(model: nn.Module, idx: torch.Tensor) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx)
    return sum(storages.values())


def test_backend_is_passed_to_fused_modules() -> None:
    torch.manual_seed(0)
    model = _gpt(dropout=0.2)
    apply_fusions(model)
    assert {m._la_backend for m in model.modules() if is_fused(m)} == {"auto"}
    apply_fusions(model, backend="reference")  # re-targets already fused modules
    assert {m._la_backend for m in model.modules() if is_fused(m)} == {"reference"}
    idx = torch.randint(0, 11, (2, 9))
    fused_bytes = _saved_bytes(model, idx)
    apply_fusions(model, backend="eager")
    assert {m._la_backend for m in model.modules() if is_fused(m)} == {"eager"}
    # eager dropout keeps a mask (and the add its input) per Linear+Dropout, 2 per block; the fused function
    # regenerates the mask from its seed
    assert _saved_bytes(model, idx) - fused_bytes >= 2 * 2 * (2 * 9 * 16)


@pytest.mark.parametrize(
    "bn_kwargs",
    [{"momentum": None}, {"track_running_stats": False}, {"affine": False}],
    ids=["cumulative", "no_stats", "no_affine"],
)
def test_batchnorm_variants_keep_their_bookkeeping(bn_kwargs: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, **bn_kwargs), nn.ReLU())
    ref = copy.deepcopy(model)
    assert apply_fusions(model, backend="reference").counts() == {"conv_bn_relu": 1}
    for _ in range(3):
        x = torch.randn(2, 3, 5, 5)
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    _close_params(model, ref)  # running stats, num_batches_tracked
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


class _PlainBlock(nn.Module):
    """A user's block with BasicBlock's structure and forward, defined outside any known package."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)
        self.downsample: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


class _RegisteredBlock(_PlainBlock):
    pass


register_block(_RegisteredBlock, FusedBasicBlockMixin)


def test_block_forwards_need_a_registration_not_a_class_name() -> None:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="nothing to fuse"):  # same structure, but its forward is not declared
        assert len(apply_fusions(_PlainBlock())) == 0
    model = nn.Sequential(_RegisteredBlock(), _PlainBlock())
    ref = copy.deepcopy(model)
    report = apply_fusions(model, backend="reference")
    assert report.counts() == {"conv_bn_relu": 1} and [r.module for r in report.records] == ["0"]
    assert is_fused(model[0], FusedBasicBlockMixin) and not is_fused(model[1])
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="`mixin` must be one of"):
        register_block(_PlainBlock, FusedSequentialMixin)
    with pytest.raises(ValueError, match="`cls` must be an nn.Module class"):
        register_block(42, FusedBasicBlockMixin)  # type: ignore[arg-type]


def test_precision_and_ops_do_not_know_the_demo_models() -> None:
    # neither the package nor its classes (torchvision's BasicBlock shares a name with the demo's: not listed)
    demo = re.compile(
        r"lightning_accel\.models|from \.\.models|import models|"
        r"\b(SmallResNet|GPTBlock|CausalSelfAttention|TinyGPT|ImageClassifier)\b"
    )
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for room in ("precision", "ops")
        for path in sorted((PACKAGE / room).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if demo.search(line)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("make", [lambda: SmallResNet(width=8, blocks=(1, 1)), _gpt], ids=["resnet", "gpt"])
def test_fused_model_round_trips_through_torch_save_and_pickle(make, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = make()
    apply_fusions(model, backend="reference")
    model.eval()
    x = torch.randn(2, 3, 16, 16) if isinstance(model, SmallResNet) else torch.randint(0, 11, (2, 9))
    expected = model(x)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for other in (loaded, pickle.loads(pickle.dumps(model))):
        assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()]  # the same swapped classes
        assert other.state_dict().keys() == model.state_dict().keys()
        torch.testing.assert_close(other(x), expected, atol=0, rtol=0)


def test_fused_by_the_plugin_pickles() -> None:
    torch.manual_seed(0)
    model = _gpt()
    FusedPrecision("bf16-mixed", device="cpu", backend="reference").convert_module(model)
    model.eval()
    idx = torch.randint(0, 11, (2, 9))
    loaded = pickle.loads(pickle.dumps(model))
    assert any(is_fused(m, FusedGPTBlockMixin) for m in loaded.modules())
    torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)


def test_the_class_swap_is_reversible_through_the_patching_handle() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
    apply_fusions(seq, fusions=["linear_dropout"], backend="reference")
    assert is_fused(seq, FusedSequentialMixin) and original_class(seq) is nn.Sequential
    previous = patching.swap_class(seq, original_class(seq))  # un-fuse: the original class comes back
    assert type(seq) is nn.Sequential and issubclass(previous, FusedSequentialMixin)
    assert not is_fused(seq)
    x = torch.randn(2, 4)
    torch.testing.assert_close(seq(x), seq[1](seq[0](x)))


def test_hooked_modules_run_unfused_and_their_hooks_run() -> None:
    """A fused forward that would skip a module's call (pruning's pre-hook, a user's hook) runs it unfused instead."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    ref = copy.deepcopy(seq)
    for m in (seq, ref):
        prune.l1_unstructured(m[0], "weight", amount=0.5)  # weight = weight_orig * mask, recomputed by a pre-hook
    report = apply_fusions(seq, backend="reference")
    assert report.counts() == {"linear_dropout": 1}
    assert [(c.module, c.fused) for c in report.candidates] == [("0", False)]
    assert "hooks" in report.candidates[0].reason
    x = torch.randn(16, 8)
    for model in (seq, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):  # the stale `weight` of a skipped pre-hook would fail the second backward
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    torch.testing.assert_close(seq[0].weight_orig, ref[0].weight_orig)

    calls: list[str] = []
    block = SmallResNet(width=8, blocks=(1,)).layers[0]
    apply_fusions(block, backend="reference")
    assert isinstance(block, FusedBasicBlockMixin)
    eager = copy.deepcopy(block)
    eager.__class__ = original_class(block)
    handle = block.bn1.register_forward_hook(lambda m, i, o: calls.append("bn1"))  # registered after surgery
    x = torch.randn(2, 8, 8, 8)
    torch.testing.assert_close(block(x), eager(x), atol=1e-5, rtol=1e-5)
    assert calls == ["bn1"]
    handle.remove()
    block(x)
    assert calls == ["bn1"]  # fused again once the hook is gone

    gpt = _gpt()
    gpt.blocks[0].attn.q_proj.register_forward_hook(lambda m, i, o: calls.append("q"))
    gpt.blocks[1].mlp[0].register_forward_pre_hook(lambda m, i: calls.append("fc"))
    report = apply_fusions(gpt, backend="reference")
    assert "q_proj" in gpt.blocks[0].attn._modules  # packing would drop the module and its hook
    assert "qkv_proj" in gpt.blocks[1].attn._modules
    calls.clear()
    gpt(torch.randint(0, 11, (2, 9)))
    assert calls == ["q", "fc"]


def test_qkv_is_packed_only_for_projections_that_train_alike() -> None:
    model = _gpt()
    model.blocks[0].attn.k_proj.weight.requires_grad_(False)
    opt = torch.optim.SGD(
        [
            {"params": [p for n, p in model.named_parameters() if "blocks.1.attn.q_proj" not in n]},
            {"params": list(model.blocks[1].attn.q_proj.parameters()), "lr": 0.0},
        ],
        lr=0.1,
    )
    report = apply_fusions(model, optimizers=[opt])
    assert "qkv" not in report.counts()  # block 0: mixed requires_grad; block 1: split across parameter groups
    assert all("q_proj" in b.attn._modules for b in model.blocks)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == sum(
        p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad
    )


def test_dropout_of_one_and_containers_changed_after_surgery_run_as_eager() -> None:
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 8), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(8, 3), nn.ReLU(), nn.Dropout(1.0))
    report = apply_fusions(head, backend="reference")
    assert [r.detail for r in report.records] == ["[0:3] linear_hardswish_dropout, [3:5] linear_relu"]
    x = torch.randn(4, 8)
    assert torch.equal(head(x), torch.zeros(4, 3))  # Dropout(p=1) in training zeroes, as unfused
    head.eval()
    head[1] = nn.ReLU()  # the planned group no longer holds the modules it was planned over
    torch.testing.assert_close(head(x), head[4](head[3](torch.relu(head[0](x)))))
    head[2] = nn.Identity()
    head.insert(0, nn.Identity())
    y = head(x)  # every stale group runs its modules one by one
    assert not any(c.fused for c in fused_candidates(head))
    assert [r.detail for r in apply_fusions(head).records] == ["[1:3] linear_relu, [4:6] linear_relu"]
    assert head._la_plan == {1: (2, "linear_relu"), 4: (2, "linear_relu")}  # surgery again: planned afresh
    torch.testing.assert_close(head(x), y)
    head.train()
    head[3].p = 1.0  # an Identity now; the Dropout(p=1) at the end zeroes, unfused
    assert torch.equal(head(x), torch.zeros(4, 3))


def fused_candidates(model: nn.Module) -> list:
    from lightning_accel.precision.surgery import _candidates

    return _candidates(model, {}, ())


def test_ignore_modules_inside_fused_containers_and_blocks() -> None:
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    report = apply_fusions(seq, ignore_modules="2")  # one name, not its characters
    assert [r.detail for r in report.records] == ["[0:2] linear_relu"]
    block = SmallResNet(width=8, blocks=(1,)).layers[0]
    report = apply_fusions(block, ignore_modules=["bn1"], warn_if_empty=False)
    assert not is_fused(block) and [r.module for r in report.records] == ["downsample"]
    assert "holds a module of `ignore_modules`" in {c.module: c.reason for c in report.skipped()}["conv2"]
    gpt = _gpt()
    report = apply_fusions(gpt, ignore_modules=[nn.LayerNorm, "blocks.0.mlp.2"])
    assert isinstance(gpt.blocks[1], FusedGPTBlockMixin) and not isinstance(gpt.blocks[0], FusedGPTBlockMixin)
    assert "_la_claimed" not in gpt.blocks[0].mlp.__dict__  # the undone block's container is free again
    with pytest.warns(UserWarning, match=r"`ignore_modules` names \['blocks\.9'\]"):
        apply_fusions(_gpt(), ignore_modules=["blocks.9"])
    with pytest.raises(TypeError, match="`ignore_modules` must be module names"):
        FusedPrecision(ignore_modules=[3])  # type: ignore[list-item]
    assert FusedPrecision(ignore_modules="model.head").ignore_modules == ("model.head",)


# ------------------------------------------------------------------ what is refused, and the report saying why


class _CountingBatchNorm(nn.BatchNorm2d):
    """A BatchNorm2d subclass with a forward of its own (as nn.SyncBatchNorm has): it must be called."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


def _frozen_bn(c: int) -> nn.Module:
    tv = pytest.importorskip("torchvision")
    return tv.ops.misc.FrozenBatchNorm2d(c)


@pytest.mark.parametrize(
    ("norm", "cls"),
    [(_frozen_bn, "FrozenBatchNorm2d"), (lambda c: nn.GroupNorm(2, c), "GroupNorm"), ("sync", "SyncBatchNorm")],
    ids=["frozen_bn", "group_norm", "sync_bn"],
)
def test_resnet_blocks_with_other_norm_layers_are_left_unfused_with_the_reason(norm: object, cls: str) -> None:
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    if norm == "sync":  # what Trainer(sync_batchnorm=True) does before convert_module
        model = nn.SyncBatchNorm.convert_sync_batchnorm(tv.models.resnet18(num_classes=4))
    else:
        model = tv.models.resnet18(num_classes=4, norm_layer=norm)
    eager = copy.deepcopy(model)
    report = apply_fusions(model, warn_if_empty=False)
    assert not any(is_fused(m) for m in model.modules()) and len(report) == 0
    assert report.candidates and report.coverage() == 0.0  # eligible, and said to be unfused
    why = {c.module: c.reason for c in report.skipped()}
    assert (
        why["layer1.0.conv1"]
        == f"bn1 is {cls}: only nn.BatchNorm2d is fused, so its block `BasicBlock` runs its own forward"
    )
    assert why["conv1"].startswith(f"bn1 is {cls}: only nn.BatchNorm2d is fused")  # the ResNet stem
    if cls == "SyncBatchNorm":  # the downsample Sequential: the generic conv + bn path refuses it too
        assert why["layer2.0.downsample.0"] == (
            "`layer2.0.downsample.1` is SyncBatchNorm: only nn.BatchNorm2d is fused"
        )
        return  # SyncBatchNorm needs a process group (and a GPU) to run
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), eager(x))


def test_generic_conv_bn_path_fuses_only_exact_batch_norm() -> None:
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU(), nn.Conv2d(4, 4, 3), _CountingBatchNorm(4))
    report = apply_fusions(seq, warn_if_empty=False)
    assert len(report) == 0 and not is_fused(seq)
    why = {c.module: c.reason for c in report.skipped()}
    assert why == {
        "0": "`1` is SyncBatchNorm: only nn.BatchNorm2d is fused",
        "3": "`4` is _CountingBatchNorm: only nn.BatchNorm2d is fused",
    }


def test_a_block_whose_batch_norm_is_replaced_after_surgery_runs_its_own_forward() -> None:
    torch.manual_seed(0)
    model = SmallResNet(width=8, blocks=(1,))
    apply_fusions(model)
    block = model.layers[0]
    assert is_fused(block, FusedBasicBlockMixin)
    eager = copy.deepcopy(model)
    counting = _CountingBatchNorm(8)
    counting.load_state_dict(block.bn1.state_dict())
    block.bn1 = counting  # e.g. convert_sync_batchnorm for a later fit
    eager.layers[0].bn1 = copy.deepcopy(counting)
    _CountingBatchNorm.calls = 0
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(model(x), eager(x))
    assert _CountingBatchNorm.calls == 2  # once in each model: the fused block did not skip it
    why = {c.module: c.reason for c in apply_fusions(model).skipped()}
    assert why["layers.0.conv1"] == "bn1 is _CountingBatchNorm: only nn.BatchNorm2d is fused"


def test_tied_or_shared_qkv_parameters_are_not_packed() -> None:
    from lightning_accel.models.transformer import CausalSelfAttention
    from lightning_accel.precision.modules import pack_qkv

    attn = CausalSelfAttention(16, 2)
    attn.k_proj.weight = attn.q_proj.weight  # tied
    n_params = sum(p.numel() for p in attn.parameters())
    report = apply_fusions(attn, warn_if_empty=False)
    assert "qkv_proj" not in attn._modules and sum(p.numel() for p in attn.parameters()) == n_params
    assert report.skipped()[0].reason == (
        "q_proj.weight is shared with `k_proj.weight` (tied weights): packing copies it, which would untie them"
    )
    with pytest.raises(ValueError, match="share a parameter"):
        pack_qkv(attn)

    attn = CausalSelfAttention(16, 2)
    attn.v_proj = attn.k_proj  # the same module twice
    report = apply_fusions(attn, warn_if_empty=False)
    assert "qkv_proj" not in attn._modules
    assert report.skipped()[0].reason.startswith("v_proj is the same module as k_proj")

    model = _gpt()
    model.blocks[0].attn.v_proj.bias = model.blocks[0].attn.proj.bias  # shared with another module of the model
    report = apply_fusions(model)
    assert "qkv_proj" not in model.blocks[0].attn._modules and "qkv_proj" in model.blocks[1].attn._modules
    why = {c.module: c.reason for c in report.skipped()}
    assert why == {
        "blocks.0.attn": "v_proj.bias is shared with `blocks.0.attn.proj.bias` (tied weights): packing copies it, "
        "which would untie them"
    }


def test_attention_counts_as_fused_only_when_its_qkv_was_packed() -> None:
    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model.blocks[0].attn.q_proj.weight.requires_grad_(False)
    report = apply_fusions(model)
    assert is_fused(model.blocks[0], FusedGPTBlockMixin) and "qkv_proj" not in model.blocks[0].attn._modules
    assert report.coverage_by_kind()["attention"] == (0, 1)
    (skipped,) = report.skipped()
    assert (skipped.module, skipped.cls) == ("blocks.0.attn", "CausalSelfAttention")
    assert skipped.reason == (
        "requires_grad differs (q_proj.weight frozen, the others not): a packed parameter has one requires_grad"
    )
    # projections split across optimizer parameter groups, and the `qkv` pattern left out
    model = _gpt()
    attn = model.blocks[0].attn
    q_params = set(attn.q_proj.parameters())
    opt = torch.optim.SGD(
        [{"params": list(q_params)}, {"params": [p for p in model.parameters() if p not in q_params]}], lr=0.1
    )
    why = {c.module: c.reason for c in apply_fusions(model, optimizers=[opt]).skipped()}
    assert list(why) == ["blocks.0.attn"] and "different optimizer parameter groups" in why["blocks.0.attn"]
    why = {c.module: c.reason for c in apply_fusions(_gpt(), fusions=["linear_dropout", "norm"]).skipped()}
    assert why["blocks.1.attn"].startswith("q_proj/k_proj/v_proj not packed: pattern `qkv` not selected")


def test_skip_reasons_name_the_ignored_neighbour_and_the_unselected_pattern() -> None:
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 4), nn.ReLU())
    report = apply_fusions(seq, ignore_modules=["1", "3"], warn_if_empty=False)
    why = {c.module: c.reason for c in report.skipped()}
    assert why == {
        "0": "the module after it, `1`, is in `ignore_modules` (it runs on its own)",
        "2": "the module after it, `3`, is in `ignore_modules` (it runs on its own)",
    }
    report = apply_fusions(SmallResNet(width=8, blocks=(1,)), fusions=["block"], warn_if_empty=False)
    why = {c.module: c.reason for c in report.skipped()}
    assert why["layers.0.conv1"] == (
        "its block `BasicBlock` is registered with FusedBasicBlockMixin, whose pattern `conv_bn_relu` is not selected "
        "(`fusions=['block']`)"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"fusions": 123}, TypeError, r"`fusions` must be pattern names from .* got 123 \(int\)"),
        ({"fusions": {"x": 1}}, TypeError, r"`fusions` as a policy must map pattern names to lists of `Replacement`"),
        ({"fusions": ["norm", 3]}, TypeError, r"`fusions` must hold pattern names"),
        ({"compile": "yes"}, TypeError, r"`compile` must be True or False, got 'yes' \(str\)"),
        ({"compile_kwargs": ["mode"]}, TypeError, r"`compile_kwargs` must be a dict .* got \['mode'\] \(list\)"),
        # torch.compile checks these only when called, i.e. at the fit's setup: the plugin checks them here
        ({"compile_kwargs": {"modes": "max-autotune"}}, ValueError, r"`compile_kwargs` must be .* 'modes'"),
        ({"compile_kwargs": {"mode": "fastest"}}, ValueError, r"`compile_kwargs` .* Unrecognized mode=fastest"),
        ({"compile_kwargs": {"backend": "no_such_backend"}}, ValueError, r"`compile_kwargs` .* Invalid backend"),
        ({"device": "gpu"}, ValueError, r"`device` must be a torch device type .* got 'gpu' \(str\)\. Use 'cuda'"),
        ({"device": "cuda:0"}, ValueError, r"`device` must be a torch device type .* without an index"),
        ({"device": 3}, TypeError, r"`device` must be a torch device type .* got 3 \(int\)"),
        ({"scaler": "yes"}, TypeError, r"`scaler` must be a `torch.amp.GradScaler` or None .* got 'yes' \(str\)"),
        # '' names the root module only: its own container stayed unfused while everything below it fused
        ({"ignore_modules": ""}, ValueError, r"empty module name, got ''.*`ignore_modules=\[\]`"),
        ({"ignore_modules": ["a", ""]}, ValueError, r"`ignore_modules` holds an empty module name"),
        # a class that is no module matched nothing, silently
        ({"ignore_modules": [int]}, TypeError, r"`ignore_modules` must be module names .* or nn.Module classes"),
    ],
)
def test_plugin_arguments_are_checked_at_construction(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message) as info:
        FusedPrecision("16-mixed", **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("given", ["device", "scaler"])
def test_autocast_on_another_device_than_the_trainers_is_refused_at_setup(given: str) -> None:
    """`device="cuda"` (or a custom scaler, which keeps the default device) with a CPU Trainer autocast nothing: the
    fit ran in full precision without a word."""
    import lightning.pytorch as pl

    from tests.tiny import TimedModule, loaders

    kw = {"device": "cuda"} if given == "device" else {"scaler": torch.amp.GradScaler("cpu")}
    plugin = FusedPrecision("16-mixed", **kw)
    plugin.device = "cuda"  # what the default is on a GPU machine (the scaler case); the CPU one defaults to "cpu"
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"sets autocast on 'cuda', but the Trainer trains on 'cpu'.*device='cpu'"):
        trainer.fit(TimedModule(), loaders(None, 0.0)[0])


def test_a_scaler_with_bf16_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"`scaler` is for precision='16-mixed' only, .* Drop `scaler`") as info:
        FusedPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    assert "\n" not in str(info.value)


def test_the_report_releases_the_replaced_parameters() -> None:
    """The report outlives surgery (the plugin keeps it): it must not keep the unpacked q/k/v weights alive."""
    import gc
    import weakref

    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    olds = [weakref.ref(p) for n, p in model.named_parameters() if any(f".{q}_proj." in n for q in ("q", "k", "v"))]
    assert olds
    report = apply_fusions(model, optimizers=[opt], backend="reference")
    gc.collect()
    assert report.param_swaps and all(not old for old, _ in report.param_swaps)
    assert all(r() is None for r in olds)


def test_plugin_accepts_the_compile_kwargs_torch_compile_accepts() -> None:
    kw = {"backend": "eager", "dynamic": False}
    plugin = FusedPrecision("bf16-mixed", device="cpu", compile=True, compile_kwargs=kw)
    assert plugin.compile_kwargs == kw
    # without `compile=True` they would be kept and never used: one line says so (a config may switch compilation
    # off and keep them)
    with pytest.warns(UserWarning, match=r"`compile_kwargs` .*'eager'.* are not used with compile=False") as rec:
        FusedPrecision("bf16-mixed", device="cpu", compile_kwargs=kw)
    assert len(rec) == 1 and "\n" not in str(rec[0].message)


@pytest.mark.parametrize("optimizers", [[1], 5, "adam"])
def test_apply_fusions_refuses_optimizers_that_are_not_optimizers(optimizers: object) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(TypeError, match=r"`optimizers` must be a `torch.optim.Optimizer` or a list of them") as info:
        apply_fusions(model, optimizers=optimizers)
    assert "\n" not in str(info.value)
    assert not is_fused(model)  # refused before surgery


def test_apply_fusions_refuses_a_warn_if_empty_that_is_not_a_bool() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(TypeError, match=r"`warn_if_empty` must be True or False, got 'no'"):
        apply_fusions(model, warn_if_empty="no")  # type: ignore[arg-type]  # a YAML/CLI string read as truthy
    assert not is_fused(model)


def test_apply_fusions_takes_one_optimizer_and_patches_it() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    opt = torch.optim.Adam(model.parameters())
    apply_fusions(model, optimizers=opt)  # one optimizer, not a list: "'Adam' object is not iterable" before
    qkv = model.get_submodule("blocks.0.attn.qkv_proj").weight
    assert any(p is qkv for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("block", ["gpt", "gpt2"])
def test_a_hook_on_a_fused_blocks_attention_sees_the_attention_output_alone(block: str) -> None:
    """The fused GPT / GPT-2 block adds its residual inside the attention's output epilogue; a forward hook on the
    attention module (capturing or ablating it) must still see and replace ``attn(x)``, not ``x + attn(x)``."""
    from lightning_accel.models.gpt2 import GPT2Block
    from lightning_accel.models.transformer import GPTBlock

    torch.manual_seed(0)
    ref = (GPTBlock(16, 4) if block == "gpt" else GPT2Block(16, 4)).eval()
    fused = copy.deepcopy(ref)
    apply_fusions(fused, backend="reference")
    assert is_fused(fused) and is_fused(fused.attn)
    x = torch.randn(2, 5, 16)
    seen: dict[str, torch.Tensor] = {}
    for tag, model in (("ref", ref), ("fused", fused)):
        model.attn.register_forward_hook(lambda m, args, out, tag=tag: seen.__setitem__(tag, out.detach()))
    torch.testing.assert_close(fused(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen["fused"], seen["ref"], atol=1e-5, rtol=1e-5)
    for model in (ref, fused):  # an ablation: the hook's return value replaces the attention output
        model.attn.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    torch.testing.assert_close(fused(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref(x), ref.mlp(ref.ln_2(x)) + x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.0)),
        lambda: nn.LayerNorm(8),
        lambda: nn.RMSNorm(8),
    ],
    ids=["sequential", "layer_norm", "rms_norm"],
)
def test_a_fused_module_takes_its_input_by_the_original_keyword(make: Callable[[], nn.Module]) -> None:
    """``nn.Sequential.forward(input)`` / ``nn.LayerNorm.forward(input)``: ``seq(input=x)`` raised a TypeError after
    surgery (the fused forward named it ``x``)."""
    torch.manual_seed(0)
    ref = make()
    fused = copy.deepcopy(ref)
    apply_fusions(fused, backend="reference")
    assert is_fused(fused)
    original = original_class(fused).forward
    assert list(inspect.signature(type(fused).forward).parameters) == list(inspect.signature(original).parameters)
    x = torch.randn(2, 3, 8)
    name = next(iter(list(inspect.signature(original).parameters)[1:]))
    torch.testing.assert_close(fused(**{name: x}), ref(**{name: x}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_rms_norm_without_eps_uses_the_epsilon_eager_uses(dtype: torch.dtype, backend: str) -> None:
    """``nn.RMSNorm(eps=None)`` takes float32's epsilon for half inputs (``torch.rms_norm`` computes in float32); the
    fused forward took the half type's own (bfloat16: 7.8e-3), off by up to half the output for small activations."""
    torch.manual_seed(0)
    ref = nn.RMSNorm(64, eps=None).to(dtype)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, backend=backend)
    x = (torch.randn(4, 64) * 0.05).to(dtype)  # mean square ~2.5e-3: an epsilon of 7.8e-3 dominates it
    torch.testing.assert_close(fused(x), ref(x), atol=0, rtol=0)


def test_rms_norm_without_eps_under_autocast_matches_eager() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64, eps=None))
    fused = copy.deepcopy(ref)
    apply_fusions(fused)
    x = torch.randn(4, 64) * 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fused(x), ref(x), atol=0, rtol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(16, elementwise_affine=False),
        lambda: nn.RMSNorm(16, elementwise_affine=False),
        lambda: nn.LayerNorm(16),
        lambda: nn.RMSNorm(16),
    ],
    ids=["layernorm-no-affine", "rmsnorm-no-affine", "layernorm", "rmsnorm"],
)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_fused_norm_refuses_an_input_of_another_width_as_eager_does(
    make: Callable[[], nn.Module], backend: Backend
) -> None:
    """A norm without weights has nothing of the input's width to check against: the fused forward normalised a
    (3, 20) input over all 20 features where ``nn.LayerNorm(16)`` / ``nn.RMSNorm(16)`` raise."""
    ref = make()
    fused = copy.deepcopy(ref)
    apply_fusions(fused, backend=backend)
    assert is_fused(fused)
    x = torch.randn(3, 20)
    with pytest.raises(RuntimeError, match=re.escape("Given normalized_shape=[16]")):
        ref(x)
    with pytest.raises(RuntimeError, match=re.escape("Given normalized_shape=[16]")):
        fused(x)
    y = torch.randn(3, 16)
    torch.testing.assert_close(fused(y), ref(y))


def test_qkv_packing_with_a_factored_optimizer_state_starts_the_packed_state_fresh() -> None:
    """``torch.optim.Adafactor`` keeps ``(rows, 1)`` and ``(1, cols)`` second moments: concatenating them along dim 0
    made a ``(3, cols)`` column state next to q's ``(rows, 1)`` row state, and the next step failed on the shapes."""
    torch.manual_seed(0)
    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 11, (2, 8))
    model(idx).float().sum().backward()
    opt.step()
    opt.zero_grad()
    apply_fusions(model, optimizers=[opt])
    qkv = model.get_submodule("blocks.0.attn.qkv_proj")
    assert not opt.state.get(qkv.weight)  # fresh: no element-wise state to carry over
    ln = model.get_submodule("blocks.0.ln_1").weight
    assert opt.state[ln]  # untouched parameters keep theirs
    model(idx).float().sum().backward()
    opt.step()  # raised "The size of tensor a (16) must match the size of tensor b (48)" before
    assert opt.state[qkv.weight]["row_var"].shape == (48, 1)


def test_qkv_packing_concatenates_element_wise_optimizer_state() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model(torch.randint(0, 11, (2, 8))).float().sum().backward()
    opt.step()
    attn = model.get_submodule("blocks.0.attn")
    parts = [opt.state[getattr(attn, n).weight]["momentum_buffer"].clone() for n in ("q_proj", "k_proj", "v_proj")]
    apply_fusions(model, optimizers=[opt])
    torch.testing.assert_close(opt.state[attn.qkv_proj.weight]["momentum_buffer"], torch.cat(parts))


def test_a_slice_of_a_fused_sequential_runs_and_keeps_the_groups_inside_it() -> None:
    """``nn.Sequential.__getitem__`` builds a slice as ``self.__class__(...)``: the swapped class without the plan,
    whose forward raised ``AttributeError: 'FusedSequential' object has no attribute '_la_plan'``."""
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
    ).eval()
    fused = copy.deepcopy(ref)
    apply_fusions(fused, backend="reference")
    x = torch.randn(2, 3, 10, 10)
    inputs = {0: x, 1: ref[0](x), 3: ref[:3](x)}
    for start, stop, groups in [(0, 3, {0: (3, "conv_bn_relu")}), (1, None, {2: (3, "conv_bn_relu")}), (0, 2, {})]:
        part = fused[start:stop]
        assert isinstance(part, FusedSequentialMixin) and part._la_plan == groups
        assert all(m._la_backend == "reference" for m in [part] if groups)
        torch.testing.assert_close(part(inputs[start]), ref[start:stop](inputs[start]), atol=1e-5, rtol=1e-5)
    every_other = fused[::2]  # no whole group inside: runs its children one by one
    assert every_other._la_plan == {}
    # a container of the swapped class made any other way runs unfused rather than failing
    torch.testing.assert_close(type(fused)(*list(ref)[:3])(x), ref[:3](x))


def test_unfuse_then_apply_fusions_fuses_the_model_again() -> None:
    """``unfuse`` puts modules back as surgery found them: a later ``apply_fusions`` fuses every container and block
    again, with the same report, instead of taking the plan a container kept for a fusion already in place."""
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Flatten(),
        nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Dropout(0.1)),
    )
    gpt = _gpt()
    for model in (cnn, gpt):
        first = apply_fusions(model, backend="reference")
        assert unfuse(model) > 0
        assert not any(is_fused(m) for m in model.modules() if not hasattr(m, "qkv_proj"))  # packed QKV stays
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "found nothing to fuse"
            again = apply_fusions(model, backend="reference")
        assert again.summary().split(" by ")[0] == first.summary().split(" by ")[0]
        assert again.coverage() == 1.0
        assert all(m._la_backend == "reference" for m in model.modules() if is_fused(m))
    assert is_fused(cnn[0], FusedSequentialMixin) and is_fused(cnn[2], FusedSequentialMixin)
    assert any(is_fused(m, FusedGPTBlockMixin) for m in gpt.modules())


def test_a_plugin_converting_an_already_fused_model_reports_its_fused_modules_as_active() -> None:
    """A second fit of the same model (a fresh ``FusedPrecision``) finds everything fused already, so its surgery
    records no rewrite; the modules still run fused, and the lever must say so (and switch them off on request)."""
    torch.manual_seed(0)
    model = _gpt()
    first = FusedPrecision(device="cpu")
    first.convert_module(model)
    assert first.lever_active
    second = FusedPrecision(device="cpu")
    second.convert_module(model)
    assert second.report is not None and not second.report.records and second.report.coverage() == 1.0
    assert second.lever_active
    assert second.switch_off("diverged") and not second.lever_active
    assert not any(is_fused(m) for m in model.modules() if not hasattr(m, "qkv_proj"))  # packed QKV stays
