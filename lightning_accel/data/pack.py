"""Packed origins: many samples per object, so a cold epoch from an object store costs a few large GETs.

An ImageFolder tree on S3 costs one GET per sample. Object stores serve small GETs at a fixed per-request price
(latency, request CPU on both ends, request fees), so a cold epoch over small JPEGs is bound by requests, not bytes:
the moto endpoint of the benchmark serves ~400 GET/s at best, and s3fs issues ~150/s per process. LitData
(``optimize``) and MosaicML Streaming (MDS) solve it the same way: write the samples once into large shard objects
and read whole shards. :func:`pack_origin` does that here, keeping each sample's *original* bytes (the cache still
decodes them with the user's ``decode``), so bytes read from the store equal the data set's bytes.

Layout under the packed origin (documented in ``docs/data.md``):

- ``shards/000000.bin``, ...: the samples' original bytes, concatenated (no headers; nothing to unpickle);
- ``lightning-accel-pack.json``, written last (a reader never sees a half-written pack): format and version, class
  names, the shards' keys and sizes, and per sample its key, label, shard, byte offset, size and CRC-32;
- ``lightning-accel-pack.writing.json`` while a pack is being written: every key the writer may create or replace,
  published before it touches any of them and removed when the pack is complete, so a pack killed halfway leaves
  only files a later :func:`pack_origin` knows as its own;
- ``.lightning-accel-pack.lock`` while a local pack is being written: the file its exclusive ``flock`` is on, so two
  packs into one destination never write at once (removed when the pack ends; one a killed pack left is taken over).

:func:`pack_origin` writes into a destination that is missing, empty, or holds only a pack of its own (and with
``overwrite`` replaces that pack): a file no pack wrote is never overwritten or removed.

:func:`~lightning_accel.data.origin.list_origin` recognises the index, and :class:`PackedReader` reads samples:

- from a local pack, with one ranged read of the shard file per sample;
- from a remote pack, by staging whole shards (one GET each) in a node-local directory shared by every DataLoader
  worker and rank of the node (a POSIX lock per shard: one process downloads, the others wait and read the file),
  then reading samples from the staged file. Read-ahead (:meth:`PackedReader.prefetch`) stages the shards of
  upcoming misses on the store's thread pool. Read-ahead is accounted per node, not per process: a shard staged
  ahead carries an ``.ahead`` marker file in the stage directory until some reader of the node has read from it, and
  a ``.need`` marker per upcoming batch of a rank's order that reads from it until that batch is read
  (:meth:`PackedReader.need`); marked shards are capped at ``stage_bytes`` less one shard for the whole node, and
  eviction takes a marked shard only when nothing else can go, so a slow consumer does not lose a shard it was about
  to read; a reader whose new shard would evict one that only earlier batches of its order still need waits for
  them instead (:meth:`PackedReader.reading`). Staged shards are evicted least recently used first beyond
  ``stage_bytes``; with ``stage_bytes`` at least the pack's size, a shuffled cold epoch reads every shard exactly
  once, and under the shard-window shuffle (:mod:`lightning_accel.data.sampler`) a stage of a few windows is enough.

Every sample read is checked against its CRC-32: a staged copy that fails is deleted and fetched again, a sample that
fails straight from the store is an :class:`~lightning_accel.data.origin.OriginError` naming the shard and the key.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import hashlib
import json
import mmap
import os
import posixpath
import random
import re
import threading
import time
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from lightning_accel._utils.atomic import atomic_publish_file
from lightning_accel._utils.checks import check_bool, check_callable, check_int
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess, ResetOnPickle
from lightning_accel._utils.paths import safe_join
from lightning_accel._utils.processes import process_running
from lightning_accel.data.origin import (
    _CONCURRENCY_FIX,
    IMAGE_EXTENSIONS,
    MAX_CONCURRENCY,
    Listing,
    ObjectStore,
    OriginError,
    check_storage_options,
    list_origin,
    text_bytes,
)

__all__ = ["PACK_INDEX", "PackInUseError", "PackIndex", "PackedReader", "pack_origin"]

PACK_INDEX = "lightning-accel-pack.json"
PACK_FORMAT = "lightning-accel-pack"
PACK_VERSION = 1
# What a pack being written owns at its destination (see `_claim_dest`): written before any shard, removed last.
PACK_JOURNAL = "lightning-accel-pack.writing.json"
_JOURNAL_FORMAT = "lightning-accel-pack-writing"
# The file a local pack being written holds an exclusive `flock` on, from before it checks the destination until its
# journal is removed: two packs started at once cannot both pass the in-use check (a map shows only once the journal
# is written). Created and removed by `pack_origin` only; one left by a killed pack is taken over as its own.
PACK_LOCK = ".lightning-accel-pack.lock"
# The temporary name a local atomic publish of the index or the journal leaves behind when killed (`_utils.atomic`).
_OWN_TMP = re.compile(r"\.lightning-accel-pack(\.writing)?\.json\.[0-9a-f]{32}\.tmp")
DEFAULT_SHARD_BYTES = 16 << 20  # S3 reaches full per-request throughput at ~8-16 MB objects
MAX_SHARD_BYTES = 4 << 30  # shards are built in memory
DEFAULT_STAGE_BYTES = 4 << 30
_TOUCH_S = 0.5  # how often a process refreshes a staged shard's "last used" time while it reads from it
# A marker older than this protects nothing, whatever its process says: a backstop behind the pid checks. Far longer
# than any step between a read-ahead and its read.
_AHEAD_TTL_S = 900.0
# Staged shards each process keeps mapped (least recently used dropped first): a sample read from a mapped shard needs
# no open, and a shard evicted while this process still reads it stays readable through its map (see `read`).
_MAPPED = 4
# How long a reader that would have to evict a shard still needed by an earlier batch of its own order waits for that
# batch to be read (see `PackedReader._wait_for_room`), and how often it looks. The earlier batch's reader never waits
# for this one, so the wait ends when it has read; the bound is a backstop for a reader that vanished unnoticed.
_ROOM_WAIT_S = 60.0
_ROOM_POLL_S = 0.02


# A staged shard's file name (see `PackedReader.__init__`): eviction touches no other file of the stage directory.
_STAGED = re.compile(r"[0-9a-f]{20}\.shard")
# An order's name in "needed" markers: its publisher's id in hex and its epoch counter (a file name, never a path).
_GROUP = re.compile(r"[0-9a-f]{1,16}-[0-9]{1,18}")
_PID_SHIFT = 20  # a publisher id is its process id shifted left by this, plus random low bits


class PackInUseError(OSError):
    """:func:`pack_origin` was asked to write into a local pack that another running process reads or writes."""


def _hold(path: str) -> mmap.mmap | None:
    """Map the local pack file ``path`` (its index, or the journal of a pack being written) for as long as the returned
    map lives, so that the pack shows as in use in this process's ``/proc/<pid>/maps`` (and in its forked DataLoader
    workers', which inherit the map): see :func:`_refuse_if_in_use`. None when it cannot be mapped (gone, empty,
    unreadable): nothing to protect."""
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


# The live readers of each local pack in this process (realpath of the pack -> readers): `/proc/<pid>/maps` cannot tell
# this process's own readers from the map of the pack it is writing, so they are counted here. Weak: a reader that was
# garbage-collected no longer counts; a closed one (see `PackedReader.close`) drops out at once.
_LIVE_READERS: dict[str, weakref.WeakSet[PackedReader]] = {}
_LIVE_LOCK = threading.Lock()


def _readers_here(root: str) -> list[PackedReader]:
    """This process's live, unclosed :class:`PackedReader` objects of the local pack at ``root``."""
    key = os.path.realpath(root)
    with _LIVE_LOCK:
        live = [r for r in _LIVE_READERS.get(key, ()) if r._hold is not None]
    if live:
        # A reader dropped by its user may sit in a reference cycle (a data module and its cache) until the next
        # collection: collect once, at pack time only, so "del dm" is enough.
        del live
        gc.collect()
        with _LIVE_LOCK:
            live = [r for r in _LIVE_READERS.get(key, ()) if r._hold is not None]
    return live


