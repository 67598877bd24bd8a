"""Clocks that mark points in time and turn two marks into seconds: the host's wall clock, or CUDA events.

Shared by the rooms that time training steps (``perf``'s step-time breakdown, ``comm``'s measured choices): on CUDA a
host clock read at the end of a step misses the kernels still queued, and a synchronisation per step would cost the
host/device overlap the measurement is about, so intervals there are CUDA events resolved when they are needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Clock", "CudaEventClock", "HostClock"]


class Clock(Protocol):
    """Marks points in time; :meth:`elapsed` turns two marks into seconds (it may block until ``end`` happened)."""

    def mark(self) -> Any: ...

    def elapsed(self, start: Any, end: Any) -> float: ...


class HostClock:
    """Host wall clock (``time.perf_counter`` by default; pass any ``() -> float`` for tests)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now

    def mark(self) -> float:
        return self._now()

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """CUDA events recorded on the current stream: intervals on the GPU timeline, resolved without a per-step sync.

    Args:
        device: the CUDA device whose current stream is marked.
    """

    def __init__(self, device: Any = None) -> None:
        import torch

        self._torch = torch
        self._device = device

    def mark(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record(self._torch.cuda.current_stream(self._device))
        return ev

    def elapsed(self, start: Any, end: Any) -> float:
        end.synchronize()  # returns at once when `end` has happened (all but the newest mark of a batch of them)
        return start.elapsed_time(end) / 1000.0
