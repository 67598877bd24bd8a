# ruff: noqa: SIM108  (branches on tl.constexpr flags are clearer as if/else inside kernels)
"""Triton kernels for LayerNorm / RMSNorm over the last dimension (forward and backward), one row per program.

Imported lazily by :mod:`.function`. Inside the kernels everything is float32 (loads are upcast, stores cast back), so
fp16/bf16 inputs keep float32 statistics. The backward gives each program a contiguous slab of rows and has it
accumulate its ``dweight``/``dbias`` partial sums in registers; the partials (one row per program) are summed by torch,
which keeps the extra memory at ``programs x N`` instead of ``rows x N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_accel.ops.indexing_triton import program_start
from lightning_accel.ops.norm.function import MAX_TRITON_FEATURES

__all__ = ["norm_backward", "norm_forward"]

# One row per program; rows wider than this would spill registers on current GPUs (and are not what LLM blocks use).
# Defined beside the dispatch, which must know it without importing Triton.
MAX_FUSED_SIZE = MAX_TRITON_FEATURES


@triton.jit
def _norm_fwd_kernel(
    X, Y, W, B, Mean, Rstd, stride_x, stride_y, N, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = program_start(0, 1)  # int64: `row * stride_x` passes 2**31 on large inputs (see indexing_triton)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        mean = 0.0
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _norm_bwd_kernel(
    DY, X, W, Mean, Rstd, DX, DW, DB, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = program_start(0, 1)  # int64, so are `row` and `row * stride` below (see indexing_triton)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        if row < M:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row)
            if RMS:
                xhat = x * rstd
            else:
                xhat = (x - tl.load(Mean + row)) * rstd
            xhat = tl.where(mask, xhat, 0.0)
            if HAS_W:
                g = dy * w
            else:
                g = dy
            c1 = tl.sum(g * xhat, axis=0) / N
            if RMS:
                dx = (g - xhat * c1) * rstd
            else:
                c2 = tl.sum(g, axis=0) / N
                dx = (g - c2 - xhat * c1) * rstd
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * xhat
            db_acc += dy
    if HAS_W:
        tl.store(DW + pid * N + cols, dw_acc, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db_acc, mask=mask)


def _block_n(n: int) -> int:
    block = triton.next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(
            f"The Triton norm kernel handles rows of at most {MAX_FUSED_SIZE} features, got {n}. "
            "Use the reference path (`backend='reference'`) for such shapes."
        )
    return block


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`..reference.norm_forward` for a 2-D ``x``; ``weight``/``bias`` are ``(N,)``.

    The kernel indexes rows by ``stride(0)`` and everything else as contiguous, so a strided last dimension of ``x``
    and strided parameter views (``w[::2]``, a slice of a packed buffer) are copied first; a contiguous one is not.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    m, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block = _block_n(n)
    has_b = bias is not None and not rms
    _norm_fwd_kernel[(m,)](
        x, y, weight if weight is not None else x, bias if has_b else x, mean, rstd, x.stride(0), y.stride(0), n, eps,
        HAS_W=weight is not None, HAS_B=has_b, RMS=rms, BLOCK_N=block, num_warps=_warps(block),
    )  # fmt: skip
    return y, mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Kernel version of :func:`..reference.norm_backward` (strided inputs copied as in :func:`norm_forward`)."""
    m, n = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous() if weight is not None else None
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    block = _block_n(n)
    # enough programs to fill a GPU (a few per SM), few enough that the partial sums stay small
    if x.is_cuda:
        programs = min(m, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:
        programs = min(m, 4)
    programs = max(programs, 1)
    rows_per_program = triton.cdiv(m, programs)
    has_b = has_bias and not rms
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if weight is not None else None
    db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if has_b else None
    _norm_bwd_kernel[(programs,)](
        dy, x, weight if weight is not None else x, mean, rstd, dx,
        dw_part if dw_part is not None else dx, db_part if db_part is not None else dx,
        dy.stride(0), x.stride(0), dx.stride(0), m, n, rows_per_program,
        HAS_W=weight is not None, HAS_B=has_b, RMS=rms, BLOCK_N=block, num_warps=_warps(block),
    )  # fmt: skip
    dw = dw_part.sum(0).to(weight.dtype) if dw_part is not None and weight is not None else None
    db = db_part.sum(0).to(weight.dtype if weight is not None else x.dtype) if db_part is not None else None
    return dx, dw, db
