"""Unit tests of structured pruning: channel groups, exact removal, optimizer state, reload, refusals."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.models import SmallResNet
from lightning_accel.recipes.channel_groups import find_channel_groups
from lightning_accel.recipes.prune import (
    apply_structured_pruning,
    batch_norms,
    channel_importance,
    count_parameters,
    recalibrate_batchnorm,
    resize_to_state_dict,
    schedule_amounts,
)

X = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def _resnet(seed: int = 0, width: int = 8) -> SmallResNet:
    torch.manual_seed(seed)
    return SmallResNet(width=width, blocks=(1, 1, 1))


def test_groups_of_a_resnet_couple_residual_adds() -> None:
    groups, skipped = find_channel_groups(_resnet(), X)
    by_names = {tuple(sorted(g.names)): g for g in groups}
    assert len(groups) == 7  # stem, 3 block-internal, 3 residual groups
    internal = by_names[("layers.1.conv1",)]
    assert [n for n, _ in internal.followers] == ["layers.1.bn1"]
    assert [n for n, _ in internal.consumers] == ["layers.1.conv2"]
    res = by_names[("layers.0.conv2", "layers.0.downsample.0")]
    assert sorted(n for n, _ in res.followers) == ["layers.0.bn2", "layers.0.downsample.1"]
    assert sorted(n for n, _ in res.consumers) == ["layers.1.conv1", "layers.1.downsample.0"]
    last = by_names[("layers.2.conv2", "layers.2.downsample.0")]
    assert [n for n, _ in last.consumers] == ["fc"]
    assert ("fc", "model output") in skipped  # the logits keep their size


class _KeywordResidual(nn.Module):
    """``conv(x) + x`` spelt with the skip connection as a keyword operand."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        z = self.b(torch.relu(y))
        if self.spelling == "other":
            out = torch.add(z, other=y)
        elif self.spelling == "input+other":
            out = torch.add(input=z, other=y)
        else:
            out = torch.mul(z, other=y)
        return self.head(out)


@pytest.mark.parametrize("spelling", ["other", "input+other", "mul"])
def test_a_residual_given_by_keyword_is_coupled(spelling: str) -> None:
    # `torch.add(z, other=y)`: the keyword operand was not looked at, so `a` and `b` were pruned as two groups with
    # their own indices -- the add then mixed unrelated channels (or, spelt `input=`, the pruned model crashed)
    torch.manual_seed(0)
    model = _KeywordResidual(spelling)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():  # channels 0-3 of the residual stream are exactly zero in both branches
        for conv in (model.a, model.b):
            conv.weight[:4] = 0
            conv.bias[:4] = 0
    expected = model(x)
    groups, _ = find_channel_groups(model, (x,))
    assert [sorted(g.names) for g in groups] == [["a", "b"]]
    apply_structured_pruning(model, 0.5, (x,))
    assert model.a.out_channels == model.b.out_channels == model.head.in_channels == 4
    assert torch.allclose(model(x), expected, atol=1e-6)


def _silence_channels(model: SmallResNet, amount: float) -> None:
    """Make the lowest-index `amount` of every group's channels exactly zero after BatchNorm (eval mode)."""
    groups, _ = find_channel_groups(model, X)
    with torch.no_grad():
        for g in groups:
            dead = torch.arange(int(amount * g.size))
            for _, m in g.producers:
                m.weight[dead] = 0
            for _, bn in g.followers:
                bn.bias[dead] = 0
                bn.running_mean[dead] = 0


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_pruning_silent_channels_is_exact_and_shrinks(norm: str) -> None:
    model = _resnet().eval()
    _silence_channels(model, 0.5)
    with torch.no_grad():
        before_out = model(X)
    before = count_parameters(model)
    result = apply_structured_pruning(model, 0.5, X, norm=norm)
    assert result.params_before == before and result.params_after == count_parameters(model)
    assert result.params_frac < 0.3  # every conv loses half its inputs and/or outputs
    assert model.stem[0].out_channels == 4 and model.stem[1].num_features == 4
    assert model.layers[0].conv1.in_channels == 4 and model.layers[0].downsample[0].in_channels == 4
    assert model.layers[2].bn1.running_var.shape == (16,)
    assert model.fc.in_features == 16 and model.fc.out_features == 10
    with torch.no_grad():
        assert torch.allclose(model(X), before_out, atol=1e-5)  # only the silent channels went


