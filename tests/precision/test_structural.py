"""Structural matching on real model layouts: Sequential-forward containers, Conv+BN with each activation,
Linear(+act)(+Dropout) chains, nn.MultiheadAttention, nn.TransformerEncoderLayer (both norm orders), GPT-2 style
blocks, the skip reasons, the coverage, the registry, and float32 gradient equivalence with eager per pattern."""

from __future__ import annotations

import copy
import pickle
from typing import cast

import pytest
import torch
from torch import nn

from lightning_accel.models.gpt2 import GPT2Block
from lightning_accel.models.transformer import GPTBlock
from lightning_accel.ops.activation import ACTIVATIONS
from lightning_accel.precision import apply_fusions, register_block
from lightning_accel.precision import modules as fm
from lightning_accel.precision.surgery import eligible_modules

GRAD_RTOL = 1e-5


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def _grad_rel_err(a: nn.Module, b: nn.Module, exact: nn.Module) -> float:
    """Largest per-parameter max|ga - gb| / max|gb|, leaving out the parameters whose float64 gradient (``exact``)
    is zero: in float32 those are rounding noise in both (a bias feeding a shift-invariant BatchNorm)."""
    triples = [
        (p.grad, q.grad, r.grad)
        for p, q, r in zip(a.parameters(), b.parameters(), exact.parameters(), strict=True)
        if q.grad is not None
    ]
    assert triples and all(ga is not None for ga, _, _ in triples)
    top = max(float(gr.abs().max()) for _, _, gr in triples)
    return max(
        (
            float((ga - gb).abs().max()) / float(gb.abs().max())
            for ga, gb, gr in triples
            if gr.abs().max() > 1e-10 * top
        ),
        default=0.0,
    )


def _compare(model: nn.Module, x: torch.Tensor, *args: object, fusions: object = None) -> tuple[nn.Module, object]:
    """Fuse a copy (reference backend), run both in training mode in float32, compare outputs, gradients, buffers."""
    torch.manual_seed(0)
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    report = apply_fusions(model, fusions=fusions, backend="reference", warn_if_empty=False)  # type: ignore[arg-type]
    y, ye = model(x, *args), eager(x, *args)
    torch.testing.assert_close(y, ye, atol=1e-5 * max(1.0, float(ye.detach().abs().max())), rtol=1e-5)
    w = torch.randn_like(ye)
    (y * w).sum().backward()
    (ye * w).sum().backward()
    dargs = [t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in args]
    (exact(x.double(), *dargs) * w.double()).sum().backward()
    assert _grad_rel_err(model, eager, exact) <= GRAD_RTOL
    for ba, bb in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(ba, bb, atol=1e-6, rtol=1e-5)  # BN running stats and num_batches_tracked
    model.eval()
    eager.eval()
    with torch.no_grad():
        y, ye = model(x, *args), eager(x, *args)
        torch.testing.assert_close(y, ye, atol=1e-5 * max(1.0, float(ye.abs().max())), rtol=1e-5)
    # state_dict: same keys, strict loads both ways
    assert list(model.state_dict()) == list(eager.state_dict())
    eager.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(eager.state_dict(), strict=True)
    return model, report


# ------------------------------------------------------------------------------------------ containers and convs


class ConvNormAct(nn.Sequential):
    """The layout of torchvision's Conv2dNormActivation: a Sequential subclass that keeps Sequential.forward."""

    def __init__(self, cin: int, cout: int, act: nn.Module | None) -> None:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)]
        super().__init__(*layers, *([act] if act is not None else []))


ACT_MODULES = {
    "relu": lambda: nn.ReLU(inplace=True),
    "relu6": lambda: nn.ReLU6(inplace=True),
    "hardswish": lambda: nn.Hardswish(inplace=True),
    "silu": lambda: nn.SiLU(),
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "none": lambda: None,
}


def test_activation_table_is_complete() -> None:
    assert set(ACT_MODULES) == set(ACTIVATIONS)


@pytest.mark.parametrize("act", sorted(ACT_MODULES))
def test_conv_bn_act_in_a_sequential_subclass(act: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ConvNormAct(3, 6, ACT_MODULES[act]()), ConvNormAct(6, 5, ACT_MODULES[act]()))
    x = torch.randn(4, 3, 7, 9)
    fused, report = _compare(model, x)
    plan = fused[0]._la_plan
    assert plan == {
        0: (3 if act != "none" else 2, {"relu": "conv_bn_relu", "none": "conv_bn"}.get(act, f"conv_bn_{act}"))
    }
    assert report.coverage() == 1.0 and report.coverage_by_kind() == {"conv_bn": (2, 2)}


