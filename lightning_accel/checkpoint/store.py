"""The delta checkpoint store: one small manifest per checkpoint path, content-addressed tensor blobs beside it.

Layout of a checkpoint directory (local path or any fsspec URL)::

    <dir>/epoch=0-step=50.ckpt      manifest (JSON, a few KB): skeleton key + per-tensor chain of blob keys
    <dir>/last.ckpt                 another manifest; unchanged tensors point at the same blobs
    <dir>/.delta_blobs/ab/ab12...   blobs, named by the BLAKE2b-160 of their bytes (content-addressed)

Algorithm of :meth:`DeltaStore.save`:

1. Split the checkpoint into a skeleton (loads with ``torch.load(weights_only=True)``) and named tensors.
2. For each tensor, hash its bytes. Same hash as the previous save of the same name in this directory: reuse that
   chain (a reference, nothing written).
3. Otherwise encode against the chain's reference (``delta_ref="base"``: the chain's lossless base, so restoring
   reads at most 2 blobs; ``"previous"``: the previous reconstruction, so chains grow up to ``max_chain``): an XOR
   delta (lossless), or a block-quantized delta for the groups selected by ``quantize``. A full (lossless) snapshot
   is written instead when the tensor is new or changed shape, when its chain already holds ``full_every`` saves,
   when the next link would exceed ``max_chain``, or when the delta is no smaller than ``rebase_ratio`` x the base
   (the restore cost would buy nothing).
4. Publish the new blobs (tmp + fsync + rename locally, one PUT on object stores), then the skeleton blob, then the
   manifest, atomically and last. A crash before the manifest leaves the previous checkpoints untouched and only
   unreferenced blobs, which the next collection removes.

References are *derived from manifests*: :meth:`DeltaStore.collect_garbage` reads every manifest of the directory
and deletes the blobs none of them (nor the in-memory chain state of this process) references. Nothing is
reference-counted in a side file that a crash could leave stale, so blobs can neither leak forever nor be lost.

One writer per directory at a time (one training run), enforced by a lock (:mod:`~lightning_accel.checkpoint.lock`);
any number of readers. Every damaged manifest, skeleton or blob raises :class:`CheckpointCorruptError` naming the file
and, where one is at fault, the tensor.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import re
import time
import warnings
import weakref
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_accel._utils.atomic import fsync_dir, is_local_url, strip_file_scheme
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess
from lightning_accel._utils.fs import FileStore
from lightning_accel._utils.paths import safe_join
from lightning_accel.checkpoint import codec
from lightning_accel.checkpoint.lock import CheckpointDirectoryLockedError, DirectoryLock, prepare_directory
from lightning_accel.checkpoint.skeleton import PLACEHOLDER, dump_skeleton, fill_skeleton, load_skeleton, split

__all__ = [
    "BLOB_DIR",
    "CheckpointCorruptError",
    "CheckpointDirectoryLockedError",
    "DeltaStore",
    "MANIFEST_FORMAT",
    "NotADeltaCheckpointError",
    "SaveStats",
    "is_manifest_bytes",
]

MANIFEST_FORMAT = "lightning-accel/delta-checkpoint"
_MANIFEST_PREFIX = ('{"format":"' + MANIFEST_FORMAT + '"').encode()
BLOB_DIR = ".delta_blobs"
_KEY_RE = re.compile(r"^[0-9a-f]{40}$")
_TMP_RE = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
_QUANT_GROUPS = ("optimizer", "all")
#: Suffix of the second copy of a full (base) blob written with ``redundancy=2``.
COPY_SUFFIX = ".copy"
# zstd's own limits (libzstd: ZSTD_minCLevel() = -131072, ZSTD_maxCLevel() = 22, ZSTDMT_NBWORKERS_MAX = 200); values
# outside are silently clamped by the library, so they are refused here instead.
_ZSTD_LEVELS = (-131072, 22)
_ZSTD_THREADS = (-1, 200)
_MAX_CHAIN_LEN = 64
_MAX_DIMS = 64


class CheckpointCorruptError(RuntimeError):
    """A checkpoint cannot be restored: a blob is missing or fails its checksum, or the manifest is damaged."""


class NotADeltaCheckpointError(ValueError):
    """The path exists but holds something other than a delta checkpoint manifest."""


def is_manifest_bytes(head: bytes) -> bool:
    """True when ``head`` (the first ~100 bytes of a file) starts like a delta checkpoint manifest: as the store
    writes it, or re-serialised with whitespace (a manifest pretty-printed by hand is still one)."""
    if head.startswith(_MANIFEST_PREFIX):
        return True
    compact = b"".join(head.split())
    return compact.startswith(_MANIFEST_PREFIX[: len(compact)]) and len(compact) >= len(_MANIFEST_PREFIX)


def _blob_key(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _raw_hash(t: torch.Tensor) -> str:
    """Identity of a tensor's bytes for "unchanged?" decisions at save time (collision-resistant)."""
    return hashlib.blake2b(codec.tensor_bytes(t).data, digest_size=16).hexdigest()


def _crc(t: torch.Tensor) -> int:
    """Checksum verified on every load: CRC-32 runs at ~1.3 GB/s here, BLAKE2b at ~0.3 GB/s (4 MB: 3 vs 12 ms)."""
    return zlib.crc32(codec.tensor_bytes(t).data)


@dataclass
class SaveStats:
    """What one save did: bytes and blobs written, tensors referenced unchanged, and the time it took."""

    path: str
    bytes_written: int = 0
    blobs_written: int = 0
    tensors_unchanged: int = 0
    tensors_delta: int = 0
    tensors_full: int = 0
    tensors_rebased: int = 0  # of `tensors_full`: re-based because their chain's base was mostly dead bytes
    seconds: float = 0.0


def entry_crc(name: str, meta: dict[str, Any]) -> int:
    """CRC-32 of one manifest entry and its tensor name (``mcrc``): a flipped byte in a name, a shape or a chain key
    is caught on load and names the tensor."""
    body = {k: v for k, v in meta.items() if k != "mcrc"}
    return zlib.crc32(json.dumps([name, body], sort_keys=True, separators=(",", ":")).encode())


