"""Pure-torch LayerNorm / RMSNorm: the test oracle and the CPU path of :class:`~.function.NormFunction`.

``layer_norm``/``rms_norm`` are the oracles (plain autograd). ``norm_forward``/``norm_backward`` spell out the same math
the Triton kernels do (fp32 inside, statistics saved for the backward), so the hand-written backward is checked by
``gradcheck`` in float64 and the kernels are checked against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["layer_norm", "norm_backward", "norm_forward", "rms_norm"]


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Oracle: ``torch.nn.functional.layer_norm`` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Oracle: ``x / sqrt(mean(x**2) + eps) * weight``, in float32 (float64 stays) and cast back to ``x.dtype``."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def _acc(t: torch.Tensor) -> torch.Tensor:
    # accumulate half precision in float32, keep float64 for gradcheck
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise the rows of a 2-D ``x``; returns ``(y, mean, rstd)`` (``mean`` is zeros for RMSNorm).

    Args:
        x: (M, N) input.
        weight: (N,) scale or None.
        bias: (N,) shift or None (ignored when ``rms``).
        eps: added to the variance (LayerNorm) or the mean square (RMSNorm).
        rms: RMSNorm instead of LayerNorm.
    """
    xf = _acc(x)
    if rms:
        mean = torch.zeros(x.shape[0], dtype=xf.dtype, device=x.device)
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        xhat = xf * rstd[:, None]
    else:
        mean = xf.mean(-1)
        xc = xf - mean[:, None]
        rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
        xhat = xc * rstd[:, None]
    y = xhat
    if weight is not None:
        y = y * _acc(weight)
    if bias is not None and not rms:
        y = y + _acc(bias)
    return y.to(x.dtype), mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dx, dweight, dbias)`` of :func:`norm_forward` for a 2-D ``x``.

    With ``xhat`` the normalised row and ``g = weight * dy``:
    LayerNorm ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``;
    RMSNorm ``dx = rstd * (g - xhat * mean(g * xhat))``;
    ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)``.
    """
    xf, dyf = _acc(x), _acc(dy)
    xhat = (xf * rstd[:, None]) if rms else (xf - mean[:, None]) * rstd[:, None]
    g = dyf * _acc(weight) if weight is not None else dyf
    c1 = (g * xhat).mean(-1, keepdim=True)
    dx = g - xhat * c1 if rms else g - g.mean(-1, keepdim=True) - xhat * c1
    dx = (dx * rstd[:, None]).to(x.dtype)
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else None
    db = dyf.sum(0).to(weight.dtype if weight is not None else x.dtype) if has_bias else None
    return dx, dw, db
