"""Local cache tiers: an LMDB environment with a byte budget, used both on the SSD and in RAM (``/dev/shm``).

One class, two placements:

- **SSD tier**: ``LmdbTier("<cache_dir>/ssd", budget)`` on a local disk.
- **RAM tier**: ``LmdbTier("/dev/shm/...", budget)`` on tmpfs. Because it is one memory-mapped environment per node,
  its byte budget holds for the whole process tree (main process, every DataLoader worker and every rank on the node
  map the *same* pages) instead of being multiplied by ``num_workers`` like per-worker LRUs, and a sample that one
  worker cached is a hit for every other worker. Reads are zero-copy views into the map.

Both also benefit from the OS page cache, which keeps recently read SSD pages in otherwise free RAM (shared by all
processes too, but outside any budget we can enforce).

Contract:

- **Budget never exceeded**: the LMDB ``map_size`` is ``budget_bytes`` from the start (without a budget it starts
  small and doubles on ``MapFullError``), so the data file can never grow past the budget. Why not start small and
  grow: each growth aborts a whole write transaction (a batch of 150 KB entries copied for nothing) and makes every
  other process remap; starting at the budget made a cold write of 150 MB cost 0.37 instead of 0.60 ms per entry
  on ext4, 0.24 instead of 0.27 on tmpfs (measured here, under load). The map is address space, not memory: a
  tmpfs file written through it stays sparse. Entries are admitted against
  ``usable_bytes`` (budget minus 1/32 headroom for B-tree pages), counted in page-rounded bytes inside the same write
  transaction as the data, so several processes sharing the directory keep one consistent count.
- **Policy when full**: ``"keep"`` (default) admits nothing more, so a data set larger than the budget keeps a
  stable subset and every later epoch hits ``budget/dataset`` of its samples (an LRU under a sequential or shuffled
  scan evicts each entry before its next use and hits ~0). ``"fifo"`` evicts the oldest entries to make room, for
  working sets that drift.
- **Process safety**: a tier holds no handle of its own. Each process keeps its environments (one per path: LMDB
  forbids two) in a :class:`~lightning_accel._utils.forksafe.PerProcess` registry, opened lazily, so a pickled tier
  carries none and a forked child starts with none. LMDB serialises writers across processes; readers never see a
  partial transaction, so a warm-up killed halfway leaves only complete entries.
- **Faults**: a directory that cannot be created or written, or a full disk, disables the tier with one warning per
  process; callers keep working with the remaining tiers.
- **Ownership**: a RAM tier (``name="ram"``, or ``marker=True``) writes :data:`TIER_MARKER` into its directory when it
  creates it (missing or empty when first opened; owner pid/host/user and creation time, :func:`read_marker`).
  Cleaning up RAM tiers (:mod:`~lightning_accel.data.lifecycle`) considers only directories that carry it, so nothing
  the package did not create is ever removed. No tier, marked or not, opens a directory holding an LMDB database
  other than a tier's (its ``data.mdb`` would gain the tier's databases and entries): the tier is disabled with one
  warning instead.
- Thread safety: every operation holds a per-process lock for its transaction (``set_mapsize`` must not run while
  another thread of the process has a transaction open), so a read-ahead thread and the main thread can share a tier.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_accel._utils.checks import check_bool, check_bytes, check_choice, check_int
from lightning_accel._utils.forksafe import PerProcess

__all__ = [
    "LMDB_FILES",
    "TIER_MARKER",
    "BudgetTooSmallError",
    "LmdbTier",
    "PutResult",
    "default_ram_dir",
    "parse_bytes",
    "read_marker",
    "write_marker",
]

TIER_MARKER = ".lightning-accel-tier.json"
LMDB_FILES = ("data.mdb", "lock.mdb")  # what an LMDB environment (subdir=True) creates in its directory
_MARKER_FORMAT = "lightning-accel-ram-tier"

_INITIAL_MAP = 64 << 20
_U64x2 = struct.Struct("<QQ")
_U64 = struct.Struct(">Q")  # big-endian so the fifo database iterates in insertion order
_K_USED = b"used"
_K_SEQ = b"seq"


class _SharedLock:
    """Read transactions share it; writes, ``set_mapsize`` and closing at fork hold it alone (reentrant).

    Reads share so that several threads of one process can copy batches out of the map at once (the copies and
    CRC-32 release the GIL); waiting exclusive holders go first so readers cannot starve them.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            self._waiting += 1
            while self._owner is not None or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            mine = self._owner == me
            if not mine:
                while self._owner is not None or self._waiting:
                    self._cond.wait()
                self._readers += 1
        try:
            yield
        finally:
            if not mine:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()


