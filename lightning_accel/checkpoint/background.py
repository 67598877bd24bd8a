"""Background saving: snapshot on the caller's thread into reused buffers, encode and write on one worker thread,
bounded, latest wins, and the first failure stops the caller.

Contract:

1. **Snapshots into reused buffers.** :class:`SnapshotPool` copies every tensor of a checkpoint into private CPU
   buffers *synchronously*, so optimizer steps that run while the save is in flight cannot race it. A buffer is kept
   per tensor (by its position in the checkpoint) and reused by the next snapshot once no save in flight holds it,
   so a warm run allocates nothing per save (:attr:`WriterStats.buffers_allocated` stops growing). A large CPU tensor
   (64 KB or more) that is the one copied into the newest snapshot of the same position, at the same in-place
   version, and whose bytes still equal it, is not copied at all: the snapshot shares that buffer and its *content
   id*, so the store knows it unchanged without hashing it (``last.ckpt`` right after ``step=N.ckpt``). Small CPU
   tensors are copied by one ``torch._foreach_copy_`` after the traversal without being compared (cheaper than the
   comparison; the store compares them on the writer's thread), large ones by one memcpy each. Accelerator tensors
   are copied into pinned buffers (asynchronous device-to-host copies, one synchronisation per snapshot).
2. :class:`BackgroundWriter` runs jobs (saves *and* removals) on a single worker thread in submission order, so a
   ``remove`` that ModelCheckpoint issues after a ``save`` can never overtake it. The worker runs at the caller's
   CPU priority: a lowered priority lets the data loader and the training threads starve it, and a starved writer
   makes every later save wait. It starts a job ``start_delay_s`` after the job was submitted at the earliest: the
   training thread has not left the save when the snapshot is queued (Lightning's barrier after the save, the
   ``last.ckpt`` save right after a top-k one), and an encode started at once takes the cores that thread and the
   other ranks need to get there (measured on 2 CPU processes: 7.6 ms of stall per save with an immediate start,
   3.5 ms with the start 50 ms later; ``docs/checkpoint.md``).
3. **Backpressure, latest wins.** At most ``max_pending`` saves are queued or running at once; a save takes its
   slot *before* its snapshot, so at most ``max_pending`` snapshots exist. A save of a path whose previous save is
   still queued (not started) replaces that save's snapshot instead of queueing (the older state would only have
   been overwritten; counted in ``coalesced``), unless it is the only pending write of a path that holds no
   complete checkpoint yet (the newer save may fail, and the path would be left with none). A removal of a path
   whose save is still queued cancels that save (Lightning no longer references the path, so nothing is left
   pointing at a missing file; ``cancelled``). Only a save of a new path with every slot taken waits, and only until
   a slot frees (``stalls``, ``stall_s``).
   Removals hold no tensors and are not bounded, but stay ordered.
4. **Failures at once.** A failed job is reported by the next :meth:`BackgroundWriter.submit`,
   :meth:`~BackgroundWriter.submit_save`, :meth:`~BackgroundWriter.wait` or :meth:`~BackgroundWriter.close` as one
   :class:`CheckpointSaveError` line naming the *first* failure (its path and error); with ``on_error="raise"``
   every job queued behind it is dropped (no removal runs after a save that failed), with ``on_error="warn"`` each
   failure is warned once and later saves go on, but a removal queued after a failed save (with no successful save
   in between) is skipped, so the older checkpoint a failed save would have replaced stays on disk.

Memory: at most ``max_pending`` snapshot buffers per tensor (a tensor unchanged between snapshots shares one), released
by :meth:`BackgroundWriter.close`. The store adds its chain bases; ``docs/checkpoint.md`` states the whole bound and
``tests/checkpoint/test_async_memory.py`` measures it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import logging
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_accel._utils.checks import check_choice, check_int, check_number
from lightning_accel._utils.compat import copy_tensors, set_state_dict_metadata, state_dict_metadata, tensor_version
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.forksafe import PerProcess
from lightning_accel.checkpoint.codec import _NUMPY_FROM, buffer_strides, copy_into, same_bytes

__all__ = [
    "BackgroundWriter",
    "CheckpointSaveError",
    "Snapshot",
    "SnapshotPool",
    "WriterStats",
    "snapshot",
    "trim_heap",
]

log = logging.getLogger("lightning_accel.checkpoint")

#: content ids of snapshot buffers: never reused, so an id names one content for the life of the process
_content_ids = itertools.count(1)


class CheckpointSaveError(RuntimeError):
    """A background checkpoint save (or removal) failed; the message names the first failure, ``__cause__`` is it.

    The error raised is also an instance of the failure's own type where that type allows it (an ``OSError`` for a
    full disk, ``NotADeltaCheckpointError`` for a bad path), so ``except OSError`` around a fit keeps working.
    """


_SAVE_ERRORS: dict[type[BaseException], type[CheckpointSaveError]] = {}


def _save_error(line: str, cause: BaseException) -> CheckpointSaveError:
    """A :class:`CheckpointSaveError` carrying ``line`` that is also of ``cause``'s type when possible."""
    cls = type(cause)
    err: CheckpointSaveError | None = None
    if isinstance(cause, Exception) and not isinstance(cause, CheckpointSaveError):
        try:
            sub = _SAVE_ERRORS.get(cls) or type("CheckpointSaveError", (CheckpointSaveError, cls), {})
            err = sub(line)
            if str(err) != line:
                err = None
            else:
                _SAVE_ERRORS[cls] = sub
        except TypeError:  # an incompatible layout or constructor
            err = None
    err = err if err is not None else CheckpointSaveError(line)
    if isinstance(cause, OSError) and isinstance(err, OSError):
        err.errno = cause.errno  # `except OSError as e: e.errno == ENOSPC` keeps working (the message stays `line`)
    err.__cause__ = cause
    return err


