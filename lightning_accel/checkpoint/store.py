"""The delta checkpoint store: one small manifest per checkpoint path, content-addressed tensor blobs beside it.

The on-disk format (directory layout, manifest JSON) is :mod:`~lightning_accel.checkpoint.manifest`'s; what each
tensor of a save becomes (reference, delta, quantized delta, full snapshot) is decided by
:mod:`~lightning_accel.checkpoint.policy`; the options are a :class:`~lightning_accel.checkpoint.options.StoreOptions`.
This module does the I/O: save, load, verify, export, remove and garbage collection.

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

Readers never lock, so a reader may have just opened a manifest that the writer replaces or removes. Garbage
collection therefore deletes a blob only once it has been unreferenced for ``gc_grace_s`` seconds: the first
collection that finds it unreferenced records the time in ``.delta_blobs/.pending`` (a small JSON record only the
single writer writes; the next run's writer reads it), later collections delete it when the grace period has passed,
and a blob referenced again leaves the record. A reader that opened a manifest less than ``gc_grace_s`` ago therefore
finds every blob it lists. A reader slower than that which does find a blob missing re-reads the manifest and
restores once more from the new version; only then does it fail, naming the missing or damaged file.

One writer per directory at a time (one training run), enforced by a lock (:mod:`~lightning_accel.checkpoint.lock`);
any number of readers. Every damaged manifest, skeleton or blob raises :class:`CheckpointCorruptError` naming the file
and, where one is at fault, the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import posixpath
import re
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_accel._utils.atomic import fsync_dir, is_local_url, strip_file_scheme
from lightning_accel._utils.checks import check_number
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess
from lightning_accel._utils.fs import FileStore, StorageUnavailableError
from lightning_accel._utils.paths import safe_join
from lightning_accel.checkpoint import codec, policy
from lightning_accel.checkpoint.lock import LOCK_NAME, CheckpointDirectoryLockedError, DirectoryLock, prepare_directory
from lightning_accel.checkpoint.manifest import (
    BLOB_DIR,
    COPY_SUFFIX,
    MANIFEST_FORMAT,
    CheckpointCorruptError,
    Manifest,
    NotADeltaCheckpointError,
    TensorEntry,
    damaged_manifest_head,
    entry_crc,
    is_blob_key,
    is_manifest_bytes,
    manifest_references,
    truncated_manifest_head,
)
from lightning_accel.checkpoint.options import StoreOptions
from lightning_accel.checkpoint.policy import ChainState
from lightning_accel.checkpoint.skeleton import (
    alias_groups,
    dump_skeleton,
    fill_skeleton,
    pack_skeleton_blob,
    placeholder_names,
    restore_aliases,
    split,
    unpack_skeleton_blob,
)

__all__ = [
    "BLOB_DIR",
    "COPY_SUFFIX",
    "GC_GRACE_S",
    "PENDING_NAME",
    "CheckpointCorruptError",
    "CheckpointDirectoryLockedError",
    "DeltaStore",
    "MANIFEST_FORMAT",
    "NotADeltaCheckpointError",
    "SaveStats",
    "StoreOptions",
    "check_export_target",
    "entry_crc",
    "is_manifest_bytes",
    "split_path",
    "store_dir",
    "store_path",
]

_TMP_RE = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
#: Seconds a blob stays after the last manifest that referenced it was replaced or removed (readers that opened that
#: manifest meanwhile still find it). The default of :class:`DeltaStore`'s ``gc_grace_s``.
GC_GRACE_S = 60.0
#: The pending-deletions record inside the blob directory: ``{"format": ..., "keys": {blob key: unreferenced since}}``.
PENDING_NAME = ".pending"
_MANIFEST_READ = 1 << 16  # bytes of a checkpoint file read first: the whole manifest, usually
_PENDING_FORMAT = "lightning-accel/delta-pending"


class _MissingBlob(CheckpointCorruptError):
    """A blob a manifest lists is not there (a reader may have raced a replacement: it re-reads the manifest)."""


def _blob_key(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _raw_hash(t: torch.Tensor) -> str:
    """Identity of a tensor's bytes for "unchanged?" decisions at save time (collision-resistant)."""
    return hashlib.blake2b(codec.tensor_bytes(t).data, digest_size=16).hexdigest()


def _crc(t: torch.Tensor) -> int:
    """Checksum verified on every load: CRC-32, several times faster than BLAKE2b (load times in
    benchmarks/delta_checkpoint.py); the content address (BLAKE2b) is re-checked by :meth:`DeltaStore.verify`."""
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
    hash_s: float = 0.0  # comparing and hashing tensors ("unchanged?"), summed over the encode threads
    encode_s: float = 0.0  # encoding changed tensors, summed over the encode threads
    write_s: float = 0.0  # publishing blobs, the skeleton and the manifest


@dataclass
class _Timing:
    """Seconds one tensor of a save spent being compared or hashed, and encoded; whether its new full snapshot was
    copied into the previous chain reference's memory (that chain state is then stale until the save commits)."""

    hash_s: float = 0.0
    encode_s: float = 0.0
    ref_reused: bool = False


@dataclass
class _DirState:
    entries: dict[str, ChainState] = field(default_factory=dict)
    # What the live manifests of the directory hold, per path: tensor name -> (chain, sizes). Seeded from disk at the
    # first save of this process, kept up to date by its saves and removals; drives the dead-bytes re-base rule.
    live: dict[str, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]] = field(default_factory=dict)
    # Whether this process collected what an earlier run left here; a failed collection is retried by the next save.
    leftovers_collected: bool = False


#: How a file in ``torch.save``'s format (a zip archive, since torch 1.6) begins.
TORCH_ZIP_MAGIC = b"PK\x03\x04"


def _is_torch_zip(head: bytes) -> bool:
    """Whether a file starting with ``head`` is in ``torch.save``'s (zip) format."""
    return head.startswith(TORCH_ZIP_MAGIC)


def store_path(path: str | os.PathLike[str]) -> str:
    """A file or directory as the store names it (local: absolute, without ``file://``; URLs: without a trailing
    slash), so that two spellings of one place compare equal."""
    s = os.fspath(path)
    return os.path.abspath(strip_file_scheme(s)) if is_local_url(s) else s.rstrip("/")


def store_dir(directory: str | os.PathLike[str]) -> str:
    """A checkpoint directory as the store names it: as :func:`store_path`, and a local one with its symlinks resolved.

    Why: the store keys its writer lock, chain state and collections by directory, so every spelling of one local
    directory (relative, through a symlink: Lightning's ``ModelCheckpoint`` resolves its ``dirpath`` with
    ``realpath``, a user's ``trainer.save_checkpoint("link/final.ckpt")`` does not) must name it the same way; two
    names took its ``flock`` twice and the process refused its own saves as "another writer".
    """
    s = store_path(directory)
    return os.path.realpath(s) if is_local_url(s) else s