def _refuse_if_in_use(dst: ObjectStore) -> None:
    """Refuse to write into the local pack at ``dst`` while another process has it open: reads it, or writes it.

    Why: a local pack is read one ranged read of a shard file per sample, by name, so a reader (a fit's main process
    and DataLoader workers) whose pack was replaced mid-epoch read other samples' bytes at its old offsets and failed
    its CRC-32 check, or found a shard gone; and two packs writing one destination overwrite each other's shards.
    Every :class:`PackedReader` of a local pack keeps its index mapped, a pack being written its journal, and the
    maps of every process are what ``lightning-accel data clean`` already reads to find a RAM tier in use
    (:func:`~lightning_accel.data.lifecycle.mapping_pids`). This process's own maps include the journal of the pack
    it writes, so its own readers are counted from a weak registry instead (a reader garbage-collected or closed no
    longer counts). Another user's processes, whose maps cannot be read, are not seen.

    Raises:
        PackInUseError: one line naming ``dst``, the processes (or this process's reader) and the fix.
    """
    from lightning_accel.data.lifecycle import mapping_pids

    here = _readers_here(dst.root)
    if here:
        raise PackInUseError(
            f"`dest` {dst.url!r} is a pack in use: this process has {len(here)} PackedReader(s) of it open (a "
            "CachedDataModule or dataset built on it); nothing was removed. Drop them first (`del` the data module, "
            "dataset or reader, or call `PackedReader.close()`), or pack into another folder."
        )
    others = [p for p in mapping_pids(dst.root) or () if p != os.getpid()]
    if not others:
        return
    try:
        with open(f"/proc/{others[0]}/comm") as f:
            name = f" ({f.read().strip()})"
    except OSError:
        name = ""
    more = f" and {len(others) - 1} more process(es)" if len(others) > 1 else ""
    raise PackInUseError(
        f"`dest` {dst.url!r} is a pack in use: pid {others[0]}{name}{more} has it open (a fit reading it, or "
        "another pack writing it); nothing was removed. Stop that process first (or let it finish), or pack into "
        "another folder and point the next run at it."
    )


def new_publisher_id() -> int:
    """An id for a process that publishes epoch orders (a rank's main process): its pid in the high bits, so a
    reader can tell that an order's publisher died (its "needed" markers then protect nothing), and random low bits,
    so a reused pid or another job sharing the stage does not collide."""
    return (os.getpid() << _PID_SHIFT) | random.getrandbits(_PID_SHIFT) | 1


def _need_marker(name: str) -> tuple[str, str, int] | None:
    """``(shard name, order group, batch)`` of a "needed" marker's file name (``PackedReader._need_path``); None for
    any other name."""
    parts = name.split(".")
    if len(parts) != 4 or parts[3] != "need" or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def order_group(publisher: int, epoch: int) -> str:
    """The name of one epoch's order of one publisher in "needed" markers (see :meth:`PackedReader.need`)."""
    return f"{publisher:x}-{epoch}"


def _ahead_owner_alive(path: str) -> bool:
    """Whether the process that started the read-ahead download behind the ``.ahead`` marker ``path`` (its pid is the
    marker's content) is still running. An empty or unreadable marker (being written, or a foreign format) counts as
    alive; a marker that is gone as not."""
    try:
        with open(path, "rb") as f:
            data = f.read(32)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        return _alive(int(data)) if data else True
    except ValueError:
        return True


def _alive(pid: int) -> bool:
    # no process named (pid <= 0): assume its batches may still come
    return pid <= 0 or process_running(pid)


@dataclass
class PackIndex:
    """Where each sample of a packed origin lives: ``shards[shard[i]]`` bytes ``[offset[i], offset[i] + size[i])``."""

    shards: list[str]
    shard_sizes: list[int]
    shard: list[int]
    offset: list[int]
    size: list[int]
    crc32: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": [{"key": k, "bytes": b} for k, b in zip(self.shards, self.shard_sizes, strict=True)],
            "shard": self.shard,
            "offset": self.offset,
            "size": self.size,
            "crc32": self.crc32,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], n: int, where: str) -> PackIndex:
        """Parse and validate (``n`` samples); errors name ``where`` (the index URL)."""
        try:
            shards = [str(s["key"]) for s in d["shards"]]
            sizes = [int(s["bytes"]) for s in d["shards"]]
            cols = [[int(x) for x in d[c]] for c in ("shard", "offset", "size", "crc32")]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"pack index {where!r} is malformed ({type(e).__name__}: {e}); re-run pack_origin.") from e
        if any(len(c) != n for c in cols):
            raise ValueError(f"pack index {where!r} has columns of different lengths; re-run pack_origin.")
        _check_keys(where, "shard", shards)  # a shard key never leaves the origin
        shard, offset, size, crc = cols
        for i in range(n):
            s = shard[i]
            if not (0 <= s < len(shards)) or offset[i] < 0 or size[i] < 0 or offset[i] + size[i] > sizes[s]:
                raise ValueError(
                    f"pack index {where!r}: sample {i} points outside its shard (shard {s}, offset {offset[i]}, "
                    f"size {size[i]}); re-run pack_origin."
                )
        return cls(shards, sizes, shard, offset, size, crc)


def _check_keys(where: str, kind: str, keys: Sequence[str]) -> None:
    """Refuse a key of the pack index ``where`` that would escape the origin (one line naming the index URL)."""
    for k in keys:
        try:
            safe_join("root", k)
        except ValueError as e:
            raise ValueError(
                f"pack index {where!r} has {kind} key {k!r}, which would escape the origin (a key is a relative POSIX "
                "path without `..`, `.`, a leading `/`, a scheme or backslashes); re-run pack_origin."
            ) from e


