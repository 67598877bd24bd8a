"""Learning-rate recipes: the linear scaling rule and a per-step warm-up + cosine schedule.

Functional core (plain torch, no Lightning):

- :func:`linear_scaling_factor` -- ``global_batch / base_batch`` (Goyal et al., 2017: "when the minibatch size is
  multiplied by k, multiply the learning rate by k").
- :func:`apply_lr_scale` -- multiply every param group's learning rate (and the base rates the attached schedulers
  compute from) by a factor, **idempotently**: the factor already applied is recorded in the param group under
  :data:`APPLIED_KEY`, which ``Optimizer.state_dict`` saves, so re-applying after a resume (same or different factor)
  never compounds.
- :class:`WarmupCosineLR` -- an ``LRScheduler`` that ramps linearly to the base rate over the warm-up, then anneals
  with a half cosine to ``min_lr`` at ``total_steps``. Closed form (not chainable), so its value at step ``s`` depends
  only on ``s`` (plus a position offset set by :meth:`WarmupCosineLR.bind` when a resumed fit counts steps in
  other units, e.g. at another world size); its ``state_dict`` makes it resumable.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, overload

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ChainedScheduler, CyclicLR, LRScheduler, SequentialLR

from lightning_accel._utils import compat
from lightning_accel._utils.checks import check_int, check_number
from lightning_accel._utils.rank import is_global_zero

__all__ = ["APPLIED_KEY", "WarmupCosineLR", "apply_lr_scale", "linear_scaling_factor", "warmup_cosine_value"]

#: Param-group key holding the learning-rate factor already applied by :func:`apply_lr_scale`.
APPLIED_KEY = "lr_scale_applied"


def linear_scaling_factor(global_batch_size: int, base_batch_size: int) -> float:
    """The linear scaling rule's factor ``global_batch_size / base_batch_size``.

    Args:
        global_batch_size: samples per optimizer step over all processes (per-device batch x devices x nodes x
            gradient-accumulation steps).
        base_batch_size: the batch size the base learning rate was tuned for.

    Raises:
        TypeError: a size that is not an integer.
        ValueError: a size below 1.
    """
    for name, v in (("global_batch_size", global_batch_size), ("base_batch_size", base_batch_size)):
        check_int(name, v, low=1, fix="Pass the batch size in samples.")
    return global_batch_size / base_batch_size


#: Per-group keys holding learning rates a scheduler computes from: torch's ``LRScheduler`` writes ``initial_lr``;
#: ``OneCycleLR`` writes ``max_lr`` and ``min_lr`` and anneals between the three, so all of them scale with ``lr``.
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def _scaled(value: Any, rel: float) -> Any:
    """``value * rel`` as a new object: a tensor rate may be the caller's own tensor (torch optimizers keep the one
    passed as ``lr=``, shared by every group that inherits it), so multiplying it in place would change the caller's
    value and scale a shared tensor once per group."""
    return value * rel


def _chained_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The states of the schedulers a ``ChainedScheduler`` steps, nested chains included, from its ``state_dict()``
    (which holds them in order under ``"_schedulers"`` and whose ``load_state_dict`` loads them back into them)."""
    out: list[dict[str, Any]] = []
    for inner in state.get("_schedulers") or ():
        if isinstance(inner, dict):
            out.append(inner)
            out.extend(_chained_states(inner))
    return out


def _scale_chained(sched: ChainedScheduler, rel_by_group: list[float]) -> None:
    """Scale the base rates (``CyclicLR``: and peaks) of the schedulers ``sched`` steps, through its public
    ``state_dict`` / ``load_state_dict``: a closed-form scheduler inside a chain (``LambdaLR``) computes from its own
    ``base_lrs`` at every step, so the scaling would otherwise be undone at the first step."""
    state = sched.state_dict()
    for inner in _chained_states(state):
        for key in ("base_lrs", "max_lrs", "_last_lr"):
            values = inner.get(key)
            if isinstance(values, list):
                inner[key] = [_scaled(v, r) for v, r in zip(values, rel_by_group, strict=False)]
    sched.load_state_dict(state)


