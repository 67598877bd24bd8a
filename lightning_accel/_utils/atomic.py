"""Atomic publication of files: write to a temporary name, fsync, rename.

A reader either sees the old file or the complete new one, never a partial write, even if the writing process is
killed (SIGKILL) mid-way. On fsspec object stores (``s3://``) a single PUT is already atomic, so the object is written
in one call under its final name; callers that publish several objects must write the one that makes the others
visible (a manifest, a marker) last. :class:`~lightning_accel._utils.fs.FileStore` writes through here.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_text", "fsync_dir", "is_local_url", "strip_file_scheme"]


def is_local_url(url: str | os.PathLike[str]) -> bool:
    """Return True for plain paths and ``file://`` URLs."""
    s = os.fspath(url)
    return "://" not in s or s.startswith("file://")


def strip_file_scheme(url: str | os.PathLike[str]) -> str:
    """``file:///a/b`` -> ``/a/b``; other strings unchanged."""
    s = os.fspath(url)
    return s[len("file://") :] if s.startswith("file://") else s


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes | memoryview,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
) -> None:
    """Write ``data`` to ``path`` so that readers never observe a partial file.

    Local paths: ``<dir>/.<name>.<uuid>.tmp`` + write + fsync + ``os.replace`` + fsync of the directory; the temporary
    file is removed if anything fails (e.g. ``ENOSPC``), and the error is re-raised. Remote fsspec URLs: one ``pipe``
    call (object PUTs are atomic).

    Args:
        path: local path, ``file://`` URL or any fsspec URL.
        data: the bytes to publish.
        storage_options: fsspec options for remote URLs (endpoint, credentials).
        fs: the fsspec filesystem to write a remote ``path`` with (a :class:`~lightning_accel._utils.fs.FileStore`
            passes this process's own); default: one made from ``storage_options``.
    """
    if is_local_url(path):
        final = Path(strip_file_scheme(path))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(final.parent)
        return
    import fsspec

    if fs is None:
        fs, fs_path = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
    else:
        fs_path = fsspec.core.strip_protocol(os.fspath(path))
    fs.pipe_file(fs_path, bytes(data))


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, storage_options: dict[str, Any] | None = None
) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"), storage_options=storage_options)
