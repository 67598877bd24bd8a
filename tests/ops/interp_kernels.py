"""Triton kernels under the CPU interpreter, against the torch references.

Not collected by the main test run (the file name does not start with ``test_``): ``test_triton_interpreter.py``
runs it in a fresh Python process with ``TRITON_INTERPRET=1`` set *before* Triton is imported, which is the only way
Triton honours the variable.
"""

from __future__ import annotations

import copy

import pytest
import torch
import triton
import triton.language as tl

from lightning_accel._utils.triton import interpreter_active

if not interpreter_active():  # pragma: no cover - guarded by the runner
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from lightning_accel.ops.activation import ACTIVATIONS
from lightning_accel.ops.conv_bn_relu import conv_bn_relu
from lightning_accel.ops.conv_bn_relu import reference as cbr_ref
from lightning_accel.ops.conv_bn_relu import triton as cbr_kernels
from lightning_accel.ops.indexing_triton import program_start
from lightning_accel.ops.linear_dropout import function as ld_function
from lightning_accel.ops.linear_dropout import linear_dropout
from lightning_accel.ops.linear_dropout import reference as ld_ref
from lightning_accel.ops.linear_dropout import triton as ld_kernels
from lightning_accel.ops.norm import layer_norm, rms_norm
from lightning_accel.ops.norm import reference as norm_ref
from lightning_accel.ops.norm import triton as norm_kernels
from lightning_accel.precision.surgery import apply_fusions
from tests.ops._cases import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    assert_grad_close,
    conv_bn_batch_edge_against_eager,
    flop_model,
    leaves,
    matmul_conv_flops,
    step_flops,
)

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


def test_bf16_fused_gemm_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    # the interpreter computes bf16 tl.dot wrongly, so the fused GEMM route is refused for bf16 here ...
    assert ld_kernels.fused_gemm_supported(torch.float32)
    assert not ld_kernels.fused_gemm_supported(torch.bfloat16)
    # ... and a bf16 call that asks for it still gets the right answer through the cuBLAS/torch route, and is told so
    monkeypatch.setattr(ld_function, "_GEMM_FALLBACK_WARNED", set())  # earlier bf16 cases may have warned already
    torch.manual_seed(0)
    x, w = torch.randn(37, 19).bfloat16(), (torch.randn(23, 19) / 19**0.5).bfloat16()
    with pytest.warns(
        UserWarning, match=r"`gemm='triton'` is not used: the Triton interpreter computes torch.bfloat16"
    ):
        y = linear_dropout(x, w, backend="triton", gemm="triton")
    assert_close(y, x.float() @ w.float().t(), 2e-2, 2e-2)


def test_guard_is_needed() -> None:
    """The premise of the guard: the raw fused-GEMM kernel on bf16 is far off under the interpreter."""
    torch.manual_seed(0)
    x, w = torch.randn(37, 19).bfloat16(), torch.randn(23, 19).bfloat16()
    out = torch.empty(37, 23)
    ld_kernels._matmul_epilogue_kernel[ld_kernels._grid(37, 23)](
        x, w, out, out, out, 37, 23, 19, x.stride(0), w.stride(0), 0, out.stride(0), 0, 0.0, out, 0,
        HAS_B=False, HAS_R=False, ACT=0, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32,
    )  # fmt: skip
    err = (out - x.float() @ w.float().t()).abs().max().item()
    if err < 1e-1:  # pragma: no cover - a fixed interpreter would make the guard unnecessary
        pytest.xfail(f"bf16 tl.dot is correct in this Triton's interpreter (error {err}); the guard can be relaxed")
    assert err > 1.0


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("gemm", ["torch", "triton"])
def test_linear_activation_kernels(act: str, gemm: str) -> None:
    """Linear + activation + dropout + residual on the kernels, float32, forward and backward, against the oracle."""
    torch.manual_seed(0)
    lead, k, n, p, seed = (3, 5), 11, 19, 0.25, 9
    x, w = torch.randn(*lead, k), torch.randn(n, k) / k**0.5
    b, r, dy = torch.randn(n) * 2, torch.randn(*lead, n), torch.randn(*lead, n)  # pre-activations past every kink
    keep = ld_kernels.dropout_keep_mask(seed, 15, n, p, "cpu").view(*lead, n)
    xs, ws, bs, rs = leaves(x, w, b, r)
    y = linear_dropout(xs, ws, bs, p, True, rs, seed=seed, backend="triton", gemm=gemm, activation=act)  # type: ignore[arg-type]
    y.backward(dy)
    xr, wr, br, rr = leaves(x, w, b, r)
    yr = ld_ref.linear_dropout(xr, wr, br, keep, p, rr, activation=act)  # type: ignore[arg-type]
    yr.backward(dy)
    for got, want in ((y, yr), (xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad), (rs.grad, rr.grad)):
        assert_grad_close(got, want, 1e-5, 1e-5, factor=2)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("affine", [True, False])
