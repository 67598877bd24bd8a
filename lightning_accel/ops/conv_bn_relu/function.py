"""``ConvBNReLUFunction``: Conv2d -> BatchNorm2d (batch statistics) -> activation that recomputes the conv in backward.

Memory: eager autograd keeps the conv output (for BN's backward) and the BN/ReLU output (for ReLU's backward) of every
block; this function keeps only its input ``x`` (which the previous layer's backward usually holds anyway), the
weights and two float32 vectors per channel. The price is one extra convolution forward in backward (~1/3 more conv
FLOPs for this layer). In eval mode :func:`conv_bn_relu` folds the running statistics into the conv weights instead.
The activation is any of :data:`lightning_accel.ops.activation.ACTIVATIONS`; on the Triton path the batch-norm +
activation passes run in :mod:`.triton`'s kernels, on the torch path in :mod:`.reference`'s functions.

FLOP counting (``torch.utils.flop_counter.FlopCounterMode``, hence ``PerformanceMonitor``'s MFU) sees what the eager
modules would run: the forward convolution and its ``convolution_backward``. The convolution that backward recomputes
is the op ``lightning_accel::conv2d_recompute``, whose FLOP formula is zero: it is work the fusion adds to save
memory, not FLOPs of the model (counted, it raised a layer's convolution FLOPs per step by a third: the forward and
the two gradients are three convolutions' worth, the recompute a fourth).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import register_flop_formula

from lightning_accel._utils.checks import check_bool
from lightning_accel._utils.triton import Backend, check_backend, use_triton
from lightning_accel.ops.activation import Activation, activation_forward
from lightning_accel.ops.conv_bn_relu import reference

__all__ = ["ConvBNReLUFunction", "conv_bn_relu", "fold_bn_into_conv"]

fold_bn_into_conv = reference.fold_bn

# An op of its own so that a FLOP counter can tell the recomputation from the model's convolution. A library kernel,
# not `torch.library.custom_op`: its dispatch costs ~10 us a call here against ~26 us (measured on 2 CPU cores).
_LIB = torch.library.Library("lightning_accel", "FRAGMENT")
_LIB.define(
    "conv2d_recompute(Tensor x, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation, "
    "SymInt groups) -> Tensor"
)


def _conv2d_recompute(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    """``F.conv2d`` with explicit (symmetric) padding: the forward's convolution, recomputed in backward."""
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


# CompositeExplicitAutograd (not Implicit): a dispatch mode sees the op itself, not the convolution inside it
_LIB.impl("conv2d_recompute", _conv2d_recompute, "CompositeExplicitAutograd")
torch.library.register_fake("lightning_accel::conv2d_recompute", _conv2d_recompute, lib=_LIB)


@register_flop_formula(torch.ops.lightning_accel.conv2d_recompute)
def _conv2d_recompute_flops(*args: Any, **kwargs: Any) -> int:
    """Zero: the recomputation is not model FLOPs (MFU counts the model's math once, as eager computes it)."""
    return 0


