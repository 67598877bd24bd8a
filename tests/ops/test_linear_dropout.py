"""Linear -> Dropout (-> + residual): the autograd function's torch path against the oracle, mask regeneration,
autocast, gradcheck, argument errors. The Triton kernels: ``test_triton_interpreter.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from lightning_accel.ops.linear_dropout import LinearDropoutFunction, linear_dropout, reference
from tests.ops._cases import DTYPE_IDS, DTYPES, assert_close, assert_grad_close, leaves

SHAPES = [((13, 19), 23), ((3, 7, 33), 5), ((1, 1), 1)]  # (input shape, out features)


def _inputs(in_shape: tuple[int, ...], n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    k = in_shape[-1]
    x = torch.randn(in_shape).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = (torch.randn(n) * 0.1).to(dtype)
    r = torch.randn(*in_shape[:-1], n).to(dtype)
    return x, w, b, r


@pytest.mark.parametrize(("in_shape", "n"), SHAPES, ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_forward_backward_match_reference(
    in_shape: tuple[int, ...], n: int, dtype: torch.dtype, atol: float, rtol: float, p: float, with_residual: bool
) -> None:
    torch.manual_seed(0)
    x, w, b, r = _inputs(in_shape, n, dtype)
    r = r if with_residual else None
    dy = torch.randn(*in_shape[:-1], n).to(dtype)
    seed = 1234
    keep = reference.dropout_mask(seed, (x[..., 0].numel(), n), p, "cpu").view(*in_shape[:-1], n) if p else None
    xs, ws, bs, rs = leaves(x, w, b, r)
    y = linear_dropout(xs, ws, bs, p, True, rs, seed=seed, backend="reference")
    y.backward(dy)
    xr, wr, br, rr = leaves(x.float(), w.float(), b.float(), r.float() if r is not None else None)
    yr = reference.linear_dropout(xr, wr, br, keep, p, rr)
    yr.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, yr, atol, rtol)
    assert_grad_close(xs.grad, xr.grad, atol, rtol, factor=2)  # a GEMM over the rounded dropout gradient
    assert_grad_close(ws.grad, wr.grad, atol, rtol)
    assert_grad_close(bs.grad, br.grad, atol, rtol)
    if with_residual:
        assert_close(rs.grad, rr.grad, atol, rtol)


def test_mask_is_regenerated_not_stored_and_matches_forward() -> None:
    torch.manual_seed(0)
    x, w, b, _ = _inputs((64, 16), 32, torch.float32)
    xs = x.clone().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear_dropout(xs, w, None, 0.5, True, seed=7, backend="reference")
    # only x and weight are saved: no mask, no pre-dropout output
    assert sorted(tuple(t.shape) for t in saved) == [(32, 16), (64, 16)]
    dropped = y == 0
    assert 0.4 < dropped.float().mean().item() < 0.6
    # the gradient of y.sum() wrt the pre-dropout activations is zero exactly where forward dropped
    y.sum().backward()
    keep = ~dropped
    expected = (keep.float() / 0.5) @ w
    torch.testing.assert_close(xs.grad, expected)


def test_seed_drawn_from_torch_rng_makes_runs_repeatable() -> None:
    x, w = torch.randn(8, 4), torch.randn(6, 4)
    torch.manual_seed(3)
    a = linear_dropout(x, w, p=0.5, backend="reference")
    torch.manual_seed(3)
    b = linear_dropout(x, w, p=0.5, backend="reference")
    torch.manual_seed(4)
    c = linear_dropout(x, w, p=0.5, backend="reference")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_eval_means_no_dropout() -> None:
    x, w, b, r = _inputs((5, 6), 7, torch.float32)
    for backend in ("auto", "reference"):
        y = linear_dropout(x, w, b, 0.9, training=False, residual=r, backend=backend)  # type: ignore[arg-type]
        torch.testing.assert_close(y, reference.linear_dropout(x, w, b, None, 0.0, r))


def test_autocast_casts_like_linear_and_grads_reach_fp32_params() -> None:
    torch.manual_seed(0)
    x, w, b, r = _inputs((9, 8), 5, torch.float32)
    ws, bs = leaves(w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_dropout(x, ws, bs, 0.0, True, residual=r, backend="reference")
        y_plain = linear_dropout(x, ws, bs, 0.0, True, backend="reference")
        expected = torch.nn.functional.linear(x, w, b)
    assert y.dtype == torch.float32  # bf16 GEMM + fp32 residual promotes, as `residual + linear(x)` does
    assert y_plain.dtype == torch.bfloat16
    torch.testing.assert_close(y_plain, expected, atol=2e-2, rtol=2e-2)
    y.sum().backward()
    assert ws.grad is not None and ws.grad.dtype == torch.float32 and bs.grad.dtype == torch.float32


def test_gradcheck_float64() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return LinearDropoutFunction.apply(x, w, b, r, 0.25, 99, "reference", "torch")

    assert torch.autograd.gradcheck(fn, (x, w, b, r))


def test_bad_arguments() -> None:
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"`p` must be a number >= 0 and <= 1, got 1.5. Use p=0 for no dropout"):
        linear_dropout(x, w, p=1.5)
    with pytest.raises(TypeError, match=r"`p` must be a number >= 0 and <= 1, got False \(bool\)"):
        linear_dropout(x, w, p=False)
    with pytest.raises(ValueError, match="`weight` has shape"):
        linear_dropout(x, torch.randn(5, 3))
    with pytest.raises(ValueError, match="`residual` must have the output's shape"):
        linear_dropout(x, w, residual=torch.randn(3, 4))
    with pytest.raises(ValueError, match="`gemm` must be 'torch' or 'triton', got 'cublas'"):
        linear_dropout(x, w, gemm="cublas")  # type: ignore[arg-type]


def test_seed_is_honoured_on_the_eager_path() -> None:
    """``backend="auto"`` on a CPU runs eager ops; a given seed still fixes the mask, the reference path's bits, and
    leaves torch's global generator alone (``F.dropout`` would draw from it and ignore the seed)."""
    torch.manual_seed(0)
    x, w, b, r = _inputs((2, 5, 8), 16, torch.float32)
    state = torch.get_rng_state()
    a = linear_dropout(x, w, b, 0.5, True, r, seed=7)  # auto: eager ops on CPU
    again = linear_dropout(x, w, b, 0.5, True, r, seed=7, backend="eager")
    assert torch.equal(torch.get_rng_state(), state)
    other = linear_dropout(x, w, b, 0.5, True, r, seed=8)
    assert torch.equal(a, again) and not torch.equal(a, other)
    torch.testing.assert_close(a, linear_dropout(x, w, b, 0.5, True, r, seed=7, backend="reference"))
    xs = x.clone().requires_grad_()
    y = linear_dropout(xs, w, None, 0.5, True, seed=7)
    assert y.grad_fn is not None and "LinearDropout" not in type(y.grad_fn).__name__  # still the eager path
    y.sum().backward()
    keep = reference.dropout_mask(7, (10, 16), 0.5, "cpu").view(2, 5, 16)
    torch.testing.assert_close(xs.grad, (keep.float() / 0.5) @ w)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("bias_shape", [(), (1,)], ids=str)
