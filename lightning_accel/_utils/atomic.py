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

import contextlib
import errno
import os
import shutil
import stat
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


# The longest file name most filesystems take (ext4, xfs, btrfs, APFS: 255 bytes). The temporary name adds 38 bytes
# (`.` + `.` + 32 hex digits + `.tmp`) to the target's, so a valid 230-byte name would not fit without trimming.
_NAME_MAX = 255
_TMP_EXTRA = len("..") + 32 + len(".tmp")


def _tmp_name(name: str) -> str:
    """``.<name>.<32 hex>.tmp``, with ``name`` cut short enough for the whole to fit in :data:`_NAME_MAX` bytes.

    The shape is what the clean-up of interrupted writes recognises (the checkpoint store's garbage collection,
    the dataset renderer): keep it when changing this.
    """
    base = name
    while len(os.fsencode(base)) > _NAME_MAX - _TMP_EXTRA:
        base = base[:-1]  # by characters, so a multi-byte character is never split
    return f".{base}.{uuid.uuid4().hex}.tmp"


def _keep_mode(final: Path, new: Path) -> None:
    """Give ``new`` the permission bits of the file it replaces, so an overwrite keeps e.g. a 0o600 file private
    (a fresh file gets the umask's default, which is usually wider). Nothing to do for a new target."""
    try:
        st = os.stat(final)
    except OSError:
        return  # no file there yet (or unreadable): the new file keeps its own mode
    if not stat.S_ISREG(st.st_mode):
        return  # a directory or a device there: the replace itself will say what is wrong
    with contextlib.suppress(OSError):  # e.g. a source file owned by someone else: publishing matters more
        os.chmod(new, stat.S_IMODE(st.st_mode))


def _publish_local(source: bytes | memoryview | str | os.PathLike[str], final: Path, durable: bool) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        src = Path(source)
        if durable:
            _fsync_file(src)
        try:
            _keep_mode(final, src)
            os.replace(src, final)  # a finished file on the same filesystem: one rename, no copy
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
        else:
            if durable:
                fsync_dir(final.parent)
            return
    tmp = final.parent / _tmp_name(final.name)
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
        _keep_mode(final, tmp)
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
    ``<name>`` is cut short where the temporary name would pass 255 bytes, so any valid file name can be published;
    a file that is replaced keeps its permission bits.
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
    file is removed if anything fails (e.g. ``ENOSPC``), and the error is re-raised; an overwritten file keeps its
    permission bits. Remote fsspec URLs: one ``pipe``
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
