"""The one place that replaces a method or attribute on a live object, and puts the original back.

A plugin sometimes has to wrap a method Lightning or torch calls on an object it does not own (``optimizer.step``,
``trainer.save_checkpoint``, ``module.forward``). Done ad hoc, each site restores its own way, a second install wraps
the wrapper, and an upgrade that renames the method passes silently. Here:

- :func:`patch` installs ``replacement`` as ``obj.<name>`` and returns a :class:`Patch`; the attribute must exist
  (``AttributeError`` names it otherwise, so an upstream rename fails loudly);
- installing the same ``key`` twice on one object is a no-op returning the live patch (idempotent hooks that run
  once per fit, or once per rank, cannot stack wrappers);
- :meth:`Patch.restore` puts back exactly what was there: an instance attribute is reinstated, a method that came
  from the class is removed again from the instance ``__dict__`` (so the class's method shows through); restoring
  twice is a no-op;
- patches on one attribute stack (the newer wraps the older) and may be restored in any order: restoring one that
  another patch has wrapped since leaves the attribute alone and splices it out of the chain instead (the patch above
  now delegates to, and will restore, what was there before it), so a replacement that calls ``p.original`` when it
  runs skips the restored patch at once;
- :func:`restore_all` undoes every patch on an object (teardown paths).

Swapping an instance's class (module surgery) goes through :func:`swap_class`, which is reversible the same way.
The layout test refuses a method assignment anywhere else in the package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["Patch", "active_patch", "patch", "restore_all", "swap_class"]

_MISSING = object()
# (id(obj), key) -> its live Patch, removed again by `restore`. A live patch holds its object (it must put the
# original back), so an id in here is never reused while the entry exists; and an installed patch keeps its object
# alive until it is restored, which is why every site restores in a `finally` or at teardown.
_ACTIVE: dict[tuple[int, str], Patch] = {}


class Patch:
    """One installed replacement of ``obj.<name>``; :meth:`restore` undoes it."""

    __slots__ = ("_obj", "installed", "key", "name", "original", "_own", "_value")

    def __init__(self, obj: Any, name: str, key: str, original: Any, own: Any) -> None:
        self._obj = obj
        self.name = name
        self.key = key
        #: what ``getattr(obj, name)`` returned before the patch (the bound original method) — call this to delegate.
        self.original = original
        self._own = own  # the instance-``__dict__`` value before the patch, or _MISSING when it came from the class
        self._value: Any = _MISSING  # what the patch installed (set by `patch`)
        self.installed = True

    def restore(self) -> None:
        """Put the original back (idempotent).

        When a newer live patch on the same attribute wraps this one, the attribute is left alone (it holds the newer
        patch) and the newer patch is rewired instead: its ``original`` becomes this patch's ``original`` and it will
        put back what was there before this patch. Restoring the patches of one attribute in any order therefore ends
        with the attribute as it was before the first.
        """
        if not self.installed:
            return
        self.installed = False
        obj = self._obj
        above = self._wrapper()
        if above is not None:
            above.original = self.original
            above._own = self._own
        elif self._own is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(obj, self.name)
        else:
            setattr(obj, self.name, self._own)
        if _ACTIVE.get((id(obj), self.key)) is self:
            del _ACTIVE[(id(obj), self.key)]

    def _wrapper(self) -> Patch | None:
        """The live patch installed on the same attribute on top of this one, when this one is not the top."""
        if getattr(self._obj, self.name, _MISSING) is self._value:
            return None  # this patch is what the attribute holds: the top of the stack
        for p in _ACTIVE.values():
            same_attribute = p is not self and p.installed and p._obj is self._obj and p.name == self.name
            if same_attribute and (p.original is self._value or p._own is self._value):
                return p
        return None  # replaced by hand since: put the original back, as before any stacking

    def __repr__(self) -> str:
        state = "installed" if self.installed else "restored"
        return f"Patch({type(self._obj).__name__}.{self.name}, key={self.key!r}, {state})"


def active_patch(obj: Any, key: str) -> Patch | None:
    """The live patch installed on ``obj`` under ``key``, or None."""
    patch_ = _ACTIVE.get((id(obj), key))
    return patch_ if patch_ is not None and patch_.installed and patch_._obj is obj else None


def patch(obj: Any, name: str, replacement: Callable[[Patch], Any], *, key: str | None = None) -> Patch:
    """Replace ``obj.<name>`` with ``replacement(p)``, where ``p`` is the new :class:`Patch` (so the replacement
    can call ``p.original``).

    Args:
        obj: the live object (an optimizer, a trainer, a module, a plugin).
        name: the attribute to replace; it must exist on ``obj``.
        replacement: builds the new attribute from the patch (usually a closure over ``p.original``).
        key: identity of this patch on ``obj`` (default ``name``); a second :func:`patch` with a live patch under the
            same key returns that patch and installs nothing.

    Raises:
        AttributeError: ``obj`` has no attribute ``name`` (the upstream object changed).
    """
    key = key or name
    live = active_patch(obj, key)
    if live is not None:
        return live
    if not hasattr(obj, name):
        raise AttributeError(
            f"cannot patch `{type(obj).__name__}.{name}`: the object has no such attribute (has the library that "
            "defines it changed?)."
        )
    original = getattr(obj, name)
    own = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
    p = Patch(obj, name, key, original, own)
    p._value = replacement(p)
    setattr(obj, name, p._value)
    _ACTIVE[(id(obj), key)] = p
    return p


def restore_all(obj: Any) -> None:
    """Restore every live patch on ``obj``, newest first."""
    live = [p for (oid, _), p in list(_ACTIVE.items()) if oid == id(obj) and p._obj is obj]
    for p in reversed(live):  # insertion order: the newest patch is undone first
        p.restore()


def swap_class(obj: Any, new_class: type) -> type:
    """Set ``obj.__class__`` to ``new_class`` (a subclass of, or layout-compatible with, the current class) and
    return the previous class, so the caller can swap back with ``swap_class(obj, previous)``."""
    previous = type(obj)
    obj.__class__ = new_class
    return previous
