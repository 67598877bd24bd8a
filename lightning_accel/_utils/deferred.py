"""Checkpoint values still being produced: a strategy hands a background-writing CheckpointIO a :class:`Deferred`.

A strategy whose checkpoint holds every rank's state gathers it with a collective at each save. Done on the training
thread, rank 0 waits for the slowest rank and the collective's round trip on every save, although a background writer
encodes the checkpoint later anyway. Instead the strategy issues the collective asynchronously and puts a
:class:`Deferred` in the checkpoint; a CheckpointIO that declares ``resolves_deferred = True`` keeps it as it is in its
snapshot and calls :func:`resolve_deferred` on its writer thread before encoding. Any other CheckpointIO gets the
value itself (the strategy resolves it first), so the contract of ``CheckpointIO.save_checkpoint`` is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Deferred", "resolve_deferred", "resolves_deferred"]


class Deferred:
    """A value that ``produce()`` returns once the work behind it is done (a collective in flight).

    :meth:`result` calls ``produce`` once, from whichever thread asks first, and returns the same value (or raises
    the same error) to every later call.
    """

    __slots__ = ("_error", "_lock", "_produce", "_value")

    def __init__(self, produce: Callable[[], Any]) -> None:
        self._produce: Callable[[], Any] | None = produce
        self._value: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def result(self) -> Any:
        """The value (waiting for the work); the error ``produce`` raised, again, if it failed."""
        with self._lock:
            if self._produce is not None:
                produce, self._produce = self._produce, None
                try:
                    self._value = produce()
                except BaseException as e:
                    self._error = e
            if self._error is not None:
                raise self._error
            return self._value


def resolve_deferred(obj: Any) -> Any:
    """``obj`` with every :class:`Deferred` inside its dicts, lists and tuples replaced by its result (containers
    that hold none are returned as they are, not copied)."""
    if isinstance(obj, Deferred):
        return resolve_deferred(obj.result())
    if isinstance(obj, dict):
        items = {k: resolve_deferred(v) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        out = type(obj)() if type(obj) is not dict else {}
        out.update(items)
        return out
    if type(obj) in (list, tuple):
        items_l = [resolve_deferred(v) for v in obj]
        if all(a is b for a, b in zip(items_l, obj, strict=True)):
            return obj
        return type(obj)(items_l)
    return obj


def resolves_deferred(io: object) -> bool:
    """Whether the CheckpointIO ``io`` takes :class:`Deferred` values in a checkpoint and resolves them itself (on its
    writer thread)."""
    return getattr(io, "resolves_deferred", False) is True