def failure_hint(cause: BaseException) -> str:
    """The fix for a save that failed with ``cause``, as a sentence to end its one-line message with ("" when no
    fix is known)."""
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            " Free space on the device that holds the checkpoint directory (or keep fewer checkpoints: a lower "
            "`save_top_k`); the checkpoints saved before this one are intact."
        )
    return ""


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are fresh private CPU copies (containers rebuilt, other leaves shared)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = snapshot(v)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``): large buffers freed by worker threads otherwise
    stay in their malloc arenas and keep counting as the process's RSS. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class WriterStats:
    """What the writer did so far (this process).

    Attributes:
        submitted: saves submitted.
        coalesced: saves that replaced a queued save of the same path instead of queueing.
        cancelled: queued saves dropped because a removal of their path followed before they started.
        overtaken: saves admitted past ``max_pending`` while an older save still waited unstarted (latest wins: the
            removal that usually follows cancels the older one; otherwise the next call waits for a slot).
        stalls: saves that had to wait for a slot.
        stall_s: seconds callers waited for a slot in total.
        pending_peak: most saves queued or running at once.
        snapshot_s: seconds callers spent snapshotting (copying tensors into the buffers).
        tensors_shared: snapshot tensors that shared the previous snapshot's buffer (same bytes: no copy, no hash).
        buffers_allocated: snapshot buffers allocated (a warm run reuses them: this stops growing).
        buffer_bytes: bytes the snapshot buffers hold now.
        failed: jobs that raised.
        skipped: jobs not run because an earlier save failed.
    """

    submitted: int = 0
    coalesced: int = 0
    cancelled: int = 0
    overtaken: int = 0
    stalls: int = 0
    stall_s: float = 0.0
    pending_peak: int = 0
    snapshot_s: float = 0.0
    tensors_shared: int = 0
    buffers_allocated: int = 0
    buffer_bytes: int = 0
    failed: int = 0
    skipped: int = 0


class _Buf:
    __slots__ = ("content_id", "key", "ptr", "refs", "source", "src_layout", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int = -1) -> None:
        self.tensor, self.key = tensor, key
        # A buffer never moves: its address is its name. 0 (no name) when empty or not strided: a sparse tensor has
        # no single data pointer (`data_ptr()` raises), and it stays in the skeleton, so no content id is asked for it.
        self.ptr = tensor.data_ptr() if tensor.numel() and tensor.layout is torch.strided else 0
        self.refs = 0
        self.content_id = next(_content_ids)
        #: (data pointer, version counter) of the tensor last copied in; None: unknown
        self.source: tuple[int, int] | None = None
        #: (device, dtype, shape, strides) of the tensors this buffer was laid out for (None: a private copy)
        self.src_layout: tuple[Any, ...] | None = None


class Snapshot:
    """One checkpoint copied into pool buffers: ``tree`` (the checkpoint with buffer tensors), :meth:`content_id`
    (the id of a buffer tensor's content, for the store's "unchanged?" test) and :meth:`aliases` (which of the
    checkpoint's tensors viewed one storage)."""

    __slots__ = ("_ids", "bufs", "shared", "tree")

    def __init__(self, tree: Any, bufs: list[_Buf], shared: list[list[tuple[int, int, list[int]]]] | None = None):
        self.tree, self.bufs = tree, bufs
        #: the tensors of the checkpoint that viewed one storage (tied weights, one score tensor held under several
        #: keys), per storage: ``(address of the member's buffer, byte offset, strides)`` as the live tensor had them.
        #: The buffers do not share, so the save records this (:meth:`aliases`).
        self.shared = shared or []
        # By data pointer: the store sees detached aliases of the buffers, and a held buffer's address is its own.
        self._ids = {b.ptr: b.content_id for b in bufs if b.ptr}

    @property
    def shares_memory(self) -> bool:
        """Whether two of the checkpoint's tensors viewed one storage."""
        return bool(self.shared)

    def aliases(self, tensors: Mapping[str, torch.Tensor]) -> list[list[list[Any]]]:
        """:func:`~lightning_accel.checkpoint.skeleton.alias_groups` of the live checkpoint, named as ``tensors``
        (what :func:`~lightning_accel.checkpoint.skeleton.split` made of :attr:`tree`) names the buffers: the record
        the store keeps so that a load shares the storages again. Runs on the writer's thread; a member the tree no
        longer holds (a value the save resolved into another tensor) is left out, and so is a group left with one."""
        if not self.shared:
            return []
        wanted = {m[0] for group in self.shared for m in group}
        names: dict[int, str] = {}
        for name, t in tensors.items():
            if t.numel() and t.device.type == "cpu" and t.data_ptr() in wanted:
                names[t.data_ptr()] = name
        groups = [[[names[p], off, strides] for p, off, strides in group if p in names] for group in self.shared]
        return [g for g in groups if len(g) > 1]

    def content_id(self, t: torch.Tensor) -> int | None:
        """The content id of ``t`` if it is (an alias of) one of this snapshot's whole buffers, else None."""
        if not t.numel() or t.device.type != "cpu":
            return None
        return self._ids.get(t.data_ptr())


