"""Triton versions of :mod:`.activation` (float32 in, float32 out), inlined into the fused ops' kernels.

``ACT`` is a ``tl.constexpr`` code from :func:`code` (so each kernel is specialised per activation and the branches
vanish at compile time). Imported lazily, by the kernels' modules only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_accel.ops.activation import ACTIVATIONS, Activation

__all__ = ["act_backward", "act_forward", "code"]


def code(activation: Activation) -> int:
    """The ``ACT`` constexpr of ``activation`` (its index in :data:`~.activation.ACTIVATIONS`)."""
    return ACTIVATIONS.index(activation)


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def act_forward(z, ACT: tl.constexpr):
    """``act(z)``; codes: 0 none, 1 relu, 2 relu6, 3 hardswish, 4 silu, 5 gelu, 6 gelu_tanh."""
    if ACT == 1:
        z = tl.maximum(z, 0.0)
    elif ACT == 2:
        z = tl.minimum(tl.maximum(z, 0.0), 6.0)
    elif ACT == 3:
        z = z * tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0
    elif ACT == 4:
        z = z * tl.sigmoid(z)
    elif ACT == 5:
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACT == 6:
        z = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    return z


@triton.jit
def act_backward(z, dy, ACT: tl.constexpr):
    """``dy * act'(z)`` with torch's derivatives at the kinks (see :mod:`.activation`)."""
    if ACT == 1:
        dy = tl.where(z > 0.0, dy, 0.0)
    elif ACT == 2:
        dy = tl.where((z > 0.0) & (z < 6.0), dy, 0.0)
    elif ACT == 3:
        dy = tl.where(z <= -3.0, 0.0, tl.where(z < 3.0, dy * (z / 3.0 + 0.5), dy))
    elif ACT == 4:
        s = tl.sigmoid(z)
        dy = dy * s * (1.0 + z * (1.0 - s))
    elif ACT == 5:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        dy = dy * (cdf + z * pdf)
    elif ACT == 6:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        dy = dy * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * d_inner)
    return dy