def test_bias_that_broadcasts_like_f_linear(backend: str, bias_shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x, w, _, r = _inputs((3, 5), 6, torch.float32)
    b = torch.randn(bias_shape)
    bs, be = leaves(b, b)
    y = linear_dropout(x, w, bs, 0.0, True, r, backend=backend)  # type: ignore[arg-type]
    ye = torch.nn.functional.linear(x, w, be) + r
    torch.testing.assert_close(y, ye)
    dy = torch.randn_like(y)
    y.backward(dy)
    ye.backward(dy)
    assert bs.grad is not None and bs.grad.shape == bias_shape
    torch.testing.assert_close(bs.grad, be.grad)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("bias_shape", [(2,), (3, 6), (1, 6)], ids=str)
def test_bias_of_another_shape_refused(backend: str, bias_shape: tuple[int, ...]) -> None:
    x, w = torch.randn(3, 5), torch.randn(6, 5)
    with pytest.raises(ValueError, match=rf"^`bias` must have shape \(6,\) .*got {re.escape(str(bias_shape))}"):
        linear_dropout(x, w, torch.zeros(bias_shape), backend=backend)  # type: ignore[arg-type]


def test_auto_dropout_compiles_as_one_graph_where_auto_picks_the_fused_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA ``"auto"`` picks the fused function, whose seed draw (``Tensor.item()``) Dynamo cannot trace: inside
    ``torch.compile`` the call takes the ``F.dropout`` path instead, so ``fullgraph=True`` holds with dropout active.
    Off CUDA ``"auto"`` already means eager; the device's choice is simulated."""
    from lightning_accel.ops.linear_dropout import function

    monkeypatch.setattr(function, "resolve_backend", lambda where, backend: "reference")
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return linear_dropout(x, w, None, 0.5, True)

    y = torch.compile(f, fullgraph=True, backend="eager")(x, w)
    y.sum().backward()
    kept = y != 0
    assert 0 < int(kept.sum()) < y.numel()  # dropout ran
    torch.testing.assert_close(y[kept], (2 * (x @ w.t()))[kept].detach())
    assert w.grad is not None and bool(torch.isfinite(w.grad).all())
    # outside torch.compile the simulated device's fused function runs (a seed drawn, the mask regenerated)
    calls: list[int] = []
    real = function.LinearDropoutFunction.apply
    monkeypatch.setattr(function.LinearDropoutFunction, "apply", lambda *a: calls.append(1) or real(*a))
    f(x, w)
    assert calls == [1]


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize("seed", [None, 7], ids=["no_seed", "seed"])
def test_p_one_drops_everything_like_nn_dropout(backend: str, seed: int | None) -> None:
    """``p=1`` is what ``nn.Dropout(p=1)`` allows: zeros (plus the residual), zero gradients, no NaN (a scale of
    ``1 / (1 - p)`` would be infinite)."""
    torch.manual_seed(0)
    x, w, b, r = leaves(torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5), torch.randn(2, 3, 5))
    y = linear_dropout(x, w, b, 1.0, True, r, seed=seed, backend=backend, activation="gelu")  # type: ignore[arg-type]
    y.backward(torch.randn_like(y))
    assert r is not None and torch.equal(y, r.detach())
    for t in (x, w, b):
        assert t is not None and t.grad is not None
        assert torch.equal(t.grad, torch.zeros_like(t.grad))
    assert r.grad is not None and torch.isfinite(r.grad).all()
    eager = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Dropout(1.0))
    assert torch.equal(linear_dropout(x, eager[0].weight, eager[0].bias, 1.0, True, backend=backend), eager(x))  # type: ignore[arg-type]