def apply_lr_scale(
    optimizer: Optimizer,
    factor: float,
    schedulers: LRScheduler | Iterable[LRScheduler] = (),
    *,
    fallback_applied: float = 1.0,
) -> float:
    """Scale ``optimizer``'s learning rates so that the total applied factor becomes ``factor``.

    For each param group the factor already applied is read from ``group[APPLIED_KEY]`` (``fallback_applied`` when
    the key is absent), and ``lr`` -- with the rates schedulers keep in the group: ``initial_lr``, and
    ``OneCycleLR``'s ``max_lr`` / ``min_lr`` -- is multiplied by ``factor / applied``. Schedulers attached to this
    optimizer get their ``base_lrs`` (and ``CyclicLR`` its ``max_lrs``) and last values scaled the same way, so a
    schedule built before the scaling (Lightning builds it in ``configure_optimizers``) follows the scaled rates:
    a warm-up reaches the scaled peak. The schedulers a ``ChainedScheduler`` steps are scaled with it (a ``LambdaLR``
    inside one computes from its own base rates). A bound :class:`WarmupCosineLR` gets its current rate recomputed from
    the scaled base rates (past the warm-up it is not proportional to them). Absolute floors (``min_lr`` of
    :class:`WarmupCosineLR`, ``eta_min`` of ``CosineAnnealingLR``) are not scaled. Tensor rates are replaced by new
    tensors, never multiplied in place. Calling it twice with the same factor changes nothing.

    Args:
        optimizer: the optimizer to scale in place.
        factor: the total factor wanted relative to the unscaled rates (> 0).
        schedulers: a scheduler, or schedulers, whose ``optimizer`` is ``optimizer`` (others are ignored); list a
            ``ChainedScheduler`` alone, not also the schedulers it steps (those would be scaled twice).
        fallback_applied: factor assumed applied for groups without the key (e.g. a checkpoint written before the key
            existed).

    Returns:
        The relative change applied to the first param group (1.0 when nothing changed).

    Raises:
        TypeError: ``factor`` or ``fallback_applied`` not a number, ``schedulers`` neither a scheduler nor an iterable.
        ValueError: ``factor`` or ``fallback_applied`` not positive and finite; or, when the rates change, a
            ``SequentialLR`` attached to ``optimizer``: its schedulers restart from their own (unscaled) base rates at
            each milestone, which this function cannot reach -- nothing is changed then.
    """
    check_number("factor", factor, low=0, high=math.inf, low_open=True, high_open=True)
    # divided by below: a factor of 0 (or a string from a config) must be named, not fail as a ZeroDivisionError
    check_number(
        "fallback_applied",
        fallback_applied,
        low=0,
        high=math.inf,
        low_open=True,
        high_open=True,
        fix="It is the factor already applied to groups without a record of it; 1.0 means none.",
    )
    if isinstance(schedulers, LRScheduler):
        schedulers = (schedulers,)  # the one scheduler of most fits, passed as it is
    elif not isinstance(schedulers, Iterable):
        raise TypeError(
            f"`schedulers` must be an LR scheduler or a list of them, got {schedulers!r} "
            f"({type(schedulers).__name__}). Pass the schedulers built on `optimizer`, or () for none."
        )
    rel_by_group = [factor / float(group.get(APPLIED_KEY, fallback_applied)) for group in optimizer.param_groups]
    attached = [s for s in schedulers if getattr(s, "optimizer", None) is optimizer]
    if any(r != 1.0 for r in rel_by_group):
        for sched in attached:
            chained = _chained_states(sched.state_dict()) if isinstance(sched, ChainedScheduler) else []
            # a SequentialLR's state is the one with milestones
            if isinstance(sched, SequentialLR) or any("_milestones" in inner for inner in chained):
                raise ValueError(
                    f"`schedulers` holds a SequentialLR, whose schedulers restart from their own base rates at each "
                    f"milestone, so the factor x{factor:g} cannot be applied to it. Use one scheduler (e.g. "
                    "lightning_accel.WarmupCosineLR for a warm-up then cosine), or scale the learning rate yourself "
                    "and drop the scaling."
                )
    for group, rel in zip(optimizer.param_groups, rel_by_group, strict=True):
        if rel != 1.0:
            for key in _GROUP_LR_KEYS:
                if key in group:
                    group[key] = _scaled(group[key], rel)
        group[APPLIED_KEY] = float(factor)
    for sched in attached:
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [_scaled(b, r) for b, r in zip(sched.base_lrs, rel_by_group, strict=False)]
        if isinstance(sched, CyclicLR):
            # CyclicLR oscillates between `base_lrs` and its own `max_lrs`, read at every step
            sched.max_lrs = [_scaled(m, r) for m, r in zip(sched.max_lrs, rel_by_group, strict=False)]
        if isinstance(sched, ChainedScheduler) and any(r != 1.0 for r in rel_by_group):
            _scale_chained(sched, rel_by_group)
        last = compat.scheduler_last_lr(sched)
        if last is not None:
            compat.set_scheduler_last_lr(sched, [_scaled(v, r) for v, r in zip(last, rel_by_group, strict=False)])
        if isinstance(sched, WarmupCosineLR) and sched.bound and any(r != 1.0 for r in rel_by_group):
            # past the warm-up the rate is `min_lr + (base - min_lr) * c`, not proportional to the base: scaling the
            # current rate would be off by `min_lr * (1 - c) * (rel - 1)` until the next step (a resume on more devices)
            sched._apply_current()
    return rel_by_group[0] if rel_by_group else 1.0


