"""The Lightning half of the tuner: run one trial of a job and measure it.

A trial is the job's own config with a short fit: ``warmup + steps + 1`` training steps, no validation, no logger,
no progress bar, the job's ``ModelCheckpoint``/``PerformanceMonitor`` replaced by a fresh ``PerformanceMonitor``
(the breakdown and the verdict) and :class:`TrialProbe` (losses, wall time, peak memory, one timed checkpoint save
when the job saves). It is instantiated by :class:`~lightning_accel.cli.AccelCLI` exactly as ``lightning-accel fit``
would, so what the tuner measures is what the written ``tuned.yaml`` runs.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_accel._utils.errors import one_line
from lightning_accel._utils.imports import import_object
from lightning_accel.tune._watch import batch_loss, unscaled_loss
from lightning_accel.tune.levers import as_list

# TrialProbe is named by class_path in the trial configs; it is no callback a user adds, so it is not exported
__all__ = ["OVER_BUDGET", "TrialMeasure", "TrialOverBudget", "agree", "deadline", "run_trial", "stop_other_ranks"]

#: callbacks a trial drops from the job (by name, and by class: their subclasses too): it saves and monitors by
#: itself, and stops by step count; and the monitors that only log, which refuse a Trainer without a logger (a trial
#: has none): with them no trial of the job ran
_DROPPED = (
    "ModelCheckpoint",
    "PerformanceMonitor",
    "EarlyStopping",
    "RollbackGuard",
    "ProgressBar",
    "LearningRateMonitor",
    "DeviceStatsMonitor",
)


class TrialProbe(Callback):
    """Records one trial: per-step losses, the time of each timed step, one checkpoint save, peak memory.

    Step time is the median period between the starts of consecutive optimizer steps in ``[warmup, warmup + steps]``
    (data wait included; the median, because on a shared machine a few steps stall for reasons of their own); under
    gradient accumulation a step starts at the first batch of its window, and the saves below are made once per step
    too. The step holding the timed checkpoint save is left out and the save is reported on its own. The slowest
    rank's value is kept (one all-reduce at the end). A batch's loss is ``training_step``'s, or under manual
    optimization that returns none, the sum of the (unscaled) losses given to ``manual_backward`` in it. A trial does
    not validate: a ``ReduceLROnPlateau`` the job conditions on a metric the trial does not log (``val_loss``) is
    skipped at an epoch end instead of failing the fit.

    Args:
        warmup: steps before the timed window.
        steps: timed steps.
        ckpt_dir: when set, ``trainer.save_checkpoint`` into this directory once in the last warm-up step (the first
            save of a process pays one-time costs) and once, timed, in the middle of the window.
        deadline: when set, a ``time.perf_counter()`` value the trial must end by: at the start of step 3 (steps 1
            and 2 timed, step 0's one-time costs left out) the trial raises :class:`TrialOverBudget` when its steps
            left, at the faster of those two steps' times, cannot end by then. One comparison, no synchronisation:
            the timed steps are measured as without it.
    """

    def __init__(
        self, warmup: int = 3, steps: int = 10, ckpt_dir: str | None = None, deadline: float | None = None
    ) -> None:
        self.warmup, self.steps, self.ckpt_dir, self.deadline = warmup, steps, ckpt_dir, deadline
        self._early: list[float] = []  # the starts of steps 1 to 3 (the deadline's check)
        self.losses: list[float] = []
        self.starts: list[float] = []
        self.save_s = 0.0
        self.save_step: int | None = None
        self._warm_saved = False
        self.step_s: float | None = None
        self.peak_mem: int | None = None
        self.steps_per_epoch: int | None = None
        # the global step at the last recorded start / the last batch end: under gradient accumulation several
        # batches share one step, and only the first batch of the window starts it, only its last one ends it
        self._started: int | None = None
        self._ended: int | None = None
        self._manual = False
        self._scaler: Any = None
        self._backward: list[torch.Tensor] = []  # this batch's losses given to `manual_backward`

    def _now(self, trainer: Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for config in trainer.lr_scheduler_configs:
            # a trial does not validate: a ReduceLROnPlateau that monitors a validation metric (`val_loss`) would
            # make Lightning raise at the end of the first epoch of a job whose epochs are shorter than the trial,
            # failing a job `fit` runs. Not strict, Lightning skips its update when the metric is missing (a
            # training metric it monitors is there, and it steps as in the job).
            if config.reduce_on_plateau:
                config.strict = False
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        else:
            _reset_peak_rss()
        n = trainer.num_training_batches
        per_step = max(1, int(trainer.accumulate_grad_batches))
        self.steps_per_epoch = -(-int(n) // per_step) if n != float("inf") else None  # optimizer steps (ceil)
        self._started, self._ended = None, trainer.global_step
        self._manual = not pl_module.automatic_optimization
        self._scaler, self._backward = getattr(trainer.precision_plugin, "scaler", None), []

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._manual:  # the batch's loss when `training_step` returns none (unscaled as this backward scaled it)
            self._backward.append(unscaled_loss(loss, self._scaler))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.deadline is not None and 1 <= step <= 3 and len(self._early) < step:
            self._early.append(time.perf_counter())
            if step == 3:
                self._check_deadline(step)
        if self.warmup <= step <= self.warmup + self.steps and step != self._started:
            self._started = step
            self.starts.append(self._now(trainer))

    def _check_deadline(self, step: int) -> None:
        """Raise :class:`TrialOverBudget` when the steps left cannot end by ``deadline`` (at the start of ``step``)."""
        assert self.deadline is not None
        periods = [b - a for a, b in zip(self._early, self._early[1:], strict=False)]
        if len(periods) < 2:  # a step that did not start here (the counter passed over it): no estimate
            return
        per = min(periods)  # the faster: a stalled step must not refuse a trial that fits
        total = self.warmup + self.steps + 1
        now = time.perf_counter()
        if per <= 0 or now + (total - step) * per <= self.deadline:
            return
        left = self.deadline - now
        fits = step + int(max(0.0, left) / per)  # the steps the whole trial could have held, counted from step 0
        raise TrialOverBudget(per, total - step, left, max(0, fits - self.warmup - 1))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        backward, self._backward = self._backward, []
        if not isinstance(loss, torch.Tensor):
            # manual optimization whose `training_step` returns nothing: a NaN here failed the numerics of every
            # trial, the job's own included ("loss is nan at step 0"), and no lever could be kept
            loss = batch_loss(backward)
        self.losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan"))
        done = trainer.global_step  # steps finished, this one included
        stepped, self._ended = done != self._ended, done
        if self.ckpt_dir is None or not stepped:  # a batch inside an accumulation window: no step ended here
            return
        # reached, not equal: under manual optimization with several optimizers the global step moves by one per
        # optimizer step, several in a batch, and may pass over a given value (no save was made, nor timed)
        if not self._warm_saved and done >= self.warmup:  # untimed: a process's first save pays one-time costs
            self._warm_saved = True
            trainer.save_checkpoint(os.path.join(self.ckpt_dir, "warm.ckpt"))
        elif self.save_step is None and done >= self.warmup + self.steps // 2:
            t = time.perf_counter()
            trainer.save_checkpoint(os.path.join(self.ckpt_dir, f"step{done}.ckpt"))
            # the period from this step's start (the last one recorded) to the next holds the save
            self.save_s, self.save_step = time.perf_counter() - t, len(self.starts) - 1

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dev = trainer.strategy.root_device
        periods = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        if self.save_step is not None and 0 <= self.save_step < len(periods):
            periods.pop(self.save_step)
        local = statistics.median(periods) if len(periods) >= 2 else -1.0
        mem = float(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else float(_peak_rss())
        t = torch.tensor([local, mem, self.save_s], dtype=torch.float64, device=dev)
        if trainer.world_size > 1:
            # the slowest rank's time counts; every rank takes part in this one collective
            t = trainer.strategy.reduce(t, reduce_op="max")
        self.step_s = float(t[0]) if float(t[0]) > 0 else None
        self.peak_mem, self.save_s = int(t[1]), float(t[2])


class TrialOverBudget(Exception):
    """A trial whose steps cannot end within the time it was given (:class:`TrialProbe`'s ``deadline``).

    Attributes:
        step_s: the step time it was estimated from; ``steps_left``: the trial's steps not run yet; ``left_s``: the
            time left for them; ``fits``: the timed steps the whole trial could have held beside its warm-up.
    """

    def __init__(self, step_s: float, steps_left: int, left_s: float, fits: int) -> None:
        self.step_s, self.steps_left, self.left_s, self.fits = step_s, steps_left, left_s, fits
        super().__init__(
            f"its {steps_left} steps left at {step_s:.3g} s a step need ~{steps_left * step_s:.0f} s and "
            f"{max(0.0, left_s):.0f} s of the budget are left (room for {fits} timed steps)"
        )


#: what a trial's ``error`` starts with when it stopped for its deadline (:class:`TrialOverBudget`)
OVER_BUDGET = "over budget: "

#: the ``time.perf_counter()`` value the trials run under :func:`deadline` must end by
_DEADLINE: list[float] = []


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Within it, :func:`run_trial` gives its trial ``seconds`` from now: one that cannot end by then stops after its
    third step with an ``error`` starting with :data:`OVER_BUDGET` (see :class:`TrialProbe`'s ``deadline``)."""
    _DEADLINE.append(time.perf_counter() + seconds)
    try:
        yield
    finally:
        _DEADLINE.pop()


def _peak_rss() -> int:
    """The process's peak resident memory in bytes since :func:`_reset_peak_rss` (``VmHWM``, which that resets;
    ``ru_maxrss``, the peak of the process's life, where there is no ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _reset_peak_rss() -> None:
    """Start the process's peak resident memory afresh (Linux: ``/proc/self/clear_refs``; nowhere else). Every trial
    runs in the tune's one process, whose peak only grows: without this each trial's memory was the largest of all
    the trials before it (a lever that saves memory could not show it, and one trial's peak rejected the next)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class TrialMeasure:
    """What one trial measured (every rank holds the same numbers but ``losses``, which are this rank's)."""

    def __init__(self) -> None:
        self.step_s: float | None = None
        self.train_step_s: float | None = None
        self.save_s = 0.0
        self.breakdown: dict[str, float] = {}
        self.dominant = ""
        self.verdict = ""
        self.losses: list[float] = []
        self.peak_mem: int | None = None
        self.mem_limit: int | None = None
        self.seconds = 0.0
        self.error: str | None = None
        #: the model holds 4-D (convolution) weights, which a memory-format lever can change
        self.conv_weights = False


def _trial_job(
    job: dict[str, Any], *, warmup: int, steps: int, root: str, save: bool, deadline: float | None = None
) -> dict[str, Any]:
    j = copy.deepcopy(job)
    t = j.setdefault("trainer", {})
    cbs = [c for c in as_list(t.get("callbacks")) if not _dropped(c)]
    # the monitor counts batches: under gradient accumulation the probe's warm-up steps are `accumulate` batches each
    acc = t.get("accumulate_grad_batches", 1)
    acc = acc if isinstance(acc, int) and not isinstance(acc, bool) and acc > 1 else 1
    cbs.append(
        {
            "class_path": "lightning_accel.callbacks.PerformanceMonitor",
            "init_args": {
                "skip_steps": warmup * acc,
                "count_flops": False,
                "nvml": False,
                "report_path": "",
                "verbose": False,
            },
        }
    )
    probe_dir = os.path.join(root, "ckpt") if save else None
    cbs.append(
        {
            "class_path": "lightning_accel.tune.runner.TrialProbe",
            "init_args": {"warmup": warmup, "steps": steps, "ckpt_dir": probe_dir, "deadline": deadline},
        }
    )
    for key in ("max_time", "val_check_interval", "check_val_every_n_epoch"):
        t.pop(key, None)
    _compress_from_warmup(t, warmup)
    # what `fit --print_config` writes at the top level for `fit` itself: a trial is a short fit from the initial
    # weights (resuming would measure the checkpoint's steps, and AccelCLI without a subcommand refuses the keys)
    for key in ("ckpt_path", "weights_only"):
        j.pop(key, None)
    t.update(
        callbacks=cbs,
        max_steps=warmup + steps + 1,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    return j


def _dropped(entry: Any) -> bool:
    """Whether a trial leaves the job's callback ``entry`` out (see ``_DROPPED``): by its class, so that a subclass
    of one of them under a name of its own (``BestCheckpoint(ModelCheckpoint)``) is left out too -- Lightning refuses
    a ``ModelCheckpoint`` or a progress bar beside the trial's ``enable_checkpointing=False`` /
    ``enable_progress_bar=False``, and an ``EarlyStopping`` on ``val_loss`` without validation, which failed the
    baseline of a job ``fit`` runs; by its name when its class does not import (``fit`` reports that)."""
    path = _cp(entry)
    if any(d in path for d in _DROPPED):
        return True
    try:
        cls = import_object(path) if path else None
    except Exception:  # a module that fails on import: the trial's `fit` reports it
        return False
    return isinstance(cls, type) and issubclass(cls, _dropped_classes())


def _dropped_classes() -> tuple[type, ...]:
    """The classes of ``_DROPPED`` (imported here: the tune's trial imports them anyway)."""
    from lightning.pytorch.callbacks import (
        DeviceStatsMonitor,
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ProgressBar,
    )

    from lightning_accel.perf.callbacks import PerformanceMonitor
    from lightning_accel.tune.guard import RollbackGuard

    return (
        ModelCheckpoint,
        PerformanceMonitor,
        EarlyStopping,
        RollbackGuard,
        ProgressBar,
        LearningRateMonitor,
        DeviceStatsMonitor,
    )


def _compress_from_warmup(trainer: dict[str, Any], warmup: int) -> None:
    """A ``ddp_1bit`` trial compresses in its timed steps: the strategy's own warm-up (``warmup_steps="auto"``: at
    least 10 fp32 steps) is cut to the trial's untimed ones, and ``compression="auto"`` (which times a few steps both
    ways at the end of its warm-up) compresses. Without this a trial of 3 + 12 steps times plain fp32 DDP almost
    throughout, and the lever is kept or rejected on noise (identical losses: the compressed stage never ran). The
    written config keeps the job's own settings: only the trial's warm-up is shorter. A job's own
    ``compression="fp32"`` is its choice, and left as it is: plain DDP has no warm-up to shorten (the strategy refuses
    a ``warmup_steps`` beside it)."""
    s = trainer.get("strategy")
    if s == "ddp_1bit":
        s = {"class_path": "lightning_accel.strategies.OneBitDDPStrategy"}
    if not (isinstance(s, dict) and _cp(s).endswith("OneBitDDPStrategy")):
        return
    init = dict(s.get("init_args") or {})
    if init.get("compression") == "fp32":
        return
    init["warmup_steps"] = max(2, warmup)  # >= 2: DDP rebuilds its buckets after the first step
    if init.get("compression", "auto") == "auto":
        init["compression"] = "1bit"
    trainer["strategy"] = {**s, "init_args": init}


def _cp(entry: Any) -> str:
    return str(entry.get("class_path", "")) if isinstance(entry, dict) else str(entry)


def _memory_limit(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return None


def run_trial(job: dict[str, Any], *, warmup: int, steps: int, root: str | os.PathLike[str]) -> TrialMeasure:
    """Run one trial of ``job`` (a config mapping) under ``root`` and measure it.

    A trial that raises (an unsupported lever, an out-of-memory) is reported through ``error``, not raised -- unless
    the failure is in the job itself, which the baseline's caller turns into an error. Every rank runs the same trial,
    and under several processes every rank returns the same ``error``: a trial that failed on one rank only (an
    out-of-memory there) fails on all of them with that rank's error, and the process group is sound again for the
    next trial (see :class:`_Coordinator`).

    Raises:
        KeyboardInterrupt: the trial was interrupted (Ctrl-C): the tune stops, it does not go on to the next trial.
        SIGTERMException: Lightning stopped the trial for a SIGTERM: the tune stops too.
    """
    from lightning_accel.cli import AccelCLI

    m = TrialMeasure()
    start = time.perf_counter()
    root = os.fspath(root)
    Path(root).mkdir(parents=True, exist_ok=True)
    save = _saves(job)
    cli: Any = None
    try:
        with _quiet(), warnings.catch_warnings():
            # the plateau schedulers the probe made lenient (the trial has no validation metric to give them)
            warnings.filterwarnings("ignore", message="ReduceLROnPlateau conditioned on metric .* not available")
            argv = list(sys.argv)
            del sys.argv[1:]  # LightningCLI warns when it gets both a command line and a config
            try:
                trial = _trial_job(
                    job, warmup=warmup, steps=steps, root=root, save=save, deadline=_DEADLINE[-1] if _DEADLINE else None
                )
                cli = AccelCLI(args=trial, run=False)
            finally:
                sys.argv[:] = argv  # before `fit`: Lightning starts a multi-device job's other ranks with it
            trainer = cli.trainer
            trainer.fit(cli.model, datamodule=cli.datamodule)
        probe = next(c for c in trainer.callbacks if isinstance(c, TrialProbe))
        from lightning_accel.perf.callbacks import PerformanceMonitor

        monitor = next(c for c in trainer.callbacks if isinstance(c, PerformanceMonitor))
        m.losses = probe.losses
        m.conv_weights = any(p.dim() == 4 for p in cli.model.parameters())
        m.train_step_s = probe.step_s
        m.save_s = probe.save_s
        m.peak_mem = probe.peak_mem
        m.mem_limit = _memory_limit(trainer.strategy.root_device)
        every = _save_every(job) or probe.steps_per_epoch or steps
        if probe.step_s is not None:
            m.step_s = probe.step_s + (probe.save_s / every if save else 0.0)
        if monitor.report is not None:
            rep = monitor.report
            # per optimizer step, as `step_s`: the monitor's steps are batches (an accumulation window holds several)
            steps_done = max(rep.steps / max(1, int(trainer.accumulate_grad_batches)), 1e-9)
            m.breakdown = {k: v / steps_done for k, v in rep.seconds.items()}
            m.dominant, m.verdict = rep.dominant, rep.verdict
            if save:
                _amortise_saves(m, probe.save_s / every, rep.context)
        if m.step_s is None:
            m.error = f"fewer than {warmup + steps + 1} steps ran (the epoch is shorter: lower the trial steps)"
    except (Exception, SystemExit) as e:  # a lever the job cannot take: reported, the tune goes on
        interrupted = isinstance(e, SIGTERMException) or (
            isinstance(e, SystemExit) and isinstance(e.__context__, KeyboardInterrupt)
        )
        if interrupted and cli is not None:
            # Lightning has just killed the other ranks: take them from its launcher's watcher thread at once, which
            # would otherwise take a killed rank for a crashed one and kill this process too (exit status -9)
            _remember_other_ranks(cli.trainer)
            stop_other_ranks()
        if isinstance(e, SIGTERMException):
            # SIGTERM inside `fit` where the tune's own handler is not installed (a handler of the caller's is):
            # Lightning stops the fit at the next batch; reported as a failed option, the tune went on for minutes
            raise
        if isinstance(e, SystemExit) and isinstance(e.__context__, KeyboardInterrupt):
            # Ctrl-C inside `fit`: Lightning shuts the trial down and turns the interrupt into `sys.exit(1)`, which
            # is the user stopping the tune, not a lever that failed
            raise KeyboardInterrupt from None
        if isinstance(e, TrialOverBudget):
            m.error = f"{OVER_BUDGET}{e}"
        elif isinstance(e, torch.OutOfMemoryError):
            m.peak_mem, m.error = None, f"out of memory: {one_line(e)}"
        else:
            m.error = f"{type(e).__name__}: {one_line(e)}"
    finally:
        if cli is not None:
            _remember_other_ranks(cli.trainer)
        del cli
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _break_off(m.error)  # a rank waiting in a collective of this trial for this one: let it go
    m = _settle(m)
    m.seconds = time.perf_counter() - start
    return m


#: the lists of processes Lightning's launcher started for the other local ranks of a multi-device job, in its first
#: trial (the later trials run in them too); :func:`stop_other_ranks` ends them
_OTHER_RANKS: list[list[subprocess.Popen]] = []


def _remember_other_ranks(trainer: Trainer) -> None:
    """Keep the list of processes ``trainer``'s launcher started for the other local ranks (the launcher's own list:
    its watcher thread reads that one; none on those ranks, in a single process, or under ``torchrun``)."""
    procs = getattr(trainer.strategy.launcher, "procs", None)
    if isinstance(procs, list) and procs and not any(procs is known for known in _OTHER_RANKS):
        _OTHER_RANKS.append(procs)


def stop_other_ranks() -> None:
    """End the processes Lightning started for the job's other local ranks (on rank 0 of a tune stopped by a signal;
    a no-op elsewhere) and reap them.

    A signal from outside (``kill``, a scheduler) reaches the command's process alone. Inside a fit Lightning's own
    handling ends the other ranks; between two trials it is not installed, and they waited in the tune's next
    collective until this process was gone, then failed on its closed connection: a C++ traceback and an ``error:``
    line (exit status 2) after the tune's ``terminated``. They are killed (``SIGKILL``, as Lightning's interrupt
    handling does): a rank blocked in a collective runs no Python signal handler until it returns, and they write
    nothing a tune keeps (rank 0 writes the outputs and the cache). Each list is emptied first: the launcher's watcher
    thread, which polls it, took a killed rank for a crashed one and killed this process too (exit status -9).
    """
    procs: list[subprocess.Popen] = []
    for launched in _OTHER_RANKS:
        procs += [p for p in launched if isinstance(p, subprocess.Popen)]
        launched.clear()
    _OTHER_RANKS.clear()
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


@dataclass
class _Coordinator:
    """How the ranks of a multi-process tune learn that a trial failed on one of them.

    A rank whose trial raised (an out-of-memory on that rank alone, an option its setup refuses) leaves the other
    ranks waiting in a collective of the fit that it never joins (a gradient all-reduce, a barrier): they waited for
    the process group's timeout (30 minutes by default), and met the tune's next broadcast out of step after it.
    Destroying the group does not free them (gloo keeps its connections open while anything, the fit's DDP module
    among others, holds the group), and neither does aborting it; a connection closed by the peer does, at once. So:

    1. when the ranks settle their first trial under a group (they are in step there), each one publishes the ports
       its process group listens on in the group's store (a TCP store with connections of its own, which outlives
       the group);
    2. the first rank whose trial raises writes its error into the store, shuts down its TCP connections of the
       group (Linux: the sockets from ``/proc``; those to or from the ranks' listening ports) and destroys the group:
       a collective another rank waits in fails at once ("Connection closed by peer" on gloo), ending its trial too;
    3. after every trial, each rank marks its end in the store and waits for all the others' marks (a store wait, not
       a collective: it needs no sound group);
    4. when a trial failed anywhere, every rank takes the first error and the default group is made again on the same
       store (its keys under a prefix of their own), with the backend and timeout it had: the next trial, and the
       tune's own broadcasts, run on a sound group.

    Elsewhere than on Linux, and on NCCL (whose kernels do not wait on those connections), a rank already waiting in a
    collective leaves it at the group's timeout, and the tune goes on from there. The keys of a trial are
    ``lightning_accel.tune/<n>/...``, ``n`` counting the trials settled since the group was made: every rank runs the
    same trials, so it is the same on every rank.

    Attributes:
        store: the default group's store, kept (and kept alive) across the group's re-creation.
        group: the default group this coordinator knows; another one (a new fit's) starts a new coordinator.
        backend, rank, world, timeout: what the group is made again with.
        trials: trials settled on ``store``; ``remade``: times the group was made again (its listening ports change).
        broken: this rank destroyed the group after its trial failed (step 2) and has not made it again yet.
    """

    store: Any
    group: Any
    backend: str
    rank: int
    world: int
    timeout: datetime.timedelta
    trials: int = 0
    remade: int = 0
    broken: bool = False

    def key(self, name: str) -> str:
        """The store key ``name`` of the current trial."""
        return f"lightning_accel.tune/{self.trials}/{name}"

    def ports_key(self, rank: int) -> str:
        """The store key of ``rank``'s listening ports under the current group."""
        return f"lightning_accel.tune/group{self.remade}/ports{rank}"

    def publish_ports(self) -> None:
        """Step 1: this rank's listening ports (but the store's own) under the current group."""
        master = os.environ.get("MASTER_PORT", "")
        mine = sorted({local for local, _, state in _tcp_sockets().values() if state == _LISTEN} - {_port(master)})
        self.store.set(self.ports_key(self.rank), ",".join(map(str, mine)))


_COORDINATOR: _Coordinator | None = None
_LISTEN, _ESTABLISHED = "0A", "01"  # TCP states as /proc/net/tcp writes them


def _port(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """This process's TCP sockets: file descriptor -> (local port, remote port, state); empty without ``/proc``."""
    by_inode: dict[int, tuple[int, int, str]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    local, remote = int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)
                    by_inode[int(cols[9])] = (local, remote, cols[3])
        except (OSError, ValueError, IndexError):
            continue
    found: dict[int, tuple[int, int, str]] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in by_inode:
            found[int(fd)] = by_inode[int(link[8:-1])]
    return found


def _cut_connections(c: _Coordinator) -> None:
    """Step 2's shutdown: every established TCP connection of this process from its listening ports or to another
    rank's (the process group's; never the store's, whose port is none of them)."""
    import socket

    mine: set[int] = set()
    theirs: set[int] = set()
    for r in range(c.world):
        key = c.ports_key(r)
        if not c.store.check([key]):  # a rank that has not published yet (a failure in the first trial)
            continue
        ports = {int(p) for p in c.store.get(key).decode().split(",") if p}
        (mine if r == c.rank else theirs).update(ports)
    for fd, (local, remote, state) in _tcp_sockets().items():
        if state != _ESTABLISHED or not (local in mine or remote in theirs):
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))  # a second handle on the same socket: shut down, then closed
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()


def _coordinator() -> _Coordinator | None:
    """The coordinator of the current multi-process group (made, and its ports published, at the first call under a
    new group); None in a single process or before the group is up."""
    import torch.distributed as dist

    from lightning_accel._utils.compat import default_process_group_store

    global _COORDINATOR
    c = _COORDINATOR
    if c is not None and c.broken:
        return c
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    group = dist.group.WORLD
    if c is None or c.group is not group:
        store = default_process_group_store()
        c = _Coordinator(store, group, str(dist.get_backend()), dist.get_rank(), dist.get_world_size(), store.timeout)
        c.publish_ports()
        _COORDINATOR = c
    return c


def _break_off(error: str | None) -> None:
    """Step 2 of :class:`_Coordinator` on a rank whose trial failed with ``error``: record it (unless another rank's
    came first: that one is the cause), cut the group's connections and destroy it, which frees the ranks waiting in
    it."""
    import torch.distributed as dist

    c = _coordinator() if error is not None else None
    if c is None or c.broken:
        return
    # compare_set writes only where no value is: the first failure stays the trial's error
    c.store.compare_set(c.key("error"), "", f"{error} (on rank {c.rank})")
    _cut_connections(c)
    dist.destroy_process_group()
    c.broken = True


def _settle(m: TrialMeasure) -> TrialMeasure:
    """Steps 3 and 4 of :class:`_Coordinator`: ``m``, or, when the trial failed on any rank, a measure holding that
    failure alone (every rank the same)."""
    import torch.distributed as dist

    c = _coordinator()
    if c is None:
        return m
    c.store.set(c.key(f"end{c.rank}"), "1")
    c.store.wait([c.key(f"end{r}") for r in range(c.world)], c.timeout)
    error = c.store.get(c.key("error")).decode() if c.store.check([c.key("error")]) else None
    if error is not None:
        if not c.broken:  # this rank's trial ended, or failed only because another rank cut the group
            dist.destroy_process_group()
        prefix = dist.PrefixStore(c.key("group"), c.store)
        dist.init_process_group(c.backend, store=prefix, rank=c.rank, world_size=c.world, timeout=c.timeout)
        c.group, c.broken = dist.group.WORLD, False
        c.remade += 1
        c.publish_ports()
        failed = TrialMeasure()
        failed.error = error
        m = failed
    c.trials += 1
    return m


def _amortise_saves(m: TrialMeasure, per_step: float, context: Mapping[str, Any]) -> None:
    """The breakdown's checkpoint time as the step time counts it: the timed save amortised over the job's save
    interval. The monitor saw the probe's saves raw (the untimed warm-up one too) over a dozen steps: a job that
    saves once per epoch of hundreds of steps read as checkpoint-bound, and its levers were tried in that order. The
    verdict follows the corrected breakdown when its dominant category changes (or stays ``checkpoint``), given from
    the facts the monitor gave its own from (``context``: the report's)."""
    from lightning_accel.perf.report import verdict_text

    m.breakdown["checkpoint"] = per_step
    dominant = max(m.breakdown, key=lambda c: m.breakdown[c])
    if dominant == m.dominant and dominant != "checkpoint":
        return
    total = sum(m.breakdown.values())
    shares = {c: (v / total if total > 0 else 0.0) for c, v in m.breakdown.items()}
    m.dominant, m.verdict = dominant, verdict_text(dominant, shares, context)


class _quiet:
    """Trials speak only through the report: Lightning's and the rooms' info lines are held back."""

    _NAMES = ("lightning.pytorch", "lightning.fabric", "lightning_accel")

    def __enter__(self) -> None:
        self.levels = {n: logging.getLogger(n).level for n in self._NAMES}
        for n in self._NAMES:
            logging.getLogger(n).setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        for n, level in self.levels.items():
            logging.getLogger(n).setLevel(level)


def _saves(job: dict[str, Any]) -> bool:
    from lightning_accel.tune.levers import has_checkpoints

    return has_checkpoints(job)


def _save_every(job: dict[str, Any]) -> int | None:
    """Steps between the job's saves when its ``ModelCheckpoint`` says (``every_n_train_steps``), else None (once per
    epoch)."""
    for c in as_list((job.get("trainer") or {}).get("callbacks")):
        if _cp(c).endswith("ModelCheckpoint"):
            n = (c.get("init_args") or {}).get("every_n_train_steps") if isinstance(c, dict) else None
            if isinstance(n, int) and n > 0:
                return n
    return None


def agree(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a broadcast once a process group is up; ``obj`` itself before)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def agree_check(check: Callable[[], str | None], *, here: bool) -> None:
    """Run ``check`` on the ranks where ``here`` is true; every rank then raises, or none does.

    ``check`` returns a refusal (one sentence) or None, or raises. Once a process group is up, every rank's outcome
    is gathered: an exception on any rank is raised on every rank (the original where it happened, a
    ``RuntimeError`` quoting it and naming the rank elsewhere); else a refusal (``ValueError``, the refusal itself)
    from any rank is raised on every rank, the lowest rank's. A rank that raised alone left the others waiting for it
    in the next collective until the process group's timeout (e.g. a trial folder that could not be created on one
    node, or a cache folder rank 0 cannot read). Before a process group exists each process decides for itself.

    Raises:
        ValueError: a refusal.
        Exception: what ``check`` raised on this rank; RuntimeError for what it raised on another.
    """
    import torch.distributed as dist

    error: Exception | None = None
    outcome: tuple[str, str] | None = None
    if here:
        try:
            refusal = check()
        except Exception as e:  # noqa: BLE001 - raised again below, on every rank
            error = e
            outcome = ("error", f"{type(e).__name__}: {one_line(e)}")
        else:
            outcome = None if refusal is None else ("refusal", refusal)
    outcomes: list[Any] = [outcome]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
    for rank, o in enumerate(outcomes):
        if o is not None and o[0] == "error":
            if error is not None:
                raise error
            raise RuntimeError(f"tune: rank {rank} failed before the first trial: {o[1]}")
    refusal_text = next((o[1] for o in outcomes if o is not None), None)
    if refusal_text is not None:
        raise ValueError(refusal_text)
