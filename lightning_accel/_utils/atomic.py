"""Atomic publication of files: write to a temporary name, fsync, rename.

A reader either sees the old file or the complete new one, never a partial write, even if the writing process is
killed (SIGKILL) mid-way. On fsspec object stores (``s3://``) a single PUT is already atomic, so the object is written
in one call under its final name (never a temporary object and a ``mv``, which an object store does as a copy and a
delete); callers that publish several objects must write the one that makes the others visible (a manifest, a marker)
last. :func:`atomic_publish_file` is the one implementation (bytes or a finished local file, to a local path or any
fsspec filesystem); :func:`atomic_write_bytes` / :func:`atomic_write_text` are its URL-addressed forms.
:class:`~lightning_accel._utils.fs.FileStore` writes through here.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_publish_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "is_local_url",
    "strip_file_scheme",
]


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


def _is_local_fs(fs: Any) -> bool:
    protocol = getattr(fs, "protocol", ())
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _publish_local(source: bytes | memoryview | str | os.PathLike[str], final: Path, durable: bool) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        src = Path(source)
        if durable:
            _fsync_file(src)
        try:
            os.replace(src, final)  # a finished file on the same filesystem: one rename, no copy
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
        else:
            if durable:
                fsync_dir(final.parent)
            return
    tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}.tmp"
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            with open(tmp, "wb") as f:
                f.write(source)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        else:  # another filesystem: copy beside the target first
            shutil.copyfile(source, tmp)
            if durable:
                _fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not isinstance(source, (bytes, bytearray, memoryview)):
        Path(source).unlink(missing_ok=True)
    if durable:
        fsync_dir(final.parent)


def atomic_publish_file(
    source: bytes | memoryview | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    fs: Any = None,
    storage_options: dict[str, Any] | None = None,
    durable: bool = True,
) -> None:
    """Publish ``source`` at ``path`` so that readers see the old content or the whole new one, never a part.

    Local targets: ``<dir>/.<name>.<uuid>.tmp`` + write + fsync + ``os.replace`` + fsync of the directory; the
    temporary file is removed if anything fails (e.g. ``ENOSPC``), and the error is re-raised (the old file stays).
    Object stores: one call under the final name (``pipe_file`` for bytes, ``put_file`` for a file: one PUT, or a
    multipart upload that S3 also makes visible only once complete); never a temporary object and a ``mv``.

    Args:
        source: the bytes to publish, or a finished local file holding them (written elsewhere, e.g. by a streaming
            writer); a file is moved into place (locally a rename when it is on the same filesystem, else a copy)
            or uploaded, and is gone afterwards either way.
        path: where to publish. With ``fs``: a path of that filesystem (its protocol optional); the target is local
            when ``fs`` is fsspec's local filesystem. Without ``fs``: a local path, a ``file://`` URL or any fsspec
            URL.
        fs: the fsspec filesystem to write with (e.g. this process's own); default: one made from
            ``storage_options`` for a remote ``path``.
        storage_options: fsspec options for a remote ``path`` when ``fs`` is not given (endpoint, credentials).
        durable: fsync the data and the directory (local targets). ``False`` for a file that can be rebuilt and is
            checked on read (a staged cache copy): a crash still never exposes a partial file, only a power loss may
            lose the rename.
    """
    local = _is_local_fs(fs) if fs is not None else is_local_url(path)
    if local:
        _publish_local(source, Path(strip_file_scheme(path)), durable)
        return
    import fsspec

    if fs is None:
        fs, fs_path = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
    else:
        fs_path = fsspec.core.split_protocol(os.fspath(path))[1]  # `fs`'s own path: the URL without its scheme
    if isinstance(source, (bytes, bytearray, memoryview)):
        fs.pipe_file(fs_path, bytes(source))
        return
    fs.put_file(os.fspath(source), fs_path)
    Path(source).unlink(missing_ok=True)


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes | memoryview,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
) -> None:
    """Write ``data`` to ``path`` so that readers never observe a partial file (see :func:`atomic_publish_file`).

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
    local = is_local_url(path)
    atomic_publish_file(data, path, fs=None if local else fs, storage_options=storage_options)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, storage_options: dict[str, Any] | None = None
) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"), storage_options=storage_options)
