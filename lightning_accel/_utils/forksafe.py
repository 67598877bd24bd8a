"""Per-process state that a forked child never inherits half-done, and that pickles without it.

``os.fork`` copies memory in whatever state it is: a lock held by a background thread (an origin read, a shard
download, a statistics update) stays locked forever in the child, because the thread that would release it does not
exist there; futures of the parent's thread pools never complete there; a writer thread's queue is never drained.
DataLoader workers are forked at any time, so such state lives in a :class:`PerProcess` (created lazily by a factory
in each process, and pickled as that factory), and locks are :class:`ForkSafeLock` s. That is the one rule: no
hand-written ``os.getpid()`` checks elsewhere.

What is not per-process but still must not travel in a pickle (a counter that restarts in the copy, like the bytes a
store has read) is named in :class:`ResetOnPickle` instead of a hand-written ``__getstate__``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["ForkSafeLock", "PerProcess", "ResetOnPickle", "cuda_available"]

_T = TypeVar("_T")


def cuda_available() -> bool:
    """Whether a CUDA device is visible, asked without initialising CUDA in this process where NVML can answer.

    ``torch.cuda.is_available()`` asks the CUDA runtime (``cuInit``) unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and a
    process that did so before ``fork`` leaves its children unable to use CUDA ("CUDA initialization error"): a
    plugin or callback constructed before ``Trainer.fit`` with a fork-based launcher (``strategy="ddp_notebook"`` /
    ``"ddp_fork"``) would break every rank. ``torch.cuda.device_count()`` asks NVML first, as Lightning's own
    ``CUDAAccelerator.is_available`` does. Use this wherever a constructor needs to know.
    """
    import torch

    return torch.cuda.device_count() > 0


# Serialises the first `get()` of every PerProcess in a process: two threads racing there would each build a value
# (two locks guarding one resource). Re-entrant because a factory may itself get() another PerProcess. A fork can
# happen while another thread holds it, so the child starts with a fresh one.
_creating = threading.RLock()


def _fresh_creating_lock() -> None:
    global _creating
    _creating = threading.RLock()


os.register_at_fork(after_in_child=_fresh_creating_lock)


class PerProcess(Generic[_T]):
    """``factory()`` made on first use in each process; ``get()`` returns this process's value.

    Pickles as its factory only (a spawned worker starts fresh too), so ``factory`` must be picklable (a class such as
    ``dict`` or ``threading.Lock``, or a module-level function).
    """

    __slots__ = ("_factory", "_pid", "_value")

    def __init__(self, factory: Callable[[], _T]) -> None:
        self._factory = factory
        self._pid = -1
        self._value: Any = None

    def get(self) -> _T:
        """This process's value, made by ``factory()`` on the first call in this process (once, even when several
        threads make that first call at the same time)."""
        pid = os.getpid()
        if self._pid != pid:
            with _creating:
                if self._pid != pid:  # another thread may have made it while this one waited
                    self._value = self._factory()
                    self._pid = pid  # published after the value: a reader that sees the pid sees the value
        return self._value

    def peek(self) -> _T | None:
        """This process's value if :meth:`get` already made it here, else ``None`` (never calls ``factory``).

        For "is there anything to flush/close in this process?" without creating it (a writer thread, a pool).
        """
        return self._value if self._pid == os.getpid() else None

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self._factory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["factory"])  # type: ignore[misc]  # re-running __init__ is how a copy starts fresh


class ForkSafeLock:
    """``threading.Lock`` (``RLock`` with ``reentrant=True``) that is fresh in every process; pickles as a new one."""

    __slots__ = ("_local",)

    def __init__(self, reentrant: bool = False) -> None:
        self._local: PerProcess[Any] = PerProcess(threading.RLock if reentrant else threading.Lock)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self._local.get().acquire(blocking, timeout))

    def release(self) -> None:
        self._local.get().release()

    def __enter__(self) -> ForkSafeLock:
        self._local.get().acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._local.get().release()

    def __getstate__(self) -> dict[str, Any]:
        return {"local": self._local}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._local = state["local"]


class ResetOnPickle:
    """Mixin: the attributes named in ``_reset_on_pickle`` take the given values in a pickled copy.

    For plain per-object fields whose meaning is "so far, in this process" and that pair with such a field of another
    object which also restarts when pickled (the cache's baseline of its store's byte counters). Per-process
    *resources* (handles, locks, threads, pools) belong in a :class:`PerProcess`, which also restarts after a fork.
    The values are shared by every copy, so use immutable ones (numbers, tuples, ``None``).

    Example::

        class Reader(ResetOnPickle):
            _reset_on_pickle = {"refetches": 0}
    """

    _reset_on_pickle: ClassVar[Mapping[str, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(self._reset_on_pickle)
        return state