@pytest.mark.parametrize("shape", [(0, 3, 5, 5), (1, 3, 1, 1)], ids=["empty", "one_value_per_channel"])
def test_conv_bn_act_batch_edge_cases_as_eager(shape: tuple[int, int, int, int]) -> None:
    """An empty batch: empty output, zero gradients, running statistics untouched, one more batch tracked. One value
    per channel in training: eager's ValueError. The fused forward (reference backend) does what eager does."""
    torch.manual_seed(0)
    model = nn.Sequential(ConvNormAct(3, 4, nn.ReLU(inplace=True)))
    eager = copy.deepcopy(model)
    apply_fusions(model, backend="reference", warn_if_empty=False)
    x = torch.randn(shape)
    if shape[0] == 0:
        y, ye = model(x), eager(x)
        assert y.shape == ye.shape == (0, 4, 5, 5)
        y.sum().backward()
        ye.sum().backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad)
    else:
        with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
            eager(x)
        with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
            model(x)
    for ba, bb in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(ba, bb)  # running statistics and num_batches_tracked


class MLPLike(nn.Sequential):
    """The layout of torchvision's MLPBlock: Linear, GELU, Dropout, Linear, Dropout."""

    def __init__(self, d: int, h: int, p: float, act: nn.Module) -> None:
        super().__init__(nn.Linear(d, h), act, nn.Dropout(p), nn.Linear(h, d), nn.Dropout(p))


@pytest.mark.parametrize("act", ["relu", "hardswish", "silu", "gelu", "gelu_tanh"])
def test_linear_act_dropout_chain(act: str) -> None:
    torch.manual_seed(0)
    model = _no_dropout(MLPLike(8, 16, 0.1, ACT_MODULES[act]()))
    fused, report = _compare(model, torch.randn(3, 5, 8))
    assert fused._la_plan == {0: (3, f"linear_{act}_dropout"), 3: (2, "linear_dropout")}
    assert report.coverage_by_kind() == {"linear": (2, 2)}


def test_linear_act_without_dropout_and_lone_linears_are_not_eligible() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.Linear(4, 4))
    report = apply_fusions(model, warn_if_empty=False)
    assert model._la_plan == {0: (2, "linear_silu")}
    assert [(c.module, c.kind, c.fused) for c in report.candidates] == [("0", "linear", True)]


def test_train_mode_dropout_semantics_in_a_chain() -> None:
    torch.manual_seed(0)
    model = MLPLike(64, 256, 0.5, nn.ReLU())
    eager = copy.deepcopy(model)
    apply_fusions(model, backend="reference")
    x = torch.randn(32, 64)
    h = model[0]
    with torch.no_grad():
        pre = torch.relu(h(x))
        dropped = nn.Sequential(*list(model)[:3])(x)  # the fused group [0:3] alone
    kept = dropped != 0
    alive = pre != 0
    rate = (kept & alive).sum() / alive.sum()
    assert 0.45 < float(rate) < 0.55  # keep probability 1 - p
    torch.testing.assert_close(dropped[kept], 2 * pre[kept])  # kept values scaled by 1 / (1 - p)
    a, b = model(x), model(x)
    assert not torch.equal(a, b)  # a fresh mask per call
    model.eval()
    eager.eval()
    torch.testing.assert_close(model(x), eager(x))  # eval: no dropout


def test_a_sequential_claimed_by_a_block_is_not_refused_twice() -> None:
    from lightning_accel.models import GPTBlock

    block = GPTBlock(16, 2, dropout=0.0)
    report = apply_fusions(block, backend="reference")
    assert report.coverage() == 1.0, report.table()
    assert not fm.is_fused(block.mlp)


# -------------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal"])
def test_multihead_attention(batch_first: bool, mask: str) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    x = torch.randn(3, 5, 16) if batch_first else torch.randn(5, 3, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    masks = {"none": None, "bool": causal.isinf(), "float": causal, "causal": causal}

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False, attn_mask=masks[mask], is_causal=mask == "causal")[0]

    fused, report = _compare(Wrap(), x)
    assert fm.is_fused(fused.attn, fm.FusedMultiheadAttentionMixin)
    assert report.counts() == {"attention": 1}