def test_importance_ranks_by_filter_norm() -> None:
    model = _resnet()
    groups, _ = find_channel_groups(model, X)
    g = next(g for g in groups if g.names == ["layers.0.conv1"])
    with torch.no_grad():
        model.layers[0].conv1.weight.mul_(0.01)
        model.layers[0].conv1.weight[3] = 1.0
    assert int(channel_importance(g, "l1").argmax()) == 3
    with pytest.raises(ValueError, match="`norm`"):
        channel_importance(g, "l3")


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_optimizer_is_repointed_and_state_sliced(opt_cls: type) -> None:
    model = _resnet().train()
    opt = opt_cls(model.parameters(), lr=0.01, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {}))
    keep_out = model(X)  # a live graph over the old parameters must not break the next backward
    model(X).sum().backward()
    opt.step()
    old_conv1 = model.layers[1].conv1.weight
    state_key = "exp_avg" if opt_cls is torch.optim.AdamW else "momentum_buffer"
    old_state = opt.state[old_conv1][state_key].clone()
    apply_structured_pruning(model, 0.5, X, optimizers=[opt])
    params = list(model.parameters())
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt_params) == len(params) and all(a is b for a, b in zip(opt_params, params, strict=True))
    for p in params:
        assert opt.state[p][state_key].shape == p.shape
    new_conv1 = model.layers[1].conv1.weight
    assert new_conv1 is not old_conv1 and old_conv1 not in opt.state
    assert opt.state[new_conv1][state_key].shape[0] == old_state.shape[0] // 2
    opt.zero_grad()
    model(X).sum().backward()
    opt.step()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    del keep_out


def test_reload_a_pruned_state_dict_into_a_fresh_model() -> None:
    model = _resnet().eval()
    apply_structured_pruning(model, 0.5, X)
    fresh = _resnet(seed=1).eval()
    resized = resize_to_state_dict(fresh, model.state_dict())
    assert "layers.0.conv1" in resized and "stem.1" in resized
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(X), model(X))


def test_mlp_prunes_hidden_units_only() -> None:
    mlp = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 3))
    apply_structured_pruning(mlp, 0.25, torch.randn(4, 6))
    assert [m.out_features for m in mlp if isinstance(m, nn.Linear)] == [24, 12, 3]
    assert [m.in_features for m in mlp if isinstance(m, nn.Linear)] == [6, 24, 12]
    assert mlp(torch.randn(2, 6)).shape == (2, 3)


def test_optimizer_state_rows_follow_the_kept_units() -> None:
    mlp = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        mlp[0].weight.copy_(torch.tensor([[1.0, 1.0], [0.01, 0.0], [2.0, 2.0], [0.0, 0.02]]))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    mlp(torch.randn(3, 2)).sum().backward()
    opt.step()
    buf0 = opt.state[mlp[0].weight]["momentum_buffer"].clone()
    buf2 = opt.state[mlp[2].weight]["momentum_buffer"].clone()
    apply_structured_pruning(mlp, 0.5, torch.randn(1, 2), optimizers=[opt])
    keep = torch.tensor([0, 2])  # the two large rows
    assert torch.equal(opt.state[mlp[0].weight]["momentum_buffer"], buf0[keep])
    assert torch.equal(opt.state[mlp[2].weight]["momentum_buffer"], buf2[:, keep])


class _Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 3, padding=1)
        self.c = nn.Conv2d(16, 4, 1)
        self.d = nn.Conv2d(4, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.cat([self.a(x), self.b(x)], dim=1))))


