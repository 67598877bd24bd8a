"""FLOPs that ``torch.utils.flop_counter.FlopCounterMode`` (hence ``PerformanceMonitor``'s MFU) counts for the fused
ops: the model's matmul and convolution FLOPs, forward and backward, the same as for the eager modules they replace.

The Triton paths are checked under the interpreter in ``interp_kernels.py``; here the fused functions' torch path.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_accel.ops import conv_bn_relu, layer_norm, linear_dropout, rms_norm
from lightning_accel.precision.surgery import apply_fusions
from tests.ops._cases import flop_model, matmul_conv_flops, step_flops


@pytest.mark.parametrize("padding", [1, "same", "valid"])
@pytest.mark.parametrize("needs_x", [True, False], ids=["x_grad", "no_x_grad"])
def test_conv_bn_relu_counts_the_eager_convolution_flops(padding: int | str, needs_x: bool) -> None:
    """The backward's recomputed convolution is work the fusion adds, not model FLOPs: it is not counted."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, requires_grad=needs_x)
    w, b = torch.randn(4, 3, 3, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    g, be = torch.rand(4, requires_grad=True), torch.randn(4, requires_grad=True)

    def run(backend: str) -> torch.Tensor:
        return conv_bn_relu(x, w, b, g, be, None, None, True, 0.1, 1e-5, 1, padding, backend=backend)  # type: ignore[arg-type]

    eager = step_flops(lambda: run("eager"))
    assert matmul_conv_flops(eager)[1] > 0
    assert step_flops(lambda: run("reference")) == eager


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("residual", [False, True])
def test_linear_dropout_counts_the_eager_gemm_flops(activation: str, residual: bool) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 7, requires_grad=True), torch.randn(9, 7, requires_grad=True)
    b, r = torch.randn(9, requires_grad=True), torch.randn(3, 5, 9) if residual else None

    def run(backend: str) -> torch.Tensor:
        return linear_dropout(x, w, b, 0.2, True, r, seed=3, backend=backend, activation=activation)  # type: ignore[arg-type]

    eager = matmul_conv_flops(step_flops(lambda: run("eager")))
    assert eager == (3 * 2 * 3 * 5 * 7 * 9, 0)  # forward, input and weight gradients
    assert matmul_conv_flops(step_flops(lambda: run("reference"))) == eager


def test_norms_count_as_their_eager_ops() -> None:
    """``FlopCounterMode`` has no formula for normalisations, so neither path adds any (nothing is double counted)."""
    x, w, b = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True), torch.zeros(8)
    for backend in ("eager", "reference"):
        assert step_flops(lambda: layer_norm(x, w, b, backend=backend)) == {}  # noqa: B023
        assert step_flops(lambda: rms_norm(x, w, backend=backend)) == {}  # noqa: B023


def test_fused_model_counts_the_unfused_model_flops() -> None:
    """A model fused by surgery (the torch path of every fused op) counts the FLOPs of the same model unfused."""
    model = flop_model()
    fused = copy.deepcopy(model)
    report = apply_fusions(fused, backend="reference")
    assert report.coverage_by_kind() == {"conv_bn": (1, 1), "linear": (1, 1), "norm": (1, 1)}
    x = torch.randn(2, 3, 6, 6)
    torch.manual_seed(1)
    unfused = step_flops(lambda: model(x))
    torch.manual_seed(1)
    counted = step_flops(lambda: fused(x))
    assert matmul_conv_flops(counted) == matmul_conv_flops(unfused)
    assert sum(counted.values()) == sum(unfused.values()) > 0


def test_recomputed_convolution_is_seen_but_counts_zero() -> None:
    """The recompute is an op of its own with a zero formula (visible in the counter's table, adding nothing)."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3, requires_grad=True)
    with FlopCounterMode(display=False) as mode:
        conv_bn_relu(x, w, None, None, None, None, None, True, 0.1, 1e-5, backend="reference").sum().backward()
    ops = {str(op) for op in mode.get_flop_counts()["Global"]}
    assert "lightning_accel.conv2d_recompute" in ops
    assert mode.get_total_flops() == 2 * 2 * 3 * 3 * 3 * 4 * 3 * 3 * 2  # forward + weight gradient, 3x3 outputs
