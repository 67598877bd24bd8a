"""The activations the fused ops apply in their epilogues, in pure torch: the forward and its derivative.

Shared by :mod:`~lightning_accel.ops.conv_bn_relu` and :mod:`~lightning_accel.ops.linear_dropout` (their Triton
kernels use :mod:`.activation_triton`, the same formulas). Each derivative is the one torch's own backward uses, at
the kinks included (``relu``: ``z > 0``; ``relu6``: ``0 < z < 6``; ``hardswish``: ``0`` up to ``-3`` included,
``z / 3 + 0.5`` on ``(-3, 3)``, ``1`` from ``3`` on, as ``aten::hardswish_backward`` does), so a fused gradient
matches eager's bit for bit in the branches.

``module_activation`` names the kind of an activation module (exact classes only: a subclass may compute something
else), so module surgery can tell which ``Conv2d -> BatchNorm2d -> act`` or ``Linear -> act`` chains it may fuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel._utils.checks import check_choice

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "activation_backward",
    "activation_forward",
    "check_activation",
    "function_activation",
    "module_activation",
]

Activation = Literal["none", "relu", "relu6", "hardswish", "silu", "gelu", "gelu_tanh"]
ACTIVATIONS: tuple[Activation, ...] = get_args(Activation)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def check_activation(activation: object, name: str = "activation") -> Activation:
    """``activation`` itself when it is one of :data:`ACTIVATIONS` (``None`` reads as ``"none"``); raises otherwise.

    Args:
        activation: the value to check.
        name: the argument the caller passed it as, named in the error.

    Raises:
        TypeError: not a string.
        ValueError: an unknown name, naming the values expected.
    """
    if activation is None:
        return "none"
    if isinstance(activation, str) and activation in ACTIVATIONS:
        return activation
    check_choice(name, activation, ACTIVATIONS, fix="Use 'none' for no activation.")
    raise AssertionError("unreachable")  # pragma: no cover


def activation_forward(z: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``act(z)``, as the eager module computes it."""
    if activation == "none":
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "relu6":
        return F.relu6(z)
    if activation == "hardswish":
        return F.hardswish(z)
    if activation == "silu":
        return F.silu(z)
    if activation == "gelu":
        return F.gelu(z)
    return F.gelu(z, approximate="tanh")


def activation_backward(z: torch.Tensor, dy: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``dy * act'(z)`` with torch's own derivative (see the module docstring for the kinks); ``z`` is the input."""
    zero = torch.zeros((), dtype=dy.dtype, device=dy.device)
    if activation == "none":
        return dy
    if activation == "relu":
        return torch.where(z > 0, dy, zero)
    if activation == "relu6":
        return torch.where((z > 0) & (z < 6), dy, zero)
    if activation == "hardswish":
        mid = dy * (z / 3 + 0.5)
        return torch.where(z <= -3, zero, torch.where(z < 3, mid, dy))
    if activation == "silu":
        s = torch.sigmoid(z)
        return dy * s * (1 + z * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(z * (1 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * z * z) * (1 / math.sqrt(2 * math.pi))
        return dy * (cdf + z * pdf)
    inner = _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    t = torch.tanh(inner)
    d_inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    return dy * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * d_inner)


_MODULES: dict[type[nn.Module], Activation] = {
    nn.ReLU: "relu",
    nn.ReLU6: "relu6",
    nn.Hardswish: "hardswish",
    nn.SiLU: "silu",
}


def module_activation(module: object) -> Activation | None:
    """The kind of an activation module of exactly one of the supported classes, else None.

    ``nn.Identity`` reads as ``"none"``; ``nn.GELU`` as ``"gelu"`` or ``"gelu_tanh"`` by its ``approximate``.
    """
    cls = type(module)
    if cls is nn.GELU:
        approx = getattr(module, "approximate", "none")
        return "gelu" if approx == "none" else "gelu_tanh" if approx == "tanh" else None
    if cls is nn.Identity:
        return "none"
    return _MODULES.get(cls)  # type: ignore[arg-type]


_FUNCTIONS: dict[Callable[..., torch.Tensor], Activation] = {
    F.relu: "relu",
    torch.relu: "relu",
    F.gelu: "gelu",
    F.silu: "silu",
    F.relu6: "relu6",
    F.hardswish: "hardswish",
}


def function_activation(fn: object) -> Activation | None:
    """The kind of an activation given as a function (``F.relu``, ``F.gelu``...) or a module, else None."""
    if isinstance(fn, nn.Module):
        return module_activation(fn)
    try:
        return _FUNCTIONS.get(fn)  # type: ignore[call-overload]
    except TypeError:  # an unhashable callable
        return None