class _Take:
    """One snapshot in progress: the buffers it holds, the small CPU copies it batches, the tensors seen so far."""

    __slots__ = ("bases", "bufs", "dst", "pending_device", "seen", "shared", "src")

    def __init__(self) -> None:
        self.bufs: list[_Buf] = []
        # the storages seen (on CPU?, address of the storage's first byte) -> the first tensor seen viewing it, with
        # its key; and every later tensor viewing a storage seen before: (storage, key, tensor)
        self.bases: dict[tuple[bool, Any], tuple[int, torch.Tensor]] = {}
        self.shared: list[tuple[tuple[bool, Any], int, torch.Tensor]] = []
        self.seen = 0  # the key of the next tensor: its position in the traversal
        self.dst: list[torch.Tensor] = []  # small CPU copies, done by one `_foreach_copy_` at the end
        self.src: list[torch.Tensor] = []
        self.pending_device = False


class SnapshotPool:
    """Per-tensor CPU buffers, reused across snapshots (see the module docstring, point 1). Thread-safe.

    A tensor's buffer is keyed by the tensor's position in the checkpoint's traversal order (dicts in insertion
    order, lists and tuples in order): Lightning builds the same structure at every save, so position ``k`` is the
    same tensor each time, and the key costs nothing to compute. When the structure changes (optimizer state that
    appears after the first step), positions shift and a buffer whose layout no longer fits goes to the spares,
    where the tensor now at a position of its layout finds it: correct either way, only the first save after the
    change allocates.
    """

    def __init__(self, stats: WriterStats | None = None) -> None:
        self._lock = threading.Lock()
        # Set while no snapshot is being taken: the writer pauses between tensors while one is (see `yield_to`).
        self._idle = threading.Event()
        self._idle.set()
        self._latest: dict[int, _Buf] = {}  # key (traversal position) -> newest snapshot buffer of it
        # released buffers no longer the newest of their key, kept under that key with their layout: the next
        # snapshot of the key while its newest is still held (`last.ckpt` right after `step=N.ckpt`) takes one back
        # without working out a layout or looking up spares (~4 us a tensor, half again a small model's snapshot)
        self._free: dict[int, list[_Buf]] = {}
        self._spare: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # released buffers of no key (layout changed)
        self.stats = stats if stats is not None else WriterStats()

    def take(self, obj: Any) -> Snapshot:
        """Snapshot ``obj`` (a checkpoint dict): containers rebuilt, tensors copied into buffers or shared."""
        t0 = time.perf_counter()
        run = _Take()
        self._idle.clear()
        try:
            with self._lock:
                tree = self._walk(obj, run)
                if run.dst:
                    # One call for the small CPU tensors: the per-tensor cost of a snapshot is Python's, not the
                    # bytes' (~100 tensors of a few KB in a small model's checkpoint)
                    copy_tensors(run.dst, run.src)
            if run.pending_device and torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        except BaseException:
            # No save will hold the buffers taken so far: release them, or they would stay held (never reused, never
            # freed by a later snapshot) for the rest of the run.
            self.release(Snapshot(None, run.bufs))
            raise
        finally:
            self._idle.set()
        self.stats.snapshot_s += time.perf_counter() - t0
        return Snapshot(tree, run.bufs, _shared_groups(run) if run.shared else None)

    def yield_to(self, timeout: float = 1.0) -> None:
        """Called by the writer between tensors: wait (at most ``timeout`` seconds) while the training thread takes a
        snapshot. The snapshot is the only part of an async save on the training thread; a writer encoding beside it
        competes for the cores and the GIL and makes the training loop's stall several times the snapshot's own cost
        (``results.lossless.stall_breakdown_per_event`` in benchmarks/delta_checkpoint.py)."""
        self._idle.wait(timeout)

    def _walk(self, obj: Any, run: _Take) -> Any:
        if isinstance(obj, torch.Tensor):
            b = self._fill(obj.detach() if obj.requires_grad else obj, run)
            run.bufs.append(b)
            return b.tensor
        kind = type(obj)
        if kind is dict:
            return {k: self._walk(v, run) for k, v in obj.items()}
        if isinstance(obj, dict):
            out = kind()
            for k, v in obj.items():
                out[k] = self._walk(v, run)
            meta = state_dict_metadata(obj)
            if meta is not None:  # a state dict's module versions: the store saves them as `torch.save` does
                set_state_dict_metadata(out, meta)
            return out
        if kind is list:
            return [self._walk(v, run) for v in obj]
        if kind is tuple:
            return tuple([self._walk(v, run) for v in obj])
        return obj

    def _fill(self, src: torch.Tensor, run: _Take) -> _Buf:
        # The hot path of a snapshot (~100 calls per save of a small model): a few attribute reads per tensor
        key = run.seen
        run.seen = key + 1
        if src.layout is not torch.strided:  # not a dense buffer (sparse, ...): a private copy, not pooled
            b = _Buf(src.to("cpu", copy=True) if src.device.type != "cpu" else src.clone())
            b.refs += 1
            return b
        cpu = src.is_cpu
        if src.numel():
            # Two tensors view one storage iff their storages start at the same address: two cheap calls per tensor
            # (an `untyped_storage()` object per tensor would cost several times more), on the training thread.
            base = (cpu, src.data_ptr() - src.storage_offset() * src.element_size())
            if base in run.bases:
                run.shared.append((base, key, src))
            else:
                run.bases[base] = (key, src)
        layout = (src.device, src.dtype, src.shape, src.stride())
        old = self._latest.get(key)
        # The buffer fits when it was laid out for a tensor of this very layout (the usual case: no stride
        # arithmetic), or when its own layout is the one this tensor wants
        fits = old is not None and (old.src_layout == layout or _layout_key(old.tensor) == _wanted(src))
        source = (src.data_ptr(), tensor_version(src)) if cpu else None
        # A small CPU tensor joins the one batched copy at the end; a large one is copied by one memcpy
        small = cpu and src.nbytes < _NUMPY_FROM
        # The byte comparison only runs when the source is the same tensor at the same version as the one copied
        # last: a tensor modified in place since (an optimizer step) is copied without comparing first, which halves
        # the snapshot of a trained state. Equal version counters do not prove equal bytes (writes through `.data`
        # do not count, nor do BatchNorm's running statistics, which its kernel writes in place), so those are
        # still compared, but only when large: a small tensor costs less to copy in the batched copy than to compare
        # (~10 us each: half a small ResNet's snapshot when `last.ckpt` follows `step=N.ckpt`), and the store still
        # finds its bytes unchanged by its own comparison, on the writer's thread.
        if old is not None and fits and old.source == source and cpu and not small and same_bytes(old.tensor, src):
            old.refs += 1
            self.stats.tensors_shared += 1
            return old
        if old is not None and fits and old.refs == 0:  # no save holds it: overwrite in place
            b = old
            b.content_id = next(_content_ids)
        else:
            if old is not None and old.refs == 0:
                self._spare.setdefault(_shape_key(old.tensor), []).append(old.tensor)
            b = self._free_buf(key, layout) or _Buf(self._buffer(src, _wanted(src)), key)
            self._latest[key] = b
        b.src_layout = layout
        b.source = source
        if not cpu:
            non_blocking = b.tensor.is_pinned()
            b.tensor.copy_(src, non_blocking=non_blocking)
            run.pending_device |= non_blocking
        elif small:
            run.dst.append(b.tensor)
            run.src.append(src)
        else:
            copy_into(b.tensor, src)
        b.refs += 1
        return b

    def _free_buf(self, key: int, layout: tuple[Any, ...]) -> _Buf | None:
        """A released buffer of position ``key`` laid out for ``layout``, with a new content id; one laid out for
        another layout goes to the spares (the structure changed), where a tensor of its layout finds it."""
        free = self._free.get(key)
        while free:
            b = free.pop()
            if b.src_layout == layout:
                b.content_id = next(_content_ids)
                return b
            self._spare.setdefault(_shape_key(b.tensor), []).append(b.tensor)
        return None

    def _buffer(self, src: torch.Tensor, want: tuple[Any, ...]) -> torch.Tensor:
        pin = src.device.type == "cuda" and torch.cuda.is_available()
        spare = self._spare.get((*want, pin))
        if spare:
            return spare.pop()
        t = torch.empty_strided(want[0], want[2], dtype=src.dtype, pin_memory=pin)
        self.stats.buffers_allocated += 1
        self.stats.buffer_bytes += t.numel() * t.element_size()
        return t

    def release(self, snap: Snapshot) -> None:
        """The save of ``snap`` finished (or was dropped): its buffers may be reused."""
        with self._lock:
            for b in snap.bufs:
                b.refs -= 1
                if b.refs == 0 and self._latest.get(b.key) is not b:  # superseded: free for its key
                    if b.key >= 0 and b.src_layout is not None:
                        self._free.setdefault(b.key, []).append(b)
                    elif b.tensor.layout is torch.strided:  # a private copy: a spare for any same-shape key
                        self._spare.setdefault(_shape_key(b.tensor), []).append(b.tensor)
                    # A sparse copy is dropped: it has no strides to key a spare by (a CSR tensor's `stride()` raises,
                    # which killed the writer thread and left every later wait hanging), and no dense tensor could
                    # reuse it (a COO copy kept as a spare was never taken again: one more held per save).
            snap.bufs, snap.tree = [], None

    def clear(self) -> None:
        """Drop every buffer no save holds (the memory goes back once the last snapshot using it is released)."""
        with self._lock:
            self._latest.clear()
            self._free.clear()
            self._spare.clear()
            self.stats.buffer_bytes = 0


