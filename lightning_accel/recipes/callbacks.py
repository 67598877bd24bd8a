"""The Lightning adapters of the recipes room, thin callbacks over the plain-torch cores beside them:
``LinearScalingLR`` and ``PerStepLR`` (:mod:`~lightning_accel.recipes.lr`), ``KnowledgeDistillation``
(:mod:`~lightning_accel.recipes.distill`) and ``StructuredPruning`` (:mod:`~lightning_accel.recipes.prune`).
"""

from __future__ import annotations

import ast
import math
import os
import re
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_accel._utils.checks import check_bool, check_choice, check_int, renamed_argument
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.patching import Patch, patch
from lightning_accel.recipes.channel_groups import UntraceableModelError, check_module_names
from lightning_accel.recipes.distill import (
    check_distillation_args,
    combine_losses,
    distillation_loss,
    freeze_teacher,
    legacy_teacher_fingerprint,
    load_teacher,
    teacher_fingerprint,
)
from lightning_accel.recipes.lr import WarmupCosineLR, apply_lr_scale, linear_scaling_factor
from lightning_accel.recipes.prune import (
    PruneResult,
    apply_structured_pruning,
    batch_norms,
    check_amount,
    count_parameters,
    recalibrate_batchnorm,
    resize_to_state_dict,
    schedule_amounts,
)

__all__ = [
    "KnowledgeDistillation",
    "LinearScalingLR",
    "PerStepLR",
    "StructuredPruning",
    "bind_to_fit",
    "fit_scheduler_steps",
]


def fit_steps_per_epoch(trainer: Trainer) -> float | None:
    """Optimizer steps per epoch of ``trainer``'s current fit, or ``None`` when ``max_steps`` bounds it.

    The count Lightning's ``estimated_stepping_batches`` multiplies by ``max_epochs``: ``ceil(batches per process /
    accumulate_grad_batches)``; it changes with the world size (each process sees a shard) and the batch size.
    """
    total = trainer.estimated_stepping_batches
    batches = trainer.num_training_batches
    if not math.isfinite(batches) or trainer.max_epochs is None or trainer.max_epochs < 1:
        return None
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
    if trainer.max_steps != -1 and total < per_epoch * trainer.max_epochs:
        return None  # bounded by `max_steps`: the steps are the unit, no conversion
    return float(per_epoch)


def _scheduler_steps_per_epoch(batches: int, accumulate: int, frequency: int) -> int:
    """How often Lightning steps an ``interval="step"`` scheduler with ``frequency`` in an epoch of ``batches``: after
    each optimizer step (every ``accumulate``-th batch, and the last one when it closes a partial accumulation) whose
    1-based batch position is a multiple of ``frequency``."""
    return batches // math.lcm(accumulate, frequency) + int(batches % accumulate != 0 and batches % frequency == 0)


def _accumulation_scheduler(trainer: Trainer) -> GradientAccumulationScheduler | None:
    """Lightning's ``GradientAccumulationScheduler`` among ``trainer``'s callbacks, if any."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, GradientAccumulationScheduler):
            return cb
    return None


def _scheduled_accumulation_steps(
    trainer: Trainer, scheduler: GradientAccumulationScheduler, frequency: int
) -> tuple[int | float, float | None]:
    """:func:`fit_scheduler_steps` under a ``GradientAccumulationScheduler``: the epochs step at their own
    accumulation, which the Trainer's ``estimated_stepping_batches`` (computed with the accumulation of the moment, 1
    at ``on_train_start``) does not know. Summed epoch by epoch up to ``max_epochs``, stopping at ``max_steps``
    optimizer steps; no single number of steps per epoch (they change with the epoch: see
    :func:`_scheduled_epoch_steps`)."""
    batches, epochs, max_steps = trainer.num_training_batches, trainer.max_epochs, trainer.max_steps
    if not math.isfinite(batches) or epochs is None or epochs < 0:
        # no epoch length or no epoch bound: `max_steps` optimizer steps (or none, which `bind` refuses with the fix)
        if max_steps == -1:
            return math.inf, None
        every = math.lcm(scheduler.get_accumulate_grad_batches(trainer.current_epoch), frequency)
        return max_steps * scheduler.get_accumulate_grad_batches(trainer.current_epoch) // every, None
    batches = int(batches)
    total, left = 0, math.inf if max_steps == -1 else max_steps
    for epoch in range(epochs):
        accumulate = scheduler.get_accumulate_grad_batches(epoch)
        optimizer_steps = math.ceil(batches / accumulate)
        if optimizer_steps > left:  # `max_steps` ends the fit in this epoch, before its last batch
            total += int(left) * accumulate // math.lcm(accumulate, frequency)
            break
        total += _scheduler_steps_per_epoch(batches, accumulate, frequency)
        left -= optimizer_steps
    return total, None


def _scheduled_epoch_steps(trainer: Trainer, frequency: int) -> list[int] | None:
    """Steps a per-step scheduler with ``frequency`` takes in each epoch of ``trainer``'s fit under a
    ``GradientAccumulationScheduler`` (each at its own accumulation), what a resume converts the restored position
    through; ``None`` without one, or when the epoch length is unknown or ``max_steps`` bounds the fit (the steps are
    then the unit, as without the scheduler)."""
    scheduler = _accumulation_scheduler(trainer)
    batches, epochs = trainer.num_training_batches, trainer.max_epochs
    if scheduler is None or not math.isfinite(batches) or epochs is None or epochs < 1:
        return None
    batches = int(batches)
    # one entry per epoch the fit runs, and the current one (a resumed fit may already be past `max_epochs`)
    accumulations = [scheduler.get_accumulate_grad_batches(e) for e in range(max(epochs, trainer.current_epoch + 1))]
    if trainer.max_steps != -1 and sum(math.ceil(batches / a) for a in accumulations[:epochs]) > trainer.max_steps:
        return None  # bounded by `max_steps`
    return [_scheduler_steps_per_epoch(batches, a, frequency) for a in accumulations]


def fit_scheduler_steps(trainer: Trainer, frequency: int) -> tuple[int | float, float | None]:
    """Steps a per-step scheduler with ``frequency`` takes in ``trainer``'s current fit, and per epoch (``None`` when
    ``max_steps`` bounds the fit).

    Lightning steps an ``interval="step"`` scheduler after an optimizer step whose batch position in the epoch
    (1-based) is a multiple of ``frequency``; the optimizer steps at every ``accumulate_grad_batches``-th batch and at
    the epoch's last one. With ``frequency=1`` these are the optimizer steps (``estimated_stepping_batches``). Under
    Lightning's ``GradientAccumulationScheduler`` each epoch counts at its own accumulation, and the steps per epoch
    are ``None`` (they change with the epoch; :func:`bind_to_fit` converts a resumed position epoch by epoch). A
    manually optimized module with several optimizers under ``max_steps`` takes ``max_steps / optimizers`` batches
    (Lightning counts every optimizer's step), each stepping each schedule once (:func:`_manual_steps_per_scheduler`).
    """
    scheduled = _accumulation_scheduler(trainer)
    if scheduled is not None:
        return _scheduled_accumulation_steps(trainer, scheduled, frequency)
    total_optimizer_steps = trainer.estimated_stepping_batches
    if frequency == 1:
        manual = _manual_steps_per_scheduler(trainer)
        if manual is not None:
            return manual, None
        return total_optimizer_steps, fit_steps_per_epoch(trainer)
    if not math.isfinite(total_optimizer_steps):
        return total_optimizer_steps, None  # no bound at all: `WarmupCosineLR.bind` refuses it with the fix
    accumulate = trainer.accumulate_grad_batches
    every = math.lcm(accumulate, frequency)  # batch positions that are both an optimizer and a scheduler step
    batches = trainer.num_training_batches
    if not math.isfinite(batches):
        return int(total_optimizer_steps) * accumulate // every, None
    batches = int(batches)
    per_epoch = _scheduler_steps_per_epoch(batches, accumulate, frequency)
    if fit_steps_per_epoch(trainer) is not None:
        return per_epoch * (trainer.max_epochs or 0), float(per_epoch)
    # bounded by `max_steps`: whole epochs, then the first optimizer steps of a last one (none of them its final batch)
    full, rest = divmod(int(total_optimizer_steps), math.ceil(batches / accumulate))
    return full * per_epoch + rest * accumulate // every, None


def _manual_steps_per_scheduler(trainer: Trainer) -> int | None:
    """Steps each scheduler takes in ``trainer``'s fit when ``max_steps`` bounds a manually optimized module with
    several optimizers, else ``None``.

    Lightning counts every optimizer's step in ``global_step``, so ``max_steps`` ends such a fit after
    ``max_steps / optimizers`` batches when each optimizer (and its scheduler) steps once per batch, the case
    ``estimated_stepping_batches`` assumes under ``max_epochs``; bound to ``max_steps`` itself, the schedules would
    stop half-way (two optimizers) and never reach ``min_lr``."""
    module = trainer.lightning_module
    optimizers = len(trainer.optimizers)
    if module.automatic_optimization or optimizers < 2 or trainer.max_steps == -1:
        return None
    bound = math.ceil(trainer.max_steps / optimizers)
    batches = trainer.num_training_batches
    if math.isfinite(batches) and trainer.max_epochs is not None and trainer.max_epochs >= 0:
        bound = min(bound, int(batches) * max(trainer.max_epochs, 1))
    return bound


def _resumed_batches(trainer: Trainer) -> int | None:
    """Batches of the current epoch that ``trainer``'s fit resumes after, as Lightning's epoch loop will count them
    (read at ``on_train_start``, before that loop resets); ``None`` when the progress cannot be read.

    The restored batch count is a position inside the epoch only while the loop is restarting: a checkpoint written at
    an epoch's end (``on_train_epoch_end``, validation) starts the next epoch at batch 0, whatever count it holds. A
    restarting loop resumes after the processed batches (one saved at ``on_train_batch_end`` counts, as Lightning
    completes it on restore), and restarts an epoch whose count reaches this fit's batches per epoch (a checkpoint
    written on an epoch's last batch: the next epoch starts at 0; with fewer batches per epoch than this fit, the
    count stays and Lightning resumes the next epoch after as many batches)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    current = getattr(getattr(loop, "batch_progress", None), "current", None)
    processed = getattr(current, "processed", None)
    if not isinstance(processed, int):
        return None
    if not getattr(loop, "restarting", False):
        return 0
    batches = trainer.num_training_batches
    return 0 if math.isfinite(batches) and processed >= int(batches) else processed