def test_multihead_attention_other_calls_run_the_eager_forward() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    eager = copy.deepcopy(mha)
    apply_fusions(mha, backend="reference")
    x, kv = torch.randn(2, 4, 8), torch.randn(2, 6, 8)
    kpm = torch.tensor([[False] * 4, [False, False, True, True]])
    for args, kwargs in (
        ((x, x, x), {}),
        ((x, kv, kv), {"need_weights": False}),
        ((x, x, x), {"key_padding_mask": kpm}),
    ):
        a, b = mha(*args, **kwargs), eager(*args, **kwargs)
        torch.testing.assert_close(a[0], b[0])
        assert (a[1] is None) == (b[1] is None)


def test_unsupported_multihead_attention_is_skipped_with_the_reason() -> None:
    model = nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    report = apply_fusions(model, warn_if_empty=False)
    assert not fm.is_fused(model[0])
    assert [c.reason for c in report.skipped()] == ["unsupported configuration: `add_bias_kv=True`"]


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_layer(norm_first: bool, activation: str) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, activation=activation, norm_first=norm_first)
    model = _no_dropout(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    fused, report = _compare(model, torch.randn(6, 3, 16), mask)
    assert all(fm.is_fused(m, fm.FusedTransformerEncoderLayerMixin) for m in fused.layers)
    assert report.coverage() == 1.0, report.table()
    assert report.coverage_by_kind() == {"attention": (2, 2), "linear": (2, 2), "norm": (4, 4)}


def test_transformer_encoder_layer_train_mode_dropout_and_padding_fallback() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True)
    eager = copy.deepcopy(layer)
    apply_fusions(layer, backend="reference")
    x = torch.randn(2, 5, 16)
    assert not torch.equal(layer(x), layer(x))  # dropout active in training
    layer.eval()
    eager.eval()
    torch.testing.assert_close(layer(x), eager(x), atol=1e-5, rtol=1e-5)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    torch.testing.assert_close(layer(x, src_key_padding_mask=kpm), eager(x, src_key_padding_mask=kpm))


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_attention_outputs_keep_the_unfused_layout(batch_first: bool) -> None:
    """Fused ``nn.MultiheadAttention`` and encoder layers return a contiguous tensor in the input's layout.
    Sequence-first (torch's default) came back as a transposed view, so ``out.view(-1, E)``, which works on the
    unfused output (a language model flattening its tokens), raised."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=batch_first)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mha = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=batch_first)
    x = torch.randn(5, 3, 16)
    seq, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    mask = nn.Transformer.generate_square_subsequent_mask(seq)
    head_mask = torch.rand(batch * 2, seq, seq) > 0.7  # (B * heads, L, S): the per-head layout of a 3-D mask
    for module, call in (
        (encoder, lambda m: m(x, mask=mask)),
        (encoder, lambda m: m(x, mask=mask, is_causal=True)),
        (mha, lambda m: m(x, x, x, need_weights=False, attn_mask=head_mask)[0]),
    ):
        eager = _no_dropout(copy.deepcopy(module))
        fused = _no_dropout(copy.deepcopy(module))
        apply_fusions(fused, backend="reference")
        out, ref = call(fused), call(eager)
        assert out.is_contiguous()
        torch.testing.assert_close(out.view(-1, 16), ref.reshape(-1, 16), atol=1e-5, rtol=1e-5)


def test_gpt2_block() -> None:
    torch.manual_seed(0)
    model = _no_dropout(nn.Sequential(GPT2Block(16, 2, dropout=0.1), GPT2Block(16, 2, dropout=0.1)))
    fused, report = _compare(model, torch.randn(2, 7, 16))
    assert fm.is_fused(fused[0], fm.FusedGPT2BlockMixin)
    assert fm.is_fused(fused[0].attn, fm.FusedPackedAttentionMixin)
    assert report.coverage() == 1.0, report.table()
    assert report.coverage_by_kind() == {"norm": (4, 4), "attention": (2, 2), "linear": (4, 4)}
    pickle.loads(pickle.dumps(fused))  # the swapped classes pickle


def test_gpt2_block_train_mode_dropout() -> None:
    torch.manual_seed(0)
    block = GPT2Block(16, 2, dropout=0.5)
    apply_fusions(block, backend="reference")
    x = torch.randn(2, 7, 16)
    assert not torch.equal(block(x), block(x))
    block.eval()
    torch.testing.assert_close(block(x), block(x))


class _Wrapped(nn.Module):
    """A wrapper put around a Linear after surgery, as an adapter (LoRA) is: the Linear's weights, another forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


