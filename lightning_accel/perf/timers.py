"""Where training-step time goes: a hook-driven timer with injectable clocks.

The training loop alternates two segments, and :class:`StepTimer` is told when each one starts:

1. the **gap** from the end of one training batch to the start of the next. When the timer is told where the loop
   starts fetching the next batch (:meth:`StepTimer.fetch_start`: the dataloader's ``next()``, or an epoch's new
   iterator), the gap splits there: before it the loop runs its own bookkeeping (the hooks of callbacks that come
   after the monitor, logging, progress bars, LR schedulers, DDP's per-batch signal check), charged to ``other``;
   from it on the loop waits for the batch (``next()``, worker IPC, pinning, host-to-device copy): ``data``. Without
   that mark the whole gap counts as ``data``;
2. the **step** from the start of a batch to its end: forward, backward, optimizer step, counted as ``compute``.

Work that happens inside either segment but is not data or compute (validation, checkpoint saves) is bracketed with
:meth:`StepTimer.begin` / :meth:`StepTimer.end`; its time is charged to its own category and subtracted from the
enclosing segment (spans nest: a save inside validation is charged to ``checkpoint``, not twice). Communication
measured elsewhere (e.g. DDP's own runtime statistics) is moved from ``compute`` to ``comm`` with :meth:`move`.

Segment boundaries are read from a :class:`Clock`. On the CPU that is ``time.perf_counter``. On CUDA it is a pair of
CUDA events per boundary (:class:`CudaEventClock`), so intervals are measured on the GPU's timeline: the gap then
means "the GPU had nothing to do" (starvation), not "the host waited" (a host that runs ahead of the GPU waits inside
``next()`` while the GPU is still busy, which is not a bottleneck). Event intervals are resolved lazily in
:meth:`StepTimer.flush`, which waits for the last event only: one synchronisation per flush, never per step.
Spans (validation, saves) are always timed on the host clock; they synchronise anyway.

Overhead: per step two or three ``clock.mark()`` calls and a list append or two; ``benchmarks/monitor_overhead.py``
measures what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_accel._utils.checks import check_choice, check_int
from lightning_accel._utils.clocks import Clock, CudaEventClock, HostClock

__all__ = ["CATEGORIES", "Clock", "CudaEventClock", "HostClock", "StepTimer", "TimerTotals"]

#: Categories of step time, in report order. ``eval`` is validation run inside ``fit``; ``other`` is the loop's own
#: work between a batch's end and the fetch of the next one (hooks of later callbacks, logging, schedulers).
CATEGORIES: tuple[str, ...] = ("data", "compute", "comm", "checkpoint", "eval", "other")


@dataclass
class TimerTotals:
    """Accumulated seconds per category, counted steps, samples and tokens."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    steps: int = 0
    samples: int = 0
    tokens: int = 0

    @property
    def wall(self) -> float:
        """Sum over categories: the wall time of the counted part of the training loop."""
        return sum(self.seconds.values())

    def add(self, other: TimerTotals) -> None:
        """Add ``other`` into this one."""
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.steps += other.steps
        self.samples += other.samples
        self.tokens += other.tokens


