"""One way to say an error on one line (the CLIs promise one line per error, and a log line must not wrap)."""

from __future__ import annotations

__all__ = ["one_line"]


def one_line(error: BaseException | str, *, expected: tuple[type[BaseException], ...] = (), first: bool = False) -> str:
    """``error``'s message as a single line.

    Args:
        error: the exception (or a message).
        expected: exception types the caller raises on purpose; any other type is prefixed with its name
            (``OSError: ...``), because an unexpected error without its type says too little.
        first: keep only the first line of a many-line message (a traceback-like text) instead of joining its lines.

    A message that is empty becomes the exception type's name.
    """
    text = error if isinstance(error, str) else str(error)
    if first:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        text = lines[0] if lines else ""
    line = " ".join(text.split())
    if isinstance(error, str):
        return line
    if not line:
        return type(error).__name__
    if expected and not isinstance(error, expected):
        return f"{type(error).__name__}: {line}"
    return line