@dataclass
class _Env:
    """One environment open in this process, with its named databases and page size."""

    env: Any
    dbs: dict[str, Any] = field(default_factory=dict)
    psize: int = 4096
    # With `writemap` (tmpfs), a descriptor of the data file through which each write transaction reserves the pages
    # it may add (`LmdbTier._reserve`): a write through the map into a full tmpfs is a SIGBUS, not an error.
    reserve_fd: int | None = None

    def close(self) -> None:
        self.env.close()
        if self.reserve_fd is not None:
            os.close(self.reserve_fd)
            self.reserve_fd = None


# This process's environments by real path, and the lock every tier operation of this process holds for its
# transaction (shared by reads). Both are PerProcess: a forked or spawned child starts with its own, empty.
_ENVS: PerProcess[dict[str, _Env]] = PerProcess(dict)
_LOCK: PerProcess[_SharedLock] = PerProcess(_SharedLock)


# What PerProcess cannot do alone: an LMDB environment must not cross a fork at all. A child can neither reopen a
# path it inherited open (py-lmdb refuses: "already open in this process", checked with py-lmdb 3.0) nor safely
# close the inherited copy (closing aborts the transactions it still lists, which are the parent threads' entries in
# the shared reader table, and waits for a parent thread's write transaction that never ends in the child). So the
# parent closes its environments just before a fork, holding the lock exclusively so that no transaction is open and
# none starts until the fork is done, and reopens them lazily afterwards (one cheap open each); the child starts with an
# empty registry and a fresh lock (PerProcess).
def _close_before_fork() -> None:
    _LOCK.get().acquire()
    envs = _ENVS.get()
    for e in envs.values():
        with contextlib.suppress(Exception):
            e.close()
    envs.clear()


def _release_after_fork() -> None:
    _LOCK.get().release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_close_before_fork, after_in_parent=_release_after_fork)


class BudgetTooSmallError(ValueError):
    """A single entry does not fit in a tier's byte budget."""


class _FilesystemFull(OSError):
    """The filesystem under a tier that writes through its map cannot hold the pages a write needs."""


@dataclass
class PutResult:
    """What one batched write did."""

    stored: int = 0
    rejected: int = 0  # not admitted: the tier is full under the "keep" policy (or already present elsewhere)
    evicted: int = 0
    # positions (in the items passed) that were not stored and that no process had stored before: the tier is full
    # or failed. A caller with another tier stores these there (the RAM tier's overflow goes to the SSD).
    not_stored: list[int] = field(default_factory=list)


def default_ram_dir(tag: str) -> str | None:
    """A per-node RAM-tier directory on tmpfs (``/dev/shm/lightning_accel/<tag>``, or under
    ``$LIGHTNING_ACCEL_RAM_ROOT`` when set), or None when there is no tmpfs."""
    root = os.environ.get("LIGHTNING_ACCEL_RAM_ROOT")
    if root:
        # absolute: a process started in another working directory (a worker, a spawned rank) opens the same tier
        return os.path.abspath(os.path.join(os.path.expanduser(root), tag))
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return os.path.join("/dev/shm", "lightning_accel", tag)
    return None