@dataclass
class _Entry:
    """In-memory state of one tensor name after a save (what the next save deltas against)."""

    dtype: str
    shape: list[int]
    chain: list[str]
    sizes: list[int]
    hash: str  # BLAKE2b of the reconstruction (what a load returns)
    src_hash: str  # BLAKE2b of what was saved (differs from `hash` after a quantized delta)
    crc: int  # CRC-32 of the reconstruction, verified on load
    ref: torch.Tensor  # reconstruction the next delta is taken against (a private copy, never a live tensor)
    lossy: bool = False
    age: int = 0  # deltas written since the chain's full snapshot
    copy: bool = False  # the base blob has a second copy (redundancy=2)

    def manifest(self, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": self.shape,
            "chain": self.chain,
            "sizes": self.sizes,
            "crc32": self.crc,
        }
        if self.copy:
            meta["copy"] = True
        meta["mcrc"] = entry_crc(name, meta)
        return meta


@dataclass
class _DirState:
    entries: dict[str, _Entry] = field(default_factory=dict)
    saves_since_full: int = 0
    # What the live manifests of the directory hold, per path: tensor name -> (chain, sizes). Seeded from disk at the
    # first save of this process, kept up to date by its saves and removals; drives the dead-bytes re-base rule.
    live: dict[str, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]] = field(default_factory=dict)


def _split_path(path: str | os.PathLike[str]) -> tuple[str, str]:
    s = os.fspath(path)
    if is_local_url(s):
        s = os.path.abspath(strip_file_scheme(s))
        return os.path.dirname(s), s
    s = s.rstrip("/")
    return s.rsplit("/", 1)[0], s


