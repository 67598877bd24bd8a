"""Plain-torch core of :class:`~lightning_accel.tune.guard.RollbackGuard`: the trigger rule and the bounded snapshot.

The rule (:class:`WatchRule`, applied by :class:`SeriesWatch` to one series: the training loss or the gradient norm):

1. **Non-finite streak.** A NaN/inf value extends a streak; ``nan_streak`` in a row trigger (``"nonfinite"``).
2. **Sustained spike.** After ``arm_after`` finite values the watch keeps an exponential moving mean (``ema_beta``)
   of the series and an EMA (``noise_beta``) of the noise variance, estimated from successive differences
   (``(x_t - x_t-1)^2 / 2``, which a smooth trend barely inflates). A value is an *outlier* when it lies more than
   ``spike_sigma`` noise standard deviations above the mean, the deviation floored at ``rel_floor`` of the mean (so a
   flat, nearly noiseless loss does not turn ordinary jitter into 100 sigma). ``spike_steps`` outliers in a row
   trigger (``"spike"``). Outliers do not update the statistics (a spike must not teach the watch that spikes are
   normal); a value below the mean is never an outlier, so a falling loss cannot trigger.
3. **Watch window.** For ``window_steps`` steps after a lever switches on, the stricter ``window_sigma`` /
   ``window_spike_steps`` apply, and the spike rule is armed even before ``arm_after`` values were seen.

Values are fed in order with :meth:`SeriesWatch.update`; a trigger is reported once, and the streaks restart.

The snapshot (:class:`Snapshot`): tensors of the model (parameters and buffers), the optimizers' state and
hyper-parameters, and small Python state (LR schedulers) copied into CPU buffers that are allocated once and reused
(pinned for CUDA tensors, copied ``non_blocking``), and restored *in place* (the live tensors keep their identity, so
DDP, fused modules and anything holding a parameter or a state tensor keeps working).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor  # public since torch 2.4, the oldest this project supports

from lightning_accel._utils.checks import check_int, check_number
from lightning_accel._utils.compat import copy_tensors
from lightning_accel.checkpoint.codec import buffer_strides

__all__ = ["Snapshot", "SeriesWatch", "Trigger", "WatchRule", "batch_loss", "local_shard", "unscaled_loss"]


@dataclass(frozen=True)
class WatchRule:
    """The trigger rule's parameters (see the module docstring), validated once.

    Args:
        nan_streak: non-finite values in a row that trigger.
        spike_sigma: an outlier lies more than this many (EMA) standard deviations above the EMA mean.
        spike_steps: outliers in a row that trigger.
        ema_beta: the mean's EMA decay per value (0.9: a memory of about 10 steps, so the mean follows a falling loss
            closely).
        noise_beta: the noise variance's EMA decay per value (0.98: about 50 steps, a steadier estimate).
        arm_after: finite values seen before the spike rule is armed (the statistics need to settle).
        rel_floor: the standard deviation used is at least this fraction of the mean's magnitude.
        window_steps: steps of stricter watch after a lever switches on.
        window_sigma: ``spike_sigma`` inside the window.
        window_spike_steps: ``spike_steps`` inside the window.
    """

    nan_streak: int = 1
    spike_sigma: float = 6.0
    spike_steps: int = 4
    ema_beta: float = 0.9
    noise_beta: float = 0.98
    arm_after: int = 20
    rel_floor: float = 0.05
    window_steps: int = 100
    window_sigma: float = 4.0
    window_spike_steps: int = 2

    def __post_init__(self) -> None:
        check_int("nan_streak", self.nan_streak, low=1)
        _check_finite("spike_sigma", self.spike_sigma, low_open=True, example="6.0")
        check_int("spike_steps", self.spike_steps, low=1)
        check_number("ema_beta", self.ema_beta, low=0, high=1, low_open=True, high_open=True)
        check_number("noise_beta", self.noise_beta, low=0, high=1, low_open=True, high_open=True)
        check_int("arm_after", self.arm_after, low=2, fix="The variance needs at least 2 values.")
        _check_finite("rel_floor", self.rel_floor, low_open=False, example="0.05")
        check_int("window_steps", self.window_steps, low=0)
        _check_finite("window_sigma", self.window_sigma, low_open=True, example="4.0")
        check_int("window_spike_steps", self.window_spike_steps, low=1)


def _check_finite(name: str, value: Any, *, low_open: bool, example: str) -> None:
    """A threshold of the spike rule: a number above 0 (``low_open``) or at least 0, and finite. An infinite one was
    taken and switched the spike rule off without a word (no value lies infinitely many deviations above the mean;
    an infinite ``rel_floor`` made the deviation NaN)."""
    fix = f"Pass a finite number, e.g. {example}."
    v = check_number(name, value, low=0, low_open=low_open, fix=fix)
    if not math.isfinite(v):
        expected = "a finite number " + ("> 0" if low_open else ">= 0")
        raise ValueError(f"`{name}` must be {expected}, got {value!r}. {fix}")


@dataclass(frozen=True)
class Trigger:
    """A triggered rule: which series, at which step, why (``"nonfinite"`` or ``"spike"``), and the step its streak
    began (the last good state is the one before it)."""

    series: str
    step: int
    kind: str
    streak_start: int
    value: float
    mean: float

    def describe(self) -> str:
        if self.kind == "nonfinite":
            return f"{self.series} non-finite ({self.value}) since step {self.streak_start}"
        return f"{self.series} spike: {self.value:.4g} vs EMA {self.mean:.4g}, sustained since step {self.streak_start}"


class SeriesWatch:
    """The rule of :class:`WatchRule` applied to one series (plain Python floats; no tensors, no syncs).

    Internal state (all in :meth:`state_dict`): ``count`` finite values seen, ``mean``/``var`` the EMA statistics,
    ``nan_run``/``spike_run`` the current streaks and the steps they began.
    """

    def __init__(self, name: str, rule: WatchRule) -> None:
        self.name = name
        self.rule = rule
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self.last = 0.0
        self.nan_run = 0
        self.nan_start = 0
        self.spike_run = 0
        self.spike_start = 0

    def _sigma(self) -> float:
        return max(math.sqrt(max(self.var, 0.0)), self.rule.rel_floor * abs(self.mean), 1e-12)

    def update(self, step: int, value: float, strict: bool = False) -> Trigger | None:
        """Feed the value of ``step``; ``strict``: inside a lever's watch window. Returns a trigger or None."""
        r = self.rule
        if not math.isfinite(value):
            if self.nan_run == 0:
                self.nan_start = step
            self.nan_run += 1
            self.spike_run = 0
            if self.nan_run >= r.nan_streak:
                self.nan_run = 0
                return Trigger(self.name, step, "nonfinite", self.nan_start, value, self.mean)
            return None
        self.nan_run = 0
        armed = self.count >= r.arm_after or (strict and self.count >= 2)
        if armed:
            sigma, need = (r.window_sigma, r.window_spike_steps) if strict else (r.spike_sigma, r.spike_steps)
            if value > self.mean + sigma * self._sigma():
                if self.spike_run == 0:
                    self.spike_start = step
                self.spike_run += 1
                if self.spike_run >= need:
                    self.spike_run = 0
                    return Trigger(self.name, step, "spike", self.spike_start, value, self.mean)
                return None  # an outlier: the statistics stay as they were
        self.spike_run = 0
        if self.count == 0:
            self.mean, self.var = value, 0.0
        else:
            # warm-up uses running averages (1/n) so the first values weigh equally
            warm = 1.0 - 1.0 / (self.count + 1)
            beta, noise_beta = min(r.ema_beta, warm), min(r.noise_beta, warm)
            self.mean += (1.0 - beta) * (value - self.mean)
            # the noise from successive differences (var(x_t - x_t-1) = 2 var(noise)): a falling trend does not
            # inflate it the way deviations from a lagging mean would
            d = value - self.last
            self.var = d * d / 2.0 if self.count == 1 else noise_beta * self.var + (1.0 - noise_beta) * d * d / 2.0
        self.last = value
        self.count += 1
        return None

    def reset_streaks(self) -> None:
        self.nan_run = self.spike_run = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "var": self.var,
            "last": self.last,
            "nan_run": self.nan_run,
            "nan_start": self.nan_start,
            "spike_run": self.spike_run,
            "spike_start": self.spike_start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("count", "nan_run", "nan_start", "spike_run", "spike_start"):
            setattr(self, k, int(state[k]))
        self.mean, self.var, self.last = float(state["mean"]), float(state["var"]), float(state["last"])


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a ``DTensor`` (the parameters and optimizer state of
    ``fully_shard`` / ``ShardedStrategy``; a view, so copying into it writes the live shard), else ``t`` itself. The
    snapshot copies each process's own shard: no collective, and ``_foreach_copy_`` refuses a DTensor beside a plain
    tensor."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def _buffer_like(t: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    # the layout the delta checkpoint's snapshot buffers take: a channels_last weight copies without reordering
    stride = buffer_strides(t)
    if old is not None and old.shape == t.shape and old.dtype == t.dtype and tuple(old.stride()) == stride:
        return old
    return torch.empty_strided(tuple(t.shape), stride, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


class Snapshot:
    """A copy of model + optimizers (+ small state) in reused CPU buffers, restorable in place.

    ``take`` copies every tensor into the buffer it had last time (allocated on the first take, or when a shape
    changes), so a run holds one extra CPU copy of its model and optimizer state; CUDA tensors copy into pinned
    buffers without blocking (the copies are ordered before any later in-place update on the same stream).

    Attributes:
        step: the global step the snapshot was taken at (None: never taken).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self._model: list[torch.Tensor] = []
        self._opt: list[dict[str, Any]] = []
        self._opt_keys: list[list[list[str]]] = []
        self._groups: list[list[dict[str, Any]]] = []
        self._extra: dict[str, Any] = {}
        self.bytes = 0

    @staticmethod
    def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
        # the live tensors (parameters, then buffers, each once), not ``state_dict()``: restoring copies into exactly
        # these, and walking the modules' state-dict hooks cost ~0.4 ms a snapshot of the 62-tensor demo CNN
        return [*model.parameters(), *model.buffers()]

    @staticmethod
    def _state_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def take(
        self,
        step: int,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Copy the state of ``step``; ``extra``: small Python state (e.g. scheduler ``state_dict``s), deep-copied."""
        with torch.no_grad():
            tensors = [local_shard(t) for t in self._model_tensors(model)]
            old: list[torch.Tensor | None] = (
                list(self._model) if len(self._model) == len(tensors) else [None] * len(tensors)
            )
            self._model = [_buffer_like(t, o) for t, o in zip(tensors, old, strict=True)]
            srcs, dsts = list(tensors), list(self._model)
            opts: list[dict[str, Any]] = []
            keys: list[list[list[str]]] = []
            for i, opt in enumerate(optimizers):
                prev = self._opt[i] if i < len(self._opt) else {}
                per_param: dict[str, Any] = {}
                pk: list[list[str]] = []
                for j, p in enumerate(self._state_params(opt)):
                    state = opt.state.get(p, {})
                    saved = {}
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            v = local_shard(v)
                            saved[k] = _buffer_like(v, prev.get(f"{j}/{k}"))
                            srcs.append(v)
                            dsts.append(saved[k])
                        else:
                            saved[k] = copy.deepcopy(v)
                    per_param.update({f"{j}/{k}": v for k, v in saved.items()})
                    pk.append(sorted(saved))
                opts.append(per_param)
                keys.append(pk)
            copy_tensors(dsts, srcs, non_blocking=True)  # one call for the lot
            self._opt, self._opt_keys = opts, keys
            self._groups = [
                [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
                for opt in optimizers
            ]
        self._extra = copy.deepcopy(extra or {})
        self.bytes = sum(t.numel() * t.element_size() for t in self._model) + sum(
            v.numel() * v.element_size() for o in self._opt for v in o.values() if isinstance(v, torch.Tensor)
        )
        self.step = step

    def restore(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, Any]:
        """Copy the snapshot back into the live tensors (in place) and return the ``extra`` state it holds.

        Raises:
            RuntimeError: nothing was taken, or the model / optimizers no longer have the layout of the snapshot
                (checked before anything is copied, so a refused restore leaves the live state as it was).
        """
        if self.step is None:
            raise RuntimeError("RollbackGuard: no snapshot has been taken yet, so there is nothing to restore.")
        with torch.no_grad():
            tensors = [local_shard(t) for t in self._model_tensors(model)]
            if len(tensors) != len(self._model):
                raise RuntimeError(
                    f"RollbackGuard: the model has {len(tensors)} tensors, its snapshot {len(self._model)}: the model "
                    "changed since the snapshot was taken."
                )
            bad = next(
                (i for i, (t, b) in enumerate(zip(tensors, self._model, strict=True)) if t.shape != b.shape), None
            )
            if bad is not None:
                raise RuntimeError(
                    f"RollbackGuard: model tensor {bad} has shape {tuple(tensors[bad].shape)}, its snapshot (step "
                    f"{self.step}) {tuple(self._model[bad].shape)}: the model was resized since. Take a new snapshot "
                    "after changing the model's shapes."
                )
            if len(optimizers) != len(self._opt):
                raise RuntimeError(
                    f"RollbackGuard: {len(optimizers)} optimizers, the snapshot (step {self.step}) holds "
                    f"{len(self._opt)}: the optimizers changed since it was taken. Take a new snapshot after replacing "
                    "them."
                )
            # every refusal above, before the first copy: a refused restore must leave the live state as it was
            for t, b in zip(tensors, self._model, strict=True):
                t.copy_(b, non_blocking=True)
            for opt, saved, keys, groups in zip(optimizers, self._opt, self._opt_keys, self._groups, strict=True):
                params = self._state_params(opt)
                for j, p in enumerate(params):
                    want = keys[j] if j < len(keys) else []
                    state = opt.state.get(p)
                    if not want:
                        opt.state.pop(p, None)  # no state at the snapshot: the optimizer starts it anew
                        continue
                    if state is None:
                        state = opt.state[p] = {}
                    for k in list(state):
                        if k not in want:
                            del state[k]
                    for k in want:
                        v = saved[f"{j}/{k}"]
                        live = state.get(k)
                        if isinstance(v, torch.Tensor):
                            if isinstance(live, torch.Tensor) and local_shard(live).shape == v.shape:
                                local_shard(live).copy_(v, non_blocking=True)
                            elif v.dim() > 0 and isinstance(p, DTensor):
                                # a sharded parameter's state is sharded alike (the optimizer adds it to the param)
                                here = v.to(p.to_local().device, copy=True)
                                state[k] = DTensor.from_local(here, p.device_mesh, p.placements, run_check=False)
                            else:
                                state[k] = v.to(p.device if v.dim() > 0 else v.device, copy=True)
                        else:
                            state[k] = copy.deepcopy(v)
                for g, s in zip(opt.param_groups, groups, strict=False):
                    g.update(copy.deepcopy(s))
        return copy.deepcopy(self._extra)

    def release(self) -> None:
        """Drop the buffers (a later :meth:`take` allocates them again)."""
        self.step = None
        self._model, self._opt, self._opt_keys, self._groups, self._extra = [], [], [], [], {}
        self.bytes = 0


def finite(values: Iterable[float]) -> bool:
    """Whether every value is finite."""
    return all(math.isfinite(v) for v in values)


def unscaled_loss(loss: torch.Tensor, scaler: Any = None) -> torch.Tensor:
    """``loss`` as a detached fp32 scalar, divided by the loss scale when ``scaler`` (a ``torch.amp.GradScaler``)
    scaled it for ``backward``: Lightning calls ``on_before_backward`` with the scaled loss. Called in that hook, before
    the optimizer step's ``scaler.update()`` changes the scale; the scale is taken as a tensor (``scaler.scale`` of a
    one), so no host sync."""
    value = loss.detach().float().sum()
    if scaler is not None:
        value = value / scaler.scale(torch.ones((), device=value.device)).float()
    return value


def batch_loss(backward_losses: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A batch's loss from the (unscaled) losses given to ``backward`` in it: their sum, None when there were none.
    Manual optimization's ``training_step`` may return nothing; what it passed to ``manual_backward`` (one loss, or
    one per optimizer) is then the batch's loss."""
    return torch.stack(list(backward_losses)).sum() if backward_losses else None