class StepTimer:
    """Attributes training-loop time to :data:`CATEGORIES` from hook calls; see the module docstring.

    Contract: call :meth:`batch_start` / :meth:`batch_end` around every training batch, :meth:`begin` /
    :meth:`end` around validation and saves, :meth:`flush` when you want numbers (it returns the window since the
    previous flush and adds it to :attr:`totals`), and :meth:`stop` when the loop ends (the trailing gap is dropped:
    nothing waits for a batch that never comes).

    Args:
        clock: marks segment boundaries (``HostClock()`` or ``CudaEventClock()``).
        span_clock: times :meth:`begin`/:meth:`end` spans (host clock; injectable for tests).
        skip_steps: the first ``skip_steps`` steps and the gaps before them are not counted (warm-up: allocator,
            autotuning, worker start-up, the one-off FLOP count).
    """

    def __init__(self, clock: Clock | None = None, span_clock: Clock | None = None, skip_steps: int = 1) -> None:
        check_int("skip_steps", skip_steps, low=0)
        self.clock: Clock = clock if clock is not None else HostClock()
        self.span_clock: Clock = span_clock if span_clock is not None else HostClock()
        self.skip_steps = skip_steps
        self.totals = TimerTotals()
        self.seen_steps = 0  # all batch_end calls, counted or not
        self._window = TimerTotals()
        self._window_syncs = 0  # counted steps of the window that synchronised gradients (see batch_end)
        # pending (category, start mark, end mark, seconds to subtract); resolved in flush()
        self._pending: list[tuple[str, Any, Any, float]] = []
        self._seg: str | None = None  # "gap" | "step" | None
        self._seg_mark: Any = None
        self._seg_excluded = 0.0
        self._fetch_mark: Any = None  # where the open gap's fetch started (see fetch_start), or None
        self._other_excluded = 0.0  # span seconds of the open gap before its fetch started
        self._spans: list[list[Any]] = []  # stack of [category, start mark, excluded seconds]

    # -- segments -------------------------------------------------------------------------------------------------
    def _counting(self) -> bool:
        return self.seen_steps >= self.skip_steps

    def batch_start(self) -> None:
        """A training batch is about to run: closes the data gap (if one is open) and opens a step."""
        now = self.clock.mark()
        if self._seg == "gap" and self._counting():
            if self._fetch_mark is None:
                self._pending.append(("data", self._seg_mark, now, self._seg_excluded))
            else:
                self._pending.append(("other", self._seg_mark, self._fetch_mark, self._other_excluded))
                self._pending.append(("data", self._fetch_mark, now, self._seg_excluded))
        self._seg, self._seg_mark, self._seg_excluded = "step", now, 0.0
        self._fetch_mark, self._other_excluded = None, 0.0

    def fetch_start(self) -> None:
        """The loop starts getting the next batch: the open gap's time so far was the loop's own work (``other``),
        its time from here to :meth:`batch_start` is ``data``. Only the first call of a gap marks it; outside a gap
        it does nothing (a ``training_step`` that draws from ``dataloader_iter`` fetches inside its step, which stays
        ``compute``). Spans that closed before it are subtracted from ``other``, later ones from ``data``."""
        if self._seg != "gap" or self._fetch_mark is not None:
            return
        self._fetch_mark = self.clock.mark()
        self._other_excluded, self._seg_excluded = self._seg_excluded, 0.0

    def batch_end(self, samples: int = 0, tokens: int = 0, *, synced: bool = True) -> None:
        """The batch's optimizer step is done: closes the step and opens the data gap.

        Args:
            samples: samples in the batch.
            tokens: tokens in the batch.
            synced: whether the batch synchronised gradients across processes. ``False`` for a gradient-accumulation
                micro-batch (DDP's ``no_sync``: nothing is sent), so a per-synchronisation cost is charged
                :attr:`window_sync_steps` times, not once per step.
        """
        now = self.clock.mark()
        if self._seg == "step" and self._counting():
            self._pending.append(("compute", self._seg_mark, now, self._seg_excluded))
            self._window.steps += 1
            self._window.samples += int(samples)
            self._window.tokens += int(tokens)
            self._window_syncs += int(synced)
        self.seen_steps += 1
        self._seg, self._seg_mark, self._seg_excluded = "gap", now, 0.0
        self._fetch_mark, self._other_excluded = None, 0.0

    def stop(self) -> None:
        """The loop ended: drop the open gap (and any unclosed span) without counting it."""
        self._seg, self._seg_mark, self._seg_excluded = None, None, 0.0
        self._fetch_mark, self._other_excluded = None, 0.0
        self._spans.clear()

    # -- spans ----------------------------------------------------------------------------------------------------
    def begin(self, category: str) -> None:
        """Start a span charged to ``category`` (``"eval"``, ``"checkpoint"``, ...); spans may nest."""
        if category not in CATEGORIES:
            check_choice("category", category, CATEGORIES)
        self._spans.append([category, self.span_clock.mark(), 0.0])

    def end(self, category: str) -> float:
        """Close the innermost span, which must be ``category``; returns its seconds (0 if none is open)."""
        if not self._spans or self._spans[-1][0] != category:
            return 0.0  # e.g. validation's sanity check began before the timer existed
        cat, start, inner = self._spans.pop()
        total = max(0.0, self.span_clock.elapsed(start, self.span_clock.mark()))
        own = max(0.0, total - inner)
        if self._spans:
            self._spans[-1][2] += total  # the enclosing span does not count this time again
        else:
            self._seg_excluded += total
        if self._counting():
            self._window.seconds[cat] += own
        return own

    def move(self, seconds: float, *, src: str, dst: str) -> float:
        """Move up to ``seconds`` of the current window's ``src`` time to ``dst`` (e.g. exposed comm out of compute).

        Pending intervals are resolved first (as :meth:`flush` does: at most one wait, for the newest CUDA event), so
        the amount is capped at what ``src`` holds and no category goes negative; call it just before :meth:`flush`.

        Args:
            seconds: how much to move (nothing happens when it is <= 0).
            src: the category the time was counted in.
            dst: the category it belongs to.

        Returns:
            The seconds actually moved.

        Raises:
            ValueError: ``src`` or ``dst`` is not one of :data:`CATEGORIES`.
        """
        for name, c in (("src", src), ("dst", dst)):
            if c not in CATEGORIES:
                check_choice(name, c, CATEGORIES, fix="It names a timer category.")
        if seconds <= 0:
            return 0.0
        self._resolve()
        moved = min(seconds, max(0.0, self._window.seconds[src]))
        self._window.seconds[src] -= moved
        self._window.seconds[dst] += moved
        return moved

    @property
    def window_steps(self) -> int:
        """Steps counted since the previous :meth:`flush` (e.g. to turn a per-step cost into a :meth:`move`)."""
        return self._window.steps

    @property
    def window_sync_steps(self) -> int:
        """Counted steps since the previous :meth:`flush` that synchronised gradients (``batch_end(synced=True)``):
        what a per-synchronisation cost, such as DDP's mean exposed allreduce time, is multiplied by."""
        return self._window_syncs

    # -- results --------------------------------------------------------------------------------------------------
    def _resolve(self) -> None:
        """Turn pending (start, end) marks into seconds of the window (blocks on the newest CUDA event only)."""
        for cat, a, b, excluded in self._pending:
            self._window.seconds[cat] += max(0.0, self.clock.elapsed(a, b) - excluded)
        self._pending.clear()

    def flush(self) -> TimerTotals:
        """Resolve pending intervals (at most one wait, for the newest CUDA event) and return the window since the
        previous flush; the window is also added to :attr:`totals`."""
        self._resolve()
        window, self._window = self._window, TimerTotals()
        self._window_syncs = 0
        self.totals.add(window)
        return window