def check_file_path(path: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint path to save at that names no file: empty, or ending with a separator.

    Why: the store names a path without its trailing separator (:func:`store_path`), so ``save(..., "runs/ckpt/")``
    wrote a *file* ``runs/ckpt``, and every later save into ``runs/ckpt/`` failed because the folder was a file.

    Raises:
        ValueError: one line naming the path and the fix.
    """
    s = os.fspath(path)
    if not s.strip():
        raise ValueError(
            f"Checkpoint path {s!r} is empty: give the checkpoint's file name, e.g. 'checkpoints/last.ckpt'."
        )
    if s.endswith(("/", os.sep)):
        raise ValueError(
            f"Checkpoint path {s!r} ends with a separator, so it names a folder, not a checkpoint file: give a file "
            f"name inside it, e.g. {s + 'last.ckpt'!r}."
        )


def split_path(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(directory, path)`` of a checkpoint path as the store names them: the directory as :func:`store_dir` names
    it, the path inside it as :func:`store_path` does (a local ``last.ckpt`` symlink stays the link, not its target).
    """
    s = store_path(path)
    if not is_local_url(s):
        return s.rsplit("/", 1)[0], s
    directory = os.path.realpath(os.path.dirname(s))
    return directory, os.path.join(directory, os.path.basename(s))


def _read_path(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(blob directory, manifest path)`` for reading: as :func:`split_path`, but a local symlink's blobs are found
    beside the manifest it points at (a ``best.ckpt`` linked from another directory), not beside the link."""
    directory, p = split_path(path)
    if is_local_url(p):
        directory = os.path.dirname(os.path.realpath(p))
    return directory, p


# the warning of a collection that failed after a save or removal took effect (DeltaStore._collect_or_warn)
_AFTER_THEN = "They stay on disk until a later save or removal there collects them."


def _after_failed(done: str, directory: str) -> str:
    return f"{done}, but collecting the blobs no checkpoint needs in {directory!r} failed"


def _cause(error: BaseException) -> tuple[str, int | None]:
    """What makes two failures "the same" for warning once: the error's type and ``errno`` (its message names a
    file, different for every blob)."""
    code = getattr(error, "errno", None)
    return type(error).__name__, code if isinstance(code, int) else None


class DeltaStore:
    """Save, load, verify and remove delta checkpoints (the functional core; no Lightning import).

    ``DeltaStore(storage_options=..., quantize="int8", ...)`` takes :class:`StoreOptions`' fields as keywords (see
    there for each option, its range and default); ``DeltaStore(options=StoreOptions(...))`` takes them made once
    (what :class:`~lightning_accel.checkpoint.plugin.DeltaCheckpointIO` does).

    Args:
        storage_options: fsspec options for remote URLs (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``).
        options: the encoding, chain and writing options (default: ``StoreOptions(**option_kwargs)``).
        gc_grace_s: garbage collection deletes a blob only after it has been unreferenced this long (seconds), so
            readers that opened a manifest the writer then replaced or removed still find its blobs. ``0``: delete at
            once; ``float("inf")``: never (unreferenced blobs stay listed in ``.pending`` until a collection with a
            finite grace period, e.g. ``lightning-accel ckpt gc DIR``, deletes them).
        **option_kwargs: :class:`StoreOptions` fields (``quantize``, ``delta_ref``, ``zstd_level``, ...), when
            ``options`` is not given.

    Attributes:
        options: the :class:`StoreOptions` in use; each field is also readable as an attribute of the store
            (``store.quantize``; ``store.max_chain`` is the effective chain limit, 2 with ``delta_ref="base"``).

    Raises:
        TypeError: an argument of the wrong type (``zstd_level="3"``, ``full_every=True``), naming it, or an unknown
            keyword.
        ValueError: an argument out of its range (``zstd_level=99``), naming it, the range and the fix; or both
            ``options`` and option keywords.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        options: StoreOptions | None = None,
        gc_grace_s: float = GC_GRACE_S,
        **option_kwargs: Any,
    ) -> None:
        #: Seconds an unreferenced blob is kept before garbage collection deletes it (see the module docstring).
        self.gc_grace_s: float = check_number(
            "gc_grace_s",
            gc_grace_s,
            low=0,
            fix=f"Default {GC_GRACE_S:g}: a reader that opened a manifest up to that long ago still finds its blobs; "
            "0 deletes unreferenced blobs at once (no concurrent readers); float('inf') never deletes them.",
        )
        if options is None:
            options = StoreOptions(**option_kwargs)
        elif option_kwargs:
            raise ValueError(
                f"Pass either `options` or the option keywords ({', '.join(sorted(option_kwargs))}) to DeltaStore, "
                "not both: put them into the `StoreOptions`."
            )
        elif not isinstance(options, StoreOptions):
            raise TypeError(f"`options` must be a StoreOptions or None, got {options!r} ({type(options).__name__}).")
        self.options = options
        # Local paths and fsspec URLs alike, with retries of transient errors; validates `storage_options`.
        self.fs = FileStore(storage_options)
        # The chain state of this process (directory -> what the next save deltas against). Per process, so a pickled
        # or forked copy of the store starts without it: it holds a private copy of every tensor, and a copy must
        # not delta against saves it did not make. The lock and the filesystems pickle fresh by themselves.
        self._dirs: PerProcess[dict[str, _DirState]] = PerProcess(dict)
        # The writer locks this process's store holds (directory -> lock); released by `close()` or when the store
        # is garbage-collected.
        self._locks: PerProcess[dict[str, DirectoryLock]] = PerProcess(dict)
        self._lock = ForkSafeLock(reentrant=True)
        self._warned_groups = False
        # Per directory: blob keys of manifests this process replaced or removed since its last collection (they were
        # referenced until then, whatever the pending-deletions record says).
        self._released: PerProcess[dict[str, set[str]]] = PerProcess(dict)
        # Plain `torch.save` checkpoints that a resumed run's checkpoint callbacks track (see `adopt`).
        self._adopted: PerProcess[set[str]] = PerProcess(set)
        # Directories whose last collection left blobs waiting out their grace period -> the oldest one's time. A
        # collection anywhere finishes those of the others once due (`_collect_due_elsewhere`).
        self._waiting: PerProcess[dict[str, float]] = PerProcess(dict)
        # Directories a removal with `drop_emptied` left with only blobs waiting out their grace period: removed, if
        # nothing else is there by then, by the collection that deletes those blobs.
        self._drop_later: PerProcess[set[str]] = PerProcess(set)
        self._collecting_elsewhere = False
        # Per directory: the causes (:func:`_cause`) of collection failures already warned. A failure of a cause
        # warned before is retried quietly by every later collection; the first collection that succeeds there
        # clears them, so the same failure coming back later is warned again.
        self._warned_gc: PerProcess[dict[str, set[tuple[str, int | None]]]] = PerProcess(dict)
        # Directories whose last collection could not delete some file -> how many (retried by the next collection).
        self._refused: PerProcess[dict[str, int]] = PerProcess(dict)

    # The options, readable on the store as before they were grouped (``store.quantize``, ``store.lock``).
    quantize = property(lambda self: self.options.quantize)
    quantize_groups = property(lambda self: self.options.quantize_groups)
    quant_block = property(lambda self: self.options.quant_block)
    delta_ref = property(lambda self: self.options.delta_ref)
    max_chain = property(lambda self: self.options.chain_limit)
    full_every = property(lambda self: self.options.full_every)
    rebase_ratio = property(lambda self: self.options.rebase_ratio)
    rebase_dead_fraction = property(lambda self: self.options.rebase_dead_fraction)
    redundancy = property(lambda self: self.options.redundancy)
    inline_bytes = property(lambda self: self.options.inline_bytes)
    zstd_level = property(lambda self: self.options.zstd_level)
    zstd_threads = property(lambda self: self.options.zstd_threads)
    io_threads = property(lambda self: self.options.io_threads)
    lock = property(lambda self: self.options.lock)

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
            self._writable(store_dir(directory))

    def close(self) -> None:
        """Release this process's writer locks (the next save in a directory takes its lock again)."""
        with self._lock:
            held = self._locks.get()
            for lk in held.values():
                lk.release()
            held.clear()

    # ------------------------------------------------------------------ paths
    def blob_url(self, directory: str, key: str) -> str:
        if not is_blob_key(key):
            raise CheckpointCorruptError(f"invalid blob key {key!r} in a manifest")
        return safe_join(safe_join(directory, BLOB_DIR), f"{key[:2]}/{key}")

    def adopt(self, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
        """Let :meth:`save` replace and :meth:`remove` delete the plain ``torch.save`` checkpoints at ``paths``,
        which are otherwise refused as files this store did not write.

        For a run that switched to this plugin and resumed from ``TorchCheckpointIO`` checkpoints: the restored
        ``ModelCheckpoint`` state tracks them, and Lightning rotates them out of its top-k and replaces ``last.ckpt``
        as it would with ``TorchCheckpointIO``. Only regular files in ``torch.save``'s zip format are adopted (a
        folder, a link or any other file stays refused), and only in this process.

        Returns:
            The paths adopted.
        """
        adopted = []
        for path in paths:
            _, p = split_path(path)
            if is_local_url(p) and os.path.islink(p):
                continue
            try:
                if self.fs.isdir(p) or not _is_torch_zip(self.fs.head(p, 4)):
                    continue
            except OSError:  # gone, or unreadable: nothing to adopt
                continue
            self._adopted.get().add(p)
            adopted.append(p)
        return adopted

    def _adopted_file(self, path: str, head: bytes) -> bool:
        """Whether ``path`` is an adopted plain checkpoint (see :meth:`adopt`) that still holds one (``head``)."""
        return path in self._adopted.get() and _is_torch_zip(head)

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
        if truncated_manifest_head(head) or (not is_manifest_bytes(head) and damaged_manifest_head(head)):
            return False  # a manifest of this plugin cut short or damaged: nothing to keep, replaced like a new path
        if not is_manifest_bytes(head):
            if self._adopted_file(path, head):
                # replaced like a new path, as TorchCheckpointIO would overwrite it; still adopted until the manifest
                # has replaced it (`save`): a save that fails first leaves the plain file, which the next one replaces
                return False
            raise NotADeltaCheckpointError(
                f"Checkpoint path {path!r} already holds a file that is not a delta checkpoint manifest (e.g. a "
                "`torch.save` checkpoint); refusing to overwrite it. Move it away or save to another directory."
            )
        if self.gc_grace_s > 0:  # without a grace period nothing waits: no need to read what it referenced
            self._release(split_path(path)[0], path)
        return True

    def _release(self, directory: str, path: str) -> None:
        """Note the blob keys of the manifest at ``path``, about to be replaced or removed: the next collection starts
        their grace period then, even if they were pending before and referenced again since."""
        try:
            skeleton, chains = manifest_references(self.fs.read(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # gone or damaged: nothing to note
        keys = self._released.get().setdefault(directory, set())
        keys.add(str(skeleton))
        for chain, _ in chains.values():
            keys.update(chain)

    # ------------------------------------------------------------------ save
    def save(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        *,
        content_id: Callable[[torch.Tensor], int | None] | None = None,
        pause: Callable[[], None] | None = None,
        aliases: list[list[list[Any]]] | Callable[[Mapping[str, torch.Tensor]], list[list[list[Any]]]] | None = None,
    ) -> SaveStats:
        """Write ``checkpoint`` as a delta checkpoint at ``path`` (a manifest file).

        Tensors that share memory (tied weights, views of one buffer) are recorded as such and share one storage
        again when loaded, as with ``torch.save`` / ``torch.load``.

        The tensors must not change while this runs (the adapter snapshots them first in async mode). The first save
        (or removal) in a directory takes its writer lock (:mod:`~lightning_accel.checkpoint.lock`). This process's
        first save there also collects what an earlier run left (:meth:`collect_garbage`); if that fails, the save
        goes ahead with a warning naming the directory and the error, and the next save there tries again.

        A tensor is known unchanged without encoding it, and where possible without hashing it: when ``content_id``
        gives it the id its previous save recorded (a snapshot buffer not rewritten since), or when its bytes equal
        the chain's reference copy and that copy is what the previous save restores
        (:func:`~lightning_accel.checkpoint.policy.ref_is_last`); otherwise its bytes are hashed.

        Args:
            checkpoint: the checkpoint dict.
            path: the manifest path.
            content_id: the content id of a tensor of ``checkpoint`` (``None``: unknown), from
                :class:`~lightning_accel.checkpoint.background.Snapshot`.
            pause: called before each tensor is encoded (a background writer waits there while the training thread
                takes a snapshot).
            aliases: which tensors share memory, when ``checkpoint`` is a snapshot whose copies no longer do: the
                :func:`~lightning_accel.checkpoint.skeleton.alias_groups` record, or a function that makes it from the
                named tensors of ``checkpoint`` (:meth:`~lightning_accel.checkpoint.background.Snapshot.aliases`);
                ``None``: found in ``checkpoint`` itself.

        Raises:
            NotADeltaCheckpointError: ``path`` is a directory or a foreign file.
            NotADirectoryError: the checkpoint directory is a file.
            ValueError: ``path`` is empty or ends with a separator (it names no file).
            CheckpointDirectoryLockedError: another writer holds the directory.
            UnsafeCheckpointContent: the checkpoint holds objects that cannot be loaded without unpickling code.
            OSError: writing failed (e.g. disk full, an unwritable directory); earlier checkpoints are intact and the
                blobs this save had written are deleted again.
        """
        if not isinstance(checkpoint, dict):
            raise TypeError(f"`checkpoint` must be a dict, got {type(checkpoint).__name__}.")
        check_file_path(path)
        t0 = time.perf_counter()
        directory, path = split_path(path)
        opts = self.options
        with self._lock:
            self._writable(directory)
            replacing = self._check_target(path)
            skeleton, all_tensors = split(checkpoint)
            if aliases is None:
                aliases = alias_groups(all_tensors)
            elif callable(aliases):  # the snapshot's record, named as `split` names its buffers
                aliases = aliases(all_tensors)
            else:  # recorded before a snapshot: only what this checkpoint still holds with its shape
                aliases = [g for g in aliases if all(m[0] in all_tensors for m in g)]
            self._warn_if_groups_match_nothing(all_tensors)
            tensors = {n: t for n, t in all_tensors.items() if t.numel() * t.element_size() >= opts.inline_bytes}
            small = {n: t for n, t in all_tensors.items() if n not in tensors}
            dirs = self._dirs.get()
            dstate = dirs.setdefault(directory, _DirState())
            if not dstate.leftovers_collected:  # what a killed earlier run left behind (unreferenced blobs, tmp files)
                dstate.leftovers_collected = (
                    self._collect_or_warn(
                        directory,
                        f"Collecting what an earlier run left in {directory!r} failed",
                        "Saving anyway; the next save there tries the collection again.",
                    )
                    is not None
                    # a file it could not delete is tried again by the next save, not only by a later removal
                    and directory not in self._refused.get()
                )
            dead = policy.dead_bases(opts, dstate.live)
            stats = SaveStats(path=path)
            new_entries: dict[str, ChainState] = {}

            def encode(item: tuple[str, torch.Tensor]) -> tuple[str, ChainState, list[tuple[str, bytes]], str, _Timing]:
                name, t = item
                if pause is not None:
                    pause()
                cid = content_id(t) if content_id is not None else None
                if t.device.type != "cpu":
                    t = t.cpu()
                timing = _Timing()
                out = self._encode_one(name, t, dstate.entries.get(name), dead, cid, timing)
                if timing.ref_reused:
                    reused.add(name)
                return (name, *out, timing)

            reused: set[str] = set()

            created: list[str] = []  # blobs this save wrote: deleted again if it fails
            try:
                # Unchanged tensors cost a comparison (or nothing), changed ones are encoded in parallel; each blob is
                # written as soon as it is encoded, so only about `io_threads` encoded tensors are held at a time.
                with ThreadPoolExecutor(max_workers=opts.io_threads) as pool:
                    for name, state, blobs, how, timing in pool.map(encode, tensors.items()):
                        stats.hash_s += timing.hash_s
                        stats.encode_s += timing.encode_s
                        new_entries[name] = state
                        if how == "rebased":
                            stats.tensors_rebased += 1
                            how = "full"
                        setattr(stats, f"tensors_{how}", getattr(stats, f"tensors_{how}") + 1)
                        for key, data in blobs:
                            urls = [self.blob_url(directory, key)]
                            if (how == "full" and state.entry.copy) or opts.redundancy >= 2:
                                urls.append(urls[0] + COPY_SUFFIX)  # redundancy=2: deltas get a copy too
                            for url in urls:
                                if not self.fs.exists(url):
                                    created.append(url)
                                    tw = time.perf_counter()
                                    self.fs.write(url, data)
                                    stats.write_s += time.perf_counter() - tw
                                    stats.bytes_written += len(data)
                                    stats.blobs_written += 1
                        del blobs  # on disk now: not held while the next tensors encode
                t_write = time.perf_counter()
                skel_blob = pack_skeleton_blob(dump_skeleton(skeleton), small, aliases)
                skel_key = _blob_key(skel_blob)
                skel_url = self.blob_url(directory, skel_key)
                for url in [skel_url, skel_url + COPY_SUFFIX] if opts.redundancy >= 2 else [skel_url]:
                    if not self.fs.exists(url):
                        created.append(url)
                        self.fs.write(url, skel_blob)
                        stats.bytes_written += len(skel_blob)
                        stats.blobs_written += 1
                if is_local_url(directory):
                    fsync_dir(strip_file_scheme(safe_join(directory, BLOB_DIR)))
                manifest = Manifest(
                    skeleton=skel_key,
                    tensors={n: s.entry for n, s in new_entries.items()},
                    lossy=any(s.lossy for s in new_entries.values()),
                    created=time.time(),
                )
                data = manifest.to_json()
                self.fs.write(path, data)  # published last: the checkpoint exists from here on
                self._adopted.get().discard(path)  # a plain file adopted there is gone now
            except BaseException:
                self._delete_created(created)
                for name in reused:  # their reference memory holds this save's bytes: restart those chains
                    dstate.entries.pop(name, None)
                raise
            stats.bytes_written += len(data)
            stats.write_s += time.perf_counter() - t_write
            # Only now does the next save delta against this one (a failed save changes nothing).
            dstate.entries = new_entries
            dstate.live[path] = {n: (s.entry.chain, s.entry.sizes) for n, s in new_entries.items()}
            if replacing:
                self._collect_or_warn(
                    directory, _after_failed(f"Checkpoint {path!r} was saved", directory), _AFTER_THEN
                )
        stats.seconds = time.perf_counter() - t0
        return stats

    def _collect_or_warn(self, directory: str, failed: str, then: str, grace_s: float | None = None) -> int | None:
        """:meth:`collect_garbage` of ``directory``; returns the files deleted, or None when it failed: then one
        warning, ``"<failed>: <error>. <then>"``, instead of an exception (a lock held by another writer still raises).

        Why: it runs before this process's first save in a directory (what an earlier run left) and after a save or
        removal took effect (the blobs no checkpoint needs). Either way what it would delete is only space, while
        raising would lose the checkpoint or report a save that succeeded as failed (and with ``async_save`` stop the
        run). The next collection of the directory deletes what is left.
        """
        try:
            return self.collect_garbage(directory, grace_s=grace_s)
        except CheckpointDirectoryLockedError:
            raise  # another writer holds the directory: not this store's to write any more
        except Exception as e:  # noqa: BLE001 - see above
            if self._first_of_its_cause(directory, e):
                line = one_line(f"{failed}: {type(e).__name__}: {one_line(e, first=True)}. {then}")
                warnings.warn(line, UserWarning, stacklevel=3)
            return None

    def _first_of_its_cause(self, directory: str, error: BaseException) -> bool:
        """Whether ``error`` is the first collection failure of its cause in ``directory`` since its last successful
        collection (and note it as warned).

        Why: the failure of a collection is not the save's or removal's, and every later save or removal collects
        again: warned each time, a directory that refuses deletes filled the log with one line per save. It is
        warned once, and retried quietly until a collection there succeeds.
        """
        warned = self._warned_gc.get().setdefault(directory, set())
        cause = _cause(error)
        if cause in warned:
            return False
        warned.add(cause)
        return True

    def _delete_created(self, urls: list[str]) -> None:
        """After a failed save: delete the blobs it created (no manifest references them: the save published
        nothing, and they did not exist before it), so a full disk gets its space back now."""
        for url in urls:
            try:
                self.fs.rm(url)
            except FileNotFoundError:
                pass  # the write itself failed before publishing the file
            except Exception as e:  # noqa: BLE001 - the save's own error is what the caller must see
                warnings.warn(
                    f"Could not delete {url!r} left by a failed save: {one_line(e)}", UserWarning, stacklevel=3
                )

    def _warn_if_groups_match_nothing(self, tensors: dict[str, torch.Tensor]) -> None:
        """``quantize_groups`` prefixes are checked against the first checkpoint's tensor names (they are not known
        before): a selection that matches no float tensor would silently keep everything lossless."""
        opts = self.options
        if self._warned_groups or opts.quantize is None or isinstance(opts.quantize_groups, str):
            return
        self._warned_groups = True
        floats = [n for n, t in tensors.items() if t.is_floating_point()]
        if not any(policy.wants_quant(opts, n, True) for n in floats):
            examples = ", ".join(repr(n) for n in floats[:3]) or "none"
            warnings.warn(
                f"`quantize_groups={list(opts.quantize_groups)!r}` matches none of the checkpoint's "
                f"{len(floats)} float tensors (e.g. {examples}), so nothing is quantized. Use prefixes of those "
                "names, 'optimizer' or 'all'.",
                UserWarning,
                stacklevel=4,
            )

    def _encode_one(
        self,
        name: str,
        t: torch.Tensor,
        prev: ChainState | None,
        dead: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset(),
        content_id: int | None = None,
        timing: _Timing | None = None,
    ) -> tuple[ChainState, list[tuple[str, bytes]], str]:
        """Encode one tensor as :func:`~lightning_accel.checkpoint.policy.plan` says. Returns (state, new blobs,
        how: ``"unchanged"``, ``"delta"``, ``"full"`` or ``"rebased"``). An unchanged tensor is recognised by its
        ``content_id`` or by a byte comparison with the chain's reference before anything is hashed."""
        opts = self.options
        timing = timing if timing is not None else _Timing()
        th = time.perf_counter()
        dname = codec.dtype_name(t.dtype)
        shape = tuple(t.shape)
        if prev is not None and prev.entry.dtype == dname and prev.entry.shape == shape:
            if content_id is not None and prev.content_id == content_id:
                timing.hash_s += time.perf_counter() - th
                return prev, [], "unchanged"
            if policy.ref_is_last(opts, prev) and codec.same_bytes(t, prev.ref):
                timing.hash_s += time.perf_counter() - th
                kept = prev if prev.content_id == content_id else dataclasses.replace(prev, content_id=content_id)
                return kept, [], "unchanged"
        # A snapshot buffer's content id names its bytes as well as a hash would (ids are never reused), so a
        # snapshot is not hashed; a live tensor (synchronous saves) is.
        src_hash = _raw_hash(t) if content_id is None else f"content:{content_id}"
        timing.hash_s += time.perf_counter() - th
        step = policy.plan(opts, name, dname, shape, src_hash, codec.quantizable(t.dtype), prev, dead)
        if step.kind == "unchanged":
            assert prev is not None
            return dataclasses.replace(prev, content_id=content_id), [], "unchanged"
        te = time.perf_counter()
        try:
            return self._encode_changed(name, t, prev, step, dname, shape, src_hash, content_id, timing)
        finally:
            timing.encode_s += time.perf_counter() - te

    def _encode_changed(
        self,
        name: str,
        t: torch.Tensor,
        prev: ChainState | None,
        step: policy.Plan,
        dname: str,
        shape: tuple[int, ...],
        src_hash: str,
        content_id: int | None,
        timing: _Timing,
    ) -> tuple[ChainState, list[tuple[str, bytes]], str]:
        opts = self.options
        if step.kind in ("xor", "quant"):
            assert prev is not None and step.ref_key is not None
            level, threads = opts.zstd_level, opts.zstd_threads
            quantized: tuple[bytes, torch.Tensor] | None = None
            if step.kind == "quant":
                bits = 8 if opts.quantize == "int8" else 4
                # An inf/NaN in the tensor or its reference has no finite block scale: a lossless XOR delta instead
                # keeps them bit-exact.
                with contextlib.suppress(codec.NonFiniteDelta):
                    quantized = codec.encode_quant(
                        t, prev.ref, step.ref_key, bits=bits, block=opts.quant_block, level=level, threads=threads
                    )
            if quantized is not None:
                (blob, recon), lossy = quantized, True
            else:
                blob = codec.encode_xor(t, prev.ref, step.ref_key, level=level, threads=threads)
                recon, lossy = t, False  # XOR restores t bit-exactly whatever the reference was
            if not policy.keep_delta(opts, len(blob), prev):
                del blob  # not held while the full snapshot is encoded
            else:
                key = _blob_key(blob)
                base = prev.entry
                chain: tuple[str, ...]
                sizes: tuple[int, ...]
                if opts.delta_ref == "base":
                    chain, sizes, ref = (base.chain[0], key), (base.sizes[0], len(blob)), prev.ref
                else:
                    chain, sizes, ref = (*base.chain, key), (*base.sizes, len(blob)), recon.clone()
                entry = TensorEntry(
                    dtype=dname, shape=shape, chain=chain, sizes=sizes, crc32=_crc(recon), copy=base.copy
                )
                state = ChainState(
                    entry=entry,
                    hash=src_hash if recon is t else _raw_hash(recon),
                    src_hash=src_hash,
                    ref=ref,
                    lossy=lossy,
                    age=prev.age + 1,
                    content_id=content_id,
                )
                return state, [(key, blob)], "delta"
        blob = codec.encode_full(t, level=opts.zstd_level, threads=opts.zstd_threads)
        key = _blob_key(blob)
        entry = TensorEntry(
            dtype=dname, shape=shape, chain=(key,), sizes=(len(blob),), crc32=_crc(t), copy=opts.redundancy > 1
        )
        # A private copy: in synchronous mode `t` aliases the live parameter, which the optimizer keeps changing (in
        # async mode a snapshot buffer, which the next snapshot rewrites). A re-based chain copies into its old
        # reference's memory (only that chain state holds it) rather than holding two references at once; a failed
        # save then drops that chain state (`save`), so the next save starts it with a full snapshot.
        old = prev.ref if prev is not None else None
        if old is not None and old.dtype == t.dtype and old.shape == t.shape and old.is_contiguous():
            ref = old
            codec.copy_into(ref, t)
            timing.ref_reused = True
        else:
            ref = t.detach().clone().reshape(shape)
        state = ChainState(entry=entry, hash=src_hash, src_hash=src_hash, ref=ref, content_id=content_id)
        return state, [(key, blob)], "rebased" if step.kind == "rebased" else "full"

    # ------------------------------------------------------------------ load
    def read_manifest(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and validate the manifest at ``path`` (its ``checksum`` and every tensor entry's ``mcrc`` when
        present); return its JSON object (the format is documented in :mod:`~lightning_accel.checkpoint.manifest`).

        Raises:
            FileNotFoundError: nothing at ``path``.
            NotADeltaCheckpointError: ``path`` is a directory or holds something else.
            CheckpointCorruptError: the manifest is damaged or truncated (naming the file, and the tensor when one is
                at fault).
        """
        return self._read_manifest(path)[0]

    def open_manifest(self, path: str | os.PathLike[str]) -> Manifest:
        """:meth:`read_manifest` as a :class:`~lightning_accel.checkpoint.manifest.Manifest`."""
        return self._read_manifest(path)[1]

    def _read_manifest(self, path: str | os.PathLike[str]) -> tuple[dict[str, Any], Manifest, bytes]:
        _, p = split_path(path)
        # The head first, one read (a manifest is usually all of it): a plain `torch.save` file of gigabytes is not
        # downloaded just to be told apart, and a manifest costs one request on an object store.
        try:
            first = self.fs.read(p, 0, _MANIFEST_READ)
        except IsADirectoryError:
            raise NotADeltaCheckpointError(_is_a_directory(self.fs, p)) from None
        except FileNotFoundError:
            if self.fs.isdir(p):  # an object-store prefix
                raise NotADeltaCheckpointError(_is_a_directory(self.fs, p)) from None
            raise FileNotFoundError(errno.ENOENT, f"Checkpoint {p!r} does not exist") from None
        head = first[:128]
        if not is_manifest_bytes(head):
            if truncated_manifest_head(head):
                what = f"holds only {len(head)} bytes ({head!r}), the start of a manifest" if head else "is empty"
                raise CheckpointCorruptError(
                    f"Checkpoint {p!r} is truncated: the file {what}. Load another checkpoint of the directory."
                )
            if damaged_manifest_head(head):
                raise CheckpointCorruptError(
                    f"The manifest of checkpoint {p!r} is damaged (its header reads {head[:40]!r}); load another "
                    "checkpoint of the directory."
                )
            raise NotADeltaCheckpointError(f"{p!r} is not a delta checkpoint manifest.")
        # A longer manifest is read again whole (never two reads spliced: the writer may replace it in between).
        data = first if len(first) < _MANIFEST_READ else self.fs.read(p)
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise CheckpointCorruptError(f"The manifest of checkpoint {p!r} is damaged ({e!r}).") from e
        return raw, Manifest.from_dict(p, raw), data

    def read_skeleton(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The non-tensor state of the checkpoint at ``path`` (tensors left as placeholder strings), reading only its
        manifest and skeleton blob: e.g. its ``global_step`` or its callbacks' state.

        Raises:
            CheckpointCorruptError: the manifest or the skeleton is damaged.
        """
        directory, p = _read_path(path)
        manifest = self.open_manifest(p)
        return self._skeleton(directory, p, manifest, None)[0]

    def saved_at_step(self, path: str | os.PathLike[str], step: object) -> bool:
        """Whether the checkpoint at ``path`` records Lightning's ``global_step`` equal to ``step`` (an ``int``;
        anything else never matches), reading only its manifest and skeleton. A checkpoint that cannot be read or
        records no step does not match.

        Why: ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` before the other checkpoint callbacks of the
        same step save, so their newest checkpoint is missing from the callback state ``last.ckpt`` holds; its step
        tells such a save apart from one a killed run made at a later step.
        """
        if not isinstance(step, int) or isinstance(step, bool):
            return False
        try:
            saved = self.read_skeleton(path).get("global_step")
        except (OSError, ValueError, RuntimeError):  # removed meanwhile, damaged, not a manifest: no match
            return False
        return isinstance(saved, int) and not isinstance(saved, bool) and saved == step

    def _skeleton(
        self, directory: str, p: str, manifest: Manifest, used_copies: list[str] | None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """The skeleton, the small tensors and the record of tensors sharing memory (``[]`` when none did, or the
        checkpoint was written before the record existed)."""
        what = "the skeleton (non-tensor state)"
        skel = self._fetch(directory, manifest.skeleton, p, what, True, manifest.copies == 2, used_copies)
        try:
            skeleton, small = unpack_skeleton_blob(skel)
            aliases = codec.read_header(skel)[0].get("aliases", [])
            if not isinstance(skeleton, dict):
                raise TypeError(f"it holds a {type(skeleton).__name__}, not a dict")
        except Exception as e:  # noqa: BLE001 - anything here means the skeleton is unusable
            raise CheckpointCorruptError(
                f"Checkpoint {p!r}: the skeleton (non-tensor state) cannot be read safely ({type(e).__name__}: "
                f"{one_line(e, first=True)[:300]})."
            ) from e
        return skeleton, small, aliases

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
        if copy:  # redundancy=2: the blob has a second copy; it is trusted only if its content address matches
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
        # The file, named relative to the checkpoint's directory (the key is in it): the message stays one line.
        rel = posixpath.join(BLOB_DIR, key[:2], key)
        fix = "Load another checkpoint, or restore that file (`redundancy=2` keeps a second copy of every blob)."
        if problem == "is missing":
            raise _MissingBlob(
                f"Checkpoint {ckpt!r}: {what} needs {rel}, which is missing although the manifest, read again, still "
                "lists it: deleted by something else than this plugin's garbage collection (which keeps a blob for "
                f"`gc_grace_s` after its last manifest went), never written, or lost with its storage. {fix}"
            )
        # Short: the blob's key is its file name, and the command line appends its own hint.
        raise CheckpointCorruptError(f"Checkpoint {ckpt!r}: blob {key} of {what} {problem} (damaged bytes).")

    def _restore_tensor(
        self,
        directory: str,
        ckpt: str,
        name: str,
        entry: TensorEntry,
        check_keys: bool = False,
        used_copies: list[str] | None = None,
        all_copies: bool = False,
    ) -> torch.Tensor:
        try:
            return self._restore_once(directory, ckpt, name, entry, check_keys, False, used_copies, all_copies)
        except _MissingBlob:
            if not entry.copy:
                raise
        except CheckpointCorruptError:
            if check_keys and not entry.copy:
                raise
        # A link may be the damaged one: re-read the chain with content addresses checked, so the damaged file is
        # named (and, with copies, replaced by its copy).
        return self._restore_once(directory, ckpt, name, entry, True, entry.copy, used_copies, all_copies)

    def _restore_once(
        self,
        directory: str,
        ckpt: str,
        name: str,
        entry: TensorEntry,
        check_keys: bool,
        copy: bool,
        used_copies: list[str] | None,
        all_copies: bool = False,
    ) -> torch.Tensor:
        what = f"tensor `{name}`"
        dtype = codec.dtype_from_name(entry.dtype)
        shape = list(entry.shape)
        chain = list(entry.chain)
        blobs = [
            self._fetch(directory, key, ckpt, what, check_keys, copy and (i == 0 or all_copies), used_copies)
            for i, key in enumerate(chain)
        ]
        nbytes = entry.nbytes
        try:
            for i, blob in enumerate(blobs):
                header, _ = codec.read_header(blob)
                expected_ref = None if i == 0 else chain[i - 1]
                if header.get("ref") != expected_ref:
                    raise codec.CodecError(f"blob {chain[i]} references {header.get('ref')}, expected {expected_ref}")
                if header.get("dtype") != entry.dtype:
                    raise codec.CodecError(f"blob {chain[i]} holds {header.get('dtype')!r}, not {entry.dtype!r}")
                quant = header.get("kind") == "quant"
                size, want = (header.get("numel"), entry.numel) if quant else (header.get("nbytes"), nbytes)
                if size != want:  # checked before anything is allocated from a damaged size
                    unit = "elements" if quant else "bytes"
                    raise codec.CodecError(f"blob {chain[i]} holds {size!r} {unit}, the shape needs {want}")
            out = codec.decode_chain(blobs, shape)
        except Exception as e:  # noqa: BLE001 - whatever damaged bytes make the decoder raise, the tensor is lost
            raise CheckpointCorruptError(
                f"Checkpoint {ckpt!r}: cannot decode {what} (chain {', '.join(chain)}): {type(e).__name__}: "
                f"{one_line(e, first=True)[:300]}"
            ) from e
        if out.dtype != dtype or list(out.shape) != shape or _crc(out) != entry.crc32:
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
        return self._load_with_manifest(path, map_location, check_keys, used_copies)[0]

    def _load_with_manifest(
        self, path: str | os.PathLike[str], map_location: Any, check_keys: bool, used_copies: list[str] | None
    ) -> tuple[dict[str, Any], Manifest]:
        """Load the checkpoint; a blob found missing makes it re-read the manifest and, when the writer replaced it
        meanwhile (a reader slower than ``gc_grace_s``), restore once more from the new version."""
        directory, p = _read_path(path)
        _, manifest, data = self._read_manifest(p)
        try:
            return self._restore_all(directory, p, manifest, map_location, check_keys, used_copies), manifest
        except _MissingBlob as e:
            try:
                again = self.fs.read(p)
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"Checkpoint {p!r} was removed while it was being read, and its blobs were collected ({e}). Load "
                    "a checkpoint that is kept (e.g. last.ckpt)",
                ) from e
            if again == data:
                raise
            manifest = Manifest.from_json(p, again)
        return self._restore_all(directory, p, manifest, map_location, check_keys, used_copies), manifest

    def _restore_all(
        self,
        directory: str,
        p: str,
        manifest: Manifest,
        map_location: Any,
        check_keys: bool,
        used_copies: list[str] | None,
    ) -> dict[str, Any]:
        skeleton, small, aliases = self._skeleton(directory, p, manifest, used_copies)
        items = list(manifest.tensors.items())
        _check_names(p, skeleton, set(manifest.tensors), set(small))
        all_copies = manifest.copies == 2
        # Tensors with identical chains (last.ckpt vs its step, zero-initialised buffers) are decoded once.
        unique: dict[tuple[Any, ...], tuple[str, TensorEntry]] = {}
        for name, entry in items:
            unique.setdefault((entry.chain, entry.shape, entry.dtype), (name, entry))
        with ThreadPoolExecutor(max_workers=self.options.io_threads) as pool:
            decoded = dict(
                zip(
                    unique,
                    pool.map(
                        lambda ne: self._restore_tensor(
                            directory, p, ne[0], ne[1], check_keys, used_copies, all_copies
                        ),
                        unique.values(),
                    ),
                    strict=True,
                )
            )
        tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[Any, ...]] = set()
        for name, entry in items:
            k = (entry.chain, entry.shape, entry.dtype)
            t = decoded[k]
            tensors[name] = t.clone() if k in seen else t
            seen.add(k)
        tensors.update(small)
        device = _target_device(map_location)
        shared: set[str] = set()
        if aliases:
            try:
                restore_aliases(aliases, tensors, device)
            except (ValueError, TypeError, RuntimeError) as e:
                raise CheckpointCorruptError(
                    f"Checkpoint {p!r}: the skeleton's record of tensors sharing memory is damaged ({e}). Load another "
                    "checkpoint of the directory."
                ) from e
            shared = {m[0] for g in aliases for m in g}
        if device is not None:  # the shared groups were rebuilt on `device` already: moving them would copy each
            tensors = {n: t if n in shared else t.to(device) for n, t in tensors.items()}
        return fill_skeleton(skeleton, tensors)

    def verify(self, path: str | os.PathLike[str], *, repair: bool = False) -> dict[str, Any]:
        """Restore every tensor of the checkpoint at ``path`` with all checksums, and check every second copy
        (``redundancy=2``) against its content address; return a summary.

        Args:
            path: the manifest path.
            repair: rewrite a damaged or missing blob from its good second copy, and a damaged or missing second copy
                from its good blob (listed in the summary's ``repaired``; copies as ``<key>.copy``).

        Raises:
            CheckpointCorruptError: a tensor cannot be restored (naming the checkpoint and the tensor), or, without
                ``repair``, a blob or a second copy is damaged although the checkpoint still restores (its redundancy
                is lost: the message names the files and says to run ``--repair``).
        """
        directory, p = _read_path(path)
        used: list[str] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # reported in the summary instead
            ckpt, manifest = self._load_with_manifest(p, None, True, used)
        bad_copies: list[tuple[str, str]] = []
        for key in sorted(manifest.copy_keys()):
            url = self.blob_url(directory, key) + COPY_SUFFIX
            try:
                ok = _blob_key(self.fs.read(url)) == key
                if not ok:
                    bad_copies.append((key, f"{url} fails its checksum"))
            except (FileNotFoundError, IsADirectoryError):
                bad_copies.append((key, f"{url} is missing"))
        bad_blobs = sorted(set(used))
        repaired: list[str] = []
        if repair:
            for key in bad_blobs:
                url = self.blob_url(directory, key)
                spare = self.fs.read(url + COPY_SUFFIX)
                if _blob_key(spare) == key:
                    self.fs.write(url, spare)
                    repaired.append(key)
            for key, _ in bad_copies:
                url = self.blob_url(directory, key)
                good = self.fs.read(url)
                if _blob_key(good) == key:
                    self.fs.write(url + COPY_SUFFIX, good)
                    repaired.append(key + COPY_SUFFIX)
        elif bad_blobs or bad_copies:
            problems = [f"blob {k} is damaged or missing (restored from its copy)" for k in bad_blobs]
            problems += [f"the second copy of blob {k}: {why}" for k, why in bad_copies]
            raise CheckpointCorruptError(
                f"Checkpoint {p!r} restores, but its redundancy is damaged: {'; '.join(problems[:3])}"
                + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
                + f". Run `lightning-accel ckpt verify --repair {p}` to re-create each from its good copy."
            )
        entries = manifest.tensors.values()
        return {
            "path": p,
            "ok": True,
            "tensors": len(manifest.tensors),
            "blobs": len(manifest.keys()),
            "copies_checked": len(manifest.copy_keys()),
            "manifest_checksum": manifest.checksummed,
            "raw_tensor_bytes": sum(e.nbytes for e in entries),
            "chain_bytes": sum(sum(e.sizes) for e in entries),
            "max_chain": max((len(e.chain) for e in entries), default=0),
            "lossy": manifest.lossy,
            "copies_used": bad_blobs,
            "repaired": repaired,
            "top_level_keys": sorted(map(str, ckpt)),
        }

    def export(self, path: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False) -> str:
        """Write the checkpoint at ``path`` as one plain ``torch.save`` file at ``out`` (what ``torch.load`` and
        ``TorchCheckpointIO`` read). Returns ``out``.

        Raises:
            FileExistsError: ``out`` already exists and ``overwrite`` is false (it is left alone), or ``out`` is
                ``path`` itself (refused even with ``overwrite``: the export would replace what it reads).
            IsADirectoryError: ``out`` is a directory.
            ValueError: ``out`` is empty or ends with ``/`` (it names no file).
        """
        out_s = os.fspath(out)
        check_export_target(self.fs, os.fspath(path), out_s, overwrite=overwrite)
        ckpt = self.load(path)
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        self.fs.write(out_s, buf.getvalue())
        return out_s

    # ------------------------------------------------------------------ remove / collect
    def remove(
        self, path: str | os.PathLike[str], *, drop_emptied: bool = False, last_grace_s: float | None = None
    ) -> int:
        """Delete the checkpoint at ``path`` and collect the blobs no remaining manifest references (once their grace
        period ``gc_grace_s`` has passed).

        A symlink is removed as a link. Local symlinks that point at the removed manifest (Lightning's
        ``save_last="link"``) are first replaced by a copy of it, so they stay loadable. A missing path is a no-op.

        Args:
            path: the manifest.
            drop_emptied: when the removal leaves the checkpoint's folder with nothing but this store's own files,
                remove them and the folder (:meth:`remove_if_emptied`), now or, for blobs waiting out their grace
                period, at the collection that deletes them.
            last_grace_s: the grace period of the collection when the removal leaves the folder with no checkpoint
                (None: the store's ``gc_grace_s``; 0: at once). For a file whose only reader is the caller, who has
                read it already, and whose folder no one comes back to (Lightning's ``ddp_spawn`` hand-over of the
                final weights): its blobs would otherwise wait for a collection that never runs.

        Returns:
            The number of blobs deleted.

        Raises:
            NotADeltaCheckpointError: ``path`` holds something else (it is left alone).
            CheckpointDirectoryLockedError: another writer holds the directory.
        """
        return self.remove_checkpoints([os.fspath(path)], drop_emptied=drop_emptied, last_grace_s=last_grace_s)

    def remove_checkpoints(
        self, paths: list[str], *, drop_emptied: bool = False, last_grace_s: float | None = None
    ) -> int:
        """:meth:`remove` each of ``paths`` (manifests), then collect garbage once per directory (and, with
        ``drop_emptied``, remove each folder left with only this store's own files). Returns the number of blobs
        deleted."""
        if last_grace_s is not None:
            check_number("last_grace_s", last_grace_s, low=0, fix="0: at once; None: the store's `gc_grace_s`.")
        dirs: dict[str, None] = {}
        with self._lock:
            for path in paths:
                directory, p = split_path(path)
                if self._unlink_manifest(directory, p):
                    dirs[directory] = None
            deleted = 0
            for d in dirs:
                # a checkpoint left in the folder may have readers of the removed one's blobs too: the usual period
                grace = None if last_grace_s is None or self.live_keys(d) else last_grace_s
                deleted += (
                    self._collect_or_warn(
                        d, _after_failed(f"Checkpoint(s) in {d!r} were removed", d), _AFTER_THEN, grace_s=grace
                    )
                    or 0
                )
                if drop_emptied:
                    self._drop_if_emptied(d)
            return deleted

    def _drop_if_emptied(self, directory: str) -> None:
        """After a removal with ``drop_emptied``: remove ``directory`` if only this store's files are left there;
        while blobs of it wait out their grace period, note it so the collection that deletes them does so then."""
        if directory in self._waiting.get():
            self._drop_later.get().add(directory)
            return
        self._drop_later.get().discard(directory)
        if self.fs.list_files(directory):  # a checkpoint (or any file) is left: the usual case, one listing
            return
        if self.remove_if_emptied(directory):
            self.forget(directory)

    def _unlink_manifest(self, directory: str, p: str) -> bool:
        """Delete the manifest (or link) at ``p``; False when nothing was there."""
        if not self.fs.exists(p):
            return False
        local = is_local_url(p)
        link = local and os.path.islink(p)
        # Checked before the writer lock is taken: a refused removal leaves the user's directory as it was.
        head = b"" if link or self.fs.isdir(p) else self.fs.head(p, 128)
        if not link and not is_manifest_bytes(head):
            if self._adopted_file(p, head):
                self._writable(directory)
                self._adopted.get().discard(p)
                self.fs.rm(p)  # a plain checkpoint: no blobs of its own
                if local:
                    fsync_dir(directory)
                return True
            raise NotADeltaCheckpointError(
                f"Refusing to remove {p!r}: it is not a delta checkpoint manifest written by DeltaCheckpointIO. "
                "Move it away yourself if it should go."
            )
        self._writable(directory)
        state = self._dirs.get().get(directory)
        if state is not None:
            state.live.pop(p, None)
        if link:
            os.unlink(p)
            return True
        if local:
            self._materialize_links_to(directory, p)
        self._release(directory, p)
        self.fs.rm(p)
        if local:
            fsync_dir(directory)
        return True

    def _materialize_links_to(self, directory: str, target: str) -> None:
        data = None
        real = os.path.realpath(target)
        for name in self.fs.list_files(directory):
            link = os.path.join(directory, name)
            if os.path.islink(link) and os.path.realpath(link) == real:
                data = self.fs.read(target) if data is None else data
                self.fs.write(link, data)  # os.replace swaps the link for a real manifest

    def untracked_manifests(
        self, directory: str | os.PathLike[str], tracked: Iterable[str], *, subdirectories: bool = False
    ) -> list[tuple[str, float]]:
        """The manifests of ``directory`` (recognised by their first bytes: never another file) that ``tracked`` does
        not name, as ``(url, created)``, oldest first. Symlinks and damaged manifests are left out (never removed by a
        reconciliation).

        Args:
            directory: the checkpoint directory.
            tracked: names, paths or URLs of the tracked checkpoints. One names a manifest when it ends with the
                manifest's path relative to ``directory`` (its name, for one directly inside), so a directory read
                from another mount point or URL still matches.
            subdirectories: also the manifests of the subdirectories of ``directory`` that hold a blob store of their
                own (:meth:`blob_stores_below`: a ``filename`` with a ``/`` saves there); a folder without one holds no
                checkpoint this plugin wrote.
        """
        directory = store_dir(directory)
        paths = {os.fspath(t).rstrip("/").replace(os.sep, "/") for t in tracked if t}
        folders = [directory, *(self.blob_stores_below(directory) if subdirectories else [])]
        out: list[tuple[str, float]] = []
        for folder in folders:
            prefix = relative_to(folder, directory)
            for name in self.fs.list_files(folder):
                url = _listed(folder, name)
                rel = f"{prefix}/{name}" if prefix else name
                if url is None or any(t == rel or t.endswith(f"/{rel}") for t in paths):
                    continue
                if is_local_url(url) and os.path.islink(url):
                    continue
                try:
                    if not is_manifest_bytes(self.fs.head(url, 128)):
                        continue
                    out.append((url, Manifest.from_json(url, self.fs.read(url)).created))
                except (FileNotFoundError, IsADirectoryError, CheckpointCorruptError):
                    continue
        return sorted(out, key=lambda uc: (uc[1], uc[0]))

    def blob_stores_below(self, root: str | os.PathLike[str]) -> list[str]:
        """The subdirectories of ``root``, at any depth, that hold a blob store (``.delta_blobs``), sorted; not inside
        a blob store, and (locally) not through a symlink, which may lead out of ``root`` or back into it."""
        root = store_dir(root)
        found: set[str] = set()
        if is_local_url(root):
            top = strip_file_scheme(root)
            for d, dirs, _ in os.walk(top):
                if d != top and BLOB_DIR in dirs and not os.path.islink(os.path.join(d, BLOB_DIR)):
                    found.add(d)
                dirs[:] = [x for x in dirs if x != BLOB_DIR and not os.path.islink(os.path.join(d, x))]
        else:
            for rel in self.fs.find(root):
                parts = rel.split("/")
                if BLOB_DIR in parts[:-1] and (i := parts.index(BLOB_DIR)) > 0:
                    found.add(posixpath.join(root, *parts[:i]))
        return sorted(found)

    def remove_if_emptied(self, directory: str | os.PathLike[str], *, keep_directory: bool = False) -> bool:
        """Remove what this store made in ``directory`` -- its blob store ``.delta_blobs`` with the writer lock and
        the empty blob folders -- and then ``directory`` itself, when nothing else is left there: no checkpoint, no
        blob (one waiting for its grace period included) and no file or folder of anyone else, in which case
        everything is left as it is.

        Why: a checkpoint subdirectory (a ``filename`` with a ``/``) whose last checkpoint was removed kept the blob
        store's lock file and folders, and so the subdirectory, for good.

        Args:
            directory: the checkpoint directory.
            keep_directory: remove only the blob store, and leave ``directory`` itself (a folder that is not this
                store's to remove: it existed before the save that made the blob store).

        Returns:
            True when ``directory`` was removed, or with ``keep_directory`` emptied (on an object store: nothing of
            the store is left under it).

        Raises:
            CheckpointDirectoryLockedError: a live writer holds ``directory`` (nothing is removed).
        """
        directory = store_dir(directory)
        blob_root = safe_join(directory, BLOB_DIR)
        lock_rel = posixpath.relpath(LOCK_NAME, BLOB_DIR)
        with self._lock:
            self._writable(directory)  # refused while a live writer holds it; ours while we look and remove
            if not is_local_url(directory):
                # Folders are only prefixes: the lease object, deleted on release, is all there may be.
                left = [rel for rel in self.fs.find(directory) if rel != LOCK_NAME]
                if left:
                    return False
                self._release_lock(directory, remove=True)
                return True
            path = strip_file_scheme(directory)
            blobs = strip_file_scheme(blob_root)
            if os.path.islink(blobs) or os.listdir(path) != [BLOB_DIR]:
                return False
            shards: list[str] = []
            for d, dirs, files in os.walk(blobs):
                own = {lock_rel} if d == blobs else set()  # no lock file when the store runs with `lock=False`
                if any(os.path.islink(os.path.join(d, x)) for x in dirs) or not set(files) <= own:
                    return False  # a blob, the pending record, a file of someone else's: not empty
                if d != blobs:
                    shards.append(d)
            for d in sorted(shards, reverse=True):  # the deepest first: each is empty once its children went
                os.rmdir(d)
            self._release_lock(directory, remove=True)
            try:
                os.rmdir(blobs)
                if not keep_directory:
                    os.rmdir(path)
            except OSError:  # a writer made a new lock file meanwhile: its store is no longer empty
                return False
            return True

    def _release_lock(self, directory: str, *, remove: bool = False) -> None:
        """Give up this store's writer lock of ``directory`` (deleting the lock file with ``remove``)."""
        lk = self._locks.get().pop(directory, None)
        if lk is not None:
            lk.release(remove=remove)

    def live_keys(self, directory: str) -> set[str]:
        """Blob keys referenced by any manifest in ``directory`` or by this process's chain state."""
        keys: set[str] = set()
        state = self._dirs.get().get(directory)
        live: dict[str, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]] = {}
        for name in self.fs.list_files(directory):
            url = _listed(directory, name)
            if url is None:
                continue
            try:
                head = self.fs.head(url, 128)
                if not is_manifest_bytes(head):
                    if damaged_manifest_head(head):
                        raise ValueError(f"its header reads {head[:40]!r}")
                    continue
                skeleton, chains = manifest_references(self.fs.read(url))
                keys.add(skeleton)
                for chain, _ in chains.values():
                    keys.update(chain)
                live[split_path(url)[1]] = chains
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
            if not live:
                # No checkpoint is left here (`save_top_k` removed the last one of a subdirectory): the chain bases
                # would keep a whole checkpoint's blobs alive only for deltas of saves that may never come here
                # again. The next save here starts with full snapshots instead.
                state.entries = {}
            for entry in state.entries.values():
                keys.update(entry.entry.chain)
        return keys

    def collect_garbage(self, directory: str | os.PathLike[str], *, grace_s: float | None = None) -> int:
        """Delete the blobs of ``directory`` that no manifest has referenced for ``grace_s`` seconds, and temporary
        files of interrupted writes.

        A blob found unreferenced is first recorded in the pending-deletions record ``.delta_blobs/.pending`` with the
        time; a later collection deletes it once the grace period has passed (a reader that opened a manifest
        meanwhile still finds its blobs), and drops it from the record if a manifest references it again. The other
        directories where this store's collections left blobs waiting are collected too once those are past the
        store's ``gc_grace_s`` (a checkpoint subdirectory may see no save or removal again).

        Args:
            directory: the checkpoint directory.
            grace_s: the grace period (default: the store's ``gc_grace_s``; 0 deletes at once).

        Returns:
            The number of files deleted (in ``directory`` and the others collected with it).

        Raises:
            CheckpointDirectoryLockedError: another writer holds the directory.
        """
        directory = store_dir(directory)
        grace = self.gc_grace_s if grace_s is None else check_number("grace_s", grace_s, low=0, fix="0: at once.")
        with self._lock:
            self._writable(directory)
            try:
                live = self.live_keys(directory)
            except CheckpointCorruptError as e:  # keep everything; saves go on (their manifests are intact)
                if self._first_of_its_cause(directory, e):  # every later collection meets it again: said once
                    warnings.warn(one_line(e), UserWarning, stacklevel=2)
                return 0
            released = self._released.get().pop(directory, set())
            blob_root = safe_join(directory, BLOB_DIR)
            pending = self._read_pending(blob_root)
            now = time.time()
            unreferenced: dict[str, list[str]] = {}
            deleted = 0
            # files that could not be deleted -> the error (they are tried again by the next collection)
            refused: dict[str, Exception] = {}

            def delete(rel: str) -> bool:
                url = safe_join(blob_root, rel)
                try:
                    self.fs.rm(url)
                except StorageUnavailableError:
                    raise  # the store cannot be reached: trying every other file would only wait out their retries
                except Exception as e:  # noqa: BLE001 - one file refused (a permission, a read-only mount, a policy)
                    refused[url] = e
                    return False
                return True

            for rel in self.fs.find(blob_root):
                base = posixpath.basename(rel)
                if _TMP_RE.match(base):  # an interrupted write of the single writer: never anyone's blob
                    deleted += delete(rel)
                    continue
                key = base[: -len(COPY_SUFFIX)] if base.endswith(COPY_SUFFIX) else base
                if is_blob_key(key) and key not in live:
                    unreferenced.setdefault(key, []).append(rel)
            keep: dict[str, float] = {}
            stuck: set[str] = set()
            for key, rels in unreferenced.items():
                since = now if key in released else min(pending.get(key, now), now)
                if now - since >= grace:
                    gone = [delete(rel) for rel in rels]
                    deleted += sum(gone)
                    if not all(gone):
                        # Kept on the record with its time: every later collection (of this run or the next) tries
                        # it again at once, and a manifest referencing it again takes it off as usual.
                        keep[key] = since
                        stuck.add(key)
                else:
                    keep[key] = since
            if keep != pending:
                self._write_pending(blob_root, keep)
            # A blob that cannot be deleted is not waiting for its grace period: other directories' collections need
            # not come back here for it (this directory's next collection retries it).
            waiting = [t for k, t in keep.items() if k not in stuck]
            if waiting:
                self._waiting.get()[directory] = min(waiting)
            else:
                self._waiting.get().pop(directory, None)
            for name in self.fs.list_files(directory):
                url = _listed(directory, name, tmp=True)
                # The directory is shared with the user and other tools, whose own atomic writes may use the same
                # `.<name>.<hex>.tmp` form: only a manifest's interrupted write is this store's to remove (a tmp
                # file killed before its first byte is left: it cannot be told apart).
                if url is not None and is_manifest_bytes(self._head(url)):
                    self.fs.rm(url)
                    deleted += 1
            if refused:
                self._refused.get()[directory] = len(refused)
                self._warn_refused(directory, refused)
            else:
                self._refused.get().pop(directory, None)
                self._warned_gc.get().pop(directory, None)  # a failure from here on is news again
            return deleted + self._collect_due_elsewhere(directory)

    def _warn_refused(self, directory: str, refused: dict[str, Exception]) -> None:
        """One warning for the files of ``directory`` a collection could not delete, unless every cause was warned
        since the directory's last successful collection (:meth:`_first_of_its_cause`)."""
        new = [(url, e) for url, e in refused.items() if self._first_of_its_cause(directory, e)]
        if not new:
            return
        url, e = new[0]
        warnings.warn(
            one_line(
                f"Could not delete {len(refused)} unreferenced file(s) of checkpoint directory {directory!r} "
                f"(first: {url!r}: {type(e).__name__}: {one_line(e, first=True)}). No checkpoint is affected: every "
                f"later collection there retries them (the blobs stay listed in `{BLOB_DIR}/{PENDING_NAME}`) without "
                f"warning again. Let this process delete files there, or run `lightning-accel ckpt gc {directory}` "
                "once it can."
            ),
            UserWarning,
            stacklevel=3,
        )

    def _collect_due_elsewhere(self, directory: str) -> int:
        """Collect the other directories whose waiting blobs are past the grace period; returns the files deleted.

        Why: a directory may see no save or removal after its last removal. ``ModelCheckpoint`` puts a checkpoint in
        a subdirectory of its own when ``filename`` holds a ``/`` (a metric named ``val/loss``); once ``save_top_k``
        removed it, its blobs (a whole checkpoint's bytes) waited for a collection there that never came.
        """
        if self._collecting_elsewhere:
            return 0
        waiting = self._waiting.get()
        now = time.time()
        due = [d for d, since in waiting.items() if d != directory and now - since >= self.gc_grace_s]
        deleted = 0
        self._collecting_elsewhere = True
        try:
            for other in due:
                waiting.pop(other, None)
                try:
                    # Gone (removed by the user) or no longer this store's to write (another writer's lock): left
                    # alone, and not re-created by taking its lock.
                    if self.fs.isdir(safe_join(other, BLOB_DIR)):
                        deleted += self.collect_garbage(other)
                        if other in self._drop_later.get():
                            self._drop_if_emptied(other)
                except Exception as e:  # noqa: BLE001 - housekeeping of another directory must not fail this call
                    if not self._first_of_its_cause(other, e):
                        continue  # warned already: tried again quietly once its blobs are due
                    warnings.warn(
                        f"Could not collect the unreferenced blobs of checkpoint directory {other!r}: {one_line(e)}. "
                        f"Run `lightning-accel ckpt gc {other}` once nothing writes there.",
                        UserWarning,
                        stacklevel=3,
                    )
        finally:
            self._collecting_elsewhere = False
        return deleted

    def _head(self, url: str) -> bytes:
        """The first bytes of ``url`` (enough for :func:`is_manifest_bytes`); ``b""`` if it went meanwhile."""
        try:
            return self.fs.head(url, 256)
        except (FileNotFoundError, IsADirectoryError):
            return b""

    def undeletable(self, directory: str | os.PathLike[str]) -> int:
        """How many files the last collection of ``directory`` by this process could not delete (0: none, or no
        collection yet); they stay on the pending-deletions record and the next collection tries them again."""
        return self._refused.get().get(store_dir(directory), 0)

    def pending_deletions(self, directory: str | os.PathLike[str]) -> dict[str, float]:
        """The blobs of ``directory`` waiting for their grace period: blob key -> time (``time.time()``) since which
        no manifest references it."""
        return self._read_pending(safe_join(store_dir(directory), BLOB_DIR))

    def _read_pending(self, blob_root: str) -> dict[str, float]:
        try:
            raw = json.loads(self.fs.read(safe_join(blob_root, PENDING_NAME)))
        except (FileNotFoundError, IsADirectoryError, ValueError):
            return {}  # none, or damaged: every unreferenced blob starts its grace period now (nothing is lost)
        keys = raw.get("keys") if isinstance(raw, dict) and raw.get("format") == _PENDING_FORMAT else None
        if not isinstance(keys, dict):
            return {}
        return {
            k: float(t)
            for k, t in keys.items()
            if is_blob_key(k) and isinstance(t, (int, float)) and not isinstance(t, bool)
        }

    def _write_pending(self, blob_root: str, keys: dict[str, float]) -> None:
        url = safe_join(blob_root, PENDING_NAME)
        if not keys:
            self.fs.rm(url)
            return
        self.fs.write(url, json.dumps({"format": _PENDING_FORMAT, "version": 1, "keys": keys}).encode())

    def forget(self, directory: str | None = None) -> None:
        """Drop the in-memory chain state (the next save of each tensor is a full snapshot)."""
        with self._lock:
            if directory is None:
                self._dirs.get().clear()
            else:
                self._dirs.get().pop(store_dir(directory), None)


def check_export_target(fs: FileStore, path: str, out: str, *, overwrite: bool) -> None:
    """Refuse an export target that would lose something: a directory, the checkpoint being exported (through any
    spelling or symlink), or, unless ``overwrite``, an existing file (which may be a user's; an export only writes a
    new one unless told to replace it). Checked before the (possibly long) read.

    Raises:
        ValueError: ``out`` is empty or ends with a ``/`` (it names no file).
        IsADirectoryError: ``out`` is a directory.
        FileExistsError: ``out`` is ``path`` itself, or exists and ``overwrite`` is false.
    """
    name = posixpath.basename(path.rstrip("/")) or "export.ckpt"
    # An empty target resolved to the working directory (five failed renames onto it, then an error about the
    # store's reachability), and `out/` was written as a file named `out`: neither names a file to write.
    if not out.strip() or out.endswith(("/", os.sep)):
        raise ValueError(
            f"Export target {out!r} names no file: it is empty or ends with '/'. Pass the path of the file to write, "
            f"e.g. {posixpath.join(out.strip() or '.', name)!r}."
        )
    if fs.isdir(out):
        raise IsADirectoryError(
            errno.EISDIR,
            f"Export target {out!r} is a directory. Pass the path of the file to write, e.g. "
            f"{posixpath.join(out, name)!r}.",
        )
    same = store_path(out) == store_path(path)
    if not same and is_local_url(out) and is_local_url(path):
        same = os.path.realpath(store_path(out)) == os.path.realpath(store_path(path))
    if same:
        raise FileExistsError(
            errno.EEXIST,
            f"Export target {out!r} is the checkpoint being exported; replacing it would lose the original. Pass "
            "another output path.",
        )
    if not overwrite and fs.exists(out):
        raise FileExistsError(
            errno.EEXIST,
            f"Export target {out!r} already exists and was left alone. Pass another output path, or "
            "`--overwrite` (`overwrite=True` from Python) to replace it.",
        )


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


def _check_names(path: str, skeleton: Any, listed: set[str], small: set[str]) -> None:
    """The skeleton's tensor placeholders and the manifest's + skeleton blob's tensors are the same names."""
    wanted = placeholder_names(skeleton)
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


def relative_to(path: str, root: str) -> str:
    """``path`` relative to ``root``, ``/``-separated (``""`` for ``root`` itself); the file name of a path that does
    not lie below ``root`` (a tracked checkpoint another run saved elsewhere)."""
    if path == root:
        return ""
    if is_local_url(root) and is_local_url(path):
        rel = os.path.relpath(strip_file_scheme(path), strip_file_scheme(root))
        return os.path.basename(path) if rel.startswith("..") else rel.replace(os.sep, "/")
    top = root.rstrip("/") + "/"
    return path[len(top) :] if path.startswith(top) else posixpath.basename(path.rstrip("/"))


def _listed(directory: str, name: str, *, tmp: bool = False) -> str | None:
    """The URL of a file name listed in ``directory``, or None for a name :func:`safe_join` refuses (e.g. a user's
    ``C:\\notes.txt``): this plugin never writes such a name, so the file is not its own and is left untouched,
    rather than failing every save and collection in the directory.

    Only names of temporary files (an interrupted write's ``.X.<32 hex>.tmp``) with ``tmp=True``, only others without:
    a temporary file is no manifest (the single writer publishes by rename; read as one, a manifest cut short by a
    kill stopped every later collection as "damaged") and no checkpoint.
    """
    if bool(_TMP_RE.match(name)) != tmp:
        return None
    try:
        return safe_join(directory, name)
    except ValueError:
        return None


def _target_device(map_location: Any) -> torch.device | None:
    if map_location is None or callable(map_location):
        return None
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return torch.device(target) if target is not None else None
    dev = torch.device(map_location)
    return None if dev.type == "cpu" else dev