def test_conv_bn_activation_kernels(act: str, affine: bool) -> None:
    """Conv2d + BatchNorm2d (batch statistics) + activation with the Triton BN passes, float32, against the oracle."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 4, 5, 7), torch.randn(6, 4, 3, 3) / 6
    g, be = (torch.rand(6) + 0.5, torch.randn(6)) if affine else (None, None)
    rm, rv = torch.zeros(6), torch.ones(6)
    rm_r, rv_r = rm.clone(), rv.clone()
    xs, ws, gs, bes = leaves(x, w, g, be)
    y = conv_bn_relu(xs, ws, None, gs, bes, rm, rv, True, 0.1, 1e-5, 1, 1, backend="triton", activation=act)  # type: ignore[arg-type]
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, gr, ber = leaves(x, w, g, be)
    yr = cbr_ref.conv_bn_relu(xr, wr, None, gr, ber, rm_r, rv_r, True, 0.1, 1e-5, 1, 1, activation=act)  # type: ignore[arg-type]
    yr.backward(dy)
    assert_close(y, yr, 1e-5, 1e-5)
    torch.testing.assert_close(rm, rm_r)
    torch.testing.assert_close(rv, rv_r)
    assert_grad_close(xs.grad, xr.grad, 1e-5, 1e-5)
    assert_grad_close(ws.grad, wr.grad, 1e-5, 1e-5)
    if affine:
        assert_grad_close(gs.grad, gr.grad, 1e-5, 1e-5)
        assert_grad_close(bes.grad, ber.grad, 1e-5, 1e-5)


def test_conv_bn_backward_split_over_a_large_batch() -> None:
    """A batch larger than the reduction's split (32): programs stride over it."""
    torch.manual_seed(0)
    x, w = torch.randn(35, 2, 3, 3), torch.randn(3, 2, 1, 1)
    g, be = torch.rand(3) + 0.5, torch.randn(3)
    xs, ws, gs, bes = leaves(x, w, g, be)
    y = conv_bn_relu(xs, ws, None, gs, bes, None, None, True, 0.1, 1e-5, backend="triton", activation="silu")
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, gr, ber = leaves(x, w, g, be)
    cbr_ref.conv_bn_relu(xr, wr, None, gr, ber, None, None, True, 0.1, 1e-5, activation="silu").backward(dy)
    for got, want in ((xs.grad, xr.grad), (ws.grad, wr.grad), (gs.grad, gr.grad), (bes.grad, ber.grad)):
        assert_grad_close(got, want, 1e-5, 1e-5)


@pytest.mark.parametrize(("shape", "padding"), [((0, 3, 5, 5), 1), ((1, 3, 1, 1), 1)], ids=["empty", "one_value"])
def test_conv_bn_batch_edge_cases_match_eager(shape: tuple[int, int, int, int], padding: int) -> None:
    """An empty batch and one value per channel on the Triton path behave as eager BatchNorm2d in training."""
    conv_bn_batch_edge_against_eager("triton", shape, padding)


