"""``LinearDropoutFunction`` (autograd) and :func:`linear_dropout` with backend dispatch.

Compared with eager ``dropout(linear(x)) + residual``, the function saves only ``x``, ``weight`` and an integer seed:
no GEMM output and no mask (eager autograd keeps a bool mask of the output's size, and the dropout output for the add).
With an ``activation`` it also saves the pre-activation (which eager's activation saves too), not the mask.

FLOP counting (``torch.utils.flop_counter.FlopCounterMode``, hence ``PerformanceMonitor``'s MFU) counts what eager
``F.linear`` counts: ``2 * M * N * K`` for the forward GEMM and as much for each of the input and weight gradients;
bias, activation, dropout and residual count zero, as their eager ops do. The backward and ``gemm="torch"`` run the
GEMMs as ``aten.mm``; the Triton GEMM (``gemm="triton"``) runs as the op ``lightning_accel::linear_dropout_gemm``,
whose FLOP formula reports the product it computes (a kernel launch is no op a counter can see).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import register_flop_formula

from lightning_accel._utils.checks import SEED_MAX, SEED_MIN, check_bool, check_choice, check_int, check_number
from lightning_accel._utils.rank import is_global_zero
from lightning_accel._utils.triton import Backend, resolve_backend, use_triton
from lightning_accel.ops.activation import Activation, activation_forward, check_activation
from lightning_accel.ops.linear_dropout import reference

__all__ = ["LinearDropoutFunction", "linear_dropout", "new_seed"]

# the reasons `gemm="triton"` fell back to the torch GEMM that this process has warned about: a training step calls
# the function once per fused Linear, and one warning per reason says all there is to say
_GEMM_FALLBACK_WARNED: set[str] = set()


def _warn_gemm_fallback(reason: str, fix: str = "") -> None:
    """Say once per process (on global rank 0: every rank falls back alike) that ``gemm="triton"`` is not used."""
    if reason in _GEMM_FALLBACK_WARNED or torch.compiler.is_compiling():
        return
    _GEMM_FALLBACK_WARNED.add(reason)
    if is_global_zero():
        warnings.warn(
            f"linear_dropout: `gemm='triton'` is not used: {reason}, so the torch GEMM computes `x @ weight.T` (same "
            f"result, unfused). {fix}Pass gemm='torch' to silence this.",
            UserWarning,
            stacklevel=3,
        )


# the Triton GEMM + epilogue as an op of its own, so that a FLOP counter sees the product (a library kernel, not
# `torch.library.custom_op`, whose dispatch costs ~2.5x as much; see conv_bn_relu.function)
_LIB = torch.library.Library("lightning_accel", "FRAGMENT")
_LIB.define(
    "linear_dropout_gemm(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, int seed, float p, "
    "ScalarType out_dtype, str activation) -> (Tensor, Tensor)"
)


def _linear_dropout_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: int,
    p: float,
    out_dtype: torch.dtype,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.triton.forward` with ``gemm="triton"`` for a 2-D ``x``; ``pre`` is empty without an activation."""
    from lightning_accel.ops.linear_dropout import triton as kernels

    out, pre = kernels.forward(x, weight, bias, residual, seed, p, out_dtype, "triton", activation)  # type: ignore[arg-type]
    return out, pre if pre is not None else x.new_empty((0,))


def _linear_dropout_gemm_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: int,
    p: float,
    out_dtype: torch.dtype,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs' shapes and dtypes (``pre`` has no elements without an activation: an op returns no None)."""
    m, n = x.shape[0], weight.shape[0]
    return x.new_empty((m, n), dtype=out_dtype), x.new_empty((m, n) if activation != "none" else (0,))


# CompositeExplicitAutograd (not Implicit): a dispatch mode sees the op itself, not what runs inside it
_LIB.impl("linear_dropout_gemm", _linear_dropout_gemm, "CompositeExplicitAutograd")
torch.library.register_fake("lightning_accel::linear_dropout_gemm", _linear_dropout_gemm_fake, lib=_LIB)


@register_flop_formula(torch.ops.lightning_accel.linear_dropout_gemm)
def _linear_dropout_gemm_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    """``2 * M * N * K``: the product ``x @ weight.T`` (what ``aten.mm`` counts for it); the epilogue counts zero."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]


def new_seed() -> int:
    """A dropout seed from torch's default CPU generator (so ``torch.manual_seed`` makes runs repeatable, no sync)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


