"""Triton kernels for the batch-norm + activation passes of Conv2d -> BatchNorm2d (-> activation). Imported lazily by
:mod:`.function`.

The convolution itself stays with cuDNN; these kernels replace the elementwise passes around it. Forward: one pass
normalises the conv output with the batch statistics, applies the affine and the activation (eager runs the
batch-norm kernel and an activation kernel, and stores both outputs for backward). Backward: one program per channel
reduces ``sum(dz)`` and ``sum(dz * xhat)`` over the recomputed conv output (``dz = dout * act'(z)``), then one pass
writes ``dy`` (the reduction is split over the batch too, ``(C, min(N, 32))`` programs, then summed). Statistics and
arithmetic are float32 inside the kernels. The kernels address the (N, C, H, W) tensors in either dense layout, NCHW
(contiguous) or NHWC (``torch.channels_last``), through a channel stride and a spatial stride, and write their outputs
in the layout of the conv output, as eager ``nn.BatchNorm2d`` does: a channels_last model gets channels_last
activations without a copy. A tensor in neither layout, and a ``dout`` in another layout than the conv output, is
copied to the conv output's layout first; per-channel vectors are made contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_accel.ops.activation import Activation
from lightning_accel.ops.activation_triton import act_backward, act_forward, code
from lightning_accel.ops.indexing_triton import program_start

__all__ = ["bn_act_backward", "bn_act_forward"]

_BLOCK = 256


@triton.jit
def _affine(y, c, MEAN, INVSTD, W, B, HAS_W: tl.constexpr, HAS_B: tl.constexpr, mask):
    mean = tl.load(MEAN + c, mask=mask, other=0.0)
    invstd = tl.load(INVSTD + c, mask=mask, other=0.0)
    xhat = (y - mean) * invstd
    z = xhat
    if HAS_W:
        z = z * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        z = z + tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
    return xhat, z


@triton.jit
def _channel(offs, C, STRIDE_C, WIDE: tl.constexpr):
    """The channel of each element at (int64) ``offs``: ``offs // STRIDE_C % C``. In int32 unless the tensor has
    ``2**31`` elements or more (``WIDE``): a 64-bit division costs several times a 32-bit one on a GPU, in a kernel
    that does little else per element."""
    if WIDE:
        return (offs // STRIDE_C) % C
    return (offs.to(tl.int32) // STRIDE_C) % C


@triton.jit
def _fwd_kernel(
    Y, OUT, MEAN, INVSTD, W, B, total, C, STRIDE_C,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = program_start(0, BLOCK) + tl.arange(0, BLOCK)  # int64: see indexing_triton
    mask = offs < total
    c = _channel(offs, C, STRIDE_C, WIDE)  # STRIDE_C: H * W for NCHW, 1 for NHWC
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    _, z = _affine(y, c, MEAN, INVSTD, W, B, HAS_W, HAS_B, mask)
    tl.store(OUT + offs, act_forward(z, ACT).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_reduce_kernel(
    DOUT, Y, MEAN, INVSTD, W, B, SUM_DZ, SUM_DZX, N, C, HW, SPLIT, STRIDE_C, STRIDE_HW,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    c = program_start(0, 1)
    part = program_start(1, 1)  # int64, so is the sample index `n` and `n * C * HW` (see indexing_triton)
    acc_dz = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_dzx = tl.zeros((BLOCK,), dtype=tl.float32)
    for n in range(part, N, SPLIT):
        base = n * C * HW + c * STRIDE_C
        for h0 in range(0, HW, BLOCK):
            hw = h0 + tl.arange(0, BLOCK)
            mask = hw < HW
            cc = tl.zeros((BLOCK,), dtype=tl.int32) + c
            y = tl.load(Y + base + hw * STRIDE_HW, mask=mask, other=0.0).to(tl.float32)
            d = tl.load(DOUT + base + hw * STRIDE_HW, mask=mask, other=0.0).to(tl.float32)
            xhat, z = _affine(y, cc, MEAN, INVSTD, W, B, HAS_W, HAS_B, mask)
            dz = tl.where(mask, act_backward(z, d, ACT), 0.0)
            acc_dz += dz
            acc_dzx += dz * xhat
    tl.store(SUM_DZ + part * C + c, tl.sum(acc_dz, axis=0))
    tl.store(SUM_DZX + part * C + c, tl.sum(acc_dzx, axis=0))


@triton.jit
def _bwd_kernel(
    DOUT, Y, DY, MEAN, INVSTD, W, B, SUM_DZ, SUM_DZX, total, C, STRIDE_C, count,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = program_start(0, BLOCK) + tl.arange(0, BLOCK)  # int64: see indexing_triton
    mask = offs < total
    c = _channel(offs, C, STRIDE_C, WIDE)
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    xhat, z = _affine(y, c, MEAN, INVSTD, W, B, HAS_W, HAS_B, mask)
    dz = act_backward(z, d, ACT)
    mean_dz = tl.load(SUM_DZ + c, mask=mask, other=0.0) / count
    mean_dzx = tl.load(SUM_DZX + c, mask=mask, other=0.0) / count
    g = tl.load(INVSTD + c, mask=mask, other=0.0)
    if HAS_W:
        g = g * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(DY + offs, (g * (dz - mean_dz - xhat * mean_dzx)).to(DY.dtype.element_ty), mask=mask)


def _layout(y: torch.Tensor) -> tuple[torch.Tensor, torch.memory_format, int, int]:
    """``(y, memory_format, channel stride, spatial stride)``: ``y`` itself when it is dense NCHW or NHWC (the layouts
    the kernels address), else an NCHW copy."""
    _, c, h, w = y.shape
    if y.is_contiguous():
        return y, torch.contiguous_format, h * w, 1
    if y.is_contiguous(memory_format=torch.channels_last):
        return y, torch.channels_last, 1, c
    return y.contiguous(), torch.contiguous_format, h * w, 1


def _wide(total: int) -> bool:
    """Whether the elementwise kernels need int64 channel arithmetic (:func:`_channel`) for ``total`` elements: an
    offset of the last, partly masked block reaches past ``2**31 - 1``."""
    return total + _BLOCK > 2**31


def _args(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    # the kernels index the per-channel vectors as W + c: a strided view (a slice of a packed buffer) is copied
    return t.contiguous() if t is not None else fallback


def bn_act_forward(
    y: torch.Tensor,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    activation: Activation,
) -> torch.Tensor:
    """``act((y - mean) * invstd * bn_weight + bn_bias)`` per channel of the (N, C, H, W) ``y``, in ``y``'s dtype and
    layout (NCHW, or NHWC for a channels_last ``y``)."""
    y, fmt, stride_c, _ = _layout(y)
    n, c, h, w = y.shape
    out = torch.empty_like(y, memory_format=fmt)
    total = y.numel()
    mean, invstd = mean.float().contiguous(), invstd.float().contiguous()
    _fwd_kernel[(triton.cdiv(total, _BLOCK),)](
        y, out, mean, invstd, _args(bn_weight, mean), _args(bn_bias, mean), total, c, stride_c,
        HAS_W=bn_weight is not None, HAS_B=bn_bias is not None, ACT=code(activation), WIDE=_wide(total),
        BLOCK=_BLOCK,
    )  # fmt: skip
    return out


def bn_act_backward(
    dout: torch.Tensor,
    y: torch.Tensor,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    activation: Activation,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dy, dbn_weight, dbn_bias)``: the kernels' version of :func:`.reference.bn_relu_backward`; ``dy`` has the
    layout of ``y`` (NCHW, or NHWC for a channels_last ``y``)."""
    y, fmt, stride_c, stride_hw = _layout(y)
    dout = dout.contiguous(memory_format=fmt)  # a no-op when autograd hands it over in y's layout, as it usually does
    n, c, h, w = y.shape
    mean, invstd = mean.float().contiguous(), invstd.float().contiguous()
    split = min(n, 32)
    part_dz = torch.empty((split, c), dtype=torch.float32, device=y.device)
    part_dzx = torch.empty((split, c), dtype=torch.float32, device=y.device)
    wt, bt = _args(bn_weight, mean), _args(bn_bias, mean)
    flags = {"HAS_W": bn_weight is not None, "HAS_B": bn_bias is not None, "ACT": code(activation), "BLOCK": _BLOCK}
    _bwd_reduce_kernel[(c, split)](
        dout, y, mean, invstd, wt, bt, part_dz, part_dzx, n, c, h * w, split, stride_c, stride_hw, **flags
    )
    sum_dz, sum_dzx = part_dz.sum(0), part_dzx.sum(0)
    dy = torch.empty_like(y, memory_format=fmt)
    total = y.numel()
    _bwd_kernel[(triton.cdiv(total, _BLOCK),)](
        dout, y, dy, mean, invstd, wt, bt, sum_dz, sum_dzx, total, c, stride_c, float(n * h * w), **flags,
        WIDE=_wide(total),
    )  # fmt: skip
    dgamma = sum_dzx.to(bn_weight.dtype) if bn_weight is not None else None
    dbeta = sum_dz.to(bn_bias.dtype) if bn_bias is not None else None
    return dy, dgamma, dbeta
