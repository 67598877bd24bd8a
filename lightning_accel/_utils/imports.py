"""Optional-dependency flags with actionable errors."""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from typing import Any

__all__ = ["import_object", "module_available", "require"]


def import_object(path: str) -> Any | None:
    """The object a dotted ``path`` (``pkg.module.Name``) names, or None when it does not import (a config's
    ``class_path`` read for a suggestion or a lever, where a wrong path is reported elsewhere)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


@cache
def module_available(name: str) -> bool:
    """True if ``import name`` would find a module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, *, purpose: str, pip_name: str | None = None) -> None:
    """Raise ``ModuleNotFoundError`` with the install command when ``name`` is missing.

    Args:
        name: the importable module name.
        purpose: what needs it, quoted in the message.
        pip_name: the distribution to install, if it differs from ``name``.
    """
    if not module_available(name):
        raise ModuleNotFoundError(
            f"{purpose} needs the `{name}` package, which is not installed. "
            f'Install it with `pip install {pip_name or name}` (or `pip install -e ".[dev]"` in a checkout).'
        )
