"""Keys and URLs that can never escape their directory."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

__all__ = ["safe_join"]


def safe_join(root: str, key: str) -> str:
    """Join ``key`` under ``root`` (a path or URL), refusing keys that would escape it.

    Rejects absolute keys, ``..`` components, backslashes, NUL bytes, URL schemes and fsspec's chain separator
    ``::`` inside the key (fsspec reads ``root/a::b`` as the file ``root/a``, so the key would alias another), in the
    key as written and in every percent-decoding of it: an HTTP client decodes ``%2e%2e`` and collapses it as ``..``
    (a literal ``%`` elsewhere, as in ``100%.jpg``, is fine). A root
    that is the top of its tree (``/``, ``file:///``, ``s3://``) keeps its own slashes: ``safe_join("/", "a")`` is
    ``/a``.

    Raises:
        ValueError: naming the key and the root.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"`key` must be a non-empty string, got {key!r}.")
    if any(map(_unsafe, _decodings(key))):
        raise ValueError(
            f"Key {key!r} would escape or is not a plain relative path under {root!r}. "
            "Use a relative POSIX path without `..`, `.`, a leading `/`, a scheme, `::` or backslashes, also not "
            "percent-encoded."
        )
    if not root:
        return key
    trimmed = root.rstrip("/")
    if not trimmed:
        return "/" + key  # the filesystem root: stripping its slash would make the result relative
    if trimmed.endswith(":"):
        return root + key  # only slashes after a scheme (`file:///`, `s3://`): they are the anchor, keep them
    return posixpath.join(trimmed, key)


def _decodings(key: str) -> list[str]:
    """``key`` and each further percent-decoding of it, until one changes nothing (bounded: ``%25`` nests)."""
    out = [key]
    for _ in range(8):
        decoded = unquote(out[-1])
        if decoded == out[-1]:
            break
        out.append(decoded)
    return out


def _unsafe(key: str) -> bool:
    return (
        key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or "://" in key
        or "::" in key
        or any(part in ("..", ".") for part in key.split("/"))
    )
