"""``warmup_steps="auto"``: end ``ddp_1bit``'s fp32 warm-up when the optimizer's own statistics have settled.

What the warm-up is for: the compressed stage freezes Adam's variance (``D = sqrt(v̂) + eps`` scales every step that
follows, :mod:`~lightning_accel.comm.momentum`). Two cases:

- With ``variance_refresh > 0`` (the default) the frozen variance is re-estimated by fp32 steps ``R, 3R, 7R, ...``
  steps into the compressed stage, so the freeze need not wait: the warm-up is :data:`AUTO_MIN_WARMUP` steps.
  Measured on ``benchmarks/localsteps.py``'s LM at 4 processes (1-bit forced, 240 steps): warm-up 10 + refreshes
  1.9975 held-out loss against DDP's 1.9972; the settled-or-15 % rule below (it ended at the cap, 36 steps) +
  refreshes 2.032. Starting compressed at the peak of the LR warm-up loses more than an early freeze that the
  refreshes correct.
- With ``variance_refresh=0`` the variance stays frozen for the rest of the fit, so the warm-up ends once ``v̂`` has
  stopped trending (the test below), and no later than the rule 1-bit Adam's authors give, ~15 % of training.

SGD with momentum and the gradient path freeze nothing: they only need DDP's rebuilt buckets and the momentum buffers
(step 2), and compress from :data:`AUTO_MIN_WARMUP`.

The test (Adam and AdamW): every :data:`CHECK_EVERY` optimizer steps from :data:`AUTO_MIN_WARMUP` on, each parameter
tensor's mean bias-corrected variance is compared with its value :data:`CHECK_EVERY` steps earlier; the warm-up ends
when the element-weighted relative change ``sum_i n_i |mean_i(v̂_t) - mean_i(v̂_{t-k})| / sum_i n_i mean_i(v̂_t)`` is
below :data:`STABLE_CHANGE`. Why per-tensor means: a single element's ``v̂`` keeps the noise of its own squared
gradients (with ``β2 = 0.95`` it moves ~20 % every 5 steps for ever on ``benchmarks/localsteps.py``'s LM), while a
tensor's mean follows the trend the frozen variance must not miss (there it falls below 10 % between steps 30 and 40
of 240, for ``β2`` 0.95 and 0.999 alike). Why means and not sums: a tensor that changes size between two checks
(``StructuredPruning`` keeps the strongest channels) keeps its mean, while its sum drops with the channels removed and
would pass for a trend (one more check before the warm-up ends). The change is MAX-reduced across ranks (one float
per check), so every rank ends the warm-up at the same step even if their states differed by rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["AUTO_MIN_WARMUP", "CHECK_EVERY", "FALLBACK_FRACTION", "STABLE_CHANGE", "WarmupWatch", "warmup_cap"]

#: the earliest step ``"auto"`` compresses from (and SGD's / the gradient path's warm-up)
AUTO_MIN_WARMUP = 10
#: optimizer steps between two checks of the variance
CHECK_EVERY = 5
#: the largest relative change of the per-tensor mean variance over :data:`CHECK_EVERY` steps that counts as settled
STABLE_CHANGE = 0.10
#: the latest end of the warm-up, as a fraction of the fit's optimizer steps (1-bit Adam's ~15 % rule)
FALLBACK_FRACTION = 0.15
#: the latest end when the fit's length is unknown (``max_steps=-1`` with unbounded epochs)
UNBOUNDED_CAP = 1000


def warmup_cap(total_steps: float) -> int:
    """The latest step ``"auto"`` ends the warm-up at: 15 % of ``total_steps`` (at least :data:`AUTO_MIN_WARMUP`),
    :data:`UNBOUNDED_CAP` when the fit's length is not finite."""
    if not math.isfinite(total_steps) or total_steps <= 0:
        return UNBOUNDED_CAP
    return max(AUTO_MIN_WARMUP, round(FALLBACK_FRACTION * total_steps))


