"""One idiom for argument checks, used by every room's ``__init__``.

Contract of every ``check_*`` function:

- a value of the wrong *type* raises :class:`TypeError`, a value of the right type outside what is accepted raises
  :class:`ValueError` (``bool`` is never an integer or a number here, although Python says it is);
- the message is one line: the argument in backticks, what is accepted, the value received (and its type for a
  TypeError), then the fix when the caller gives one — ```warmup_steps` must be an integer >= 0, got -1. Use 0 to
  compress from the first step.``;
- the checked value is returned (normalised: ``check_number`` returns a float, ``check_bytes`` an int), so a caller
  writes ``self.steps = check_int("steps", steps, low=1)``;
- numpy scalars are refused like any other type: most callers keep the value they were given, and an ``np.int64``
  kept in a Trainer's hyper-parameters would fail later (a checkpoint's weights-only loader, a DataLoader's
  ``batch_size``) far from its cause; ``int(x)`` / ``float(x)`` is the fix the message asks for.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable
from fractions import Fraction
from typing import Any, TypeVar

__all__ = [
    "check_bool",
    "check_bytes",
    "check_callable",
    "check_choice",
    "check_int",
    "check_number",
    "check_seed",
    "parse_bytes",
    "renamed_argument",
]

T = TypeVar("T")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def _fail(kind: type[Exception], name: str, expected: str, value: Any, fix: str) -> Exception:
    got = f"{value!r} ({type(value).__name__})" if kind is TypeError else repr(value)
    tail = f" {fix.strip()}" if fix and fix.strip() else ""
    if kind is TypeError and _numpy(value):  # the contract's fix, said (see the module docstring)
        tail = f" Pass a Python value: `int(...)`, `float(...)` or `str(...)` of the numpy scalar.{tail}"
    return kind(f"`{name}` must be {expected}, got {got}.{tail}")


def _numpy(value: Any) -> bool:
    """True for a numpy scalar (``np.int64``, ``np.float64``, ``np.str_`` subclass Python's own types or compare equal
    to them, so ``isinstance`` and ``==`` alone let them through)."""
    return type(value).__module__.partition(".")[0] == "numpy"


def _range(kind: str, low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(
            f"{'>' if low_open else '>='} {low:g}" if isinstance(low, float) else f"{'>' if low_open else '>='} {low}"
        )
    if high is not None:
        parts.append(
            f"{'<' if high_open else '<='} {high:g}"
            if isinstance(high, float)
            else f"{'<' if high_open else '<='} {high}"
        )
    return f"{kind} {' and '.join(parts)}" if parts else kind


def check_int(
    name: str,
    value: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    fix: str = "",
    allow_none: bool = False,
) -> Any:
    """``value`` as an ``int`` in ``[low, high]`` (either bound optional); ``None`` passes when ``allow_none``."""
    expected = _range("an integer", low, high, False, False) + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(TypeError, name, expected, value, fix)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _fail(ValueError, name, expected, value, fix)
    return value


#: the seeds Lightning's ``seed_everything`` takes (its ``min_seed_value`` / ``max_seed_value``: numpy's legacy seed
#: range), spelt out so the plain-torch cores need not import Lightning for two integers; every ``seed`` argument of
#: the package takes exactly these, so a seed that works in one place works in all, and in ``seed_everything``
SEED_MIN = 0
SEED_MAX = 2**32 - 1


def check_seed(name: str, value: Any, *, what: str) -> int:
    """``value`` as a seed in ``SEED_MIN .. SEED_MAX`` (what ``seed_everything`` takes), else one line naming ``name``,
    the value, the range and what the seed seeds (``what``, e.g. "the train/validation split"). Also keeps
    ``seed + epoch`` within torch's generator range, where torch would say only "Overflow when unpacking long long".

    Raises:
        TypeError: ``value`` is not an integer (a bool neither).
        ValueError: ``value`` is outside the range.
    """
    fix = f"It seeds {what}; any seed `lightning.seed_everything` takes (0 .. 2**32 - 1) works."
    checked: int = check_int(name, value, low=SEED_MIN, high=SEED_MAX, fix=fix)
    return checked


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
    allow_none: bool = False,
) -> Any:
    """``value`` (an int or a float, never a bool, never NaN) as a ``float`` within the bounds; ``low_open`` /
    ``high_open`` exclude the bound itself (``low=0, low_open=True`` is "> 0")."""
    expected = _range("a number", low, high, low_open, high_open) + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or _numpy(value):
        raise _fail(TypeError, name, expected, value, fix)
    try:
        v = float(value)
    except OverflowError:  # an int beyond any float (10**400)
        raise _fail(ValueError, name, expected, value, fix) from None
    bad = math.isnan(v)
    if low is not None:
        bad = bad or (v <= low if low_open else v < low)
    if high is not None:
        bad = bad or (v >= high if high_open else v > high)
    if bad:
        raise _fail(ValueError, name, expected, value, fix)
    return v


def check_choice(name: str, value: T, choices: Iterable[Any], *, fix: str = "") -> T:
    """``value`` when it is one of ``choices`` (compared with ``==``; a bool never matches an int choice)."""
    allowed = tuple(choices)
    expected = (
        "one of " + ", ".join(repr(c) for c in allowed) if len(allowed) > 2 else " or ".join(repr(c) for c in allowed)
    )
    if _numpy(value) or not any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in allowed):
        kinds = {type(c) for c in allowed}
        wrong_type = (
            _numpy(value)
            or not any(isinstance(value, k) for k in kinds)
            or (isinstance(value, bool) and bool not in kinds)
        )
        raise _fail(TypeError if wrong_type else ValueError, name, expected, value, fix)
    return value


def check_bool(name: str, value: Any, *, fix: str = "") -> bool:
    """``value`` when it is ``True`` or ``False`` (``0``/``1``/strings are refused: a YAML typo must not pass)."""
    if not isinstance(value, bool):
        raise _fail(TypeError, name, "True or False", value, fix)
    return value


def check_callable(name: str, value: Any, expected: str) -> None:
    """``value`` must be callable or None (``expected`` says what it is called with); a ``TypeError`` otherwise."""
    if value is not None and not callable(value):
        raise TypeError(f"`{name}` must be {expected} or None, got {value!r} ({type(value).__name__}).")


def parse_bytes(value: Any) -> int | None:
    """``1073741824``, ``"1GiB"``, ``"512MB"``, ``"0"`` -> bytes; None for anything else (the caller raises)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            # exact: a float would round "1.1GB" and overflow on a 400-digit count
            return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    return None