@pytest.mark.parametrize(("k", "n"), [(0, 5), (4, 0), (0, 0)], ids=["no_inputs", "no_outputs", "neither"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_linear_without_features_behaves_as_eager(k: int, n: int, p: float) -> None:
    """``nn.Linear(0, N)`` outputs its bias, ``nn.Linear(K, 0)`` nothing; the fused function used to fail on
    reshaping the empty input to ``(-1, 0)``."""
    x, w, b, r = leaves(torch.randn(2, 3, k), torch.randn(n, k), torch.randn(n), torch.randn(2, 3, n))
    assert x is not None and w is not None and b is not None and r is not None
    y = linear_dropout(x, w, b, p, True, r, seed=1, backend="reference", activation="gelu")
    y.sum().backward()
    assert y.shape == (2, 3, n)
    if p == 0:
        torch.testing.assert_close(y, torch.nn.functional.gelu(b).expand(2, 3, n) + r)
    assert x.grad is not None and x.grad.shape == x.shape
    assert w.grad is not None and w.grad.shape == (n, k)
    assert b.grad is not None and b.grad.shape == (n,)


@pytest.mark.parametrize("backend", ["auto", "reference", "eager"])
@pytest.mark.parametrize(
    ("seed", "error"), [(1.5, TypeError), (True, TypeError), (-1, ValueError), (2**70, ValueError)], ids=str
)
def test_seed_outside_the_package_seed_range_is_one_clear_error(backend: str, seed: object, error: type) -> None:
    """A seed torch's generator cannot take used to fail inside it ("Overflow when unpacking long long", "manual_seed
    expected a long"), or on some paths only; every path takes the package's seed range."""
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(
        error, match=r"^`seed` must be an integer >= 0 and <= 4294967295 or None, got .*seed_everything"
    ):
        linear_dropout(x, w, p=0.5, seed=seed, backend=backend)  # type: ignore[arg-type]


def test_seed_at_the_top_of_the_range_draws_a_mask() -> None:
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    y = linear_dropout(x, w, p=0.5, seed=2**32 - 1, backend="reference")
    torch.testing.assert_close(y, linear_dropout(x, w, p=0.5, seed=2**32 - 1, backend="eager"))
