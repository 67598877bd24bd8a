"""The compiled Triton kernels on a CUDA device against the torch references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.ops import conv_bn_relu, layer_norm, linear_dropout, rms_norm
from lightning_accel.ops.conv_bn_relu import reference as cbr_ref
from lightning_accel.ops.linear_dropout import reference as ld_ref
from lightning_accel.ops.norm import reference as norm_ref
from tests.ops._cases import DTYPE_IDS, DTYPES, assert_close, assert_grad_close, leaves

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_kernels_cuda(dtype: torch.dtype, atol: float, rtol: float, rms: bool) -> None:
    torch.manual_seed(0)
    x, dy = torch.randn(67, 1031, device="cuda").to(dtype), torch.randn(67, 1031, device="cuda").to(dtype)
    w, b = torch.randn(1031, device="cuda") * 0.5 + 1, torch.randn(1031, device="cuda") * 0.1
    xs, ws, bs = leaves(x, w, b)
    y = rms_norm(xs, ws, 1e-5) if rms else layer_norm(xs, ws, bs, 1e-5)  # auto: Triton on CUDA
    y.backward(dy)
    xr, wr, br = leaves(x.float(), w, b)
    yr = norm_ref.rms_norm(xr, wr, 1e-5) if rms else norm_ref.layer_norm(xr, wr, br, 1e-5)
    yr.backward(dy.float())
    assert_close(y, yr, atol, rtol)
    assert_grad_close(xs.grad, xr.grad, atol, rtol, factor=2)
    assert_grad_close(ws.grad, wr.grad, atol, rtol)


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES[1:], ids=DTYPE_IDS[1:])  # tf32 makes fp32 GEMMs ~1e-3
def test_linear_dropout_kernels_cuda(gemm: str, dtype: torch.dtype, atol: float, rtol: float) -> None:
    from lightning_accel.ops.linear_dropout import triton as kernels

    torch.manual_seed(0)
    m, k, n, p = 257, 129, 383, 0.1
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b, r = (torch.randn(n, device="cuda") * 0.1).to(dtype), torch.randn(m, n, device="cuda").to(dtype)
    keep = kernels.dropout_keep_mask(3, m, n, p, "cuda")
    xs, ws, bs, rs = leaves(x, w, b, r)
    y = linear_dropout(xs, ws, bs, p, True, rs, seed=3, gemm=gemm)  # type: ignore[arg-type]
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, br, rr = leaves(x.float(), w.float(), b.float(), r.float())
    yr = ld_ref.linear_dropout(xr, wr, br, keep, p, rr)
    yr.backward(dy.float())
    assert_grad_close(y, yr, atol, rtol, factor=2)  # a GEMM output
    assert_grad_close(xs.grad, xr.grad, atol, rtol, factor=2)
    assert_grad_close(ws.grad, wr.grad, atol, rtol)


def test_conv_bn_relu_cuda_bf16_autocast() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32, device="cuda")
    w = (torch.randn(32, 16, 3, 3, device="cuda") / 12).requires_grad_()
    g, be = torch.rand(32, device="cuda") + 0.5, torch.randn(32, device="cuda") * 0.1
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = conv_bn_relu(x, w, None, g, be, None, None, True, 0.1, 1e-5, 1, 1)
    assert y.grad_fn is not None and "ConvBNReLU" in type(y.grad_fn).__name__
    yr = cbr_ref.conv_bn_relu(x, w.detach(), None, g, be, None, None, True, 0.1, 1e-5, 1, 1)
    assert_close(y, yr, 5e-2, 5e-2)


@pytest.mark.parametrize("act", ["relu6", "hardswish", "silu", "gelu", "gelu_tanh"])
def test_activation_kernels_cuda(act: str) -> None:
    """The compiled activation epilogues of both ops (float16: CUDA fp32 convs and GEMMs may use TF32)."""
    torch.manual_seed(0)
    dev, dtype, atol = "cuda", torch.float16, 1e-3
    x, w = torch.randn(4, 8, 17, 19, device=dev).to(dtype), (torch.randn(16, 8, 3, 3, device=dev) / 8).to(dtype)
    g, be = torch.rand(16, device=dev) + 0.5, torch.randn(16, device=dev)
    xs, ws, gs, bes = leaves(x, w, g, be)
    y = conv_bn_relu(xs, ws, None, gs, bes, None, None, True, 0.1, 1e-5, 1, 1, activation=act)  # type: ignore[arg-type]
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, gr, ber = leaves(x.float(), w.float(), g, be)
    yr = cbr_ref.conv_bn_relu(xr, wr, None, gr, ber, None, None, True, 0.1, 1e-5, 1, 1, activation=act)  # type: ignore[arg-type]
    yr.backward(dy.float())
    assert_grad_close(y, yr, atol, atol, factor=2)
    assert_grad_close(xs.grad, xr.grad, atol, atol)
    assert_grad_close(gs.grad, gr.grad, atol, atol)
    xl, wl = torch.randn(33, 65, device=dev).to(dtype), (torch.randn(47, 65, device=dev) / 8).to(dtype)
    a, b = leaves(xl, wl)
    out = linear_dropout(a, b, activation=act)  # type: ignore[arg-type]
    d = torch.randn_like(out)
    out.backward(d)
    ar, br = leaves(xl.float(), wl.float())
    ref = ld_ref.linear_dropout(ar, br, None, None, 0.0, activation=act)  # type: ignore[arg-type]
    ref.backward(d.float())
    assert_grad_close(out, ref, atol, atol, factor=2)
    assert_grad_close(a.grad, ar.grad, atol, atol, factor=2)