def load_pack_index(store: ObjectStore) -> Listing | None:
    """The listing of a packed origin, or ``None`` when ``store`` holds no pack index."""
    path = safe_join(store.root, PACK_INDEX)
    if not store.fs.exists(path):
        return None
    where = store.url_of(PACK_INDEX)
    try:
        d = json.loads(store.fs.cat_file(path))
    except ValueError as e:
        raise ValueError(f"pack index {where!r} is not valid JSON ({e}); re-run pack_origin.") from e
    if not isinstance(d, dict) or d.get("format") != PACK_FORMAT:
        raise ValueError(f"{where!r} is not a {PACK_FORMAT} index (format {d.get('format')!r}).")
    if d.get("version") != PACK_VERSION:
        raise ValueError(
            f"pack index {where!r} has version {d.get('version')!r}; this lightning-accel reads version "
            f"{PACK_VERSION}. Re-pack with this version (pack_origin)."
        )
    try:
        keys, labels, classes = [str(k) for k in d["keys"]], [int(y) for y in d["labels"]], list(d["classes"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"pack index {where!r} is malformed ({type(e).__name__}: {e}); re-run pack_origin.") from e
    if len(labels) != len(keys) or not keys:
        raise ValueError(f"pack index {where!r} lists {len(keys)} keys and {len(labels)} labels; re-run pack_origin.")
    _check_keys(where, "sample", keys)  # sample keys name cache entries and errors: never outside the origin either
    pack = PackIndex.from_dict(d, len(keys), where)
    return Listing(origin=store.url, keys=keys, labels=labels, classes=[str(c) for c in classes], pack=pack)


def _within(inner: ObjectStore, outer: ObjectStore) -> bool:
    """True when ``inner`` is ``outer`` or a folder below it (local paths through their real paths; URLs of one
    protocol by their paths; an object store with its own options may be another endpoint: not compared)."""
    if inner.is_local != outer.is_local:
        return False
    if inner.is_local:
        a, b = os.path.realpath(inner.root), os.path.realpath(outer.root)
    else:
        if inner.url.split("://", 1)[0] != outer.url.split("://", 1)[0]:
            return False
        if inner.files.storage_options != outer.files.storage_options:
            return False
        a, b = posixpath.normpath(inner.root), posixpath.normpath(outer.root)
    return a == b or a.startswith(b.rstrip("/") + "/")


def pack_origin(
    source: str,
    dest: str,
    *,
    storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    manifest: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_concurrency: int = 16,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    shuffle_seed: int | None = None,
) -> Listing:
    """Copy an origin (ImageFolder tree or manifest) into a packed origin at ``dest``; returns its listing.

    Args:
        source: the origin to pack (any fsspec URL or path).
        dest: where to write the pack (any fsspec URL or path; a prefix of its own).
        storage_options: fsspec options of ``source``.
        dest_storage_options: fsspec options of ``dest`` (default: ``storage_options``).
        manifest: a JSONL manifest under ``source`` instead of an ImageFolder tree (see ``list_origin``).
        shard_bytes: target shard size; a shard closes before the sample that would overflow it (a sample larger
            than ``shard_bytes`` gets a shard of its own).
        max_concurrency: concurrent reads from ``source``, 1 to 1024 (a thread each).
        overwrite: replace a pack already at ``dest``: its index is removed just before the first new shard is
            written (readers never mix the two), the new shards are written, the new index is published, then the
            old pack's shards the new one does not reuse are removed. Only files the old pack's index (or an
            interrupted pack's journal) lists are replaced or removed. A local pack that a :class:`PackedReader`
            reads (a running fit's, or a live one of this process) is not replaced: :class:`PackInUseError`.
        progress: called as ``progress(done, total)`` after each group of samples.
        shuffle_seed: write the samples into the shards in a random order drawn from this seed (the listing keeps
            its order; only where each sample lives changes), so every shard holds a mix of classes and a shuffle
            within a window of shards (:class:`~lightning_accel.data.sampler.ShardWindowSampler`) still mixes them.
            ``None``: listing order (an ImageFolder tree is sorted by class, so shards are nearly single-class).

    Empty files, and image files PIL cannot decode, are left out (one warning with their count and the first keys);
    the class list stays that of ``source``, so labels do not move.

    A destination left by a pack that was killed halfway (no index, its journal) is taken over without
    ``overwrite``: it holds nothing but that pack's own files.

    Raises:
        FileExistsError: ``dest`` already holds a pack and ``overwrite`` is False; or ``dest`` holds a file that no
            pack wrote (e.g. an ImageFolder tree, or a user's ``shards/000000.bin``), or an index that cannot be
            read; or ``dest`` is a file.
        NotADirectoryError: a local ``dest`` lies under a file (checked before any sample is read).
        PackInUseError: a local ``dest`` is in use: a pack there that another process, or a live (not closed, not
            garbage-collected) :class:`PackedReader` of this one, reads (``overwrite`` would replace it under the
            reader), or a pack that another :func:`pack_origin` is writing (it holds ``.lightning-accel-pack.lock``
            there: of two started at once, one is refused); checked before any sample is read, and again just
            before the first shard is written; nothing is removed.
        TypeError: ``shard_bytes``, ``max_concurrency`` or ``shuffle_seed`` is not an integer, ``overwrite`` not a
            bool, ``progress`` not callable, or a storage options argument is not a dict with string keys.
        ValueError: ``shard_bytes`` outside 1 to 4 GiB (a shard is built in memory), ``max_concurrency`` outside 1
            to 1024, ``source`` is itself a pack, or ``dest`` is ``source`` or a folder inside it.
    """
    # a shard is built in memory before it is written: the bound keeps one from growing to the whole data set
    check_int(
        "shard_bytes",
        shard_bytes,
        low=1,
        high=MAX_SHARD_BYTES,
        fix="It is the target shard size in bytes; use e.g. 16 << 20.",
    )
    check_int("max_concurrency", max_concurrency, low=1, high=MAX_CONCURRENCY, fix=_CONCURRENCY_FIX)
    # A truthy string ("no", "false" from a config) would replace the pack at `dest`: only a bool says "replace".
    check_bool("overwrite", overwrite, fix="True replaces a pack already at `dest`.")
    # random.Random seeds from any str, float or bytes: a typo would still pack, in an order no int seed gives.
    check_int("shuffle_seed", shuffle_seed, allow_none=True, fix="None keeps the listing order.")
    check_callable("progress", progress, "a callable `progress(done: int, total: int)`")
    check_storage_options(storage_options)
    check_storage_options(dest_storage_options, "dest_storage_options")
    src = ObjectStore(source, storage_options, max_concurrency=max_concurrency)
    dst = ObjectStore(dest, storage_options if dest_storage_options is None else dest_storage_options)
    if _within(dst, src):
        raise ValueError(
            f"`dest` {dst.url!r} is inside `source` {src.url!r}: the pack would become a folder of the data set it "
            "packs (a class folder without images, which the next listing refuses). Choose a destination outside "
            "the source tree."
        )
    listing = list_origin(src, manifest=manifest)
    if listing.pack is not None:
        raise ValueError(f"`source` {src.url!r} is already a packed origin; read it directly.")
    fs, root = dst.fs, dst.root
    index_path = safe_join(root, PACK_INDEX)
    journal_path = safe_join(root, PACK_JOURNAL)
    # refused before the lock below creates anything (a file on the way, a user's files)
    has_index, owned, leftovers = _claim_dest(dst, overwrite)
    with _dest_lock(dst) as holding:
        if dst.is_local:
            # again under the lock: another pack may have finished between the first look and the lock
            has_index, owned, leftovers = _claim_dest(dst, overwrite)
            _refuse_if_in_use(dst)  # before any sample is read: a busy pack is refused at once
        # Every file this call may create or replace is listed in the journal before it is touched, so a pack killed at
        # any point leaves only files the next pack_origin recognises as its own. Nothing is written before the first
        # shard (the lock file aside, removed on the way out): a source that fails before it (unreachable, nothing
        # decodable) leaves `dest` as it was, an old pack included.
        claimed = set(owned)

        def publish_journal() -> None:
            doc = {"format": _JOURNAL_FORMAT, "keys": sorted(claimed)}
            atomic_publish_file(json.dumps(doc, separators=(",", ":")).encode(), journal_path, fs=fs)
            if dst.is_local:
                # the new journal mapped before the old one's map goes: the pack never looks idle in between
                old, holding[0] = holding[0], _hold(journal_path)
                if old is not None:
                    old.close()

        shards: list[str] = []
        shard_sizes: list[int] = []
        buf = bytearray()

        def flush() -> None:
            key = f"shards/{len(shards):06d}.bin"
            first, grew = not shards, key not in claimed
            if grew:
                # claim the next keys in growing runs (one journal write per doubling, not per shard); a key claimed
                # but never written is simply absent. No such key held a file: `_claim_dest` refused any.
                k = len(shards)
                claimed.update(f"shards/{j:06d}.bin" for j in range(k, k + max(16, k)))
            if first and dst.is_local:
                _refuse_if_in_use(dst)  # again: a reader or writer may have started while the source was read
            if first or grew:
                publish_journal()
            if first:
                if has_index:
                    fs.rm_file(index_path)  # no longer a pack: a reader never mixes the old index with new shards
                fs.makedirs(safe_join(root, "shards"), exist_ok=True)
            fs.pipe_file(safe_join(root, key), bytes(buf))
            shards.append(key)
            shard_sizes.append(len(buf))
            buf.clear()

        n = len(listing)
        order = list(range(n))
        if shuffle_seed is not None:
            order = random.Random(shuffle_seed).sample(order, n)
        shard_of = [0] * n
        offsets = [0] * n
        sizes = [0] * n
        crcs = [0] * n
        group = 4 * max_concurrency
        bad: list[int] = []  # samples left out: empty or undecodable image files
        for lo in range(0, n, group):
            idx = order[lo : lo + group]
            for i, data in zip(idx, src.fetch_many([listing.keys[i] for i in idx]), strict=True):
                if not _decodable(listing.keys[i], data):
                    bad.append(i)
                    continue
                if buf and len(buf) + len(data) > shard_bytes:
                    flush()
                shard_of[i] = len(shards)
                offsets[i] = len(buf)
                sizes[i] = len(data)
                crcs[i] = zlib.crc32(data)
                buf += data
            if progress is not None:
                progress(min(n, lo + group), n)
        if buf:
            flush()
        keys, labels = listing.keys, listing.labels
        if bad:
            bad.sort()
            shown = ", ".join(repr(listing.keys[i]) for i in bad[:3]) + (", ..." if len(bad) > 3 else "")
            if len(bad) == n:
                raise ValueError(
                    f"`source` {src.url!r}: none of its {n} files can be decoded ({shown}); nothing to pack. Check "
                    "that the files are images."
                )
            warnings.warn(
                f"pack_origin: left out {len(bad)} of {n} files of {src.url!r} that are empty or cannot be decoded as "
                f"images ({shown}); the other {n - len(bad)} were packed, the class list is unchanged. Fix or remove "
                "those files and pack again to include them.",
                RuntimeWarning,
                stacklevel=2,
            )
            drop = set(bad)
            kept = [i for i in range(n) if i not in drop]
            keys, labels = [keys[i] for i in kept], [labels[i] for i in kept]
            shard_of, offsets = [shard_of[i] for i in kept], [offsets[i] for i in kept]
            sizes, crcs = [sizes[i] for i in kept], [crcs[i] for i in kept]
        pack = PackIndex(shards, shard_sizes, shard_of, offsets, sizes, crcs)
        doc = {
            "format": PACK_FORMAT,
            "version": PACK_VERSION,
            "source": src.url,
            "classes": listing.classes,
            "keys": keys,
            "labels": labels,
            **pack.to_dict(),
        }
        # The index last, published atomically (one PUT on an object store): a pack killed halfway has no index and is
        # not a pack.
        atomic_publish_file(json.dumps(doc, separators=(",", ":")).encode(), index_path, fs=fs)
        # Then the old pack's shards the new one does not reuse (left behind before), and an interrupted publish's
        # temporary files; the journal last, so a kill in between still leaves them known.
        for key in sorted(owned - set(shards)) + leftovers:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(safe_join(root, key))
        fs.rm_file(journal_path)
        return Listing(origin=dst.url, keys=keys, labels=labels, classes=listing.classes, pack=pack)


@contextlib.contextmanager
def _dest_lock(dst: ObjectStore) -> Iterator[list[mmap.mmap | None]]:
    """Hold an exclusive ``flock`` on ``PACK_LOCK`` in the local ``dst`` while :func:`pack_origin` writes there (a
    remote ``dst``: no lock). The folder is created if missing and, when the pack wrote nothing into it, removed again
    with the parents this call created; the lock file is removed on the way out, whatever happened.

    Yields the slot for the map of the pack's journal (see :func:`_refuse_if_in_use`), closed on the way out too: a
    pack interrupted in a notebook, whose traceback keeps its frames alive, must not leave the destination looking in
    use by this process to every other one.

    Why: the in-use check reads the other processes' maps, and a pack maps its journal only once it starts writing,
    so two packs started at once both passed it and wrote the same shards. The lock makes the second one fail at once.

    Raises:
        PackInUseError: another process holds the lock (one line naming ``dst``, its pid and the fix).
    """
    holding: list[mmap.mmap | None] = [None]
    if not dst.is_local:
        yield holding
        return
    root = os.path.abspath(dst.root)
    top = root  # the highest folder this call creates, if any
    while not os.path.lexists(os.path.dirname(top)) and os.path.dirname(top) != top:
        top = os.path.dirname(top)
    created = not os.path.lexists(root)
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, PACK_LOCK)
    fd = -1
    try:
        for _ in range(8):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.read(fd, 32).decode(errors="replace").strip()
                finally:
                    os.close(fd)
                    fd = -1
                who = f"pid {holder}" if holder.isdigit() else "another process"  # its pid not written yet
                raise PackInUseError(
                    f"`dest` {dst.url!r} is a pack in use: {who} is writing a pack there; nothing was removed. Let "
                    "that pack finish (or stop it), or pack into another folder."
                ) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                break  # a filesystem without flock (some FUSE mounts): the in-use checks alone, as before the lock
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            # the previous holder removed the file between our open and our lock: lock the one now at `path`
            os.close(fd)
            fd = -1
        else:
            raise PackInUseError(
                f"`dest` {dst.url!r} is a pack in use: its {PACK_LOCK} kept being replaced by other packs; nothing was "
                "removed. Let those packs finish, or pack into another folder."
            )
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())  # named by a pack refused meanwhile
        yield holding
    finally:
        if holding[0] is not None:
            holding[0].close()
        if fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # before the lock goes, so no one locks a file that is about to be removed
            os.close(fd)
        if created:
            # a pack that wrote nothing (its source failed, or it was refused) leaves no folder behind
            d = root
            while True:
                try:
                    os.rmdir(d)
                except OSError:
                    break
                if d == top:
                    break
                d = os.path.dirname(d)