def write_marker(path: str, note: str | None = None) -> None:
    """Write the tier marker into the directory ``path`` unless it is there already (atomically: a sweep never reads
    half a marker). It says who created the tier and when, and ``note`` what it caches (shown by the cleanup)."""
    import getpass
    import json
    import socket
    import time

    from lightning_accel._utils.atomic import atomic_write_text

    target = os.path.join(path, TIER_MARKER)
    if os.path.lexists(target):
        return
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without passwd entry)
        user = str(os.getuid())
    doc = {
        "format": _MARKER_FORMAT,
        "owner": {"pid": os.getpid(), "host": socket.gethostname(), "user": user},
        "created": time.time(),
    }
    if note:
        doc["note"] = note
    atomic_write_text(target, json.dumps(doc))


def read_marker(path: str) -> dict[str, Any] | None:
    """The marker of the tier directory ``path`` (``{"owner": {...}, "created": ...}``), or None when ``path`` carries
    no valid marker (a regular file, not a link, written by :func:`write_marker`)."""
    import json
    import stat

    target = os.path.join(path, TIER_MARKER)
    try:
        if not stat.S_ISREG(os.lstat(target).st_mode):
            return None
        with open(target, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _MARKER_FORMAT:
        return None
    return doc


def _on_tmpfs(path: str) -> bool:
    """True when ``path`` lies on a tmpfs (the longest mount point of ``/proc/self/mounts`` above it)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:  # not Linux: the plain path
        return False
    return fstype == "tmpfs"


_TIER_DBS = ("data", "index", "fifo", "meta")  # the named databases of a tier's LMDB environment


def _foreign_contents(path: str) -> str | None:
    """What in the non-empty directory ``path`` the tier must not write into, or None.

    Opening an LMDB environment writes into the ``data.mdb`` there: an LMDB database of the user's would gain the
    tier's databases and entries. A ``data.mdb`` holding only a tier's named databases is a tier's (one made before
    markers, or whose marker could not be written); other files beside the tier's are left alone either way.
    """
    if read_marker(path) is not None or not os.path.isfile(os.path.join(path, "data.mdb")):
        return None
    return None if _tier_dbs_only(path) else "an LMDB database (data.mdb)"


def _tier_dbs_only(path: str) -> bool:
    """True when the LMDB environment at ``path`` holds nothing but a tier's named databases (read-only, no lock;
    only when this process has no environment open there: LMDB forbids opening one twice in a process)."""
    import lmdb

    try:
        env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=0, readahead=False)
    except lmdb.Error:
        return False
    try:
        with env.begin() as txn:
            names = {bytes(k).decode("utf-8", "replace") for k, _ in txn.cursor()}
    except lmdb.Error:
        return False
    finally:
        env.close()
    return names <= set(_TIER_DBS)


def _open_env(path: str, key: str, map_size: int, sync: bool) -> _Env:
    """This process's environment at ``path`` (``key``: its real path), opened now if needed; holds ``_LOCK``."""
    import lmdb

    envs = _ENVS.get()
    opened = envs.get(key)
    if opened is not None:
        return opened
    os.makedirs(path, exist_ok=True)
    writemap = _on_tmpfs(path)
    env = lmdb.open(
        path,
        map_size=map_size,
        subdir=True,
        max_dbs=4,
        # A cache is re-derivable: no fsync per commit (a killed process loses nothing committed; only an OS crash
        # may drop the last commits, and checksums catch anything torn): an fsync per commit would dominate batched
        # writes.
        sync=sync,
        metasync=sync,
        readahead=False,  # random reads of large values: readahead only evicts useful page-cache pages
        # On tmpfs, commits write straight into the memory map instead of into malloc'd pages copied to the file at
        # commit: one copy of each 150 KB entry fewer (0.147 -> 0.115 ms per put, best of 4 here). On ext4 the map's
        # write faults cost more than the copy (0.118 -> 0.199 ms): there, the plain path. The file never exceeds
        # the map either way, and the map is capped at the budget.
        writemap=writemap,
        meminit=False,
        max_readers=512,
        max_spare_txns=2,
    )
    try:
        with env.begin(write=True) as txn:
            dbs = {n: env.open_db(n.encode(), txn=txn) for n in _TIER_DBS}
        opened = _Env(env, dbs, int(env.stat()["psize"]))
        if writemap:
            opened.reserve_fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR | os.O_CLOEXEC)
    except BaseException:
        env.close()
        raise
    envs[key] = opened
    return opened