class ConvBNReLUFunction(torch.autograd.Function):
    """Training-mode fused Conv2d + BatchNorm2d (+ activation). Tensors must already have their compute dtypes.

    ``running_mean``/``running_var`` (optional) are updated in place with ``momentum`` like ``nn.BatchNorm2d`` does
    (unbiased variance). ``relu`` is True/False (ReLU or none) or an activation name; ``on_triton`` runs the
    batch-norm + activation passes in the Triton kernels.

    Batches behave as in eager ``nn.BatchNorm2d`` training: an empty one (N = 0) gives an empty output, zero gradients
    and unchanged running statistics; one with a single value per channel (N * H_out * W_out = 1) raises.

    Raises:
        ValueError: ``Expected more than 1 value per channel when training`` for a single value per channel.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bn_weight: torch.Tensor | None,
        bn_bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
        conv_args: tuple[Any, Any, Any, int],
        relu: bool | str,
        on_triton: bool = False,
    ) -> torch.Tensor:
        act = reference.resolve_activation(relu)
        y = F.conv2d(x, weight, bias, *conv_args)
        count = reference.check_batch_values(y)
        # an empty batch has nothing for a kernel to do (and an empty launch grid): the torch path returns it as is
        on_triton = on_triton and count > 0
        if on_triton:
            from lightning_accel.ops.conv_bn_relu import triton as kernels

            yf = y.float()
            var, mean = torch.var_mean(yf, dim=(0, 2, 3), unbiased=False)
            invstd = torch.rsqrt(var + eps)
            n = y.numel() // y.shape[1]
            unbiased_var = var * (n / max(n - 1, 1))
            del yf
            out = kernels.bn_act_forward(y, bn_weight, bn_bias, mean, invstd, act)
        else:
            out, mean, invstd, unbiased_var = reference.bn_relu_forward(y, bn_weight, bn_bias, eps, act)
        del y  # the point of the fusion: the conv output is not kept for backward
        # like eager BatchNorm, an empty batch leaves the running statistics alone (its statistics are undefined)
        if running_mean is not None and running_var is not None and count > 0:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(x, weight, bias, bn_weight, bn_bias, mean, invstd)
        ctx.conv_args, ctx.act, ctx.on_triton = conv_args, act, on_triton
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        x, weight, bias, bn_weight, bn_bias, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        stride, padding, dilation, groups = ctx.conv_args
        # a string padding becomes the numbers the forward used; "same" with an even effective kernel pads one more
        # on the right/bottom (as torch does)
        pad, extra = _explicit_padding(padding, weight, dilation)
        xp = F.pad(x, [0, extra[1], 0, extra[0]]) if any(extra) else x
        with torch.autocast(x.device.type, enabled=False):
            # recompute instead of having stored it
            y = torch.ops.lightning_accel.conv2d_recompute(
                xp, weight, bias, _pair(stride), pad, _pair(dilation), groups
            )
        if ctx.on_triton:
            from lightning_accel.ops.conv_bn_relu import triton as kernels

            dy, dgamma, dbeta = kernels.bn_act_backward(dout, y, bn_weight, bn_bias, mean, invstd, ctx.act)
        else:
            dy, dgamma, dbeta = reference.bn_relu_backward(dout, y, bn_weight, bn_bias, mean, invstd, ctx.act)
        del y
        dx = dw = db = None
        if need_x or need_w or need_b:
            # the op autograd itself runs for a conv's backward: one call, and traceable by torch.compile (which
            # breaks the graph on `torch.autograd.grad` inside a backward)
            dx, dw, db = torch.ops.aten.convolution_backward(
                dy, xp, weight, [weight.shape[0]] if bias is not None else None, _pair(stride), pad,
                _pair(dilation), False, [0, 0], groups, [need_x, need_w, need_b and bias is not None],
            )  # fmt: skip
            if dx is not None and any(extra):
                dx = dx[:, :, : x.shape[2], : x.shape[3]]
        return dx, dw, db, dgamma, dbeta, None, None, None, None, None, None, None


def _check_channels(weight: torch.Tensor, **vectors: torch.Tensor | None) -> None:
    """Refuse a batch-norm vector that is not ``(C_out,)``: eager ``F.batch_norm`` refuses it, the torch path would
    broadcast a ``(1,)`` one silently (the folded eval path too) and the Triton kernels would read past its end."""
    c = weight.shape[0]
    for name, t in vectors.items():
        if t is not None and t.shape != (c,):
            raise ValueError(
                f"`{name}` must have one value per output channel of the convolution, shape ({c},), got "
                f"{tuple(t.shape)}. Give BatchNorm2d num_features={c}."
            )


def _explicit_padding(padding: Any, weight: torch.Tensor, dilation: Any) -> tuple[list[int], list[int]]:
    """``(padding, extra)`` per spatial dimension: the symmetric padding of ``F.conv2d(..., padding)`` and what
    ``padding="same"`` adds on the right/bottom when ``dilation * (kernel - 1)`` is odd (torch's own rule)."""
    if not isinstance(padding, str):
        return _pair(padding), [0, 0]
    if padding == "valid":
        return [0, 0], [0, 0]
    d = _pair(dilation)
    total = [d[i] * (weight.shape[2 + i] - 1) for i in range(2)]  # "same" implies stride 1 (F.conv2d checks)
    return [t // 2 for t in total], [t % 2 for t in total]


def _check_real(name: str, value: Any, *, positive: bool, fix: str) -> float:
    """``value`` as a ``float`` when it is a finite real number (> 0 when ``positive``), else one line naming ``name``.

    Any :class:`numbers.Real` is taken, numpy scalars included (``nn.BatchNorm2d`` takes an ``eps`` or ``momentum``
    read from a numpy config, and the function is handed the module's values); the value is used for this call and
    not kept, so the float it becomes cannot surface later. ``bool`` is refused although Python calls it an integer:
    ``eps=True`` is a mistake, not 1.0. NaN or infinity would give a NaN or constant output (``x / sqrt(inf)`` is 0)
    or poison the running statistics for good.

    Raises:
        TypeError: ``value`` is not a real number, or is a bool.
        ValueError: ``value`` is NaN, infinite, or <= 0 when ``positive``.
    """
    expected = "a finite number > 0" if positive else "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # `np.bool_` is no `numbers.Real`
        raise TypeError(f"`{name}` must be {expected}, got {value!r} ({type(value).__name__}). {fix}")
    try:
        v = float(value)
    except OverflowError:  # an int or Fraction beyond any float
        v = math.inf
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"`{name}` must be {expected}, got {value!r}. {fix}")
    return v


def _pair(v: Any) -> list[int]:
    """A ``stride``/``padding``/``dilation`` as ``F.conv2d`` takes it, as two ints: one integer of any type (a numpy
    one too: ``F.conv2d`` takes it, so the backward must) for both dimensions, or a sequence of one or two."""
    if not isinstance(v, (tuple, list, torch.Size)):
        return [int(v), int(v)]
    values = [int(t) for t in v]
    return values * 2 if len(values) == 1 else values


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
    backend: Backend = "auto",
    activation: Activation | None = None,
) -> torch.Tensor:
    """Fused ``act(batch_norm(conv2d(x)))`` with the signature of :func:`.reference.conv_bn_relu`.

    ``activation`` (``"none"``, ``"relu"``, ``"relu6"``, ``"hardswish"``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"``)
    wins over ``relu`` (the older spelling of ``"relu"``/``"none"``) when given.

    ``training=True`` (or no running statistics) normalises with batch statistics through
    :class:`ConvBNReLUFunction`; otherwise BatchNorm is folded into the convolution. Honours ``torch.autocast``: the
    convolution runs in the autocast dtype, the statistics in float32, the output has the convolution's dtype.

    ``backend``: ``"auto"`` uses the fused function on CUDA (where activation memory is what limits batch size), with
    the Triton batch-norm + activation kernels when Triton is installed, and the eager oracle elsewhere (on a CPU the
    recomputed convolution costs more time than the memory is worth); ``"reference"`` forces the fused function's
    torch path, ``"triton"`` its kernels (CUDA, or the interpreter; float64 inputs take the torch path, since the
    kernels compute in float32); ``"eager"`` forces the oracle. The output has the layout (NCHW or channels_last) of
    the convolution's output, as with the eager modules. Every backend
    treats an empty batch and a batch of one value per channel as eager ``nn.BatchNorm2d`` does (see
    :class:`ConvBNReLUFunction`).

    Raises:
        TypeError: for a ``training`` that is not True or False, an ``eps`` that is not a real number (a bool
            neither), a ``relu`` that is neither True, False nor an activation name, or a ``momentum`` that is not a
            real number (None included) while running statistics are updated. Any real number type is taken for
            ``eps`` and ``momentum``, numpy scalars and :class:`fractions.Fraction` included, as
            ``nn.BatchNorm2d`` takes them.
        ValueError: for an unknown activation name in ``relu`` or ``activation`` (the message names the one given),
            an ``eps`` or ``momentum`` that is NaN or infinite, an ``eps`` <= 0 with batch statistics (as eager
            ``F.batch_norm`` refuses it), an ``x`` that is not 4-D, a
            ``bn_weight``, ``bn_bias``, ``running_mean`` or ``running_var`` that is not ``(C_out,)``, or one running
            statistic without the other (eager ``F.batch_norm`` refuses them too).
    """
    if x.dim() != 4:
        raise ValueError(f"`x` must be a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}.")
    check_backend(backend)
    if not isinstance(training, bool):  # a string is truthy: training="no" updated the running statistics
        check_bool("training", training, fix="Pass the batch norm's `training` flag (`nn.Module.training`).")
    if (running_mean is None) != (running_var is None):
        # `F.batch_norm` refuses this; the fused paths would ignore the one buffer given without a word
        missing = "running_var" if running_var is None else "running_mean"
        raise ValueError(
            f"`running_mean` and `running_var` must both be tensors or both be None, got `{missing}`=None. Pass "
            "both running buffers of the BatchNorm2d, or neither to normalise with batch statistics only."
        )
    # the cheap tests first (a finite Python float in range): a compiled model calls this every step, and Dynamo
    # then traces two comparisons, not the checks and messages of `_check_real`
    if training and running_mean is not None and not (type(momentum) is float and -math.inf < momentum < math.inf):
        # `nn.BatchNorm2d(momentum=None)` means a cumulative average, which the module turns into a number per step;
        # the function (like `F.batch_norm`) takes that number, and None would fail deep in the update
        momentum = _check_real(
            "momentum", momentum, positive=False, fix="For a cumulative average (`nn.BatchNorm2d(momentum=None)`) "
            "pass `1 / num_batches_tracked` after incrementing `num_batches_tracked`, as the module does.",
        )  # fmt: skip
    # batch statistics divide by sqrt(var + eps): eager `F.batch_norm` refuses eps <= 0 there (on some paths only,
    # in words naming no argument), and the torch path took it and gave NaN wherever var < -eps
    batch_stats = training or running_mean is None
    if not (type(eps) is float and (0 if batch_stats else -math.inf) < eps < math.inf):
        fix = "Pass the batch norm's `eps` (`nn.BatchNorm2d.eps`, 1e-5 by default)."
        eps = _check_real("eps", eps, positive=batch_stats, fix=fix)
    _check_channels(weight, bn_weight=bn_weight, bn_bias=bn_bias, running_mean=running_mean, running_var=running_var)
    act = reference.resolve_activation(relu, activation)
    if backend == "eager" or (backend == "auto" and not x.is_cuda):
        return reference.conv_bn_relu(
            x, weight, bias, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, stride, padding,
            dilation, groups, activation=act,
        )  # fmt: skip
    conv_args = (stride, padding, dilation, groups)
    if not training and running_mean is not None and running_var is not None:
        w, b = fold_bn_into_conv(weight, bias, bn_weight, bn_bias, running_mean, running_var, eps)
        return activation_forward(F.conv2d(x, w, b, stride, padding, dilation, groups), act)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    elif weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = bias.to(x.dtype) if bias is not None else None
    # the kernels compute in float32: float64 takes the torch path, which keeps float64 (as the eager modules do)
    on_triton = use_triton(x, backend) and x.dtype != torch.float64
    with torch.autocast(device_type, enabled=False):
        return ConvBNReLUFunction.apply(
            x, weight, bias, bn_weight, bn_bias, running_mean, running_var, momentum, eps, conv_args, act, on_triton
        )