# (block, path of the child's parent, child name, replacement): children a fused forward reads instead of calling
_REPLACED_AFTER_SURGERY = [
    ("gpt", "mlp", "1", nn.Tanh),
    ("gpt", "mlp", "2", _Wrapped),
    ("gpt", "mlp", "3", nn.Identity),
    ("gpt", "mlp", "", nn.Tanh),  # appended
    ("gpt", "attn", "proj", _Wrapped),
    ("gpt", "attn", "resid_dropout", nn.Identity),
    ("gpt2", "mlp", "act", nn.Tanh),
    ("gpt2", "mlp", "c_fc", _Wrapped),
    ("gpt2", "mlp", "dropout", nn.Identity),
    ("gpt2", "attn", "c_proj", _Wrapped),
    ("gpt2", "attn", "resid_dropout", nn.Identity),
    ("encoder", "", "dropout", nn.Identity),
    ("encoder", "", "dropout1", nn.Identity),
    ("encoder", "", "dropout2", nn.Identity),
]


@pytest.mark.parametrize(
    ("block", "parent", "child", "new"),
    _REPLACED_AFTER_SURGERY,
    ids=[f"{b}-{p}.{c or 'append'}-{n.__name__}" for b, p, c, n in _REPLACED_AFTER_SURGERY],
)
def test_a_transformer_block_whose_child_is_replaced_after_surgery_runs_as_unfused(
    block: str, parent: str, child: str, new: type[nn.Module]
) -> None:
    """A fused block reads its children's ``weight`` / ``p``: a Linear wrapped (or a Dropout swapped for an Identity)
    after surgery raised AttributeError, and a GPT-2 MLP activation replaced by another kind was silently dropped."""
    torch.manual_seed(0)
    makers = {
        "gpt": lambda: GPTBlock(16, 2, dropout=0.0),
        "gpt2": lambda: GPT2Block(16, 2, dropout=0.0),
        "encoder": lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
    }
    eager = makers[block]().eval()
    fused = copy.deepcopy(eager)
    assert apply_fusions(fused, backend="reference").records
    for model in (eager, fused):
        owner = model.get_submodule(parent)
        if child:
            setattr(owner, child, new(getattr(owner, child)) if new is _Wrapped else new())
        else:
            cast(nn.Sequential, owner).append(new())
    assert fm.is_fused(fused)  # still the swapped class: its forward decides, call by call
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x))


