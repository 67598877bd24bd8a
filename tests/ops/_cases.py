"""Shared parameters and checks of the op tests: the (dtype, atol, rtol) table, odd shapes, eager batch edge cases."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_accel.ops.conv_bn_relu import conv_bn_relu

# fp16/bf16 results are compared with a float32 computation on the *same* low-precision inputs
DTYPES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    """Compare in float32 with the table's tolerances (dtypes may differ: the oracle runs in float32)."""
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Fresh leaf copies that require grad (None stays None)."""
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def assert_grad_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, factor: float = 10.0
) -> None:
    """Gradients that are reductions (GEMM inputs, weights, BN): absolute tolerance ``factor * atol`` scaled by the
    tensor's largest magnitude, since a sum of rounded low-precision products is only as exact as its largest terms."""
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    assert_close(actual, expected, factor * atol * scale, rtol)


def conv_bn_batch_edge_against_eager(backend: str, shape: tuple[int, int, int, int], padding: int | str) -> None:
    """Conv2d(k=3) + BatchNorm2d + ReLU in training through ``conv_bn_relu(backend=...)`` against the eager modules on
    a batch eager treats specially (empty, or one value per channel): the same exception (type, eager's message
    first), or the same output, gradients and running statistics."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(shape[1], 4, 3, padding=padding), nn.BatchNorm2d(4)
    with torch.no_grad():  # running statistics an update would visibly move
        bn.running_mean.fill_(0.5)
        bn.running_var.fill_(2.0)
    x = torch.randn(shape)
    xe, xf = leaves(x, x)
    w, b, g, be = leaves(conv.weight, conv.bias, bn.weight, bn.bias)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    eager_error: Exception | None = None
    try:
        ye = torch.relu(bn(conv(xe)))
    except Exception as err:  # noqa: BLE001 - whatever eager raises, the fused path must raise too
        eager_error = err
    args = (xf, w, b, g, be, rm, rv, True, 0.1, bn.eps, 1, padding)
    if eager_error is not None:
        with pytest.raises(type(eager_error)) as info:
            conv_bn_relu(*args, backend=backend)  # type: ignore[arg-type]
        assert str(info.value).startswith(str(eager_error)), str(info.value)
        return
    y = conv_bn_relu(*args, backend=backend)  # type: ignore[arg-type]
    assert y.shape == ye.shape and y.dtype == ye.dtype
    torch.testing.assert_close(y, ye)
    dy = torch.randn_like(ye)
    ye.backward(dy)
    y.backward(dy)
    for got, want in ((xf, xe), (w, conv.weight), (b, conv.bias), (g, bn.weight), (be, bn.bias)):
        assert got is not None and want is not None and got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad)
    torch.testing.assert_close(rm, bn.running_mean)
    torch.testing.assert_close(rv, bn.running_var)


def flop_model() -> nn.Sequential:
    """A small model with every fusion the ops serve: Conv2d + BatchNorm2d + ReLU, Linear + GELU + Dropout (with its
    GEMM), LayerNorm and a plain Linear, for (2, 3, 6, 6) inputs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8), nn.GELU(), nn.Dropout(0.2), nn.LayerNorm(8), nn.Linear(8, 3),
    )  # fmt: skip


def step_flops(fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    """``{op name: FLOPs}`` that ``FlopCounterMode`` counts for ``fn()`` and the backward of its sum."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as mode:
        fn().float().sum().backward()
    return {str(op): int(n) for op, n in mode.get_flop_counts().get("Global", {}).items() if n}


def matmul_conv_flops(counts: dict[str, int]) -> tuple[int, int]:
    """``(GEMM FLOPs, convolution FLOPs)`` of :func:`step_flops`'s counts (``mm`` and ``addmm`` count the same
    products; so does a fused op that reports them)."""
    conv = sum(n for op, n in counts.items() if "conv" in op)
    return sum(counts.values()) - conv, conv