@overload
def warmup_cosine_value(step: int, base: float, total_steps: int, warmup_steps: int, min_lr: float) -> float: ...
@overload
def warmup_cosine_value(
    step: int, base: torch.Tensor, total_steps: int, warmup_steps: int, min_lr: float
) -> torch.Tensor: ...
def warmup_cosine_value(
    step: int, base: float | torch.Tensor, total_steps: int, warmup_steps: int, min_lr: float
) -> float | torch.Tensor:
    """The warm-up + cosine learning rate at optimizer step ``step`` (0-based).

    ``base * (step + 1) / warmup_steps`` during the warm-up (so the first step already moves, and step
    ``warmup_steps - 1`` reaches ``base``), then ``min_lr + (base - min_lr) * (1 + cos(pi * t)) / 2`` with ``t`` going
    from 0 at ``warmup_steps`` to 1 at ``total_steps``, and ``min_lr`` afterwards. A tensor ``base`` (torch
    optimizers accept 0-dim tensor rates) gives a tensor.
    """
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / decay)
    return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def _epoch_profile(steps_per_epoch: float | Sequence[float]) -> float | list[float]:
    """``steps_per_epoch`` as :meth:`WarmupCosineLR.bind` stores it: a number, or the list of each epoch's steps."""
    if isinstance(steps_per_epoch, Sequence):
        if not steps_per_epoch:
            raise ValueError("`steps_per_epoch` is an empty sequence. Pass each epoch's steps, or one number.")
        return [float(n) for n in steps_per_epoch]
    return float(steps_per_epoch)


def _epoch_length(profile: float | list[float], epoch: int) -> float:
    """Steps of ``epoch`` (0-based) in ``profile``; a list's last value holds for the epochs after it."""
    return profile if isinstance(profile, float) else profile[min(epoch, len(profile) - 1)]


def _epoch_start(profile: float | list[float], epochs: float) -> float:
    """Steps before (fractional) epoch ``epochs`` in ``profile``."""
    if isinstance(profile, float):
        return epochs * profile
    whole = int(epochs)
    done = sum(_epoch_length(profile, e) for e in range(whole))
    return done + (epochs - whole) * _epoch_length(profile, whole)


def _epochs_of(profile: float | list[float], position: float) -> float:
    """The (fractional) epochs that ``position`` steps cover in ``profile``: the inverse of :func:`_epoch_start`."""
    if isinstance(profile, float):
        return position / profile if profile else 0.0
    epoch = 0
    while True:
        length = _epoch_length(profile, epoch)
        if position < length or length <= 0 and epoch >= len(profile):
            return epoch + (position / length if length > 0 else 0.0)
        position -= length
        epoch += 1


