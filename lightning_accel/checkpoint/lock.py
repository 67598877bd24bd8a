"""One writer per checkpoint directory: an exclusive lock that a killed writer cannot leave stuck.

Two runs saving into one directory corrupt it (each collects the blobs the other just wrote), so
:class:`~lightning_accel.checkpoint.store.DeltaStore` takes a :class:`DirectoryLock` before its first save or removal in
a directory (only global rank 0 saves, so in DDP rank 0 holds it) and keeps it until ``close()`` (the plugin's
``teardown``). Readers (loads, ``ckpt verify|export``) never lock.

- **Local directories**: ``fcntl.flock`` on ``<dir>/.delta_blobs/.lock``, whose content names the holder (pid,
  host, start time). The kernel drops the lock when the holder's process dies (SIGKILL included), so a stale lock
  file is simply taken over; the previous holder's record is reported in :attr:`DirectoryLock.took_over`. Works on
  NFS through Linux's ``flock``-over-``fcntl`` emulation.
- **Object stores** (``s3://``...): a *lease* object ``<dir>/.delta_blobs/.lock`` (JSON: owner id, pid, host,
  expiry). It is created with a conditional PUT (``If-None-Match: *``: the store refuses it when the object
  exists), renewed every ``lease_s / 3`` by a heartbeat thread with ``If-Match: <etag>`` (so a holder that lost its
  lease finds out instead of overwriting its successor's), and deleted on release. A lease not renewed for
  ``lease_s`` (the holder was killed) is taken over with ``If-Match`` on the stale object's etag, so two takers
  cannot both win; a lease whose holder ran on this host and whose process is gone is stale at once. Checked with
  s3fs + moto; AWS S3 supports both conditions since 2024. A store that rejects the conditions falls back to
  read-check-write (a race window of one round trip, documented) — see :attr:`DirectoryLock.atomic`.
  Expiry compares wall clocks of different hosts: keep ``lease_s`` far above their skew.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from lightning_accel._utils.atomic import is_local_url, strip_file_scheme
from lightning_accel._utils.fs import FileStore
from lightning_accel._utils.paths import safe_join
from lightning_accel._utils.processes import process_running

__all__ = ["LOCK_NAME", "CheckpointDirectoryLockedError", "DirectoryLock", "prepare_directory"]

LOCK_NAME = ".delta_blobs/.lock"  # beside the blobs: the checkpoint directory lists only checkpoints
#: Seconds an object-store lease lives without renewal (renewed every third of it).
LEASE_S = 120.0


class CheckpointDirectoryLockedError(RuntimeError):
    """Another writer holds the checkpoint directory.

    Attributes:
        directory: the directory.
        holder: what the lock records about its holder (``pid``, ``host``, ``since``; may be empty).
    """

    def __init__(self, message: str, *, directory: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.directory = directory
        self.holder = holder


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown writer"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {when})"


def _record(owner: str, lease_s: float | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"owner": owner, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    if lease_s is not None:
        rec["expires"] = time.time() + lease_s
    return rec


def _parse(data: bytes) -> dict[str, Any]:
    try:
        rec = json.loads(data)
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


def _dead_here(holder: dict[str, Any]) -> bool:
    """The holder ran on this host and its process is gone: its lease is stale before it expires (a pid reused
    since is taken as alive, which only delays the take-over to the expiry)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    return not process_running(pid)


def prepare_directory(directory: str) -> None:
    """Create a local checkpoint directory, or fail in one line naming it and the fix.

    Raises:
        NotADirectoryError: ``directory`` (or a parent) is a file.
        OSError: the directory cannot be created or written (same type and errno as the cause).
    """
    if not is_local_url(directory):
        return
    d = strip_file_scheme(directory)
    try:
        os.makedirs(d, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), d)
    except (FileExistsError, NotADirectoryError) as e:
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"Checkpoint directory {d!r} is a file (or lies under one), not a directory. Point `dirpath` at a "
            "directory, or move the file away",
        ) from e
    except OSError as e:
        raise OSError(
            e.errno or errno.EIO,
            f"Cannot write checkpoints to {d!r} ({e.strerror or e}). Choose a writable `dirpath` (or fix the "
            "directory's permissions / mount)",
        ) from e