def _shared_groups(run: _Take) -> list[list[tuple[int, int, list[int]]]]:
    """The storages ``run`` saw viewed by two or more tensors: per storage, in the checkpoint's order, each member's
    ``(address of its buffer, byte offset, strides)``, as :func:`~lightning_accel.checkpoint.skeleton.alias_groups`
    describes a member. The members it leaves out are left out (a lazy conjugate or negative view, whose values are
    not the bytes it views; a meta tensor), and so is a storage left with one member."""
    by_storage: dict[tuple[Any, ...], list[tuple[int, torch.Tensor]]] = {}
    for base, key, t in run.shared:
        members = by_storage.get(base)
        if members is None:
            members = by_storage[base] = [run.bases[base]]
        members.append((key, t))
    groups = []
    for members in by_storage.values():
        kept = [
            (run.bufs[key].ptr, int(t.storage_offset()) * t.element_size(), [int(s) for s in t.stride()])
            for key, t in members
            if not (t.is_conj() or t.is_neg() or t.device.type == "meta")
        ]
        if len(kept) > 1:
            groups.append((members[0][0], kept))
    return [kept for _, kept in sorted(groups, key=lambda g: g[0])]


def _layout_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A buffer's shape, dtype and strides."""
    return tuple(t.shape), t.dtype, tuple(t.stride())