def test_unsupported_ops_are_left_alone() -> None:
    m = _Concat()
    result = apply_structured_pruning(m, 0.5, torch.randn(2, 3, 8, 8))
    assert (m.a.out_channels, m.b.out_channels) == (8, 8)  # concatenated: untouched
    assert m.c.out_channels == 2 and m.d.in_channels == 2  # a plain conv -> relu -> conv chain is pruned
    assert any(name == "a" for name, _ in result.skipped)


class _PooledFeatures(nn.Module):
    """fc1 -> relu -> a pooling op over the trailing dims -> fc2; ``conv`` makes fc1 a Conv1d over (B, C, L)."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.conv = pool == "max_pool2d"
        self.fc1 = nn.Conv1d(3, 16, 3, padding=1) if self.conv else nn.Linear(8, 16)
        self.pool = {"MaxPool1d": nn.MaxPool1d(3, 1, 1), "AvgPool1d": nn.AvgPool1d(3, 1, 1)}.get(pool, nn.Identity())
        self.fc2 = nn.Conv1d(16, 4, 1) if self.conv else nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(F.max_pool2d(h, 3, 1, 1) if self.conv else self.pool(h))


@pytest.mark.parametrize(
    ("pool", "shape"),
    [("MaxPool1d", (2, 5, 8)), ("AvgPool1d", (2, 8)), ("max_pool2d", (2, 3, 10))],
    ids=["max-over-features-of-a-sequence", "avg-over-features", "2d-max-over-conv1d-channels-and-length"],
)
def test_a_pooling_op_over_the_channel_dim_keeps_the_group(pool: str, shape: tuple[int, ...]) -> None:
    # the pooling keeps the size (stride 1, padding 1) but mixes neighbouring channels: half of them silent, removing
    # those would change the others' values, so the group must be left alone
    torch.manual_seed(0)
    model = _PooledFeatures(pool).eval()
    with torch.no_grad():
        model.fc1.weight[::2] = 0
        model.fc1.bias[::2] = -5.0  # relu(-5) = 0
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
    with pytest.warns(UserWarning, match="changed nothing"):
        result = apply_structured_pruning(model, 0.5, x)
    assert model.fc1.weight.shape[0] == 16  # unpruned
    assert any(name == "fc1" and "pooled along the channel dim" in reason for name, reason in result.skipped)
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_pooling_over_the_spatial_dims_keeps_the_channels_apart() -> None:
    # the usual case: a conv's (B, C, H, W) pooled over H, W; the silent channels go and nothing else changes
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(3, 1, 1), nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        model[0].weight[::2] = 0
        model[0].bias[::2] = -5.0
        before = model(X)
    apply_structured_pruning(model, 0.5, X)
    assert model[0].out_channels == 4
    with torch.no_grad():
        assert torch.allclose(model(X), before, atol=1e-6)


def _weight_normalised(kind: str, where: str) -> nn.Sequential:
    """fc1 -> relu -> fc2 -> relu -> head, with ``where`` (fc1 or fc2) weight-normalised the ``kind`` way."""
    torch.manual_seed(0)
    layers = {"fc1": nn.Linear(8, 16), "fc2": nn.Linear(16, 16)}
    if kind == "parametrization":
        layers[where] = torch.nn.utils.parametrizations.weight_norm(layers[where])
    elif kind == "spectral":
        layers[where] = torch.nn.utils.parametrizations.spectral_norm(layers[where])
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the hook is deprecated, not removed
            layers[where] = torch.nn.utils.weight_norm(layers[where])
    return nn.Sequential(layers["fc1"], nn.ReLU(), layers["fc2"], nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("where", ["fc1", "fc2"])
@pytest.mark.parametrize("kind", ["parametrization", "spectral", "hook"])
def test_a_layer_whose_weight_is_computed_is_left_alone(kind: str, where: str) -> None:
    net = _weight_normalised(kind, where)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(x).sum().backward()
    opt.step()  # momentum buffers of the full shapes
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # with fc2 computed nothing is prunable, which a warning says
        result = apply_structured_pruning(net, 0.5, x, optimizers=[opt])
    index = 0 if where == "fc1" else 2
    # its weight is recomputed from originals the surgery cannot slice: neither it nor the channels it reads shrink
    assert net[index].weight.shape == (16, 8 if where == "fc1" else 16)
    reasons = [reason for name, reason in result.skipped if name == str(index)]
    assert reasons and "computes its weight (a parametrization" in reasons[0]
    if where == "fc1":
        assert net[2].weight.shape == (8, 16)  # the plain fc2 -> head group is still pruned
    net(x).sum().backward()
    opt.step()  # the optimizer state still matches every parameter


def test_nothing_to_prune_warns() -> None:
    with pytest.warns(UserWarning, match="changed nothing"):
        apply_structured_pruning(nn.Linear(4, 2), 0.5, torch.randn(1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_structured_pruning(_resnet(), 0.0, X)  # amount 0: nothing asked, nothing said


@pytest.mark.parametrize(
    ("bad", "kind"), [(1.0, ValueError), (-0.1, ValueError), (1.5, ValueError), ("0.5", TypeError), (True, TypeError)]
)
def test_bad_amount_names_the_argument(bad: object, kind: type[Exception]) -> None:
    with pytest.raises(kind, match="`amount` must be a number >= 0 and < 1, got .*fraction of the channels to remove"):
        apply_structured_pruning(_resnet(), bad, X)  # type: ignore[arg-type]


def test_bad_norm_round_to_and_steps() -> None:
    with pytest.raises(ValueError, match="`norm` must be 'l1' or 'l2', got 'l0'"):
        apply_structured_pruning(_resnet(), 0.5, X, norm="l0")
    with pytest.raises(TypeError, match="`round_to` must be an integer >= 1, got True \\(bool\\)"):
        apply_structured_pruning(_resnet(), 0.5, X, round_to=True)
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1, got 0"):
        schedule_amounts(0.5, 0)


def test_untraceable_model_gives_a_clear_error() -> None:
    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(TypeError, match="could not trace"):
        apply_structured_pruning(Dynamic(), 0.5, torch.randn(2, 3))


def test_schedule_amounts_reach_the_total() -> None:
    steps = schedule_amounts(0.5, 3)
    remaining = 1.0
    for i, a in enumerate(steps, 1):
        remaining *= 1 - a
        assert remaining == pytest.approx(1 - 0.5 * i / 3)
    assert schedule_amounts(0.5, 1) == pytest.approx([0.5])


def test_round_to_keeps_multiples() -> None:
    model = _resnet(width=12)
    apply_structured_pruning(model, 0.5, X, round_to=4)
    assert model.layers[0].conv1.out_channels == 8  # 6 rounded up to a multiple of 4


def _bn_inputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Each BatchNorm's input on ``x`` in a train-mode forward (of a copy): what its statistics should describe."""
    probe = copy.deepcopy(model).train()
    norms = batch_norms(probe)
    seen: dict[int, torch.Tensor] = {}
    for m in norms:
        m.register_forward_pre_hook(lambda m, a: seen.__setitem__(norms.index(m), a[0].detach()))
    with torch.no_grad():
        probe(x)
    return [seen[i] for i in range(len(norms))]  # in the order of `batch_norms(model)`


