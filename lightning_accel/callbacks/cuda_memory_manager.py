"""``CudaMemoryManager``: PyTorch's caching allocator as a tuned memory pool, with fragmentation logging and OOM
snapshots. A thin Lightning adapter over :mod:`lightning_accel.perf.cuda_memory`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel._utils.rank import global_rank
from lightning_accel.perf.cuda_memory import (
    AllocatorSettings,
    AppliedSettings,
    apply_allocator_settings,
    dump_memory_snapshot,
    fragmentation_stats,
    should_release,
)

__all__ = ["CudaMemoryManager"]

log = logging.getLogger(__name__)


class CudaMemoryManager(Callback):
    """Tune the CUDA caching allocator, log fragmentation, release cached blocks at safe points, snapshot on OOM.

    1. **Settings** (``expandable_segments``, ``max_split_size_mb``, ``garbage_collection_threshold``) are applied
       in ``__init__`` so that a callback built before the Trainer (the usual case, and LightningCLI's) acts before
       the first CUDA allocation: they go to ``PYTORCH_ALLOC_CONF`` and the allocator's runtime setter. If CUDA was
       already initialised, a warning says what did not take effect and how to fix it (:attr:`applied`).
    2. **Fragmentation** every ``log_every_n_steps`` steps: ``mem/allocated_gb``, ``mem/reserved_gb``,
       ``mem/fragmentation`` (1 - allocated/reserved), ``mem/inactive_split_gb``, ``mem/alloc_retries``,
       ``mem/ooms``, from ``torch.cuda.memory_stats()`` (a host-side read, no device sync).
    3. **Release** (optional): when fragmentation exceeds ``release_threshold`` on a pool of at least
       ``release_min_reserved_gb``, ``torch.cuda.empty_cache()`` runs at the end of a training batch (after the
       optimizer step, when no activations are alive), at most once per logging window.
    4. **OOM**: on ``torch.OutOfMemoryError``, the allocator's snapshot is written to
       ``<snapshot_dir>/oom_snapshot_rank<r>.pickle`` and the error log says where it is and how to open it
       (https://pytorch.org/memory_viz). With ``record_history=True`` the snapshot also holds the stack trace of every
       allocation (costs a few µs per allocation; off by default).

    On a machine without CUDA it logs one info line and does nothing else.

    Args:
        expandable_segments: see :class:`~lightning_accel.perf.cuda_memory.AllocatorSettings` (None: leave as is).
        max_split_size_mb: blocks above this are never split (256: requests above 256 MB go to ``cudaMalloc``).
        garbage_collection_threshold: reclaim cached blocks above this fraction of device memory.
        log_every_n_steps: logging window (None: the trainer's ``log_every_n_steps``).
        release_threshold: fragmentation above which cached blocks are released (None: never).
        release_min_reserved_gb: only release when at least this much is reserved.
        snapshot_dir: where OOM snapshots go (None: the trainer's ``log_dir`` or ``default_root_dir``).
        record_history: record allocation stack traces for richer snapshots.
        max_history_entries: ring-buffer size of the history when ``record_history``.
    """

    def __init__(
        self,
        expandable_segments: bool | None = True,
        max_split_size_mb: int | None = 256,
        garbage_collection_threshold: float | None = 0.8,
        log_every_n_steps: int | None = None,
        release_threshold: float | None = None,
        release_min_reserved_gb: float = 1.0,
        snapshot_dir: str | None = None,
        record_history: bool = False,
        max_history_entries: int = 100_000,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"`log_every_n_steps` must be >= 1 or None, got {log_every_n_steps!r}.")
        if release_threshold is not None and not 0.0 < release_threshold < 1.0:
            raise ValueError(f"`release_threshold` must be in (0, 1) or None, got {release_threshold!r}; e.g. 0.5.")
        self.settings = AllocatorSettings(expandable_segments, max_split_size_mb, garbage_collection_threshold)
        self.log_every_n_steps = log_every_n_steps
        self.release_threshold = release_threshold
        self.release_min_reserved_bytes = int(release_min_reserved_gb * (1 << 30))
        self.snapshot_dir = snapshot_dir
        self.record_history = record_history
        self.max_history_entries = max_history_entries
        self.applied: AppliedSettings | None = None
        self.releases = 0
        self.snapshot_path: str | None = None
        self._every = 50
        self._active = False
        self._cpu_noted = False
        self._batches = 0
        if torch.cuda.is_available():
            self._apply()

    def _apply(self) -> None:
        self.applied = apply_allocator_settings(self.settings)
        for msg in self.applied.messages:
            rank_zero_warn(f"CudaMemoryManager: {msg}")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type != "cuda":
            self._active = False
            if not self._cpu_noted:
                rank_zero_info(f"CudaMemoryManager: no CUDA device in use ({device}); nothing to manage.")
                self._cpu_noted = True
            return
        self._active = True
        if self.applied is None:  # CUDA appeared after __init__ (unusual): apply now, reporting what is late
            self._apply()
        self._every = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps or 50))
        if self.record_history:
            torch.cuda.memory._record_memory_history(max_entries=self.max_history_entries)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._active and self.record_history:
            torch.cuda.memory._record_memory_history(enabled=None)
        self._active = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._batches += 1
        if self._batches % self._every != 0:
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
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not self._active or not _is_oom(exception):
            return
        root = self.snapshot_dir or trainer.log_dir or trainer.default_root_dir or os.getcwd()
        path = Path(root) / f"oom_snapshot_rank{global_rank()}.pickle"
        try:
            self.snapshot_path = dump_memory_snapshot(path)
        except Exception as e:  # never mask the OOM itself
            log.error("CudaMemoryManager: out of memory, and writing the memory snapshot to %s failed: %r", path, e)
            return
        hint = "" if self.record_history else " Pass record_history=True to include allocation stack traces."
        log.error(
            "CudaMemoryManager: out of memory. Allocator snapshot written to %s: open it at "
            "https://pytorch.org/memory_viz (drag the file in) to see which tensors held the memory.%s",
            self.snapshot_path,
            hint,
        )


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
