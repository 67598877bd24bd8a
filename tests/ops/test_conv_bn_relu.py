"""Conv2d -> BatchNorm2d (-> ReLU): the recomputing function against the three eager modules, running statistics,
eval-mode folding, autocast, saved-memory accounting and gradcheck."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_accel.ops.conv_bn_relu import ConvBNReLUFunction, conv_bn_relu, fold_bn_into_conv, reference
from tests.ops._cases import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    assert_grad_close,
    conv_bn_batch_edge_against_eager,
    leaves,
)

# (N, C_in, H, W), C_out, kernel, stride, padding, groups
CASES = [((3, 5, 9, 7), 6, 3, 2, 1, 1), ((2, 4, 5, 11), 8, 1, 1, 0, 2), ((1, 3, 6, 6), 3, 3, 1, "same", 3)]


def _params(case: tuple, dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, ...]:
    shape, c_out, k, _, _, groups = case
    x = torch.randn(shape).to(dtype)
    fan_in = shape[1] // groups * k * k
    w = (torch.randn(c_out, shape[1] // groups, k, k) / fan_in**0.5).to(dtype)
    b = (torch.randn(c_out) * 0.1).to(dtype) if bias else None
    return x, w, b, torch.rand(c_out) + 0.5, torch.randn(c_out) * 0.1


@pytest.mark.parametrize("case", CASES, ids=["stride2", "grouped1x1", "depthwise_same"])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "no_relu"])
def test_train_forward_backward_and_running_stats(
    case: tuple, dtype: torch.dtype, atol: float, rtol: float, relu: bool
) -> None:
    torch.manual_seed(0)
    _, c_out, _, stride, padding, groups = case
    x, w, b, g, be = _params(case, dtype, bias=True)
    stats = (torch.zeros(c_out), torch.ones(c_out))
    stats_ref = (torch.zeros(c_out), torch.ones(c_out))
    xs, ws, bs, gs, bes = leaves(x, w, b, g, be)
    y = conv_bn_relu(
        xs, ws, bs, gs, bes, *stats, True, 0.1, 1e-5, stride, padding, 1, groups, relu, backend="reference"
    )
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, br, gr, ber = leaves(x.float(), w.float(), b.float(), g, be)
    yr = reference.conv_bn_relu(xr, wr, br, gr, ber, *stats_ref, True, 0.1, 1e-5, stride, padding, 1, groups, relu)
    yr.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, yr, atol, rtol)
    for got, exp in [(xs, xr), (ws, wr), (gs, gr), (bes, ber)]:
        assert_grad_close(got.grad, exp.grad, atol, rtol)
    if dtype == torch.float32:  # the conv bias cancels under BN: its gradient is rounding noise in half precision
        assert_close(bs.grad, br.grad, atol * 10, rtol)
    assert_close(stats[0], stats_ref[0], atol, rtol)
    assert_close(stats[1], stats_ref[1], atol, rtol)


@pytest.mark.parametrize("bias", [True, False])
def test_eval_folds_running_stats(bias: bool) -> None:
    torch.manual_seed(0)
    x, w, b, g, be = _params(CASES[0], torch.float32, bias)
    rm, rv = torch.randn(6) * 0.1, torch.rand(6) + 0.5
    y = conv_bn_relu(x, w, b, g, be, rm, rv, False, 0.1, 1e-5, 2, 1, backend="reference")
    yr = reference.conv_bn_relu(x, w, b, g, be, rm, rv, False, 0.1, 1e-5, 2, 1)
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
    wf, bf = fold_bn_into_conv(w, b, g, be, rm, rv, 1e-5)
    assert wf.shape == w.shape and bf.shape == (6,)


def test_saves_less_activation_memory_than_eager() -> None:
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)

    def saved_bytes(fn: object) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()  # type: ignore[operator]
        return sum(seen.values())

    eager = saved_bytes(lambda: torch.relu(bn(conv(x))))
    fused = saved_bytes(
        lambda: conv_bn_relu(
            x,
            conv.weight,
            None,
            bn.weight,
            bn.bias,
            bn.running_mean,
            bn.running_var,
            True,
            0.1,
            1e-5,
            1,
            1,
            backend="reference",
        )
    )
    activation = 4 * 16 * 16 * 16 * 4  # one fp32 conv output
    # eager keeps x, the conv output and the BN/ReLU output; fused keeps x (+ weights and per-channel stats)
    assert eager - fused >= 2 * activation - 1024


def test_autocast_runs_conv_in_bf16_and_statistics_in_fp32() -> None:
    torch.manual_seed(0)
    x, w, _, g, be = _params(CASES[0], torch.float32, bias=False)
    ws = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv_bn_relu(x, ws, None, g, be, None, None, True, 0.1, 1e-5, 2, 1, backend="reference")
    assert y.dtype == torch.bfloat16
    yr = reference.conv_bn_relu(x, w, None, g, be, None, None, True, 0.1, 1e-5, 2, 1)
    assert_close(y, yr, 5e-2, 5e-2)  # bf16 inputs to the conv
    y.float().sum().backward()
    assert ws.grad is not None and ws.grad.dtype == torch.float32


@pytest.mark.parametrize("relu", [True, False])
def test_gradcheck_float64(relu: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, dtype=torch.float64, requires_grad=True)
    be = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def fn(*args: torch.Tensor) -> torch.Tensor:
        return ConvBNReLUFunction.apply(*args, None, None, 0.1, 1e-5, (1, 1, 1, 1), relu)

    assert torch.autograd.gradcheck(fn, (x, w, b, g, be))


def test_auto_is_eager_on_cpu_and_eager_matches() -> None:
    torch.manual_seed(0)
    x, w, b, g, be = _params(CASES[0], torch.float32, bias=True)
    ws = w.clone().requires_grad_()
    y = conv_bn_relu(x, ws, b, g, be, None, None, True, 0.1, 1e-5, 2, 1)  # auto, CPU tensors
    yr = reference.conv_bn_relu(x, w, b, g, be, None, None, True, 0.1, 1e-5, 2, 1)
    torch.testing.assert_close(y, yr)
    assert y.grad_fn is not None and "ConvBNReLU" not in type(y.grad_fn).__name__


def test_bad_input_rank() -> None:
    with pytest.raises(ValueError, match="`x` must be a 4-D"):
        conv_bn_relu(torch.randn(3, 4, 5), torch.randn(2, 4, 1, 1), None, None, None, None, None, True, 0.1, 1e-5)


# an empty batch (eager: empty output, zero gradients, running statistics untouched) and one value per channel after
# the conv (eager: ValueError "Expected more than 1 value per channel when training")
EDGE_BATCHES = [((0, 3, 5, 5), 1), ((0, 3, 5, 5), "same"), ((1, 3, 1, 1), 1), ((1, 3, 1, 1), "same")]
EDGE_IDS = ["empty", "empty_same", "one_value", "one_value_same"]


@pytest.mark.parametrize(("shape", "padding"), EDGE_BATCHES, ids=EDGE_IDS)
@pytest.mark.parametrize("backend", ["auto", "eager", "reference"])
def test_batch_edge_cases_match_eager(backend: str, shape: tuple[int, int, int, int], padding: int | str) -> None:
    conv_bn_batch_edge_against_eager(backend, shape, padding)


def test_empty_batch_through_the_function_warns_nothing_and_keeps_running_stats() -> None:
    x, w = torch.randn(0, 2, 4, 4, requires_grad=True), torch.randn(3, 2, 3, 3, requires_grad=True)
    rm, rv = torch.full((3,), 0.5), torch.full((3,), 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a variance over no values warns in torch
        y = ConvBNReLUFunction.apply(x, w, None, None, None, rm, rv, 0.1, 1e-5, (1, 1, 1, 1), True)
        y.sum().backward()
    assert y.shape == (0, 3, 4, 4)
    assert w.grad is not None and not w.grad.any()
    torch.testing.assert_close(rm, torch.full((3,), 0.5))
    torch.testing.assert_close(rv, torch.full((3,), 2.0))


# kernel, dilation, padding: odd and even effective kernels ("same" pads one more on the right/bottom for an even one)
STRING_PADDINGS = [((3, 3), 1, "same"), ((2, 4), 1, "same"), ((2, 3), (3, 2), "same"), ((3, 2), 1, "valid")]


@pytest.mark.parametrize(("kernel", "dilation", "padding"), STRING_PADDINGS, ids=["odd", "even", "dilated", "valid"])
def test_string_padding_gradients_match_eager(kernel: tuple[int, int], dilation: object, padding: str) -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 7, 6), torch.randn(4, 3, *kernel) / 4, torch.randn(4) * 0.1
    g, be = torch.rand(4) + 0.5, torch.randn(4) * 0.1
    xs, ws, bs, gs, bes = leaves(x, w, b, g, be)
    xr, wr, br, gr, ber = leaves(x, w, b, g, be)
    args = (None, None, True, 0.1, 1e-5, 1, padding, dilation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns once that an even "same" kernel pads a copy of the input
        y = conv_bn_relu(xs, ws, bs, gs, bes, *args, backend="reference")  # type: ignore[arg-type]
        yr = reference.conv_bn_relu(xr, wr, br, gr, ber, *args)  # type: ignore[arg-type]
        dy = torch.randn_like(yr)
        y.backward(dy)
        yr.backward(dy)
    torch.testing.assert_close(y, yr)
    for got, want in ((xs, xr), (ws, wr), (bs, br), (gs, gr), (bes, ber)):
        assert_grad_close(got.grad, want.grad, 1e-5, 1e-5)


def test_same_padding_compiles_into_one_graph() -> None:
    """``torch.compile(fullgraph=True)`` raises on a graph break, and Dynamo traces an autograd.Function's backward
    with its forward: the backward used to call ``torch.autograd.grad`` for a string padding, which it cannot trace."""
    torch.manual_seed(0)
    w, g, be = torch.randn(4, 3, 3, 3, requires_grad=True), torch.rand(4) + 0.5, torch.randn(4)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return conv_bn_relu(x, w, None, g, be, None, None, True, 0.1, 1e-5, 1, "same", backend="reference")

    x = torch.randn(2, 3, 5, 5)
    y = torch.compile(fused, fullgraph=True, backend="eager")(x)
    y.sum().backward()
    compiled_grad, w.grad = w.grad, None
    fused(x).sum().backward()
    torch.testing.assert_close(y, fused(x))
    torch.testing.assert_close(compiled_grad, w.grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["bn_weight", "bn_bias", "running_mean", "running_var"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_batch_norm_vectors_of_another_shape_refused(name: str, backend: str) -> None:
    """Eager ``F.batch_norm`` refuses them; the torch path used to broadcast a (1,) one (the folded eval path too)."""
    vectors = {"bn_weight": torch.ones(5), "bn_bias": torch.zeros(5), "running_mean": None, "running_var": None}
    vectors[name] = torch.ones(1)
    if name.startswith("running"):
        vectors["running_mean" if name == "running_var" else "running_var"] = torch.ones(5)
    for training in (True, False):
        with pytest.raises(ValueError, match=rf"^`{name}` must have one value per output channel .*\(5,\), got \(1,\)"):
            conv_bn_relu(
                torch.randn(2, 3, 4, 4), torch.randn(5, 3, 3, 3), None, *vectors.values(), training, 0.1, 1e-5,
                backend=backend,  # type: ignore[arg-type]
            )  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_momentum_none_with_running_statistics_is_one_clear_error(backend: str) -> None:
    """``nn.BatchNorm2d(momentum=None)`` spelled into the function: a TypeError naming `momentum` and the fix, not an
    arithmetic error from inside the running-statistics update."""
    x, w = torch.randn(2, 3, 4, 4), torch.randn(4, 3, 3, 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    with pytest.raises(TypeError, match=r"`momentum` must be a finite number, got None.*num_batches_tracked"):
        conv_bn_relu(x, w, None, None, None, rm, rv, True, None, 1e-5, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(rm, torch.zeros(4))  # nothing was updated before the error


@pytest.mark.parametrize("backend", ["eager", "reference", "auto"])
def test_eval_without_running_statistics_uses_batch_statistics_on_every_backend(backend: str) -> None:
    """``nn.BatchNorm2d(track_running_stats=False).eval()`` normalises with the batch; so does the function on every
    backend (the eager one raised ``running_mean must be defined in evaluation mode``)."""
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4, track_running_stats=False).eval()
    x = torch.randn(2, 3, 6, 6)
    want = torch.relu(bn(conv(x)))
    got = conv_bn_relu(x, conv.weight, None, bn.weight, bn.bias, None, None, False, 0.1, bn.eps, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want)


def test_bf16_eval_fold_rounds_once() -> None:
    """A bfloat16 model's eval-mode fold is computed in float32 and rounded to bfloat16 once: rounding the batch-norm
    scale first and the product again was 1 % off the unfused module on large scales."""
    torch.manual_seed(0)
    w = torch.randn(32, 16, 3, 3).bfloat16()
    g, be = (torch.rand(32) * 3 + 0.5).bfloat16(), torch.randn(32).bfloat16()
    rm, rv = torch.randn(32).bfloat16(), (torch.rand(32) * 0.01 + 0.01).bfloat16()
    wf, bf = fold_bn_into_conv(w, None, g, be, rm, rv, 1e-5)
    scale = torch.rsqrt(rv.float() + 1e-5) * g.float()
    assert wf.dtype == bf.dtype == torch.bfloat16
    assert torch.equal(wf, (w.float() * scale[:, None, None, None]).bfloat16())
    assert torch.equal(bf, (be.float() - rm.float() * scale).bfloat16())
    # and the fused eval forward of the bf16 model is as close to the exact result as the unfused bf16 modules
    conv, bn = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32)
    with torch.no_grad():
        conv.weight.copy_(w.float())
        bn.weight.copy_(g.float())
        bn.bias.copy_(be.float())
        bn.running_mean.copy_(rm.float())  # type: ignore[union-attr]
        bn.running_var.copy_(rv.float())  # type: ignore[union-attr]
        x = torch.randn(4, 16, 8, 8).bfloat16()
        exact = bn.eval()(conv(x.float()))
        conv, bn = conv.bfloat16(), bn.bfloat16()
        unfused = bn(conv(x)).float()
        fused = conv_bn_relu(
            x, conv.weight, None, bn.weight, bn.bias, bn.running_mean, bn.running_var, False, 0.1, 1e-5, 1, 1,
            relu=False, backend="reference",
        ).float()  # fmt: skip
    err = (fused - exact).norm() / exact.norm()
    assert err <= 1.5 * (unfused - exact).norm() / exact.norm(), err


@pytest.mark.parametrize("given", ["running_mean", "running_var"])
@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_one_running_statistic_without_the_other_is_refused(given: str, backend: str, training: bool) -> None:
    """``F.batch_norm`` refuses one running buffer without the other; the fused function used to ignore the one given
    (no update in training, batch statistics in eval) without a word."""
    stats = {"running_mean": None, "running_var": None}
    stats[given] = torch.zeros(4) if given == "running_mean" else torch.ones(4)
    before = stats[given].clone()  # type: ignore[union-attr]
    missing = "running_var" if given == "running_mean" else "running_mean"
    with pytest.raises(ValueError, match=rf"^`running_mean` and `running_var` must both be tensors or both be None, "
                       rf"got `{missing}`=None\..*BatchNorm2d"):  # fmt: skip
        conv_bn_relu(
            torch.randn(2, 3, 4, 4), torch.randn(4, 3, 3, 3), None, None, None, *stats.values(), training, 0.1,
            1e-5, backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
    torch.testing.assert_close(stats[given], before)