def _check_min_lr(min_lr: float, optimizer: Optimizer) -> None:
    """Refuse a ``min_lr`` above a group's base rate, before the scheduler touches the optimizer.

    The base rate is what ``LRScheduler.__init__`` takes as ``base_lrs``: the group's ``initial_lr`` (a scheduler
    built earlier, or a resume, set it), else its ``lr``. A later ``LinearScalingLR`` with a factor below 1 may still
    bring a base rate under ``min_lr`` (the floor is absolute, not scaled): the class docstring says so.
    """
    bases = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
    for i, base in enumerate(bases):
        if min_lr > base:
            raise ValueError(
                f"`min_lr` ({min_lr:g}) must be at most the base learning rate of every param group, got {base:g} for "
                f"group {i}: the cosine would raise that group's rate instead of decaying it. Pass a `min_lr` <= "
                f"{min(bases):g} (e.g. the base rate / 100)."
            )


class WarmupCosineLR(LRScheduler):
    """Linear warm-up to each group's base learning rate, then cosine annealing to ``min_lr``; step it per batch.

    From ``configure_optimizers``::

        sched = WarmupCosineLR(opt, total_steps=self.trainer.estimated_stepping_batches, warmup_fraction=0.05)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    From LightningCLI YAML (the optimizer is injected; ``total_steps`` may be left out when the
    :class:`~lightning_accel.recipes.PerStepLR` callback is used, which binds it to the fit's
    ``estimated_stepping_batches`` and makes Lightning step the schedule per batch instead of per epoch)::

        lr_scheduler:
          class_path: lightning_accel.WarmupCosineLR
          init_args: {warmup_fraction: 0.05, min_lr: 1.0e-5}

    The schedule drives the param groups the optimizer has when it is built. A group added later (Lightning's
    ``BaseFinetuning`` / ``BackboneFinetuning`` adds the unfrozen backbone mid-fit, with a rate it then manages) keeps
    the rate it is given; a resume that restores such a group does too.

    Args:
        optimizer: the wrapped optimizer (injected by LightningCLI).
        total_steps: optimizer steps of the whole run; ``None`` leaves the schedule unbound until :meth:`bind`
            (the learning rate stays at the warm-up start until then).
        warmup_steps: steps of linear warm-up (mutually exclusive with ``warmup_fraction``).
        warmup_fraction: warm-up as a fraction of ``total_steps`` in [0, 1) (rounded to whole steps, at most
            ``total_steps - 1``: the run keeps at least one step of cosine).
        min_lr: learning rate at the end of the cosine (absolute, for every group; ``0 <= min_lr <=`` each group's base
            rate). It is not scaled by :func:`apply_lr_scale` / ``LinearScalingLR``: a factor below 1 that brings a
            base rate under ``min_lr`` makes that group's cosine rise towards it.
        last_epoch: index of the last step taken (``-1`` to start fresh), as in torch schedulers.

    Raises:
        TypeError: an ``optimizer`` that is no ``Optimizer``, or an argument of the wrong type (a bool for a step
            count, too), naming it.
        ValueError: both or a bad warm-up argument, a negative ``min_lr`` or one above a group's base rate, a
            ``last_epoch`` below -1, or a warm-up that is not shorter than ``total_steps`` -- each naming the argument.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int | float | None = None,
        *,
        warmup_steps: int | None = None,
        warmup_fraction: float | None = None,
        min_lr: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            # read below (`min_lr` against each group's rate) before torch's own check would name it
            raise TypeError(
                f"`optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}. Pass the optimizer "
                "(e.g. `WarmupCosineLR(torch.optim.AdamW(model.parameters()), ...)`), not the model or its parameters."
            )
        if warmup_steps is not None and warmup_fraction is not None:
            raise ValueError(
                f"Pass either `warmup_steps` ({warmup_steps!r}) or `warmup_fraction` ({warmup_fraction!r}), not both."
            )
        check_int("warmup_steps", warmup_steps, low=0, allow_none=True)
        check_number(
            "warmup_fraction",
            warmup_fraction,
            low=0,
            high=1,
            high_open=True,
            allow_none=True,
            fix="It is a fraction of the total steps.",
        )
        check_number("min_lr", min_lr, low=0)
        # torch's own check of a resumed `last_epoch` would blame a missing `initial_lr` for a string or a -2
        check_int(
            "last_epoch",
            last_epoch,
            low=-1,
            fix="It is the index of the last step taken: -1 starts fresh (a resume restores it by `load_state_dict`).",
        )
        self.warmup_steps_arg = None if warmup_steps is None else int(warmup_steps)
        self.warmup_fraction = None if warmup_fraction is None else float(warmup_fraction)
        self.min_lr = float(min_lr)
        self.total_steps: int | None = None
        # given here (e.g. `trainer.estimated_stepping_batches` in configure_optimizers, which re-runs on resume with
        # the current Trainer) or bound later from the Trainer (PerStepLR): either way not taken from a restored state
        self.total_steps_arg = None if total_steps is None else total_steps
        self.warmup_steps = 0
        # position on the curve = step + step_offset; nonzero only after a resume whose steps (per epoch, or into the
        # interrupted epoch) differ from the checkpoint's (another world size / batch size / accumulation): the
        # restored progress is re-expressed in this fit's steps
        self.step_offset = 0
        self.steps_per_epoch: float | list[float] | None = None
        if total_steps is not None:
            self._resolve(total_steps)
        elif self.warmup_steps_arg is not None:
            self.warmup_steps = self.warmup_steps_arg
        _check_min_lr(self.min_lr, optimizer)
        super().__init__(optimizer, last_epoch)

    @property
    def bound(self) -> bool:
        """Whether ``total_steps`` is known."""
        return self.total_steps is not None

    def _resolve(self, total_steps: int | float) -> None:
        if isinstance(total_steps, float) and math.isinf(total_steps):
            raise ValueError(
                "`total_steps` is infinite (the Trainer has no `max_steps`/`max_epochs` bound). "
                "Set `max_epochs` or `max_steps`, or pass `total_steps` explicitly."
            )
        # a whole float is a step count too (`estimated_stepping_batches` may be one)
        whole = isinstance(total_steps, float) and total_steps.is_integer()
        total = check_int("total_steps", int(total_steps) if whole else total_steps, low=1)
        if self.warmup_fraction is not None:
            # a fraction in [0, 1) is always valid: rounding (0.95 of 10 steps, 0.6 of 1) must not make the warm-up
            # the whole run, which only `warmup_steps` given as a count may ask for (and is refused below)
            warm = min(int(round(self.warmup_fraction * total)), total - 1)
        else:
            warm = self.warmup_steps_arg or 0
        if warm >= total and warm > 0:
            raise ValueError(
                f"`warmup_steps` ({warm}) must be shorter than the training, `total_steps` ({total}). "
                "Shorten the warm-up (or use `warmup_fraction`), or train for more steps."
            )
        self.total_steps = total
        self.warmup_steps = warm

    def bind(
        self,
        total_steps: int | float,
        steps_per_epoch: float | Sequence[float] | None = None,
        *,
        epochs_done: int | None = None,
        into_epoch: int | None = None,
    ) -> None:
        """Fix ``total_steps`` (e.g. to ``trainer.estimated_stepping_batches``) and re-apply the current step's rate.

        Binding again to the same values is a no-op. Binding a restored (resumed) schedule to a new length continues
        the cosine of the new length from the restored position: extending a finished run (more ``max_epochs``)
        resumes on the longer curve instead of staying at ``min_lr``, and reaches ``min_lr`` at the new
        ``total_steps`` (the index one past the fit's last step, which trains just above it).

        Args:
            total_steps: optimizer steps of the whole (current) fit.
            steps_per_epoch: optimizer steps per epoch of the current fit (``None`` when the fit is bounded by
                ``max_steps``), or the steps of each epoch in turn when they differ (Lightning's
                ``GradientAccumulationScheduler``; the last value holds for the epochs after). When the restored
                schedule was bound with another value (the world size, the batch size or the accumulation changed),
                the restored position is converted through the epochs it represents, each at its own length, so the
                schedule continues from the same progress fraction to the end of the new horizon instead of
                counting old steps against the new horizon.
            epochs_done: whole epochs the restored position covers (Lightning's ``trainer.current_epoch`` at the
                start of the resumed fit). With a restored ``steps_per_epoch``, the whole epochs are converted to this
                fit's steps, and the steps taken into the interrupted epoch are kept as they are (or taken from
                ``into_epoch``), because Lightning resumes that epoch at the same batch count (a step count that
                reaches this fit's steps of that epoch restarts it, and the position restarts with it). So a resume
                mid-epoch reaches ``min_lr`` at the end of the fit too, not early. ``None`` converts the whole
                position when ``steps_per_epoch`` changed.
            into_epoch: the steps of the interrupted epoch already taken, counted in the current fit's steps (the
                batches Lightning resumes the epoch at, over this fit's ``accumulate_grad_batches``; 0 when the fit
                starts the epoch at its first batch). Used with ``epochs_done`` when the restored position is inside
                an epoch or at its start, even at unchanged ``steps_per_epoch``: a resume at another
                ``accumulate_grad_batches`` takes another number of steps over the same batches (5 batches at
                accumulation 3 step after batches 3 and 5, at 4 after 4 and 5; 2 batches at accumulation 3 took no
                step, at 2 they are one), so the restored step count would put the schedule off by the difference.
                ``None`` keeps the restored steps into the epoch as they are (right when only the world size or the
                batch size changed).
        """
        self._resolve(total_steps)
        step = max(0, self.last_epoch)
        position = step + self.step_offset
        old = self.steps_per_epoch
        new = None if steps_per_epoch is None else _epoch_profile(steps_per_epoch)
        if new is not None and old is not None:
            into = position - _epoch_start(old, epochs_done) if epochs_done is not None else -1.0
            if epochs_done is not None and 0 <= into < _epoch_length(old, epochs_done):
                # Lightning resumes the interrupted epoch at the same batch; `into_epoch` counts those batches in this
                # fit's steps (another accumulation steps at other batches, even with as many steps per epoch), also
                # when the restored run took no step over them yet (2 batches at accumulation 3 are 1 step at 2). It
                # restarts an epoch whose restored batch count reaches this fit's batches per epoch
                kept = into if into_epoch is None else into_epoch
                kept = kept if kept < _epoch_length(new, epochs_done) else 0
                position = int(round(_epoch_start(new, epochs_done) + kept))
            elif new != old:
                position = int(round(_epoch_start(new, _epochs_of(old, position))))
        self.step_offset = position - step
        if new is not None:
            self.steps_per_epoch = new
        self._apply_current()

    def _apply_current(self) -> None:
        values = self._closed_form(max(0, self.last_epoch))
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = lr
        compat.set_scheduler_last_lr(self, values)

    def _closed_form(self, step: int) -> list[float | torch.Tensor]:
        """The rate of every param group at ``step``: the schedule's for the groups it was built with, and their own
        current rate for groups added to the optimizer later (Lightning's ``BaseFinetuning`` adds an unfrozen backbone
        as a group mid-fit and sets its rate itself), so stepping never fails on a group count that changed."""
        scheduled = self._scheduled(step)
        return scheduled + [g["lr"] for g in self.optimizer.param_groups[len(scheduled) :]]

    def _scheduled(self, step: int) -> list[float | torch.Tensor]:
        if self.total_steps is None:
            # Unbound: step 0's rate is provisional (the warm-up's first value when `warmup_steps` is known, else the
            # base rate); `bind()` sets the real one before the first optimizer step, and stepping further is refused.
            if step > 0:
                raise RuntimeError(
                    "WarmupCosineLR was stepped before `total_steps` was known. Pass `total_steps=...`, or add the "
                    "`lightning_accel.recipes.PerStepLR` callback to the Trainer so it binds the schedule to "
                    "`trainer.estimated_stepping_batches`."
                )
            warm = self.warmup_steps if self.warmup_steps_arg is not None else 1
            return [warmup_cosine_value(0, b, max(warm, 1) + 1, warm, self.min_lr) for b in self.base_lrs]
        pos = step + self.step_offset
        return [warmup_cosine_value(pos, b, self.total_steps, self.warmup_steps, self.min_lr) for b in self.base_lrs]

    def get_lr(self) -> list[float | torch.Tensor]:
        """The rates for step ``last_epoch`` (torch's scheduler contract); a closed form, so the deprecated
        ``step(epoch)`` gets the same rates."""
        return self._closed_form(self.last_epoch)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict`` (the step, the base rates); the optimizer's rates are set to the restored step's
        value (so the result does not depend on whether the optimizer state is loaded before or after).

        The horizon is not taken from the checkpoint when this schedule knows a current one: a ``total_steps`` given
        to the constructor (``configure_optimizers`` runs again on resume, with the resumed Trainer's
        ``estimated_stepping_batches``) wins over the restored one, and an unbound schedule is rebound by
        :class:`~lightning_accel.recipes.PerStepLR` at ``on_train_start``. So a finished run extended with more
        epochs continues on the longer cosine instead of training at ``min_lr``. The restored position offset and
        steps per epoch stay until :meth:`bind` re-expresses them in the current fit's steps
        (:func:`~lightning_accel.recipes.callbacks.bind_to_fit`, called by ``PerStepLR`` at ``on_train_start``).

        The shape of the curve is not taken from the checkpoint either: ``warmup_steps``, ``warmup_fraction`` and
        ``min_lr`` keep the constructor's values, so a resumed run configured with another warm-up or floor follows
        it from the restored step on. Where they differ from the checkpoint's, a warning (on global rank 0) names each
        argument with both values; pass the checkpoint's values to continue on its curve.
        """
        arg = self.total_steps_arg
        # the constructor's schedule shape, which this fit was configured with: kept like `total_steps` (the checkpoint
        # gives the position on the curve, not its shape)
        warmup_steps, warmup_fraction, min_lr = self.warmup_steps_arg, self.warmup_fraction, self.min_lr
        given = {"warmup_steps": warmup_steps, "warmup_fraction": warmup_fraction, "min_lr": min_lr}
        saved = {
            "warmup_steps": state_dict.get("warmup_steps_arg", warmup_steps),
            "warmup_fraction": state_dict.get("warmup_fraction", warmup_fraction),
            "min_lr": state_dict.get("min_lr", min_lr),
        }
        self.__dict__.update(state_dict)
        self.total_steps_arg = arg
        self.warmup_steps_arg, self.warmup_fraction, self.min_lr = warmup_steps, warmup_fraction, min_lr
        changed = [f"`{k}` {saved[k]!r} in the checkpoint, {given[k]!r} given" for k in given if saved[k] != given[k]]
        if changed and is_global_zero():
            warnings.warn(
                f"WarmupCosineLR: resumed with other schedule arguments than the checkpoint's ({'; '.join(changed)}); "
                "it uses the given ones from the restored step on, as it does `total_steps` (the checkpoint keeps the "
                "position only). Pass the checkpoint's values to continue on its curve.",
                UserWarning,
                stacklevel=2,
            )
        # the restored warm-up length was resolved from the checkpoint's arguments: resolved again from the given ones
        horizon = arg if arg is not None else self.total_steps
        if horizon is not None:
            self._resolve(horizon)
        else:
            self.warmup_steps = warmup_steps or 0
        if self.total_steps is not None:
            self._apply_current()
        elif self.last_epoch > 0:
            warnings.warn(
                "Restored an unbound WarmupCosineLR past step 0; bind it (`bind(total_steps)`) before stepping again.",
                stacklevel=2,
            )
