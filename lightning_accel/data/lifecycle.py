"""Lifecycle of RAM tiers: find them, tell whether a process still uses one, and remove stale ones.

A RAM tier lives on tmpfs (``/dev/shm/lightning_accel/<tag>``, :func:`~lightning_accel.data.tiers.default_ram_dir`),
which survives the job but not a reboot, so without a sweep every ``cache_dir`` ever trained from keeps its RAM budget
pinned until the machine restarts. A tier is **stale** when

- no process has it open: LMDB memory-maps ``data.mdb`` and ``lock.mdb`` in every process that has the environment
  open (main process, DataLoader workers, every rank of the node) and holds a lock on ``lock.mdb`` there, so a tier
  absent from every ``/proc/<pid>/maps`` and whose ``lock.mdb`` nobody locks is not in use (the lock speaks for the
  processes whose maps cannot be read: another user's, or another PID namespace's sharing ``/dev/shm``; on a system
  without ``/proc``, every tier counts as in use and nothing is removed), and
- its last use is older than the TTL: :func:`touch` marks a tier used (``CachedDataModule`` does at setup) and every
  write updates the files' mtimes, so "last use" is the newest mtime of the directory and its files.

:func:`sweep` removes stale tiers (``CachedDataModule`` runs it once per node in ``prepare_data`` with its ``ram_ttl``;
``lightning-accel data clean`` runs it by hand). Only directories that carry the tier marker
(:data:`~lightning_accel.data.tiers.TIER_MARKER`, written when the package creates a RAM tier) and that the calling
user owns are considered, and removing one deletes only the files a tier creates (``data.mdb``, ``lock.mdb``, the
marker) and then the directory if that left it empty, holding LMDB's lock exclusively meanwhile (a process that has
the tier open keeps it, even one that opened it after the check): anything else found inside stays, and so does every
other entry under the root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning_accel._utils.checks import check_number
from lightning_accel.data.tiers import _ENVS, LMDB_FILES, TIER_MARKER, read_marker

__all__ = [
    "TierInfo",
    "find_tiers",
    "mapping_pids",
    "other_entries",
    "parse_duration",
    "ram_root",
    "remove_tier",
    "sweep",
    "touch",
]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*$", re.IGNORECASE)


def ram_root() -> str:
    """Where RAM tiers are made by default: ``$LIGHTNING_ACCEL_RAM_ROOT`` or ``/dev/shm/lightning_accel``."""
    return os.environ.get("LIGHTNING_ACCEL_RAM_ROOT") or os.path.join("/dev/shm", "lightning_accel")


def parse_duration(value: float | int | str | None, *, name: str) -> float | None:
    """Seconds from ``3600``, ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"1w"`` (None stays None).

    Raises:
        TypeError: naming ``name``, for a value that is neither a number, a string nor None (a bool included).
        ValueError: naming ``name``, for a string that is no duration, or a negative number.
    """
    if value is None:
        return None
    expected = "a duration such as 3600, '90s', '30m', '12h' or '7d'"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"`{name}` must be {expected}, or None, got {value!r} ({type(value).__name__}).")
    if not isinstance(value, str):
        return float(check_number(name, value, low=0, fix="A number is a duration in seconds."))
    m = _DURATION.match(value)
    if m is None:
        raise ValueError(f"`{name}` must be {expected}, got {value!r}.")
    return float(m.group(1)) * _UNITS[(m.group(2) or "s").lower()]


def touch(path: str) -> None:
    """Mark the tier at ``path`` used now (its directory's mtime); silent when it does not exist."""
    with contextlib.suppress(OSError):
        os.utime(path)


@dataclass
class TierInfo:
    """One RAM tier directory: its path, bytes on tmpfs, newest mtime, the pids that have it open (-1: a process whose
    pid this system does not show, or no ``/proc`` to tell), and its marker's note (what it caches, e.g. the data
    module's ``cache_dir``; None for a tier made without one)."""

    path: str
    bytes: int
    last_use: float
    pids: list[int]
    note: str | None = None

    @property
    def in_use(self) -> bool:
        return bool(self.pids)


def _mapped_dirs() -> dict[str, set[int]] | None:
    """``{directory: pids}`` of every memory-mapped file of every readable process; None without ``/proc``."""
    if not os.path.isdir("/proc/self"):
        return None
    out: dict[str, set[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            # Bytes, decoded as os.listdir does (surrogateescape): a path that is not UTF-8 still matches its tier.
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(b"/"):
                        path = os.fsdecode(parts[5].rstrip(b"\n")).removesuffix(" (deleted)")
                        # The kernel writes a newline in a path as the 4 characters "\012" (and leaves a literal
                        # "\012" as it is): count the directory under both spellings, so a mapped tier whose path
                        # holds either is seen as in use.
                        for p in {path, path.replace("\\012", "\n")}:
                            out.setdefault(os.path.dirname(p), set()).add(int(pid))
        except OSError:  # gone meanwhile, or another user's process
            continue
    return out


def mapping_pids(directory: str) -> list[int] | None:
    """The pids of the readable processes that memory-map a file directly inside ``directory`` (sorted; this process
    included), or None on a system without ``/proc`` (nothing can be told). A process of another user, whose maps
    cannot be read, is not seen."""
    mapped = _mapped_dirs()
    if mapped is None:
        return None
    return sorted(mapped.get(os.path.realpath(directory), ()))


# struct flock on Linux: l_type, l_whence (short), l_start, l_len (off_t), l_pid (pid_t), native alignment
_FLOCK = "hhqqi"
_LOCK_FILE = "lock.mdb"


def _open_here(path: str) -> bool:
    """True when this process has the LMDB environment at ``path`` open (closing a descriptor of its ``lock.mdb`` would
    drop the lock LMDB holds on it for this process)."""
    return os.path.realpath(path) in _ENVS.get()


def _lock_holder(path: str) -> int | None:
    """The pid of a process holding LMDB's lock on the ``lock.mdb`` in ``path`` (-1 when the kernel does not name it: a
    process of another PID namespace), or None when no process holds one (or there is no lock file).

    LMDB takes this lock in every process that opens the environment and keeps it until the environment is closed (or
    the process exits), so it tells what ``/proc/<pid>/maps`` cannot: a process whose maps this user cannot read.
    Never called on an environment this process has open (see :func:`_open_here`).
    """
    if sys.platform != "linux":  # the layout of `struct flock` above is Linux's
        return None
    import fcntl

    try:
        fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    kind, _, _, _, pid = struct.unpack(_FLOCK, got)
    if kind == fcntl.F_UNLCK:
        return None
    return pid if pid > 0 else -1


@contextlib.contextmanager
def _locked_out(path: str) -> Iterator[bool]:
    """Hold LMDB's lock on the ``lock.mdb`` in ``path`` exclusively for the block (no process can open the environment
    meanwhile); yields False, holding nothing, when a process has it open. True when there is no lock file."""
    import fcntl

    try:
        fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN/EACCES: a process holds LMDB's lock
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _scan(path: str) -> tuple[int, float]:
    total, newest = 0, os.stat(path).st_mtime
    for dirpath, _, files in os.walk(path):
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(dirpath).st_mtime)
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(dirpath, name))
                total += st.st_blocks * 512
                newest = max(newest, st.st_mtime)
    return total, newest


def _tier_marker(entry: os.DirEntry[str]) -> dict[str, Any] | None:
    """The marker of a directory (not a link) of the calling user that carries one, else None."""
    try:
        if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
            return None
    except OSError:
        return None
    return read_marker(entry.path)


def _is_tier(entry: os.DirEntry[str]) -> bool:
    """A directory (not a link) of the calling user that carries the tier marker."""
    return _tier_marker(entry) is not None


def other_entries(root: str) -> list[str]:
    """The entries directly under ``root`` that are not RAM tiers (files, links, unmarked or foreign directories),
    sorted; empty when ``root`` cannot be listed."""
    try:
        return sorted(e.path for e in os.scandir(root) if not _is_tier(e))
    except OSError:
        return []


def _own_bytes(path: str) -> int:
    """Bytes on disk of the files a tier created in ``path`` (what :func:`remove_tier` deletes)."""
    total = 0
    for name in (*LMDB_FILES, TIER_MARKER):
        with contextlib.suppress(OSError):
            st = os.lstat(os.path.join(path, name))
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


def remove_tier(path: str) -> bool:
    """Delete what a tier created in ``path`` (its LMDB files and marker), then the directory if that emptied it.

    Returns False, removing nothing, when ``path`` carries no marker or a process has the tier open (this one, or one
    holding LMDB's lock on its ``lock.mdb``: that lock is held exclusively while the files go, so no process opens the
    tier halfway through). Any other file inside stays (and keeps the directory)."""
    if os.path.islink(path) or read_marker(path) is None or _open_here(path):
        return False
    with _locked_out(path) as free:
        if not free:
            return False
        for name in (*LMDB_FILES, TIER_MARKER):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):  # not empty: files the tier did not create stay, with their directory
        os.rmdir(path)
    return True


