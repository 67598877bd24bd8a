"""Pure-torch Linear (-> activation) -> Dropout (-> + residual): the test oracle and the CPU path of the fused function.

The dropout mask is a function of ``(seed, shape, p)`` only, so the backward regenerates it instead of storing it.
On this path it comes from a ``torch.Generator`` seeded with ``seed``; the Triton path draws it with
``tl.rand`` (Philox) from the same seed. Both are valid dropout masks, but not the same bits: compare paths with
an explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_accel.ops.activation import Activation, activation_backward, activation_forward

__all__ = [
    "apply_dropout",
    "dropout_backward",
    "dropout_mask",
    "epilogue_act_forward",
    "epilogue_forward",
    "linear_dropout",
]


def linear_dropout(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    p: float,
    residual: torch.Tensor | None = None,
    activation: Activation = "none",
) -> torch.Tensor:
    """Oracle: ``act(F.linear(x, weight, bias)) * keep / (1 - p) (+ residual)``; ``keep=None`` means no dropout."""
    y = activation_forward(F.linear(x, weight, bias), activation)
    if keep is not None:
        y = y * keep.to(y.dtype) / (1.0 - p)
    return y if residual is None else y + residual


def dropout_mask(seed: int, shape: tuple[int, ...], p: float, device: torch.device | str) -> torch.Tensor:
    """The boolean keep-mask of this path: ``rand(shape) >= p`` from a generator seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.rand(shape, generator=g, device=device) >= p


def apply_dropout(z: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """``z * keep / (1 - p)``, the mask of ``seed`` drawn over ``z`` as the 2-D ``(rows, N)`` matrix the kernels see
    (so an N-D ``z`` gets the same bits as its 2-D view)."""
    rows = 1
    for d in z.shape[:-1]:
        rows *= d
    keep = dropout_mask(seed, (rows, z.shape[-1]), p, z.device).view(z.shape)
    return torch.where(keep, z / (1.0 - p), z.new_zeros(()))


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def epilogue_forward(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: int,
    p: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(y + bias) * keep / (1 - p) + residual`` for the 2-D GEMM output ``y``, accumulated in float32."""
    return epilogue_act_forward(y, bias, residual, seed, p, out_dtype)[0]


def epilogue_act_forward(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: int,
    p: float,
    out_dtype: torch.dtype,
    activation: Activation = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(act(y + bias) * keep / (1 - p) + residual, pre)``; ``pre = y + bias`` in ``y``'s dtype (None without act)."""
    z = _acc(y)
    if bias is not None:
        z = z + _acc(bias)
    pre = None
    if activation != "none":
        pre = z.to(y.dtype)
        z = activation_forward(z, activation)
    if p > 0:
        z = apply_dropout(z, seed, p)
    if residual is not None:
        z = z + _acc(residual)
    return z.to(out_dtype), pre


def dropout_backward(
    dout: torch.Tensor,
    seed: int,
    p: float,
    dtype: torch.dtype,
    pre: torch.Tensor | None = None,
    activation: Activation = "none",
) -> torch.Tensor:
    """``act'(pre) * dout * keep / (1 - p)`` with the mask regenerated from ``seed``, cast to ``dtype`` (the GEMM's)."""
    if p == 0 and activation == "none":
        return dout.to(dtype)
    dz = _acc(dout)
    if p > 0:
        dz = apply_dropout(dz, seed, p)
    if activation != "none" and pre is not None:
        dz = activation_backward(_acc(pre), dz, activation)
    return dz.to(dtype)