def test_recalibration_gives_the_pruned_network_its_own_statistics() -> None:
    model = _resnet().train()
    with torch.no_grad():
        for _ in range(3):
            model(X * 3 + 1)  # running statistics of the unpruned network, on other data
    apply_structured_pruning(model, 0.5, X)
    norms, inputs = batch_norms(model), _bn_inputs(model, X)
    stale = [bn for bn, x in zip(norms, inputs, strict=True) if not torch.allclose(bn.running_mean, x.mean((0, 2, 3)))]
    assert len(stale) == len(inputs) == 10  # sliced statistics of the unpruned network, on other data
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    model.train()
    assert recalibrate_batchnorm(model, [(X, torch.zeros(3))]) == 1
    for bn, x in zip(norms, _bn_inputs(model, X), strict=True):  # each norm's input as the pruned net computes it
        assert torch.allclose(bn.running_mean, x.mean((0, 2, 3)), atol=1e-5)
        assert torch.allclose(bn.running_var, x.var((0, 2, 3), unbiased=True), rtol=1e-4, atol=1e-5)
        assert bn.momentum == 0.1 and bn.training  # momentum and mode restored
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())  # parameters untouched
    with pytest.raises(ValueError, match="`batches` is empty"):
        recalibrate_batchnorm(model, [])