class DeltaStore:
    """Save, load, verify and remove delta checkpoints (the functional core; no Lightning import).

    Args:
        storage_options: fsspec options for remote URLs (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``).
        quantize: ``None`` (lossless, the default), ``"int8"`` or ``"int4"``: store deltas of the selected float
            tensors block-quantized (see :mod:`lightning_accel.checkpoint.codec` for the error bound). Full
            snapshots stay lossless.
        quantize_groups: which tensors may be quantized: ``"optimizer"`` (``optimizer_states/...``, the default) or
            ``"all"`` floating tensors, or a sequence of name prefixes (e.g. ``["state_dict/model.head"]``).
        quant_block: elements per quantization scale.
        delta_ref: ``"base"`` (delta against the chain's full snapshot: restore reads at most 2 blobs) or
            ``"previous"`` (delta against the previous reconstruction: smaller deltas, longer chains).
        max_chain: most blobs one tensor's restore may read (``delta_ref="previous"``; ``"base"`` uses 2).
        full_every: a tensor's chain is restarted with a full snapshot after this many deltas.
        rebase_ratio: write a full snapshot instead of a delta that is at least this fraction of the base's size
            (0.8: a delta that saves less than 20 % is not worth keeping its base alive for; measured on the
            benchmark, bytes on disk at the end 0.71x -> 0.60x of ``torch.save`` for 0.406x -> 0.411x written).
        rebase_dead_fraction: write a full snapshot instead of a delta when the tensor's base is part of no live
            checkpoint any more (its own was removed) and is more than this fraction of the bytes its live chains
            keep on disk; 1.0 (default) never (measured: no gain on the benchmark once ``rebase_ratio=0.8``).
        redundancy: 1, or 2 to keep a second copy (``<key>.copy``) of every base (full) blob: a lost or damaged
            base is then read from its copy (with a warning) and :meth:`verify` ``(repair=True)`` rewrites it.
        inline_bytes: tensors smaller than this are packed into the skeleton blob (always rewritten, never deltas)
            instead of getting blobs of their own.
        zstd_level: zstd compression level (3: ~300 MB/s per core here; higher buys ~1-2 % on float noise).
        zstd_threads: zstd worker threads per blob (0: single-threaded; -1: one per core).
        io_threads: threads that encode/decode tensors in parallel.
        lock: take the directory's writer lock at its first save or removal
            (:class:`~lightning_accel.checkpoint.lock.DirectoryLock`; released by :meth:`close`).

    Raises:
        TypeError: an argument of the wrong type (``zstd_level="3"``, ``full_every=True``), naming it.
        ValueError: an argument out of its range (``zstd_level=99``), naming it, the range and the fix.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        quantize: Literal["int8", "int4"] | None = None,
        quantize_groups: Literal["optimizer", "all"] | Sequence[str] = "optimizer",
        quant_block: int = 128,
        delta_ref: Literal["base", "previous"] = "base",
        max_chain: int = 8,
        full_every: int = 16,
        rebase_ratio: float = 0.8,
        rebase_dead_fraction: float = 1.0,
        redundancy: int = 1,
        inline_bytes: int = 1024,
        zstd_level: int = 3,
        zstd_threads: int = 0,
        io_threads: int = 2,
        lock: bool = True,
    ) -> None:
        if quantize not in (None, "int8", "int4"):
            raise ValueError(
                f"`quantize` must be None, 'int8' or 'int4', got {quantize!r}. Use None for lossless checkpoints, "
                "'int8' for quantized deltas with a 1/254 error bound per block, 'int4' for 1/14."
            )
        if isinstance(quantize_groups, str):
            if quantize_groups not in _QUANT_GROUPS:
                raise ValueError(
                    f"`quantize_groups` must be 'optimizer', 'all' or a list of tensor-name prefixes, "
                    f"got {quantize_groups!r}. Example: `quantize_groups=['state_dict/model.head']`."
                )
        else:
            if not isinstance(quantize_groups, Sequence) or not quantize_groups:
                raise ValueError(
                    f"`quantize_groups` must be 'optimizer', 'all' or a non-empty list of tensor-name prefixes, got "
                    f"{quantize_groups!r}. Example: `quantize_groups=['optimizer_states/']`."
                )
            if not all(isinstance(p, str) and p for p in quantize_groups):
                raise ValueError(
                    f"`quantize_groups` prefixes must be non-empty strings, got {quantize_groups!r}. "
                    "Example: `quantize_groups=['state_dict/model.head']`."
                )
        if quantize is None and quantize_groups != "optimizer":
            warnings.warn(
                f"`quantize_groups={quantize_groups!r}` has no effect without `quantize`: checkpoints stay "
                "lossless. Set `quantize='int8'` (or 'int4') to quantize the selected tensors.",
                UserWarning,
                stacklevel=2,
            )
        if delta_ref not in ("base", "previous"):
            raise ValueError(
                f"`delta_ref` must be 'base' or 'previous', got {delta_ref!r}. 'base': restores read at most 2 blobs; "
                "'previous': smaller deltas, chains up to `max_chain`."
            )
        _check_int("quant_block", quant_block, 1, 1 << 24, "Typical: 32-1024 elements per scale (default 128).")
        _check_int("max_chain", max_chain, 1, _MAX_CHAIN_LEN, "Typical: 4-16 (default 8).")
        _check_int("full_every", full_every, 1, 1_000_000, "Typical: 8-64 deltas per full snapshot (default 16).")
        _check_fraction(
            "rebase_ratio",
            rebase_ratio,
            "Default 0.8: a delta must save at least 20 % of its base; a value > 1 never re-bases on size.",
            hi=100.0,
        )
        _check_fraction(
            "rebase_dead_fraction",
            rebase_dead_fraction,
            "1.0 (default) never re-bases for dead bytes; 0.3 re-bases when 30 % of a kept chain is dead.",
        )
        _check_int("redundancy", redundancy, 1, 2, "1: one copy of every blob; 2: a second copy of each base blob.")
        _check_int("inline_bytes", inline_bytes, 0, 1 << 30, "Default 1024 bytes.")
        _check_int(
            "zstd_level",
            zstd_level,
            *_ZSTD_LEVELS,
            "zstd's levels are 1-22 (default 3; higher buys ~1-2 % on float tensors) and negative fast levels.",
        )
        _check_int("zstd_threads", zstd_threads, *_ZSTD_THREADS, "0: single-threaded (default), -1: one per core.")
        _check_int("io_threads", io_threads, 1, 256, f"Default 2; this machine has {os.cpu_count()} cores.")
        if not isinstance(lock, bool):
            raise TypeError(f"`lock` must be True or False, got {lock!r}.")
        # Local paths and fsspec URLs alike, with retries of transient errors; validates `storage_options`.
        self.fs = FileStore(storage_options)
        self.quantize = quantize
        self.quantize_groups = quantize_groups if isinstance(quantize_groups, str) else tuple(quantize_groups)
        self.quant_block = quant_block
        self.delta_ref = delta_ref
        self.max_chain = 2 if delta_ref == "base" else max_chain
        self.full_every = full_every
        self.rebase_ratio = float(rebase_ratio)
        self.rebase_dead_fraction = float(rebase_dead_fraction)
        self.redundancy = redundancy
        self.inline_bytes = inline_bytes
        self.zstd_level = zstd_level
        self.zstd_threads = zstd_threads
        self.io_threads = io_threads
        self.lock = lock
        # The chain state of this process (directory -> what the next save deltas against). Per process, so a pickled
        # or forked copy of the store starts without it: it holds a private copy of every tensor, and a copy must
        # not delta against saves it did not make. The lock and the filesystems pickle fresh by themselves.
        self._dirs: PerProcess[dict[str, _DirState]] = PerProcess(dict)
        # The writer locks this process's store holds (directory -> lock); released by `close()` or when the store
        # is garbage-collected.
        self._locks: PerProcess[dict[str, DirectoryLock]] = PerProcess(dict)
        self._lock = ForkSafeLock(reentrant=True)
        self._warned_groups = False

    def _writable(self, directory: str) -> None:
        """Before the first write in ``directory``: make it (clear errors for a file or an unwritable path) and take
        its writer lock; afterwards: raise if the (object-store) lease was lost."""
        held = self._locks.get()
        lk = held.get(directory)
        if lk is not None:
            lk.check()
            if lk.held:
                return
        if not self.lock:
            prepare_directory(directory)
            return
        lk = DirectoryLock(self.fs, directory)
        lk.acquire()
        held[directory] = lk
        weakref.finalize(self, lk.release)
        if lk.took_over is not None:
            warnings.warn(
                f"Took over the writer lock of checkpoint directory {directory!r} from pid {lk.took_over.get('pid')} "
                f"on host {lk.took_over.get('host')}, which no longer holds it (killed or crashed).",
                UserWarning,
                stacklevel=3,
            )

    def claim(self, directory: str) -> None:
        """Take ``directory``'s writer lock now, before the first save (made if missing); nothing when ``lock=False``
        beyond making it.

        Raises:
            CheckpointDirectoryLockedError: another live writer holds it.
        """
        with self._lock:
            self._writable(directory.rstrip("/"))

    def close(self) -> None:
        """Release this process's writer locks (the next save in a directory takes its lock again)."""
        with self._lock:
            held = self._locks.get()
            for lk in held.values():
                lk.release()
            held.clear()

    # ------------------------------------------------------------------ paths
    def blob_url(self, directory: str, key: str) -> str:
        if not _KEY_RE.match(key):
            raise CheckpointCorruptError(f"invalid blob key {key!r} in a manifest")
        return safe_join(safe_join(directory, BLOB_DIR), f"{key[:2]}/{key}")

    def _check_target(self, path: str) -> bool:
        """True when ``path`` already holds a manifest (to be replaced); raise if it holds anything else."""
        if not self.fs.exists(path):
            return False
        if self.fs.isdir(path):
            raise NotADeltaCheckpointError(
                f"Checkpoint path {path!r} is a directory. DeltaCheckpointIO writes one manifest file per checkpoint "
                "path; choose another `dirpath`/`filename` or remove the directory."
            )
        try:
            head = self.fs.head(path, 128)
        except FileNotFoundError:  # a dangling symlink: replacing it is harmless
            return False
        if not is_manifest_bytes(head):
            raise NotADeltaCheckpointError(
                f"Checkpoint path {path!r} already holds a file that is not a delta checkpoint manifest (e.g. a "
                "`torch.save` checkpoint); refusing to overwrite it. Move it away or save to another directory."
            )
        return True

    def _wants_quant(self, name: str, t: torch.Tensor) -> bool:
        if self.quantize is None or not t.is_floating_point():
            return False
        if self.quantize_groups == "all":
            return True
        if self.quantize_groups == "optimizer":
            return name.startswith("optimizer_states/")
        return any(name.startswith(p) for p in self.quantize_groups)

    # ------------------------------------------------------------------ save
    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> SaveStats:
        """Write ``checkpoint`` as a delta checkpoint at ``path`` (a manifest file).

        The tensors must not change while this runs (the adapter snapshots them first in async mode). The first save
        (or removal) in a directory takes its writer lock (:mod:`~lightning_accel.checkpoint.lock`).

        Raises:
            NotADeltaCheckpointError: ``path`` is a directory or a foreign file.
            NotADirectoryError: the checkpoint directory is a file.
            CheckpointDirectoryLockedError: another writer holds the directory.
            UnsafeCheckpointContent: the checkpoint holds objects that cannot be loaded without unpickling code.
            OSError: writing failed (e.g. disk full, an unwritable directory); earlier checkpoints are intact.
        """
        if not isinstance(checkpoint, dict):
            raise TypeError(f"`checkpoint` must be a dict, got {type(checkpoint).__name__}.")
        t0 = time.perf_counter()
        directory, path = _split_path(path)
        with self._lock:
            self._writable(directory)
            replacing = self._check_target(path)
            skeleton, all_tensors = split(checkpoint)
            self._warn_if_groups_match_nothing(all_tensors)
            tensors = {n: t for n, t in all_tensors.items() if t.numel() * t.element_size() >= self.inline_bytes}
            small = {n: t for n, t in all_tensors.items() if n not in tensors}
            dirs = self._dirs.get()
            first_save_here = directory not in dirs
            dstate = dirs.setdefault(directory, _DirState())
            if first_save_here:  # collect what a killed earlier run left behind (unreferenced blobs, tmp files)
                self.collect_garbage(directory)
            dead = self._dead_bases(dstate)
            stats = SaveStats(path=path)
            new_entries: dict[str, _Entry] = {}

            def encode(item: tuple[str, torch.Tensor]) -> tuple[str, _Entry, list[tuple[str, bytes]], str]:
                name, t = item
                if t.device.type != "cpu":
                    t = t.cpu()
                return (name, *self._encode_one(name, t, dstate.entries.get(name), dead))

            with ThreadPoolExecutor(max_workers=self.io_threads) as pool:
                results = list(pool.map(encode, tensors.items()))
            for name, entry, blobs, how in results:
                new_entries[name] = entry
                if how == "rebased":
                    stats.tensors_rebased += 1
                    how = "full"
                setattr(stats, f"tensors_{how}", getattr(stats, f"tensors_{how}") + 1)
                for key, data in blobs:
                    urls = [self.blob_url(directory, key)]
                    if how == "full" and entry.copy:
                        urls.append(urls[0] + COPY_SUFFIX)
                    for url in urls:
                        if not self.fs.exists(url):
                            self.fs.write(url, data)
                            stats.bytes_written += len(data)
                            stats.blobs_written += 1
            skel_blob = _pack_skeleton(dump_skeleton(skeleton), small)
            skel_key = _blob_key(skel_blob)
            skel_url = self.blob_url(directory, skel_key)
            if not self.fs.exists(skel_url):
                self.fs.write(skel_url, skel_blob)
                stats.bytes_written += len(skel_blob)
                stats.blobs_written += 1
            if is_local_url(directory):
                fsync_dir(strip_file_scheme(safe_join(directory, BLOB_DIR)))
            manifest = {
                "format": MANIFEST_FORMAT,
                "version": 1,
                "blob_dir": BLOB_DIR,
                "created": time.time(),
                "skeleton": skel_key,
                "lossy": any(e.lossy for e in new_entries.values()),
                "tensors": {n: e.manifest(n) for n, e in new_entries.items()},
            }
            data = json.dumps(manifest, separators=(",", ":")).encode()
            assert is_manifest_bytes(data)
            self.fs.write(path, data)  # published last: the checkpoint exists from here on
            stats.bytes_written += len(data)
            # Only now does the next save delta against this one (a failed save changes nothing).
            dstate.entries = new_entries
            dstate.live[path] = {n: (tuple(e.chain), tuple(e.sizes)) for n, e in new_entries.items()}
            if replacing:
                self.collect_garbage(directory)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _warn_if_groups_match_nothing(self, tensors: dict[str, torch.Tensor]) -> None:
        """``quantize_groups`` prefixes are checked against the first checkpoint's tensor names (they are not known
        before): a selection that matches no float tensor would silently keep everything lossless."""
        if self._warned_groups or self.quantize is None or isinstance(self.quantize_groups, str):
            return
        self._warned_groups = True
        floats = [n for n, t in tensors.items() if t.is_floating_point()]
        if not any(self._wants_quant(n, tensors[n]) for n in floats):
            examples = ", ".join(repr(n) for n in floats[:3]) or "none"
            warnings.warn(
                f"`quantize_groups={list(self.quantize_groups)!r}` matches none of the checkpoint's "
                f"{len(floats)} float tensors (e.g. {examples}), so nothing is quantized. Use prefixes of those "
                "names, 'optimizer' or 'all'.",
                UserWarning,
                stacklevel=4,
            )

    def _dead_bases(self, dstate: _DirState) -> set[tuple[str, str]]:
        """``(tensor name, base key)`` pairs whose next delta should be a full snapshot instead: no live manifest
        holds the base's own version any more (its checkpoint was removed), and the base is more than
        ``rebase_dead_fraction`` of the bytes that the live chains of that tensor keep on disk."""
        if self.rebase_dead_fraction >= 1.0:
            return set()
        owned: set[tuple[str, str]] = set()
        kept: dict[tuple[str, str], dict[str, int]] = {}
        for tensors in dstate.live.values():
            for name, (chain, sizes) in tensors.items():
                if not chain:
                    continue
                if len(chain) == 1:
                    owned.add((name, chain[0]))
                links = kept.setdefault((name, chain[0]), {})
                for k, n in zip(chain, sizes, strict=False):
                    links[k] = int(n)
        dead = set()
        for nb, links in kept.items():
            if nb in owned:
                continue
            total = sum(links.values())
            if total and links.get(nb[1], 0) / total > self.rebase_dead_fraction:
                dead.add(nb)
        return dead

    def _encode_one(
        self, name: str, t: torch.Tensor, prev: _Entry | None, dead: set[tuple[str, str]] | frozenset = frozenset()
    ) -> tuple[_Entry, list[tuple[str, bytes]], str]:
        """Decide reference / delta / full for one tensor and encode it. Returns (entry, new blobs, how)."""
        dname = codec.dtype_name(t.dtype)
        shape = list(t.shape)
        src_hash = _raw_hash(t)
        rebased = False
        if prev is not None and prev.dtype == dname and prev.shape == shape:
            if prev.src_hash == src_hash or prev.hash == src_hash:
                return prev, [], "unchanged"
            room = self.delta_ref == "base" or len(prev.chain) < self.max_chain  # "base" chains are always 2 long
            rebased = (name, prev.chain[0]) in dead
            if room and prev.age < self.full_every and not rebased:
                ref_key = prev.chain[0] if self.delta_ref == "base" else prev.chain[-1]
                if self._wants_quant(name, t):
                    blob, recon = codec.encode_quant(
                        t,
                        prev.ref,
                        ref_key,
                        bits=8 if self.quantize == "int8" else 4,
                        block=self.quant_block,
                        level=self.zstd_level,
                        threads=self.zstd_threads,
                    )
                    lossy = True
                else:
                    blob = codec.encode_xor(t, prev.ref, ref_key, level=self.zstd_level, threads=self.zstd_threads)
                    recon, lossy = t, False  # XOR restores t bit-exactly whatever the reference was
                if len(blob) < self.rebase_ratio * prev.sizes[0]:
                    key = _blob_key(blob)
                    if self.delta_ref == "base":
                        chain, sizes, ref = [prev.chain[0], key], [prev.sizes[0], len(blob)], prev.ref
                    else:
                        chain, sizes, ref = [*prev.chain, key], [*prev.sizes, len(blob)], recon.clone()
                    h = src_hash if recon is t else _raw_hash(recon)
                    crc = _crc(recon)
                    entry = _Entry(dname, shape, chain, sizes, h, src_hash, crc, ref, lossy, prev.age + 1, prev.copy)
                    return entry, [(key, blob)], "delta"
        blob = codec.encode_full(t, level=self.zstd_level, threads=self.zstd_threads)
        key = _blob_key(blob)
        # A private copy: in synchronous mode `t` aliases the live parameter, which the optimizer keeps changing.
        ref = t.detach().clone().reshape(shape)
        entry = _Entry(dname, shape, [key], [len(blob)], src_hash, src_hash, _crc(t), ref, copy=self.redundancy > 1)
        return entry, [(key, blob)], "rebased" if rebased else "full"

    # ------------------------------------------------------------------ load
    def read_manifest(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and validate the manifest at ``path`` (every tensor entry checked, with its ``mcrc`` when present).

        Raises:
            FileNotFoundError: nothing at ``path``.
            NotADeltaCheckpointError: ``path`` is a directory or holds something else.
            CheckpointCorruptError: the manifest is damaged (naming the file, and the tensor when one is at fault).
        """
        _, p = _split_path(path)
        if not self.fs.exists(p):
            raise FileNotFoundError(errno.ENOENT, f"Checkpoint {p!r} does not exist")
        if self.fs.isdir(p):
            raise NotADeltaCheckpointError(_is_a_directory(self.fs, p))
        # The head first: a plain `torch.save` file of gigabytes is not downloaded just to be told apart.
        head = self.fs.head(p, 128)
        if not is_manifest_bytes(head):
            if _damaged_manifest_head(head):
                raise CheckpointCorruptError(
                    f"The manifest of checkpoint {p!r} is damaged (its header reads {head[:40]!r}); load another "
                    "checkpoint of the directory."
                )
            raise NotADeltaCheckpointError(f"{p!r} is not a delta checkpoint manifest.")
        data = self.fs.read(p)
        try:
            manifest = json.loads(data)
            if not isinstance(manifest, dict):
                raise ValueError("not a JSON object")
            if manifest.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}")
            if manifest["version"] != 1 or not isinstance(manifest["tensors"], dict):
                raise ValueError(f"unsupported manifest version {manifest['version']!r}")
            if not isinstance(manifest["skeleton"], str) or not _KEY_RE.match(manifest["skeleton"]):
                raise ValueError(f"bad skeleton key {manifest['skeleton']!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(f"The manifest of checkpoint {p!r} is damaged ({e!r}).") from e
        for name, meta in manifest["tensors"].items():
            _check_entry(p, name, meta)
        return manifest

    def _fetch(
        self,
        directory: str,
        key: str,
        ckpt: str,
        what: str,
        check_key: bool,
        copy: bool = False,
        used_copies: list[str] | None = None,
    ) -> bytes:
        url = self.blob_url(directory, key)
        try:
            data = self.fs.read(url)
            problem = None
        except FileNotFoundError:
            data, problem = b"", "is missing"
        except IsADirectoryError:
            data, problem = b"", "is a directory"
        # Loads rely on the CRC-32 of the decoded tensor (any damaged link changes it); `verify` also re-hashes
        # every blob against its content address (BLAKE2b, 4x slower).
        if problem is None and check_key and _blob_key(data) != key:
            problem = "fails its checksum"
        if problem is None:
            return data
        if copy:  # redundancy=2: a base blob has a second copy; it is trusted only if its content address matches
            try:
                spare = self.fs.read(url + COPY_SUFFIX)
            except (FileNotFoundError, IsADirectoryError):
                spare = b""
            if spare and _blob_key(spare) == key:
                warnings.warn(
                    f"Checkpoint {ckpt!r}: blob {key} of {what} {problem} ({url}); restored from its second copy. "
                    "Run `lightning-accel ckpt verify --repair` to rewrite it.",
                    UserWarning,
                    stacklevel=2,
                )
                if used_copies is not None:
                    used_copies.append(key)
                return spare
        hint = (
            "It was deleted or damaged outside this plugin, never written (a second writer in the same directory, "
            "a damaged manifest), or lost with its storage"
            if problem == "is missing"
            else "The file is corrupt"
        )
        raise CheckpointCorruptError(
            f"Checkpoint {ckpt!r}: blob {key} of {what} {problem} ({url}). {hint}; this checkpoint cannot be "
            "restored. Load an older or newer checkpoint, or restore the blob directory (`redundancy=2` keeps a "
            "second copy of base blobs)."
        )

    def _restore_tensor(
        self,
        directory: str,
        ckpt: str,
        name: str,
        meta: dict[str, Any],
        check_keys: bool = False,
        used_copies: list[str] | None = None,
    ) -> torch.Tensor:
        copy = bool(meta.get("copy"))
        try:
            return self._restore_once(directory, ckpt, name, meta, check_keys, False, used_copies)
        except CheckpointCorruptError:
            if not copy:
                raise
            # The base may be the damaged link: re-read it with its content address checked (falls back to the copy).
            return self._restore_once(directory, ckpt, name, meta, True, True, used_copies)

    def _restore_once(
        self,
        directory: str,
        ckpt: str,
        name: str,
        meta: dict[str, Any],
        check_keys: bool,
        copy: bool,
        used_copies: list[str] | None,
    ) -> torch.Tensor:
        what = f"tensor `{name}`"
        dtype = codec.dtype_from_name(meta["dtype"])
        shape = [int(s) for s in meta["shape"]]
        chain = [str(k) for k in meta["chain"]]
        crc = int(meta["crc32"])
        blobs = [
            self._fetch(directory, key, ckpt, what, check_keys, copy and i == 0, used_copies)
            for i, key in enumerate(chain)
        ]
        nbytes = _numel(shape) * codec.itemsize_of(dtype)
        try:
            for i, blob in enumerate(blobs):
                header, _ = codec.read_header(blob)
                expected_ref = None if i == 0 else chain[i - 1]
                if header.get("ref") != expected_ref:
                    raise codec.CodecError(f"blob {chain[i]} references {header.get('ref')}, expected {expected_ref}")
                if header.get("dtype") != meta["dtype"]:
                    raise codec.CodecError(f"blob {chain[i]} holds {header.get('dtype')!r}, not {meta['dtype']!r}")
                quant = header.get("kind") == "quant"
                size, want = (header.get("numel"), _numel(shape)) if quant else (header.get("nbytes"), nbytes)
                if size != want:  # checked before anything is allocated from a damaged size
                    unit = "elements" if quant else "bytes"
                    raise codec.CodecError(f"blob {chain[i]} holds {size!r} {unit}, the shape needs {want}")
            out = codec.decode_chain(blobs, shape)
        except Exception as e:  # noqa: BLE001 - whatever damaged bytes make the decoder raise, the tensor is lost
            raise CheckpointCorruptError(
                f"Checkpoint {ckpt!r}: cannot decode {what} (chain {', '.join(chain)}): {type(e).__name__}: "
                f"{_first_line(e)}"
            ) from e
        if out.dtype != dtype or list(out.shape) != shape or _crc(out) != crc:
            raise CheckpointCorruptError(
                f"Checkpoint {ckpt!r}: {what} fails its checksum after decoding (a blob of its chain "
                f"{', '.join(chain)} is corrupt)."
            )
        return out

    def load(
        self, path: str | os.PathLike[str], map_location: Any = None, *, check_keys: bool = False
    ) -> dict[str, Any]:
        """Rebuild the checkpoint dict saved at ``path``; every blob and every tensor is checksum-verified.

        Args:
            path: the manifest path.
            map_location: ``None``/``"cpu"``, a device (string or ``torch.device``) to move tensors to, a dict
                ``{"cuda:1": "cuda:0"}``-style mapping (applied as for ``torch.load``), or a callable
                ``(storage, location)`` (tensors are restored on the CPU and the callable is not called).
            check_keys: also re-hash every blob against its content address (what :meth:`verify` does).

        Raises:
            CheckpointCorruptError: the manifest, the skeleton or a blob is missing or damaged (the message names the
                checkpoint and, where one is at fault, the tensor).
        """
        return self._load(path, map_location, check_keys, None)

    def _load(
        self, path: str | os.PathLike[str], map_location: Any, check_keys: bool, used_copies: list[str] | None
    ) -> dict[str, Any]:
        directory, p = _split_path(path)
        manifest = self.read_manifest(p)
        skel = self._fetch(directory, manifest["skeleton"], p, "the skeleton (non-tensor state)", True)
        try:
            skeleton, small = _unpack_skeleton(skel)
            if not isinstance(skeleton, dict):
                raise TypeError(f"it holds a {type(skeleton).__name__}, not a dict")
        except Exception as e:  # noqa: BLE001 - anything here means the skeleton is unusable
            raise CheckpointCorruptError(
                f"Checkpoint {p!r}: the skeleton (non-tensor state) cannot be read safely ({type(e).__name__}: "
                f"{_first_line(e)})."
            ) from e
        items = list(manifest["tensors"].items())
        _check_names(p, skeleton, {n for n, _ in items}, set(small))
        # Tensors with identical chains (last.ckpt vs its step, zero-initialised buffers) are decoded once.
        unique: dict[tuple[str, ...], tuple[str, dict[str, Any]]] = {}
        for name, meta in items:
            unique.setdefault((*meta["chain"], str(meta["shape"]), meta["dtype"]), (name, meta))
        with ThreadPoolExecutor(max_workers=self.io_threads) as pool:
            decoded = dict(
                zip(
                    unique,
                    pool.map(
                        lambda nm: self._restore_tensor(directory, p, nm[0], nm[1], check_keys, used_copies),
                        unique.values(),
                    ),
                    strict=True,
                )
            )
        tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[str, ...]] = set()
        for name, meta in items:
            k = (*meta["chain"], str(meta["shape"]), meta["dtype"])
            t = decoded[k]
            tensors[name] = t.clone() if k in seen else t
            seen.add(k)
        tensors.update(small)
        device = _target_device(map_location)
        if device is not None:
            tensors = {n: t.to(device) for n, t in tensors.items()}
        return fill_skeleton(skeleton, tensors)

    def verify(self, path: str | os.PathLike[str], *, repair: bool = False) -> dict[str, Any]:
        """Restore every tensor of the checkpoint at ``path`` with all checksums; return a summary.

        Args:
            path: the manifest path.
            repair: rewrite base blobs that are missing or corrupt from their second copy (``redundancy=2``).

        Raises:
            CheckpointCorruptError: naming the checkpoint and the tensor that fails.
        """
        directory, p = _split_path(path)
        manifest = self.read_manifest(p)
        used: list[str] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # reported in the summary instead
            ckpt = self._load(p, None, True, used)
        repaired = []
        if repair:
            for key in sorted(set(used)):
                url = self.blob_url(directory, key)
                spare = self.fs.read(url + COPY_SUFFIX)
                if _blob_key(spare) == key:
                    self.fs.write(url, spare)
                    repaired.append(key)
        keys = {manifest["skeleton"]}
        for meta in manifest["tensors"].values():
            keys.update(meta["chain"])
        stored = sum(sum(m.get("sizes", [])) for m in manifest["tensors"].values())
        raw = sum(
            _numel(m["shape"]) * codec.itemsize_of(codec.dtype_from_name(m["dtype"]))
            for m in manifest["tensors"].values()
        )
        return {
            "path": p,
            "ok": True,
            "tensors": len(manifest["tensors"]),
            "blobs": len(keys),
            "raw_tensor_bytes": raw,
            "chain_bytes": stored,
            "max_chain": max((len(m["chain"]) for m in manifest["tensors"].values()), default=0),
            "lossy": bool(manifest.get("lossy")),
            "copies_used": sorted(set(used)),
            "repaired": repaired,
            "top_level_keys": sorted(map(str, ckpt)),
        }

    def export(self, path: str | os.PathLike[str], out: str | os.PathLike[str]) -> str:
        """Write the checkpoint at ``path`` as one plain ``torch.save`` file at ``out`` (what ``torch.load`` and
        ``TorchCheckpointIO`` read). Returns ``out``."""
        import io

        ckpt = self.load(path)
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        out_s = os.fspath(out)
        self.fs.write(out_s, buf.getvalue())
        return out_s

    # ------------------------------------------------------------------ remove / collect
    def remove(self, path: str | os.PathLike[str]) -> int:
        """Delete the checkpoint at ``path`` and collect the blobs no remaining manifest references.

        A symlink is removed as a link. Local symlinks that point at the removed manifest (Lightning's
        ``save_last="link"``) are first replaced by a copy of it, so they stay loadable. A missing path is a no-op.

        Returns:
            The number of blobs deleted.

        Raises:
            NotADeltaCheckpointError: ``path`` holds something else (it is left alone).
            CheckpointDirectoryLockedError: another writer holds the directory.
        """
        directory, p = _split_path(path)
        with self._lock:
            if not self.fs.exists(p):
                return 0
            self._writable(directory)
            state = self._dirs.get().get(directory)
            if state is not None:
                state.live.pop(p, None)
            local = is_local_url(p)
            if local and os.path.islink(p):
                os.unlink(p)
                return self.collect_garbage(directory)
            if self.fs.isdir(p) or not is_manifest_bytes(self.fs.head(p, 128)):
                raise NotADeltaCheckpointError(
                    f"Refusing to remove {p!r}: it is not a delta checkpoint manifest written by DeltaCheckpointIO."
                )
            if local:
                self._materialize_links_to(directory, p)
            self.fs.rm(p)
            if local:
                fsync_dir(directory)
            return self.collect_garbage(directory)

    def _materialize_links_to(self, directory: str, target: str) -> None:
        data = None
        real = os.path.realpath(target)
        for name in self.fs.list_files(directory):
            link = os.path.join(directory, name)
            if os.path.islink(link) and os.path.realpath(link) == real:
                data = self.fs.read(target) if data is None else data
                self.fs.write(link, data)  # os.replace swaps the link for a real manifest

    def live_keys(self, directory: str) -> set[str]:
        """Blob keys referenced by any manifest in ``directory`` or by this process's chain state."""
        keys: set[str] = set()
        state = self._dirs.get().get(directory)
        live: dict[str, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]] = {}
        for name in self.fs.list_files(directory):
            url = safe_join(directory, name)
            try:
                head = self.fs.head(url, 128)
                if not is_manifest_bytes(head):
                    if _damaged_manifest_head(head):
                        raise ValueError(f"its header reads {head[:40]!r}")
                    continue
                m = json.loads(self.fs.read(url))
                keys.add(m["skeleton"])
                chains = {}
                for tname, meta in m["tensors"].items():
                    keys.update(meta["chain"])
                    chains[tname] = (tuple(meta["chain"]), tuple(int(n) for n in meta.get("sizes", ())))
                live[_split_path(url)[1]] = chains
            except (FileNotFoundError, IsADirectoryError):  # removed meanwhile / dangling link
                continue
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                # A damaged manifest: keep everything rather than guess what it needed.
                raise CheckpointCorruptError(
                    f"Manifest {url!r} is damaged ({e!r}); not collecting blobs in {directory!r} so nothing it may "
                    "reference is lost. Remove or repair it."
                ) from e
        if state is not None:
            state.live = live
            for entry in state.entries.values():
                keys.update(entry.chain)
        return keys

    def collect_garbage(self, directory: str | os.PathLike[str]) -> int:
        """Delete blobs of ``directory`` that no manifest references, and temporary files of interrupted writes.

        Returns:
            The number of files deleted.

        Raises:
            CheckpointDirectoryLockedError: another writer holds the directory.
        """
        directory = _norm_dir(directory)
        with self._lock:
            self._writable(directory)
            try:
                live = self.live_keys(directory)
            except CheckpointCorruptError as e:  # keep everything; saves go on (their manifests are intact)
                warnings.warn(str(e), UserWarning, stacklevel=2)
                return 0
            blob_root = safe_join(directory, BLOB_DIR)
            deleted = 0
            for rel in self.fs.find(blob_root):
                base = posixpath.basename(rel)
                key = base[: -len(COPY_SUFFIX)] if base.endswith(COPY_SUFFIX) else base
                if key in live:
                    continue
                if _KEY_RE.match(key) or _TMP_RE.match(base):
                    self.fs.rm(safe_join(blob_root, rel))
                    deleted += 1
            for name in self.fs.list_files(directory):
                if _TMP_RE.match(name):
                    self.fs.rm(safe_join(directory, name))
                    deleted += 1
            return deleted

    def forget(self, directory: str | None = None) -> None:
        """Drop the in-memory chain state (the next save of each tensor is a full snapshot)."""
        with self._lock:
            if directory is None:
                self._dirs.get().clear()
            else:
                self._dirs.get().pop(_norm_dir(directory), None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _is_a_directory(fs: FileStore, path: str) -> str:
    """The message for a checkpoint path that is a directory, listing the checkpoints inside it."""
    try:
        inside = sorted(n for n in fs.list_files(path) if n.endswith(".ckpt"))
    except Exception:  # noqa: BLE001 - only a hint
        inside = []
    hint = f" It holds {', '.join(inside[:5])}{' ...' if len(inside) > 5 else ''}: pass one of those." if inside else ""
    return (
        f"Checkpoint path {path!r} is a directory, not a checkpoint file. Pass the path of one checkpoint, e.g. "
        f"{posixpath.join(path, 'last.ckpt')!r}.{hint}"
    )


def _damaged_manifest_head(head: bytes) -> bool:
    """A file whose start is one or two bytes off a manifest's (``{"format":"lightning-accel/delta-checkpoint"``)."""
    want = _MANIFEST_PREFIX
    if len(head) < len(want):
        return head.startswith(b"{") and b"lightning-accel" in head
    return sum(a != b for a, b in zip(head, want, strict=False)) <= 2


def _check_entry(path: str, name: Any, meta: Any) -> None:
    """One manifest entry is well-formed and (with ``mcrc``) intact; else CheckpointCorruptError naming the tensor."""
    what = f"Checkpoint {path!r}: the manifest entry of tensor `{name}`"
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{what} is damaged (a {type(meta).__name__}, not a mapping).")
    try:
        if "mcrc" in meta and entry_crc(str(name), meta) != meta["mcrc"]:
            raise ValueError("its checksum (mcrc) does not match: a byte of its name, shape, dtype or chain changed")
        codec.dtype_from_name(meta["dtype"])
        shape, chain, sizes = meta["shape"], meta["chain"], meta.get("sizes", [])
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
            raise ValueError(f"shape {shape!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in shape):
            raise ValueError(f"shape {shape!r}")
        if not isinstance(chain, list) or not 1 <= len(chain) <= _MAX_CHAIN_LEN:
            raise ValueError(f"a chain of {len(chain) if isinstance(chain, list) else chain!r} blobs")
        if not all(isinstance(k, str) and _KEY_RE.match(k) for k in chain):
            raise ValueError(f"chain {chain!r}")
        if not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes):
            raise ValueError(f"sizes {sizes!r}")
        crc = meta["crc32"]
        if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 1 << 32:
            raise ValueError(f"crc32 {crc!r}")
    except (KeyError, TypeError, ValueError, codec.CodecError) as e:
        raise CheckpointCorruptError(f"{what} is damaged ({type(e).__name__}: {e}).") from e


def _check_names(path: str, skeleton: Any, listed: set[str], small: set[str]) -> None:
    """The skeleton's tensor placeholders and the manifest's + skeleton blob's tensors are the same names."""
    wanted: set[str] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, str) and obj.startswith(PLACEHOLDER):
            wanted.add(obj[len(PLACEHOLDER) :])
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v)

    walk(skeleton)
    have = listed | small
    missing, extra = sorted(wanted - have), sorted(listed - wanted)
    if missing:
        raise CheckpointCorruptError(
            f"Checkpoint {path!r}: tensor `{missing[0]}` is not in the manifest"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
            + (f"; the manifest lists `{extra[0]}` instead" if extra else "")
            + " — the manifest is damaged."
        )
    if extra:
        raise CheckpointCorruptError(
            f"Checkpoint {path!r}: the manifest lists tensor `{extra[0]}`, which the checkpoint's structure does not "
            "hold — the manifest is damaged."
        )


