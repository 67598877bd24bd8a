"""Triton kernels for ``dropout(act(x @ W.T + b)) (+ residual)``: the epilogue, an optional GEMM with that epilogue,
and the dropout (+ activation) backward. Imported lazily by :mod:`.function`.

With an activation (``ACT`` > 0, see :mod:`lightning_accel.ops.activation_triton`) the epilogue also writes the
pre-activation ``x @ W.T + b`` (what eager's activation saves for its backward); the backward kernel applies the
regenerated mask and the activation's derivative in one pass.

The keep-mask is ``tl.rand(seed, row * N + col) >= p`` (Philox), so forward and backward draw the same bits without
storing a mask. Offsets, the mask's flat index included, are int64 (:mod:`lightning_accel.ops.indexing_triton`): an
index below ``2**32`` draws the bits an int32 one drew, and outputs of ``2**31`` elements and more are fused too.
Everything inside the kernels is float32.

Two forward routes:

- ``gemm="torch"`` (default): cuBLAS computes ``x @ W.T``; one Triton pass adds the bias, applies dropout and adds the
  residual (eager runs three or four elementwise kernels and stores a mask for that).
- ``gemm="triton"``: one Triton kernel computes the GEMM with the same epilogue applied to the accumulator, so ``y``
  never goes to memory. The Triton interpreter computes bf16 ``tl.dot`` wrongly (checked: error 3e10 on a 37x19x23
  product), so under ``TRITON_INTERPRET=1`` bf16 falls back to the cuBLAS/torch route (:func:`fused_gemm_supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_accel._utils.triton import interpreter_active
from lightning_accel.ops.activation import Activation
from lightning_accel.ops.activation_triton import act_backward, act_forward, code
from lightning_accel.ops.indexing_triton import program_start

__all__ = ["dropout_backward", "dropout_keep_mask", "forward", "fused_gemm_supported"]

_BLOCK_M, _BLOCK_N = 32, 32


@triton.jit
def _epilogue(
    acc, offs_m, offs_n, mask, B, R, stride_r, N, seed, p, PRE, stride_p,
    HAS_B: tl.constexpr, HAS_R: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    if HAS_B:
        acc = acc + tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:
        tl.store(PRE + offs_m[:, None] * stride_p + offs_n[None, :], acc.to(PRE.dtype.element_ty), mask=mask)
        acc = act_forward(acc, ACT)
    if p > 0:
        rnd = tl.rand(seed, offs_m[:, None] * N + offs_n[None, :])
        acc = tl.where(rnd >= p, acc / (1.0 - p), 0.0)
    if HAS_R:
        acc = acc + tl.load(R + offs_m[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _epilogue_kernel(
    Y, B, R, OUT, M, N, stride_y, stride_r, stride_o, seed, p, PRE, stride_p,
    HAS_B: tl.constexpr, HAS_R: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = program_start(0, BLOCK_M) + tl.arange(0, BLOCK_M)  # int64: see indexing_triton
    offs_n = program_start(1, BLOCK_N) + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.load(Y + offs_m[:, None] * stride_y + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = _epilogue(acc, offs_m, offs_n, mask, B, R, stride_r, N, seed, p, PRE, stride_p, HAS_B, HAS_R, ACT)
    tl.store(OUT + offs_m[:, None] * stride_o + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_epilogue_kernel(
    X, W, B, R, OUT, M, N, K, stride_xm, stride_wn, stride_r, stride_o, seed, p, PRE, stride_p,
    HAS_B: tl.constexpr, HAS_R: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = program_start(0, BLOCK_M) + tl.arange(0, BLOCK_M)  # int64: see indexing_triton
    offs_n = program_start(1, BLOCK_N) + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        # other=0: masked-off K columns must add nothing to the dot product
        a_mask = (offs_m[:, None] < M) & (kk[None, :] < K)
        b_mask = (offs_n[None, :] < N) & (kk[:, None] < K)
        a = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0)
        b = tl.load(W + offs_n[None, :] * stride_wn + kk[:, None], mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = _epilogue(acc, offs_m, offs_n, mask, B, R, stride_r, N, seed, p, PRE, stride_p, HAS_B, HAS_R, ACT)
    tl.store(OUT + offs_m[:, None] * stride_o + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd_kernel(
    DOUT, DZ, M, N, stride_d, stride_z, seed, p, PRE, stride_p,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = program_start(0, BLOCK_M) + tl.arange(0, BLOCK_M)  # int64: see indexing_triton
    offs_n = program_start(1, BLOCK_N) + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dz = tl.load(DOUT + offs_m[:, None] * stride_d + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if p > 0:
        rnd = tl.rand(seed, offs_m[:, None] * N + offs_n[None, :])
        dz = tl.where(rnd >= p, dz / (1.0 - p), 0.0)
    if ACT != 0:
        pre = tl.load(PRE + offs_m[:, None] * stride_p + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = act_backward(pre, dz, ACT)
    tl.store(DZ + offs_m[:, None] * stride_z + offs_n[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


@triton.jit
def _keep_mask_kernel(KEEP, M, N, seed, p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = program_start(0, BLOCK_M) + tl.arange(0, BLOCK_M)  # int64: see indexing_triton
    offs_n = program_start(1, BLOCK_N) + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rnd = tl.rand(seed, offs_m[:, None] * N + offs_n[None, :])
    tl.store(KEEP + offs_m[:, None] * N + offs_n[None, :], (rnd >= p).to(tl.int8), mask=mask)


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N)


def fused_gemm_supported(dtype: torch.dtype) -> bool:
    """Whether ``gemm="triton"`` may run for inputs of ``dtype`` here.

    Under the interpreter bf16 ``tl.dot`` returns garbage without an error, so it is refused there; compiled kernels
    on a GPU handle fp32, fp16 and bf16.
    """
    return not (interpreter_active() and dtype == torch.bfloat16)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: int,
    p: float,
    out_dtype: torch.dtype,
    gemm: str = "torch",
    activation: Activation = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dropout(act(x @ weight.T + bias)) + residual`` for a 2-D ``x`` (M, K), ``weight`` (N, K); residual (M, N).

    ``bias`` is ``(N,)`` (:func:`~..function.linear_dropout` expands a broadcast ``(1,)`` or ``()`` bias first). The
    kernels index the bias as contiguous and the rows of ``x``/``residual`` by ``stride(0)``, so a strided bias view
    and a strided last dimension are copied first (contiguous tensors are not).

    Returns:
        ``(out, pre)``: ``pre`` is the pre-activation in ``x``'s dtype (None without an activation).
    """
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"`bias` must have shape ({n},) here, got {tuple(bias.shape)}. Expand it to ({n},) first.")
    bias = bias.contiguous() if bias is not None else None
    residual = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    pre = torch.empty((m, n), dtype=x.dtype, device=x.device) if activation != "none" else None
    pre_arg = pre if pre is not None else out
    r = residual if residual is not None else out
    b = bias if bias is not None else out
    flags = {"HAS_B": bias is not None, "HAS_R": residual is not None, "ACT": code(activation)}
    if gemm == "triton" and fused_gemm_supported(x.dtype):
        # the GEMM kernel walks K with unit steps: only the row strides are arguments
        x = x if x.stride(1) == 1 else x.contiguous()
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        _matmul_epilogue_kernel[_grid(m, n)](
            x, weight, b, r, out, m, n, k, x.stride(0), weight.stride(0), r.stride(0), out.stride(0), seed, p,
            pre_arg, pre_arg.stride(0), **flags, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=32,
        )  # fmt: skip
        return out, pre
    y = torch.mm(x, weight.t())
    _epilogue_kernel[_grid(m, n)](
        y, b, r, out, m, n, y.stride(0), r.stride(0), out.stride(0), seed, p, pre_arg, pre_arg.stride(0),
        **flags, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
    )  # fmt: skip
    return out, pre


