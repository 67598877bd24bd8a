"""Pure-torch Conv2d -> BatchNorm2d (-> activation): the oracle and the batch-norm math of the fused function.

The convolution stays with cuDNN (or the CPU backend); what the fusion buys is memory: the fused function stores the
convolution's *input* and two per-channel vectors, and recomputes the convolution output in backward, instead of
keeping the conv output and the BN output alive until backward. The activation after the batch norm is any of
:data:`lightning_accel.ops.activation.ACTIVATIONS` (``relu=True/False`` is the older spelling of ``"relu"``/``"none"``).
The Triton kernels (:mod:`.triton`) compute the same batch-norm + activation passes on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_accel.ops.activation import (
    ACTIVATIONS,
    Activation,
    activation_backward,
    activation_forward,
    check_activation,
)

__all__ = [
    "bn_relu_backward",
    "bn_relu_forward",
    "check_batch_values",
    "conv_bn_relu",
    "fold_bn",
    "resolve_activation",
]

_DIMS = (0, 2, 3)


def conv_bn_relu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    stride: tuple[int, ...] | int = 1,
    padding: tuple[int, ...] | int | str = 0,
    dilation: tuple[int, ...] | int = 1,
    groups: int = 1,
    relu: bool = True,
    activation: Activation | None = None,
) -> torch.Tensor:
    """Oracle: ``act(batch_norm(conv2d(x)))`` exactly as the three eager modules compute it.

    ``activation`` (one of :data:`~lightning_accel.ops.activation.ACTIVATIONS`) wins over ``relu`` when given.
    Without running statistics, ``training=False`` normalises with batch statistics, as
    ``nn.BatchNorm2d(track_running_stats=False)`` does in eval mode.
    """
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    # nn.BatchNorm2d(track_running_stats=False) normalises with batch statistics in eval mode too (its `bn_training`)
    training = training or (running_mean is None and running_var is None)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return activation_forward(y, resolve_activation(relu, activation))


def resolve_activation(relu: bool | str | None, activation: str | None = None) -> Activation:
    """The activation of a call: ``activation`` when given, else ``"relu"``/``"none"`` from ``relu`` (True/False, an
    activation name, or None for ``"none"``).

    Raises:
        TypeError: for a ``relu`` that is neither a bool, an activation name nor None (``1`` and ``0.0`` included:
            they were read as True and False), or an ``activation`` that is not a string.
        ValueError: for an unknown activation name, naming the argument that held it (``relu`` or ``activation``).
    """
    if activation is not None:
        return check_activation(activation)
    if isinstance(relu, bool):
        return "relu" if relu else "none"
    if relu is None or (isinstance(relu, str) and relu in ACTIVATIONS):
        return check_activation(relu)
    expected = "True, False or one of " + ", ".join(repr(a) for a in ACTIVATIONS)
    raise (ValueError if isinstance(relu, str) else TypeError)(
        f"`relu` must be {expected}, got {relu!r} ({type(relu).__name__}). Pass relu=False (or 'none') for no "
        "activation, or the activation's name as `activation=`."
    )


def check_batch_values(y: torch.Tensor) -> int:
    """The number of values per channel (N * H * W) that batch statistics of the conv output ``y`` average over.

    Raises:
        ValueError: when that number is 1, with eager ``F.batch_norm``'s message: the variance of one value is 0 and
            normalising it gives the bias alone, so eager training refuses it.
    """
    count = y.shape[0] * y.shape[2] * y.shape[3]
    if count == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {y.size()}: the batch norm "
            "after the convolution averages over N * H_out * W_out = 1 value; train on more than one sample (or a "
            "larger image), or evaluate with running statistics (`training=False`)."
        )
    return count


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _affine(xhat: torch.Tensor, bn_weight: torch.Tensor | None, bn_bias: torch.Tensor | None) -> torch.Tensor:
    z = xhat
    if bn_weight is not None:
        z = z * _acc(bn_weight)[None, :, None, None]
    if bn_bias is not None:
        z = z + _acc(bn_bias)[None, :, None, None]
    return z


def bn_relu_forward(
    y: torch.Tensor,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    eps: float,
    relu: bool | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch statistics + affine + activation on the conv output ``y`` (N, C, H, W).

    ``relu``: True/False (ReLU or none) or an activation name.

    Returns:
        ``(out, mean, invstd, unbiased_var)``; ``out`` has ``y``'s dtype, the statistics are float32 (float64 stays).
        For an empty ``y`` the output is empty and the statistics are those of a zero variance (nothing uses them).
    """
    yf = _acc(y)
    n = y.shape[0] * y.shape[2] * y.shape[3]
    if n == 0:  # an empty batch (eager returns it as is): a variance over no values would warn and be NaN
        var = yf.new_zeros(y.shape[1])
        return torch.empty_like(y), var, torch.rsqrt(var + eps), var
    mean = yf.mean(_DIMS)
    var = yf.var(_DIMS, unbiased=False)
    invstd = torch.rsqrt(var + eps)
    z = _affine((yf - mean[None, :, None, None]) * invstd[None, :, None, None], bn_weight, bn_bias)
    z = activation_forward(z, resolve_activation(relu))
    return z.to(y.dtype), mean, invstd, var * (n / max(n - 1, 1))


def bn_relu_backward(
    dout: torch.Tensor,
    y: torch.Tensor,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    relu: bool | str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dy, dbn_weight, dbn_bias)`` of :func:`bn_relu_forward` given the (recomputed) conv output ``y``.

    With ``xhat = (y - mean) * invstd``, ``z`` the affine output and ``dz = dout * act'(z)``:
    ``dy = invstd * (g - mean(g) - xhat * mean(g * xhat))`` where ``g = dz * bn_weight`` (means over N, H, W).
    """
    xhat = (_acc(y) - mean[None, :, None, None]) * invstd[None, :, None, None]
    dz = _acc(dout)
    act = resolve_activation(relu)
    if act != "none":
        dz = activation_backward(_affine(xhat, bn_weight, bn_bias), dz, act)
    dgamma = (dz * xhat).sum(_DIMS).to(bn_weight.dtype) if bn_weight is not None else None
    dbeta = dz.sum(_DIMS).to(bn_bias.dtype) if bn_bias is not None else None
    g = dz * _acc(bn_weight)[None, :, None, None] if bn_weight is not None else dz
    dy = g - g.mean(_DIMS, keepdim=True) - xhat * (g * xhat).mean(_DIMS, keepdim=True)
    return (dy * invstd[None, :, None, None]).to(y.dtype), dgamma, dbeta


def fold_bn(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold eval-mode batch norm into the convolution: ``conv(x, w', b') == bn(conv(x, w, b))`` with running stats.

    The fold is computed in float32 (float64 for float64 tensors) and ``w'`` and ``b'`` are rounded to ``weight``'s
    dtype once: rounding the scale to bfloat16 before multiplying rounds twice (2.4x the unfused bf16 modules' error
    in a measured case).
    """
    acc = torch.promote_types(weight.dtype, torch.float32)
    scale = torch.rsqrt(running_var.to(acc) + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.to(acc)
    w = weight.to(acc) * scale[:, None, None, None]
    b = -running_mean.to(acc) * scale
    if bias is not None:
        b = b + bias.to(acc) * scale
    if bn_bias is not None:
        b = b + bn_bias.to(acc)
    return w.to(weight.dtype), b.to(weight.dtype)