class WarmupWatch:
    """Decides where ``warmup_steps="auto"`` ends, one optimizer step at a time (collective at its checks).

    Args:
        optimizers: the Adam/AdamW optimizers whose variance is watched (empty: the warm-up is
            :data:`AUTO_MIN_WARMUP`, nothing is frozen).
        cap: the step the warm-up ends at if the variance has not settled (:func:`warmup_cap`).
        group: the process group to agree over (None: the default group).
        refreshed: the variance will be refreshed in the compressed stage (``variance_refresh > 0``): end at
            :data:`AUTO_MIN_WARMUP` without watching.
        device: where the 1-float agreement tensor lives (the process group's device).

    Attributes:
        changes: ``[(step, change)]``, every check made.
        reason: why the warm-up ended (for the log), once it has.
    """

    def __init__(
        self,
        optimizers: Sequence[Optimizer],
        cap: int,
        *,
        refreshed: bool = False,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.optimizers = list(optimizers)
        self.cap = max(AUTO_MIN_WARMUP, int(cap))
        self.refreshed = refreshed
        self.group = group
        self.device = device or torch.device("cpu")
        self._last: torch.Tensor | None = None
        self._checked: int | None = None  # the step of the last check
        self.changes: list[tuple[int, float]] = []
        if not self.optimizers:
            self.reason = "nothing to freeze (no Adam/AdamW variance)"
        elif refreshed:
            self.reason = "the frozen variance is refreshed during the compressed stage (`variance_refresh`)"
        else:
            self.reason = ""

    @property
    def watching(self) -> bool:
        """Whether the end depends on the variance (else it is :data:`AUTO_MIN_WARMUP`, for :attr:`reason`)."""
        return bool(self.optimizers) and not self.refreshed

    def _means(self) -> torch.Tensor | None:
        """``[mean_i(v̂), n_i]`` per watched tensor that has a variance (fp64, shape ``(2, tensors)``), or None before
        any has."""
        out: list[torch.Tensor] = []
        for opt in self.optimizers:
            for group in opt.param_groups:
                beta2 = float(group["betas"][1])
                for p in group["params"]:
                    s = opt.state.get(p, {})
                    v, step = s.get("exp_avg_sq"), int(s.get("step", 0))
                    if v is None or step == 0:
                        continue  # not reached yet (frozen, or unused so far): nothing to freeze either
                    mean = v.double().mean() / (1 - beta2**step)
                    out.append(torch.stack([mean, torch.tensor(float(v.numel()), dtype=torch.float64)]))
        return torch.stack(out, dim=1) if out else None

    def end_at(self, step: int) -> bool:
        """Whether the warm-up ends before step ``step`` (the step about to run). Call it on every rank at every
        warm-up step: the checks (every :data:`CHECK_EVERY` steps from :data:`AUTO_MIN_WARMUP`) all-reduce one float.
        Called again at the same step (several optimizers stepping after one backward), it does not check again: the
        first optimizer's update would pass for the variance settling."""
        if step < AUTO_MIN_WARMUP:
            return False
        if not self.watching:
            return True
        if step >= self.cap:
            self.reason = f"the cap, {FALLBACK_FRACTION:.0%} of the fit"
            return True
        if (step - AUTO_MIN_WARMUP) % CHECK_EVERY or step == self._checked:
            return False
        self._checked = step
        means = self._means()
        last, self._last = self._last, means
        if means is None or last is None or last.shape != means.shape:
            change = math.inf
        else:
            # `last` is on the CPU when it came from a checkpoint; weighted by today's sizes
            mean, n = means[0], means[1]
            moved = (n * (mean - last[0].to(means.device)).abs()).sum()
            change = float(moved / (n * mean.abs()).sum().clamp_min(1e-300))
        agreed = torch.tensor([change if math.isfinite(change) else 1e300], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            agreed = agreed.to(self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        change = float(agreed.item())
        change = math.inf if change >= 1e300 else change
        self.changes.append((step, change))
        if change < STABLE_CHANGE:
            self.reason = f"the variance moved {change:.1%} over the last {CHECK_EVERY} steps"
            self._last = None
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """What the next check compares against, for checkpoints: ``{"last", "changes"}`` (``last``: a CPU copy of
        the previous check's per-tensor means and sizes, shape ``(2, tensors)``, or None; ``changes``:
        :attr:`changes`). Tensors, ints, floats and lists only, so ``torch.load(weights_only=True)`` reads it back.

        Without it, a fit resumed between two checks would compare its first check with nothing (a change of
        ``inf``) and end the warm-up :data:`CHECK_EVERY` or more steps later than the uninterrupted fit.
        """
        return {
            "last": None if self._last is None else self._last.detach().to("cpu", copy=True),
            "changes": [[step, change] for step, change in self.changes],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (taken at the same step as the optimizer states it goes with)."""
        last = state.get("last")
        # a 1-D `last` holds the per-tensor sums earlier versions kept: not comparable with means, so the next check
        # compares with nothing (one check later, as a resume between two checks did then)
        self._last = None if last is None or last.dim() != 2 else last.to(torch.float64)
        self.changes = [(int(step), float(change)) for step, change in state.get("changes", [])]