def _steps_into_epoch(trainer: Trainer, frequency: int) -> int | None:
    """Scheduler steps the batches of the current epoch that ``trainer`` resumes after take in this fit: a step after
    each batch position that is a multiple of both ``accumulate_grad_batches`` and ``frequency``
    (:func:`_resumed_batches`). ``None`` when the batch count or the epoch length is unknown."""
    done = _resumed_batches(trainer)
    if done is None or not math.isfinite(trainer.num_training_batches):
        return None
    return done // math.lcm(_fit_accumulation(trainer, trainer.current_epoch), frequency)


def _resumed_accumulation_scheduler(trainer: Trainer) -> GradientAccumulationScheduler | None:
    """At ``on_train_start``: ``trainer``'s ``GradientAccumulationScheduler`` when the fit resumes inside an epoch
    (its loop is restarting, so Lightning will not call ``on_train_epoch_start`` for it), else ``None``."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return _accumulation_scheduler(trainer) if getattr(loop, "restarting", False) else None


def _set_scheduled_accumulation(trainer: Trainer, scheduler: GradientAccumulationScheduler | None) -> None:
    """Set ``trainer``'s ``accumulate_grad_batches`` to ``scheduler``'s for the current epoch; call it at the first
    ``on_train_batch_start`` of a resumed fit (:func:`_resumed_accumulation_scheduler`).

    Lightning does not call ``on_train_epoch_start``, where its ``GradientAccumulationScheduler`` sets the value, for
    the epoch a fit resumes inside (a checkpoint written mid-epoch, or on the previous epoch's last batch), so that
    epoch would train at accumulation 1. Not at ``on_train_start``: the scheduler refuses a Trainer accumulation other
    than 1 there, and may come after the caller; Lightning reads the value only after this hook, for this batch."""
    if scheduler is not None:
        trainer.accumulate_grad_batches = scheduler.get_accumulate_grad_batches(trainer.current_epoch)


def _fit_accumulation(trainer: Trainer, epoch: int) -> int:
    """``accumulate_grad_batches`` of ``trainer`` in ``epoch``: Lightning's ``GradientAccumulationScheduler`` sets
    the Trainer's value at each epoch start (after ``on_train_start``, and perhaps after the caller's own hook), so
    its schedule is asked directly."""
    scheduler = _accumulation_scheduler(trainer)
    return int(trainer.accumulate_grad_batches if scheduler is None else scheduler.get_accumulate_grad_batches(epoch))


def bind_to_fit(
    sched: WarmupCosineLR, trainer: Trainer, total_steps: int | float | None = None, frequency: int = 1
) -> None:
    """Bind ``sched`` to ``trainer``'s current fit: its length, and (resumed) its position in this fit's steps.

    Call it at ``on_train_start`` (after Lightning restored the checkpoint's scheduler state, which would otherwise
    keep the first fit's horizon). ``total_steps`` defaults to the number of times Lightning steps the scheduler in
    this fit: ``trainer.estimated_stepping_batches`` with the default ``frequency=1``, fewer with the ``frequency`` of
    its ``interval="step"`` config (:func:`fit_scheduler_steps`). A schedule resumed at another number of steps per
    epoch (world size, batch size, ``accumulate_grad_batches``; under a ``GradientAccumulationScheduler``, epoch by
    epoch at each one's accumulation) continues from the restored whole epochs converted to this fit's steps, plus the
    steps this fit takes over the batches of the interrupted epoch already trained (Lightning resumes that epoch at the
    same batch; another accumulation steps at other batches, even with as many steps per epoch):
    :meth:`~lightning_accel.recipes.lr.WarmupCosineLR.bind` with ``epochs_done=trainer.current_epoch`` and
    ``into_epoch``. Every rank computes the same values from its own Trainer; no collective.
    """
    before = (sched.total_steps, sched.step_offset)
    fit_total, per_epoch = fit_scheduler_steps(trainer, frequency)
    total = fit_total if total_steps is None else total_steps
    into = _steps_into_epoch(trainer, frequency)
    scheduled = _scheduled_epoch_steps(trainer, frequency)
    sched.bind(
        total,
        steps_per_epoch=per_epoch if scheduled is None else scheduled,
        epochs_done=trainer.current_epoch,
        into_epoch=into,
    )
    if before[0] is not None and before != (sched.total_steps, sched.step_offset):
        step = max(0, sched.last_epoch)
        rank_zero_info(
            f"{type(sched).__name__}: length {before[0]} -> {sched.total_steps} steps (this fit), continuing from "
            f"position {step + sched.step_offset} (step {step})."
        )


def _data_parallel_replicas(trainer: Trainer) -> int:
    """How many different batches ``trainer``'s ranks read per step: the sampler's ``num_replicas``.

    Not the process count: the ranks of one tensor-parallel group or pipeline read the same batch by default
    (``ShardedStrategy(tensor_parallel_size=N)``, ``PipelineStrategy``, Lightning's ``ModelParallelStrategy``), so
    they are one replica. Strategies without a distributed sampler (a single device) have one; a parallel strategy that
    does not say uses the world size.
    """
    kwargs = trainer.distributed_sampler_kwargs
    if kwargs and "num_replicas" in kwargs:
        return max(1, int(kwargs["num_replicas"]))
    return max(1, trainer.world_size)


def _loader_batch_size(obj: Any) -> int | None:
    if isinstance(obj, DataLoader):
        if obj.batch_size is not None:
            return int(obj.batch_size)
        bs = getattr(obj.batch_sampler, "batch_size", None)
        return int(bs) if bs is not None else None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        for o in obj:
            bs = _loader_batch_size(o)
            if bs is not None:
                return bs
    return None


class LinearScalingLR(Callback):
    """Scale every optimizer's learning rate by ``global_batch / base_batch_size`` once, at the start of training.

    ``global_batch = per-device batch x data-parallel replicas x accumulate_grad_batches``. With Lightning's
    ``GradientAccumulationScheduler`` the accumulation is the schedule's for the current epoch, and the rates are
    rescaled at each epoch start where it changes the global batch (``{0: 2, 4: 8}`` quadruples them at epoch 4,
    schedulers' base rates included); a fit resumed inside an epoch trains it at the scheduled accumulation from its
    first batch (Lightning skips the ``on_train_epoch_start`` where the scheduler would set it). The per-device batch is
    read from the training DataLoader (``batch_size``) unless ``batch_size`` is given. The replicas are the ranks the
    strategy's sampler splits the data over (``num_replicas`` of ``trainer.distributed_sampler_kwargs``; 1 on a
    single device): every process under DDP and FSDP, but one per tensor-parallel group or pipeline when the ranks of
    a group read the same batch (``ShardedStrategy`` / ``PipelineStrategy`` with the default
    ``batch_split="data_parallel"``). Schedulers created in ``configure_optimizers`` are scaled along (see
    :func:`~lightning_accel.recipes.lr.apply_lr_scale`: base rates, ``OneCycleLR``'s and ``CyclicLR``'s peaks), so
    warm-up and cosine follow the scaled peak; a ``SequentialLR`` is refused (its schedulers keep their own base rates).

    Idempotent across resume: the factor applied is stored in each param group (saved with the optimizer state) and in
    this callback's ``state_dict``; resuming with the same setup changes nothing, resuming with a different global
    batch (e.g. more devices) rescales by the ratio of the two factors; a later fit of the same callback without a
    checkpoint scales the fresh rates afresh. The factor is logged as ``lr_scale/factor``
    and ``lr_scale/global_batch_size``.

    Args:
        base_batch_size: the global batch size the configured learning rate was tuned for.
        batch_size: per-device batch size (``None``: read it from the train DataLoader).

    Raises:
        TypeError: a ``base_batch_size``/``batch_size`` that is not an integer.
        ValueError: a non-positive ``base_batch_size``/``batch_size``; at the start of training, a per-device batch size
            that cannot be found, or a ``SequentialLR`` to scale.
    """

    def __init__(self, base_batch_size: int, batch_size: int | None = None) -> None:
        check_int("base_batch_size", base_batch_size, low=1, fix="Pass the batch size in samples.")
        check_int("batch_size", batch_size, low=1, allow_none=True, fix="Pass the batch size in samples.")
        self.base_batch_size = int(base_batch_size)
        self.batch_size = batch_size
        self.factor: float | None = None
        self.global_batch_size: int | None = None
        self._restored_factor: float | None = None
        # the GradientAccumulationScheduler whose accumulation the first batch of a fit resumed mid-epoch must train at
        self._accumulation: GradientAccumulationScheduler | None = None

    def global_batch(self, trainer: Trainer) -> int:
        """``per-device batch x data-parallel replicas x accumulate_grad_batches`` for ``trainer``'s current fit and
        epoch (the accumulation of a ``GradientAccumulationScheduler``, else the Trainer's)."""
        per_device = self.batch_size if self.batch_size is not None else _loader_batch_size(trainer.train_dataloader)
        if per_device is None:
            raise ValueError(
                "LinearScalingLR could not read the per-device batch size from the train DataLoader "
                f"({type(trainer.train_dataloader).__name__}). Pass `batch_size=` to LinearScalingLR."
            )
        return int(per_device) * _data_parallel_replicas(trainer) * _fit_accumulation(trainer, trainer.current_epoch)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # the factor a checkpoint recorded belongs to the fit that resumes from it: `load_state_dict` sets it after
        # this hook, so a later fit of the same callback without a checkpoint starts from the unscaled rates
        self._restored_factor = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        restored = self._restored_factor
        self._accumulation = _resumed_accumulation_scheduler(trainer)
        self._scale(trainer, restored or 1.0, f" (restored x{restored:g}, rescaled)" if restored else "")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # the rates were scaled for the scheduled accumulation, which a fit resumed inside an epoch must train at
        scheduler, self._accumulation = self._accumulation, None
        _set_scheduled_accumulation(trainer, scheduler)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a GradientAccumulationScheduler changes the global batch between epochs: the rates follow it (the same
        # value on every rank, read from each rank's own Trainer; no collective)
        if self.global_batch_size is not None and self.global_batch(trainer) != self.global_batch_size:
            # a group added since (e.g. by BaseFinetuning, from the scaled rates) carries the factor applied so far
            previous = self.factor or 1.0
            self._scale(trainer, previous, f" at epoch {trainer.current_epoch} (was x{previous:g})")

    def _scale(self, trainer: Trainer, fallback: float, note: str) -> None:
        """Bring every optimizer's total factor to this fit's (current epoch's) global batch over the base; groups
        without a record of the factor applied to them are taken to carry ``fallback``."""
        self.global_batch_size = self.global_batch(trainer)
        self.factor = linear_scaling_factor(self.global_batch_size, self.base_batch_size)
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        rel = [apply_lr_scale(opt, self.factor, schedulers, fallback_applied=fallback) for opt in trainer.optimizers]
        lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
        if any(r != 1.0 for r in rel):
            rank_zero_info(
                f"LinearScalingLR: global batch {self.global_batch_size} / base {self.base_batch_size} -> learning "
                f"rates x{self.factor:g}{note} (now {[float(f'{lr:.4g}') for lr in lrs]})."
            )
        # else: a resume with the same global batch; the restored rates already carry the factor, nothing changed
        metrics = {"lr_scale/factor": self.factor, "lr_scale/global_batch_size": float(self.global_batch_size)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "base_batch_size": self.base_batch_size,
            "global_batch_size": self.global_batch_size,
            "factor": self.factor,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_factor = state_dict.get("factor")
        self.factor = self._restored_factor
        self.global_batch_size = state_dict.get("global_batch_size")


class PerStepLR(Callback):
    """Make every :class:`~lightning_accel.recipes.lr.WarmupCosineLR` of the fit step per batch, with a known length.

    LightningCLI's ``lr_scheduler:`` block returns the scheduler without an interval, so Lightning would step it once
    per *epoch*; and the YAML cannot know the number of optimizer steps. At ``on_train_start`` this callback sets the
    interval of each ``WarmupCosineLR`` to ``"step"`` and binds those created without ``total_steps`` to
    ``trainer.estimated_stepping_batches`` (``max_epochs`` x batches per epoch / ``accumulate_grad_batches``, or
    ``max_steps``). The length is recomputed at every fit start, resumed fits included: a resumed schedule keeps its
    step and base rates but takes the current fit's length (a finished 10-epoch run resumed with ``max_epochs=20``
    continues on the 20-epoch cosine instead of training at ``min_lr``). Schedules given an explicit ``total_steps``
    keep their length. Other schedulers are left alone. A manually optimized module with several optimizers, each
    stepping its own schedule once per batch, ends a ``max_steps`` fit after ``max_steps / optimizers`` batches
    (Lightning's ``global_step`` counts every optimizer's step): its schedules are bound to that many steps.

    **Frequency.** A scheduler config with ``interval="step"`` keeps its ``frequency``: Lightning then steps the
    schedule after every optimizer step that ends a batch position (in the epoch) divisible by ``frequency``, and the
    schedule is bound to that number of steps (:func:`fit_scheduler_steps`), so it still spans the whole fit. A config
    with the default ``interval="epoch"`` (the CLI block's) is switched to ``"step"``; one that also sets a
    ``frequency`` other than 1 (a step every N epochs) is refused with a ``ValueError`` at ``on_train_start``, as is a
    ``frequency`` that never steps the schedule, with or without a ``total_steps``: one larger than the batches of an
    epoch, or one that no optimizer step's batch position is a multiple of (``accumulate_grad_batches`` 2, 5
    batches per epoch: the optimizer steps after batches 2, 4 and 5, so ``frequency=3`` never steps it). Under a
    ``GradientAccumulationScheduler`` every accumulation the fit reaches is checked, later epochs' included.

    Resumed at another world size (or batch size, or accumulation), the restored step counts steps of the old run: the
    schedule's position is converted through the epochs it represents, each at its own accumulation under a
    ``GradientAccumulationScheduler`` (:func:`bind_to_fit`; the steps taken into an interrupted epoch are this fit's
    steps over the batches Lightning resumes that epoch at), so it continues from the same
    point of the run and reaches ``min_lr`` at the end of this fit (at ``total_steps``, the index one past its last
    step; not early, not half-way), from an end-of-epoch checkpoint or a mid-epoch one.

    **Scheduled accumulation on resume.** Lightning does not call ``on_train_epoch_start`` for the epoch a fit resumes
    inside (a checkpoint written mid-epoch, or on an epoch's last batch: then the next epoch), which is where its
    ``GradientAccumulationScheduler`` sets the Trainer's ``accumulate_grad_batches``; that epoch would train at
    accumulation 1 and take other steps than the schedule counts. Under such a scheduler this callback sets the
    scheduled accumulation of the current epoch at the first batch of a fit resumed inside an epoch, so the resumed
    batches accumulate as an uninterrupted run's do.
    """

    def __init__(self) -> None:
        super().__init__()
        # the GradientAccumulationScheduler whose accumulation the first batch of a fit resumed mid-epoch must train at
        self._accumulation: GradientAccumulationScheduler | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._accumulation = _resumed_accumulation_scheduler(trainer)
        found = 0
        for cfg in trainer.lr_scheduler_configs:
            if isinstance(cfg.scheduler, WarmupCosineLR):
                found += 1
                sched = cfg.scheduler
                if cfg.interval != "step" and cfg.frequency != 1:
                    # "every N epochs" cannot be kept by a per-step schedule, and N batches is not what was asked
                    raise ValueError(
                        f"PerStepLR steps WarmupCosineLR per optimizer step, but its scheduler config has `interval` "
                        f"{cfg.interval!r} with `frequency` {cfg.frequency!r} (a step every {cfg.frequency} epochs). "
                        "Set `interval: 'step'` (`frequency` then counts batches), or drop PerStepLR."
                    )
                # LightningCLI's `lr_scheduler:` block gives the default interval, "epoch"
                cfg.interval = "step"
                _check_frequency_steps(trainer, cfg.frequency)
                steps, _ = fit_scheduler_steps(trainer, cfg.frequency)
                if steps == 0 and sched.total_steps_arg is None:
                    # an epoch does step it (checked above): this fit ends first
                    raise ValueError(
                        f"The WarmupCosineLR scheduler config's `frequency` {cfg.frequency!r} never steps it in this "
                        f"fit: `max_steps` ({trainer.max_steps}) ends it before the first batch position that is a "
                        "multiple of the frequency. Raise `max_steps`, or lower `frequency` (1 steps it at every "
                        "optimizer step)."
                    )
                bind_to_fit(sched, trainer, sched.total_steps_arg, frequency=cfg.frequency)
        if not found:
            rank_zero_warn("PerStepLR found no WarmupCosineLR scheduler in this fit; it changed nothing.")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        scheduler, self._accumulation = self._accumulation, None
        _set_scheduled_accumulation(trainer, scheduler)


def _check_frequency_steps(trainer: Trainer, frequency: int) -> None:
    """Refuse a per-step scheduler ``frequency`` that an epoch of ``trainer``'s fit never steps: no optimizer step of
    the epoch ends a batch position divisible by it (a frequency above the batches of an epoch, or one that the
    ``accumulate_grad_batches`` positions never meet). The schedule would stay at its value for the whole fit,
    whatever ``total_steps`` says; under a ``GradientAccumulationScheduler`` every accumulation the fit reaches is
    checked up front, since one met from a later epoch would freeze the schedule from there on. A ``frequency`` below
    1 is refused first (Lightning would divide by it at the first step)."""
    check_int(
        "frequency",
        frequency,
        low=1,
        fix="It is the WarmupCosineLR scheduler config's: the schedule steps at every `frequency`-th batch (1: every "
        "optimizer step).",
    )
    batches = trainer.num_training_batches
    if not math.isfinite(batches) or int(batches) < 1:
        return  # unknown epoch length (an iterable dataset): nothing to check against
    batches = int(batches)
    scheduler = _accumulation_scheduler(trainer)
    for epoch, accumulate in _fit_accumulations(trainer):
        if epoch > trainer.current_epoch and scheduler is not None and trainer.max_steps != -1:
            # an epoch `max_steps` ends the fit before (whole epochs counted from the current one) is never trained
            before = sum(
                math.ceil(batches / scheduler.get_accumulate_grad_batches(e))
                for e in range(trainer.current_epoch, epoch)
            )
            if trainer.global_step + before >= trainer.max_steps:
                break
        if _scheduler_steps_per_epoch(batches, accumulate, frequency) == 0:
            _refuse_frequency(trainer, frequency, batches, accumulate, epoch)


def _fit_accumulations(trainer: Trainer) -> list[tuple[int, int]]:
    """``(first epoch, accumulate_grad_batches)`` of each accumulation ``trainer``'s fit trains at from the current
    epoch on: the Trainer's, or under a ``GradientAccumulationScheduler`` each one its schedule reaches before
    ``max_epochs``."""
    current = trainer.current_epoch
    scheduler = _accumulation_scheduler(trainer)
    if scheduler is None:
        return [(current, int(trainer.accumulate_grad_batches))]
    last = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    starts = [current] + sorted(e for e in scheduler.scheduling if e > current and (last is None or e < last))
    return [(e, int(scheduler.get_accumulate_grad_batches(e))) for e in starts]


def _refuse_frequency(trainer: Trainer, frequency: int, batches: int, accumulate: int, epoch: int) -> None:
    """Raise the ``ValueError`` of a ``frequency`` that an epoch at ``accumulate`` never steps, with the optimizer's
    batch positions."""
    # the optimizer's batch positions, the first few of them: every `accumulate`-th, then the epoch's last
    positions = list(range(accumulate, batches + 1, accumulate)[:6])
    if batches % accumulate and len(positions) < 6:
        positions.append(batches)
    more = batches // accumulate + int(batches % accumulate != 0) > len(positions)
    shown = ", ".join(map(str, positions)) + (", ..." if more else "")
    how = f"with `accumulate_grad_batches` {accumulate} " if accumulate > 1 else ""
    when = ""
    if epoch > trainer.current_epoch:
        # a later epoch of a GradientAccumulationScheduler: the schedule would freeze from there on
        when = f" from epoch {epoch} on (the GradientAccumulationScheduler's `accumulate_grad_batches` {accumulate})"
    raise ValueError(
        f"The WarmupCosineLR scheduler config's `frequency` {frequency!r} never steps it{when}: Lightning steps it "
        f"after an optimizer step whose batch position in the epoch is a multiple of the frequency, and {how}the "
        f"optimizer steps after batches {shown} of the epoch's {batches}, none a multiple of {frequency}. Use a "
        "`frequency` that divides one of those positions in every epoch (1 steps it at every optimizer step)."
    )


def _input_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype ``precision`` converts floating-point inputs to (``"bf16-true"``: bfloat16, ``"64-true"``: float64),
    or None when it leaves float32 alone (``"32-true"``, the ``*-mixed`` modes). Lightning's plugins convert the model
    to the dtype they convert its inputs to."""
    probe = torch.zeros((), dtype=torch.float32)
    out = precision.convert_input(probe)
    if isinstance(out, torch.Tensor) and out.dtype != probe.dtype:
        return out.dtype
    return None


def _floating_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of ``module``'s first floating-point parameter (or buffer): what its layers compute in."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _to_floating_dtype(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating-point tensor of another dtype converted to ``dtype``; the rest as it is."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return apply_to_collection(data, torch.Tensor, convert)


class KnowledgeDistillation(Callback):
    """Add ``alpha * T^2 * KL(teacher || student)`` to the student's loss and weight the hard loss by ``1 - alpha``.

    **How the student's logits and loss are reached** (the protocol, in order of precedence):

    1. *Hard loss*: what ``training_step`` returns -- a tensor, or the ``"loss"`` entry of a dict.
    2. *Student logits*: the ``"logits"`` entry if ``training_step`` returns a dict that has one; otherwise the output
       of the module's own ``forward``, captured with a forward hook -- i.e. ``training_step`` must call ``self(x)``
       exactly once.
    3. *Teacher inputs*: ``pl_module.distillation_inputs(batch)`` if the module defines it (a tensor or a tuple of
       positional args); otherwise the arguments of that captured ``self(x)`` call; otherwise ``batch[0]`` for
       tuple/list batches, or the batch itself.

    The callback wraps ``training_step`` on the module instance for the duration of ``fit`` and returns
    ``(1 - alpha) * hard + alpha * T^2 * KL`` in place of the hard loss (logged as ``distill/hard_loss`` and
    ``distill/soft_loss``). The teacher lives on the callback, not on the module: it is not a submodule, so it is not
    in the optimizer, not in ``state_dict``/checkpoints and not in the DDP wrapper; it is frozen, in eval mode, and
    moved to the module's device at fit start. Under DDP each rank runs its own teacher copy on its own shard of the
    batch.

    **Several teachers.** Each callback adds its own term: with two, the second takes the first's combined loss as its
    hard loss. The callbacks log apart (``distill/soft_loss`` for the first, ``distill/soft_loss_1`` for the second, in
    ``callbacks`` order) and checkpoint apart: the state key names the teacher (its class and a hash of its weights,
    :func:`~lightning_accel.recipes.distill.teacher_fingerprint`), ``temperature`` and ``alpha``, so a resume with
    the same teachers gives each callback its own state. A Trainer with one such callback also takes the one state of
    a checkpoint written by an earlier version (keyed by the bare class name, or by a teacher hash computed from a
    sample of the weights, when it is this teacher's). The key names ``KnowledgeDistillation`` whatever the class, so
    a subclass and this class resume each other's checkpoints. A state of another teacher (the checkpoint was
    distilled from another one) is not applied: this teacher starts afresh, and a warning on global rank 0 names both
    teachers.

    **Precision.** At fit start the teacher is converted, in place, to the dtype the Trainer's precision gives the
    student's inputs (``"bf16-true"``: bfloat16, ``"16-true"``: float16, ``"64-true"``: float64; the ``*-mixed``
    modes and ``"32-true"`` leave it as it is); the tensors it converts are kept on the CPU meanwhile and put back at
    fit end (also after a failed fit), so the teacher leaves the fit with its own dtypes and exact values. Its inputs
    are converted like the batch, then to the teacher's own floating-point dtype where that differs (a bfloat16 teacher
    kept small beside a float32 student, a float64 teacher; integer inputs such as token ids are left alone). Its
    forward runs inside the student's ``training_step``, so under the precision's context too (autocast for
    ``*-mixed``).

    **Automatic optimization only.** The distillation term is added to the loss ``training_step`` returns, which
    Lightning back-propagates; a module with ``automatic_optimization = False`` calls ``manual_backward`` itself, on
    its own loss, so the callback refuses it at fit start instead of training without the teacher.

    Args:
        teacher: the teacher network (any ``nn.Module`` mapping the student's inputs to logits of the same shape), or
            the path of a checkpoint of it, plain or ``DeltaCheckpointIO`` (then ``teacher_class`` is required; read
            with :func:`~lightning_accel.checkpoint.read_checkpoint`, which never unpickles arbitrary objects).
        temperature: softening temperature ``T > 0``, finite.
        alpha: weight of the distillation term in [0, 1].
        teacher_class: the teacher's class (or import path) when ``teacher`` is a checkpoint path; with a module as
            ``teacher`` it is unused, and a warning says so.

    Raises:
        ValueError: ``temperature`` not finite and > 0, ``alpha`` outside [0, 1], (at fit start) a teacher that is a
            submodule of the student or shares parameters with it (a tied embedding: the student's shared parameters
            are made trainable again, as they were before the teacher was frozen), a module with manual optimization,
            or (at the first step) teacher logits whose shape differs from the student's -- each naming the argument.
    """

    def __init__(
        self,
        teacher: nn.Module | str,
        temperature: float = 4.0,
        alpha: float = 0.5,
        teacher_class: type[nn.Module] | str | None = None,
    ) -> None:
        check_distillation_args(temperature, alpha)
        if isinstance(teacher, (str, os.PathLike)):
            teacher = load_teacher(teacher, teacher_class)
        elif teacher_class is not None:
            warnings.warn(
                f"`teacher_class` ({teacher_class!r}) is used only when `teacher` is a checkpoint path; `teacher` is "
                f"a module ({type(teacher).__name__}), so it is ignored. Drop `teacher_class`.",
                UserWarning,
                stacklevel=2,
            )
        # the parameters the caller left trainable: a student sharing one of them (a tied embedding) gets it back
        # trainable when the fit refuses the shared teacher, instead of leaving it silently frozen by the freeze below
        self._trainable = (
            frozenset(name for name, p in teacher.named_parameters() if p.requires_grad)
            if isinstance(teacher, nn.Module)
            else frozenset()
        )
        self.teacher = freeze_teacher(teacher)
        self.temperature = float(temperature)
        self.alpha = float(alpha)
        # fixed here, before any fit converts the teacher (device, precision) or a schedule changes `alpha`, so a
        # resume with the same arguments finds the same key
        self._fingerprint = teacher_fingerprint(self.teacher)
        # the key earlier versions wrote for this teacher, to recognise its state in their checkpoints
        self._legacy_fingerprint = legacy_teacher_fingerprint(self.teacher)
        config = {"teacher": self._fingerprint, "temperature": self.temperature, "alpha": self.alpha}
        # the algorithm's name, not `type(self)`'s: a user's subclass and this class resume each other's checkpoints
        self._state_key = f"KnowledgeDistillation{config!r}"
        self._module: LightningModule | None = None
        self._precision: Precision | None = None
        self._teacher_dtype: torch.dtype | None = None
        self._hook: Any = None
        self._patch: Patch | None = None
        self._capturing = False
        self._log_suffix = ""
        self._captured: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
        # the teacher's tensors (on the CPU) as they were before a "-true" precision converted them for the fit
        self._teacher_originals: dict[str, torch.Tensor] = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if any(m is self.teacher for m in pl_module.modules()):
            raise ValueError(
                "`teacher` is a submodule of the student LightningModule, so it would be trained, checkpointed and "
                "wrapped by DDP. Keep the teacher out of the module (pass it only to KnowledgeDistillation)."
            )
        self._refuse_shared_parameters(pl_module)
        if not pl_module.automatic_optimization:
            # the soft term would be added to a returned loss nobody back-propagates: training without the teacher
            raise ValueError(
                f"KnowledgeDistillation needs automatic optimization, but {type(pl_module).__name__} sets "
                "`automatic_optimization = False`: its `manual_backward` never sees the distillation term the callback "
                "adds to the returned loss. Use automatic optimization, or drop the callback and add "
                "`lightning_accel.recipes.distillation_loss(student_logits, teacher_logits, T)` to your loss yourself."
            )
        self.teacher.to(pl_module.device)
        self._precision = trainer.precision_plugin
        dtype = _input_dtype(self._precision)
        if dtype is not None:
            # the user's own values of the tensors the conversion changes, restored at fit end: converted in place and
            # left so, a float32 teacher would keep bfloat16-rounded weights for every later fit and for the user
            self._teacher_originals = {
                name: t.detach().to("cpu", copy=True)
                for name, t in (*self.teacher.named_parameters(), *self.teacher.named_buffers())
                if t.is_floating_point() and t.dtype != dtype
            }
            # not `convert_module`: a plugin may keep state about the one model it converts (FusedPrecision records
            # it to undo its surgery), and a frozen teacher needs only the dtype its inputs arrive in
            self.teacher.to(dtype=dtype)
        freeze_teacher(self.teacher)
        self._teacher_dtype = _floating_dtype(self.teacher)
        # several teachers log apart (`distill/soft_loss`, `distill/soft_loss_1`, ...): one name would average them
        mine = [cb for cb in trainer.callbacks if isinstance(cb, KnowledgeDistillation)]  # type: ignore[attr-defined]
        index = next(i for i, cb in enumerate(mine) if cb is self)
        self._log_suffix = f"_{index}" if index else ""
        self._install(pl_module)

    def _refuse_shared_parameters(self, pl_module: LightningModule) -> None:
        """Refuse a teacher holding parameters of the student (the same tensor, or views of one storage).

        Freezing the teacher freezes them in the student, a ``"-true"`` precision would convert them in place, and
        giving the teacher back its values at fit end would undo the student's training of them. The student's
        parameters that were trainable before the teacher was frozen are made trainable again first, so the refused
        fit leaves the student as it was.
        """
        student = {id(p) for p in pl_module.parameters()}
        storages = {_storage_key(p) for p in pl_module.parameters()} - {None}
        shared = [
            (name, p)
            for name, p in self.teacher.named_parameters(remove_duplicate=False)
            if id(p) in student or _storage_key(p) in storages
        ]
        if not shared:
            return
        for name, p in shared:
            if name in self._trainable:
                p.requires_grad_(True)
        names = sorted({name for name, _ in shared})
        raise ValueError(
            f"`teacher` shares {len(names)} parameter(s) with the student {type(pl_module).__name__}: "
            f"{', '.join(map(repr, names[:5]))}{', ...' if len(names) > 5 else ''}. Freezing the teacher would "
            "freeze them in the student (and a '-true' precision would convert them). Pass a copy of the teacher "
            "(`copy.deepcopy(teacher)`) or a separately loaded one."
        )

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.teacher.eval()  # in case anything switched it back to train mode

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._uninstall()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._uninstall()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._uninstall()  # a failed fit must not leave the module wrapped

    @property
    @override
    def state_key(self) -> str:
        # one key per teacher and hyper-parameters: Lightning refuses two stateful callbacks with one key, and an
        # ensemble distils from two teachers with two callbacks; spelt as Lightning's own keys (`ModelCheckpoint{...}`)
        return self._state_key

    @override
    def state_dict(self) -> dict[str, Any]:
        # Hyper-parameters only: the teacher's weights never go into the student's checkpoints.
        return {"temperature": self.temperature, "alpha": self.alpha}

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A checkpoint written by an earlier version keys the state by the bare class name (taken when this is the only
        # KnowledgeDistillation of the Trainer: otherwise which one wrote it is unknown), or by the same
        # `KnowledgeDistillation{...}` form with a teacher hash computed from a sample of the weights (taken when that
        # hash is this teacher's); for a subclass, earlier versions wrote the subclass's name in place of
        # `KnowledgeDistillation`, so a state of this form under any class name is taken. A state keyed by another
        # teacher is not this one's: the resumed fit distils from another teacher, which starts afresh, and is told so
        # (a changed teacher is a choice, not an error)
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return
        mine = [cb for cb in trainer.callbacks if isinstance(cb, KnowledgeDistillation)]  # type: ignore[attr-defined]
        claimed = {cb.state_key for cb in mine}
        teachers = {k: _key_teacher(k) for k in states if isinstance(k, str) and k not in claimed}
        older = [k for k, teacher in teachers.items() if teacher is not None]
        own = [k for k in older if teachers[k] in (self._fingerprint, self._legacy_fingerprint)]
        if len(own) == 1 and states[own[0]]:
            self.load_state_dict(dict(states[own[0]]))
            return
        if len(mine) == 1:
            bare = [states[n] for n in _class_names(type(self), KnowledgeDistillation) if states.get(n)]
            if bare:
                self.load_state_dict(dict(bare[0]))
                return
        # states of teachers that no KnowledgeDistillation of this Trainer distils from (the first callback missing
        # its state reports them, once)
        known = {f for cb in mine for f in (cb._fingerprint, cb._legacy_fingerprint)}
        foreign = [teachers[k] for k in older if teachers[k] not in known]
        first = next(cb for cb in mine if cb.state_key not in states)
        if foreign and first is self:
            named = ", ".join(map(str, foreign))
            rank_zero_warn(
                f"KnowledgeDistillation: the checkpoint holds the distillation state of teacher(s) {named}, not "
                f"of this fit's teacher {self._fingerprint}; it is not applied, and this teacher starts afresh with "
                f"temperature {self.temperature} and alpha {self.alpha}. Resume with the checkpoint's teacher to "
                "continue its distillation."
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the configured hyper-parameters win over a checkpoint's (an older one, keyed by the bare class name, may
        # hold others): a change is reported
        saved = {k: state_dict.get(k) for k in ("temperature", "alpha")}
        if saved != {"temperature": self.temperature, "alpha": self.alpha}:
            rank_zero_warn(
                f"KnowledgeDistillation: the checkpoint was trained with temperature {saved['temperature']} and alpha "
                f"{saved['alpha']}; this fit continues with temperature {self.temperature} and alpha {self.alpha}."
            )

    def _install(self, pl_module: LightningModule) -> None:
        if self._module is not None:
            return

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._capturing:
                self._captured.append((args, kwargs, output))

        def distilled(p: Patch) -> Callable[..., Any]:
            def training_step(*args: Any, **kwargs: Any) -> Any:
                self._captured = []
                self._capturing = True
                try:
                    # `p.original` (the class's bound method, or a user's instance override) read at each call: a
                    # patch below this one restored first is spliced out of the chain through it
                    out = p.original(*args, **kwargs)
                finally:
                    self._capturing = False
                batch = args[0] if args else kwargs.get("batch")
                try:
                    return self._distil(pl_module, out, batch)
                finally:
                    self._captured = []

            return training_step

        self._hook = pl_module.register_forward_hook(hook, with_kwargs=True)
        # wrapped on the instance for the fit, restored by `_uninstall`
        self._patch = patch(pl_module, "training_step", distilled, key=f"KnowledgeDistillation-{id(self)}")
        self._module = pl_module

    def _restore_teacher(self) -> None:
        """Give the teacher back the dtypes and exact values it had before the fit's precision converted it (on the
        device it was moved to)."""
        if not self._teacher_originals:
            return
        tensors = dict((*self.teacher.named_parameters(), *self.teacher.named_buffers()))
        with torch.no_grad():
            for name, original in self._teacher_originals.items():
                t = tensors.get(name)
                if t is not None:
                    # `.data`, as `Module.to` converts: the same Parameter objects, in their original dtype again
                    t.data = original.to(t.device)
        self._teacher_originals = {}

    def _uninstall(self) -> None:
        self._restore_teacher()
        if self._module is None:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._patch is not None:
            self._patch.restore()
            self._patch = None
        self._module = None
        self._precision = None
        self._teacher_dtype = None

    def _student_logits(self, out: Any) -> torch.Tensor:
        if isinstance(out, Mapping) and "logits" in out:
            return out["logits"]
        if len(self._captured) == 1 and isinstance(self._captured[0][2], torch.Tensor):
            return self._captured[0][2]
        raise ValueError(
            f"KnowledgeDistillation cannot find the student's logits: `training_step` returned "
            f"{type(out).__name__} without a 'logits' entry and called the module's forward {len(self._captured)} "
            "time(s). Either return {'loss': loss, 'logits': logits} from `training_step`, or call `self(x)` exactly "
            "once in it (its output is taken as the logits)."
        )

    def _teacher_inputs(self, pl_module: LightningModule, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        fn = getattr(pl_module, "distillation_inputs", None)
        if callable(fn):
            x = fn(batch)
            return (x if isinstance(x, tuple) else (x,)), {}
        if len(self._captured) == 1:
            return self._captured[0][0], self._captured[0][1]
        if isinstance(batch, (list, tuple)) and batch:
            return (batch[0],), {}
        return (batch,), {}

    def _distil(self, pl_module: LightningModule, out: Any, batch: Any) -> Any:
        if out is None:
            return None  # the module skipped this batch
        hard = out["loss"] if isinstance(out, Mapping) else out
        student = self._student_logits(out)
        t_args, t_kwargs = self._teacher_inputs(pl_module, batch)
        if self._precision is not None:
            # inputs made by `distillation_inputs` may not have been through the precision's conversion of the batch
            t_args, t_kwargs = self._precision.convert_input((t_args, t_kwargs))
        if self._teacher_dtype is not None:
            # a teacher kept in another dtype than the student's inputs (bf16 to save memory) needs its own
            t_args, t_kwargs = _to_floating_dtype((t_args, t_kwargs), self._teacher_dtype)
        # inside the student's `training_step`, so under the precision's forward context (autocast, default dtype)
        with torch.no_grad():
            teacher = self.teacher(*t_args, **t_kwargs)
        if not isinstance(teacher, torch.Tensor):
            raise ValueError(
                f"`teacher` must return a logits tensor, got {type(teacher).__name__}. Wrap it in a module whose "
                "forward returns the logits."
            )
        soft = distillation_loss(student, teacher, self.temperature)
        loss = combine_losses(hard, soft, self.alpha)
        suffix = self._log_suffix
        pl_module.log(f"distill/hard_loss{suffix}", hard.detach(), on_step=True, on_epoch=True, sync_dist=True)
        pl_module.log(f"distill/soft_loss{suffix}", soft.detach(), on_step=True, on_epoch=True, sync_dist=True)
        if isinstance(out, Mapping):
            return {**out, "loss": loss}
        return loss


#: ``<class name>{<arguments>}``: the form of the state keys of these callbacks (and of Lightning's own).
_STATE_KEY = re.compile(r"^([A-Za-z_][\w.]*)(\{.*\})$", re.DOTALL)


def _key_config(key: str, fields: frozenset[str]) -> dict[str, Any] | None:
    """The arguments of a ``<class name>{...}`` state key whose arguments are exactly ``fields``, or None.

    Any class name: earlier versions wrote a user's subclass's name, so the arguments say whose state it is.
    """
    match = _STATE_KEY.match(key)
    if match is None:
        return None
    try:
        config = ast.literal_eval(match.group(2))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return config if isinstance(config, dict) and set(config) == fields else None


def _key_teacher(key: str) -> str | None:
    """The teacher fingerprint of a ``KnowledgeDistillation{...}`` state key (under any class name), or None when it
    is not one."""
    config = _key_config(key, frozenset({"teacher", "temperature", "alpha"}))
    teacher = config.get("teacher") if config is not None else None
    return teacher if isinstance(teacher, str) else None


def _class_names(cls: type, base: type) -> list[str]:
    """The qualified names of ``cls`` and of its ancestors down to ``base``: the bare state keys earlier versions
    wrote for it (Lightning's default key is the class's ``__qualname__``)."""
    return [c.__qualname__ for c in cls.__mro__ if isinstance(c, type) and issubclass(c, base)]


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """``(device, address)`` of the storage under ``t``, or None where there is none to compare (empty, meta)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return str(t.device), t.untyped_storage().data_ptr()


def _submodule_inputs(pl_module: nn.Module, sub: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The positional arguments ``pl_module(*args)`` passes to its submodule ``sub`` first; None when unknown.

    One forward in eval mode and without gradients (BatchNorm statistics untouched, modes restored); it runs to the
    end rather than being cut short at ``sub``'s call, so other hooks on the module see a whole forward. Unknown:
    ``forward`` fails on ``args`` (a LightningModule without one, whose ``training_step`` calls the submodule),
    does not call ``sub``, or calls it with keyword arguments (which a trace cannot take).
    """
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def pre_hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        seen.append((a, kw))

    handle = sub.register_forward_pre_hook(pre_hook, with_kwargs=True)
    modes = {m: m.training for m in pl_module.modules()}
    pl_module.eval()
    try:
        with torch.no_grad():
            pl_module(*args)
    except Exception:
        if not seen:
            return None
    finally:
        handle.remove()
        for m, t in modes.items():
            m.train(t)
    if not seen or seen[0][1]:
        return None
    return seen[0][0]


def _broadcast_module_state(trainer: Trainer, module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers of ``module`` before it is ranked and sliced.

    Why: each rank ranks channels on its own values and slices its own optimizer state with the indices it found,
    while the re-wrap by DDP then copies rank 0's weights. Values that differ between ranks therefore let ranks keep
    different channels and slice their optimizer states apart: BatchNorm running statistics (each rank updates them
    from its own batches after DDP's broadcast; ``fold_bn`` ranks on them) and, under local-steps strategies
    (``diloco``), the weights themselves between syncs. Under plain DDP the weights are already equal and this costs
    one broadcast of the module at a pruning step. Every rank calls it at the same pruning step (a collective per
    tensor); one process, or a strategy that does not replicate the module with DDP, does nothing.
    """
    from lightning.pytorch.strategies import DDPStrategy

    if (
        trainer.world_size < 2
        or not isinstance(trainer.strategy, DDPStrategy)
        or not (torch.distributed.is_available() and torch.distributed.is_initialized())
    ):
        return
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            torch.distributed.broadcast(t.data, src=0)


class StructuredPruning(Callback):
    """Remove the weakest whole channels/neurons at the start of chosen epochs; fine-tune on the smaller model.

    At the first training batch of each epoch in ``schedule`` the module (or its ``target`` submodule) is traced, its
    channel groups found (residual adds are pruned consistently, BatchNorm and the consuming layers shrink along) and
    ``amount`` of the original channels removed in total over the schedule (evenly split: step ``k`` of ``n`` brings
    the removed fraction to ``amount * k / n``). This is structured pruning with real speed-ups; for unstructured
    masks use Lightning's ``ModelPruning``.

    **BatchNorm after pruning.** The sliced running statistics describe the unpruned network (the layers behind a
    pruned group see fewer input channels): by default they are rebuilt from the pruning batch (``recalibrate_bn``).
    A module whose BatchNorms are *all* in eval mode (a trained model evaluated before ``fit``; Lightning keeps the
    mode) is switched to train mode with a warning (``train_mode``) -- otherwise they would fine-tune on frozen
    statistics.

    **Optimizer after pruning.** The sliced parameters are new tensors. The callback re-points every optimizer of the
    trainer to them and slices their per-parameter state (momentum, Adam moments) with the same indices -- the
    equivalent of rebuilding the optimizer with ``trainer.strategy.setup_optimizers(trainer)`` but keeping the kept
    channels' state and the LR schedule's position (``setup_optimizers`` would restart warm-up). Under DDP the model
    is re-wrapped (``DDPStrategy.configure_ddp``) because DDP's gradient buckets are sized for the old parameters.
    Every rank ranks rank 0's parameters and buffers (broadcast first), so all ranks keep the same channels and slice
    their optimizer states alike: BatchNorm statistics differ between ranks, and so do the weights between syncs
    under local steps (``strategy="diloco"``, whose re-wrap then continues from rank 0's model).

    **Checkpoints.** A checkpoint saved after pruning holds the smaller weights. While this callback is attached
    (e.g. when resuming with ``ckpt_path``) the module's layers are resized to the checkpoint's shapes before the
    weights load; elsewhere use :func:`lightning_accel.recipes.prune.resize_to_state_dict` before
    ``load_state_dict``. The epochs already pruned are in the callback's state, so resuming never prunes twice, nor
    does another fit of the module already pruned; a later fit of another module without a checkpoint (a fresh model)
    is pruned on the schedule from the start. Resumed with another ``amount`` than the checkpoint's, the epochs left
    take the removed fraction from what the pruned epochs removed to the new ``amount``, with a warning (they prune
    nothing when more is removed already: channels do not grow back). The state is keyed by ``target`` and
    ``schedule``, so several of these callbacks (a backbone and a head pruned by their own amounts, at their own
    epochs) can share a Trainer and its checkpoints.

    Args:
        amount: total fraction in [0, 1) of each prunable group's channels to remove.
        norm: filter norm ranking the channels, ``"l1"`` or ``"l2"``.
        schedule: epoch (or epochs) at whose start to prune; ``0`` prunes before training (prune-then-fine-tune).
        target: dotted name of the submodule to prune, never empty (``None``: the LightningModule itself, traced
            through its ``forward``). It is traced with the inputs the module's ``forward`` passes to it (so it may
            sit behind a stem), or with the module's inputs when ``forward`` does not reach it.
        ignore_modules: module names (relative to the pruned module) whose outputs must keep all channels; one name
            alone may be a string (in LightningCLI YAML too: the annotation says so, ``ignore_modules: model.fc``).
            Checked against the module's ``named_modules()`` at ``setup``.
        ignore: deprecated spelling of ``ignore_modules`` (same values).
        round_to: keep a multiple of this many channels per group.
        fold_bn: rank the channels of a layer followed by a BatchNorm on the BN-folded filter norm
            (:func:`~lightning_accel.recipes.prune.channel_importance`) instead of the raw filter norm. Off
            by default: it did not lower the accuracy drop of pruning + fine-tune on the digits ResNet
            (``benchmarks/recipes.py`` measures that drop, ``pruned_acc_drop``, over several seeds).
        recalibrate_bn: after each pruning step, rebuild every BatchNorm's running statistics from the pruning batch
            (:func:`~lightning_accel.recipes.prune.recalibrate_batchnorm`: one extra no-grad forward). The sliced
            statistics describe the unpruned network: the layers behind a pruned group see fewer input channels.
            With a ``target`` behind other layers (a stem) the forward runs through them too; their BatchNorms are
            not pruned and keep their statistics (the training step counts the batch once).
        train_mode: at a pruning step, switch the module to train mode (with a warning) when *all* its BatchNorms are
            in eval mode -- the state of a trained model evaluated before ``fit``, which Lightning keeps; ``False``
            leaves frozen norms frozen (they still get the recalibrated statistics).

    Raises:
        TypeError: an ``amount``, ``norm``, ``schedule`` (a string too) or entry of it, ``target``, ``ignore_modules``
            entry, ``round_to``, ``fold_bn``, ``recalibrate_bn`` or ``train_mode`` of the wrong type (a bool for an
            epoch, an int for a flag).
        ValueError: ``amount`` outside [0, 1), a bad ``norm``, negative or duplicate epochs in ``schedule``, an
            empty ``target``, an ``ignore_modules`` entry ``""`` (the pruned module's own name); at ``setup``, an
            ``ignore_modules`` name that is not a module of the pruned module (the close names are listed).
    """

    def __init__(
        self,
        amount: float = 0.5,
        *,
        norm: str = "l1",
        schedule: int | Sequence[int] = 0,
        target: str | None = None,
        ignore_modules: str | Sequence[str] = (),
        round_to: int = 1,
        fold_bn: bool = False,
        recalibrate_bn: bool = True,
        train_mode: bool = True,
        ignore: str | Sequence[str] | None = None,
    ) -> None:
        self.amount = check_amount(amount)
        check_choice("norm", norm, ("l1", "l2"))
        fix = "E.g. `schedule=0` prunes before training, `schedule=[1, 2, 3]` prunes in three steps."
        if isinstance(schedule, (str, bytes)):
            # a string is a Sequence: "12" was read as the epochs '1' and '2', and the error quoted '1'
            raise TypeError(
                f"`schedule` must be an epoch index >= 0 or a list of them, got {schedule!r} "
                f"({type(schedule).__name__}). {fix}"
            )
        epochs = [schedule] if isinstance(schedule, int) or not isinstance(schedule, Sequence) else list(schedule)
        if not epochs:
            raise ValueError(f"`schedule` must be an epoch index >= 0 or a non-empty list of them, got []. {fix}")
        for e in epochs:
            check_int("schedule", e, low=0, fix=f"It holds epoch indices. {fix}")
        if len(set(epochs)) != len(epochs):
            raise ValueError(f"`schedule` has repeated epochs: {schedule!r}. List each epoch once.")
        check_int("round_to", round_to, low=1)
        if target is not None and not isinstance(target, str):
            raise TypeError(
                f"`target` must be the dotted name of a submodule (a string) or None, got {target!r} "
                f"({type(target).__name__}). E.g. 'model', or None to prune the whole module."
            )
        if target is not None and not target.strip():
            # `get_submodule("")` is the module itself: an empty name would silently prune the whole model
            raise ValueError(
                f"`target` must be the dotted name of a submodule or None, got {target!r}. Use None to prune the "
                "whole LightningModule, or name the submodule, e.g. 'model'."
            )
        # a YAML `recalibrate_bn: "false"` must not read as True
        self.fold_bn = check_bool("fold_bn", fold_bn)
        self.recalibrate_bn = check_bool("recalibrate_bn", recalibrate_bn)
        self.train_mode = check_bool("train_mode", train_mode)
        self.norm = norm
        self.schedule = sorted(epochs)
        # the fraction of the current channels each scheduled epoch removes; re-planned by `load_state_dict` when the
        # checkpoint pruned its epochs with another `amount`
        self.step_amounts = self._plan()
        self.target = target
        given = check_module_names("ignore_modules", ignore_modules) or ()
        old = check_module_names("ignore", ignore)
        self.ignore_modules = tuple(renamed_argument("ignore_modules", given, "ignore", old, new_given=bool(given)))
        self.round_to = round_to
        self.done: list[int] = []
        self.history: list[dict[str, Any]] = []
        self._hook: Any = None
        # the target's `forward` inputs are the LightningModule's (its `forward` does not reach the target)
        self._target_takes_inputs = False
        # the module `done` describes: a fit of another module (a fresh model, no checkpoint) starts unpruned
        self._owner: weakref.ReferenceType[LightningModule] | None = None

    def _plan(self, removed: float | None = None) -> dict[int, float]:
        """``{epoch: fraction of the current channels}``: for every scheduled epoch (``removed`` None, the plan of
        ``amount`` from the start), or for those not pruned yet, taking the removed fraction of the original channels
        from ``removed`` to ``amount`` in even steps."""
        if removed is None:
            return dict(zip(self.schedule, schedule_amounts(self.amount, len(self.schedule)), strict=True))
        left = [e for e in self.schedule if e not in self.done]
        return dict(zip(left, schedule_amounts(self.amount, len(left), removed=removed), strict=True)) if left else {}

    def _module(self, pl_module: LightningModule) -> nn.Module:
        if self.target is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.target)
        except AttributeError as e:
            raise ValueError(
                f"`target` {self.target!r} is not a submodule of {type(pl_module).__name__}. Pass a dotted name from "
                "`named_modules()` (e.g. 'model'), or None to prune the whole module."
            ) from e

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # `target` and the ignored names, checked before the first epoch rather than at the pruning step
        check_module_names("ignore_modules", self.ignore_modules, self._module(pl_module))
        if stage == "fit" and (self._owner is None or self._owner() is not pl_module):
            # the epochs pruned belong to the module that was pruned: a later fit of a fresh module by this callback
            # prunes it on its own schedule (a resume restores them through `load_state_dict`, after this hook), while
            # another fit of the module already pruned does not prune it twice
            self.done = []
            self.history = []
            self.step_amounts = self._plan()
        if self._hook is None:
            # Resuming from a pruned checkpoint: give the layers the saved (smaller) shapes before the weights load.
            def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
                resize_to_state_dict(module, state_dict, prefix)

            self._hook = pl_module.register_load_state_dict_pre_hook(pre_hook)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hook()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hook()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._owner = weakref.ref(pl_module)  # `done` (restored or empty) now describes this module
        # a scheduled epoch this fit never starts leaves the model (partly) unpruned, which nothing else would show
        start, last = trainer.current_epoch, trainer.max_epochs
        missed = [e for e in self.schedule if e < start and e not in self.done]
        if missed:
            rank_zero_warn(
                f"StructuredPruning: `schedule` epochs {missed} come before epoch {start}, where this fit starts (a "
                "resumed checkpoint that did not prune at them), so they will not prune. Schedule epochs >= "
                f"{start} to prune in this fit."
            )
        beyond = [e for e in self.schedule if last is not None and last >= 0 and e >= last]
        if beyond and last is not None:
            rank_zero_warn(
                f"StructuredPruning: `schedule` epochs {beyond} are not reached with `max_epochs={last}` (the last "
                f"epoch is {last - 1}), so they will not prune. Raise `max_epochs` or schedule earlier epochs."
            )

    def __getstate__(self) -> dict[str, Any]:
        # a weak reference cannot be pickled (`ddp_spawn` pickles the callbacks); a copy has pruned no module of its own
        state = self.__dict__.copy()
        state["_owner"] = None
        return state

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _example_inputs(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> tuple[Any, ...]:
        """The positional inputs of the pruned module: the LightningModule's example input (``example_input_array``,
        else the batch's inputs) converted by the Trainer's precision like a batch, or, with a ``target``, what the
        module's ``forward`` passes to that submodule."""
        ex = pl_module.example_input_array
        if ex is None:
            ex = batch[0] if isinstance(batch, (list, tuple)) else batch
        if isinstance(ex, torch.Tensor):
            args: tuple[Any, ...] = (ex.to(pl_module.device),)
        elif isinstance(ex, tuple):
            args = tuple(a.to(pl_module.device) if isinstance(a, torch.Tensor) else a for a in ex)
        else:
            raise ValueError(
                "StructuredPruning needs an example input to trace the model: set `example_input_array` on the module "
                f"or use (inputs, targets) batches (got a {type(ex).__name__})."
            )
        # a "-true" precision converted the module (bf16, fp64) and converts each batch, but not `example_input_array`
        args = trainer.precision_plugin.convert_input(args)
        if self.target is None:
            return args
        # a submodule after a stem (or any preprocessing in `forward`) does not take the LightningModule's inputs;
        # where `forward` does not tell, the target is assumed to take them (the whole model under another name)
        found = _submodule_inputs(pl_module, self._module(pl_module), args)
        self._target_takes_inputs = found is None
        return args if found is None else found

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        epoch = trainer.current_epoch
        if epoch not in self.step_amounts or epoch in self.done:
            return
        module = self._module(pl_module)
        norms = batch_norms(module)
        if self.train_mode and norms and not any(bn.training for bn in norms):
            # Lightning keeps the mode a module arrives in: a trained model evaluated before this fit would fine-tune
            # with BatchNorm normalising by the sliced statistics of the unpruned network, never updated, and lose
            # accuracy (benchmarks/recipes.py measures the pruning drop on the digits ResNet)
            rank_zero_warn(
                f"StructuredPruning: every BatchNorm of the pruned module was in eval mode at epoch {epoch}'s first "
                "training batch (the model was evaluated before `fit`?); switching the module to train mode so they "
                "learn the pruned network's statistics. Pass `train_mode=False` to keep frozen norms frozen."
            )
            module.train()
        _broadcast_module_state(trainer, module)
        before = count_parameters(module)
        # the forwards below (trace, target probe, recalibration) run as the training step's does: under a "-true"
        # precision's default dtype, a "-mixed" one's autocast
        with trainer.precision_plugin.forward_context():
            result = self._prune(trainer, pl_module, module, batch, self.step_amounts[epoch])
        self._rewrap_ddp(trainer, pl_module)
        self.done.append(epoch)
        record = {
            "epoch": epoch,
            "params_before": before,
            "params_after": result.params_after,
            "groups": [(names, a, b) for names, a, b in result.groups],
        }
        self.history.append(record)
        rank_zero_info(
            f"StructuredPruning (epoch {epoch}): {len(result.groups)} channel groups shrunk, parameters "
            f"{before:,} -> {result.params_after:,} ({result.params_after / max(1, before):.2f}x)."
        )
        for logger in trainer.loggers:
            logger.log_metrics({"pruning/params": float(result.params_after)}, step=trainer.global_step)

    def _prune(
        self, trainer: Trainer, pl_module: LightningModule, module: nn.Module, batch: Any, amount: float
    ) -> PruneResult:
        """One pruning step of ``module`` by ``amount``, then (``recalibrate_bn``) its BatchNorm statistics rebuilt."""
        try:
            result = apply_structured_pruning(
                module,
                amount,
                self._example_inputs(trainer, pl_module, batch),
                norm=self.norm,
                optimizers=trainer.optimizers,
                ignore_modules=self.ignore_modules,
                round_to=self.round_to,
                fold_bn=self.fold_bn,
            )
        except UntraceableModelError as e:
            # the core cannot know the dotted names `target` takes, nor that the module already is a `target`
            prefix = f"{self.target}." if self.target else ""
            inside = [prefix + name for name, _ in module.named_children()]
            what = f"`target` {self.target!r}" if self.target else "the LightningModule"
            raise TypeError(
                f"StructuredPruning could not trace {what} ({type(module).__name__}) with torch.fx ({e.reason}). Pass "
                f"a traceable submodule as `target`, e.g. one of {inside}, or keep data-dependent control flow out of "
                "its forward."
            ) from e
        if self.recalibrate_bn:
            # one no-grad pass over the pruning batch with the norms in train mode: the sliced statistics describe the
            # unpruned network, which costs accuracy in eval mode until they are re-estimated (benchmarks/recipes.py
            # measures the pruned model's accuracy); frozen norms (`train_mode=False`) keep these fresh ones
            inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
            # through the LightningModule's forward, unless it does not reach the target (then traced on the inputs)
            direct = self._target_takes_inputs
            # that forward also runs the layers before the target (a stem): their BatchNorms, not pruned, would count
            # the pruning batch a second time (the training step counts it), so their statistics are put back after
            pruned = {id(bn) for bn in batch_norms(module)}
            outside = [bn for bn in batch_norms(pl_module) if id(bn) not in pruned] if not direct else []
            kept = [{k: v.clone() for k, v in bn.named_buffers(recurse=False)} for bn in outside]
            try:
                recalibrate_batchnorm(module, [inputs], forward=lambda m, x: m(x) if direct else pl_module(x))
            except Exception as e:
                raise ValueError(
                    "StructuredPruning could not rebuild the BatchNorm statistics by calling the module on the batch's "
                    f"inputs ({type(e).__name__}: {one_line(e)}). Use (inputs, targets) batches or pass "
                    "`recalibrate_bn=False`."
                ) from e
            finally:
                with torch.no_grad():
                    for bn, state in zip(outside, kept, strict=True):
                        for name, value in state.items():
                            bn.get_buffer(name).copy_(value)
        return result

    @staticmethod
    def _rewrap_ddp(trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning.pytorch.strategies import DDPStrategy
        from torch.nn.parallel import DistributedDataParallel

        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
            strategy.model = pl_module
            strategy.configure_ddp()

    @property
    @override
    def state_key(self) -> str:
        # one key per pruned submodule and schedule: Lightning refuses two stateful callbacks with one key (at fit
        # start), and pruning a backbone and a head with their own amounts and epochs takes two callbacks
        # spelt as Lightning's own keys (`ModelCheckpoint{...}`): the algorithm's name (not `type(self)`'s, so a user's
        # subclass and this class resume each other's checkpoints) and the distinguishing arguments
        return f"StructuredPruning{ {'target': self.target, 'schedule': self.schedule}!r}"

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Earlier versions keyed a subclass's state by the subclass's name (`MyPruning{...}`): a state of this form
        # with this callback's `target` and `schedule` is this one's, under any class name. Older ones keyed it by the
        # bare class name: that state belongs to this callback if it is the only StructuredPruning of the Trainer
        # (otherwise which one pruned is unknown, and none is restored)
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return
        mine = [cb for cb in trainer.callbacks if isinstance(cb, StructuredPruning)]  # type: ignore[attr-defined]
        claimed = {cb.state_key for cb in mine}
        config = {"target": self.target, "schedule": self.schedule}
        fields = frozenset(config)
        same = [k for k in states if isinstance(k, str) and k not in claimed and _key_config(k, fields) == config]
        if len(same) == 1 and states[same[0]]:
            self.load_state_dict(dict(states[same[0]]))
            return
        bare = [states[n] for n in _class_names(type(self), StructuredPruning) if states.get(n)]
        if bare and len(mine) == 1:
            self.load_state_dict(dict(bare[0]))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"amount": self.amount, "norm": self.norm, "done": list(self.done), "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = list(state_dict.get("done", []))
        self.history = list(state_dict.get("history", []))
        saved = state_dict.get("amount")
        pruned = sorted(e for e in self.done if e in self.schedule)
        self.step_amounts = self._plan()
        if not isinstance(saved, (int, float)) or isinstance(saved, bool) or saved == self.amount or not pruned:
            return
        # the checkpoint's epochs took `saved * k / n` of the original channels, while this amount's own plan assumes
        # `amount * k / n` (one step of a 0.5 plan over 2 epochs, then 0.75's second step, ends at 5/8 removed): the
        # remaining epochs are planned from what was removed
        removed = float(saved) * len(pruned) / len(self.schedule)
        self.step_amounts = self._plan(removed)
        left = sorted(self.step_amounts)
        if not left:
            then = "no scheduled epoch is left to prune"
        elif self.amount > removed:
            then = (
                f"the remaining epochs {left} bring the removed fraction of the channels from {removed:g} to "
                f"{self.amount:g}"
            )
        else:
            then = f"{removed:g} of the channels are removed already, so the remaining epochs {left} prune nothing"
        rank_zero_warn(
            f"StructuredPruning: the checkpoint pruned epochs {pruned} of `schedule` {self.schedule} with `amount` "
            f"{saved:g}; this fit continues with `amount` {self.amount:g}: {then}."
        )
