"""The Lightning adapters of the perf room: ``PerformanceMonitor`` (where step time goes: data wait, compute, comm,
checkpoint stall, MFU, GPU utilisation), ``CudaMemoryManager`` (the caching allocator as a tuned memory pool, with
fragmentation logging and OOM snapshots) and ``HostMemoryManager`` (host memory kept between steps), thin callbacks
over the plain-torch core in this package and ``lightning_accel/_utils/malloc.py``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import os
import pickle
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.atomic import atomic_write_bytes, is_local_url, strip_file_scheme
from lightning_accel._utils.checks import check_bool, check_bytes, check_callable, check_int, check_number
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.forksafe import cuda_available
from lightning_accel._utils.fs import FileStore
from lightning_accel._utils.levers import find_levers
from lightning_accel._utils.malloc import MMAP_THRESHOLD, keep_freed_memory
from lightning_accel._utils.patching import Patch, patch
from lightning_accel._utils.paths import safe_join
from lightning_accel._utils.rank import global_rank
from lightning_accel.perf.cuda_memory import (
    AllocatorSettings,
    AppliedSettings,
    apply_allocator_settings,
    dump_memory_snapshot,
    fragmentation_stats,
    host_memory_stats,
    should_release,
)
from lightning_accel.perf.flops import StepFlopCounter, precision_dtype
from lightning_accel.perf.nvml import NvmlSampler, nvml_available
from lightning_accel.perf.plot import epoch_breakdown_png, is_breakdown_png, plot_available
from lightning_accel.perf.report import BottleneckReport, build_report
from lightning_accel.perf.timers import CATEGORIES, Clock, CudaEventClock, HostClock, StepTimer, TimerTotals

__all__ = ["CudaMemoryManager", "HostMemoryManager", "PerformanceMonitor"]


# the Trainer's `log_every_n_steps=0` is Lightning's "log no steps"; the callbacks' own 0 would be ambiguous
_WINDOW_FIX = (
    "Use None to follow the Trainer's `log_every_n_steps` (`Trainer(log_every_n_steps=0)` logs no windows), or a "
    "window of >= 1 optimizer steps."
)

# DDP samples its own forward/backward/comm timers every N iterations (default 100); 10 gives numbers in short runs
# at the cost of a few timer records every 10th step.
_DDP_TIMING_SAMPLE_RATE = 10


class PerformanceMonitor(Callback):
    """Attribute training-step time to data wait, compute, communication, checkpoint saves and validation; log it
    under ``perf/``; print a bottleneck report with a verdict at the end of ``fit``.

    What is measured, and how:

    * **data**: from the moment the training loop starts fetching the next batch (the dataloader's ``next()``, or
      an epoch's new iterator and its workers) to the next ``on_train_batch_start``: worker IPC, collation, the
      host-to-device copy. On CUDA measured between CUDA events, i.e. the time the *GPU* sat idle waiting for input.
    * **other**: the rest of the gap after ``on_train_batch_end``, before that fetch: the hooks of callbacks that
      run after the monitor, logging, progress bars, LR schedulers (a slow callback shows here, not as data).
      Validation and saves in the gap are subtracted from both.
    * **compute**: ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer), minus the exposed
      communication below. CUDA events on GPU; no per-step synchronisation (events are resolved at log time).
    * **comm**: exposed DDP gradient communication, from DDP's own runtime statistics
      (``avg_backward_comm_time - avg_backward_compute_comm_overlap_time``, sampled every 10th iteration), charged
      once per batch that synchronised gradients: with gradient accumulation only the batch that steps the optimizer
      does (the micro-batches before it run under ``no_sync`` and send nothing; under manual optimization every
      batch counts). Not measured: FSDP/DeepSpeed collectives and comm hooks that overlap with compute; their time
      stays in compute.
    * **checkpoint**: time inside ``trainer.save_checkpoint`` (state gathering + write; with ``AsyncCheckpointIO``
      only the blocking part), which is what the training loop stalls on.
    * **eval**: validation run inside ``fit``.
    * **throughput**: samples/s (batch size found by Lightning's ``extract_batch_size`` or ``samples_fn``),
      tokens/s when ``tokens_fn`` says how to count them.
    * **MFU**: FLOPs of one training step counted once per ``fit`` with ``torch.utils.flop_counter`` (the second
      batch; that step is excluded from timings; a resumed fit counts its own step too, a step that raised inside the
      count leaves none), over the device's peak for the trainer's precision (Lightning's table on CUDA, or
      ``peak_flops``).
    * **GPU utilisation and memory**: NVML (``pip install nvidia-ml-py``), sampled only when logging.

    Logging: every ``log_every_n_steps`` optimizer steps (with gradient accumulation, that many times the
    accumulated batches; counted as Lightning counts its own logging steps, also in a resumed fit), rank 0 sends
    window means to the trainer's loggers
    (``perf/data_s``, ``perf/compute_s``, ``perf/step_s``, ``perf/data_frac``, ``perf/samples_per_s``, ...), on the
    step axis of the run's own ``self.log`` metrics (Lightning's batches that stepped, not ``trainer.global_step``,
    which counts every optimizer's steps). At the end of ``fit`` the totals are averaged over ranks, and rank 0
    prints the report and writes it as JSON (``perf_report.json`` in the trainer's ``log_dir``). The report is also
    kept in :attr:`report` (and the picture's path in :attr:`png_path`), also on the main process's instance under
    ``strategy="ddp_spawn"`` / ``"ddp_fork"`` / ``"ddp_notebook"``, whose fit runs in processes of their own: rank
    0's worker sends them back when the fit returns. A fit that stops early (Ctrl+C, an exception) gets the report of
    the steps it measured all the same, from each rank's own numbers (no exchange between ranks then), with
    ``interrupted`` in its extras.

    Overhead: two clock reads and a batch-size lookup per step; see ``benchmarks/monitor_overhead.py``.

    Args:
        log_every_n_steps: window for logged metrics (None: the trainer's ``log_every_n_steps``; its 0, "log no
            steps", logs no window: the report at the end of the fit is still made and logged).
        skip_steps: warm-up steps left out of all timings (>= 1 when ``count_flops``; the FLOP count runs in the
            last skipped step).
        count_flops: count FLOPs once for MFU.
        peak_flops: the device's peak FLOP/s for the active precision (None: Lightning's table on CUDA, unknown on
            CPU); refused with ``count_flops=False``, where no MFU is computed.
        samples_fn: ``batch -> number of samples`` (None: Lightning's batch-size extraction).
        tokens_fn: ``batch -> number of tokens`` for tokens/s (None: not reported). Either returns an integer >= 0
            (a Python or numpy integer, a one-element tensor, a whole float); anything else stops the fit at its
            first batch with an error naming the function. Under ``strategy="ddp_spawn"``, which pickles the
            callbacks, both must be picklable (defined at a module's top level, not lambdas).
        nvml: sample GPU utilisation and memory through NVML when available: of the GPU torch trains on, found by
            its UUID or PCI bus id (NVML numbers all GPUs, torch only those ``CUDA_VISIBLE_DEVICES`` leaves); one
            warning when only an index is left to go by.
        report_path: where to write the JSON report, a local path (a leading ``~`` is the home directory) or an fsspec
            URL such as ``s3://bucket/run.json`` (None: ``<log_dir>/perf_report.json``; ``""``: do not write); the PNG
            goes beside it with the suffix ``.png``. Checked here: a file name, never an existing directory nor a
            directory's spelling (``runs/``), never a ``.png`` name (the picture would overwrite the report), never
            under an existing file, never a URL whose scheme no installed fsspec filesystem handles; never blank. A
            file already at either place that the monitor did not write (neither a report of its own, nor a picture it
            drew, nor a file this instance wrote there and that is still as it wrote it) is never overwritten: that
            file is skipped, with one warning naming it. A file that cannot be written at the end of the fit (a full
            disk, a removed folder) is one warning too: the fit does not fail over it, and the report stays in
            :attr:`report`.
        verbose: print the report on rank 0.
        clock: override the segment clock, an object with ``mark()`` and ``elapsed(start, end)`` such as
            ``HostClock(fn)`` (tests inject a fake one; checked here).
        span_clock: override the clock for validation/checkpoint spans (tests; the same kind of object).
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        skip_steps: int = 2,
        count_flops: bool = True,
        peak_flops: float | None = None,
        samples_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        nvml: bool = True,
        report_path: str | os.PathLike[str] | None = None,
        verbose: bool = True,
        clock: Clock | None = None,
        span_clock: Clock | None = None,
    ) -> None:
        super().__init__()
        # checked before the fit, so that a typo fails in seconds instead of after the whole run
        count_flops = check_bool("count_flops", count_flops)
        nvml = check_bool("nvml", nvml)
        verbose = check_bool("verbose", verbose)
        log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, low=1, allow_none=True, fix=_WINDOW_FIX)
        skip_steps = check_int(
            "skip_steps",
            skip_steps,
            low=1 if count_flops else 0,
            fix="With `count_flops=True` the FLOP count runs in the last skipped step (it is slow): raise it or pass "
            "`count_flops=False`."
            if count_flops
            else "",
        )
        peak_flops = check_number(
            "peak_flops", peak_flops, low=0, low_open=True, allow_none=True, fix="Pass the device's FLOP/s."
        )
        if peak_flops is not None and math.isinf(peak_flops):  # every MFU would be 0
            raise ValueError(
                f"`peak_flops` must be a finite number > 0 or None, got {peak_flops}. Pass the device's FLOP/s "
                "(e.g. 989e12, an H100's dense bf16 peak), or None to leave MFU out on a device Lightning's table "
                "does not know."
            )
        if peak_flops is not None and not count_flops:  # MFU is counted FLOPs over the peak: nothing would use it
            raise ValueError(
                f"`peak_flops` is {peak_flops:g}, but `count_flops=False` counts no FLOPs, so no MFU is reported: pass "
                "`count_flops=True` for MFU, or leave `peak_flops` out."
            )
        check_callable("samples_fn", samples_fn, "a function `batch -> number of samples`")
        check_callable("tokens_fn", tokens_fn, "a function `batch -> number of tokens`")
        _check_clock("clock", clock)
        _check_clock("span_clock", span_clock)
        self.log_every_n_steps = log_every_n_steps
        self.skip_steps = skip_steps
        self.count_flops = count_flops
        self.peak_flops = peak_flops
        self.samples_fn = samples_fn
        self.tokens_fn = tokens_fn
        self.nvml = nvml
        self.report_path = _check_report_path(report_path)
        self.verbose = verbose
        self._clock = clock
        self._span_clock = span_clock
        self.timer: StepTimer | None = None
        self.report: BottleneckReport | None = None
        self._flops = StepFlopCounter()
        self._sampler: NvmlSampler | None = None
        self._nvml_last: dict[str, float] = {}
        self._every: int | None = 50  # None: the trainer logs no steps (`log_every_n_steps=0`)
        self._save_patch: Patch | None = None
        self._fetch_patch: Patch | None = None  # calls `_fetching` when the training loop fetches a batch
        self._ddp_timed: weakref.ref[Any] | None = None  # the DDP module asked to time itself in this fit
        self._peak_cache: tuple[float | None] | None = None
        self._log_dir: str | None = None
        self._epochs: list[TimerTotals] = []  # per epoch, this rank's totals (reduced at the end of fit)
        self._epoch_numbers: list[int] = []
        self._epoch_mark = TimerTotals()
        self._epoch_index: int | None = None
        self._step_before = 0  # trainer.global_step when the current batch started
        # report and picture files this instance wrote, with what it wrote there: it may replace them while they are
        # still that (a file the user put in their place since is not the monitor's)
        self._written: dict[str, _Written] = {}
        self._finished = False  # this fit's report was made (at its end, or when it was interrupted)
        self.png_path: str | None = None
        # the spawning launchers fit on a copy of this instance in each worker: rank 0's copy sends its report back to
        # this one, found by this token (pickled with the copy)
        self.worker_results_token = uuid.uuid4().hex
        compat.carry_callback_results_from_workers(self)

    # -- set-up / tear-down --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        compat.carry_callback_results_from_workers(self)  # a spawned worker imported the launcher afresh
        device = trainer.strategy.root_device
        clock = self._clock
        if clock is None:
            clock = CudaEventClock(device) if device.type == "cuda" else HostClock()
        self.timer = StepTimer(clock=clock, span_clock=self._span_clock or HostClock(), skip_steps=self.skip_steps)
        self.report = None
        self._finished = False
        # counted again for this fit's model and batch: a count of an earlier fit of this instance, or of the fit that
        # saved the checkpoint a fit resumes from, is another batch size's, precision's or model's; so the monitor keeps
        # no state in checkpoints, and the count an older checkpoint holds is ignored (the base `load_state_dict`)
        self._flops.cancel()
        self._flops.flops = None
        self._ddp_timed = None  # a DDP module of an earlier fit says nothing about this one
        self._peak_cache = None
        self._epochs, self._epoch_numbers = [], []
        self._epoch_mark = TimerTotals()
        self._epoch_index = None
        # `trainer.log_dir` is a broadcast: read it here, where every rank runs, never on rank 0 alone at the end
        self._log_dir = _log_dir(trainer) if self.report_path is None else None
        self._every = self.log_every_n_steps or _trainer_log_every_n_steps(trainer)
        if self.nvml and device.type == "cuda" and nvml_available():
            # matched to torch's device by UUID / PCI bus id (NVML numbers every GPU of the machine, torch only the
            # visible ones); opened here, once per fit, so that a GPU it cannot match is said before training
            self._sampler = NvmlSampler.for_device(device)
            self._sampler.open()
            if self._sampler.note:
                rank_zero_warn(f"PerformanceMonitor: {self._sampler.note}")
        self._wrap_save_checkpoint(trainer)
        if self._fetch_patch is None:
            self._fetch_patch = compat.on_train_fetch(trainer, self._fetching, key=f"PerformanceMonitor-{id(self)}")

    def _fetching(self) -> None:
        """The loop starts fetching the next training batch: the gap's time after this is data wait."""
        if self.timer is not None:
            self.timer.fetch_start()

    def worker_results(self) -> dict[str, Any]:
        """What rank 0's worker process of a spawning launcher sends back to the main process's instance."""
        return {"report": self.report, "png_path": self.png_path}

    def load_worker_results(self, results: dict[str, Any]) -> None:
        """Take the report made in rank 0's worker process (the main process of a spawning launcher)."""
        self.report, self.png_path = results["report"], results["png_path"]

    def __getstate__(self) -> dict[str, Any]:
        """The state that is pickled, e.g. by ``strategy="ddp_spawn"``, which copies the callbacks into each process it
        starts: refused, naming the argument, when a function given to the monitor cannot be pickled (a lambda, a
        function defined inside another): pickle's own error names neither the monitor nor the argument.

        Raises:
            pickle.PicklingError: ``samples_fn``, ``tokens_fn``, ``clock`` or ``span_clock`` cannot be pickled.
        """
        user = {
            "samples_fn": self.samples_fn,
            "tokens_fn": self.tokens_fn,
            "clock": self._clock,
            "span_clock": self._span_clock,
        }
        for name, value in user.items():
            if value is None:
                continue
            try:
                pickle.dumps(value)
            except Exception as e:
                raise pickle.PicklingError(
                    f"PerformanceMonitor's `{name}` must be picklable, got {value!r}, which pickle refuses "
                    f"({type(e).__name__}); a launcher that starts its processes with spawn (`strategy='ddp_spawn'`) "
                    "pickles the callbacks into each of them. Define the function at the top level of a module "
                    "(`def count(batch): ...`), or use `strategy='ddp'` (or `'ddp_fork'`), which copies nothing by "
                    "pickling."
                ) from None
        return self.__dict__.copy()

    def __copy__(self) -> PerformanceMonitor:
        # a copy in the same process is no pickling: it keeps a lambda as it always did (no `__getstate__` check)
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> PerformanceMonitor:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _wrap_save_checkpoint(self, trainer: pl.Trainer) -> None:
        # Shadow the bound method on this trainer instance only (restored in teardown): every save, whoever calls it
        # (ModelCheckpoint, the user, a fault handler), is timed, and the checkpoint IO plugin is left untouched so
        # isinstance checks of other plugins still hold.
        if self._save_patch is not None:
            return

        def timed(p: Patch) -> Callable[..., Any]:
            # `p.original` is read at each call, not captured: if another patch below this one is restored first,
            # the chain is rewired through `p.original` and this wrapper must follow it
            @functools.wraps(p.original)
            def timed_save(*args: Any, **kwargs: Any) -> Any:
                timer = self.timer
                if timer is None:
                    return p.original(*args, **kwargs)
                timer.begin("checkpoint")
                try:
                    return p.original(*args, **kwargs)
                finally:
                    timer.end("checkpoint")

            return timed_save

        self._save_patch = patch(trainer, "save_checkpoint", timed, key=f"PerformanceMonitor-{id(self)}")

    def _restore_patches(self, trainer: pl.Trainer) -> None:
        if self._save_patch is not None:
            self._save_patch.restore()  # back to the class method
            self._save_patch = None
        if self._fetch_patch is not None:
            self._fetch_patch.restore()  # the profiler's own `start` again
            self._fetch_patch = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_patches(trainer)
        self._flops.stop()
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit that stops early (Ctrl+C, an exception) still gets the report of the steps it measured: built and
        written as at a normal end, from this rank's own numbers (a rank that raised cannot count on the others to
        join an all-reduce, so no collective runs here), marked ``interrupted`` in its extras."""
        # never leave a dispatch mode active after a crash; a step that crashed inside the count (an OOM in backward)
        # has no FLOP total: dropped, so that MFU does not take half a step's count
        self._flops.cancel()
        self._restore_patches(trainer)
        # Lightning calls no `teardown` of callbacks after an exception: the monitor closes what it opened
        try:
            if self.timer is not None and not self._finished and trainer.state.fn == TrainerFn.FITTING:
                self._finish(trainer, pl_module, interrupted=exception)
        except Exception as e:  # never mask the exception that stopped the fit
            log.error("PerformanceMonitor: the report of the interrupted fit could not be made: %r", e)
        finally:
            self._finished = True
            if self._sampler is not None:
                self._sampler.close()
                self._sampler = None

    # -- the loop ------------------------------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is None:
            return
        self._close_epoch(trainer)
        self._epoch_index = trainer.current_epoch
        # what follows in this gap is the epoch's new dataloader iterator (workers starting) and its first fetch
        self.timer.fetch_start()

    def _close_epoch(self, trainer: pl.Trainer) -> None:
        """Flush (and log) the open window and record the epoch that just ended as the difference of totals."""
        timer = self.timer
        if timer is None or self._epoch_index is None:
            return
        self._log_window(trainer)
        cur = timer.totals
        mark = self._epoch_mark
        ep = TimerTotals(
            seconds={c: cur.seconds[c] - mark.seconds.get(c, 0.0) for c in CATEGORIES},
            steps=cur.steps - mark.steps,
            samples=cur.samples - mark.samples,
            tokens=cur.tokens - mark.tokens,
        )
        self._epoch_mark = TimerTotals(dict(cur.seconds), cur.steps, cur.samples, cur.tokens)
        self._epochs.append(ep)
        self._epoch_numbers.append(self._epoch_index)
        self._epoch_index = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        timer = self.timer
        if timer is None:
            return
        timer.batch_start()
        self._step_before = trainer.global_step
        if self._epoch_index is None:
            # a fit resumed from a checkpoint saved mid-epoch goes on with that epoch without `on_train_epoch_start`:
            # without this its batches would count in the next epoch's row, and the resumed epoch have none
            self._epoch_index = trainer.current_epoch
        if self.count_flops and self._flops.flops is None and timer.seen_steps == self.skip_steps - 1:
            self._flops.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        timer = self.timer
        if timer is None:
            return
        if self._flops.active:
            self._flops.stop()
        # DDP allreduces only in the backward of a batch that steps the optimizer: Lightning runs the accumulating
        # micro-batches under `no_sync`. Under manual optimization the user decides; every batch is assumed to sync.
        synced = _stepped(trainer, pl_module, self._step_before)
        tokens = _count("tokens_fn", self.tokens_fn(batch), "tokens") if self.tokens_fn is not None else 0
        timer.batch_end(self._samples(batch), tokens, synced=synced)
        # every rank reaches the same decision (the flush asks DDP for its timers on each)
        if timer.seen_steps > self.skip_steps and synced and _log_due(trainer, self._every):
            self._log_window(trainer)

    def _samples(self, batch: Any) -> int:
        if self.samples_fn is not None:
            return _count("samples_fn", self.samples_fn(batch), "samples")
        if isinstance(batch, torch.Tensor):  # fast path: most batches are a tensor or a tuple starting with one
            return int(batch.shape[0]) if batch.ndim else 1
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim:
            return int(batch[0].shape[0])
        from lightning.pytorch.utilities.data import extract_batch_size

        try:
            return int(extract_batch_size(batch))
        except Exception:
            return 0

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is not None and not trainer.sanity_checking:
            self.timer.begin("eval")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is not None and not trainer.sanity_checking:
            self.timer.end("eval")

    # -- numbers -------------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._init_ddp_timing(trainer)

    def _init_ddp_timing(self, trainer: pl.Trainer) -> None:
        """Ask this fit's DDP module to time itself: once per module, so also a model wrapped again during the fit
        (StructuredPruning) or in a later fit of this instance, never a module of an earlier fit only."""
        model = getattr(trainer.strategy, "model", None)
        if model is None or (self._ddp_timed is not None and self._ddp_timed() is model):
            return
        if compat.set_ddp_runtime_logging_sample_rate(model, _DDP_TIMING_SAMPLE_RATE):
            self._ddp_timed = weakref.ref(model)

    def _ddp_exposed_comm(self, trainer: pl.Trainer) -> float | None:
        """Seconds per step of DDP gradient communication not hidden behind backward, from DDP's own timers."""
        self._init_ddp_timing(trainer)
        d = compat.ddp_logging_data(getattr(trainer.strategy, "model", None))
        if d is None:
            return None
        comm_ns = float(d.get("avg_backward_comm_time", 0) or 0)
        overlap_ns = float(d.get("avg_backward_compute_comm_overlap_time", 0) or 0)
        return max(0.0, comm_ns - overlap_ns) / 1e9

    def _flush(self, trainer: pl.Trainer) -> TimerTotals:
        assert self.timer is not None
        comm = self._ddp_exposed_comm(trainer)
        if comm:
            # exposed comm happened inside the step segments: move it out of compute before the window closes. DDP's
            # figure is per synchronising iteration; accumulation micro-batches (no_sync) sent nothing.
            self.timer.move(comm * self.timer.window_sync_steps, src="compute", dst="comm")
        return self.timer.flush()

    def _log_window(self, trainer: pl.Trainer) -> None:
        window = self._flush(trainer)
        # flushed in every case (the epochs' totals need it); logged unless the trainer logs no steps
        if not window.steps or not trainer.is_global_zero or not trainer.loggers or self._every is None:
            return
        wall = window.wall
        n = window.steps
        metrics: dict[str, float] = {f"perf/{c}_s": window.seconds[c] / n for c in CATEGORIES if window.seconds[c]}
        metrics["perf/step_s"] = wall / n
        if wall > 0:
            metrics["perf/data_frac"] = window.seconds["data"] / wall
            if window.samples:
                metrics["perf/samples_per_s"] = window.samples / wall
            if window.tokens:
                metrics["perf/tokens_per_s"] = window.tokens / wall
            peak = self._peak(trainer)
            if self._flops.flops and peak:
                metrics["perf/mfu"] = self._flops.flops / (wall / n) / peak
        if self._sampler is not None:
            self._nvml_last = self._sampler.sample()
            metrics.update({f"perf/{k}": v for k, v in self._nvml_last.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=compat.logger_step(trainer))

    def _peak(self, trainer: pl.Trainer) -> float | None:
        if self.peak_flops is not None:
            return self.peak_flops
        if self._peak_cache is None:
            self._peak_cache = (_table_peak(trainer),)
        return self._peak_cache[0]

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is None or self._finished:
            return
        self._finished = True  # before the work: a failure in it reaches `on_exception`, which must not start again
        self._flops.stop()
        self._finish(trainer, pl_module)

    def _finish(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, interrupted: BaseException | None = None
    ) -> None:
        """Close the timings and make the report: reduced over ranks at the end of a fit (every rank is here), this
        rank's own numbers when ``interrupted`` (no collective); rank 0 logs, writes and prints it."""
        timer = self.timer
        assert timer is not None
        self._close_epoch(trainer)  # flushes the last window
        timer.stop()  # an interrupted batch, or validation or a save cut short, is not counted
        self._flush(trainer)
        if interrupted is None:
            totals = self._reduce(trainer, timer.totals)
            epochs = self._reduce_epochs(trainer)
        else:
            totals, epochs = timer.totals, self._reduce_epochs(trainer, collective=False)
        if totals.steps <= 0:
            if interrupted is not None:  # the exception says what happened; advice on `skip_steps` would mislead
                return
            rank_zero_warn(
                f"PerformanceMonitor: no step was timed ({timer.seen_steps} steps ran, {self.skip_steps} are warm-up); "
                "no report. Run more steps or lower `skip_steps`."
            )
            return
        ios = _checkpoint_io_layers(trainer.strategy.checkpoint_io)
        dm = getattr(trainer, "datamodule", None)  # set by `fit(datamodule=...)`; not declared on the Trainer class
        context: dict[str, Any] = {
            "precision": str(trainer.precision),
            "num_workers": _num_workers(trainer),
            # class names with their bases': a subclass of FusedPrecision or OneBitDDPStrategy counts as one
            "precision_plugin": [c.__name__ for c in type(trainer.precision_plugin).__mro__],
            "strategy": [c.__name__ for c in type(trainer.strategy).__mro__],
            # the same for the checkpoint IO and every IO it wraps; and whether one already writes in the background
            # without being an AsyncCheckpointIO (`DeltaCheckpointIO(async_save=True)`)
            "checkpoint_io": [c.__name__ for io in ios for c in type(io).__mro__],
            "checkpoint_async": any(getattr(io, "async_save", False) is True for io in ios),
            # the data module's class names (a CachedDataModule subclass counts), the device type, and whether the
            # model already runs compiled: the advice leaves out what is already on, and GPU work on a CPU run
            "datamodule": [c.__name__ for c in type(dm).__mro__] if dm is not None else [],
            "device": trainer.strategy.root_device.type,
            "compiled": _is_compiled(pl_module),
            # whether a lever strategy (`ddp_1bit`) changes training at the end of the fit: compressing, not still in
            # its fp32 warm-up or kept at fp32 by `compression="auto"`
            "strategy_lever_active": any(lv.lever_active for lv in find_levers([trainer.strategy])),
        }
        extras: dict[str, Any] = {"world_size": trainer.world_size, "device": str(trainer.strategy.root_device)}
        if self._ddp_timed is not None:
            extras["comm_source"] = "DDP runtime stats (exposed backward allreduce)"
        if interrupted is not None:
            extras["interrupted"] = type(interrupted).__name__
            if trainer.world_size > 1:
                extras["ranks"] = f"rank {trainer.global_rank}'s numbers only (the fit stopped before ranks met)"
        if self._sampler is not None:
            extras.update({f"last_{k}": round(v, 2) for k, v in (self._sampler.sample() or self._nvml_last).items()})
        self.report = build_report(
            totals,
            flops_per_step=self._flops.flops,
            peak_flops=self._peak(trainer),
            context=context,
            extras=extras,
            epochs=epochs,
        )
        if not trainer.is_global_zero:
            return
        r = self.report
        summary = {f"perf/report/{c}_frac": r.shares[c] for c in CATEGORIES}
        summary["perf/report/step_s"] = r.step_time_s
        if r.samples_per_s is not None:
            summary["perf/report/samples_per_s"] = r.samples_per_s
        if r.mfu is not None:
            summary["perf/report/mfu"] = r.mfu
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=compat.logger_step(trainer))
        self._log_epoch_scalars(trainer, r.epochs)
        path = self._report_file()
        written = ""
        if path:
            places = []
            # the fit is over and its numbers are in `self.report`: a file that cannot be written (a full disk, a log
            # directory removed during the run, expired storage credentials) is said, never turned into a failed fit
            try:
                if _may_replace(path, "report", self._written):
                    data = r.to_json().encode("utf-8")
                    atomic_write_bytes(path, data)
                    self._written[path] = _Written.of(data)
                    places.append(f"report written to {path}")
            except Exception as e:
                _warn_unwritten("report", path, e)
            try:
                # an interrupted fit's bars are this rank's own seconds, not a mean (no collective ran)
                ylabel = f"seconds (rank {trainer.global_rank}'s own)" if "ranks" in r.extras else None
                self.png_path = self._write_png(path, r.epochs, self._written, ylabel=ylabel)
            except Exception as e:
                self.png_path = None
                _warn_unwritten("picture", _with_suffix(path, ".png"), e)
            if self.png_path:
                places.append(f"picture {self.png_path}")
            written = f"\n({', '.join(places)})" if places else ""
        if self.verbose:
            rank_zero_info(r.format() + written)

    def _report_file(self) -> str | None:
        if self.report_path == "":
            return None
        if self.report_path is not None:
            return self.report_path
        # string joins, never pathlib: `Path("s3://b/logs")` collapses the scheme to a local folder named `s3:`
        return safe_join(os.fspath(self._log_dir), "perf_report.json") if self._log_dir else None

    @staticmethod
    def _write_png(
        json_path: str,
        epochs: list[dict[str, float]],
        written: dict[str, _Written] | None = None,
        *,
        ylabel: str | None = None,
    ) -> str | None:
        """``perf_report.png`` beside the JSON: seconds per category, one stacked bar per epoch (needs matplotlib).

        Not written over a file the monitor did not write (see :func:`_may_replace`; ``written`` holds the files this
        instance wrote, and receives the picture's); None when nothing was written."""
        if not epochs:
            return None
        if not plot_available():
            rank_zero_info("PerformanceMonitor: no perf_report.png (needs matplotlib: `pip install matplotlib`).")
            return None
        png = _with_suffix(json_path, ".png")
        written = {} if written is None else written
        if not _may_replace(png, "picture", written):
            return None
        data = epoch_breakdown_png(epochs) if ylabel is None else epoch_breakdown_png(epochs, ylabel=ylabel)
        atomic_write_bytes(png, data)
        written[png] = _Written.of(data)
        return png

    @staticmethod
    def _log_epoch_scalars(trainer: pl.Trainer, epochs: list[dict[str, float]]) -> None:
        """The per-epoch breakdown as ``perf/epoch/<category>_s`` scalars (x axis: the epoch) for TensorBoard."""
        tb = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        for e in epochs:
            scalars = {f"perf/epoch/{c}_s": e[c] for c in CATEGORIES if e.get(c)}
            for lg in tb:
                lg.log_metrics(scalars, step=int(e["epoch"]))

    @staticmethod
    def _reduce(trainer: pl.Trainer, totals: TimerTotals) -> TimerTotals:
        """Mean seconds over ranks (one small all-reduce at the end of fit); steps per rank; samples/tokens summed over
        ranks and counted once per batch (:func:`_ranks_per_batch`), for the job's rates."""
        if trainer.world_size <= 1:
            return totals
        vals = [totals.seconds[c] for c in CATEGORIES] + [totals.steps, totals.samples, totals.tokens]
        t = torch.tensor(vals, dtype=torch.float64, device=trainer.strategy.root_device)
        t = trainer.strategy.reduce(t, reduce_op="sum")
        ws = trainer.world_size
        out = TimerTotals()
        for i, c in enumerate(CATEGORIES):
            out.seconds[c] = float(t[i]) / ws
        # per-device rates: average steps per rank, samples summed over ranks over the (mean) wall time = global rate;
        # the ranks of a tensor-parallel group or a pipeline all saw their group's batch: count it once
        share = _ranks_per_batch(trainer)
        out.steps = int(round(float(t[len(CATEGORIES)]) / ws))
        out.samples = int(round(float(t[len(CATEGORIES) + 1]) / share))
        out.tokens = int(round(float(t[len(CATEGORIES) + 2]) / share))
        return out

    def _reduce_epochs(self, trainer: pl.Trainer, *, collective: bool = True) -> list[dict[str, float]]:
        """Per-epoch seconds averaged over ranks, samples summed and counted once per batch, as :meth:`_reduce` does
        (one all-reduce, every rank has the same epochs); this rank's own rows when not ``collective``."""
        rows = [[e.seconds[c] for c in CATEGORIES] + [e.steps, e.samples] for e in self._epochs]
        if not rows:
            return []
        if collective and trainer.world_size > 1:
            t = torch.tensor(rows, dtype=torch.float64, device=trainer.strategy.root_device)
            t = trainer.strategy.reduce(t, reduce_op="sum")
            rows = (t.cpu() / trainer.world_size).tolist()
            share = _ranks_per_batch(trainer)
            for r in rows:
                r[-1] *= trainer.world_size / share  # samples: the sum over ranks, each group's batch once
        out: list[dict[str, float]] = []
        for epoch, r in zip(self._epoch_numbers, rows, strict=True):
            d: dict[str, float] = {"epoch": float(epoch)}
            d.update({c: float(r[i]) for i, c in enumerate(CATEGORIES)})
            wall = sum(r[: len(CATEGORIES)])
            d["steps"] = float(round(r[len(CATEGORIES)]))
            d["samples_per_s"] = float(r[-1]) / wall if wall > 0 else 0.0
            out.append(d)
        return out


def _check_report_path(value: Any) -> str | None:
    """``report_path`` as a string: None, ``""``, a local file path or an fsspec URL, never an existing directory."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f'`report_path` must be a file path or URL (a string), None or "", got {value!r} ({type(value).__name__}). '
            "E.g. `report_path='runs/perf_report.json'`."
        )
    # `~/runs/r.json` (a YAML config, a quoted argument) is the home directory's, as for Lightning's checkpoint dirpath;
    # unexpanded it became a folder named `~` in the working directory
    path = os.path.expanduser(os.fspath(value))
    if path and not path.strip():
        # blanks only (an unset variable in a shell line, a YAML value cut short): the report would land in the working
        # directory under a name nobody sees, and the picture beside it as ` .png`
        raise ValueError(
            f"`report_path` must name a file, got {path!r}, which is blank. Name the file, e.g. "
            "'runs/perf_report.json', or pass None for `<log_dir>/perf_report.json` or `\"\"` to write no report."
        )
    name = path.rstrip("/" + os.sep).rpartition("/")[2].rpartition(os.sep)[2]
    if path and (path.endswith(("/", os.sep)) or name in ("", ".", "..")):
        # a directory's spelling: the report would land as a file named like the directory, and the picture beside
        # it (`<dir>/.png`) fail after the whole fit
        raise ValueError(
            f"`report_path` must name a file, got {path!r}, which names a directory. Name the file, e.g. "
            f"{path + ('' if path.endswith(('/', os.sep)) else '/') + 'perf_report.json'!r}."
        )
    if path and is_local_url(path) and os.path.isdir(strip_file_scheme(path)):
        raise ValueError(
            f"`report_path` must be a file path, got {path!r}, an existing directory. "
            f"Name the file, e.g. {safe_join(path, 'perf_report.json')!r}."
        )
    if path and is_local_url(path):
        _check_no_file_above("report_path", path, "perf_report.json")
    elif path:
        _check_protocol("report_path", path)
    if path.rpartition("/")[2].lower().endswith(".png"):
        raise ValueError(
            f"`report_path` must name the JSON report, not a .png, got {path!r}: the picture goes beside the report "
            f"with the suffix .png and would overwrite it. Name the report e.g. {_with_suffix(path, '.json')!r}."
        )
    return str(path)


def _check_clock(name: str, value: Any) -> None:
    """``value`` must be None or a :class:`~lightning_accel.perf.timers.Clock` (``mark()`` and ``elapsed(a, b)``): a
    plain ``time.perf_counter`` failed only at the first training batch."""
    if value is None or (callable(getattr(value, "mark", None)) and callable(getattr(value, "elapsed", None))):
        return
    fix = f" Wrap a `() -> seconds` function in a clock: `{name}=HostClock(fn)`." if callable(value) else ""
    raise TypeError(
        f"`{name}` must be a clock with `mark()` and `elapsed(start, end)` (e.g. `HostClock()` from "
        f"`lightning_accel.perf`) or None, got {value!r} ({type(value).__name__}).{fix}"
    )


def _count(name: str, value: Any, what: str) -> int:
    """``value``, what the user's function ``name`` (``samples_fn``, ``tokens_fn``) returned for a batch, as a count.

    Accepted: an integer >= 0 as Python, numpy or a one-element tensor has it (an integral float such as a float mask's
    sum, ``172.0``, too). Anything else raises at the first batch, naming the function: ``int(value)`` alone fails on
    ``None`` with a message that names neither the function nor the batch, and lets a negative count (a throughput
    below zero in the report) or a fraction (truncated) through silently.

    Raises:
        TypeError: ``value`` is not a number (``None``, a tensor of several elements, a string).
        ValueError: ``value`` is negative, not a whole number, or not finite.
    """
    fix = "Return e.g. `len(batch[0])`." if what == "samples" else "Return e.g. `batch.numel()` or `int(mask.sum())`."
    n: int | None
    if isinstance(value, bool):  # an int subclass: `lambda batch: batch is not None` is no count
        n = None
    else:
        try:
            n = int(value)  # ints, numpy integers and floats, one-element tensors
        except OverflowError:  # an infinite float: a number, but no count
            n = -1
        except ValueError:  # NaN (a number, but no count), or a tensor of several elements
            n = -1 if isinstance(value, float) else None
        except (TypeError, RuntimeError):
            n = None
    # a tensor of the batch's size would print every element: its shape says enough
    got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) and value.numel() > 1 else None
    if n is None:
        raise TypeError(
            f"`{name}` must return the number of {what} in the batch, an integer >= 0, got "
            f"{got or repr(value)} ({type(value).__name__}). {fix}"
        )
    # an integer needs no comparison (on a CUDA tensor each one would be a device sync): only a float may be a fraction
    exact = isinstance(value, int) or (isinstance(value, torch.Tensor) and not value.is_floating_point())
    if n < 0 or not (exact or bool(n == value)):
        raise ValueError(
            f"`{name}` must return the number of {what} in the batch, an integer >= 0, got {value!r}. {fix}"
        )
    return n


def _warn_unwritten(what: str, path: str, error: BaseException) -> None:
    """One warning: the ``what`` ("report", "picture") could not be written at ``path``; the report stays available."""
    rank_zero_warn(
        f"PerformanceMonitor: the {what} could not be written to {path!r} ({one_line(error, expected=(OSError,))}); "
        "the fit is not affected and the report is kept in `PerformanceMonitor.report`. Check that the place is "
        "writable, or pass another `report_path`."
    )


def _stepped(trainer: pl.Trainer, pl_module: pl.LightningModule, step_before: int) -> bool:
    """Whether the batch that began at ``trainer.global_step == step_before`` stepped the optimizer: Lightning runs
    accumulation micro-batches without a step (and, under DDP, without the allreduce); under manual optimization the
    user decides, so every batch counts as one that stepped."""
    return not pl_module.automatic_optimization or trainer.global_step != step_before


def _log_due(trainer: pl.Trainer, every: int | None) -> bool:
    """Lightning's rule for its own logging, asked after a batch that stepped: the n-th such batch logs when n is a
    multiple of ``every`` (``logger_step`` counts the ones before it); never when ``every`` is None (the trainer logs
    no steps, see :func:`_trainer_log_every_n_steps`). Windows that follow it land on the rows of the run's
    ``self.log`` metrics in every fit, after a resume and with gradient accumulation."""
    return every is not None and (compat.logger_step(trainer) + 1) % every == 0


def _check_protocol(name: str, url: str) -> None:
    """Raise when no installed fsspec filesystem handles the scheme of ``url`` (each one of a chained
    ``simplecache::s3://...``): the write would fail only after the whole fit, or when the fit has failed."""
    import fsspec

    for part in url.split("::"):
        protocol = part.partition("://")[0] if "://" in part else part
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as e:
            raise ImportError(
                f"`{name}` is {url!r}, whose scheme `{protocol}://` needs a package that is not installed "
                f"({one_line(e)}). Install it, or pass a local path."
            ) from None
        except ValueError:
            raise ValueError(
                f"`{name}` must be a local path or an fsspec URL, got {url!r}, whose scheme `{protocol}://` no "
                "filesystem knows. Check its spelling (e.g. `s3://bucket/run.json`), or pass a local path."
            ) from None


def _check_no_file_above(name: str, path: str, example: str) -> None:
    """Raise when a folder of the local ``path`` (``file://`` allowed) is an existing file: the write would fail after
    the whole fit (``runs`` a file, ``runs/perf_report.json`` the report)."""
    parent = os.path.dirname(os.path.abspath(strip_file_scheme(path)))
    while parent and not os.path.exists(parent):
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above
    if parent and not os.path.isdir(parent):
        raise ValueError(
            f"`{name}` must be a path under a directory, got {path!r}, but {parent!r} is a file, not a directory. "
            f"Move that file, or pass a path in a directory, e.g. {os.path.join(os.path.dirname(parent), example)!r}."
        )


# a report of this monitor is small (a few KB, one entry per epoch): a bigger file at its place is not one
_OWN_FILE_MAX_BYTES = 1 << 20
_REPORT_KEYS = frozenset({"seconds", "shares", "dominant", "verdict", "steps", "step_time_s"})


def _read_head(path: str, n: int) -> bytes | None:
    """The first ``n`` bytes of the file at ``path`` (local or fsspec URL); None when nothing is there, or when the
    store cannot be asked (the write then says what is wrong, as it did before this check existed).

    Raises:
        Exception: something is there but cannot be read as a file (a directory, no permission).
    """
    store = FileStore(retries=0)
    try:
        there = store.exists(path)
    except Exception:  # no such filesystem installed, an unreachable store, no credentials
        return None
    return store.head(path, n) if there else None


def _is_own_file(head: bytes) -> bool:
    """Whether ``head`` (a whole small file, or the start of a larger one) is a report or a picture the monitor wrote:
    a PNG with the monitor's text chunk, or a JSON object with every key of :class:`BottleneckReport`."""
    if is_breakdown_png(head):
        return True
    if len(head) >= _OWN_FILE_MAX_BYTES:
        return False
    try:
        data = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and set(data) >= _REPORT_KEYS


@dataclass(frozen=True)
class _Written:
    """What the monitor wrote to a file: its size and SHA-256, to know the file again (it may have been replaced)."""

    size: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> _Written:
        return cls(len(data), hashlib.sha256(data).hexdigest())


def _may_replace(path: str, what: str, written: dict[str, _Written]) -> bool:
    """Whether the monitor may write its ``what`` ("report", "picture") at ``path``: nothing is there, or a file this
    instance wrote there and that is still what it wrote (``written``), or one the monitor recognisably wrote (an
    earlier run's report or picture). Else one warning names the file, which is left as it is."""
    own = written.get(path)
    try:
        # one byte more than this instance wrote there: a longer file is not that one
        head = _read_head(path, max(_OWN_FILE_MAX_BYTES, own.size + 1 if own is not None else 0))
    except Exception:  # there but unreadable (a directory, no permission): not the monitor's; no crash over it
        head = b""
    if head is None or (own is not None and _Written.of(head) == own) or _is_own_file(head[:_OWN_FILE_MAX_BYTES]):
        return True
    rank_zero_warn(
        f"PerformanceMonitor: {path!r} exists and is not a {what} the monitor wrote, so the {what} is not written "
        "there (that file is left as it is). Move it, or pass another `report_path`."
    )
    return False


def _with_suffix(path: str, suffix: str) -> str:
    """``path`` with the extension of its last component replaced by ``suffix`` (added when it has none).

    String operations on purpose: ``Path("s3://b/r.json")`` would collapse the URL to ``s3:/b/r.json``.
    """
    head, sep, name = path.rpartition("/")
    stem, dot, _ = name.rpartition(".")
    return f"{head}{sep}{stem if dot and stem else name}{suffix}"


def _table_peak(trainer: pl.Trainer) -> float | None:
    """Lightning's peak-FLOPs table for the CUDA device and the trainer's precision (None elsewhere or unknown)."""
    device = trainer.strategy.root_device
    if device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    try:
        return get_available_flops(device, precision_dtype(str(trainer.precision)))
    except Exception:
        return None


def _ranks_per_batch(trainer: pl.Trainer) -> int:
    """How many ranks train on each batch together: the ranks of one tensor-parallel group or one pipeline.

    They all see their group's batch in the hooks (the same one read by each, or the one gathered from their parts
    with ``batch_split="world"``), so the samples summed over ranks count it that many times. Read from the device
    mesh of Lightning's ``ModelParallelStrategy`` (``ShardedStrategy`` too): the ranks outside its ``"data_parallel"``
    dimension; from ``pipeline_size`` for ``PipelineStrategy`` (None: the whole world). 1 for DDP, FSDP, DeepSpeed
    and single-device strategies.
    """
    world = max(1, trainer.world_size)
    strategy = trainer.strategy
    share = 1
    try:
        mesh = getattr(strategy, "device_mesh", None)  # ModelParallelStrategy raises before the processes start
    except RuntimeError:
        mesh = None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None and "data_parallel" in names:
        share = int(mesh.size()) // max(1, int(mesh["data_parallel"].size()))
    elif hasattr(strategy, "pipeline_size"):
        share = int(strategy.pipeline_size or world)
    # a group size that does not divide the world is not one this rule knows: count every rank
    return share if 1 <= share <= world and world % share == 0 else 1


def _is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` already runs under ``torch.compile``: ``trainer.fit(torch.compile(model))`` (Lightning
    keeps the compiled forward on the module), a compiled submodule (an ``OptimizedModule`` child), or
    ``nn.Module.compile()`` in place."""
    if compat.lightning_compiled_forward(module) is not None:
        return True
    for m in module.modules():
        if compat.compiled_call_impl(m) is not None:
            return True
        # by class name: importing torch._dynamo to check isinstance costs seconds in a run that never compiled
        if any(c.__name__ == "OptimizedModule" for c in type(m).__mro__):
            return True
    return False


def _checkpoint_io_layers(io: Any) -> list[Any]:
    """``io`` and every checkpoint IO it wraps (``AsyncCheckpointIO(x)`` wraps ``x`` as its ``checkpoint_io``),
    outermost first."""
    layers: list[Any] = []
    while io is not None and not any(io is seen for seen in layers):
        layers.append(io)
        io = getattr(io, "checkpoint_io", None)
    return layers


def _log_dir(trainer: pl.Trainer) -> str | None:
    """``trainer.log_dir`` (a collective: call it on every rank), or ``default_root_dir`` when that is None."""
    return trainer.log_dir or trainer.default_root_dir or None


def _trainer_log_every_n_steps(trainer: pl.Trainer) -> int | None:
    """The trainer's ``log_every_n_steps`` (>= 1; 50 when unset), or None for ``Trainer(log_every_n_steps=0)``.

    0 is Lightning's "log no steps" (``barebones=True`` sets it): its own ``self.log`` step metrics,
    ``LearningRateMonitor`` and ``DeviceStatsMonitor`` then log nothing per step, and neither do the callbacks here
    (0 is not "unset").
    """
    # public, but set on the instance by Lightning's logger connector rather than declared on the class
    value = getattr(trainer, "log_every_n_steps", None)
    if value is None:
        return 50
    return None if int(value) == 0 else max(1, int(value))


def _num_workers(trainer: pl.Trainer) -> int | None:
    loader = trainer.train_dataloader
    n = getattr(loader, "num_workers", None)
    if n is None:
        flat = getattr(loader, "flattened", None)
        if flat:
            n = getattr(flat[0], "num_workers", None)
    return int(n) if n is not None else None


log = logging.getLogger(__name__)


class CudaMemoryManager(Callback):
    """Tune the CUDA caching allocator, log fragmentation, release cached blocks at safe points, snapshot on OOM.

    1. **Settings** (``expandable_segments``, ``max_split_size_mb``, ``garbage_collection_threshold``) are applied
       in ``__init__`` so that a callback built before the Trainer (the usual case, and LightningCLI's) acts before
       the first CUDA allocation: they go to ``PYTORCH_ALLOC_CONF`` and the allocator's runtime setter. If CUDA was
       already initialised, a warning says what did not take effect and how to fix it (:attr:`applied`).
    2. **Fragmentation** every ``log_every_n_steps`` optimizer steps, on the steps Lightning logs the run's own
       ``self.log`` metrics at (also in a resumed fit, a later fit of the same callback, and with gradient
       accumulation, where a window is that many optimizer steps): ``mem/allocated_gb``, ``mem/reserved_gb``,
       ``mem/fragmentation`` (1 - allocated/reserved), ``mem/inactive_split_gb``, ``mem/alloc_retries``,
       ``mem/ooms``, from ``torch.cuda.memory_stats()`` (a host-side read, no device sync).
    3. **Release** (optional): when fragmentation exceeds ``release_threshold`` on a pool of at least
       ``release_min_reserved_gb``, ``torch.cuda.empty_cache()`` runs at the end of a training batch (after the
       optimizer step, when no activations are alive), at most once per logging window.
    4. **OOM**: on ``torch.OutOfMemoryError``, the allocator's snapshot is written to
       ``<snapshot_dir>/oom_snapshot_rank<r>.pickle`` (``..._rank<r>-2.pickle`` and on when a file is already there:
       an earlier snapshot is never overwritten) and the error log says where it is and how to open it
       (https://pytorch.org/memory_viz). With ``record_history=True`` the snapshot also holds the stack trace of every
       allocation (costs a few µs per allocation; off by default).

    Without a CUDA device it says so in one info line (the allocator knobs do nothing there) and logs rank 0's host
    memory instead every ``log_every_n_steps``: ``mem/host_rss_gb`` (resident now) and ``mem/host_peak_rss_gb``.

    Args:
        expandable_segments: see :class:`~lightning_accel.perf.cuda_memory.AllocatorSettings` (None: leave as is).
        max_split_size_mb: blocks above this are never split (256: requests above 256 MB go to ``cudaMalloc``).
        garbage_collection_threshold: reclaim cached blocks above this fraction of device memory.
        log_every_n_steps: logging window (None: the trainer's ``log_every_n_steps``; its 0, "log no steps", logs
            nothing).
        release_threshold: fragmentation above which cached blocks are released (None: never).
        release_min_reserved_gb: only release when at least this much is reserved (>= 0).
        snapshot_dir: where OOM snapshots go, a local directory (a leading ``~`` is the home directory) or an fsspec
            URL (None: the trainer's ``log_dir`` or ``default_root_dir``). Checked here: never an existing file nor
            under one, never a URL whose scheme no installed fsspec filesystem handles, never blank (``""`` included).
        record_history: record allocation stack traces for richer snapshots.
        max_history_entries: ring-buffer size of the history when ``record_history`` (>= 1).
    """

    def __init__(
        self,
        *,
        expandable_segments: bool | None = True,
        max_split_size_mb: int | None = 256,
        garbage_collection_threshold: float | None = 0.8,
        log_every_n_steps: int | None = None,
        release_threshold: float | None = None,
        release_min_reserved_gb: float = 1.0,
        snapshot_dir: str | os.PathLike[str] | None = None,
        record_history: bool = False,
        max_history_entries: int = 100_000,
    ) -> None:
        super().__init__()
        log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, low=1, allow_none=True, fix=_WINDOW_FIX)
        release_threshold = check_number(
            "release_threshold",
            release_threshold,
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            allow_none=True,
            fix="E.g. 0.5 (a fragmentation fraction).",
        )
        release_min_reserved_gb = check_number(
            "release_min_reserved_gb", release_min_reserved_gb, low=0, fix="Use 0 to release at any pool size."
        )
        record_history = check_bool("record_history", record_history)
        max_history_entries = check_int(
            "max_history_entries", max_history_entries, low=1, fix="E.g. 100000 (allocations kept in the history)."
        )
        if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
            raise TypeError(
                f"`snapshot_dir` must be a directory path or URL (a string) or None, got {snapshot_dir!r} "
                f"({type(snapshot_dir).__name__})."
            )
        if snapshot_dir is not None and not os.fspath(snapshot_dir).strip():
            # `""` would silently mean the log directory, while `report_path=""` means "write nothing": refused, so that
            # neither reading is guessed
            raise ValueError(
                f"`snapshot_dir` must be a directory path or URL, got {os.fspath(snapshot_dir)!r}, which is blank. "
                "Pass a directory, e.g. 'oom_snapshots', or None for the trainer's log directory."
            )
        if math.isinf(release_min_reserved_gb):
            raise ValueError(
                f"`release_min_reserved_gb` must be a finite number >= 0, got {release_min_reserved_gb}. "
                "Pass `release_threshold=None` to never release cached blocks."
            )
        if snapshot_dir is not None:
            # an OOM snapshot is written when the fit fails: a file at the directory's place would lose it then
            local = os.path.expanduser(os.fspath(snapshot_dir))
            if local and not is_local_url(local):
                _check_protocol("snapshot_dir", local)
            elif local:
                if os.path.isfile(strip_file_scheme(local)):
                    raise ValueError(
                        f"`snapshot_dir` must be a directory, got {local!r}, an existing file. Pass a directory, e.g. "
                        f"{os.path.join(os.path.dirname(strip_file_scheme(local)), 'oom_snapshots')!r}."
                    )
                _check_no_file_above("snapshot_dir", safe_join(local, "x"), "oom_snapshots")
        self.settings = AllocatorSettings(expandable_segments, max_split_size_mb, garbage_collection_threshold)
        self.log_every_n_steps = log_every_n_steps
        self.release_threshold = release_threshold
        self.release_min_reserved_bytes = int(release_min_reserved_gb * (1 << 30))
        # `~` is the home directory (as for the report path and Lightning's checkpoint dirpath), not a folder named `~`
        self.snapshot_dir = os.path.expanduser(os.fspath(snapshot_dir)) if snapshot_dir is not None else None
        self.record_history = record_history
        self.max_history_entries = max_history_entries
        self.applied: AppliedSettings | None = None
        self.releases = 0
        self.snapshot_path: str | None = None
        self._every: int | None = 50  # None: the trainer logs no steps (`log_every_n_steps=0`)
        self._active = False
        self._cpu_noted = False
        self._step_before = 0  # trainer.global_step when the current batch started
        self._snapshot_root: str | None = None
        self._host = False  # no CUDA: log host memory
        if cuda_available():
            self._apply()

    def _apply(self) -> None:
        self.applied = apply_allocator_settings(self.settings)
        for msg in self.applied.messages:
            rank_zero_warn(f"CudaMemoryManager: {msg}")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        self._every = self.log_every_n_steps or _trainer_log_every_n_steps(trainer)
        if device.type != "cuda":
            self._active = False
            self._host = True
            if not self._cpu_noted:
                rank_zero_info(
                    f"CudaMemoryManager: no CUDA device in use ({device}): the allocator settings, releases and OOM "
                    "snapshots do nothing; logging this process's host memory instead (mem/host_rss_gb, "
                    "mem/host_peak_rss_gb)."
                )
                self._cpu_noted = True
            return
        self._host = False
        self._active = True
        # `trainer.log_dir` is a broadcast: resolve it now on every rank; an OOM reaches `on_exception` on one rank only
        self._snapshot_root = self.snapshot_dir or _log_dir(trainer) or os.getcwd()
        if self.applied is None:  # CUDA appeared after __init__ (unusual): apply now, reporting what is late
            self._apply()
        if self.record_history:
            compat.record_cuda_memory_history(self.max_history_entries)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._active and self.record_history:
            compat.stop_cuda_memory_history()
        self._active = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step

    def _due(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
        """The logger step to log at after this batch, or None: Lightning's own rule (the ``n``-th batch that steps
        the optimizer, ``n`` a multiple of the window), so the numbers land on the rows of the run's ``self.log``
        metrics in every fit of this instance, after a resume and with gradient accumulation (whose micro-batches
        before the optimizer step are not counted: a window is ``log_every_n_steps`` optimizer steps)."""
        if not _stepped(trainer, pl_module, self._step_before):
            return None  # an accumulation micro-batch: the optimizer did not step
        return compat.logger_step(trainer) if _log_due(trainer, self._every) else None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active and not self._host:
            return
        step = self._due(trainer, pl_module)
        if step is None:
            return
        if not self._active:
            if trainer.is_global_zero:
                host = host_memory_stats()
                for logger in trainer.loggers:
                    logger.log_metrics(host, step=step)
            return
        device = trainer.strategy.root_device
        frag = fragmentation_stats(torch.cuda.memory_stats(device))
        metrics = frag.as_metrics()
        # after the optimizer step of this batch nothing of the step is alive: a safe point to return cached blocks
        if should_release(frag, threshold=self.release_threshold, min_reserved_bytes=self.release_min_reserved_bytes):
            torch.cuda.empty_cache()
            self.releases += 1
            metrics["mem/releases"] = float(self.releases)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not self._active:
            return
        if _is_oom(exception):
            self._write_oom_snapshot()
        # Lightning calls no `teardown` of callbacks after an exception: stop the allocation history here, or every
        # later allocation of the process (a notebook, a retry) keeps paying for a stack trace
        try:
            self.teardown(trainer, pl_module, "fit")
        except Exception as e:  # never mask the exception that stopped the fit
            log.error("CudaMemoryManager: stopping the allocation history failed: %r", e)

    def _write_oom_snapshot(self) -> None:
        root = self._snapshot_root or self.snapshot_dir or os.getcwd()
        try:
            path = _free_snapshot_path(os.fspath(root), global_rank())
            self.snapshot_path = dump_memory_snapshot(path)
        except Exception as e:  # never mask the OOM itself
            log.error("CudaMemoryManager: out of memory, and writing the memory snapshot under %s failed: %r", root, e)
            return
        hint = "" if self.record_history else " Pass record_history=True to include allocation stack traces."
        log.error(
            "CudaMemoryManager: out of memory. Allocator snapshot written to %s: open it at "
            "https://pytorch.org/memory_viz (drag the file in) to see which tensors held the memory.%s",
            self.snapshot_path,
            hint,
        )


def _free_snapshot_path(root: str, rank: int) -> str:
    """``<root>/oom_snapshot_rank<r>.pickle``, or ``..._rank<r>-2.pickle``, ``-3``, ... when that is taken: a snapshot
    of an earlier out-of-memory error (another fit in this process, another run into the same ``snapshot_dir``) or a
    file of the user's is never overwritten. String joins: ``root`` may be a URL."""
    store = FileStore(retries=0)
    stem = f"oom_snapshot_rank{rank}"
    n = 1
    while True:
        path = safe_join(root, f"{stem}{'' if n == 1 else f'-{n}'}.pickle")
        try:
            taken = store.exists(path)
        except Exception:  # a store that cannot be asked may still take the write: the write says what is wrong
            return path
        if not taken:
            return path
        n += 1


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


#: pid -> the largest ``keep_freed_bytes`` HostMemoryManager has reported in that process (0: that the setting cannot
#: apply); the pid tells a forked child, which has its parent's copy, that it has reported nothing yet
_HOST_MEMORY_SAID: dict[int, int] = {}


class HostMemoryManager(Callback):
    """Keep freed host memory in every training process instead of handing it back to the OS each step (glibc).

    A CPU training step allocates and frees the same activations, gradients and optimizer temporaries every time.
    Under glibc's defaults ``malloc`` serves large blocks with a fresh ``mmap`` and unmaps them when freed, and hands a
    free heap top above its trim threshold back to the kernel; both thresholds start at 128 KiB and adapt only part of
    the way. So every step faults those pages in again, each one zero-filled by the kernel. Measured on the end-to-end
    CPU job's model (``SmallResNet``, batch 16 at 64 px, one thread): ~4-9k page faults per step in fp32, ~1k in bf16
    with channels_last, against ~0-100 with freed memory kept (``docs/performance.md`` has the step times).

    In ``setup`` (every process of every rank, before the first step; also the processes ``ddp_spawn`` starts) it
    raises glibc's thresholds with ``mallopt``: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap
    and are reused, and up to ``keep_freed_bytes`` of freed heap stays in the process. The same setting the cache
    applies in its cold pass's workers (``lightning_accel/_utils/malloc.py``).

    The cost is memory: a process's resident size stays near its peak between steps, up to ``keep_freed_bytes`` more
    than it would. The setting lasts for the process's life (glibc cannot read it back to restore it) and is inherited
    by the DataLoader workers it forks. Where the C library is not glibc (macOS, musl) one info line says so and nothing
    changes. Either line is logged once per process and setting, on global rank 0 (``setup`` runs at every stage; a
    smaller setting than one applied already changes nothing and is not logged). On CUDA it changes host-side
    allocations only (the CUDA caching allocator, pinned memory included, is :class:`CudaMemoryManager`'s).

    Args:
        keep_freed_bytes: freed heap memory each process keeps, at least 32 MiB (an integer, or a string such as
            ``"256MiB"``): a smaller trim threshold would hand back the blocks the 32 MiB mmap threshold keeps on the
            heap.

    Attributes:
        applied: None before ``setup``; then whether glibc took the setting in this process.
    """

    def __init__(self, keep_freed_bytes: int | str = "256MiB") -> None:
        super().__init__()
        self.keep_freed_bytes: int = check_bytes(
            "keep_freed_bytes",
            keep_freed_bytes,
            low=MMAP_THRESHOLD,
            fix="Use at least '32MiB' (glibc's largest mmap threshold), e.g. '256MiB'.",
        )
        self.applied: bool | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.applied = keep_freed_memory(self.keep_freed_bytes)
        # `setup` runs at every stage (fit, validate, test, predict) and for every Trainer: the line is said once per
        # process and setting (on global rank 0), not before each of them; a smaller setting than one said already
        # changes nothing (glibc keeps the larger, see `keep_freed_memory`) and is not said either
        pid, kept = os.getpid(), self.keep_freed_bytes if self.applied else 0
        if pid in _HOST_MEMORY_SAID and kept <= _HOST_MEMORY_SAID[pid]:
            return
        _HOST_MEMORY_SAID[pid] = kept
        if self.applied:
            rank_zero_info(
                f"HostMemoryManager: each training process keeps up to {self.keep_freed_bytes / 2**20:.0f} MiB of "
                "freed host memory (glibc malloc), so steps stop faulting their memory in again."
            )
        else:
            rank_zero_info("HostMemoryManager: the C library is not glibc; host memory is left as it is.")