def _claim_dest(dst: ObjectStore, overwrite: bool) -> tuple[bool, set[str], list[str]]:
    """Check that :func:`pack_origin` may write into ``dst``; returns (whether it holds a pack index, the keys of
    files a pack wrote there: the index's shards and an interrupted pack's journal's keys, the temporary files of
    an interrupted publish of the index or the journal).

    Only a missing or empty destination, or one holding nothing but files of a pack (its index, the shards the index
    lists, and what an interrupted pack's journal lists), is accepted: anything else may be a user's, and the pack
    would overwrite it (``shards/000000.bin``) or turn the folder (an ImageFolder tree) into a pack.

    Raises:
        FileExistsError: one line naming ``dst`` and the fix (see :func:`pack_origin`).
    """
    fs, root = dst.fs, dst.root
    if dst.is_local:
        # A file on the way (`run.log/pack`): found before any sample is read, not as the first shard's bare
        # NotADirectoryError after the whole source was fetched.
        above = os.path.dirname(os.path.abspath(root))
        while not os.path.lexists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise NotADirectoryError(
                f"`dest` {dst.url!r} lies under {above!r}, which is a file, not a folder. Choose a destination whose "
                "parent folders are folders (or do not exist yet)."
            )
    if fs.isfile(root):
        raise FileExistsError(
            f"`dest` {dst.url!r} is a file; pack_origin writes a folder (prefix) of shards and an index. Choose a "
            "new or empty folder."
        )
    rels = [p[len(root) :].lstrip("/") if root else p for p in fs.find(root)]
    present = set(rels)
    owned: set[str] = set()
    has_index = PACK_INDEX in present
    if has_index:
        owned.update(_listed_keys(dst, PACK_INDEX, PACK_FORMAT, lambda d: [str(x["key"]) for x in d["shards"]]))
    if PACK_JOURNAL in present:
        owned.update(_listed_keys(dst, PACK_JOURNAL, _JOURNAL_FORMAT, lambda d: [str(k) for k in d["keys"]]))
    # never data files, whatever a tampered index says: removed only by name
    owned -= {PACK_INDEX, PACK_JOURNAL, PACK_LOCK}
    leftovers = sorted(r for r in rels if _OWN_TMP.fullmatch(r))
    # the lock file: this pack's own (see `_dest_lock`), or one a killed pack left, which the lock takes over
    foreign = sorted(present - owned - {PACK_INDEX, PACK_JOURNAL, PACK_LOCK} - set(leftovers))
    if foreign:
        shown = ", ".join(repr(k) for k in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise FileExistsError(
            f"`dest` {dst.url!r} holds {len(foreign)} file(s) that no pack wrote ({shown}); refusing to pack there, "
            "as it would overwrite or mix with them (`overwrite` replaces only a previous pack's files). Choose a new "
            "or empty folder (prefix), or move those files away."
        )
    if has_index and not overwrite:
        raise FileExistsError(
            f"`dest` {dst.url!r} already holds a pack ({PACK_INDEX}). Pass `overwrite=True` (`--overwrite`) to "
            "replace it, or choose another prefix."
        )
    return has_index, owned & present, leftovers


def _listed_keys(dst: ObjectStore, name: str, fmt: str, keys_of: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """The keys that the pack file ``name`` (the index or the journal, of format ``fmt``) at ``dst`` lists.

    Raises:
        FileExistsError: the file cannot be read as one, so which files a pack wrote is unknown (one line).
    """
    where = dst.url_of(name)
    try:
        d = json.loads(dst.fs.cat_file(safe_join(dst.root, name)))
        if not isinstance(d, dict) or d.get("format") != fmt:
            raise ValueError(f"format {d.get('format') if isinstance(d, dict) else None!r}, expected {fmt!r}")
        keys = keys_of(d)
        _check_keys(where, "file", keys)
    except (ValueError, KeyError, TypeError) as e:
        raise FileExistsError(
            f"`dest` holds {where!r}, which cannot be read as a {fmt} file ({type(e).__name__}: {e}), so which files "
            "a pack wrote there is unknown; refusing to pack there. Choose a new or empty folder, or empty this one."
        ) from e
    return keys


def _decodable(key: str, data: bytes) -> bool:
    """False for an empty file, and for an image file (by extension) that PIL cannot decode. JPEGs are decoded at
    1/8 scale (``draft``): enough to find a broken stream at a fraction of a full decode's cost."""
    if not data:
        return False
    if not key.lower().endswith(IMAGE_EXTENSIONS):
        return True  # not an image file (a manifest's own format): the user's decode judges it
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format == "JPEG":
                im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
    except Exception:  # PIL raises OSError, SyntaxError, ValueError, ... for broken streams
        return False
    return True


def _lock_shard(f: Any) -> None:
    """Take the exclusive record lock on a shard's lock file, waiting for it.

    The kernel detects deadlocks between record locks per *process*, not per thread: when two processes each have
    one thread holding a shard's lock and another thread waiting for the other's, ``lockf`` fails with EDEADLK
    although every holder will finish (each thread holds at most one shard lock). Seen with 2 workers and the main
    process staging 16 shards at once; retried after a short pause instead of giving up on staging."""
    delay = 0.002
    while True:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX)
            return
        except OSError as e:
            if e.errno != errno.EDEADLK:
                raise
            time.sleep(delay)
            delay = min(0.05, delay * 2)


# Thread locks per lock-file path, for the whole process. Why process-wide: a POSIX record lock belongs to the
# process, so two threads (or two readers of one process sharing a stage) that lock the same file would both "hold"
# it, and closing any descriptor of that file drops the process's lock.
_PATH_LOCKS: PerProcess[dict[str, threading.Lock]] = PerProcess(dict)
_PATH_LOCKS_GUARD = ForkSafeLock()
# What staging leaves behind when its process is killed: a shard's lock file, and the temporary file of a download
# killed mid-write (the `_utils.atomic` temporary name of a staged shard). Nothing else of the stage is swept.
_SHARD_NAME = re.compile(r"[0-9a-f]{20}")
_STAGE_LOCK = re.compile(r"([0-9a-f]{20})\.shard\.lock")
_STAGE_TMP = re.compile(r"\.([0-9a-f]{20})\.shard\.[0-9a-f]{32}\.tmp")


def _path_lock(path: str) -> threading.Lock:
    with _PATH_LOCKS_GUARD:
        return _PATH_LOCKS.get().setdefault(path, threading.Lock())


@contextlib.contextmanager
def _node_lock(path: str, *, wait: bool = True) -> Iterator[bool]:
    """Hold the node-wide lock whose lock file is ``path``: a thread lock of this process, then a POSIX record lock
    on the file across processes. Yields True once held; with ``wait=False``, yields False at once when another
    thread or process holds it.

    The lock file exists only while its lock is held: the holder unlinks it before letting go, so no lock file is
    left behind per shard ever staged. A process killed while holding it leaves the file, unlocked (the kernel drops
    a dead process's record locks), and the next holder removes it. Why the check after locking: a waiter may lock a
    file its previous holder has just unlinked, while a newcomer locks the new file at the same name; only the holder
    of the file the name points to holds the lock, the other tries again."""
    tlock = _path_lock(path)
    if not tlock.acquire(blocking=wait):
        yield False
        return
    try:
        while True:
            with open(path, "a+b") as f:
                if wait:
                    _lock_shard(f)
                else:
                    try:
                        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError as e:
                        if e.errno not in (errno.EACCES, errno.EAGAIN, errno.EDEADLK):
                            raise
                        yield False
                        return
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue  # unlinked by its previous holder: lock the new one
                mine = os.fstat(f.fileno())
                if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
                    continue
                try:
                    yield True
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)  # while still held: nobody can be holding the file at this name
                return
    finally:
        tlock.release()


