"""Background saving: snapshot on the caller's thread, encode and write on one worker thread, bounded, never lose an
error.

Contract:

1. :func:`snapshot` copies every tensor of a checkpoint to private CPU memory *synchronously* (a GPU tensor is copied
   device-to-host; a CPU tensor is cloned), so optimizer steps that run while the save is in flight cannot race it.
   Cloning is much cheaper than encoding + writing, which is what moves off the training loop (the stall per save is
   measured by ``benchmarks/delta_checkpoint.py``).
2. :class:`BackgroundWriter` runs jobs (saves *and* removals) on a single worker thread in submission order, so a
   ``remove`` that ModelCheckpoint issues after a ``save`` can never overtake it.
3. **Backpressure.** At most ``max_pending`` *bounded* jobs (saves: each holds a snapshot of the whole checkpoint)
   are queued or running at once. A bounded job submitted with a ``key`` (the checkpoint path) first *coalesces* with
   a queued, not yet started job of the same key when no later job touches that key: the newer snapshot replaces the
   older one, which would only have been overwritten (``last.ckpt`` saved every step). Otherwise the caller waits for
   a slot; the wait is counted in :attr:`BackgroundWriter.stats` (``stalls``, ``stall_s``). Memory is therefore at
   most ``max_pending`` snapshots, ``close`` waits for at most ``max_pending`` saves, and a killed process loses at
   most those. Without the bound, ``every_n_train_steps=1`` queues saves (and snapshots) without limit
   (``pending_peak`` in ``benchmarks/delta_checkpoint.py``).
   Removals are unbounded (they hold no tensors) but still ordered.
4. The worker thread runs at a lower CPU priority (``nice`` + 10 on Linux), so on a busy machine the training
   threads keep the cores and the save finishes in their gaps.
5. A job's exception is kept and raised by the next :meth:`BackgroundWriter.submit`, :meth:`~BackgroundWriter.wait`
   or :meth:`~BackgroundWriter.close` — never swallowed. Jobs after a failure still run (each save publishes its
   manifest last, so a failed save leaves earlier checkpoints intact).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from lightning_accel._utils.checks import check_int
from lightning_accel._utils.forksafe import PerProcess

__all__ = ["BackgroundWriter", "WriterStats", "snapshot"]


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are private CPU copies (containers rebuilt, other leaves shared)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = snapshot(v)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def _lower_thread_priority(increment: int = 10) -> None:
    """Run this thread at ``nice + increment`` (Linux: ``setpriority`` on a thread id affects that thread only), so
    encoding competes less with the training threads for the CPU; a no-op where unsupported."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (AttributeError, OSError):
        pass


@dataclass
class WriterStats:
    """What the writer did so far (this process).

    Attributes:
        submitted: bounded jobs (saves) submitted.
        coalesced: saves that replaced a queued save of the same path instead of queueing.
        stalls: saves that had to wait for a slot.
        stall_s: seconds callers waited for a slot in total.
        pending_peak: most bounded jobs queued or running at once.
    """

    submitted: int = 0
    coalesced: int = 0
    stalls: int = 0
    stall_s: float = 0.0
    pending_peak: int = 0


class _Job:
    __slots__ = ("args", "bounded", "fn", "future", "key", "started")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], key: str | None, bounded: bool) -> None:
        self.fn, self.args, self.key, self.bounded = fn, args, key, bounded
        self.future: Future = Future()
        self.started = False


class _Jobs:
    """One process's queue, worker thread, counters and first unreported error."""

    __slots__ = ("bounded", "cond", "error", "queue", "running", "stats", "thread", "unfinished")

    def __init__(self) -> None:
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.bounded = 0  # bounded jobs queued or running
        self.unfinished = 0  # all jobs queued or running
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.cond = threading.Condition()
        self.stats = WriterStats()