class DirectoryLock:
    """The exclusive writer lock of one checkpoint directory (see the module docstring).

    Args:
        fs: the file store of the directory's URLs.
        directory: local path or fsspec URL of the checkpoint directory.
        lease_s: object stores: seconds a lease lives without renewal.
    """

    def __init__(self, fs: FileStore, directory: str, *, lease_s: float = LEASE_S) -> None:
        self.fs = fs
        self.directory = directory
        self.url = safe_join(directory, LOCK_NAME)
        self.lease_s = float(lease_s)
        self.owner = uuid.uuid4().hex
        #: What the previous, dead holder recorded when this lock took it over (``None``: it was free).
        self.took_over: dict[str, Any] | None = None
        #: False when the object store refused conditional writes and the read-check-write fallback is in use.
        self.atomic = True
        self._fd: int | None = None
        self._etag: str | None = None
        self._held = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        #: An error of the heartbeat (the lease was lost): raised by :meth:`check`.
        self.lost: BaseException | None = None

    @property
    def held(self) -> bool:
        return self._held

    def _locked_error(self, holder: dict[str, Any], extra: str = "") -> CheckpointDirectoryLockedError:
        mine = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        who = "another DeltaStore / DeltaCheckpointIO of this process" if mine else _describe(holder)
        fix = (
            "call `teardown()` (plugin) or `close()` (store) on the other one first"
            if mine
            else "stop the other run, or give this run its own `dirpath`"
        )
        return CheckpointDirectoryLockedError(
            f"Checkpoint directory {self.directory!r} is being written by {who}{extra}; two writers would delete "
            f"each other's blobs, so this one refuses to save there. Fix: {fix}.",
            directory=self.directory,
            holder=holder,
        )

    # ---- acquire / release ---------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointDirectoryLockedError` naming the directory and the holder."""
        if self._held:
            return
        if is_local_url(self.directory):
            self._acquire_local()
        else:
            self._acquire_remote()
            self._stop.clear()
            self._heartbeat = threading.Thread(target=self._renew_loop, name="delta-checkpoint-lease", daemon=True)
            self._heartbeat.start()
        self._held = True

    def _acquire_local(self) -> None:
        import fcntl

        prepare_directory(self.directory)
        path = strip_file_scheme(self.url)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except IsADirectoryError as e:
            raise NotADirectoryError(
                errno.EISDIR, f"{path!r} (the lock file of checkpoint directory {self.directory!r}) is a directory"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse(os.pread(fd, 4096, 0))
            os.close(fd)
            raise self._locked_error(holder) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _parse(os.pread(fd, 4096, 0))
        # The kernel released the previous holder's flock, so it is gone: record and take over.
        self.took_over = previous or None
        data = json.dumps(_record(self.owner)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        self._fd = fd

    def _put(self, data: bytes, *, create: bool = False, etag: str | None = None) -> str | None:
        """One PUT of the lease, conditional where asked; returns the new etag (None if the store gives none)."""
        fs, path = self.fs.resolve(self.url)
        kwargs: dict[str, Any] = {}
        if create:
            kwargs["mode"] = "create"
        if etag is not None and self.atomic:
            kwargs["IfMatch"] = etag
        out = self.fs.call("lock", self.url, lambda: fs.pipe_file(path, data, **kwargs))
        return out.get("ETag") if isinstance(out, dict) else None

    def _read_remote(self) -> tuple[dict[str, Any], str | None] | None:
        """``(record, etag)`` of the lease object, or None when there is none."""
        fs, path = self.fs.resolve(self.url)
        try:
            info = self.fs.call("lock", self.url, lambda: fs.info(path))
            data = self.fs.read(self.url)
        except FileNotFoundError:
            return None
        return _parse(data), info.get("ETag")

    def _acquire_remote(self) -> None:
        data = json.dumps(_record(self.owner, self.lease_s)).encode()
        for _ in range(3):
            try:
                self._etag = self._put(data, create=True)
                return
            except FileExistsError:
                pass
            except TypeError:  # a filesystem without `mode="create"`: read-check-write
                self.atomic = False
                if self._read_remote() is None:
                    self._etag = self._put(data)
                    self._confirm()
                    return
            found = self._read_remote()
            if found is None:
                continue  # released meanwhile: try to create it again
            holder, etag = found
            raw = holder.get("expires")
            expires = float(raw) if isinstance(raw, (int, float)) else 0.0
            live = expires > time.time() and not _dead_here(holder)
            if holder.get("owner") != self.owner and live:
                left = f" (its lease expires in {expires - time.time():.0f} s unless renewed)"
                raise self._locked_error(holder, left)
            # Expired (the holder was killed) or unreadable: take it over, conditionally on the stale object.
            try:
                self._etag = self._put(data, etag=etag if self.atomic else None)
            except OSError as e:
                if "condition" in str(e).lower():
                    continue  # someone else took it over first: read again
                raise
            if not self.atomic:
                self._confirm()
            self.took_over = holder or None
            return
        found = self._read_remote()
        raise self._locked_error(found[0] if found else {})

    def _confirm(self) -> None:
        """Fallback mode: after a short pause the lease must still be ours (narrows the read-check-write race)."""
        time.sleep(0.2)
        found = self._read_remote()
        if found is None or found[0].get("owner") != self.owner:
            raise self._locked_error(found[0] if found else {}, " (it took the lease at the same moment)")

    def renew(self) -> None:
        """Object stores: extend the lease (conditionally on our last etag); raise if it was lost."""
        if not self._held or is_local_url(self.directory):
            return
        data = json.dumps(_record(self.owner, self.lease_s)).encode()
        if not self.atomic:
            found = self._read_remote()
            if found is None or found[0].get("owner") != self.owner:
                raise self._locked_error(found[0] if found else {}, " (this run's lease expired and was taken over)")
        try:
            self._etag = self._put(data, etag=self._etag)
        except OSError as e:
            if "condition" in str(e).lower():
                found = self._read_remote()
                raise self._locked_error(
                    found[0] if found else {}, " (this run's lease expired and was taken over)"
                ) from e
            raise

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except CheckpointDirectoryLockedError as e:
                self.lost = e
                return
            except Exception:  # noqa: BLE001 - a flaky store: try again at the next beat (the lease has slack)
                continue

    def check(self) -> None:
        """Raise the error of a lost lease (called before every save and removal)."""
        if self.lost is not None:
            err, self.lost, self._held = self.lost, None, False
            raise err

    def release(self, *, remove: bool = False) -> None:
        """Give the lock up (idempotent). The lease object is deleted only while it is still ours.

        Args:
            remove: local directories: delete the lock file too (it is unlinked while still held, so no other writer
                can hold it at that moment; one that comes later makes a new file). Object stores always delete the
                lease object.
        """
        if not self._held:
            return
        self._held = False
        if self._fd is not None:
            import fcntl

            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(strip_file_scheme(self.url))
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # an empty lock file: released cleanly
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            return
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        with contextlib.suppress(Exception):
            found = self._read_remote()
            if found is not None and found[0].get("owner") == self.owner:
                self.fs.rm(self.url)
