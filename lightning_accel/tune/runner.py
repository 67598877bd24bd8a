"""The Lightning half of the tuner: run one trial of a job and measure it.

A trial is the job's own config with a short fit: ``warmup + steps + 1`` training steps, no validation, no logger,
no progress bar, the job's ``ModelCheckpoint``/``PerformanceMonitor`` replaced by a fresh ``PerformanceMonitor``
(the breakdown and the verdict) and :class:`TrialProbe` (losses, wall time, peak memory, one timed checkpoint save
when the job saves). It is instantiated by :class:`~lightning_accel.cli.AccelCLI` exactly as ``lightning-accel fit``
would, so what the tuner measures is what the written ``tuned.yaml`` runs.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel._utils.errors import one_line
from lightning_accel.tune.levers import as_list

# TrialProbe is named by class_path in the trial configs; it is no callback a user adds, so it is not exported
__all__ = ["TrialMeasure", "agree", "run_trial"]

#: callbacks a trial drops from the job: it saves and monitors by itself, and stops by step count
_DROPPED = ("ModelCheckpoint", "PerformanceMonitor", "EarlyStopping", "RollbackGuard", "ProgressBar")


class TrialProbe(Callback):
    """Records one trial: per-step losses, the time of each timed step, one checkpoint save, peak memory.

    Step time is the median period between the starts of consecutive optimizer steps in ``[warmup, warmup + steps]``
    (data wait included; the median, because on a shared machine a few steps stall for reasons of their own); under
    gradient accumulation a step starts at the first batch of its window, and the saves below are made once per step
    too. The step holding the timed checkpoint save is left out and the save is reported on its own. The slowest
    rank's value is kept (one all-reduce at the end).

    Args:
        warmup: steps before the timed window.
        steps: timed steps.
        ckpt_dir: when set, ``trainer.save_checkpoint`` into this directory once in the last warm-up step (the first
            save of a process pays one-time costs) and once, timed, in the middle of the window.
    """

    def __init__(self, warmup: int = 3, steps: int = 10, ckpt_dir: str | None = None) -> None:
        self.warmup, self.steps, self.ckpt_dir = warmup, steps, ckpt_dir
        self.losses: list[float] = []
        self.starts: list[float] = []
        self.save_s = 0.0
        self.save_step: int | None = None
        self.step_s: float | None = None
        self.peak_mem: int | None = None
        self.steps_per_epoch: int | None = None
        # the global step at the last recorded start / the last batch end: under gradient accumulation several
        # batches share one step, and only the first batch of the window starts it, only its last one ends it
        self._started: int | None = None
        self._ended: int | None = None

    def _now(self, trainer: Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        n = trainer.num_training_batches
        per_step = max(1, int(trainer.accumulate_grad_batches))
        self.steps_per_epoch = -(-int(n) // per_step) if n != float("inf") else None  # optimizer steps (ceil)
        self._started, self._ended = None, trainer.global_step

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.warmup <= step <= self.warmup + self.steps and step != self._started:
            self._started = step
            self.starts.append(self._now(trainer))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan"))
        done = trainer.global_step  # steps finished, this one included
        stepped, self._ended = done != self._ended, done
        if self.ckpt_dir is None or not stepped:  # a batch inside an accumulation window: no step ended here
            return
        if done == self.warmup:  # untimed: the first save of a process pays one-time costs
            trainer.save_checkpoint(os.path.join(self.ckpt_dir, "warm.ckpt"))
        elif done == self.warmup + self.steps // 2:
            t = time.perf_counter()
            trainer.save_checkpoint(os.path.join(self.ckpt_dir, f"step{done}.ckpt"))
            self.save_s, self.save_step = time.perf_counter() - t, done - 1 - self.warmup

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dev = trainer.strategy.root_device
        periods = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        if self.save_step is not None and 0 <= self.save_step < len(periods):
            periods.pop(self.save_step)
        local = statistics.median(periods) if len(periods) >= 2 else -1.0
        if dev.type == "cuda":
            mem = float(torch.cuda.max_memory_allocated(dev))
        else:
            mem = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
        t = torch.tensor([local, mem, self.save_s], dtype=torch.float64, device=dev)
        if trainer.world_size > 1:
            # the slowest rank's time counts; every rank takes part in this one collective
            t = trainer.strategy.reduce(t, reduce_op="max")
        self.step_s = float(t[0]) if float(t[0]) > 0 else None
        self.peak_mem, self.save_s = int(t[1]), float(t[2])


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


def _trial_job(job: dict[str, Any], *, warmup: int, steps: int, root: str, save: bool) -> dict[str, Any]:
    j = copy.deepcopy(job)
    t = j.setdefault("trainer", {})
    cbs = [c for c in as_list(t.get("callbacks")) if not any(d in str(_cp(c)) for d in _DROPPED)]
    cbs.append(
        {
            "class_path": "lightning_accel.callbacks.PerformanceMonitor",
            "init_args": {
                "skip_steps": warmup,
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
            "init_args": {"warmup": warmup, "steps": steps, "ckpt_dir": probe_dir},
        }
    )
    for key in ("max_time", "val_check_interval", "check_val_every_n_epoch"):
        t.pop(key, None)
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
    the failure is in the job itself, which the baseline's caller turns into an error. Every rank runs the same trial.
    """
    from lightning_accel.cli import AccelCLI

    m = TrialMeasure()
    start = time.perf_counter()
    root = os.fspath(root)
    Path(root).mkdir(parents=True, exist_ok=True)
    save = _saves(job)
    cli: Any = None
    try:
        with _quiet():
            argv = list(sys.argv)
            del sys.argv[1:]  # LightningCLI warns when it gets both a command line and a config
            try:
                cli = AccelCLI(args=_trial_job(job, warmup=warmup, steps=steps, root=root, save=save), run=False)
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
        if probe.step_s is not None:
            every = _save_every(job) or probe.steps_per_epoch or steps
            m.step_s = probe.step_s + (probe.save_s / every if save else 0.0)
        if monitor.report is not None:
            rep = monitor.report
            m.breakdown = {k: v / max(rep.steps, 1) for k, v in rep.seconds.items()}
            m.dominant, m.verdict = rep.dominant, rep.verdict
        if m.step_s is None:
            m.error = f"fewer than {warmup + steps + 1} steps ran (the epoch is shorter: lower the trial steps)"
    except (Exception, SystemExit) as e:  # a lever the job cannot take: reported, the tune goes on
        if isinstance(e, torch.OutOfMemoryError):
            m.peak_mem, m.error = None, f"out of memory: {one_line(e)}"
        else:
            m.error = f"{type(e).__name__}: {one_line(e)}"
    finally:
        del cli
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    m.seconds = time.perf_counter() - start
    return m


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