def _strided(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf of ``2 * n`` values and its every-other-value view: what a slice of a packed parameter looks like."""
    big = torch.randn(2 * n, requires_grad=True)
    return big, big[::2]


def _twin(big: torch.Tensor) -> torch.Tensor:
    return big.detach().clone().requires_grad_()


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_kernels_with_strided_parameter_views(rms: bool) -> None:
    """The kernels index weight/bias as contiguous: a strided view used to give silently wrong rows."""
    torch.manual_seed(0)
    x, dy = torch.randn(6, 37), torch.randn(6, 37)
    (wbig, w), (bbig, b) = _strided(37), _strided(37)
    xs = x.clone().requires_grad_()
    y = rms_norm(xs, w, 1e-5, backend="triton") if rms else layer_norm(xs, w, b, 1e-5, backend="triton")
    y.backward(dy)
    xr, wbig_r, bbig_r = x.clone().requires_grad_(), _twin(wbig), _twin(bbig)
    wr, br = wbig_r[::2], bbig_r[::2]
    yr = norm_ref.rms_norm(xr, wr, 1e-5) if rms else norm_ref.layer_norm(xr, wr, br, 1e-5)
    yr.backward(dy)
    assert_close(y, yr, 1e-5, 1e-5)
    for got, want in ((xs.grad, xr.grad), (wbig.grad, wbig_r.grad)) + (() if rms else ((bbig.grad, bbig_r.grad),)):
        assert_grad_close(got, want, 1e-5, 1e-5)
    # the launcher itself, given a strided last dimension (the autograd function copies it before; a caller may not)
    xt = x.t().contiguous().t()
    got = norm_kernels.norm_forward(xt, w, b, 1e-5, rms)
    for a, e in zip(got, norm_ref.norm_forward(x, w, b, 1e-5, rms), strict=True):
        assert_close(a, e, 1e-5, 1e-5)


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize("bias_kind", ["strided", "one", "scalar"])
def test_linear_dropout_kernels_with_strided_or_broadcast_bias(gemm: str, bias_kind: str) -> None:
    """A strided bias view, and a ``(1,)`` / ``()`` bias that ``F.linear`` broadcasts: the epilogue used to read N
    contiguous values from it (past the end of a one-value bias)."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(4, 19), torch.randn(23, 19) / 19**0.5, torch.randn(4, 23)
    big = torch.randn(46, requires_grad=True)
    big_r = _twin(big)
    pick = {"strided": lambda t: t[::2], "one": lambda t: t[5:6], "scalar": lambda t: t[5]}[bias_kind]
    y = linear_dropout(x, w, pick(big), 0.0, True, backend="triton", gemm=gemm)  # type: ignore[arg-type]
    y.backward(dy)
    yr = torch.nn.functional.linear(x, w, pick(big_r))
    yr.backward(dy)
    assert_close(y, yr, 1e-5, 1e-5)
    assert_grad_close(big.grad, big_r.grad, 1e-5, 1e-5)
    # the launcher with a residual whose last dimension is strided
    r = torch.randn(23, 4).t()
    out, _ = ld_kernels.forward(x, w, pick(big).detach().expand(23), r, 0, 0.0, torch.float32, gemm)
    assert_close(out, yr.detach() + r, 1e-5, 1e-5)


def test_conv_bn_kernels_with_strided_bn_parameters() -> None:
    """The BN kernels index bn_weight/bn_bias as contiguous: strided views used to give wrong channels."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 3, 3) / 5
    (gbig, g), (bbig, be) = _strided(5), _strided(5)
    y = conv_bn_relu(x, w, None, g, be, None, None, True, 0.1, 1e-5, 1, 1, backend="triton", activation="silu")
    dy = torch.randn_like(y)
    y.backward(dy)
    gbig_r, bbig_r = _twin(gbig), _twin(bbig)
    gr, ber = gbig_r[::2], bbig_r[::2]
    yr = cbr_ref.conv_bn_relu(x, w, None, gr, ber, None, None, True, 0.1, 1e-5, 1, 1, activation="silu")
    yr.backward(dy)
    assert_close(y, yr, 1e-5, 1e-5)
    assert_grad_close(gbig.grad, gbig_r.grad, 1e-5, 1e-5)
    assert_grad_close(bbig.grad, bbig_r.grad, 1e-5, 1e-5)


@pytest.mark.parametrize("act", ["relu", "relu6", "hardswish"])
def test_activation_kernel_derivative_at_the_kinks(act: str) -> None:
    """The kernels' piecewise derivatives take torch's branch on the kinks themselves (``x = 0``: the pre-activations
    are exactly the bias)."""
    kinks = [-6.0, -3.5, -3.0, -2.5, 0.0, 0.5, 2.5, 3.0, 3.5, 6.0, 6.5]
    x, w = torch.zeros(2, 3), torch.ones(len(kinks), 3)
    b_kernel, b_eager = leaves(torch.tensor(kinks), torch.tensor(kinks))
    linear_dropout(x, w, b_kernel, backend="triton", activation=act).sum().backward()  # type: ignore[arg-type]
    linear_dropout(x, w, b_eager, backend="eager", activation=act).sum().backward()  # type: ignore[arg-type]
    assert b_kernel is not None and b_eager is not None
    torch.testing.assert_close(b_kernel.grad, b_eager.grad, rtol=0, atol=0)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_conv_bn_kernels_keep_channels_last(act: str) -> None:
    """A channels_last convolution output stays channels_last through the BN kernels, forward and backward, as it does
    through eager Conv2d + BatchNorm2d (the launchers used to copy it to NCHW and return NCHW)."""
    torch.manual_seed(0)
    cl = torch.channels_last
    x, w = torch.randn(3, 4, 5, 6).to(memory_format=cl), (torch.randn(6, 4, 3, 3) / 6).to(memory_format=cl)
    g, be = torch.rand(6) + 0.5, torch.randn(6)
    rm, rv = torch.zeros(6), torch.ones(6)
    rm_r, rv_r = rm.clone(), rv.clone()
    xs, ws, gs, bes = leaves(x, w, g, be)
    y = conv_bn_relu(xs, ws, None, gs, bes, rm, rv, True, 0.1, 1e-5, 1, 1, backend="triton", activation=act)  # type: ignore[arg-type]
    xr, wr, gr, ber = leaves(x, w, g, be)
    yr = cbr_ref.conv_bn_relu(xr, wr, None, gr, ber, rm_r, rv_r, True, 0.1, 1e-5, 1, 1, activation=act)  # type: ignore[arg-type]
    assert yr.is_contiguous(memory_format=cl)
    assert y.is_contiguous(memory_format=cl) and y.stride() == yr.stride()
    dy = torch.randn(3, 6, 5, 6)  # an NCHW gradient: the backward kernels take it in the conv output's layout
    y.backward(dy)
    yr.backward(dy)
    assert_close(y, yr, 1e-5, 1e-5)
    torch.testing.assert_close(rm, rm_r)
    torch.testing.assert_close(rv, rv_r)
    for got, want in ((xs, xr), (ws, wr), (gs, gr), (bes, ber)):
        assert got is not None and want is not None and got.grad is not None and want.grad is not None
        assert_grad_close(got.grad, want.grad, 1e-5, 1e-5)
    assert xs is not None and xs.grad is not None and xs.grad.is_contiguous(memory_format=cl)


def test_float64_gets_float64_results_on_the_triton_backend() -> None:
    """The kernels compute in float32; float64 inputs take the torch path and match the float64 eager ops (a large
    mean cost the float32 kernels up to 0.3 % of the result)."""
    torch.manual_seed(0)
    f64 = torch.float64
    x = torch.randn(3, 4, 6, 6, dtype=f64) * 10 + 1e4
    w, g, be = torch.randn(6, 4, 3, 3, dtype=f64), torch.rand(6, dtype=f64) + 0.5, torch.randn(6, dtype=f64)
    y = conv_bn_relu(x, w, None, g, be, None, None, True, 0.1, 1e-5, 1, 1, backend="triton", activation="none")
    want = torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, w, None, 1, 1), None, None, g, be, True)
    assert y.dtype == f64
    torch.testing.assert_close(y, want, atol=1e-9, rtol=1e-9)
    a, wl, r = torch.randn(7, 33, dtype=f64) + 1e3, torch.randn(9, 33, dtype=f64), torch.randn(7, 9, dtype=f64)
    for gemm in ("torch", "triton"):
        got = linear_dropout(a, wl, None, 0.0, True, r, backend="triton", gemm=gemm, activation="gelu")
        assert got.dtype == f64
        torch.testing.assert_close(got, torch.nn.functional.gelu(a @ wl.t()) + r, atol=1e-9, rtol=1e-9)
    # a float32 input with a float64 residual: the residual is not rounded to float32 on the way through
    r_big = torch.randn(7, 9, dtype=f64) + 1e9
    got = linear_dropout(a.float(), wl.float(), None, 0.0, True, r_big, backend="triton")
    torch.testing.assert_close(got, (a.float() @ wl.float().t()).to(f64) + r_big, atol=1e-6, rtol=0)
    rows = torch.randn(7, 33, dtype=f64) * 1e-3 + 1e2
    torch.testing.assert_close(
        layer_norm(rows, None, None, 1e-5, backend="triton"), torch.nn.functional.layer_norm(rows, (33,)),
        atol=1e-9, rtol=1e-9,
    )  # fmt: skip
    torch.testing.assert_close(
        rms_norm(rows, None, 1e-6, backend="triton"), torch.nn.functional.rms_norm(rows, (33,), eps=1e-6),
        atol=1e-9, rtol=1e-9,
    )  # fmt: skip
    assert rms_norm(rows, None, 1e-6, backend="triton").dtype == f64


@pytest.mark.parametrize("gemm", ["torch", "triton"])
def test_kernels_without_features(gemm: str) -> None:
    """Rows of no features (``nn.LayerNorm(0)``) and Linears with no inputs or outputs, as the eager ops give them."""
    for k, n in ((0, 5), (4, 0), (0, 0)):
        x, w, b = leaves(torch.randn(2, 3, k), torch.randn(n, k), torch.randn(n))
        assert x is not None and w is not None and b is not None
        y = linear_dropout(x, w, b, 0.3, True, seed=1, backend="triton", gemm=gemm)  # type: ignore[arg-type]
        y.sum().backward()
        assert y.shape == (2, 3, n) and w.grad is not None and w.grad.shape == (n, k)
    for shape in ((4, 0), (0, 0)):
        x = torch.randn(shape, requires_grad=True)
        for y in (layer_norm(x, torch.ones(0), torch.zeros(0), backend="triton"), rms_norm(x, None, backend="triton")):
            y.sum().backward()
            assert y.shape == shape and x.grad is not None and x.grad.shape == shape


# --------------------------------------------------------------------------------- offsets past 2**31 elements


@triton.jit
def _program_start_probe(OUT, BLOCK: tl.constexpr):
    tl.store(OUT + tl.program_id(0), program_start(0, BLOCK))


def test_program_start_is_int64_past_2_31() -> None:
    """Program 2 of blocks of 2**30 starts at element 2**31: in int32 that wraps to -2**31."""
    out = torch.zeros(4, dtype=torch.int64)
    _program_start_probe[(4,)](out, BLOCK=2**30)
    assert out.tolist() == [0, 2**30, 2**31, 3 * 2**30]


@pytest.fixture
def far_program(monkeypatch: pytest.MonkeyPatch) -> int:
    """Programs along axis 0 run as program ``2**27`` of their launch (the interpreter's ``program_id`` moved there): a
    block of 32 (or 256) elements then starts at ``2**32`` (``2**35``), past any small tensor, so an int64 offset masks
    every element off and the kernel writes nothing; an int32 offset wraps to 0 and overwrites the first elements."""
    import numpy as np
    from triton.runtime import interpreter

    far = 2**27
    builder = type(interpreter.interpreter_builder)
    original = builder.create_get_program_id

    def moved(self: object, axis: int) -> object:
        handle = original(self, axis)
        if axis == 0:
            handle.data = handle.data + np.int32(far)
        return handle

    monkeypatch.setattr(builder, "create_get_program_id", moved)
    return far


def test_elementwise_kernels_offsets_do_not_wrap_past_2_31(far_program: int) -> None:
    """Block-indexed kernels compute their offsets in int64: a program whose block starts past 2**31 elements touches
    nothing of a small tensor (int32 offsets wrapped back into it and overwrote its first rows)."""
    torch.manual_seed(0)
    m, n = 40, 24
    y, r = torch.randn(m, n), torch.randn(m, n)
    out = torch.full((m, n), float("nan"))
    ld_kernels._epilogue_kernel[(1, 1)](
        y, r, r, out, m, n, y.stride(0), r.stride(0), out.stride(0), 3, 0.5, out, out.stride(0),
        HAS_B=False, HAS_R=True, ACT=0, BLOCK_M=32, BLOCK_N=32,
    )  # fmt: skip
    assert out.isnan().all()
    dz = torch.full((m, n), float("nan"))
    ld_kernels._dropout_bwd_kernel[(1, 1)](
        y, dz, m, n, y.stride(0), dz.stride(0), 3, 0.5, dz, dz.stride(0), ACT=0, BLOCK_M=32, BLOCK_N=32
    )
    assert dz.isnan().all()
    x4 = torch.randn(2, 3, 8, 8)
    out4 = torch.full_like(x4, float("nan"))
    mean, invstd = torch.zeros(3), torch.ones(3)
    cbr_kernels._fwd_kernel[(1,)](
        x4, out4, mean, invstd, mean, mean, x4.numel(), 3, 64, HAS_W=False, HAS_B=False, ACT=1, WIDE=False, BLOCK=256
    )
    assert out4.isnan().all()


@triton.jit
def _rand_probe(OUT, seed, START, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(OUT + program_start(0, BLOCK) + offs, tl.rand(seed, program_start(0, 1) * START + offs))


def test_dropout_draws_by_int64_index_alias_nothing_and_keep_the_small_index_bits() -> None:
    """The fused dropout's mask is ``tl.rand(seed, row * N + col)`` with an int64 index (outputs of 2**31 elements and
    more were refused before): an index past 2**32 draws other bits than the same index mod 2**32 (no mask repeats
    inside one output), and one below 2**31 draws the bits of the same int32 index (small outputs keep their masks)."""
    out = torch.zeros(2, 64)
    _rand_probe[(2,)](out, 5, 2**32, BLOCK=64)  # program 1 draws indices 2**32 .. 2**32 + 63
    assert not torch.equal(out[0], out[1])
    keep = ld_kernels.dropout_keep_mask(5, 1, 64, 0.25, "cpu")[0]
    torch.testing.assert_close(out[0] >= 0.25, keep)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_conv_bn_kernels_with_int64_channel_arithmetic(monkeypatch: pytest.MonkeyPatch, channels_last: bool) -> None:
    """Tensors of 2**31 elements and more compute each element's channel in int64 (smaller ones in int32, cheaper on a
    GPU); forced here on a small tensor, both layouts give eager's results, forward and backward."""
    monkeypatch.setattr(cbr_kernels, "_wide", lambda total: True)
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, w = torch.randn(3, 4, 5, 6).to(memory_format=fmt), (torch.randn(6, 4, 3, 3) / 6).to(memory_format=fmt)
    g, be = torch.rand(6) + 0.5, torch.randn(6)
    xs, ws, gs, bes = leaves(x, w, g, be)
    y = conv_bn_relu(xs, ws, None, gs, bes, None, None, True, 0.1, 1e-5, 1, 1, backend="triton", activation="silu")
    xr, wr, gr, ber = leaves(x, w, g, be)
    yr = cbr_ref.conv_bn_relu(xr, wr, None, gr, ber, None, None, True, 0.1, 1e-5, 1, 1, activation="silu")
    dy = torch.randn(3, 6, 5, 6)
    y.backward(dy)
    yr.backward(dy)
    assert_close(y, yr, 1e-5, 1e-5)
    for got, want in ((xs, xr), (ws, wr), (gs, gr), (bes, ber)):
        assert got is not None and want is not None and got.grad is not None and want.grad is not None
        assert_grad_close(got.grad, want.grad, 1e-5, 1e-5)


