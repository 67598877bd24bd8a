"""Double backward through the fused autograd Functions: an error, never a silently wrong second derivative.

The hand-written backwards use statistics (mean, 1/std), a pre-activation and a reshaped input that the forward
computed without autograd, so a graph built from them misses terms; ``create_graph=True`` must raise instead.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_accel.ops import conv_bn_relu, layer_norm, linear_dropout, rms_norm


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return layer_norm(x, torch.ones(x.shape[-1], dtype=x.dtype), None, backend="reference")


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, None, backend="reference")


def _linear_dropout(x: torch.Tensor) -> torch.Tensor:
    w = torch.linspace(-1, 1, 4 * x.shape[-1], dtype=x.dtype).view(4, x.shape[-1])
    return linear_dropout(x, w, None, p=0.25, seed=1, backend="reference")


def _conv_bn_relu(x: torch.Tensor) -> torch.Tensor:
    x4 = x.view(2, 1, 2, x.shape[-1])
    w = torch.linspace(-1, 1, 2 * 9, dtype=x.dtype).view(2, 1, 3, 3)
    return conv_bn_relu(x4, w, None, None, None, None, None, True, 0.1, 1e-5, padding=1, backend="reference")


@pytest.mark.parametrize("op", [_layer_norm, _rms_norm, _linear_dropout, _conv_bn_relu], ids=lambda f: f.__name__)
def test_double_backward_raises_instead_of_a_wrong_result(op: Callable[[torch.Tensor], torch.Tensor]) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(op(x).pow(2).sum(), x, create_graph=True)
    torch.testing.assert_close(g, torch.autograd.grad(op(x).pow(2).sum(), x)[0])  # the first derivative is right
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.pow(2).sum().backward()
