"""``NormFunction`` (autograd) and the ``layer_norm`` / ``rms_norm`` entry points with backend dispatch."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from lightning_accel._utils.checks import check_number
from lightning_accel._utils.triton import Backend, ResolvedBackend, resolve_backend, use_triton
from lightning_accel.ops.norm import reference

__all__ = ["MAX_TRITON_FEATURES", "NormFunction", "layer_norm", "rms_norm"]

#: The widest rows the Triton kernels normalise (one row per program, held in registers: wider ones would spill).
#: ``backend="auto"`` runs wider rows on the function's torch path; a forced ``"triton"`` refuses them.
MAX_TRITON_FEATURES = 65536


def _impl(on_triton: bool) -> Any:
    if on_triton:
        from lightning_accel.ops.norm import triton as impl  # lazy: importing triton is slow

        return impl
    return reference


class NormFunction(torch.autograd.Function):
    """LayerNorm (``rms=False``) or RMSNorm (``rms=True``) over the last dimension with a hand-written backward.

    Saves the input and two float32 numbers per row (mean, 1/std), like ``torch``'s own kernel. The output has the
    input's dtype; statistics are accumulated in float32 (float64 inputs stay float64 on the reference path).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        rms: bool,
        backend: Backend,
    ) -> torch.Tensor:
        shape = x.shape
        # not reshape(-1, N): -1 is ambiguous for an empty tensor (N = 0 features)
        x2 = x.reshape(math.prod(shape[:-1]), shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if weight is not None:
            # a strided view (a slice of a packed buffer) copied once here, and saved so, not again in backward
            weight = weight.contiguous()
        on_triton = use_triton(x, backend)
        y, mean, rstd = _impl(on_triton).norm_forward(x2, weight, bias, eps, rms)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.on_triton, ctx.has_bias = rms, on_triton, bias is not None and not rms
        return y.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2, weight, mean, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape[0], dy.shape[-1])
        dx, dw, db = _impl(ctx.on_triton).norm_backward(dy2, x2, weight, mean, rstd, ctx.rms, ctx.has_bias)
        return dx.view(dy.shape), dw, db, None, None, None


def _check(x: torch.Tensor, weight: torch.Tensor | None, name: str, bias: torch.Tensor | None = None) -> None:
    """Refuse a 0-d ``x``, and a ``weight`` or ``bias`` that is not ``(N,)`` for the last dimension ``N`` of ``x``.

    ``F.layer_norm`` refuses them too; without this check the torch path would broadcast a ``(1,)`` or ``(M, N)``
    bias silently and the Triton kernels would read ``N`` elements from it (out of bounds).
    """
    if x.dim() == 0:
        raise ValueError(
            f"`x` of `{name}` must have at least one dimension (the features normalised are the last one), got a 0-d "
            "tensor. Give it a feature dimension, e.g. `x.view(1)`."
        )
    n = x.shape[-1]
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (n,):
            raise ValueError(
                f"`{arg}` of `{name}` must have shape ({n},), one value per feature of the last dimension of `x`, "
                f"got {tuple(t.shape)}. Pass `normalized_shape` equal to the last dimension only."
            )


def _check_eps(eps: object, name: str) -> float:
    """``eps`` as a float; a clear TypeError (naming ``name``'s argument) for None or a non-number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        check_number("eps", eps, fix=f"Pass a float such as 1e-5 to `{name}`.")
    return float(eps)  # type: ignore[arg-type]


def _default_rms_eps(dtype: torch.dtype) -> float:
    """``F.rms_norm``'s epsilon for ``eps=None``: that of the dtype the op computes in (float32 for float16, bfloat16
    and float32 inputs, float64 for float64), not of the input's own dtype (bfloat16's would be 0.0078)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _path(x: torch.Tensor, backend: Backend) -> ResolvedBackend:
    """:func:`resolve_backend`'s path, but the torch path instead of the kernels for float64, which they compute in
    float32 (a float64 row with a large mean lost 0.3 % to them, measured; the torch path keeps float64), for rows
    of no features (a kernel block cannot be 0 wide; there is nothing to compute) and, when ``backend`` is
    ``"auto"``, for rows wider than :data:`MAX_TRITON_FEATURES`: the default must not pick kernels that refuse the
    input (a fused ``nn.LayerNorm(100_000)`` failed at its first call on CUDA, telling the user to change a backend
    they had not chosen)."""
    path = resolve_backend(x, backend)
    if path != "triton":
        return path
    n = x.shape[-1]
    wide = backend == "auto" and n > MAX_TRITON_FEATURES
    return "reference" if x.dtype == torch.float64 or n == 0 or wide else path


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    backend: Backend = "auto",
) -> torch.Tensor:
    """LayerNorm over the last dimension: Triton kernels on CUDA, the torch reference elsewhere.

    Args:
        x: input (..., N).
        weight: (N,) scale, or None.
        bias: (N,) shift, or None.
        eps: variance epsilon.
        backend: ``"auto"`` (Triton on CUDA, ``F.layer_norm`` elsewhere), ``"triton"`` (force; a CPU needs
            ``TRITON_INTERPRET=1``; float64 inputs take the torch path, which keeps float64), ``"reference"`` (the
            function's torch path) or ``"eager"``.

    Raises:
        TypeError: for an ``eps`` that is not a number.
        ValueError: for a 0-d ``x``, or a ``weight`` or ``bias`` that is not ``(N,)`` (``F.layer_norm`` refuses them
            too).
    """
    _check(x, weight, "layer_norm", bias)
    eps = _check_eps(eps, "layer_norm")
    path = _path(x, backend)
    if path == "eager":
        return reference.layer_norm(x, weight, bias, eps)
    return NormFunction.apply(x, weight, bias, eps, False, path)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6, backend: Backend = "auto"
) -> torch.Tensor:
    """RMSNorm over the last dimension (``x / sqrt(mean(x**2) + eps) * weight``); dispatch as :func:`layer_norm`.

    ``eps=None`` (``nn.RMSNorm``'s default) means what it means to ``F.rms_norm``: the machine epsilon of the compute
    dtype, float32's (about 1.2e-7) for float16, bfloat16 and float32 inputs, float64's for float64 ones.
    """
    _check(x, weight, "rms_norm")
    eps = _default_rms_eps(x.dtype) if eps is None else _check_eps(eps, "rms_norm")
    path = _path(x, backend)
    if path == "eager":
        return reference.rms_norm(x, weight, eps)
    return NormFunction.apply(x, weight, None, eps, True, path)
