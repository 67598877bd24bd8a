"""The harness' Lightning measures (re-exported by ``benchmarks/_harness.py``): :class:`StepClock` times steps,
epochs and checkpoint saves; :class:`MemoryProbe` reads the CUDA allocator after every step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_accel._utils.checks import check_choice, check_int

__all__ = ["MemoryProbe", "StepClock"]


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class StepClock(Callback):
    """Wall seconds of every training step (or epoch), or of any section the caller brackets (a checkpoint save).

    As a callback, ``per="step"``: a step lasts from the previous step's end (the first step: its
    ``on_train_batch_start``) to its ``on_train_batch_end``, so it holds the loop's own work between steps (data
    loading, hooks); ``per="epoch"``: from ``on_train_epoch_start`` to ``on_train_epoch_end`` (validation and the
    checkpoint saves of the epoch included). Used by hand, :meth:`now` reads the clock and :meth:`record` adds a
    section's seconds.

    Every reading synchronises CUDA first when ``sync`` is true (``None``: when this process has initialised CUDA),
    so queued kernels count in the step that queued them.

    Args:
        per: ``"step"`` or ``"epoch"``.
        skip: warm-up: the first ``skip`` intervals are in :attr:`marks` but not in :attr:`times`.
        sync: synchronise CUDA before each reading; ``None``: when CUDA is initialised.
        count: ``batch -> samples``; their sum per interval goes to :attr:`samples` (``None``: not counted).

    Attributes:
        times: seconds of every interval after the warm-up.
        marks: ``perf_counter()`` at the end of every step or epoch, warm-up included.
        samples: samples of every interval after the warm-up (with ``count``).
        started: ``perf_counter()`` at ``on_train_start`` (``None`` before).
    """

    def __init__(
        self,
        *,
        per: Literal["step", "epoch"] = "step",
        skip: int = 0,
        sync: bool | None = None,
        count: Callable[[Any], int] | None = None,
    ) -> None:
        self.per = check_choice("per", per, ("step", "epoch"))
        self.skip = check_int("skip", skip, low=0)
        self.sync, self.count = sync, count
        self.times: list[float] = []
        self.marks: list[float] = []
        self.samples: list[int] = []
        self.started: float | None = None
        self._seen = 0
        self._t0: float | None = None
        self._n = 0

    def now(self) -> float:
        """``time.perf_counter()``, after ``torch.cuda.synchronize()`` when synchronising."""
        if self.sync or (self.sync is None and _cuda_in_use()):
            torch.cuda.synchronize()
        return time.perf_counter()

    def record(self, seconds: float, samples: int = 0) -> None:
        """Add one interval measured by the caller; the first ``skip`` are warm-up and not kept."""
        self._seen += 1
        if self._seen > self.skip:
            self.times.append(seconds)
            if self.count is not None:
                self.samples.append(samples)

    def rebase(self) -> None:
        """The time since the last mark belongs to no interval: move the last mark, and the next start, to now."""
        t = self.now()
        if self.marks:
            self.marks[-1] = t
        self._t0 = t

    def _close(self) -> None:
        t = self.now()
        if self._t0 is not None:
            self.record(t - self._t0, self._n)
        self.marks.append(t)
        self._t0, self._n = (t if self.per == "step" else None), 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = self.now()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.per == "epoch":
            self._t0, self._n = self.now(), 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.per == "step" and self._t0 is None:
            self._t0 = self.now()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.count is not None:
            self._n += self.count(batch)
        if self.per == "step":
            self._close()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.per == "epoch":
            self._close()


class MemoryProbe(Callback):
    """The CUDA caching allocator after every training step: fragmentation and inactive split bytes.

    Place it after a :class:`StepClock` in the callbacks list: the clock's synchronisation then precedes the reading.

    Attributes:
        frag: ``fragmentation`` of every step (see ``lightning_accel.perf.cuda_memory.fragmentation_stats``).
        inactive_split: inactive split bytes of every step.
    """

    def __init__(self) -> None:
        from lightning_accel.perf.cuda_memory import fragmentation_stats

        self._stats = fragmentation_stats
        self.frag: list[float] = []
        self.inactive_split: list[int] = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self._stats(torch.cuda.memory_stats())
        self.frag.append(stats.fragmentation)
        self.inactive_split.append(stats.inactive_split)