class LinearDropoutFunction(torch.autograd.Function):
    """``dropout(act(x @ weight.T + bias), p) (+ residual)``, the dropout mask regenerated from ``seed`` in backward.

    All tensors must already have their compute dtypes (the :func:`linear_dropout` wrapper applies autocast). The
    output dtype is ``x``'s, promoted with the residual's (as eager ``residual + y`` would).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        p: float,
        seed: int,
        backend: Backend,
        gemm: str,
        activation: Activation = "none",
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = math.prod(lead)  # not reshape(-1, K): -1 is ambiguous for an empty tensor (K = 0, nn.Linear(0, N))
        x2 = x.reshape(rows, x.shape[-1])
        r2 = residual.reshape(rows, residual.shape[-1]).contiguous() if residual is not None else None
        out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
        on_triton = use_triton(x, backend)
        if on_triton:
            from lightning_accel.ops.linear_dropout import triton as kernels

            if gemm == "triton":
                out, pre = torch.ops.lightning_accel.linear_dropout_gemm(
                    x2, weight, bias, r2, seed, p, out_dtype, activation
                )
                pre = pre if activation != "none" else None
            else:
                out, pre = kernels.forward(x2, weight, bias, r2, seed, p, out_dtype, gemm, activation)
        else:
            y = torch.mm(x2, weight.t())
            out, pre = reference.epilogue_act_forward(y, bias, r2, seed, p, out_dtype, activation)
        ctx.save_for_backward(x2, weight, pre)
        ctx.p, ctx.seed, ctx.on_triton, ctx.act = p, seed, on_triton, activation
        ctx.has_bias, ctx.bias_dtype = bias is not None, bias.dtype if bias is not None else None
        ctx.has_residual, ctx.res_dtype = residual is not None, residual.dtype if residual is not None else None
        ctx.lead = lead
        return out.view(*lead, weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        x2, weight, pre = ctx.saved_tensors
        d2 = dout.reshape(x2.shape[0], dout.shape[-1])
        if ctx.on_triton:
            from lightning_accel.ops.linear_dropout import triton as kernels

            dz = kernels.dropout_backward(d2, ctx.seed, ctx.p, x2.dtype, pre, ctx.act)
        else:
            dz = reference.dropout_backward(d2, ctx.seed, ctx.p, x2.dtype, pre, ctx.act)
        dx = dw = db = dres = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(dz, weight).view(*ctx.lead, weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = torch.mm(dz.t(), x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dz.sum(0, dtype=torch.float32 if dz.dtype in (torch.float16, torch.bfloat16) else dz.dtype)
            db = db.to(ctx.bias_dtype)
        if ctx.has_residual and ctx.needs_input_grad[3]:
            dres = dout.to(ctx.res_dtype)
        return dx, dw, db, dres, None, None, None, None, None


def linear_dropout(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    p: float = 0.0,
    training: bool = True,
    residual: torch.Tensor | None = None,
    seed: int | None = None,
    backend: Backend = "auto",
    gemm: Literal["torch", "triton"] = "torch",
    activation: Activation = "none",
) -> torch.Tensor:
    """``dropout(act(F.linear(x, weight, bias)), p, training) (+ residual)`` in one fused pass after the GEMM.

    Honours ``torch.autocast``: inside an autocast region ``x``, ``weight`` and ``bias`` are cast to the autocast
    dtype first (as ``F.linear`` would be), outside of the function so gradients flow back to float32 parameters.

    Args:
        x: input (..., K).
        weight: (N, K).
        bias: (N,), or a bias that broadcasts to it as ``F.linear`` allows (``()`` or ``(1,)``), or None.
        p: dropout probability in [0, 1]. ``p=1`` drops everything, as ``nn.Dropout(p=1)`` does: the output is
            zeros (plus ``residual``) and ``x``, ``weight`` and ``bias`` get zero gradients; it runs eager ops.
        training: apply dropout (``False``: ``p`` is ignored).
        residual: (..., N) tensor added after dropout, or None.
        seed: the dropout seed, ``0 .. 2**32 - 1`` (unused without dropout). On every path the same seed, ``p``, output
            shape and device give the same mask, call after call, without touching torch's global generator. The
            ``"reference"`` and ``"eager"`` paths (so ``"auto"`` off CUDA) draw it from a ``torch.Generator`` seeded
            with ``seed`` and get the same bits as each other; the Triton kernels draw it with Philox ``tl.rand`` (a
            different, equally valid mask for the same seed). ``None`` (default): the fused paths draw a seed from
            torch's CPU generator, the eager path calls ``F.dropout`` (torch's generator for the device), so
            ``torch.manual_seed`` makes runs repeatable either way.
        backend: ``"auto"`` (Triton on CUDA, eager ``F.linear`` + ``F.dropout`` elsewhere and, for dropout without
            a ``seed``, inside ``torch.compile`` on every device; with a ``seed``, the seeded mask instead of
            ``F.dropout``), ``"triton"``, ``"reference"`` (the function's torch path, mask
            from a ``torch.Generator``) or ``"eager"``.
        gemm: ``"torch"`` (cuBLAS GEMM + Triton epilogue) or ``"triton"`` (GEMM and epilogue in one Triton kernel).
            Where the Triton GEMM cannot run (a path without Triton kernels, such as ``"auto"`` off CUDA; float64;
            bf16 under the interpreter) the torch GEMM computes the same product, and a ``UserWarning`` says so
            once per reason and process, on global rank 0.
        activation: applied before dropout: ``"none"`` (default), ``"relu"``, ``"relu6"``, ``"hardswish"``,
            ``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` (``nn.GELU(approximate="tanh")``).

    float64 inputs (``x`` or ``residual``) take the torch path on ``backend="triton"`` too: the kernels compute in
    float32, and float64 gets float64 results, as from the eager ops.

    Raises:
        TypeError: for a ``p`` that is not a number, a ``training`` that is not True or False, or a ``seed`` that is
            not an integer (or None).
        ValueError: for ``p`` outside [0, 1], a ``seed`` outside ``0 .. 2**32 - 1`` (the seeds of
            ``lightning.seed_everything``), a 0-d ``x``, or a ``weight``, ``bias`` or ``residual`` whose shape does not
            fit ``x``.
    """
    if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):  # the check only when it fails
        check_number("p", p, low=0, high=1, fix="Use p=0 for no dropout, p=1 to drop everything.")
    if gemm not in ("torch", "triton"):
        check_choice("gemm", gemm, ("torch", "triton"))
    if not isinstance(training, bool):  # a string is truthy: training="no" applied dropout
        check_bool("training", training, fix="Pass the module's `training` flag (`nn.Module.training`).")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        # torch's generator (and Triton's seed argument) fail deep inside on these, naming no argument
        check_int(
            "seed", seed, low=SEED_MIN, high=SEED_MAX, allow_none=True,
            fix="Any seed `lightning.seed_everything` takes works; None draws one from torch's generator.",
        )  # fmt: skip
    if x.dim() == 0:  # `x.shape[-1]` below would stop with an IndexError naming nothing
        raise ValueError(
            "`x` must have at least one dimension (..., K), got a 0-d tensor (shape ()). Pass the features as "
            "the last dimension, e.g. `x.reshape(1)` for one feature."
        )
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"`x` has {x.shape[-1]} input features but `weight` has shape {tuple(weight.shape)}; expected (N, "
            f"{x.shape[-1]})."
        )
    if residual is not None and residual.shape != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(
            f"`residual` must have the output's shape {(*x.shape[:-1], weight.shape[0])}, got {tuple(residual.shape)}."
        )
    n = weight.shape[0]
    if bias is not None and not (bias.dim() <= 1 and bias.numel() in (1, n)):
        raise ValueError(
            f"`bias` must have shape ({n},) (or () / (1,), which broadcast to it), got {tuple(bias.shape)}. Pass "
            "one bias per output feature."
        )
    act = check_activation(activation) if activation != "none" else "none"
    p = p if training else 0.0
    path = resolved = resolve_backend(x, backend)
    if backend == "auto" and p > 0 and seed is None and torch.compiler.is_compiling():
        # Under torch.compile: F.linear + F.dropout, which Dynamo traces and the compiler fuses itself. The fused
        # function draws its seed with Tensor.item(), a graph break (an error under fullgraph=True).
        path = "eager"
    if p >= 1:
        # everything dropped: F.dropout's zeros (no mask to draw, so no seed either); the fused paths scale the kept
        # values by 1 / (1 - p), whose gradient through the mask would be 0 * inf = NaN
        path = "eager"
    elif path == "triton" and torch.float64 in (x.dtype, residual.dtype if residual is not None else None):
        # the kernels compute (and load a residual) in float32: float64 keeps float64 on the torch path
        path = "reference"
    if gemm == "triton" and p < 1:
        _check_fused_gemm(x, backend, resolved, path)
    if path == "eager":
        y = activation_forward(F.linear(x, weight, bias), act)
        # F.dropout takes no seed: with one, the reference path's mask (same generator, same 2-D shape, same bits)
        y = reference.apply_dropout(y, seed, p) if 0 < p < 1 and seed is not None else F.dropout(y, p, training=p > 0)
        return y if residual is None else residual + y
    seed = (new_seed() if p > 0 else 0) if seed is None else seed  # no draw without dropout: RNG streams stay as eager
    if bias is not None and bias.shape != (n,):
        bias = bias.expand(n)  # the kernels read N values; autograd sums the gradient back to the broadcast shape
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return LinearDropoutFunction.apply(x, weight, bias, residual, p, seed, path, gemm, act)
    weight = weight.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    return LinearDropoutFunction.apply(x, weight, bias, residual, p, seed, path, gemm, act)


def _check_fused_gemm(x: torch.Tensor, backend: str, resolved: str, path: str) -> None:
    """Warn (once per reason) when a ``gemm="triton"`` call runs another GEMM: asked for explicitly, it must not be
    dropped without a word. ``resolved`` is the path ``backend`` picks for ``x``, ``path`` the one the call takes."""
    if resolved != "triton":
        where = f" for {x.device.type} tensors" if backend == "auto" else ""
        _warn_gemm_fallback(
            f"backend={backend!r} runs the {resolved!r} torch path{where}, without Triton kernels",
            "The fused GEMM needs CUDA tensors with backend='auto' or 'triton' (or backend='triton' with "
            "TRITON_INTERPRET=1 set before `import triton` on a CPU). ",
        )
    elif path != "triton":  # the only other switch, torch.compile's, returns early in `_warn_gemm_fallback`
        _warn_gemm_fallback("float64 inputs take the torch path (the Triton kernels compute in float32)")
    else:
        from lightning_accel.ops.linear_dropout import triton as kernels

        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        if not kernels.fused_gemm_supported(dtype):
            _warn_gemm_fallback(f"the Triton interpreter computes {dtype} `tl.dot` wrongly")