class BackgroundWriter:
    """One worker thread that runs submitted jobs in order, at most ``max_pending`` saves at a time, and re-raises
    their first unreported error.

    The thread and its queue are per process (:class:`~lightning_accel._utils.forksafe.PerProcess`): a pickled or
    forked copy starts with none (a forked child would otherwise queue behind a thread it does not have).

    Args:
        name: the worker thread's name.
        max_pending: most bounded jobs (saves) queued or running at once (>= 1).
        nice: CPU priority increment of the worker thread (0: the caller's priority). On a machine shared with other
            processes a niced worker gets little CPU, so a caller waiting for a slot waits longer.
    """

    def __init__(self, name: str = "delta-checkpoint", *, max_pending: int = 2, nice: int = 10) -> None:
        check_int(
            "max_pending",
            max_pending,
            low=1,
            fix="It counts saves in flight at once: 1 for the least memory, 2 (the default) to overlap a save with "
            "the next snapshot.",
        )
        self._name = name
        self.max_pending = max_pending
        self.nice = nice
        self._jobs: PerProcess[_Jobs] = PerProcess(_Jobs)

    # ---- worker ------------------------------------------------------------------------------------------------
    def _run(self, jobs: _Jobs) -> None:
        if self.nice:
            _lower_thread_priority(self.nice)
        while True:
            with jobs.cond:
                while True:
                    if jobs.thread is not threading.current_thread():  # closed (or replaced after a fork)
                        return
                    if jobs.queue:
                        break
                    jobs.cond.wait()
                job = jobs.queue.popleft()
                job.started = True
                jobs.running = job
            try:
                result = job.fn(*job.args)
            except BaseException as e:  # kept for the caller: raised at the next submit / wait / close
                job.future.set_exception(e)
                with jobs.cond:
                    if jobs.error is None:
                        jobs.error = e
            else:
                job.future.set_result(result)
            finally:
                job.args = ()  # drop the snapshot now, not when the future is collected
                with jobs.cond:
                    jobs.running = None
                    jobs.unfinished -= 1
                    if job.bounded:
                        jobs.bounded -= 1
                    jobs.cond.notify_all()

    def _ensure_thread(self, jobs: _Jobs) -> None:
        if jobs.thread is None or not jobs.thread.is_alive():
            jobs.thread = threading.Thread(target=self._run, args=(jobs,), name=self._name, daemon=True)
            jobs.thread.start()

    def _raise(self, jobs: _Jobs) -> None:
        with jobs.cond:
            err, jobs.error = jobs.error, None
        if err is not None:
            raise err

    # ---- public ------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._jobs.get().unfinished

    @property
    def stats(self) -> WriterStats:
        """Counters of this process's writer (submitted, coalesced, stalls, stall seconds, peak pending saves)."""
        return self._jobs.get().stats

    def submit(self, fn: Callable[..., Any], *args: Any, key: str | None = None, bounded: bool = False) -> Future:
        """Queue ``fn(*args)``; first raise the error of any earlier job that failed.

        Args:
            fn: the job.
            *args: its arguments (a save's snapshot: dropped as soon as the job ran).
            key: what the job writes or removes (the checkpoint path): a bounded job coalesces with a queued,
                unstarted job of the same key that no later job touches.
            bounded: counts against ``max_pending`` (a save); the call waits for a slot when all are taken.

        Returns:
            The job's future (a coalesced save returns the future of the job it joined).
        """
        jobs = self._jobs.get()
        self._raise(jobs)
        with jobs.cond:
            self._ensure_thread(jobs)
            if bounded:
                jobs.stats.submitted += 1
                joined = self._coalesce(jobs, fn, args, key)
                if joined is not None:
                    return joined
                if jobs.bounded >= self.max_pending:
                    t0 = time.perf_counter()
                    while jobs.bounded >= self.max_pending:
                        jobs.cond.wait()
                        joined = self._coalesce(jobs, fn, args, key)
                        if joined is not None:
                            jobs.stats.stalls += 1
                            jobs.stats.stall_s += time.perf_counter() - t0
                            return joined
                    jobs.stats.stalls += 1
                    jobs.stats.stall_s += time.perf_counter() - t0
            job = _Job(fn, args, key, bounded)
            jobs.queue.append(job)
            jobs.unfinished += 1
            if bounded:
                jobs.bounded += 1
                jobs.stats.pending_peak = max(jobs.stats.pending_peak, jobs.bounded)
            jobs.cond.notify_all()
            return job.future

    @staticmethod
    def _coalesce(jobs: _Jobs, fn: Callable[..., Any], args: tuple[Any, ...], key: str | None) -> Future | None:
        """Under ``jobs.cond``: replace the arguments of the last queued job of ``key`` if it is an unstarted bounded
        job of the same function (no later job touches ``key``); return its future, or None."""
        if key is None:
            return None
        for job in reversed(jobs.queue):
            if job.key != key:
                continue
            if job.bounded and not job.started and job.fn == fn:
                job.args = args
                jobs.stats.coalesced += 1
                return job.future
            return None  # a removal (or another kind of job) of this key is queued last: keep the order
        return None

    def wait(self) -> None:
        """Block until every queued job has finished; raise the first error among them."""
        jobs = self._jobs.get()
        with jobs.cond:
            while jobs.unfinished:
                jobs.cond.wait()
        self._raise(jobs)

    def close(self) -> None:
        """:meth:`wait`, then stop the worker thread (a later :meth:`submit` starts a new one)."""
        jobs = self._jobs.get()
        try:
            self.wait()
        finally:
            with jobs.cond:
                thread, jobs.thread = jobs.thread, None
                jobs.cond.notify_all()
            if thread is not None and thread is not threading.current_thread():
                thread.join()