def _pack_skeleton(skeleton_bytes: bytes, small: dict[str, torch.Tensor]) -> bytes:
    """One blob: the ``torch.save``d skeleton followed by the raw bytes of the small tensors (zstd on top)."""
    parts, items, offset = [skeleton_bytes], [], len(skeleton_bytes)
    for name, t in small.items():
        raw = codec.tensor_bytes(t)
        items.append([name, codec.dtype_name(t.dtype), list(t.shape), offset])
        parts.append(raw.tobytes())
        offset += raw.size
    body = b"".join(parts)
    header = {
        "kind": "skeleton",
        "dtype": "uint8",
        "nbytes": len(body),
        "ref": None,
        "items": items,
        "skeleton_bytes": len(skeleton_bytes),
    }
    return codec._pack(header, codec._zstd_compress(body, 3, 0))


def _unpack_skeleton(blob: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    header, payload = codec.read_header(blob)
    if header["kind"] != "skeleton":
        raise codec.CodecError(f"expected a skeleton blob, got `{header['kind']}`")
    body = codec._zstd_decompress(payload, int(header["nbytes"]))
    n = int(header["skeleton_bytes"])
    skeleton = load_skeleton(body[:n].tobytes())
    small = {}
    for name, dname, shape, offset in header["items"]:
        dtype = codec.dtype_from_name(dname)
        size = _numel(shape) * codec.itemsize_of(dtype)
        if offset < n or offset + size > body.size:
            raise codec.CodecError(f"small tensor {name!r} lies outside the skeleton blob")
        small[name] = codec.tensor_from_bytes(body[offset : offset + size], dtype, shape)
    return skeleton, small


def _norm_dir(directory: str | os.PathLike[str]) -> str:
    s = os.fspath(directory)
    return os.path.abspath(strip_file_scheme(s)) if is_local_url(s) else s.rstrip("/")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _target_device(map_location: Any) -> torch.device | None:
    if map_location is None or callable(map_location):
        return None
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return torch.device(target) if target is not None else None
    dev = torch.device(map_location)
    return None if dev.type == "cpu" else dev


def _check_int(name: str, value: Any, lo: int, hi: int, hint: str) -> None:
    """An integer argument in ``[lo, hi]``: TypeError for another type (bool included), ValueError out of range."""
    expected = f"an integer >= {lo} and <= {hi}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be {expected}, got {value!r} ({type(value).__name__}). {hint}")
    if not lo <= value <= hi:
        raise ValueError(f"`{name}` must be {expected}, got {value!r}. {hint}")


def _check_fraction(name: str, value: Any, hint: str, hi: float = 1.0) -> None:
    """A number in ``(0, hi]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number > 0 and <= {hi:g}, got {value!r} ({type(value).__name__}). {hint}")
    if not 0 < value <= hi:
        raise ValueError(f"`{name}` must be a number > 0 and <= {hi:g}, got {value!r}. {hint}")
