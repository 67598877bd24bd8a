"""Per-process state that a forked child never inherits half-done.

``os.fork`` copies memory in whatever state it is: a lock held by a background thread (an origin read, a shard
download, a statistics update) stays locked forever in the child, because the thread that would release it does not
exist there; futures of the parent's thread pools never complete there. DataLoader workers are forked at any time,
so such state lives in a :class:`PerProcess` (created lazily by a factory in each process), and locks are
:class:`ForkSafeLock` s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["ForkSafeLock", "PerProcess"]

_T = TypeVar("_T")


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
        pid = os.getpid()
        if self._pid != pid:  # first use in this process (a forked child starts with one thread: no race)
            self._value = self._factory()
            self._pid = pid
        return self._value

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self._factory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["factory"])  # type: ignore[misc]


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
