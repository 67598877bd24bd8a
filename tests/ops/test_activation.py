"""The epilogue activations' torch derivative against torch's own autograd, at the kinks included."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.ops.activation import ACTIVATIONS, activation_backward, activation_forward
from lightning_accel.ops.linear_dropout import linear_dropout

# every kink of relu (0), relu6 (0, 6) and hardswish (-3, 3), and values on either side
KINKS = [-6.0, -3.5, -3.0, -2.5, -0.0, 0.0, 0.5, 2.5, 3.0, 3.5, 6.0, 6.5]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_backward_is_torch_autograd_at_the_kinks(act: str, dtype: torch.dtype) -> None:
    z = torch.tensor(KINKS, dtype=dtype, requires_grad=True)
    dy = torch.linspace(0.5, 2.0, len(KINKS), dtype=dtype)
    activation_forward(z, act).backward(dy)  # type: ignore[arg-type]
    got = activation_backward(z.detach(), dy, act)  # type: ignore[arg-type]
    if act in ("relu", "relu6", "hardswish"):  # piecewise: the same branch, so the same bits
        torch.testing.assert_close(got, z.grad, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, z.grad)


@pytest.mark.parametrize("act", ["relu", "relu6", "hardswish"])
def test_fused_linear_bias_grad_at_the_kinks_matches_eager(act: str) -> None:
    """Through the fused function: ``x = 0`` makes the pre-activations exactly the bias, set on the kinks."""
    x = torch.zeros(2, 3)
    w = torch.ones(len(KINKS), 3)
    b_fused = torch.tensor(KINKS, requires_grad=True)
    b_eager = torch.tensor(KINKS, requires_grad=True)
    linear_dropout(x, w, b_fused, backend="reference", activation=act).sum().backward()  # type: ignore[arg-type]
    linear_dropout(x, w, b_eager, backend="eager", activation=act).sum().backward()  # type: ignore[arg-type]
    torch.testing.assert_close(b_fused.grad, b_eager.grad, rtol=0, atol=0)
