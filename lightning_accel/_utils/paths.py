"""Keys and URLs that can never escape their directory."""

from __future__ import annotations

import posixpath

__all__ = ["safe_join"]


def safe_join(root: str, key: str) -> str:
    """Join ``key`` under ``root`` (a path or URL), refusing keys that would escape it.

    Rejects absolute keys, ``..`` components, backslashes, NUL bytes and URL schemes inside the key.

    Raises:
        ValueError: naming the key and the root.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"`key` must be a non-empty string, got {key!r}.")
    bad = (
        key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or "://" in key
        or any(part in ("..", ".") for part in key.split("/"))
    )
    if bad:
        raise ValueError(
            f"Key {key!r} would escape or is not a plain relative path under {root!r}. "
            "Use a relative POSIX path without `..`, `.`, a leading `/`, a scheme or backslashes."
        )
    return posixpath.join(root.rstrip("/"), key) if root else key