def check_bytes(name: str, value: Any, *, low: int = 0, fix: str = "", allow_none: bool = False) -> Any:
    """A byte count: an integer or a string with a unit (``"512MiB"``, ``"2GB"``), returned as an ``int`` >= ``low``;
    ``None`` passes when ``allow_none`` (conventionally "no cap")."""
    expected = f"a byte count (an integer >= {low}, or a string like '512MiB', '2GB')" + (
        ", or None for no cap" if allow_none else ""
    )
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _fail(TypeError, name, expected, value, fix)
    n = parse_bytes(value)
    if n is None or n < low:
        raise _fail(ValueError, name, expected, value, fix)
    return n


def renamed_argument(new_name: str, new: Any, old_name: str, old: Any, *, new_given: bool, stacklevel: int = 3) -> Any:
    """The value of the argument ``new_name``, given either as ``new`` or through its deprecated spelling ``old``.

    The one idiom for a renamed argument: the old spelling stays accepted for one release and emits a
    :class:`DeprecationWarning` naming the new one (``stacklevel`` counts from this function: 3 points at the caller of
    the ``__init__`` that calls it). ``old`` is None when the old spelling was not used (LightningCLI passes every
    parameter, so None means "not given"); ``new_given`` says whether the new one was.

    Raises:
        ValueError: both spellings were given (one line naming both).
    """
    if old is None:
        return new
    if new_given:
        raise ValueError(f"`{old_name}` is the deprecated name of `{new_name}`: pass only `{new_name}`, got both.")
    warnings.warn(
        f"`{old_name}` is deprecated; use `{new_name}` (same values).", DeprecationWarning, stacklevel=stacklevel
    )
    return old
