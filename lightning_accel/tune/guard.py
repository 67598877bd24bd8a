"""``RollbackGuard``: watch the loss and the gradient norm, roll back to the last good state and switch the most
recently enabled lever off when training goes wrong.

The Lightning adapter of :mod:`lightning_accel.tune._watch` (the rule and the snapshot, plain torch). Levers are the
objects of a run that implement :class:`lightning_accel._utils.levers.Lever` (``OneBitDDPStrategy``,
``FusedPrecision``, ``DeltaCheckpointIO``; any object passed in ``levers=``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel._utils.checks import check_bool, check_int
from lightning_accel._utils.compat import model_checkpoint_step_interval, rewind_global_step
from lightning_accel._utils.levers import Lever, find_levers
from lightning_accel._utils.rank import distributed_ready
from lightning_accel.tune._watch import (
    SeriesWatch,
    Snapshot,
    Trigger,
    WatchRule,
    batch_loss,
    local_shard,
    unscaled_loss,
)

__all__ = ["RollbackGuard"]

_CODES = {"spike": 1, "nonfinite": 2}
_KINDS = {v: k for k, v in _CODES.items()}


class RollbackGuard(Callback):
    """Roll training back to the last good state when the loss or the gradient norm goes wrong, switch the most
    recently enabled lever off, and continue; stop the fit after ``max_rollbacks`` rollbacks.

    Contract:

    * **Watch.** Every training batch's loss (``training_step``'s ``loss``; under manual optimization, when
      ``training_step`` returns none, the sum of the losses given to ``manual_backward`` in the batch, unscaled) and,
      with ``watch_grad_norm``, the total gradient norm before each optimizer step (2-norm over the LightningModule's
      gradients, after AMP unscaling) are fed to the rule of :class:`~lightning_accel.tune._watch.WatchRule`:
      ``nan_streak`` non-finite values in a row, or ``spike_steps`` values in a row more than ``spike_sigma`` EMA
      standard deviations above the EMA mean (armed after ``arm_after`` values). For ``window_steps`` steps after a
      lever switches on (the 1-bit compressed stage starting after warm-up; fused modules and quantized checkpoints
      from the start of the fit, i.e. right after surgery or a resume) the stricter ``window_sigma`` /
      ``window_spike_steps`` apply. With a GradScaler a non-finite gradient norm is the scaler's business (it skips
      that step) and is not counted.
    * **Cost.** The values stay on the device; every ``check_every`` steps they are copied to the host at once (one
      sync) and, with several processes, one 3-element all-reduce makes every rank decide alike. Every
      ``snapshot_every`` steps (when no streak is open) the model's tensors, the optimizers' state and
      hyper-parameters and the LR schedulers' state are copied into one reused set of CPU buffers (pinned on CUDA):
      one CPU copy of model + optimizer state is the memory bound. A snapshot is taken in the optimizer step after
      it falls due, before the update, and only when that step's loss and gradients are finite on every rank (so a
      snapshot never holds the update of a bad step). The first is the state at the first training batch of ``fit``,
      after every callback's ``on_train_start`` (a learning rate scaled by ``LinearScalingLR``, a schedule bound by
      ``PerStepLR``); and when the optimizers' parameters are replaced mid-fit (``StructuredPruning`` slices the
      layers), a fresh one is taken in the next optimizer step, before its update: the old one no longer fits the
      model.
    * **Checkpoints.** The values pending are also checked before each save a checkpoint callback can make between
      two checks, so no checkpoint holds the weights of a bad step: at the end of an epoch, at the start of a
      validation, at a step where a ``ModelCheckpoint(every_n_train_steps=N)`` saves, and at every step when a
      ``ModelCheckpoint`` saves by the clock (``train_time_interval``: any step may save). When the last optimizer
      step's gradient norm was not sampled, that check also makes sure every weight is finite (one norm over the
      parameters), so a NaN gradient does not reach a checkpoint before the next loss shows it.
    * **Rollback.** On a trigger on any rank, every rank restores the snapshot in place (parameters, buffers,
      optimizer state, learning rates, schedulers; with ``replay_lost_steps`` in a fit bound by ``max_steps`` the
      step counter too, so it trains the steps the rollback took back and its schedule ends where it would have;
      the data position goes on) and drops every optimizer's gradients (``set_to_none``: under gradient
      accumulation a rollback mid-window leaves the window's step only the gradients of the batches after it), the
      most recently switched-on active lever is switched off through its
      ``switch_off(reason)`` (``ddp_1bit`` -> fp32 averaging, fused modules -> the reference ops, quantized
      checkpoint deltas -> lossless), the event is logged
      (``guard/rollbacks``, a ``rank_zero_warn`` line with the reason, an entry in :attr:`events`, a line in the
      ``PerformanceMonitor`` report's ``extras`` when one is present) and training continues.
    * **Stop.** The trigger after ``max_rollbacks`` rollbacks restores the last good state too, then stops the fit
      (``trainer.should_stop``) with one line saying what was tried.
    * **Resume.** Its state (rollbacks, events, levers switched off, the rule's statistics) is saved in checkpoints;
      on resume, levers it had switched off are switched off again at the start of ``fit`` (so are, on a later
      ``fit`` without a resume, the levers it switched off in an earlier one). A lever cannot be switched on again:
      one this guard switched off that is still on the Trainer stays off, and in :attr:`switched_off`, when a fit
      resumes from a checkpoint saved before the switch.
    * **DDP.** Every collective runs on every rank at the same step (the check steps are the same everywhere).
      Sharded parameters and optimizer state (DTensors of ``fully_shard`` / ``ShardedStrategy``) are snapshotted
      and restored shard by shard, each rank its own; a sampled gradient norm of sharded gradients is made whole
      (``full_tensor``: one small all-reduce, on every rank at the same step).

    Args:
        snapshot_every: optimizer steps between in-memory snapshots.
        max_rollbacks: rollbacks allowed before the fit is stopped (0: stop at the first trigger).
        check_every: steps between checks (one host sync and, with several processes, one small all-reduce each);
            None: 5 on a CPU, 10 on an accelerator. A fault is acted on at the next check; the snapshot restored is
            the last one taken before the streak began, so a later check loses steps, not state.
        watch_grad_norm: also watch the gradient norm.
        grad_norm_every: optimizer steps between gradient-norm samples; None: every step on an accelerator (one
            fused, asynchronous reduction), every 10th on a CPU, where the norm of each gradient tensor is a separate
            kernel (~120 us of CPU time for the 32 tensors of the demo CNN, 1.5 % of its 8 ms step, measured). A NaN
            gradient is caught either way: the weights it produces make the next loss NaN. The spike rule counts
            samples in a row.
        nan_streak: non-finite values in a row that trigger.
        spike_sigma: EMA standard deviations above the EMA mean that make a value an outlier.
        spike_steps: outliers in a row that trigger.
        ema_beta: the mean's EMA decay per step.
        noise_beta: the noise variance's EMA decay per step.
        arm_after: values seen before the spike rule is armed.
        rel_floor: the standard deviation used is at least this fraction of the EMA mean.
        window_steps: steps of stricter watch after a lever switches on.
        window_sigma: ``spike_sigma`` inside that window.
        window_spike_steps: ``spike_steps`` inside that window.
        replay_lost_steps: on a rollback in a fit with ``max_steps``, take ``trainer.global_step`` back to the
            restored state's step (the steps between are trained again, on the next batches); False: the counter goes
            on, and the fit ends that many steps short of its schedule. A fit bound by ``max_epochs`` alone ends
            with its data either way (its counter is not taken back). Step-indexed callbacks
            (``ModelCheckpoint(every_n_train_steps=...)``) see the replayed step numbers again.
        levers: extra :class:`~lightning_accel._utils.levers.Lever` objects to manage, beside those found on the
            Trainer (strategy, precision plugin, checkpoint IO); None: none.
        verbose: print each rollback on rank 0.

    Attributes:
        rollbacks: rollbacks so far (in this fit and the ones it resumed).
        events: one dict per trigger: ``step``, ``reason``, ``restored_step``, ``switched_off`` (lever name or None),
            ``action`` (``"rollback"`` or ``"stop"``), ``replayed`` (steps the counter was taken back).
    """

    def __init__(
        self,
        *,
        snapshot_every: int = 50,
        max_rollbacks: int = 3,
        check_every: int | None = None,
        watch_grad_norm: bool = True,
        grad_norm_every: int | None = None,
        nan_streak: int = 1,
        spike_sigma: float = 6.0,
        spike_steps: int = 4,
        ema_beta: float = 0.9,
        noise_beta: float = 0.98,
        arm_after: int = 20,
        rel_floor: float = 0.05,
        window_steps: int = 100,
        window_sigma: float = 4.0,
        window_spike_steps: int = 2,
        levers: Sequence[Any] | None = (),
        replay_lost_steps: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.snapshot_every = check_int("snapshot_every", snapshot_every, low=1, fix="Use e.g. 50.")
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, low=0)
        self.check_every = check_int("check_every", check_every, low=1, allow_none=True, fix="Use None for auto.")
        self.watch_grad_norm = check_bool("watch_grad_norm", watch_grad_norm)
        self.grad_norm_every = check_int(
            "grad_norm_every", grad_norm_every, low=1, allow_none=True, fix="Use None for auto."
        )
        self.verbose = check_bool("verbose", verbose)
        self.replay_lost_steps = check_bool("replay_lost_steps", replay_lost_steps)
        self.rule = WatchRule(
            nan_streak=nan_streak,
            spike_sigma=spike_sigma,
            spike_steps=spike_steps,
            ema_beta=ema_beta,
            noise_beta=noise_beta,
            arm_after=arm_after,
            rel_floor=rel_floor,
            window_steps=window_steps,
            window_sigma=window_sigma,
            window_spike_steps=window_spike_steps,
        )
        if levers is None:  # `levers: null` in a YAML config: none beside the Trainer's own
            levers = ()
        if isinstance(levers, (str, bytes, Lever)) or not isinstance(levers, Iterable):
            raise TypeError(
                f"`levers` must be a list of lever objects, got {type(levers).__name__} ({levers!r}). Pass a list, "
                "e.g. `levers=[my_lever]`, or leave it out for the Trainer's own levers."
            )
        levers = list(levers)
        bad = [lv for lv in levers if not isinstance(lv, Lever)]
        if bad:
            raise TypeError(
                f"`levers` must hold objects with `lever_name`, `lever_active` and `switch_off(reason)`, got "
                f"{type(bad[0]).__name__}. Implement lightning_accel._utils.levers.Lever or drop it."
            )
        self.extra_levers = levers
        self.rollbacks = 0
        self.events: list[dict[str, Any]] = []
        self.switched_off: list[str] = []
        # the lever objects this guard switched off, across fits: no lever switches back on, so one of them on the
        # Trainer of a later fit is off whatever the checkpoint that fit resumed from says
        self._held_off: list[Lever] = []
        self._resumed = False  # this fit's checkpoint held the guard's state (set by `load_state_dict`)
        self.watches = {"loss": SeriesWatch("loss", self.rule), "grad_norm": SeriesWatch("grad_norm", self.rule)}
        self.snapshot = Snapshot()
        self._levers: list[Lever] = []
        self._since: dict[str, int] = {}  # lever name -> the step it was seen switched on
        self._was_active: dict[str, bool] = {}
        self._window_end = -1
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        self._grad_norm: torch.Tensor | None = None
        self._every = 1
        self._gn_every = 1
        self._opt_steps = 0
        self._scaler = False
        self._cpu = True
        self._stopped = False
        self._epoch_end = False
        self._save_every: list[int] = []
        self._timed_save = False
        # an optimizer step of this batch was not sampled: a save before the next batch's loss holds the weights its
        # update produced, from gradients nobody looked at
        self._unchecked_update = False
        self._weights_ok: torch.Tensor | None = None  # 1. when every weight is finite (taken before such a save)
        self._snap_due = False
        self._loss: torch.Tensor | None = None
        self._scaler_obj: Any = None
        self._manual = False
        self._backward: list[torch.Tensor] = []  # this batch's losses given to `manual_backward`
        # the optimizers' parameters at the last snapshot (None: none taken in this fit yet); a change means the
        # model was rebuilt (pruned) and the snapshot no longer fits it
        self._layout: list[list[torch.Tensor]] | None = None

    # -- set-up --------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        self._levers = find_levers(
            [strategy, strategy.precision_plugin, io, getattr(io, "checkpoint_io", None), *self.extra_levers]
        )
        # a check costs ~20 us of Python on a CPU (rule, lever poll) and one host sync on an accelerator
        cpu = self._cpu = strategy.root_device.type == "cpu"
        self._every = self.check_every or (5 if cpu else 10)
        self._gn_every = self.grad_norm_every or (10 if cpu else 1)
        self._scaler_obj = getattr(strategy.precision_plugin, "scaler", None)
        self._scaler = self._scaler_obj is not None
        self._manual = not pl_module.automatic_optimization
        # per-fit state (a second `fit` with the same guard starts watching afresh; rollbacks and events stay)
        self._since, self._was_active, self._window_end = {}, {}, -1
        self._pending, self._grad_norm, self._loss, self._backward = [], None, None, []
        self._opt_steps, self._stopped, self._snap_due = 0, False, False
        self._unchecked_update, self._weights_ok = False, None
        self._layout = None
        self._resumed = False  # Lightning restores the callbacks' state after `setup`
        # the step intervals of the checkpoint callbacks that save inside an epoch (`every_n_train_steps`): the
        # values pending are checked before such a save, which must not hold the weights of a bad step
        self._save_every = [n for cb in trainer.checkpoint_callbacks if (n := model_checkpoint_step_interval(cb))]
        # a ModelCheckpoint that saves neither every N epochs nor every N steps saves by the clock
        # (`train_time_interval`, rank 0's clock): any step may save, so every step is checked before it (unforeseen,
        # such a save held up to `check_every - 1` unchecked steps, the weights of a NaN among them)
        self._timed_save = any(
            isinstance(cb, ModelCheckpoint) and not cb.every_n_epochs and not model_checkpoint_step_interval(cb)
            for cb in trainer.checkpoint_callbacks
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        resumed, self._resumed = self._resumed, False
        where = "before the checkpoint this fit resumed from" if resumed else "in an earlier fit"
        held = [lv for lv in self._levers if any(lv is o for o in self._held_off)]
        for lever in self._levers:
            if lever.lever_name in self.switched_off:  # what the guard switched off stays off
                lever.switch_off(f"switched off by RollbackGuard {where}")
                if not any(lever is o for o in held):
                    held.append(lever)
            elif any(lever is o for o in held):
                # resumed from a checkpoint older than the switch, on the same Trainer: the lever is still off (none
                # switches back on), so the record, which later checkpoints save, says so
                self.switched_off.append(lever.lever_name)
        self._held_off = held  # the levers of this fit only: an earlier Trainer's are not kept alive
        self._poll_levers(step)
        self._pending.clear()
        # the first snapshot waits for the first batch: callbacks later in the list still change the state in their
        # own `on_train_start` (LinearScalingLR scales the rates, PerStepLR binds the schedule), and a snapshot taken
        # before them would undo that on a rollback
        self._layout = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._layout is None:
            self._take_snapshot(trainer, pl_module)
        self._unchecked_update = False  # this batch's loss is computed from the last update's weights: it shows them

    # -- the levers ----------------------------------------------------------------------------------------------
    def _poll_levers(self, step: int) -> None:
        for lever in self._levers:
            active = bool(lever.lever_active)
            if active and not self._was_active.get(lever.lever_name, False):
                self._since[lever.lever_name] = step
                self._window_end = max(self._window_end, step + self.rule.window_steps)
            self._was_active[lever.lever_name] = active

    def _switch_off_latest(self, reason: str) -> str | None:
        active = [lv for lv in self._levers if lv.lever_active]
        # the most recently switched on first; ties: the later found (extra levers, checkpoint IO, precision, strategy)
        order = sorted(range(len(active)), key=lambda i: (self._since.get(active[i].lever_name, -1), i), reverse=True)
        for i in order:
            lever = active[i]
            if lever.switch_off(reason):
                self.switched_off.append(lever.lever_name)
                self._held_off.append(lever)
                self._was_active[lever.lever_name] = False
                return lever.lever_name
        return None

    # -- recording -----------------------------------------------------------------------------------------------
    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._snap_due:
            self._loss = loss.detach()  # the snapshot below is taken only if this loss is finite
        if self._manual:
            # the batch's loss when `training_step` returns none: the scale is the one of this backward (the step's
            # `scaler.update()` may change it before the batch ends)
            self._backward.append(unscaled_loss(loss, self._scaler_obj))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._opt_steps += 1
        if self._layout_changed(trainer):
            # the parameters were replaced since the snapshot (pruning): it cannot be restored into this model, so the
            # state before this step's update, which the change produced from a good state, is the one to go back to
            self._take_snapshot(trainer, pl_module)
        sample = self.watch_grad_norm and (self._opt_steps - 1) % self._gn_every == 0
        norm = self._norm(optimizer) if sample or self._snap_due else None
        if sample and norm is not None:
            self._grad_norm = norm if self._grad_norm is None else torch.maximum(self._grad_norm, norm)
        # several optimizers (manual optimization) step in one batch: any of them unsampled leaves the batch's update
        # unchecked until the next batch's loss
        self._unchecked_update = self._unchecked_update or not sample
        if self._snap_due:
            self._snapshot_if_sound(trainer, pl_module, norm)

    @staticmethod
    def _norm(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The total 2-norm of ``optimizer``'s gradients as a device tensor (no sync); None when it has none."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return None
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, torch.Tensor) and local_shard(norm) is not norm:
            # sharded gradients (`fully_shard`): the norm is a DTensor holding each rank's partial sum, which
            # `torch.stack` and `dist.all_reduce` refuse; its full value is one small all-reduce, on every rank alike
            # (the sampling, the due snapshot and the saves are the same on every rank)
            norm = norm.full_tensor()  # type: ignore[attr-defined]
        return norm

    def _probe_weights(self, pl_module: pl.LightningModule) -> None:
        """Before a save that would hold the update of a step whose gradient norm was not sampled (every 10th on a
        CPU), whether every weight is finite (one norm over the parameters, a device tensor: no sync; its host copy
        is the check's): a NaN gradient shows in the next loss only, after the save. The gradients themselves may be
        gone by then (Lightning drops them before a validation)."""
        if not self._unchecked_update:
            return
        self._unchecked_update = False
        params = [p.detach() for p in pl_module.parameters()]
        if not params:
            return
        norm = torch.nn.utils.get_total_norm(params)
        if local_shard(norm) is not norm:  # sharded parameters: one small all-reduce, on every rank alike
            norm = norm.full_tensor()  # type: ignore[attr-defined]
        self._weights_ok = norm.isfinite().float().reshape(())

    def _snapshot_if_sound(self, trainer: pl.Trainer, pl_module: pl.LightningModule, norm: torch.Tensor | None) -> None:
        """Take the due snapshot now, before the optimizer updates anything, if the weights about to be saved just
        gave a finite loss and finite gradients on every rank (one host sync, one all-reduce, every
        ``snapshot_every`` steps): a snapshot taken after a check could hold the update of a step whose gradients
        were bad but whose loss (computed before that update) looked fine."""
        parts = [t.float().reshape(()) for t in (self._loss, norm) if t is not None]
        sound = torch.stack(parts).isfinite().all().float() if parts else torch.ones(())
        if self._scaler:  # the scaler skips steps with inf/NaN gradients: only the loss must be finite
            sound = self._loss.isfinite().float() if self._loss is not None else torch.ones(())
        if distributed_ready() and dist.get_world_size() > 1:
            sound = sound.to(pl_module.device)
            dist.all_reduce(sound, op=dist.ReduceOp.MIN)
        self._loss = None
        if bool(sound.item()):
            self._snap_due = False
            self._take_snapshot(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        backward, self._backward = self._backward, []
        if not isinstance(loss, torch.Tensor):
            # manual optimization whose `training_step` returns nothing (as Lightning's examples do): unwatched, a
            # NaN ran on through every later step
            loss = batch_loss(backward)
        # checkpoint callbacks run after every other callback's hook: a step save at this step comes after this check
        save_due = self._timed_save or any(trainer.global_step % n == 0 for n in self._save_every)
        if isinstance(loss, torch.Tensor):
            self._pending.append((trainer.global_step, loss.detach(), self._grad_norm))
        self._grad_norm = None
        if save_due:
            self._probe_weights(pl_module)
        if len(self._pending) >= self._every or (save_due and self._due()):
            self._check(trainer, pl_module)

    def _due(self) -> bool:
        """Whether anything awaits a check (the same on every rank: the values and the probes are taken alike)."""
        return bool(self._pending) or self._weights_ok is not None

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a validation inside an epoch (`val_check_interval`) ends with the checkpoint callbacks' saves: the steps
        # since the last check are checked first, as at the end of an epoch (every rank validates at the same step)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting or trainer.sanity_checking or self._stopped:
            return
        self._probe_weights(pl_module)
        if not self._due():
            return
        self._epoch_end = True  # not a batch hook: Lightning takes epoch metrics only
        try:
            self._check(trainer, pl_module)
        finally:
            self._epoch_end = False

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last steps of an epoch are checked before validation and checkpoints see them (every rank ends the
        # epoch with the same number of pending values, so the collective matches)
        if not self._stopped:
            self._probe_weights(pl_module)
        if self._due() and not self._stopped:
            self._epoch_end = True
            try:
                self._check(trainer, pl_module)
            finally:
                self._epoch_end = False

    # -- the check -----------------------------------------------------------------------------------------------
    def _local(self, step: int) -> tuple[Trigger | None, bool]:
        """Run the rule over the values recorded since the last check, and the weights' probe when one was taken
        (one host sync)."""
        pending, self._pending = self._pending, []
        probe, self._weights_ok = self._weights_ok, None
        if not pending and probe is None:
            return None, False
        flat = [t for _, lo, gn in pending for t in ((lo, gn) if gn is not None else (lo,))]
        flat += [probe] if probe is not None else []
        if self._cpu:  # no sync to save: item() per value is cheaper than stacking (~1 us against ~4 us a value)
            values = [float(t.item()) for t in flat]
        else:
            values = torch.stack([t.float().reshape(()) for t in flat]).cpu().tolist()
        trigger: Trigger | None = None
        k = 0
        for at, _, gn in pending:
            strict = at <= self._window_end
            t = self.watches["loss"].update(at, values[k], strict)
            k += 1
            if gn is not None:
                v = values[k]
                k += 1
                if not (self._scaler and not math.isfinite(v)):  # the scaler skips such a step itself
                    t = t or self.watches["grad_norm"].update(at, v, strict)
            if t is not None and trigger is None:
                trigger = t
        if probe is not None and trigger is None and values[-1] < 1.0:
            # the last update, whose gradients were not sampled, made a weight NaN/inf: no loss has shown it yet
            trigger = Trigger("weights", step, "nonfinite", step, math.nan, 0.0)
        open_streak = any(w.nan_run or w.spike_run for w in self.watches.values())
        return trigger, open_streak

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        self._poll_levers(step)
        trigger, open_streak = self._local(step)
        code = _CODES[trigger.kind] if trigger is not None else 0
        start = trigger.streak_start if trigger is not None else step
        g_code, g_start, g_open = float(code), float(-start), float(open_streak)
        if distributed_ready() and dist.get_world_size() > 1:
            decision = torch.tensor([g_code, g_start, g_open], device=pl_module.device)
            dist.all_reduce(decision, op=dist.ReduceOp.MAX)  # every rank, every check: all decide alike
            g_code, g_start, g_open = decision.tolist()
        if g_code:
            reason = trigger.describe() if trigger is not None else f"{_KINDS[int(g_code)]} on another rank"
            self._rollback(trainer, pl_module, step, int(-g_start), reason)
        elif not g_open and step - (self.snapshot.step or 0) >= self.snapshot_every:
            self._snap_due = True  # taken in the next optimizer step, before its update (`_snapshot_if_sound`)
        elif g_open:
            self._snap_due = False

    # -- snapshot and rollback -----------------------------------------------------------------------------------
    @staticmethod
    def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def _layout_changed(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizers hold other parameter tensors than at the last snapshot (identity: ~1 us a step)."""
        layout, opts = self._layout, trainer.optimizers
        if layout is None or len(layout) != len(opts):
            return layout is not None
        for old, opt in zip(layout, opts, strict=True):
            now = self._params(opt)
            if len(now) != len(old) or not all(map(operator.is_, now, old)):
                return True
        return False

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedulers = {str(i): c.scheduler.state_dict() for i, c in enumerate(trainer.lr_scheduler_configs)}
        self.snapshot.take(trainer.global_step, pl_module, list(trainer.optimizers), {"schedulers": schedulers})
        self._layout = [self._params(opt) for opt in trainer.optimizers]

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        extra = self.snapshot.restore(pl_module, list(trainer.optimizers))
        # under gradient accumulation a check can fall mid-window: `.grad` then holds the bad batches' sum (a NaN),
        # and the window's optimizer step would apply it to the restored weights. Dropping it makes that step use
        # only the gradients of the window's batches after the restore, computed from the restored weights.
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        for i, c in enumerate(trainer.lr_scheduler_configs):
            state = extra.get("schedulers", {}).get(str(i))
            if state is not None:
                c.scheduler.load_state_dict(state)
        for w in self.watches.values():
            w.reset_streaks()
        self._snap_due = False
        return int(self.snapshot.step or 0)

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, start: int, reason: str) -> None:
        restored = self._restore(trainer, pl_module)
        stop = self.rollbacks >= self.max_rollbacks
        lever = None if stop else self._switch_off_latest(f"RollbackGuard at step {step}: {reason}")
        event: dict[str, Any] = {
            "step": step,
            "reason": reason,
            "streak_start": start,
            "restored_step": restored,
            "switched_off": lever,
            "action": "stop" if stop else "rollback",
        }
        self.events.append(event)
        if stop:
            self._stopped = True
            trainer.should_stop = True
            tried = ", ".join(f"step {e['step']}: {e['switched_off'] or 'restore only'}" for e in self.events[:-1])
            rank_zero_warn(
                f"RollbackGuard stopped the fit at step {step} ({reason}) after {self.rollbacks} rollback(s) "
                f"[{tried or 'none allowed'}]; the state of step {restored} was restored. Check the data and the "
                "learning rate, or raise `max_rollbacks`."
            )
            return
        self.rollbacks += 1
        # only a fit bound by max_steps trains the lost steps again: one bound by epochs ends with its data anyway
        replay = self.replay_lost_steps and trainer.max_steps not in (None, -1) and step > restored
        if replay and rewind_global_step(trainer, step - restored):
            event["replayed"] = step - restored
        # a step metric from a batch hook; from on_train_epoch_end Lightning accepts epoch metrics only
        per_step = not self._epoch_end
        pl_module.log("guard/rollbacks", float(self.rollbacks), on_step=per_step, on_epoch=not per_step, batch_size=1)
        if self.verbose:
            rank_zero_warn(
                f"RollbackGuard rollback {self.rollbacks}/{self.max_rollbacks} at step {step}: {reason}; restored the "
                f"state of step {restored}; " + (f"switched `{lever}` off." if lever else "no lever to switch off.")
            )

    # -- reporting, state ----------------------------------------------------------------------------------------
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note_in_reports(trainer)
        if self.rollbacks and self.verbose:
            rank_zero_info(self.summary())

    def _note_in_reports(self, trainer: pl.Trainer) -> None:
        """Add :meth:`summary` to a PerformanceMonitor's report (``report.extras["guard"]``) once it exists: the
        monitor builds it in its own ``on_train_end``, which runs before or after this callback's by list order."""
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            report = getattr(cb, "report", None)
            if type(cb).__name__ == "PerformanceMonitor" and isinstance(getattr(report, "extras", None), dict):
                report.extras["guard"] = self.summary()  # type: ignore[union-attr]

    def summary(self) -> str:
        """One line: rollbacks, their reasons and the levers switched off."""
        if not self.events:
            return "RollbackGuard: no rollback"
        parts = [
            f"step {e['step']} {e['action']} ({e['reason']}; {e['switched_off'] or 'no lever'})" for e in self.events
        ]
        return f"RollbackGuard: {self.rollbacks} rollback(s): " + "; ".join(parts)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._note_in_reports(trainer)
        self.snapshot.release()
        self._pending.clear()
        self._backward.clear()
        self._grad_norm = None
        self._layout = None  # it holds the parameters: do not keep them alive after the fit

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "rollbacks": self.rollbacks,
            "events": [dict(e) for e in self.events],
            "switched_off": list(self.switched_off),
            "watches": {k: w.state_dict() for k, w in self.watches.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.events = [dict(e) for e in state_dict.get("events", [])]
        self.switched_off = list(state_dict.get("switched_off", []))
        self._resumed = True
        for k, w in self.watches.items():
            if k in state_dict.get("watches", {}):
                w.load_state_dict(state_dict["watches"][k])