def dropout_backward(
    dout: torch.Tensor,
    seed: int,
    p: float,
    dtype: torch.dtype,
    pre: torch.Tensor | None = None,
    activation: Activation = "none",
) -> torch.Tensor:
    """``act'(pre) * dout * keep / (1 - p)`` with the mask redrawn from ``seed``, as ``dtype``."""
    m, n = dout.shape
    if p == 0 and activation == "none":
        return dout.to(dtype)
    dout = dout if dout.stride(1) == 1 else dout.contiguous()
    pre = pre if pre is None or pre.stride(1) == 1 else pre.contiguous()
    dz = torch.empty((m, n), dtype=dtype, device=dout.device)
    pre_arg = pre if pre is not None and activation != "none" else dz
    _dropout_bwd_kernel[_grid(m, n)](
        dout, dz, m, n, dout.stride(0), dz.stride(0), seed, p, pre_arg, pre_arg.stride(0),
        ACT=code(activation), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
    )  # fmt: skip
    return dz


def dropout_keep_mask(seed: int, m: int, n: int, p: float, device: torch.device | str) -> torch.Tensor:
    """The boolean keep-mask the kernels draw for ``seed`` on an (m, n) output (for tests and debugging)."""
    keep = torch.empty((m, n), dtype=torch.int8, device=device)
    _keep_mask_kernel[_grid(m, n)](keep, m, n, seed, p, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
    return keep.bool()