class UserAttention(nn.Module):
    """An unregistered GPT-2 style attention (the same layout as the demo's, defined here)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.n_head = 2
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = (t.view(b, s, 2, c // 2).transpose(1, 2) for t in self.c_attn(x).split(c, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, s, c)))


class UserMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc, self.act, self.c_proj, self.dropout = (
            nn.Linear(d, 4 * d),
            nn.GELU(),
            nn.Linear(4 * d, d),
            nn.Dropout(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class UserBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), UserAttention(d), nn.LayerNorm(d), UserMLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def test_unregistered_blocks_are_reported_with_how_to_register() -> None:
    report = apply_fusions(UserBlock(8), warn_if_empty=False)
    why = {c.module: c.reason for c in report.skipped()}
    assert set(why) == {"attn", "mlp.c_fc", "mlp.c_proj"}
    assert "register_block" in why["attn"] and "FusedPackedAttentionMixin" in why["attn"]
    assert "FusedGPT2BlockMixin" in why["mlp.c_fc"] and "UserMLP" in why["mlp.c_fc"]
    assert report.coverage() == pytest.approx(2 / 5)
    table = report.table()
    assert "coverage: 2/5 eligible modules fused" in table and "| skipped | kind | class | why |" in table


# ---------------------------------------------------------------------------------------- reasons and registry


def test_skip_reasons_for_selection_and_ignore() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.LayerNorm(4), nn.Linear(4, 4), nn.Dropout())
    report = apply_fusions(copy.deepcopy(model), fusions=["norm"], warn_if_empty=False)
    why = {c.module: c.reason for c in report.skipped()}
    assert "pattern `conv_bn_relu` not selected" in why["0"] and "pattern `linear_dropout` not selected" in why["3"]
    report = apply_fusions(copy.deepcopy(model), ignore_modules=["2"], warn_if_empty=False)
    assert {c.module: c.reason for c in report.skipped()} == {"2": "ignored (`ignore_modules`)"}


def test_eligible_kinds() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1), nn.Flatten(), nn.Linear(4, 4), nn.Tanh(),
        nn.Linear(4, 4), nn.LayerNorm(4), nn.MultiheadAttention(4, 1),
    )  # fmt: skip
    kinds = {path: kind for path, _, kind in eligible_modules(model)}
    # the lone conv and the last Linear are not chains; Tanh is an activation, though not a fused kind
    assert kinds == {"0": "conv_bn", "4": "linear", "7": "norm", "8": "attention"}
    report = apply_fusions(model, warn_if_empty=False)
    assert [c.module for c in report.skipped()] == ["4"]


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FusedTwoLinears(fm.FusedBlockMixin):
    fused_children = ("fc1",)
    fc1: nn.Linear
    fc2: nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lightning_accel.ops import linear_dropout

        h = linear_dropout(x, self.fc1.weight, self.fc1.bias, activation="relu", backend=self._la_backend)
        return self.fc2(h)


def test_register_a_block_replacement_of_your_own() -> None:
    before = apply_fusions(TwoLinears(), warn_if_empty=False)
    assert "FusedBlockMixin subclass" in before.skipped()[0].reason
    register_block(TwoLinears, FusedTwoLinears)
    assert fm.registered_blocks()[fm.qualname(TwoLinears)] is FusedTwoLinears
    torch.manual_seed(0)
    fused, report = _compare(TwoLinears(), torch.randn(3, 4))
    assert report.counts() == {"block": 1} and report.coverage() == 1.0
    assert len(apply_fusions(fused, warn_if_empty=False)) == 0  # idempotent


def test_register_block_refuses_other_classes() -> None:
    with pytest.raises(ValueError, match="subclass of FusedBlockMixin"):
        register_block(TwoLinears, fm.FusedSequentialMixin)
    with pytest.raises(ValueError, match="subclass of FusedBlockMixin"):
        register_block(TwoLinears, fm.FusedBlockMixin)


# --------------------------------------------------------------------------------------------- real model layouts


def test_torchvision_zoo_coverage_and_numerics() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    mobilenet = _no_dropout(torchvision.models.mobilenet_v3_small(weights=None))
    _, report = _compare(mobilenet, torch.randn(4, 3, 64, 64))  # 2 x 2 maps at the end: batch statistics of 16
    assert report.coverage() == 1.0 and report.coverage_by_kind() == {"conv_bn": (34, 34), "linear": (1, 1)}
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    nn.init.normal_(vit.heads.head.weight, std=0.02)
    _, report = _compare(vit, torch.randn(2, 3, 32, 32))
    assert report.coverage() == 1.0 and report.coverage_by_kind() == {
        "norm": (5, 5),
        "attention": (2, 2),
        "linear": (4, 4),
    }
    report = apply_fusions(torchvision.models.resnet18(weights=None), warn_if_empty=False)
    assert report.coverage_by_kind() == {"conv_bn": (20, 20)}


@pytest.mark.parametrize("which", ["encoder_layer", "gpt2_block", "conv_norm_act", "mha"])
def test_fused_modules_compile_without_graph_breaks(which: str) -> None:
    """``torch.compile(fullgraph=True)`` raises on a graph break; the eager backend traces without a C++ compiler."""
    torch.manual_seed(0)
    models = {
        "encoder_layer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), (2, 5, 16)),
        "gpt2_block": (lambda: GPT2Block(16, 2, dropout=0.1), (2, 5, 16)),
        "conv_norm_act": (lambda: ConvNormAct(3, 4, nn.Hardswish()), (2, 3, 6, 6)),
        "mha": (lambda: MHASelf(), (2, 5, 16)),
    }
    build, shape = models[which]
    model = _no_dropout(build())
    eager = copy.deepcopy(model)
    apply_fusions(model, backend="reference")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = torch.randn(*shape)
    torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-5)


class MHASelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]
