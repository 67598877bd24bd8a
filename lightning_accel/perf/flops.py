"""FLOPs of one training step, counted once with ``torch.utils.flop_counter.FlopCounterMode``.

The counter is a ``TorchDispatchMode``: while it is active every aten op pays a Python dispatch, so the step it
watches runs several times slower. :class:`StepFlopCounter` therefore watches exactly one step (the monitor excludes
that step from its timings) and is inactive afterwards: zero steady-state cost.

What is counted is torch's formulas, which cover matrix products (``mm``, ``addmm``, ``bmm``, ...), convolutions and
attention (``scaled_dot_product_attention``), forward and backward; normalisations, activations, other element-wise
ops and the optimizer count zero. The fused ops of :mod:`lightning_accel.ops` count as the eager modules they replace:
a Triton GEMM reports its product through a FLOP formula of its own op, and a convolution that a fused backward
recomputes to save memory counts zero (model FLOPs, as MFU defines them; not the hardware's extra work).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepFlopCounter", "precision_dtype"]


def precision_dtype(precision: str | None) -> torch.dtype:
    """The dtype whose peak FLOPs apply to a Lightning precision string (``"bf16-mixed"`` -> ``torch.bfloat16``).

    ``"32-true"`` maps to ``torch.float32``; on Ampere+ GPUs matmuls may use TF32 when
    ``torch.backends.cuda.matmul.allow_tf32`` is set, which the peak table accounts for under ``"tf32"``.
    """
    p = str(precision or "32-true")
    if p.startswith("bf16"):
        return torch.bfloat16
    if p.startswith("16"):
        return torch.float16
    if p.startswith("64"):
        return torch.float64
    if p.startswith("transformer-engine") or "fp8" in p:
        return torch.float8_e4m3fn
    return torch.float32


class StepFlopCounter:
    """Counts FLOPs between :meth:`start` and :meth:`stop` (one training step: forward, backward, optimizer; see the
    module docstring for which ops count).

    Safe to call :meth:`stop` twice or without :meth:`start`. A step that did not finish (an exception inside it)
    is :meth:`cancel`-led instead: its partial count (a forward without its backward) is not a step's FLOPs.
    """

    def __init__(self) -> None:
        self._mode: Any = None
        self.flops: int | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        """Begin counting (enters a ``FlopCounterMode`` without printing)."""
        from torch.utils.flop_counter import FlopCounterMode

        if self._mode is not None:
            return
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def stop(self) -> int | None:
        """Stop counting; returns (and stores) the total FLOPs, or the stored value if not counting."""
        if self._mode is None:
            return self.flops
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.flops = int(mode.get_total_flops())
        return self.flops

    def cancel(self) -> None:
        """Stop counting and drop what was counted since :meth:`start` (the step did not finish); :attr:`flops`
        keeps its earlier value (None when nothing was counted before). Safe without :meth:`start`."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