def _shape_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A spare buffer's key: its layout and pinning."""
    return (*_layout_key(t), t.is_pinned())


def _wanted(src: torch.Tensor) -> tuple[Any, ...]:
    """The shape, dtype and strides of ``src``'s buffer (:func:`~lightning_accel.checkpoint.codec.buffer_strides`:
    channels_last weights copy as one memcpy, not a reorder), to compare with a buffer's ``_layout_key``."""
    return tuple(src.shape), src.dtype, buffer_strides(src)


class _Job:
    __slots__ = ("args", "bounded", "fn", "future", "key", "not_before", "seq", "snap", "started")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], key: str | None, bounded: bool) -> None:
        self.fn, self.args, self.key, self.bounded = fn, args, key, bounded
        self.future: Future = Future()
        self.started = False
        self.snap: Snapshot | None = None
        self.seq = 0
        self.not_before = 0.0  # time.monotonic() before which the worker does not start it


class _Jobs:
    """One process's queue, worker thread, counters, snapshot buffers and failures."""

    __slots__ = (
        "bounded",
        "cond",
        "error",
        "failed_since_save",
        "held",
        "hurry",
        "overflow",
        "pool",
        "queue",
        "running",
        "stats",
        "thread",
        "unfinished",
        "warnings",
    )

    def __init__(self) -> None:
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.bounded = 0  # saves queued, running, or taking their snapshot
        self.unfinished = 0  # all jobs queued or running
        self.error: CheckpointSaveError | None = None  # the first unreported failure (on_error="raise")
        self.warnings: list[str] = []  # failures not warned yet (on_error="warn")
        self.failed_since_save = False  # the newest finished save failed: removals wait for a good one
        self.overflow = False  # one save was admitted past max_pending: the next call settles it
        self.hurry = 0  # callers blocked in wait(): start queued jobs without their delay
        self.held = 0  # callers inside `errors_held()`: a failure is not raised, and nothing is queued behind it
        self.thread: threading.Thread | None = None
        self.cond = threading.Condition()
        self.stats = WriterStats()
        self.pool = SnapshotPool(self.stats)


