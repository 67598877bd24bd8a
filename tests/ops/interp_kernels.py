"""Triton kernels under the CPU interpreter, against the torch references.

Not collected by the main test run (the file name does not start with ``test_``): ``test_triton_interpreter.py``
runs it in a fresh Python process with ``TRITON_INTERPRET=1`` set *before* Triton is imported, which is the only way
Triton honours the variable.
"""

from __future__ import annotations

import pytest
import torch

from lightning_accel._utils.triton import interpreter_active

if not interpreter_active():  # pragma: no cover - guarded by the runner
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from lightning_accel.ops.linear_dropout import linear_dropout
from lightning_accel.ops.linear_dropout import reference as ld_ref
from lightning_accel.ops.linear_dropout import triton as ld_kernels
from lightning_accel.ops.norm import layer_norm, rms_norm
from lightning_accel.ops.norm import reference as norm_ref
from tests.ops._cases import DTYPE_IDS, DTYPES, assert_close, assert_grad_close, leaves

torch.set_num_threads(1)


@pytest.mark.parametrize("shape", [(7, 37), (2, 3, 130)], ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_kernels(shape: tuple[int, ...], dtype: torch.dtype, atol: float, rtol: float, rms: bool) -> None:
    torch.manual_seed(0)
    n = shape[-1]
    x, dy = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w, b = torch.randn(n) * 0.5 + 1, torch.randn(n) * 0.1
    xs, ws, bs = leaves(x, w, b)
    y = rms_norm(xs, ws, 1e-5, backend="triton") if rms else layer_norm(xs, ws, bs, 1e-5, backend="triton")
    y.backward(dy)
    xr, wr, br = leaves(x.float(), w, b)
    yr = norm_ref.rms_norm(xr, wr, 1e-5) if rms else norm_ref.layer_norm(xr, wr, br, 1e-5)
    yr.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, yr, atol, rtol)
    assert_grad_close(xs.grad, xr.grad, atol, rtol, factor=2)  # a GEMM over the rounded dropout gradient
    assert_grad_close(ws.grad, wr.grad, atol, rtol)
    if not rms:
        assert_grad_close(bs.grad, br.grad, atol, rtol)


def test_norm_kernel_without_affine() -> None:
    x = torch.randn(5, 19)
    torch.testing.assert_close(layer_norm(x, backend="triton"), norm_ref.layer_norm(x, None, None, 1e-5))
    torch.testing.assert_close(rms_norm(x, backend="triton"), norm_ref.rms_norm(x, None, 1e-6))


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_linear_dropout_kernels(gemm: str, dtype: torch.dtype, atol: float, rtol: float, p: float) -> None:
    torch.manual_seed(0)
    lead, k, n = (3, 13), 19, 23
    x = torch.randn(*lead, k).to(dtype)
    w, b = (torch.randn(n, k) / k**0.5).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    r, dy = torch.randn(*lead, n).to(dtype), torch.randn(*lead, n).to(dtype)
    seed = 77
    keep = ld_kernels.dropout_keep_mask(seed, 39, n, p, "cpu").view(*lead, n) if p else None
    xs, ws, bs, rs = leaves(x, w, b, r)
    y = linear_dropout(xs, ws, bs, p, True, rs, seed=seed, backend="triton", gemm=gemm)  # type: ignore[arg-type]
    y.backward(dy)
    xr, wr, br, rr = leaves(x.float(), w.float(), b.float(), r.float())
    yr = ld_ref.linear_dropout(xr, wr, br, keep, p, rr)
    yr.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, yr, atol, rtol)
    assert_grad_close(xs.grad, xr.grad, atol, rtol, factor=2)  # a GEMM over the rounded dropout gradient
    assert_grad_close(ws.grad, wr.grad, atol, rtol)
    assert_grad_close(bs.grad, br.grad, atol, rtol)
    assert_close(rs.grad, rr.grad, atol, rtol)


def test_kernel_mask_rate_and_scaling() -> None:
    keep = ld_kernels.dropout_keep_mask(5, 64, 48, 0.25, "cpu")
    assert 0.70 < keep.float().mean().item() < 0.80
    x, w = torch.randn(64, 16), torch.randn(48, 16)
    y = linear_dropout(x, w, None, 0.25, True, seed=5, backend="triton")
    torch.testing.assert_close(y, ld_ref.linear_dropout(x, w, None, keep, 0.25), atol=1e-5, rtol=1e-5)


def test_bf16_fused_gemm_guard() -> None:
    # the interpreter computes bf16 tl.dot wrongly, so the fused GEMM route is refused for bf16 here ...
    assert ld_kernels.fused_gemm_supported(torch.float32)
    assert not ld_kernels.fused_gemm_supported(torch.bfloat16)
    # ... and a bf16 call that asks for it still gets the right answer through the cuBLAS/torch route
    torch.manual_seed(0)
    x, w = torch.randn(37, 19).bfloat16(), (torch.randn(23, 19) / 19**0.5).bfloat16()
    y = linear_dropout(x, w, backend="triton", gemm="triton")
    assert_close(y, x.float() @ w.float().t(), 2e-2, 2e-2)


def test_guard_is_needed() -> None:
    """The premise of the guard: the raw fused-GEMM kernel on bf16 is far off under the interpreter."""
    torch.manual_seed(0)
    x, w = torch.randn(37, 19).bfloat16(), torch.randn(23, 19).bfloat16()
    out = torch.empty(37, 23)
    ld_kernels._matmul_epilogue_kernel[ld_kernels._grid(37, 23)](
        x, w, out, out, out, 37, 23, 19, x.stride(0), w.stride(0), 0, out.stride(0), 0, 0.0,
        HAS_B=False, HAS_R=False, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32,
    )  # fmt: skip
    err = (out - x.float() @ w.float().t()).abs().max().item()
    if err < 1e-1:  # pragma: no cover - a fixed interpreter would make the guard unnecessary
        pytest.xfail(f"bf16 tl.dot is correct in this Triton's interpreter (error {err}); the guard can be relaxed")
    assert err > 1.0