def test_recalibration_averages_batches_and_keeps_modes() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2)).train()
    a, b = torch.randn(8, 4), torch.randn(8, 4) + 2
    recalibrate_batchnorm(model, [a, b])
    with torch.no_grad():
        ha, hb = model[0](a), model[0](b)
    assert torch.allclose(model[1].running_mean, (ha.mean(0) + hb.mean(0)) / 2, atol=1e-6)
    assert torch.allclose(model[1].running_var, (ha.var(0) + hb.var(0)) / 2, atol=1e-5)
    assert int(model[1].num_batches_tracked) == 2
    assert all(m.training for m in model.modules())  # train mode restored


def test_folded_importance_ranks_by_the_normalised_output() -> None:
    model = _resnet()
    groups, _ = find_channel_groups(model, X)
    g = next(g for g in groups if g.names == ["layers.0.conv1"])
    assert g.normalized["layers.0.conv1"] is model.layers[0].bn1
    res = next(g for g in groups if "layers.0.downsample.0" in g.names)
    assert res.normalized == {
        "layers.0.conv2": model.layers[0].bn2,
        "layers.0.downsample.0": model.layers[0].downsample[1],
    }
    with torch.no_grad():
        model.layers[0].conv1.weight[2].mul_(10.0)  # the largest filter ...
        model.layers[0].bn1.weight[2] = 1e-3  # ... whose output the norm scales to almost nothing
        model.layers[0].bn1.weight[5] = 5.0
    assert int(channel_importance(g, "l1", fold_bn=False).argmax()) == 2
    folded = channel_importance(g, "l1", fold_bn=True)
    assert int(folded.argmax()) == 5 and int(folded.argmin()) == 2


def test_ignore_modules_takes_one_name_as_a_string_and_refuses_names_the_model_lacks() -> None:
    model = _resnet()
    as_str = find_channel_groups(model, X, ignore_modules="layers.1.conv1")  # one name, not its characters
    assert as_str[1] == find_channel_groups(model, X, ignore_modules=["layers.1.conv1"])[1]
    assert ("layers.1.conv1", "ignored") in as_str[1]
    before = [p.shape for p in model.parameters()]
    with pytest.raises(
        ValueError, match=r"`ignore_modules` names modules that SmallResNet does not have: \['layers.1.conv_1'\]"
    ):
        apply_structured_pruning(model, 0.5, X, ignore_modules=["layers.1.conv1", "layers.1.conv_1"])
    assert [p.shape for p in model.parameters()] == before  # refused before anything was pruned
    with pytest.raises(TypeError, match=r"`ignore_modules` must hold module names \(strings\), got 3 \(int\)"):
        find_channel_groups(model, X, ignore_modules=[3])


def test_ignore_modules_keeps_a_layer_and_the_old_spelling_still_works() -> None:
    model = _resnet()
    groups, skipped = find_channel_groups(model, X, ignore_modules=["layers.1.conv1"])
    assert ("layers.1.conv1", "ignored") in skipped
    assert all("layers.1.conv1" not in g.names for g in groups)
    with pytest.warns(DeprecationWarning, match="`ignore` is deprecated; use `ignore_modules` \\(same values\\)"):
        old = find_channel_groups(model, X, ignore=["layers.1.conv1"])
    assert old[1] == skipped
    before = model.layers[1].conv1.out_channels
    with pytest.warns(DeprecationWarning, match="use `ignore_modules`"):
        apply_structured_pruning(model, 0.5, X, ignore=["layers.1.conv1"])
    assert model.layers[1].conv1.out_channels == before
    with pytest.raises(
        ValueError, match="`ignore` is the deprecated name of `ignore_modules`: pass only `ignore_modules`"
    ):
        apply_structured_pruning(model, 0.5, X, ignore_modules=["stem"], ignore=["stem"])