class BackgroundWriter:
    """One worker thread that runs submitted jobs in order, at most ``max_pending`` saves at a time, and reports their
    first failure at the next call.

    The thread and its queue are per process (:class:`~lightning_accel._utils.forksafe.PerProcess`): a pickled or
    forked copy starts with none (a forked child would otherwise queue behind a thread it does not have).

    Args:
        name: the worker thread's name.
        max_pending: most saves queued or running at once (>= 1).
        on_error: ``"raise"`` (default): the first failure is raised by the next call and every job queued behind it
            is dropped; ``"warn"``: every failure is warned by the next call and later jobs run (removals queued after
            a failed save are skipped).
        start_delay_s: seconds after its submission before the worker starts a job (see the module notes; 0: at
            once). Only the start moves: a job queued behind others starts when they are done if its delay has
            passed, and :meth:`wait` / :meth:`close` start queued jobs at once.
    """

    def __init__(
        self,
        name: str = "delta-checkpoint",
        *,
        max_pending: int = 2,
        on_error: Literal["raise", "warn"] = "raise",
        start_delay_s: float = 0.0,
    ) -> None:
        check_int(
            "max_pending",
            max_pending,
            low=1,
            fix="It counts saves in flight at once: 1 for the least memory, 2 (the default) to overlap a save with "
            "the next snapshot.",
        )
        self.on_error = check_choice(
            "on_save_error",
            on_error,
            ("raise", "warn"),
            fix="'raise' (default) stops training at the next step; 'warn' keeps training and warns every failure.",
        )
        self.start_delay_s = check_number(
            "write_delay_s", start_delay_s, low=0.0, high=10.0, fix="Use e.g. 0.05, or 0 to start each write at once."
        )
        self._name = name
        self.max_pending = max_pending
        self._jobs: PerProcess[_Jobs] = PerProcess(_Jobs)
        self._seq = itertools.count(1)

    # ---- worker ------------------------------------------------------------------------------------------------
    def _run(self, jobs: _Jobs) -> None:
        while True:
            with jobs.cond:
                while True:
                    if jobs.thread is not threading.current_thread():  # closed (or replaced after a fork)
                        return
                    if jobs.queue:
                        wait_s = jobs.queue[0].not_before - time.monotonic()
                        if wait_s <= 0 or jobs.hurry:
                            break
                        jobs.cond.wait(wait_s)  # woken early by a new job, a cancellation or a caller's wait()
                        continue
                    jobs.cond.wait()
                job = jobs.queue.popleft()
                job.started = True
                jobs.running = job
                skip = not job.bounded and jobs.failed_since_save
            try:
                if skip:
                    line = f"Skipped removing checkpoint {job.key!r}: the save before it failed, so it is kept."
                    with jobs.cond:
                        jobs.stats.skipped += 1
                        jobs.warnings.append(line)
                    log.warning("%s", line)
                    job.future.set_result(None)
                elif job.snap is not None:
                    job.future.set_result(job.fn(job.snap, job.key, *job.args))
                    with jobs.cond:
                        jobs.failed_since_save = False
                else:
                    job.future.set_result(job.fn(*job.args))
                    if job.bounded:
                        with jobs.cond:
                            jobs.failed_since_save = False
            except BaseException as e:  # kept for the caller: reported at the next submit / wait / close
                job.future.set_exception(e)
                self._failed(jobs, job, e, job.key)
            finally:
                job.args = ()
                if job.snap is not None:  # the buffers are free for the next snapshot now
                    jobs.pool.release(job.snap)
                    job.snap = None
                    trim_heap()  # the save's encode temporaries, freed in this thread's malloc arena
                with jobs.cond:
                    jobs.running = None
                    jobs.unfinished -= 1
                    if job.bounded:
                        jobs.bounded -= 1
                    jobs.cond.notify_all()

    def _failed(self, jobs: _Jobs, job: _Job, e: BaseException, path: str | None) -> None:
        what = "save" if job.bounded else "removal"
        line = one_line(f"Async checkpoint {what} of {path!r} failed: {type(e).__name__}: {one_line(e, first=True)}")
        with jobs.cond:
            jobs.stats.failed += 1
            if job.bounded:
                jobs.failed_since_save = True
            if self.on_error == "warn":
                jobs.warnings.append(line)
                log.warning("%s", line)
                return
            dropped = 0
            while jobs.queue:  # nothing queued behind a failure runs: no removal after a failed save
                later = jobs.queue.popleft()
                self._drop(jobs, later)
                dropped += 1
            jobs.stats.skipped += dropped
            if jobs.error is None:
                if dropped:
                    line += f" ({dropped} later checkpoint job(s) were dropped, nothing was removed)"
                hint = failure_hint(e)
                line += f".{hint}" if hint else ""
                jobs.error = _save_error(line, e)
            log.error("%s", line)

    @staticmethod
    def _drop(jobs: _Jobs, job: _Job) -> None:
        """Under ``jobs.cond``: forget a queued job (its snapshot released, its future cancelled)."""
        if job.snap is not None:
            jobs.pool.release(job.snap)
            job.snap = None
        job.args = ()
        job.future.cancel()
        jobs.unfinished -= 1
        if job.bounded:
            jobs.bounded -= 1
        jobs.cond.notify_all()

    def _ensure_thread(self, jobs: _Jobs) -> None:
        if jobs.thread is None or not jobs.thread.is_alive():
            jobs.thread = threading.Thread(target=self._run, args=(jobs,), name=self._name, daemon=True)
            jobs.thread.start()

    def _report(self, jobs: _Jobs) -> None:
        """Raise the first unreported failure (once) or warn every unwarned one; inside :meth:`errors_held` the
        failure is kept for later instead."""
        with jobs.cond:
            err = None
            if not jobs.held:
                err, jobs.error = jobs.error, None
            lines, jobs.warnings = jobs.warnings, []
        for line in lines:
            warnings.warn(line, UserWarning, stacklevel=4)
        if err is not None:
            raise err

    # ---- public ------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._jobs.get().unfinished

    @property
    def stats(self) -> WriterStats:
        """Counters of this process's writer."""
        return self._jobs.get().stats

    @property
    def holding_errors(self) -> bool:
        """Whether a caller of this process is inside :meth:`errors_held` now."""
        return self._jobs.get().held > 0

    def take_error(self) -> CheckpointSaveError | None:
        """The first failure not reported yet (``on_error="raise"``), now counted as reported (no later call raises
        it); None when there is none."""
        jobs = self._jobs.get()
        with jobs.cond:
            err, jobs.error = jobs.error, None
        return err

    @contextlib.contextmanager
    def errors_held(self) -> Iterator[None]:
        """Within this block, calls do not raise an earlier failure (``on_error="raise"``): it stays for the first call
        after the block, or for :meth:`take_error`. A save or removal submitted while a failure is held is dropped
        (counted in ``skipped``), as the jobs queued behind the failure were: nothing runs after a failed save.

        Why: under data parallelism only global rank zero saves, and a failure raised inside a save there left the
        other ranks waiting in the collective that follows the save. The caller takes the failure at a point every
        rank reaches (:meth:`take_error`) and raises it on all of them.
        """
        jobs = self._jobs.get()
        with jobs.cond:
            jobs.held += 1
        try:
            yield
        finally:
            with jobs.cond:
                jobs.held -= 1

    def queued_outcome(self, key: str) -> bool | None:
        """What the jobs not finished yet leave at ``key``: True when its newest queued or running job is a save (the
        file will exist), False when it is a removal (it will not), None when no job of ``key`` is queued or running
        (the file system knows)."""
        jobs = self._jobs.get()
        with jobs.cond:
            outcome: bool | None = None
            for job in ([jobs.running] if jobs.running is not None else []) + list(jobs.queue):
                if job.key == key:
                    outcome = job.bounded
            return outcome

    def submit(self, fn: Callable[..., Any], *args: Any, key: str | None = None, bounded: bool = False) -> Future:
        """Queue ``fn(*args)``; first report any earlier failure.

        Args:
            fn: the job.
            *args: its arguments (dropped as soon as the job ran).
            key: what the job writes or removes (the checkpoint path). An unbounded job (a removal) of ``key``
                cancels a queued, unstarted save of ``key``; a bounded one coalesces with it (replaces its arguments).
            bounded: counts against ``max_pending`` (a save); the call waits for a slot when all are taken.

        Returns:
            The job's future (a coalesced save returns the future of the job it joined).

        Raises:
            CheckpointSaveError: an earlier job failed (``on_error="raise"``): the first failure, once.
        """
        return self._submit(fn, args, key, bounded, None, None)

    def submit_save(
        self,
        fn: Callable[..., Any],
        checkpoint: Any,
        path: str,
        settled: Callable[[str], bool] | None = None,
    ) -> Future:
        """Snapshot ``checkpoint`` into the pool's buffers on this thread and queue ``fn(snapshot, path)`` (a
        :class:`Snapshot`; its buffers are reused once the job ran; which tensors shared a storage is in
        :meth:`Snapshot.aliases`). A queued, unstarted save of ``path`` gets the
        new snapshot instead (latest wins: the older state would only be overwritten); otherwise, with
        every slot taken, the call waits until one frees (a save of another path is never given this state: every
        path holds exactly the state saved there).

        ``settled(path)``: whether ``path`` holds a complete checkpoint now. Given, a queued save that is the only
        pending write of a path without one is not replaced but kept ahead of the new save, so a failure of the newer
        save cannot leave the path without any checkpoint (counted as a new save: it may wait for a slot).

        Raises:
            CheckpointSaveError: an earlier job failed (``on_error="raise"``): the first failure, once.
        """
        return self._submit(fn, (), path, True, checkpoint, settled)

    def _settle_overflow(self, jobs: _Jobs) -> bool:
        """Under ``jobs.cond``: after a save admitted past ``max_pending``, wait until the saves in flight are within
        ``max_pending`` again (the removal that follows a top-k save usually cancels the older one at once).
        Returns whether it waited."""
        waited = False
        while jobs.overflow and jobs.bounded > self.max_pending and jobs.error is None:
            waited = True
            jobs.cond.wait()
        jobs.overflow = False
        return waited

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        key: str | None,
        bounded: bool,
        checkpoint: Any,
        settled: Callable[[str], bool] | None,
    ) -> Future:
        jobs = self._jobs.get()
        self._report(jobs)
        with jobs.cond:
            if jobs.error is not None:  # held (`errors_held`): nothing is queued behind a failure, nothing raised
                jobs.stats.skipped += 1
                dropped: Future = Future()
                dropped.cancel()
                return dropped
            self._ensure_thread(jobs)
            if not bounded:
                self._cancel_queued_save(jobs, key)
                future = self._append(jobs, _Job(fn, args, key, False))
                t0 = time.perf_counter()
                self._account_wait(jobs, self._settle_overflow(jobs), t0)
                return future
            jobs.stats.submitted += 1
            t0 = time.perf_counter()
            waited = self._settle_overflow(jobs)
            while True:
                target = self._coalesce_target(jobs, fn, key, settled)
                if target is not None:  # unstarted: the worker will not start it while we hold the lock
                    if checkpoint is not None:
                        self._refill(jobs, target, checkpoint)
                    target.args = args
                    jobs.stats.coalesced += 1
                    if jobs.stats.coalesced == 1 or jobs.stats.coalesced % 100 == 0:
                        log.info(
                            "Checkpoint saves outrun the writer: %d queued save(s) replaced by a newer save of the "
                            "same path so far (latest wins).",
                            jobs.stats.coalesced,
                        )
                    self._account_wait(jobs, waited, t0)
                    return target.future
                if jobs.bounded < self.max_pending or jobs.error is not None:
                    break
                if self._overtakes(jobs):  # latest wins: do not wait behind a save that may be cancelled next
                    jobs.overflow = True
                    jobs.stats.overtaken += 1
                    if jobs.stats.overtaken == 1 or jobs.stats.overtaken % 100 == 0:
                        log.info(
                            "Checkpoint saves outrun the writer: %d save(s) admitted past max_pending=%d while an "
                            "older one waited unstarted (a removal of the older path cancels it; otherwise the next "
                            "call waits for a slot).",
                            jobs.stats.overtaken,
                            self.max_pending,
                        )
                    break
                waited = True
                jobs.cond.wait()
            self._account_wait(jobs, waited, t0)
            failed = jobs.error is not None
            if not failed:
                jobs.bounded += 1  # the slot is ours before the snapshot exists: at most max_pending (+1 overtaking)
                jobs.stats.pending_peak = max(jobs.stats.pending_peak, jobs.bounded)
        if failed:  # a job failed while this save waited for a slot: report it now, save nothing
            self._report(jobs)
            return self._submit(fn, args, key, bounded, checkpoint, settled)
        job = _Job(fn, args, key, True)
        try:
            if checkpoint is not None:
                job.snap = jobs.pool.take(checkpoint)  # outside the lock: the worker goes on meanwhile
        except BaseException:
            if job.snap is not None:  # no save will hold its buffers
                jobs.pool.release(job.snap)
            with jobs.cond:
                jobs.bounded -= 1
                jobs.cond.notify_all()
            raise
        with jobs.cond:
            jobs.unfinished += 1
            return self._append(jobs, job, counted=True)

    @staticmethod
    def _refill(jobs: _Jobs, target: _Job, checkpoint: Any) -> None:
        """Under ``jobs.cond``: give an unstarted save the snapshot of ``checkpoint`` instead of its own."""
        if target.snap is not None:  # released first: its buffers are refilled in place
            jobs.pool.release(target.snap)
            target.snap = None
        try:
            target.snap = jobs.pool.take(checkpoint)
        except BaseException:
            jobs.queue.remove(target)
            BackgroundWriter._drop(jobs, target)
            raise

    def _append(self, jobs: _Jobs, job: _Job, counted: bool = False) -> Future:
        """Under ``jobs.cond``."""
        job.seq = next(self._seq)
        job.not_before = time.monotonic() + self.start_delay_s
        jobs.queue.append(job)
        if not counted:
            jobs.unfinished += 1
        jobs.cond.notify_all()
        return job.future

    @staticmethod
    def _account_wait(jobs: _Jobs, waited: bool, t0: float) -> None:
        if waited:
            jobs.stats.stalls += 1
            jobs.stats.stall_s += time.perf_counter() - t0

    @staticmethod
    def _last_of(jobs: _Jobs, key: str | None) -> _Job | None:
        if key is None:
            return None
        for job in reversed(jobs.queue):
            if job.key == key:
                return job
        return None

    def _overtakes(self, jobs: _Jobs) -> bool:
        """Under ``jobs.cond``, every slot taken: may one more save be admitted? Once, when an older save waits
        unstarted in the queue (``ModelCheckpoint`` rotating ``save_top_k`` removes the older path right after the
        newer save, which cancels it), and ``max_pending >= 2`` (one writing, one waiting)."""
        if jobs.overflow or self.max_pending < 2:
            return False
        return any(j.bounded and not j.started for j in jobs.queue)

    def _coalesce_target(
        self, jobs: _Jobs, fn: Callable[..., Any], key: str | None, settled: Callable[[str], bool] | None
    ) -> _Job | None:
        """Under ``jobs.cond``: the last queued job of ``key`` if it is an unstarted save of the same function that a
        newer save may replace: an earlier save of ``key`` is queued or running before it, or ``key`` already holds
        a complete checkpoint (``settled(key)``; None: always).

        Why: the replacing save may fail. Replacing the only pending save of a path with nothing complete there yet
        (the first ``last.ckpt`` of a run) left no file at all when the newer save failed, although the older one
        would have been written: ``ckpt_path="last"`` then started afresh. Otherwise a failure leaves the older
        complete file, or the earlier save's, in place.
        """
        job = self._last_of(jobs, key)
        if job is None or not job.bounded or job.started or job.fn != fn:
            return None
        if settled is None or key is None:
            return job
        before: _Job | None = jobs.running if jobs.running is not None and jobs.running.key == key else None
        for queued in jobs.queue:
            if queued is job:
                break
            if queued.key == key:
                before = queued
        if before is not None:
            return job if before.bounded else None  # after a queued removal of `key` nothing is complete there
        return job if settled(key) else None

    def _cancel_queued_save(self, jobs: _Jobs, key: str | None) -> None:
        """Under ``jobs.cond``: a removal of ``key`` drops the unstarted save of ``key`` queued last."""
        job = self._last_of(jobs, key)
        if job is None or not job.bounded or job.started:
            return
        jobs.stats.cancelled += 1
        jobs.queue.remove(job)
        self._drop(jobs, job)

    def yield_to_snapshots(self) -> None:
        """For a job between units of work: wait while this process's training thread takes a snapshot
        (:meth:`SnapshotPool.yield_to`)."""
        self._jobs.get().pool.yield_to()

    def wait(self) -> None:
        """Block until every queued job has finished; report the first failure among them."""
        jobs = self._jobs.get()
        with jobs.cond:
            jobs.hurry += 1
            jobs.cond.notify_all()
            try:
                while jobs.unfinished:
                    jobs.cond.wait()
            finally:
                jobs.hurry -= 1
        self._report(jobs)

    def close(self) -> None:
        """:meth:`wait`, then stop the worker thread and free the snapshot buffers (a later :meth:`submit` starts
        anew)."""
        jobs = self._jobs.get()
        try:
            self.wait()
        finally:
            with jobs.cond:
                thread, jobs.thread = jobs.thread, None
                jobs.cond.notify_all()
            if thread is not None and thread is not threading.current_thread():
                thread.join()
            jobs.pool.clear()
            trim_heap()
