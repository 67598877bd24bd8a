"""LayerNorm / RMSNorm: the autograd function's torch path against the oracle, gradcheck, argument errors.

The Triton kernels are checked against the same oracle under the interpreter (``test_triton_interpreter.py``).
"""

from __future__ import annotations

import re

import pytest
import torch

from lightning_accel.ops.norm import NormFunction, layer_norm, reference, rms_norm
from tests.ops._cases import DTYPE_IDS, DTYPES, assert_close, assert_grad_close, leaves

SHAPES = [(7, 37), (2, 5, 129), (1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_forward_backward_match_reference(
    shape: tuple[int, ...], dtype: torch.dtype, atol: float, rtol: float, rms: bool
) -> None:
    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape).to(dtype)
    w, b = torch.randn(n) * 0.5 + 1, torch.randn(n) * 0.1
    dy = torch.randn(shape).to(dtype)
    xs, ws, bs = leaves(x, w, b)
    y = rms_norm(xs, ws, 1e-5, backend="reference") if rms else layer_norm(xs, ws, bs, 1e-5, backend="reference")
    y.backward(dy)
    xr, wr, br = leaves(x.float(), w, b)
    yr = reference.rms_norm(xr, wr, 1e-5) if rms else reference.layer_norm(xr, wr, br, 1e-5)
    yr.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, yr, atol, rtol)
    assert_close(xs.grad, xr.grad, atol, rtol)
    assert_grad_close(ws.grad, wr.grad, atol, rtol)
    if not rms:
        assert_grad_close(bs.grad, br.grad, atol, rtol)
    else:
        assert bs.grad is None


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_float64(rms: bool, affine: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True) if affine else None
    b = torch.randn(11, dtype=torch.float64, requires_grad=True) if affine and not rms else None
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args: torch.Tensor) -> torch.Tensor:
        it = iter(args)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        return NormFunction.apply(xx, ww, bb, 1e-5, rms, "reference")

    assert torch.autograd.gradcheck(fn, inputs)


def test_non_contiguous_input() -> None:
    x = torch.randn(9, 6).t()  # (6, 9), last dim strided
    w = torch.ones(9)
    torch.testing.assert_close(layer_norm(x, w, None, backend="reference"), reference.layer_norm(x, w, None, 1e-5))


def test_bad_weight_shape_and_backend() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"`layer_norm`.*\(8,\)"):
        layer_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="`backend`"):
        layer_norm(x, torch.ones(8), backend="cuda")  # type: ignore[arg-type]


def test_forced_triton_without_cuda_or_interpreter_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        layer_norm(torch.randn(2, 4), backend="triton")


def test_auto_runs_rows_wider_than_the_kernels_take_on_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA ``"auto"`` picks the Triton kernels, which take rows of at most ``MAX_TRITON_FEATURES`` features: a
    wider row (a fused ``nn.LayerNorm(100_000)``) must run on the torch path, not fail at its first call. Simulated on
    the CPU by resolving ``"auto"`` as a CUDA device does."""
    from lightning_accel.ops.norm import function

    real = function.resolve_backend
    monkeypatch.setattr(function, "resolve_backend", lambda x, b: "triton" if b in ("auto", "triton") else real(x, b))
    n = function.MAX_TRITON_FEATURES + 1
    assert function._path(torch.randn(2, n - 1), "auto") == "triton"  # rows the kernels take still go to them
    assert function._path(torch.randn(2, n), "triton") == "triton"  # forced: the kernels' own refusal says why
    x, w, b = leaves(torch.randn(2, n), torch.rand(n) + 0.5, torch.randn(n))
    y = layer_norm(x, w, b, backend="auto")
    xr, wr, br = leaves(x.detach(), w.detach(), b.detach())
    yr = torch.nn.functional.layer_norm(xr, (n,), wr, br)
    torch.testing.assert_close(y, yr)
    y.square().sum().backward()
    yr.square().sum().backward()
    assert x.grad is not None and w.grad is not None
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-4, rtol=1e-4)
    xd, wd = x.detach(), w.detach()
    torch.testing.assert_close(rms_norm(xd, wd, 1e-6), torch.nn.functional.rms_norm(xd, (n,), wd, 1e-6))


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize("bias_shape", [(1,), (4, 8), (7,)], ids=str)
def test_bad_bias_shape_refused_on_every_backend(backend: str, bias_shape: tuple[int, ...]) -> None:
    """``F.layer_norm`` refuses a bias that is not (N,); the torch path used to broadcast a (1,) or (M, N) one."""
    x = torch.randn(4, 8, requires_grad=True)
    expected = rf"^`bias` of `layer_norm` must have shape \(8,\).*got {re.escape(str(bias_shape))}"
    with pytest.raises(ValueError, match=expected):
        layer_norm(x, torch.ones(8), torch.zeros(bias_shape), backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_rms_norm_eps_none_is_nn_rmsnorm_default(dtype: torch.dtype, backend: str) -> None:
    """``nn.RMSNorm()`` has ``eps=None``; passing it on gives ``F.rms_norm``'s value (the compute dtype's machine
    epsilon), visible on rows whose mean square is far below bfloat16's epsilon."""
    x = torch.full((2, 4), 1e-3, dtype=torch.float64).to(dtype).requires_grad_()
    module = torch.nn.RMSNorm(4, dtype=dtype)
    assert module.eps is None
    y = rms_norm(x, module.weight, module.eps, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(y, module(x))


@pytest.mark.parametrize("fn", [layer_norm, rms_norm], ids=["layer_norm", "rms_norm"])
def test_eps_not_a_number_is_one_clear_error(fn: object) -> None:
    with pytest.raises(TypeError, match=r"`eps` must be a number, got '1e-5' \(str\)\. Pass a float"):
        fn(torch.randn(2, 4), None, eps="1e-5", backend="reference")  # type: ignore[operator]


@pytest.mark.parametrize("shape", [(4, 0), (0, 0), (2, 0, 0)], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_no_features_behaves_as_eager(shape: tuple[int, ...], rms: bool) -> None:
    """Rows of no features (``nn.LayerNorm(0)``) give an empty output and empty gradients, as ``F.layer_norm`` does;
    the function used to fail on reshaping the empty input to ``(-1, 0)``."""
    x, w, b = leaves(torch.randn(shape), torch.ones(0), torch.zeros(0))
    assert x is not None and w is not None and b is not None
    y = rms_norm(x, w, 1e-6, backend="reference") if rms else layer_norm(x, w, b, 1e-5, backend="reference")
    y.sum().backward()
    assert y.shape == x.shape
    assert x.grad is not None and x.grad.shape == x.shape
    assert w.grad is not None and w.grad.shape == (0,)


@pytest.mark.parametrize("fn", [layer_norm, rms_norm], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
def test_zero_dim_input_is_one_clear_error(fn: object, backend: str) -> None:
    """A 0-d tensor has no last dimension to normalise: one clear error, not ``IndexError: tuple index out of
    range``."""
    name = "layer_norm" if fn is layer_norm else "rms_norm"
    with pytest.raises(ValueError, match=rf"^`x` of `{name}` must have at least one dimension .*got a 0-d tensor"):
        fn(torch.tensor(1.0), backend=backend)  # type: ignore[operator]
