"""The lever protocol: what a speed lever (a strategy, a precision plugin, a checkpoint IO) exposes so that a guard can
tell when it switched on and switch it off again, without the lever's room importing the guard.

A lever is any object with:

- ``lever_name``: a short stable name (``"ddp_1bit"``, ``"fused"``, ``"quantized_checkpoint"``), used in logs and in
  the guard's saved state;
- ``lever_active``: whether the lever changes training *now* (1-bit: the compressed stage has begun; fused: fused
  modules compute through their fast path; quantized checkpoints: saves quantize deltas). A guard polls it to see
  when a lever switches on and watches the steps right after more strictly;
- ``switch_off(reason) -> bool``: fall back to the reference behaviour (fp32 averaging, the reference ops, lossless
  saves) from the next step on, and say whether anything changed (``False``: it was already off). It must be safe to
  call on every rank at the same step, and must not communicate.

Rooms implement it with plain methods; :func:`find_levers` collects the levers among a run's objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

__all__ = ["Lever", "find_levers"]


@runtime_checkable
class Lever(Protocol):
    """A speed lever that can be switched off (see the module docstring for the contract)."""

    lever_name: str

    @property
    def lever_active(self) -> bool:
        """Whether the lever changes training now."""
        ...

    def switch_off(self, reason: str) -> bool:
        """Fall back to the reference behaviour from the next step on; True if something changed."""
        ...


def find_levers(candidates: Iterable[object]) -> list[Lever]:
    """The distinct :class:`Lever` objects among ``candidates`` (None and non-levers skipped), in order."""
    out: list[Lever] = []
    for c in candidates:
        if c is not None and isinstance(c, Lever) and not any(c is o for o in out):
            out.append(c)
    return out
