"""Small argument parsers shared by the ``lightning-accel`` sub-commands (``ckpt``, ``data``)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["json_object_arg"]


def json_object_arg(flag: str, raw: str | None) -> dict[str, Any] | None:
    """Parse a command-line value that must be a JSON object (e.g. fsspec ``--storage-options``); ``None`` stays None.

    Raises:
        ValueError: naming ``flag`` and the value, with an example of the expected form.
    """
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"`{flag}` {raw!r} is not valid JSON ({e}).") from e
    if not isinstance(value, dict):
        raise ValueError(f"`{flag}` {raw!r} must be a JSON object, e.g. '{{\"anon\": true}}'.")
    return value