class PackedReader(ResetOnPickle):
    """Reads samples of a packed origin (see the module docstring for local and remote reads).

    Args:
        store: the packed origin.
        pack: its index.
        stage_dir: node-local directory for staged shards of a remote pack (shared by workers and ranks).
        stage_bytes: staged shards kept at most (least recently used evicted first; the shard being read may exceed it).
        on_staged: called after this process downloaded a shard (the cache counts the bytes there).
    """

    # a count of this process's own reads; the index map is made again by the copy (see `__setstate__`)
    _reset_on_pickle = {"staged_refetches": 0, "_hold": None}

    def __init__(
        self,
        store: ObjectStore,
        pack: PackIndex,
        stage_dir: str,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        on_staged: Callable[[], None] | None = None,
    ) -> None:
        check_int("stage_bytes", stage_bytes, low=0, fix="It is the most bytes of staged shards kept.")
        self.store = store
        self.pack = pack
        self.stage_dir = os.fspath(stage_dir)
        self.stage_bytes = stage_bytes
        self.staging = not store.is_local
        self.on_staged = on_staged
        # A staged file's name covers the URL, the shard key, its size and the CRC of its first sample, so a pack
        # rewritten at the same URL never reads an old staged shard (and the per-sample CRC would catch it anyway).
        firsts: dict[int, int] = {}
        for i, s in enumerate(pack.shard):
            firsts.setdefault(s, pack.crc32[i])
        self._names = [
            hashlib.sha1(text_bytes(f"{store.url}|{k}|{b}|{firsts.get(s, 0)}")).hexdigest()[:20]
            for s, (k, b) in enumerate(zip(pack.shards, pack.shard_sizes, strict=True))
        ]
        self._by_name = {n: s for s, n in enumerate(self._names)}
        self._inflight: PerProcess[dict[int, Future[None]]] = PerProcess(dict)
        self._lock = ForkSafeLock(reentrant=True)  # a done-callback can run inline, under the lock
        self.staged_refetches = 0  # staged copies that failed their CRC and were fetched again (this process)
        self._touched: PerProcess[dict[int, float]] = PerProcess(dict)  # shard -> when this process last touched it
        self._maps: PerProcess[OrderedDict[int, mmap.mmap]] = PerProcess(OrderedDict)  # shard -> its file, mapped
        # "needed" markers this process made, per order (group -> {(shard, batch)}), and each rank's latest order
        self._needs: PerProcess[dict[str, set[tuple[int, int]]]] = PerProcess(dict)
        self._latest: PerProcess[dict[str, int]] = PerProcess(dict)
        # the (order, batch) each thread of this process is reading, if any (see `reading`)
        self._reading: PerProcess[threading.local] = PerProcess(threading.local)
        # A local pack is read in place: its index stays mapped while this reader lives, so `pack_origin` refuses to
        # replace the pack under it (see `_refuse_if_in_use`). A forked worker inherits the map; an unpickled copy
        # maps it again. Nothing per sample.
        self._hold = _hold(safe_join(store.root, PACK_INDEX)) if store.is_local else None
        self._register()
        if self.staging:
            self.sweep()  # what a killed run left, before this one stages anything

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.store.is_local:
            self._hold = _hold(safe_join(self.store.root, PACK_INDEX))
            self._register()

    def _register(self) -> None:
        """Count this reader of a local pack as live in this process (see :func:`_refuse_if_in_use`)."""
        if self._hold is not None:
            with _LIVE_LOCK:
                _LIVE_READERS.setdefault(os.path.realpath(self.store.root), weakref.WeakSet()).add(self)

    def close(self) -> None:
        """Release the pack: drop the index map (a local pack may then be replaced by :func:`pack_origin` in this
        process) and the staged shards this process keeps mapped. Idempotent; reads after it are not supported."""
        with self._lock:
            hold, self._hold = self._hold, None
            self._maps.get().clear()  # dropped, not closed: a thread still slicing one holds its own reference
        if hold is not None:
            hold.close()

    def _path(self, s: int) -> str:
        return os.path.join(self.stage_dir, f"{self._names[s]}.shard")

    def _ahead_path(self, s: int) -> str:
        return os.path.join(self.stage_dir, f"{self._names[s]}.ahead")

    def _need_path(self, s: int, group: str, batch: int) -> str:
        return os.path.join(self.stage_dir, f"{self._names[s]}.{group}.{batch}.need")

    def _ahead(self) -> tuple[set[str], int]:
        """The node's protected read-ahead: (staged-file paths that eviction spares, their bytes, each shard once)
        over every process of the node.

        A shard counts while it has an ``.ahead`` marker (from the moment a reader starts its download until a
        reader reads a sample of it), or while it is staged and some batch of a rank's order still needs it (a
        ``.need`` marker per shard and batch, see :meth:`need`). Markers older than ``_AHEAD_TTL_S`` do not count, nor
        do markers whose process is gone: an ``.ahead`` marker's download process (its content is the pid), a
        "needed" marker's order publisher (the rank's main process, see :func:`new_publisher_id`). After a worker or
        a rank is killed and restarted, its old markers would otherwise hold their shards for those minutes (and a
        dead download's ``.ahead`` would keep every reader from starting that shard, see :meth:`_claim_ahead`).
        "Needed" markers of an order this process has seen replaced by a newer one of the same rank (batches never
        read: an epoch cut short) are removed."""
        marked: set[str] = set()
        total = 0
        now = time.time()
        latest = self._latest.get()
        try:
            with os.scandir(self.stage_dir) as it:
                entries = list(it)
        except FileNotFoundError:
            return marked, total
        names = {e.name for e in entries}
        alive: dict[str, bool] = {}
        for e in entries:
            parts = e.name.split(".")
            if parts[-1] not in ("ahead", "need"):
                continue
            s = self._by_name.get(parts[0])
            if s is None or self._path(s) in marked:
                continue
            if parts[-1] == "need":
                rank, _, epoch = parts[1].rpartition("-")
                if epoch.isdigit() and int(epoch) < latest.get(rank, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)  # a stale order's leftover
                    continue
                if f"{parts[0]}.shard" not in names:
                    continue  # needed but not staged (nor coming: that is an `.ahead`): nothing to spare
                if rank not in alive:
                    alive[rank] = _alive(int(rank, 16) >> _PID_SHIFT) if _GROUP.fullmatch(parts[1]) else False
                if not alive[rank]:
                    continue  # its rank died (e.g. killed, and restarted under a new id): no batch of it will come
            elif not _ahead_owner_alive(e.path):
                continue  # its download's process died (a worker killed or stopped): its readers are gone with it
            with contextlib.suppress(FileNotFoundError):
                if now - e.stat().st_mtime < _AHEAD_TTL_S:
                    marked.add(self._path(s))
                    total += self.pack.shard_sizes[s]
        return marked, total

    def _note_group(self, group: str) -> None:
        """Record ``group`` ("<rank>-<epoch>") as its rank's current order; markers this process left for an older
        order of that rank (batches it never saw read) are removed."""
        if not _GROUP.fullmatch(group):
            raise ValueError(f"`group` must look like '<hex rank>-<epoch>', got {group!r}.")
        rank, _, epoch = group.rpartition("-")
        latest = self._latest.get()
        if int(epoch) <= latest.get(rank, -1):
            return
        latest[rank] = int(epoch)
        made = self._needs.get()
        for old in [g for g in made if g != group and g.rpartition("-")[0] == rank]:
            for s, b in made.pop(old):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._need_path(s, old, b))

    def need(self, group: str, batches: Sequence[tuple[int, Sequence[int]]], done: Callable[[int], bool]) -> None:
        """Mark the shards of upcoming ``batches`` (``(batch, sample indices)`` of the order ``group``: one rank's
        epoch) as needed until that batch is read (:meth:`release_batch`): eviction spares a staged shard while any
        batch of any rank's order still needs it. ``done(batch)``: that batch has been read already (its marker, if
        this call raced the read, is removed again).

        Why per batch, and for every reader's batches: a shard's samples are spread over several readers' batches
        (DataLoader workers take batches in turn, and each runs at its own pace). With one marker per reader, placed
        for its own next batches and removed at its first read, a worker running ahead read its batch of a shard,
        the other worker had not marked its own batch of it yet, a newer shard's staging evicted it, and the shard
        was fetched again: a cold epoch under the window shuffle fetched 1.12x the pack in 1 of 5 runs of the quick
        benchmark. Marking every batch of the horizon, whoever reads it, closes that gap."""
        if not self.staging:
            return
        self._note_group(group)
        made = self._needs.get().setdefault(group, set())
        try:
            os.makedirs(self.stage_dir, exist_ok=True)
        except OSError:
            return  # nothing marked: eviction may take those shards, and a read stages them again
        for b, indices in batches:
            for s in {self.pack.shard[i] for i in indices}:
                if (s, b) in made:
                    continue
                path = self._need_path(s, group, b)
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
                except OSError:
                    return  # not marked: eviction may take it, and a read stages it again
                if done(b):  # its reader finished between our check of the horizon and the marker
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                made.add((s, b))

    def drop_needs(self, group: str) -> None:
        """Remove every "needed" marker of the order ``group``, whichever process placed it: its batches will not be
        released one by one (the DataLoader's batches are not the sampler's, see ``CachedDataset``)."""
        if not self.staging or not _GROUP.fullmatch(group):
            return
        self._needs.get().pop(group, None)
        try:
            with os.scandir(self.stage_dir) as it:
                names = [e.name for e in it]
        except FileNotFoundError:
            return
        for name in names:
            marker = _need_marker(name)
            if marker is not None and marker[1] == group and marker[0] in self._by_name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.stage_dir, name))

    def release_batch(self, group: str, batch: int, indices: Sequence[int]) -> None:
        """Batch ``batch`` of the order ``group`` was read (its samples ``indices``): its shards are no longer needed
        by it (by whichever process marked them)."""
        if not self.staging:
            return
        made = self._needs.get().get(group)
        for s in {self.pack.shard[i] for i in indices}:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._need_path(s, group, batch))
            if made is not None:
                made.discard((s, batch))

    @contextlib.contextmanager
    def reading(self, group: str, batch: int) -> Iterator[None]:
        """Reads by this thread inside the block are for batch ``batch`` of the order ``group`` (one rank's epoch, as
        in :meth:`need`): a shard they stage waits, rather than evict a shard that an earlier batch of that order
        still needs (see :meth:`_wait_for_room`)."""
        local = self._reading.get()
        outer = getattr(local, "batch", None)
        local.batch = (group, batch)
        try:
            yield
        finally:
            local.batch = outer

    def _room_blocked(self, s: int, group: str, batch: int) -> bool:
        """Whether staging shard ``s`` now would evict a staged shard that only earlier batches (``< batch``) of the
        order ``group`` still need: the stage is full once the shards no reader needs are gone, and such a shard
        exists. Shards needed by later batches, by another order (another rank, another data set) or staged ahead and
        not read yet are not waited for: their readers may be waiting for this one (a later batch of this order is
        read after this one by the DataLoader; ranks wait for each other in collectives)."""
        staged: dict[str, int] = {}
        needs: dict[str, set[tuple[str, int]]] = {}
        ahead: set[str] = set()
        try:
            with os.scandir(self.stage_dir) as it:
                entries = list(it)
        except FileNotFoundError:
            return False
        for e in entries:
            parts = e.name.split(".")
            marker = _need_marker(e.name)
            if _STAGED.fullmatch(e.name):
                with contextlib.suppress(FileNotFoundError):
                    staged[e.path] = e.stat().st_size
            elif parts[-1] == "ahead" and len(parts) == 2:
                ahead.add(os.path.join(self.stage_dir, f"{parts[0]}.shard"))
            elif marker is not None:
                path = os.path.join(self.stage_dir, f"{marker[0]}.shard")
                needs.setdefault(path, set()).add(marker[1:])
        if self._path(s) in staged:
            return False
        over = sum(staged.values()) + self.pack.shard_sizes[s] - self.stage_bytes
        if over <= 0:
            return False
        marked, _ = self._ahead()
        if sum(b for p, b in staged.items() if p not in marked) >= over:
            return False  # eviction makes room from shards no reader needs
        return any(
            p in marked and p not in ahead and p in needs and all(g == group and b < batch for g, b in needs[p])
            for p in staged
        )

    def _wait_for_room(self, s: int) -> None:
        """Before this thread stages shard ``s`` for the batch it is reading (:meth:`reading`), wait while that would
        evict a shard only earlier batches of its order still need (at most ``_ROOM_WAIT_S``).

        Why: the DataLoader's workers read their batches in turn, each at its own pace, and one can be several
        batches ahead of another (``prefetch_factor`` batches per worker are in flight). Its new shards then meet a
        stage full of shards the slower worker's batches still need, and eviction, bound by ``stage_bytes``, took the
        oldest of them, the very next one to be read: it was fetched again (a cold epoch under the window shuffle with
        one worker slowed by 0.3 s per batch fetched 1.19x the pack, 4 of 17 shards twice). The slower batches never
        wait for a later one, so the wait ends when they are read, and the DataLoader hands out the later batch only
        after those anyway. Reads with no batch (read-ahead on the store's threads, a plain ``load``) never wait."""
        current = getattr(self._reading.get(), "batch", None)
        if current is None:
            return
        deadline = time.monotonic() + _ROOM_WAIT_S
        while self._room_blocked(s, *current) and time.monotonic() < deadline:
            time.sleep(_ROOM_POLL_S)

    def _release(self, s: int) -> None:
        """Shard ``s`` was read from: it is no longer ahead (the batches that still need it keep their markers)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._ahead_path(s))

    # ---- staging -------------------------------------------------------------------------------------------------
    def _stage(self, s: int) -> str | None:
        """The staged file of shard ``s`` (downloading it under the shard's lock if needed); ``None``: staging is
        unavailable (unwritable directory, full disk), read straight from the store instead."""
        path = self._path(s)
        if os.path.exists(path):
            return path
        if not self.staging:
            return None
        try:
            os.makedirs(self.stage_dir, exist_ok=True)
            self._wait_for_room(s)  # before the shard's lock: an earlier batch's reader may need this shard too
            # One download per node: a thread lock within this process, then a POSIX record lock (fcntl) across
            # processes. Record locks, unlike flock, are not inherited by a forked child, so a DataLoader worker
            # forked while a download is running can never keep that shard locked. The lock file goes with the lock.
            with _node_lock(path + ".lock"):  # the others wait here, then read the file
                if os.path.exists(path):
                    return path
                # The index knows the size: a ranged GET of it. A whole-object read made s3fs ask the size first
                # (a HEAD, to decide on a split download), one more request per shard (~13 ms of botocore CPU
                # in the process that stages, on the cores that decode). A shard longer than its index says
                # is read to its indexed end; every sample read from it is checked against its CRC-32 anyway.
                size = self.pack.shard_sizes[s]
                data = self.store.fetch(self.pack.shards[s], 0, size) if size else b""
                if len(data) != size:
                    raise OriginError(
                        f"shard {self.store.url_of(self.pack.shards[s])!r} has {len(data)} bytes, its pack index "
                        f"says {self.pack.shard_sizes[s]}: the pack was changed or truncated; re-run pack_origin."
                    )
                # Readers see the whole shard or none of it. Not fsynced: a staged copy is rebuilt from the store,
                # and every sample read from it is checked against its CRC-32.
                atomic_publish_file(data, path, durable=False)
                self._evict(keep=path)
                if self.on_staged is not None:
                    self.on_staged()
                return path
        except OriginError:
            raise
        except OSError as e:
            self._disable(e)
            return None

    def _disable(self, e: OSError) -> None:
        if self.staging:
            self.staging = False
            warnings.warn(
                f"cannot stage shards in {self.stage_dir!r} ({type(e).__name__}: {e}); reading samples of the "
                "packed origin one ranged GET at a time instead (slower). Free space or point `stage_dir` at a "
                "writable local directory.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _touch(self, s: int, path: str) -> None:
        """Mark shard ``s`` as used now (its mtime, which eviction sorts by), at most every ``_TOUCH_S`` seconds per
        process: eviction is least recently *used* first, so a shard a rank is still reading stays while shards of
        finished windows go (one ``utime`` per shard and second instead of one per sample)."""
        now = time.monotonic()
        touched = self._touched.get()
        if now - touched.get(s, -_TOUCH_S) < _TOUCH_S:
            return
        touched[s] = now
        with contextlib.suppress(OSError):
            os.utime(path)

    def _evict(self, keep: str) -> None:
        """Delete least recently used staged shards until the stage holds ``stage_bytes``, sparing ``keep`` (being
        read) and, while anything else can go, every shard still marked ahead or needed (a reader of the node is
        about to read it; the node-wide cap in :meth:`prefetch` keeps those below the stage). ``stage_bytes`` is a
        bound on disk use: when only marked shards are left (e.g. a global shuffle, where every upcoming batch
        needs most shards) they go too, least recently used first, and are fetched again when read.

        One eviction at a time on the node (a thread lock, then a record lock on ``evict.lock``): two stagings that
        finished together each counted the other's victims as still there and deleted twice what the stage needed,
        marked shards included (seen with one core kept busy: shards a batch had yet to read were evicted)."""
        # the same EDEADLK-tolerant wait as a shard's lock (a holder never waits for one)
        with self._lock, _node_lock(os.path.join(self.stage_dir, "evict.lock")):
            self._evict_locked(keep)
        self.sweep()

    def sweep(self) -> int:
        """Remove what staging processes killed mid-way left in the stage directory: lock files whose lock nobody
        holds, the temporary files of shard downloads killed mid-write (a download in progress holds its shard's
        lock, so its file is never taken), and the "needed" markers of orders whose publishing process is gone (a
        killed rank's: no batch of it will be read to release them). Returns how many files were removed.

        Only files named as the stage names its own are considered (a user's files beside them are never touched),
        and a lock held by a live process or thread is skipped without waiting. Runs when a reader is created and
        after each staged shard, so leftovers of a killed worker or rank do not pile up over runs."""
        try:
            with os.scandir(self.stage_dir) as it:
                names = [e.name for e in it]
        except OSError:
            return 0
        # lock file -> the leftovers its lock guards (the lock file itself, if there, goes on release)
        leftovers: dict[str, list[str]] = {}
        removed = 0
        alive: dict[str, bool] = {}
        for name in names:
            marker = _need_marker(name)
            if marker is not None and _SHARD_NAME.fullmatch(marker[0]) and _GROUP.fullmatch(marker[1]):
                # a "needed" marker of an order whose publisher died (a rank killed): nothing will ever release it
                rank = marker[1].rpartition("-")[0]
                if rank not in alive:
                    alive[rank] = _alive(int(rank, 16) >> _PID_SHIFT)
                if not alive[rank]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.stage_dir, name))
                        removed += 1
            elif name == "evict.lock":
                leftovers.setdefault(name, [])
            elif (m := _STAGE_LOCK.fullmatch(name) or _STAGE_TMP.fullmatch(name)) is not None:
                found = leftovers.setdefault(f"{m.group(1)}.shard.lock", [])
                if name.endswith(".tmp"):
                    found.append(name)
        for lock, tmps in leftovers.items():
            try:
                with _node_lock(os.path.join(self.stage_dir, lock), wait=False) as held:
                    if not held:
                        continue  # a live download or eviction: its files are in use
                    for name in tmps:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(self.stage_dir, name))
                            removed += 1
                    removed += lock in names  # the lock file, unlinked on the way out
            except OSError:
                continue  # an unwritable stage: nothing to sweep from it
        return removed

    def _evict_locked(self, keep: str) -> None:
        files = []
        with os.scandir(self.stage_dir) as it:
            for e in it:
                if _STAGED.fullmatch(e.name):  # a user's own `*.shard` file beside them is not the stage's
                    with contextlib.suppress(FileNotFoundError):
                        st = e.stat()
                        files.append((st.st_mtime, st.st_size, e.path))
        ahead, _ = self._ahead()  # after the listing: a shard staged and marked in between is not in it
        total = sum(f[1] for f in files)
        files.sort()
        for spare_marked in (True, False):
            for _, size, p in files:
                if total <= self.stage_bytes:
                    return
                if p == keep or (spare_marked and p in ahead) or not os.path.exists(p):
                    continue  # (gone: deleted by the first pass, or read as corrupt and removed)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)  # another process may hold it open: its reads go on, the file is freed after
                total -= size

    def prefetch(self, indices: Sequence[int]) -> int:
        """Start staging (on the store's thread pool) the shards of ``indices`` not staged yet; returns how many of
        ``indices`` lie in a shard whose download this call started.

        Marked shards (ahead or needed, see :meth:`_ahead`) are capped *for the whole node* (every worker and rank:
        the markers live in the stage directory), whatever the number of readers, at ``stage_bytes`` less one shard:
        read-ahead beyond what the stage holds would evict shards staged for upcoming batches before they are read,
        and one shard's room is left for a read that stages inline. With a cap per process instead, 2 workers and
        the main process together had 1.5 stages ahead, and a cold epoch under the window shuffle (``stage_bytes`` =
        1/4 of the pack) fetched 1.31x the pack in one run and 1.00x in another, depending on timing
        (``benchmarks/_data_shards.py`` measures the bytes read). One shard may always be ahead, so a stage smaller
        than two shards still reads ahead."""
        if not self.staging:
            return 0
        started: set[int] = set()
        seen: set[int] = set()
        biggest = max(self.pack.shard_sizes, default=1)
        cap = max(biggest, self.stage_bytes - biggest)
        with self._lock:
            inflight = self._inflight.get()
            ahead_bytes: int | None = None
            for i in indices:
                s = self.pack.shard[i]
                if s in seen:
                    continue
                seen.add(s)
                if s in inflight or os.path.exists(self._path(s)):
                    continue
                if ahead_bytes is None:
                    ahead_bytes = self._ahead()[1]  # one directory scan per call, only when there is work
                if ahead_bytes + self.pack.shard_sizes[s] > cap:
                    break
                try:
                    os.makedirs(self.stage_dir, exist_ok=True)
                    fd = self._claim_ahead(s)
                except OSError as e:
                    self._disable(e)
                    return 0
                if fd is None:
                    continue  # another reader of the node started it
                try:
                    # whose download (see `_ahead`); one left empty (disk full) counts as a live one's until its TTL
                    with contextlib.suppress(OSError):
                        os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)
                ahead_bytes += self.pack.shard_sizes[s]  # neither staged nor started by anyone: not counted yet
                fut = self.store.run(self._stage_quietly, s)
                inflight[s] = fut
                fut.add_done_callback(functools.partial(self._done, s))
                started.add(s)
        return sum(1 for i in indices if self.pack.shard[i] in started)

    def _claim_ahead(self, s: int) -> int | None:
        """Create shard ``s``'s ``.ahead`` marker exclusively: its open descriptor, or ``None`` when a live reader of
        the node holds it. A marker whose process died before the shard was read (a worker killed mid-download) is
        taken over, instead of keeping every reader from starting that shard until ``_AHEAD_TTL_S``."""
        path = self._ahead_path(s)
        for _ in range(2):
            try:
                return os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if _ahead_owner_alive(path):
                    return None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return None

    def _stage_quietly(self, s: int) -> None:
        try:
            staged = self._stage(s)
        except Exception:  # read() stages again and raises with context
            staged = None
        if staged is None:
            self._release(s)  # nothing staged: nothing ahead

    def _done(self, s: int, staged: Future[None]) -> None:
        if staged.cancelled():
            self._release(s)  # never started (a new epoch's order dropped it)
        with self._lock:
            self._inflight.get().pop(s, None)

    def drop_pending(self) -> None:
        """Forget staging not started yet (a new order: its next batches are others); downloads already running
        finish. The old order's "needed" markers go when :meth:`need` first sees the new order."""
        with self._lock:
            inflight = self._inflight.get()
            for f in list(inflight.values()):  # a cancelled future runs its done-callback inline: it pops itself
                f.cancel()
            inflight.clear()

    # ---- reads ---------------------------------------------------------------------------------------------------
    def _mapped(self, s: int) -> mmap.mmap | None:
        """Shard ``s``'s staged file, mapped by this process (staged first if needed); None: staging unavailable.

        Why a map kept open: another reader of the node may evict the file while this process still has samples of
        it to read (the stage is shared and bounded; under load a worker's next batch can come seconds later). An
        open map keeps an unlinked file readable, so those samples cost no second download; the disk space is freed
        when the map is dropped (at most ``_MAPPED`` shards per process, least recently used first). Before, each
        sample opened the file by name and a shard evicted in between was fetched again: a cold epoch under the
        window shuffle with one core kept busy fetched 1.45x the pack."""
        with self._lock:
            maps = self._maps.get()
            m = maps.get(s)
            if m is not None:
                maps.move_to_end(s)
                return m
        for _ in range(2):
            path = self._stage(s)
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:  # evicted by another process between the check and the open
                continue
            with self._lock:
                maps = self._maps.get()
                maps[s] = m
                while len(maps) > _MAPPED:
                    maps.popitem(last=False)  # a thread still slicing it holds its own reference
            return m
        return None

    def read(self, i: int, key: str) -> bytes:
        """The original bytes of sample ``i`` (``key`` names it in errors).

        Raises:
            OriginError: the store cannot deliver the shard, or the sample fails its CRC-32 (names shard and key);
                when the pack's index changed since it was listed, it says that the pack was replaced instead.
        """
        s, off, size, crc = self.pack.shard[i], self.pack.offset[i], self.pack.size[i], self.pack.crc32[i]
        for _ in range(2):
            m = self._mapped(s)
            if m is None:
                break
            data = m[off : off + size]
            if zlib.crc32(data) == crc and len(data) == size:
                self._touch(s, self._path(s))
                self._release(s)  # one failed unlink (~2 us) per sample once released: beside a decode, nothing
                return data
            with self._lock:
                self._maps.get().pop(s, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(s))  # a corrupt staged copy: fetch the shard again
            self.staged_refetches += 1
        try:  # costs nothing per sample unless it raises
            data = self.store.fetch(self.pack.shards[s], off, off + size)
        except OriginError as e:
            replaced = self._replaced(i, key)
            if replaced is None:
                raise
            raise replaced from e
        if zlib.crc32(data) != crc or len(data) != size:
            raise self._replaced(i, key) or OriginError(
                f"{self._where(i, key)} fails its CRC-32 against the pack index: the packed origin is corrupt. "
                "Re-run pack_origin."
            )
        return data

    def _where(self, i: int, key: str) -> str:
        """Sample ``i`` (``key``) and where its bytes are, for an error message."""
        s, off, size = self.pack.shard[i], self.pack.offset[i], self.pack.size[i]
        return f"sample {key!r} (bytes [{off}, {off + size}) of {self.store.url_of(self.pack.shards[s])!r})"

    def _replaced(self, i: int, key: str) -> OriginError | None:
        """The error for a failed read of sample ``i`` (``key``) when the pack was replaced after this reader's index
        was listed (its index now differs or is gone), else None. Only on a failed read: one GET of the index.

        Why: a pack replaced under a reader (on an object store, where no process can be seen reading it, or by
        another user's process) failed its reads as a missing shard or a corrupt pack, whose fix (re-run
        pack_origin) was already done; the reader needs a restart to list the new pack."""
        try:
            now = load_pack_index(self.store)
        except (OSError, ValueError):  # unreachable or unreadable now: the original error says more
            return None
        if now is not None and now.pack == self.pack:
            return None
        return OriginError(
            f"{self._where(i, key)} cannot be read: the packed origin {self.store.url!r} was replaced after it was "
            f"listed (its {PACK_INDEX} {'is gone' if now is None else 'differs'}: a pack_origin with `overwrite` ran "
            "while this run read it). Restart the run to read the pack now there; pack into another prefix while a "
            "run reads this one."
        )