def test_fused_model_on_the_kernels_counts_the_unfused_model_flops() -> None:
    """FLOP counting (``PerformanceMonitor``'s MFU) sees the same matmul and convolution FLOPs, forward + backward,
    for a model whose conv + BN + ReLU, linear + GELU + dropout and LayerNorm run in the Triton kernels."""
    model = flop_model()
    fused = copy.deepcopy(model)
    assert apply_fusions(fused, backend="triton").coverage() == 1.0
    x = torch.randn(2, 3, 6, 6)
    unfused = step_flops(lambda: model(x))
    counted = step_flops(lambda: fused(x))
    assert matmul_conv_flops(counted) == matmul_conv_flops(unfused)
    assert matmul_conv_flops(unfused)[0] > 0 and matmul_conv_flops(unfused)[1] > 0


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_dropout_kernels_count_the_eager_gemm_flops(gemm: str, activation: str, dtype: torch.dtype) -> None:
    """The fused Triton GEMM is no aten op: it reports its ``2 * M * N * K`` itself (bf16 under the interpreter takes
    the torch GEMM inside the same op: counted once either way)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7).to(dtype).requires_grad_()
    w, b = torch.randn(9, 7).to(dtype).requires_grad_(), torch.randn(9).to(dtype).requires_grad_()
    r = torch.randn(3, 5, 9).to(dtype)

    def run(backend: str) -> torch.Tensor:
        return linear_dropout(x, w, b, 0.2, True, r, seed=3, backend=backend, gemm=gemm, activation=activation)  # type: ignore[arg-type]

    eager = matmul_conv_flops(step_flops(lambda: run("eager")))
    assert eager == (3 * 2 * 15 * 7 * 9, 0)
    assert matmul_conv_flops(step_flops(lambda: run("triton"))) == eager


@pytest.mark.parametrize("gemm", ["torch", "triton"])
def test_linear_dropout_kernels_take_the_whole_seed_range(gemm: str) -> None:
    """``0 .. 2**32 - 1`` (what ``linear_dropout`` accepts): the top seed draws a mask at the rate, forward and
    backward agree on it."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 16, requires_grad=True), torch.randn(48, 16)
    keep = ld_kernels.dropout_keep_mask(2**32 - 1, 64, 48, 0.25, "cpu")
    assert 0.70 < keep.float().mean().item() < 0.80
    y = linear_dropout(x, w, None, 0.25, True, seed=2**32 - 1, backend="triton", gemm=gemm)  # type: ignore[arg-type]
    torch.testing.assert_close(y, ld_ref.linear_dropout(x, w, None, keep, 0.25), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (keep.float() / 0.75) @ w, atol=1e-5, rtol=1e-5)