class LmdbTier:
    """A byte-budgeted LMDB key/value tier shared by every process that opens the same directory.

    Args:
        path: a directory on a local filesystem (never a network filesystem: LMDB's locks need local mmap).
        budget_bytes: hard cap on the data file; ``None`` for no cap (map grows without bound).
        name: label used in warnings and statistics (``"ssd"``, ``"ram"``).
        policy: ``"keep"`` (admit nothing when full) or ``"fifo"`` (evict oldest to make room).
        sync: fsync every commit (off by default; see the module notes).
        marker: write :data:`TIER_MARKER` when the tier is opened in a directory it creates (missing or empty), so
            tier cleanup may remove the directory later (``None``: for a RAM tier, ``name="ram"``).
        note: what the tier caches, recorded in the marker so that ``lightning-accel data clean`` can say whose
            tier a directory is (the data module records its ``cache_dir``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        budget_bytes: int | None,
        *,
        name: str = "ssd",
        policy: str = "keep",
        sync: bool = False,
        marker: bool | None = None,
        note: str | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"LmdbTier: `name` must be a non-empty string (the label of warnings and statistics), got {name!r}. "
                'Use e.g. name="ssd" or name="ram".'
            )
        check_int(f"{name}_bytes", budget_bytes, low=0, allow_none=True, fix="None: no cap.")
        check_choice("policy", policy, ("keep", "fifo"))
        check_bool("sync", sync)
        self.path = os.fspath(path)
        self._key = os.path.realpath(self.path)  # one environment per directory, however it is spelt
        self.budget_bytes = budget_bytes
        self.name = name
        self.policy = policy
        self.sync = sync
        self.marker = name == "ram" if marker is None else bool(marker)
        self.note = note
        self.disabled = budget_bytes == 0
        self.disabled_reason: str | None = "budget is 0" if self.disabled else None
        self._psize = 4096  # LMDB's page size, known once opened (the same in every process)
        self._usable_override: int | None = None
        self._warned_full = False

    # ---- environment ---------------------------------------------------------------------------------------------
    @property
    def _lock(self) -> _SharedLock:
        """This process's tier lock (one for every tier: see the fork handling above)."""
        return _LOCK.get()

    def _opened(self) -> _Env | None:
        """This process's environment of this tier, or None (not opened yet here, or closed by a fork since)."""
        return _ENVS.get().get(self._key)

    @property
    def _env(self) -> Any:
        """This process's LMDB environment, or None before :meth:`open`."""
        opened = self._opened()
        return None if opened is None else opened.env

    @property
    def _dbs(self) -> dict[str, Any]:
        """The named databases (``data``, ``index``, ``fifo``, ``meta``) of this process's environment."""
        opened = self._opened()
        return {} if opened is None else opened.dbs

    @property
    def cap_bytes(self) -> int | None:
        """The most the map (and so the data file) may grow to."""
        if self.budget_bytes is None:
            return None
        return max(self._psize * 8, self.budget_bytes - self.budget_bytes % self._psize)

    @property
    def usable_bytes(self) -> int | None:
        """Entry bytes admitted before the tier counts as full (budget minus B-tree headroom)."""
        cap = self.cap_bytes
        if cap is None:
            return None
        usable = cap - max(cap // 32, 4 * self._psize)
        if self._usable_override is not None:
            usable = min(usable, self._usable_override)
        return max(0, usable)

    def _disable(
        self,
        err: BaseException,
        fix: str = "Point the cache at a writable local directory with free space to re-enable it.",
    ) -> None:
        if not self.disabled:
            self.disabled = True
            self.disabled_reason = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"lightning_accel cache: the {self.name} tier at {self.path!r} is disabled ({self.disabled_reason}); "
                f"training continues with the remaining tiers. {fix}",
                RuntimeWarning,
                stacklevel=3,
            )

    def open(self) -> bool:
        """Open (or reuse) this process's environment; False when the tier is disabled."""
        if self.disabled:
            return False
        opened = self._opened()
        if opened is None:
            with self._lock:
                try:
                    cap = self.cap_bytes
                    initial = _INITIAL_MAP if cap is None else cap  # see "Budget never exceeded" above
                    # Only a directory this tier creates (missing or empty before the environment is opened) becomes
                    # a marked tier: one that held anything, an LMDB database of the user's included (the same
                    # data.mdb/lock.mdb), is never offered to the cleanup. Decided before opening, which creates
                    # the files; a tier marked before keeps its marker.
                    fresh = not os.path.isdir(self.path) or not os.listdir(self.path)
                    mark = self.marker and fresh
                    # Any tier, marked or not: the SSD tier (`cache_dir/ssd`) wrote its databases into an LMDB
                    # database of the user's found there.
                    if (
                        not fresh
                        and self._key not in _ENVS.get()  # open in this process already: a tier's
                        and (foreign := _foreign_contents(self.path)) is not None
                    ):
                        self._disable(
                            FileExistsError(f"it holds {foreign} this cache did not create, left untouched"),
                            f"Point the {self.name} tier at a new or empty directory to re-enable it.",
                        )
                        return False
                    opened = _open_env(self.path, self._key, initial, self.sync)
                    if mark and set(os.listdir(self.path)) <= set(LMDB_FILES):
                        write_marker(self.path, self.note)
                except Exception as e:  # lmdb.Error, OSError (read-only dir, ENOSPC, ...)
                    self._disable(e)
                    return False
        self._psize = opened.psize
        return True

    # ---- reads ---------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reader(self) -> Iterator[Callable[[bytes], memoryview | None]]:
        """``with tier.reader() as get:`` ``get(key)`` returns a zero-copy view valid inside the block, or None.

        Several threads may read at once; do not call other methods of a tier inside the block.
        """
        import lmdb

        for _ in range(3):
            if not self.open():
                break
            resized = False
            err: BaseException | None = None
            with self._lock.shared():
                opened = self._opened()
                if opened is None:  # a fork closed it between open() and here: open it again
                    continue
                try:
                    txn = opened.env.begin(db=opened.dbs["data"], buffers=True)
                except lmdb.MapResizedError:
                    resized = True
                except Exception as e:
                    err = e
                else:
                    try:
                        yield txn.get
                    finally:
                        txn.abort()
                    return
            if not resized:
                self._disable(err if err is not None else RuntimeError("cannot begin a read transaction"))
                break
            with self._lock:  # another process grew the map: adopt its size (no transaction may be open)
                opened = self._opened()
                if opened is not None:
                    opened.env.set_mapsize(0)
        yield lambda key: None

    def get(self, key: bytes) -> bytes | None:
        """A copy of the value under ``key``, or None."""
        with self.reader() as get:
            v = get(key)
            return None if v is None else bytes(v)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` are stored (one read transaction; none while no process has created the environment)."""
        if self._opened() is None and not os.path.exists(os.path.join(self.path, "data.mdb")):
            # Nothing was ever stored here, and opening would create the environment only for the next fork to close
            # it again: the main process asks this before its cold epoch's workers start, on the way to the first
            # batch. Another process creating it meanwhile makes its first samples look missing here: read ahead from
            # the origin once more, never read wrong (reads look the tiers up themselves).
            return [False] * len(keys)
        with self.reader() as get:
            return [get(k) is not None for k in keys]

    def scan_keys(self, prefix: bytes, after: bytes | None = None, limit: int = 64) -> list[bytes]:
        """Up to ``limit`` keys that start with ``prefix``, in key order, after the key ``after`` (``None``: from the
        first); an empty list at the end. Keys only: the values stay in the map."""
        out: list[bytes] = []
        with self.reader() as get:
            txn = getattr(get, "__self__", None)  # the read transaction behind `get` (None: the tier is unusable)
            if txn is None:
                return out
            cur = txn.cursor()
            if not cur.set_range(after if after is not None else prefix):
                return out
            for k in cur.iternext(keys=True, values=False):
                k = bytes(k)
                if not k.startswith(prefix):
                    break
                if after is not None and k == after:
                    continue
                out.append(k)
                if len(out) >= limit:
                    break
        return out

    def __len__(self) -> int:
        with self._lock:
            if not self.open():
                return 0
            with self._env.begin() as txn:
                return int(txn.stat(self._dbs["index"])["entries"])

    def used_bytes(self) -> int:
        """Entry bytes currently accounted against the budget (page-rounded)."""
        with self._lock:
            if not self.open():
                return 0
            with self._env.begin(db=self._dbs["meta"]) as txn:
                v = txn.get(_K_USED)
            return 0 if v is None else _U64.unpack(v)[0]

    def file_bytes(self) -> int:
        """Size of the data file on disk."""
        try:
            return os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            return 0

    # ---- writes --------------------------------------------------------------------------------------------------
    def cost(self, key: bytes, value_len: int) -> int:
        """Bytes one entry is accounted for: whole overflow pages for large values (LMDB stores them so)."""
        ps = self._psize
        if value_len > ps // 2:
            return -(-(value_len + 16) // ps) * ps + len(key) + 64
        return value_len + len(key) + 64

    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> PutResult:
        """Store ``(key, value)`` pairs in one write transaction (keys already present are left alone).

        Raises:
            BudgetTooSmallError: one entry alone exceeds the usable budget (message has both numbers).
        """

        with self._lock:
            return self._put_many(items)

    def _put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> PutResult:
        import lmdb

        res = PutResult()
        if not items:
            return res
        if not self.open():
            res.not_stored.extend(range(len(items)))
            return res
        for _ in range(64):
            try:
                if self.policy == "fifo" and self.usable_bytes is not None:
                    # Evict in a transaction of its own: LMDB reuses freed pages only after the freeing commit.
                    with self._env.begin(write=True) as txn:
                        res.evicted += self._make_room(txn, items)
                with self._env.begin(write=True) as txn:
                    r = self._put_txn(txn, items)
                r.evicted += res.evicted
                return r
            except lmdb.MapFullError:
                cur = int(self._env.info()["map_size"])
                cap = self.cap_bytes
                if cap is None or cur < cap:
                    self._env.set_mapsize(cur * 2 if cap is None else min(cap, cur * 2))
                    continue
                # The map is at the budget: B-tree pages (or old snapshots held by readers) need more than the
                # headroom. Write in smaller transactions; a single entry that still does not fit lowers the
                # admission limit for this process, so the budget holds.
                if len(items) > 1:
                    mid = len(items) // 2
                    a, b = self._put_many(items[:mid]), self._put_many(items[mid:])
                    return PutResult(
                        a.stored + b.stored,
                        a.rejected + b.rejected,
                        res.evicted + a.evicted + b.evicted,
                        a.not_stored + [mid + i for i in b.not_stored],
                    )
                used = self.used_bytes()
                one = self.cost(items[0][0], len(items[0][1]))
                self._usable_override = max(0, used - one) if self.policy == "fifo" else used
                if self.policy != "fifo" or self._usable_override == 0:
                    res.rejected += len(items)
                    res.not_stored.extend(range(len(items)))
                    return res
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
            except BudgetTooSmallError:
                raise
            except _FilesystemFull as e:
                # As at the budget: the tier keeps what it holds and admits nothing more (a "fifo" tier still
                # replaces its oldest entries, whose pages it reuses).
                self._filesystem_full(e)
                res.rejected += len(items)
                res.not_stored.extend(range(len(items)))
                return res
            except Exception as e:  # ENOSPC, read-only filesystem, ...
                self._disable(e)
                return PutResult(rejected=len(items), not_stored=list(range(len(items))))
        res.rejected += len(items)
        res.not_stored.extend(range(len(items)))
        return res

    def _check_fits(self, key: bytes, value_len: int, usable: int) -> int:
        c = self.cost(key, value_len)
        if c > usable and self._usable_override is None:
            raise BudgetTooSmallError(
                f"`{self.name}_bytes` budget {self.budget_bytes} bytes leaves {usable} usable bytes, less "
                f"than one cached sample ({c} bytes for a {value_len}-byte entry). Raise `{self.name}_bytes` "
                f"to at least {2 * c} bytes, or set it to 0 to disable the {self.name} tier."
            )
        return c

    def _make_room(self, txn: Any, items: Sequence[tuple[bytes, bytes | bytearray]]) -> int:
        usable = self.usable_bytes
        assert usable is not None
        meta, index = self._dbs["meta"], self._dbs["index"]
        raw = txn.get(_K_USED, db=meta)
        used = 0 if raw is None else _U64.unpack(raw)[0]
        need = sum(self._check_fits(k, len(v), usable) for k, v in items if txn.get(k, db=index) is None)
        if used + need <= usable:
            return 0
        self._reserve(0, 2 * len(items))  # the B-tree pages the evictions copy
        used, n = self._evict_oldest(txn, used, used + need - usable)
        txn.put(_K_USED, _U64.pack(used), db=meta)
        return n

    def _put_txn(self, txn: Any, items: Sequence[tuple[bytes, bytes | bytearray]]) -> PutResult:
        self._reserve(sum(self.cost(k, len(v)) for k, v in items), len(items))
        data, index, fifo, meta = (self._dbs[n] for n in ("data", "index", "fifo", "meta"))
        res = PutResult()
        raw = txn.get(_K_USED, db=meta)
        used = 0 if raw is None else _U64.unpack(raw)[0]
        raw = txn.get(_K_SEQ, db=meta)
        seq = 0 if raw is None else _U64.unpack(raw)[0]
        usable = self.usable_bytes
        for pos, (key, value) in enumerate(items):
            if txn.get(key, db=index) is not None:
                res.rejected += 1  # another worker/rank stored it first
                continue
            c = self.cost(key, len(value))
            if usable is not None:
                c = self._check_fits(key, len(value), usable)
                if used + c > usable:
                    res.rejected += 1
                    res.not_stored.append(pos)
                    continue
            txn.put(key, value, db=data)
            txn.put(key, _U64x2.pack(seq, c), db=index)
            txn.put(_U64.pack(seq), key, db=fifo)
            used += c
            seq += 1
            res.stored += 1
        txn.put(_K_USED, _U64.pack(used), db=meta)
        txn.put(_K_SEQ, _U64.pack(seq), db=meta)
        return res

    def _reserve(self, nbytes: int, entries: int) -> None:
        """Inside a write transaction (LMDB's writer lock, across processes): when this tier writes through its map
        (tmpfs), allocate the data file's pages past the last one in use for ``nbytes`` of entries plus the B-tree
        pages ``entries`` writes may copy, so that the filesystem refuses them here, as an error, instead of
        killing the process with SIGBUS at the write. Pages below the last one in use are allocated already (LMDB
        reuses them); the reservation past it is what the next transactions fill.

        Raises:
            _FilesystemFull: the filesystem has no room for them.
        """
        opened = self._opened()
        if opened is None or opened.reserve_fd is None:
            return
        info = self._env.info()
        start = (int(info["last_pgno"]) + 1) * self._psize
        length = min(nbytes + (4 * entries + 32) * self._psize, int(info["map_size"]) - start)
        if length <= 0:
            return
        try:
            os.posix_fallocate(opened.reserve_fd, start, length)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _FilesystemFull(e.errno, f"no room for {length} more bytes in {self.path}") from e
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                opened.reserve_fd = None  # cannot reserve here: write as before
                return
            raise

    def _filesystem_full(self, err: OSError) -> None:
        """Treat the tier as full at what it holds now (see :meth:`_reserve`), with one warning per process."""
        used = self.used_bytes()
        self._usable_override = used
        if not self._warned_full:
            self._warned_full = True
            try:
                st = os.statvfs(self.path)
                free = f"{st.f_bavail * st.f_frsize} bytes free"
            except OSError:
                free = "free space unknown"
            warnings.warn(
                f"lightning_accel cache: the filesystem of the {self.name} tier at {self.path!r} is full ({free}, "
                f"{err.strerror}) at {used} of its {self.budget_bytes}-byte budget: the tier keeps what it holds and "
                f"admits nothing more. Give that filesystem more room (for /dev/shm in Docker: `--shm-size`) or "
                f"lower `{self.name}_bytes`.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _evict_oldest(self, txn: Any, used: int, need: int) -> tuple[int, int]:
        fifo = self._dbs["fifo"]
        freed = n = 0
        cur = txn.cursor(db=fifo)
        while freed < need and cur.first():
            seq_b, key = cur.item()
            key = bytes(key)
            cur.delete()
            rec = txn.get(key, db=self._dbs["index"])
            if rec is None:
                continue
            seq, c = _U64x2.unpack(rec)
            if _U64.pack(seq) != bytes(seq_b):
                continue  # stale record of a key that was deleted and stored again later
            txn.delete(key, db=self._dbs["data"])
            txn.delete(key, db=self._dbs["index"])
            freed += c
            n += 1
        return used - freed, n

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` (e.g. corrupt entries); returns how many were present."""
        with self._lock:
            return self._delete(keys)

    def _delete(self, keys: Sequence[bytes]) -> int:
        import lmdb

        if not keys or not self.open():
            return 0
        for _ in range(8):
            try:
                with self._env.begin(write=True) as txn:
                    self._reserve(0, len(keys))
                    meta = self._dbs["meta"]
                    raw = txn.get(_K_USED, db=meta)
                    used = 0 if raw is None else _U64.unpack(raw)[0]
                    n = 0
                    for k in keys:
                        rec = txn.get(k, db=self._dbs["index"])
                        if rec is None:
                            continue
                        seq, c = _U64x2.unpack(rec)
                        txn.delete(k, db=self._dbs["data"])
                        txn.delete(k, db=self._dbs["index"])
                        txn.delete(_U64.pack(seq), db=self._dbs["fifo"])
                        used = max(0, used - c)
                        n += 1
                    txn.put(_K_USED, _U64.pack(used), db=meta)
                return n
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
            except lmdb.MapFullError:
                self._env.set_mapsize(int(self._env.info()["map_size"]) + 16 * self._psize)
            except Exception as e:
                self._disable(e)
                return 0
        return 0

    def flush(self) -> None:
        """fsync the environment (end of a warm-up)."""
        if self.open():
            with self._lock.shared(), contextlib.suppress(Exception):
                opened = self._opened()
                if opened is not None:
                    opened.env.sync(True)

    def clear(self) -> None:
        """Drop every entry (the directory and its budget stay)."""
        with self._lock:
            if not self.open():
                return
            with self._env.begin(write=True) as txn:
                for n in ("data", "index", "fifo", "meta"):
                    txn.drop(self._dbs[n], delete=False)
            self._usable_override = None

    def __repr__(self) -> str:
        return (
            f"LmdbTier(name={self.name!r}, path={self.path!r}, budget_bytes={self.budget_bytes}, "
            f"policy={self.policy!r})"
        )


def parse_bytes(value: int | str | None, *, name: str) -> int | None:
    """``1073741824``, ``"1GiB"``, ``"512MB"``, ``"0"`` -> bytes; ``None`` stays None (no cap). Delegates to
    :func:`~lightning_accel._utils.checks.check_bytes`.

    Raises:
        TypeError: ``value`` is neither an integer, a string nor None (a bool included), naming ``name``.
        ValueError: naming ``name`` and the value, with the accepted forms.
    """
    return check_bytes(name, value, allow_none=True)
