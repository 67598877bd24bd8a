"""``DeltaCheckpointIO``: the Lightning adapter of the delta checkpoint store.

Use it like any ``CheckpointIO``::

    trainer = L.Trainer(plugins=[DeltaCheckpointIO(async_save=True)], callbacks=[ModelCheckpoint(save_top_k=3)])

It composes with Lightning's own ``AsyncCheckpointIO(DeltaCheckpointIO())`` too, but the built-in ``async_save=True``
is preferred: it queues ``remove_checkpoint`` behind the saves (Lightning's wrapper runs removals on the caller's
thread, so a removal can overtake a queued save), bounds the saves in flight (``max_pending``) and only snapshots
tensors to the CPU on the training thread. ``AsyncCheckpointIO.teardown`` does not tear down the IO it wraps (its
directory's writer lock would stay taken until the process exits): ``DeltaModelCheckpoint`` and ``CheckpointGuard`` do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from lightning.fabric.plugins import CheckpointIO
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.atomic import is_local_url
from lightning_accel._utils.checks import check_bool, check_number
from lightning_accel._utils.compat import PathType, register_before_thread_shutdown
from lightning_accel._utils.deferred import Deferred, resolve_deferred
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.forksafe import ForkSafeLock
from lightning_accel._utils.rank import distributed_ready, world_size
from lightning_accel.checkpoint.background import (
    BackgroundWriter,
    CheckpointSaveError,
    Snapshot,
    WriterStats,
    failure_hint,
    trim_heap,
)
from lightning_accel.checkpoint.lock import prepare_directory
from lightning_accel.checkpoint.options import StoreOptions
from lightning_accel.checkpoint.reader import read_checkpoint_with
from lightning_accel.checkpoint.store import (
    GC_GRACE_S,
    DeltaStore,
    SaveStats,
    check_file_path,
    split_path,
    store_dir,
)

__all__ = ["CheckpointSaveError", "DeltaCheckpointIO"]

log = logging.getLogger(__name__)

#: default of ``deferred_timeout_s``: Lightning's default process-group timeout, so a gather in flight is not given up
#: on before the collective itself would time out
DEFERRED_TIMEOUT_S = 1800.0

#: this process's plugins, whose queued saves are finished at interpreter exit (:func:`_finish_saves_at_exit`)
_LIVE: weakref.WeakSet[DeltaCheckpointIO] = weakref.WeakSet()


def _finish_saves_at_exit() -> None:
    """Finish the saves still queued when the interpreter exits, then release the directories' writer locks (each
    plugin's :meth:`~DeltaCheckpointIO.teardown`).

    Why: a save requested after ``fit`` (``trainer.save_checkpoint("final.ckpt")``: the plugin's ``teardown`` has
    already run) returns once its snapshot is taken; the writer is a daemon thread, and at interpreter exit it would
    be stopped mid-save and the checkpoint lost. Lightning's ``AsyncCheckpointIO`` finishes it (its executor's thread
    is joined at exit); so does this, before the interpreter's executors stop taking work (the save's parallel IO
    uses one). A failure can no longer be raised to the caller: it is logged.
    """
    for io in list(_LIVE):
        try:
            io.teardown()
        except BaseException as e:  # noqa: BLE001 - nothing to raise to at exit; the error is logged
            log.error("A checkpoint save still queued at exit failed: %s", one_line(e))


register_before_thread_shutdown(_finish_saves_at_exit)


class DeltaCheckpointIO(CheckpointIO):
    """Checkpoints that store only what changed: content-addressed blobs, lossless XOR deltas, opt-in quantization.

    Each checkpoint path becomes a small JSON manifest; tensors live as blobs in ``<dir>/.delta_blobs/``. Unchanged
    tensors are references, changed ones XOR deltas (or quantized deltas) against the chain's full snapshot.
    ``remove_checkpoint`` deletes the manifest and the blobs no remaining manifest needs. Loading never unpickles
    arbitrary objects. See ``docs/checkpoint.md``.

    Every argument is keyword-only and validated here, in ``__init__`` (one line naming the argument, the value, the
    range and the fix); ``max_pending``, ``write_delay_s``, ``on_save_error`` and ``deferred_timeout_s`` given other
    values than their defaults without ``async_save=True`` are warned about, as they change nothing then. Apart from
    ``async_save``, ``max_pending``, ``write_delay_s``, ``on_save_error``, ``deferred_timeout_s`` and
    ``storage_options`` they are the fields of
    :class:`~lightning_accel.checkpoint.options.StoreOptions` (which validates and documents them in full), made once
    and handed to the :class:`~lightning_accel.checkpoint.store.DeltaStore`.

    Args:
        async_save: **Saving.** Snapshot tensors into reused CPU buffers (pinned for GPU tensors) on the training
            thread, then encode and write in a background thread; removals are queued behind saves; ``teardown``
            waits and frees the buffers.
        max_pending: most saves queued or running at once with ``async_save`` (default 2: one writing while the
            next snapshot waits). A save of a path whose earlier save has not started replaces it (latest wins); a
            removal cancels a not yet started save of its path; a save of a new path with every slot taken is
            admitted once past the bound while an older save waits unstarted (the removal ``save_top_k`` sends next
            usually cancels that one; the call after it waits until the bound holds again), otherwise it waits for
            a slot (all counted in :attr:`writer_stats`). Memory stays at most ``max_pending + 1`` snapshot buffers
            per tensor (1 with ``max_pending=1``, which never overtakes), ``teardown`` waits for at most that many
            saves, and a killed process loses at most those.
        write_delay_s: with ``async_save``, seconds after a save's snapshot before the background thread starts
            encoding it (default 0.05). The training thread is still inside the save then (Lightning's barrier, a
            ``last.ckpt`` save right after a top-k one); an encode started at once competes for the cores it and
            the other ranks need to leave it: 2 CPU processes stalled 7.6 ms per save with 0 against 3.5 ms with
            0.05 here (``docs/checkpoint.md``). Only the start moves, not the work; ``teardown`` starts what is
            queued at once.
        on_save_error: what a failed async save (or removal) does. ``"raise"`` (default): the next
            ``save_checkpoint`` / ``remove_checkpoint`` (the next step of a run saving every step), load or
            ``teardown`` raises :class:`CheckpointSaveError`, one line naming the first failure, and nothing queued
            behind it runs (no removal after the failed save). ``"warn"``: every failure is warned at the next call
            and training goes on; a removal queued after a failed save is skipped, so the older checkpoint stays.
            Either way the blobs a failed save wrote are deleted again. Under DDP only global rank 0 saves:
            ``DeltaModelCheckpoint`` raises its failure on every rank together (see :meth:`save_errors_held`).
        deferred_timeout_s: with ``async_save``, seconds the writer waits for a checkpoint value still being
            produced when the save was requested (``ddp_1bit``'s gather of every rank's error state) before that save
            fails with a ``TimeoutError`` naming the checkpoint (reported as ``on_save_error`` says; the previous
            checkpoint stays). Default 1800, Lightning's default process-group timeout: a rank that died before
            joining the gather does not leave ``teardown`` waiting forever. At most ``threading.TIMEOUT_MAX``.
        storage_options: **Storage.** fsspec options for ``s3://`` and other remote checkpoint directories.
        quantize: **Lossy deltas (opt-in).** ``None`` (lossless), ``"int8"`` or ``"int4"`` quantized deltas (full
            snapshots stay lossless).
        quantize_groups: which tensors may be quantized: ``"optimizer"`` (default), ``"all"`` float tensors, or a
            list of tensor-name prefixes.
        quant_block: elements per quantization scale.
        delta_ref: **Delta chains.** ``"base"`` (delta against the chain's full snapshot: restores read at most 2
            blobs) or ``"previous"`` (against the previous save: smaller deltas, chains up to ``max_chain``).
        max_chain: most blobs one tensor's restore may read (``delta_ref="previous"``).
        full_every: restart a tensor's chain with a full snapshot after this many deltas.
        rebase_ratio: write a full snapshot instead of a delta at least this fraction of the base's size.
        rebase_dead_fraction: write a full snapshot instead of a delta when the tensor's base belongs to no live
            checkpoint any more and is more than this fraction of the bytes its live chains keep (1.0: never).
        redundancy: **Safety.** ``2`` keeps a second copy (``<key>.copy``) of every blob a save writes (bases,
            deltas and the skeleton), so one lost or damaged blob does not take its checkpoint; ``ckpt verify``
            checks both copies and ``--repair`` rewrites a damaged one from the other.
        gc_grace_s: **Readers.** Seconds a blob that no checkpoint references any more stays on disk before garbage
            collection deletes it, so a reader that opened a manifest just before it was replaced or removed still
            finds its blobs (readers take no lock). ``0``: delete at once; ``float("inf")``: never (the blobs stay
            until ``lightning-accel ckpt gc DIR`` collects them).
        inline_bytes: **Encoding.** Tensors smaller than this go into the skeleton blob instead of blobs of their own.
        zstd_level: zstd compression level.
        zstd_threads: zstd worker threads per blob (0: single-threaded; -1: one per core).
        io_threads: threads that encode/decode tensors in parallel.
        lock: take the directory's writer lock at the first save (refuses a second writer; see
            :mod:`~lightning_accel.checkpoint.lock`). Disable only on filesystems without ``flock``.

    The writer lock is held while a stage can write: from the first save (or :meth:`claim`) until ``teardown``, which
    Lightning calls at the end of every ``fit`` / ``validate`` / ... A save or removal after that (a post-fit
    ``trainer.save_checkpoint("final.ckpt")``) takes the lock only while it is written (with ``async_save``: until
    the writer has nothing more queued) and releases it with the chain state, so another process may resume from or
    collect the directory while this one lives on. :meth:`attach` (``DeltaModelCheckpoint`` and ``CheckpointGuard``
    at the start of a stage) and :meth:`claim` (``CheckpointGuard``, the ``lightning-accel`` CLI) make writes hold it
    until the next ``teardown`` again.

    ``remove_checkpoint`` also removes the checkpoint's folder once it holds nothing but the blob store's own files
    (a ``filename`` with a ``/`` gives each checkpoint a subfolder): at once, or when the blobs it left have waited out
    ``gc_grace_s``. A folder with any other file or folder in it is left as it is.
    """

    # Explicit keyword-only arguments rather than `**store_kwargs`: LightningCLI (jsonargparse) builds the
    # `init_args:` schema from this signature and cannot see through `**kwargs`. The defaults mirror StoreOptions'
    # fields (a test checks that both agree); the values are only forwarded.
    def __init__(
        self,
        *,
        async_save: bool = False,
        max_pending: int = 2,
        write_delay_s: float = 0.05,
        on_save_error: Literal["raise", "warn"] = "raise",
        deferred_timeout_s: float = DEFERRED_TIMEOUT_S,
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
        gc_grace_s: float = GC_GRACE_S,
    ) -> None:
        super().__init__()
        self.async_save = check_bool("async_save", async_save)
        self.deferred_timeout_s = check_number(
            "deferred_timeout_s",
            deferred_timeout_s,
            low=0,
            low_open=True,
            # the longest wait a thread can be given here: a longer one failed every save holding a deferred value,
            # later, on the writer thread ("timestamp out of range for platform time_t")
            high=threading.TIMEOUT_MAX,
            fix=f"Default {DEFERRED_TIMEOUT_S:g} (Lightning's process-group timeout); raise it for slower gathers.",
        )
        options = StoreOptions(
            quantize=quantize,
            quantize_groups=quantize_groups,
            quant_block=quant_block,
            delta_ref=delta_ref,
            max_chain=max_chain,
            full_every=full_every,
            rebase_ratio=rebase_ratio,
            rebase_dead_fraction=rebase_dead_fraction,
            redundancy=redundancy,
            inline_bytes=inline_bytes,
            zstd_level=zstd_level,
            zstd_threads=zstd_threads,
            io_threads=io_threads,
            lock=lock,
        )
        self.store = DeltaStore(storage_options=storage_options, options=options, gc_grace_s=gc_grace_s)
        self._writer = BackgroundWriter(max_pending=max_pending, on_error=on_save_error, start_delay_s=write_delay_s)
        if not self.async_save:
            _warn_async_only(
                max_pending=max_pending,
                write_delay_s=write_delay_s,
                on_save_error=on_save_error,
                deferred_timeout_s=deferred_timeout_s,
            )
        _LIVE.add(self)
        self.max_pending = max_pending
        self.write_delay_s = self._writer.start_delay_s
        self.on_save_error = on_save_error
        # Per-save statistics (bytes and blobs written, tensors unchanged / delta / full), newest last.
        self.history: deque[SaveStats] = deque(maxlen=10_000)
        #: why quantized deltas were switched off (:meth:`switch_off`), or None
        self.switched_off_reason: str | None = None
        # local directories made on the training thread by async saves (:meth:`_make_directory`)
        self._made_dirs: set[str] = set()
        # those of them that did not exist -> the folder above the topmost one made (what a removal may take back)
        self._created_dirs: dict[str, str] = {}
        # True from construction or `claim` until `teardown`: writes keep the directory's writer lock. False after
        # `teardown`: each write holds it only while it is written (`_release_if_detached`). Changed, and read before
        # a release, under `_stage_lock`, so a release on the writer thread cannot undo a `claim` made meanwhile.
        self._attached = True
        # Fork-safe, and pickled as a fresh lock: `strategy="ddp_spawn"` pickles the Trainer with this plugin to start
        # each rank, and a plain `threading.Lock` made that launch fail ("cannot pickle '_thread.lock' object").
        self._stage_lock = ForkSafeLock()
        # whether a save under several processes outside the callbacks' routing was warned (`_warn_unrouted`)
        self._warned_unrouted = False
        # > 0 inside `failures_raised_on_every_rank`: a synchronous write there is not warned about
        self._routed_depth = 0
        # the paths (writer keys) this plugin's async saves completed and no removal took since: a queued save of any
        # other path is not replaced by a newer one (`BackgroundWriter.submit_save`'s `settled`)
        self._saved: set[str] = set()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy made by unpickling is a live plugin of its process too.

        Why: ``strategy="ddp_spawn"`` pickles the Trainer to start each rank, and rank 0 saves the final weights with
        this plugin after ``teardown`` (Lightning's ``.temp.ckpt``, loaded by the main process once the ranks exit).
        An unpickled copy was missing from the plugins whose queued saves are finished at exit
        (:func:`_finish_saves_at_exit`), so with ``async_save`` that save died with the writer thread and the main
        process found no file.
        """
        self.__dict__.update(state)
        _LIVE.add(self)

    # -- the lever protocol (lightning_accel._utils.levers.Lever) --------------------------------------------------
    lever_name = "quantized_checkpoint"

    @property
    def lever_active(self) -> bool:
        """Whether saves store quantized (lossy) deltas."""
        return self.store.options.quantize is not None

    def switch_off(self, reason: str) -> bool:
        """Store lossless deltas from the next save on (saves already queued keep the options they started with).
        Returns whether quantization was on."""
        if self.store.options.quantize is None:
            return False
        # `quantize_groups` back to its default too: without `quantize` it selects nothing (and would warn so)
        self.store.options = dataclasses.replace(self.store.options, quantize=None, quantize_groups="optimizer")
        self.switched_off_reason = reason
        return True

    def _save_now(self, checkpoint: dict[str, Any], path: str) -> SaveStats:
        stats = self.store.save(checkpoint, path)
        self.history.append(stats)
        return stats

    @property
    def resolves_deferred(self) -> bool:
        """With ``async_save``: a checkpoint value still being produced (a
        :class:`~lightning_accel._utils.deferred.Deferred`, e.g. ``ddp_1bit``'s gather of every rank's error state)
        is kept as it is by the snapshot and resolved on the writer thread before encoding, so the training thread
        does not wait for it."""
        return self.async_save

    def _save_snapshot(self, snap: Snapshot, path: str) -> SaveStats:
        # the values still being produced at the snapshot (collectives in flight) are waited for here, off the
        # training thread; they are fresh tensors of this save alone, so they need no snapshot copy
        try:
            tree = _resolve_within(snap.tree, path, self.deferred_timeout_s)
            stats = self.store.save(
                tree, path, content_id=snap.content_id, pause=self._writer.yield_to_snapshots, aliases=snap.aliases
            )
        except BaseException:
            directory = split_path(path)[0]
            # made by this plugin on the training thread (`_make_directory`), or an object store's prefix
            self._after_failed_save(path, made=directory in self._created_dirs or not is_local_url(directory))
            raise
        finally:
            self._release_if_detached(running=1)
        self.history.append(stats)
        self._saved.add(path)
        return stats

    def _remove_now(self, path: str, *, running: int = 0) -> None:
        self._saved.discard(path)
        try:
            # Lightning's `ddp_spawn` hand-over file has been read by the one process that reads it, which removes it
            # now: its blobs go at once, since no later collection ever comes back to its folder
            last_grace = 0.0 if compat.is_launcher_weights_file(path) else None
            self.store.remove(path, drop_emptied=True, last_grace_s=last_grace)
            self._drop_made_directory(split_path(path)[0])
        finally:
            self._release_if_detached(running=running)

    def _after_failed_save(self, path: str, *, made: bool) -> None:
        """A save failed (a full disk, a store outage): when its folder holds no file, the blob store the save made
        there (its lock file, empty blob folders) goes again, and with it the folder when the save made it (``made``)
        (:meth:`~lightning_accel.checkpoint.store.DeltaStore.remove_if_emptied`: a folder with anything else in it,
        a blob waiting out its grace period included, is left as it is).

        Why: under a full disk every failed save of a ``filename`` with a ``/`` left a folder of its own behind. A
        folder that existed before the save (made by the user, empty) is theirs: it stays.
        """
        directory = split_path(path)[0]
        # the save's own error is what the caller must see: a folder that cannot be checked or removed stays
        with contextlib.suppress(Exception):
            if self.store.fs.isdir(directory) and not self.store.fs.list_files(directory):
                self.store.remove_if_emptied(directory, keep_directory=not made)
        self._drop_made_directory(directory)

    def _drop_made_directory(self, directory: str) -> None:
        """After a removal in ``directory``: remove the folders :meth:`_make_directory` made for it (up to the one that
        existed) that are empty now, deepest first; the first one holding anything stops it.

        Why: a removal that cancels a queued save (``save_top_k`` rotating a checkpoint out before its save started)
        left the empty folder made for it on the training thread, one per cancelled save with a ``filename`` holding a
        ``/``. A folder that existed before, or holds a file or folder of anyone's, is never removed.
        """
        if directory not in self._made_dirs:
            return  # not made on the training thread (no async save went there, or not a local directory)
        stop = self._created_dirs.get(directory)
        d = directory
        while stop is not None and d != stop and d.startswith(stop.rstrip(os.sep) + os.sep):
            try:
                os.rmdir(d)  # only an empty folder
            except FileNotFoundError:
                pass  # the store removed it (its blob store was all that was left there)
            except OSError:
                break
            d = os.path.dirname(d)
        if not os.path.lexists(directory):
            # an async save into it makes it again before returning (and records it again)
            self._created_dirs.pop(directory, None)
            self._made_dirs.discard(directory)

    def _release_if_detached(self, *, running: int = 0) -> None:
        """After a write outside a stage (after ``teardown``): release the writer locks and forget the chain state once
        no other write is queued (``running``: the writer's job calling this, still counted as pending).

        Why: the lock was taken again by a post-fit ``trainer.save_checkpoint`` and held until the process exited, so
        a resume or ``ckpt gc`` from another process was refused while this one lived on. The chain state goes with
        the lock: once another writer may collect the directory, a later delta must not rely on blobs it kept alive.
        """
        with self._stage_lock:
            if self._attached or self._writer.pending > running:
                return
            self.store.close()
            self.store.forget()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathType, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path`` (a manifest); in async mode only the CPU snapshot happens here.

        Raises:
            CheckpointSaveError: an earlier async save failed (``on_save_error="raise"``), naming the first failure.
            ValueError: ``path`` is empty or ends with a separator (it names no file), before anything is written.
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by `DeltaCheckpointIO`: pass "
                "`DeltaCheckpointIO(storage_options=...)` instead, so saves, loads and removals use the same options."
            )
        path_s = os.fspath(path)
        check_file_path(path_s)  # on the caller's thread, before anything is queued or written
        if self.async_save:
            self._warn_unrouted(path_s)
            key = split_path(path_s)[1]  # one key per file however it is spelt: coalescing and `exists` compare it
            self._make_directory(key)
            # The snapshot copies every tensor into a buffer of its own and notes which of them shared a storage (tied
            # weights, ModelCheckpoint's score tensor under several keys) as it copies them: the writer records that
            # (`Snapshot.aliases`), so the load shares them again as a synchronous save's does.
            self._writer.submit_save(self._save_snapshot, checkpoint, key, settled=self._saved.__contains__)
        else:
            self._warn_unrouted(path_s)
            self._writer.wait()
            directory = split_path(path_s)[0]
            made = not is_local_url(directory) or not os.path.lexists(directory)  # the save makes its folder
            try:
                self._save_now(checkpoint, path_s)
            except OSError as e:
                self._after_failed_save(path_s, made=made)
                if type(e).__module__ != "builtins":
                    raise  # the package's own errors name their file and fix already
                raise _named_save_error(path_s, e) from e
            except BaseException:
                self._after_failed_save(path_s, made=made)
                raise
            finally:
                self._release_if_detached()

    def _warn_unrouted(self, path: str) -> None:
        """Warn once when a write under more than one process is not requested through ``DeltaModelCheckpoint`` or
        ``CheckpointGuard``: an async save whose failures are not held for every rank to raise, or a synchronous save
        or removal outside :meth:`failures_raised_on_every_rank` (a plain ``ModelCheckpoint`` without the guard).

        Why: only global rank zero writes (so only it warns); a failed write raised there alone (by the save itself,
        or by the next save with ``async_save``) left the other ranks waiting in the barrier that follows every save
        (gloo: "Connection closed by peer", NCCL: the process-group timeout). The plugin sees only rank zero's side,
        so it cannot tell the others; the callbacks raise the failure on every rank together. No collective: a plugin
        has no hook that runs on every rank, so the routing itself is the callbacks'.
        """
        if self.async_save:
            routed = self.on_save_error != "raise" or self._writer.holding_errors
        else:
            routed = self._routed_depth > 0
        if (
            self._warned_unrouted
            or routed
            or not distributed_ready()
            or world_size() < 2
            or compat.is_launcher_weights_file(path)  # `ddp_spawn`'s hand-over file: rank zero alone, after the fit
        ):
            return
        self._warned_unrouted = True
        fix = (
            "Use `DeltaModelCheckpoint` instead of `ModelCheckpoint`, or add `CheckpointGuard()` to the callbacks (the "
            "`lightning-accel` CLI does)."
        )
        if self.async_save:
            message = (
                f"`DeltaCheckpointIO(async_save=True)` under {world_size()} processes saves {path!r} from a "
                "checkpoint callback that is not a `DeltaModelCheckpoint` (a plain `ModelCheckpoint`, or "
                "`trainer.save_checkpoint` during a stage): a failed background save will be raised on global rank 0 "
                f"alone, and the other ranks wait in their next collective until the process group times out. {fix}"
            )
        else:
            message = (
                f"`DeltaCheckpointIO()` under {world_size()} processes writes {path!r} outside `DeltaModelCheckpoint` "
                "and `CheckpointGuard` (a plain `ModelCheckpoint` or `trainer.save_checkpoint` without either "
                "callback, or a `weights_only=True` save after the fit): a failed save or removal will be raised on "
                "global rank 0 alone, and the other ranks wait in the barrier that follows it until the process group "
                f"times out. {fix}"
            )
        warnings.warn(
            message,
            UserWarning,
            stacklevel=3,
        )

    @contextlib.contextmanager
    def failures_raised_on_every_rank(self) -> Iterator[None]:
        """A block whose synchronous saves and removals the caller raises on every rank together when they fail on
        global rank zero (``DeltaModelCheckpoint`` and ``CheckpointGuard`` under DDP): they are not warned about as
        unrouted writes (:meth:`_warn_unrouted`). Nothing else changes; a failure is still raised to the caller."""
        self._routed_depth += 1
        try:
            yield
        finally:
            self._routed_depth -= 1

    def _make_directory(self, path: str) -> None:
        """Async mode: make the local directory of ``path`` (as :func:`split_path` names it) on the training thread,
        before the save returns.

        Why: Lightning acts on the file system right after ``save_checkpoint`` returns: ``save_last="link"`` calls
        ``os.symlink`` into the directory, which fails with ``FileNotFoundError`` while the first save of a fresh
        ``dirpath`` is still queued (and its fallback, ``shutil.copy`` of the target, fails too). A directory that
        cannot be made, or one where a queued save will put a file, is left to the save, which reports it as before
        (:class:`CheckpointSaveError`): the queued save of that file comes first.
        """
        directory = split_path(path)[0]
        if directory in self._made_dirs or not is_local_url(directory):
            return
        missing = directory
        while not os.path.lexists(missing):
            if self._writer.queued_outcome(missing):
                return
            parent = os.path.dirname(missing)
            if parent == missing:
                break
            missing = parent
        with contextlib.suppress(OSError):
            prepare_directory(directory)
            self._made_dirs.add(directory)
            if missing != directory:
                self._created_dirs[directory] = missing

    @override
    def load_checkpoint(
        self, path: PathType, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the checkpoint at ``path`` (after any queued saves finished).

        A plain ``torch.save`` checkpoint (e.g. from ``TorchCheckpointIO``) is also accepted and read with
        ``torch.load(weights_only=True)``, so a run can switch to this plugin and resume from an older checkpoint
        (both through :func:`~lightning_accel.checkpoint.read_checkpoint`). ``weights_only=False`` is refused: this
        plugin never unpickles arbitrary objects.

        The plain ``torch.save`` checkpoints that the checkpoint's ``ModelCheckpoint`` states track in their own
        ``dirpath`` are adopted (:meth:`DeltaStore.adopt`): the resumed run may rotate them out and replace
        ``last.ckpt`` as it would with ``TorchCheckpointIO``. Any other file that is not this plugin's stays refused.
        """
        if weights_only is False:
            raise ValueError(
                "`weights_only=False` is not supported by `DeltaCheckpointIO`: its checkpoints never contain "
                "arbitrary pickled objects. Load without `weights_only`, or use `TorchCheckpointIO` for trusted files."
            )
        self._writer.wait()
        checkpoint = read_checkpoint_with(self.store, path, map_location=map_location or "cpu")
        self.store.adopt(_tracked_checkpoints(checkpoint))
        return checkpoint

    @override
    def remove_checkpoint(self, path: PathType) -> None:
        """Remove the manifest at ``path`` and the blobs nothing else references (queued in async mode, where it
        cancels a queued, not yet started save of ``path``; skipped after a failed save).

        Raises:
            CheckpointSaveError: an earlier async save failed (``on_save_error="raise"``), naming the first failure.
            OSError: a synchronous removal failed (a file this process may not delete), of the cause's type, one line
                naming the checkpoint, which is still there, and the fix. Under DDP, ``DeltaModelCheckpoint`` and
                ``CheckpointGuard`` raise it on every rank together.
        """
        if self.async_save:
            key = split_path(path)[1]
            self._writer.submit(functools.partial(self._remove_now, running=1), key, key=key)
        else:
            path_s = os.fspath(path)
            self._warn_unrouted(path_s)
            self._writer.wait()
            try:
                self._remove_now(path_s)
            except OSError as e:
                if type(e).__module__ != "builtins":
                    raise  # the package's own errors name their file and fix already
                raise _named_removal_error(path_s, e) from e

    def claim(self, directory: PathType) -> None:
        """Take ``directory``'s writer lock now (a second writer is refused before training, not at its first save) and
        hold the locks of the directories written from here on until :meth:`teardown`, as during a stage.

        Raises:
            CheckpointDirectoryLockedError: another live run writes there.
        """
        with self._stage_lock:
            self._attached = True
            self.store.claim(os.fspath(directory))

    def attach(self) -> None:
        """A stage starts: from here on, a directory's writer lock (and the chain state that makes saves deltas) is
        held from its first write until :meth:`teardown`, as for a new plugin. ``DeltaModelCheckpoint`` and
        ``CheckpointGuard`` call it in their ``setup``; without them a plugin torn down by an earlier stage of the same
        Trainer (``validate``, the ``Tuner``) holds the lock only while each save is written, and each save is then a
        full snapshot."""
        with self._stage_lock:
            self._attached = True

    def exists(self, path: PathType) -> bool | None:
        """Whether a checkpoint will be at ``path`` once the queued async saves and removals ran: True when the newest
        queued or running job of ``path`` saves it, False when it removes it, None when none is queued (ask the file
        system). ``DeltaModelCheckpoint.file_exists`` asks this first: a checkpoint still queued is not on disk yet,
        and Lightning's version counter (``epoch=0-v1.ckpt``) would otherwise give the next save the same name."""
        return self._writer.queued_outcome(split_path(path)[1]) if self.async_save else None

    def wait(self) -> None:
        """Block until queued saves and removals are done; raise the first background error."""
        self._writer.wait()

    def take_save_error(self) -> CheckpointSaveError | None:
        """The first failed async save or removal not raised yet (``on_save_error="raise"``), now counted as raised
        (no later call raises it); None when there is none."""
        return self._writer.take_error()

    def save_errors_held(self) -> contextlib.AbstractContextManager[None]:
        """A block within which saves, removals and loads do not raise an earlier async failure; it stays for the
        first call after the block, or for :meth:`take_save_error`. A save or removal requested while a failure is
        held is dropped, as those queued behind the failure were.

        ``DeltaModelCheckpoint`` holds them around each save and removal under data parallelism, and takes a
        failure before the next save on every rank at once (only global rank zero writes: a failure raised there
        alone left the other ranks waiting in the collective that follows a save)."""
        return self._writer.errors_held()

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options every save, load and removal uses (share them with ``ModelCheckpoint`` through
        :class:`~lightning_accel.checkpoint.callbacks.DeltaModelCheckpoint`)."""
        return self.store.fs.storage_options

    @property
    def writer_stats(self) -> WriterStats:
        """Async saves so far: submitted, coalesced, cancelled, stalls (waits for a slot) and their seconds, peak
        pending, snapshot seconds and buffers, failures."""
        return self._writer.stats

    @override
    def teardown(self) -> None:
        """Wait for the saves in flight (at most ``max_pending + 1``) and queued removals, then free the snapshot
        buffers and the chain bases (a later save starts its chains anew) and release the directory's writer lock;
        raise a background failure not reported yet rather than lose it (one already raised is not raised again).
        Writes after this hold the lock only while they are written (see the class docstring)."""
        with self._stage_lock:
            self._attached = False
        try:
            self._writer.close()
        finally:
            self.store.close()
            self.store.forget()
            trim_heap()  # the chain bases and snapshot buffers just freed go back to the OS


def _named_save_error(path: str, cause: OSError) -> OSError:
    """``cause`` (a built-in ``OSError``) of a synchronous save of ``path``, as one line naming the checkpoint (and
    the fix where one is known), of ``cause``'s type and ``errno``.

    Why: a write that fails (a full disk) raises ``OSError`` without a file name (``[Errno 28] No space left on
    device``), which did not say which checkpoint failed, nor that the earlier ones are intact.
    """
    line = one_line(f"Checkpoint save of {path!r} failed: {type(cause).__name__}: {one_line(cause, first=True)}.")
    line += failure_hint(cause)
    err = type(cause)(line)  # one argument: the built-in types keep it as their message
    err.errno = cause.errno  # the message stays `line`: `OSError.__str__` needs a `strerror` too to show it
    return err


def _named_removal_error(path: str, cause: OSError) -> OSError:
    """``cause`` (a built-in ``OSError``) of a synchronous removal of ``path``, as one line naming the checkpoint, that
    it is still there, and the fix, of ``cause``'s type and ``errno``.

    Why: a file that cannot be deleted (``PermissionError``) raised without saying which checkpoint, nor that nothing
    was lost: the checkpoint stays, complete, and a later ``lightning-accel ckpt gc`` or removal collects it.
    """
    line = one_line(
        f"Checkpoint removal of {path!r} failed: {type(cause).__name__}: {one_line(cause, first=True)}. The checkpoint "
        "is still there and loads; make its directory writable by this process (or delete it by hand), then resume."
    )
    err = type(cause)(line)
    err.errno = cause.errno
    return err


def _warn_async_only(**given: Any) -> None:
    """Warn about the arguments that only ``async_save=True`` uses, given other values than their defaults.

    Why: they were silently ignored without it; ``on_save_error="warn"`` most of all, where a failed save still
    raised and stopped the run. The defaults pass quietly (LightningCLI passes every argument).
    """
    defaults = inspect.signature(DeltaCheckpointIO.__init__).parameters
    changed = [f"`{name}={value!r}`" for name, value in given.items() if value != defaults[name].default]
    if changed:
        warnings.warn(
            f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect without `async_save=True`: "
            "each save is written, and a failure raised, in its `save_checkpoint` call. Pass `async_save=True`, or "
            "leave the argument out.",
            UserWarning,
            stacklevel=3,
        )


def _holds_deferred(obj: Any) -> bool:
    if isinstance(obj, Deferred):
        return True
    if isinstance(obj, dict):
        return any(_holds_deferred(v) for v in obj.values())
    if type(obj) in (list, tuple):
        return any(_holds_deferred(v) for v in obj)
    return False


def _resolve_within(tree: Any, path: str, timeout_s: float) -> Any:
    """:func:`~lightning_accel._utils.deferred.resolve_deferred` of ``tree``, waiting at most ``timeout_s`` seconds.

    Why: the value is a collective in flight; a rank that died before joining it never completes it, and a writer
    waiting without a bound left ``teardown`` (and every later save) waiting forever. The wait cannot be interrupted,
    so it runs on a daemon thread of its own that is left behind when the bound passes (the collective's own error
    or the process group's end releases it); the save fails with ``TimeoutError`` naming ``path``.

    Raises:
        TimeoutError: a value was not ready within ``timeout_s``.
    """
    if not _holds_deferred(tree):
        return tree  # the usual save: no thread
    result: list[Any] = []
    error: list[BaseException] = []

    def resolve() -> None:
        try:
            result.append(resolve_deferred(tree))
        except BaseException as e:  # noqa: BLE001 - raised again on the writer's thread below
            error.append(e)

    waiter = threading.Thread(target=resolve, name="lightning-accel-checkpoint-deferred", daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if waiter.is_alive():
        raise TimeoutError(
            f"Checkpoint {path!r}: a value still being produced for it (a collective in flight, e.g. `ddp_1bit`'s "
            f"gather of every rank's error state) was not ready after {timeout_s:g} s (`deferred_timeout_s`): a rank "
            "may have died or stopped before saving. This save failed and the previous checkpoint is kept; check the "
            "other ranks, or raise `DeltaCheckpointIO(deferred_timeout_s=...)` if the gather is that slow."
        )
    if error:
        raise error[0]
    return result[0]


def _tracked_checkpoints(checkpoint: dict[str, Any]) -> list[str]:
    """The checkpoint paths that ``checkpoint``'s ``ModelCheckpoint`` states track inside their own ``dirpath``:
    those Lightning may replace or remove after restoring one of them."""
    callbacks = checkpoint.get("callbacks")
    out = []
    for state in compat.model_checkpoint_states(callbacks if isinstance(callbacks, dict) else {}):
        dirpath = state.get("dirpath")
        if not isinstance(dirpath, str) or not dirpath:
            continue
        home = store_dir(dirpath)
        out += [t for t in compat.model_checkpoint_tracked(state) if split_path(t)[0] == home]
    return out