def find_tiers(root: str | None = None) -> list[TierInfo]:
    """The RAM tiers directly under ``root`` (default :func:`ram_root`): directories of the calling user that carry
    the tier marker. Every other entry is ignored (see :func:`other_entries`)."""
    root = ram_root() if root is None else root
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    mapped = _mapped_dirs()
    out = []
    for e in entries:
        marker = _tier_marker(e)
        if marker is None:
            continue
        try:
            size, newest = _scan(e.path)
        except OSError:
            continue
        real = os.path.realpath(e.path)
        if mapped is None:
            pids = [-1]  # no /proc: cannot tell, treat as in use
        else:
            pids = sorted({p for d, ps in mapped.items() if d == real or d.startswith(real + os.sep) for p in ps})
            if not pids and not _open_here(real) and (holder := _lock_holder(e.path)) is not None:
                pids = [holder]  # open in a process whose maps cannot be read here
        note = marker.get("note")
        out.append(TierInfo(e.path, size, newest, pids, note if isinstance(note, str) else None))
    return out


def sweep(
    root: str | None = None,
    *,
    older_than_s: float = 0.0,
    keep: Iterable[str] = (),
    dry_run: bool = False,
    now: float | None = None,
    only: Iterable[str] | None = None,
) -> list[TierInfo]:
    """Remove the tiers under ``root`` that no process maps and that were last used more than ``older_than_s``
    seconds ago (``keep``: paths never removed, e.g. the caller's own tier; ``only``: tier names under ``root``, the
    only ones considered). Returns what was (or, with ``dry_run``, would be) removed; a tier another process removes
    meanwhile is skipped. Only marked tiers are touched (:func:`remove_tier`); each returned entry's ``bytes`` counts
    the tier's own files, what removing it frees (a user's file inside a tier stays, and is not counted as freed)."""
    now = time.time() if now is None else now
    kept = {os.path.realpath(k) for k in keep}
    names = None if only is None else set(only)
    removed = []
    for info in find_tiers(root):
        if names is not None and os.path.basename(info.path) not in names:
            continue
        if info.in_use or now - info.last_use < older_than_s or os.path.realpath(info.path) in kept:
            continue
        freed = _own_bytes(info.path)  # measured before removal; `info.bytes` also counts files that stay
        if not dry_run:
            try:
                if not remove_tier(info.path):
                    continue
            except OSError:
                continue  # not ours to remove after all (permissions): leave it
        removed.append(dataclasses.replace(info, bytes=freed))
    if not dry_run and root is None:
        with contextlib.suppress(OSError):
            os.rmdir(ram_root())  # only when empty
    return removed
