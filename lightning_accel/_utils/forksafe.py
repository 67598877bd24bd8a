"""A thread lock that a forked child always gets unlocked.

``os.fork`` copies a lock in whatever state it is: when a background thread (an origin read, a shard download, a
statistics update) holds it at that moment, the child's copy stays locked forever, because the thread that would
release it does not exist in the child. DataLoader workers are forked at any time, so every lock those threads take
is a :class:`ForkSafeLock`: each process lazily creates its own underlying lock.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """``threading.Lock`` (``RLock`` with ``reentrant=True``) that is fresh in every process; pickles as a new one."""

    __slots__ = ("_lock", "_pid", "_reentrant")

    def __init__(self, reentrant: bool = False) -> None:
        self._reentrant = reentrant
        self._pid = -1
        self._lock: Any = None

    def _get(self) -> Any:
        pid = os.getpid()
        if self._pid != pid:  # first use in this process (a forked child starts with one thread: no race)
            self._lock = threading.RLock() if self._reentrant else threading.Lock()
            self._pid = pid
        return self._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self._get().acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> ForkSafeLock:
        self._get().acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __getstate__(self) -> dict[str, Any]:
        return {"reentrant": self._reentrant}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["reentrant"])  # type: ignore[misc]
