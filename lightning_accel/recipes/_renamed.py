"""Arguments of this room that were renamed: the old spelling stays accepted for one release, with a warning."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["renamed_argument"]


def renamed_argument(new_name: str, new: Any, old_name: str, old: Any, *, new_given: bool, stacklevel: int = 3) -> Any:
    """The value of the argument ``new_name``, given either as ``new`` or through its deprecated spelling ``old``.

    ``old`` is None when the old spelling was not used; ``new_given`` says whether the new one was.

    Raises:
        ValueError: both spellings were given.
    """
    if old is None:
        return new
    if new_given:
        raise ValueError(f"Pass only `{new_name}`: `{old_name}` is its deprecated spelling, and both were given.")
    warnings.warn(
        f"`{old_name}` is deprecated; use `{new_name}` (same values).", DeprecationWarning, stacklevel=stacklevel
    )
    return old
