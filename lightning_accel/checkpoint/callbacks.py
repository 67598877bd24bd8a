"""``DeltaModelCheckpoint``: Lightning's ``ModelCheckpoint`` on the same filesystem (and storage options) as the
checkpoint plugin, and ``ckpt_path="last"`` resolved on object stores.

Lightning's ``ModelCheckpoint`` opens its ``dirpath`` with ``get_filesystem(dirpath)`` and no storage options, so with
an S3 endpoint or credentials given only to ``DeltaCheckpointIO(storage_options=...)`` its ``setup`` and its search
for ``last`` checkpoints fail (``NoCredentialsError``); only ``AWS_ENDPOINT_URL`` / ``AWS_ACCESS_KEY_ID`` in the
environment reach it. :class:`DeltaModelCheckpoint` takes ``storage_options`` itself, or, when given none, uses those
of the Trainer's ``DeltaCheckpointIO``: one set of options for saves, loads, removals, listings and existence checks
(its own are refused at ``setup`` when they differ from the plugin's).

``Trainer.fit(ckpt_path="last")`` on an object store finds nothing in Lightning (its search drops the ``s3://`` of
the listed paths and then looks on the local disk), so :func:`resolve_ckpt_path` resolves ``"last"`` for the
Trainer's checkpoint callbacks with :func:`~lightning_accel.checkpoint.reader.resolve_last`; the ``lightning-accel``
CLI calls it for ``--ckpt_path last``.

A killed run leaves checkpoints that the resumed ``ModelCheckpoint`` does not track: its state comes from the
checkpoint it resumes from (``last.ckpt``), so a ``step=N.ckpt`` saved after that ``last.ckpt``, or one whose removal
was still queued, is never removed by Lightning (a later save of the same name becomes ``step=N-v1.ckpt``) and keeps
its blobs alive. :class:`DeltaModelCheckpoint` reconciles its directory when training starts on a resumed run
(``on_train_start``, global rank zero; :meth:`DeltaModelCheckpoint.reconcile`); ``lightning-accel ckpt gc DIR`` does
the same by hand.

:class:`ElasticExit` ends a worker at once when torchrun stops it to restart the group (the ``lightning-accel`` CLI
adds it under torchrun): Lightning's own SIGTERM handler would wait for a collective that a dead peer never joins.
"""

from __future__ import annotations

import os
import posixpath
import re
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.atomic import is_local_url, strip_file_scheme
from lightning_accel._utils.checks import check_bool
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.fs import FileStore
from lightning_accel._utils.patching import Patch, active_patch, patch
from lightning_accel._utils.rank import (
    ErrorDescription,
    describe_error,
    distributed_ready,
    raise_if_any_rank_failed,
    rebuild_error,
    world_size,
)
from lightning_accel.checkpoint.background import _save_error
from lightning_accel.checkpoint.lock import CheckpointDirectoryLockedError
from lightning_accel.checkpoint.plugin import CheckpointSaveError, DeltaCheckpointIO
from lightning_accel.checkpoint.reader import resolve_last
from lightning_accel.checkpoint.store import relative_to, split_path, store_dir

__all__ = [
    "CheckpointGuard",
    "DeltaModelCheckpoint",
    "ElasticExit",
    "resolve_ckpt_path",
    "teardown_wrapped_io",
    "trainer_storage_options",
]


def delta_io(trainer: pl.Trainer) -> DeltaCheckpointIO | None:
    """The Trainer's ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``), or None."""
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncCheckpointIO):
        io = io.checkpoint_io
    return io if isinstance(io, DeltaCheckpointIO) else None


def teardown_wrapped_io(trainer: pl.Trainer) -> None:
    """Tear down a ``DeltaCheckpointIO`` that Lightning's ``AsyncCheckpointIO`` wraps (its writer lock released, its
    chain state and buffers freed), as Lightning tears down an unwrapped one at the end of every stage.

    Why: ``AsyncCheckpointIO.teardown`` joins its own thread but does not call the wrapped IO's ``teardown``, so the
    directory stayed locked until the process exited: ``lightning-accel ckpt gc`` from another shell and a second fit
    on the same ``dirpath`` in the same process (a notebook) were refused as "another writer". Called from the
    ``teardown`` hook of :class:`DeltaModelCheckpoint` and :class:`CheckpointGuard`, which Lightning runs after the
    strategy's (the wrapper's saves are finished by then). A failure of the wrapper's thread held for every rank
    (:func:`hold_save_failures`) and not raised yet (the stage ended otherwise) is raised here rather than lost.
    """
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncCheckpointIO) and isinstance(io.checkpoint_io, DeltaCheckpointIO):
        io.checkpoint_io.teardown()
        error = _held_failures.pop(io.checkpoint_io, None)
        if error is not None:
            raise error  # a failure held for every rank that no save or end of training raised: not lost


def attach_io(trainer: pl.Trainer) -> None:
    """A stage starts: the Trainer's ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``) holds its directories'
    writer locks from their first write until its ``teardown`` again (:meth:`DeltaCheckpointIO.attach`), also after an
    earlier stage of the same Trainer tore it down."""
    io = delta_io(trainer)
    if io is not None:
        io.attach()


#: the key of the patches that route a checkpoint callback's saves and removals through :func:`route_write`
_WRITES_KEY = "lightning_accel-delta-model-checkpoint-writes"


def _held_io(trainer: pl.Trainer) -> DeltaCheckpointIO | None:
    """The Trainer's own ``DeltaCheckpointIO`` when its async failures must reach every rank together: an async one
    that raises them (``on_save_error="raise"``; not inside ``AsyncCheckpointIO``, see :func:`hold_save_failures`)
    under more than one process. The same on every rank (the same configuration), so all take the same collectives."""
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, DeltaCheckpointIO) and io.async_save and io.on_save_error == "raise" and trainer.world_size > 1:
        return io
    return None


#: the key of the patch that holds the failures of a synchronous ``DeltaCheckpointIO`` (also inside Lightning's
#: ``AsyncCheckpointIO``) for every rank to raise
_HELD_SAVES_KEY = "lightning_accel-held-delta-saves"

#: the first save that failed and is not raised yet, per ``DeltaCheckpointIO`` (see :func:`hold_save_failures`)
_held_failures: weakref.WeakKeyDictionary[DeltaCheckpointIO, CheckpointSaveError] = weakref.WeakKeyDictionary()

#: the synchronous plugins inside a routed save (:func:`route_write`): only their failures there are held
_catching: weakref.WeakSet[DeltaCheckpointIO] = weakref.WeakSet()


def _wrapped_io(trainer: pl.Trainer) -> tuple[AsyncCheckpointIO, DeltaCheckpointIO] | None:
    """Lightning's ``AsyncCheckpointIO`` and the ``DeltaCheckpointIO`` it wraps, under more than one process (where
    its failures must reach every rank together), or None. The same on every rank (the same configuration)."""
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncCheckpointIO) and isinstance(io.checkpoint_io, DeltaCheckpointIO) and trainer.world_size > 1:
        return io, io.checkpoint_io
    return None


def _caught_io(trainer: pl.Trainer) -> DeltaCheckpointIO | None:
    """Under more than one process, the synchronous ``DeltaCheckpointIO`` whose save failures
    :func:`hold_save_failures` keeps for every rank to raise: the Trainer's own (``async_save=False``) or the one
    inside Lightning's ``AsyncCheckpointIO``; None otherwise. The same on every rank (the same configuration)."""
    wrapped = _wrapped_io(trainer)
    if wrapped is not None:
        return wrapped[1]
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, DeltaCheckpointIO) and not io.async_save and trainer.world_size > 1:
        return io
    return None


def cover_save_after_stage(trainer: pl.Trainer, write_patches: list[Patch]) -> None:
    """A checkpoint callback's ``on_save_checkpoint`` (every rank, right before a save): a save requested after the
    stage (``trainer.save_checkpoint("final.ckpt")`` after ``fit``, when the callback holds no patches of a stage,
    ``write_patches`` empty) is raised on every rank when it fails on global rank zero
    (:func:`hold_direct_save_failures` with ``once``)."""
    if not write_patches and _routed(trainer):
        hold_direct_save_failures(trainer, once=True)


def _routed(trainer: pl.Trainer) -> bool:
    """Whether a checkpoint callback's saves and removals go through :func:`route_write` (the same on every rank)."""
    return _held_io(trainer) is not None or _caught_io(trainer) is not None


class _WrapperQueue:
    """The saves of one ``DeltaCheckpointIO`` handed to Lightning's ``AsyncCheckpointIO`` and not finished in its
    thread yet, and the removals waiting for them (:func:`_remove_behind_saves`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: saves submitted to the wrapper and not finished in its thread
        self.pending = 0
        self.removals: list[Callable[[], None]] = []


_wrapper_queues: weakref.WeakKeyDictionary[DeltaCheckpointIO, _WrapperQueue] = weakref.WeakKeyDictionary()


def _queue_of(io: DeltaCheckpointIO) -> _WrapperQueue:
    queue = _wrapper_queues.get(io)
    if queue is None:
        queue = _wrapper_queues[io] = _WrapperQueue()
    return queue


def _run_removal(io: DeltaCheckpointIO, write: Callable[[], None]) -> None:
    """One removal of a synchronous ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``): skipped while a failure
    is held (the checkpoint it removes may be the last complete one), its own failure held like a save's."""
    if io in _held_failures:
        return
    try:
        with io.failures_raised_on_every_rank():
            write()
    except Exception as e:  # noqa: BLE001 - raised on every rank together by `raise_save_failure_on_every_rank`
        # the plugin's own message names the checkpoint, that it is still there, and the fix
        _held_failures.setdefault(io, _save_error(one_line(e, first=True), e))


def _remove_behind_saves(io: DeltaCheckpointIO, write: Callable[[], None]) -> None:
    """A removal inside ``AsyncCheckpointIO``: run now when no save is queued in the wrapper's thread, otherwise in
    that thread once the saves queued before it have finished (and not at all when one of them failed).

    Why: the wrapper runs removals on the caller's thread. ``save_top_k`` rotates the older checkpoints out right
    after queueing the newer saves, so with the writer behind, a full disk failed the queued saves after every older
    checkpoint had been removed: the directory was left with none that loads.
    """
    queue = _queue_of(io)
    with queue.lock:
        if queue.pending:
            queue.removals.append(write)
            return
    _run_removal(io, write)


def _save_finished(io: DeltaCheckpointIO) -> None:
    """In the wrapper's thread, after one save (done, failed or dropped): once none is queued, the removals that
    waited for them run there (:func:`_remove_behind_saves`)."""
    queue = _queue_of(io)
    with queue.lock:
        queue.pending = max(0, queue.pending - 1)
        if queue.pending:
            return
        removals, queue.removals = queue.removals, []
    for write in removals:
        _run_removal(io, write)


def hold_save_failures(trainer: pl.Trainer) -> list[Patch]:
    """Under more than one process, keep the save failures of a synchronous ``DeltaCheckpointIO`` (the Trainer's own,
    or one inside Lightning's ``AsyncCheckpointIO``) for :func:`raise_save_failure_on_every_rank`; returns the patches
    to restore at ``teardown`` (none without such a plugin). Installed once per plugin however many callbacks ask.

    Inside ``AsyncCheckpointIO`` every save that fails in the wrapper's thread is kept (the first one, as a
    :class:`CheckpointSaveError` naming its path) and the saves queued behind it are dropped, as
    ``DeltaCheckpointIO(async_save=True)`` drops them; :func:`route_write` raises it at the next save, and the end of
    training at the latest. The wrapper's ``save_checkpoint`` is wrapped too, to count the saves queued in its thread
    that a removal waits for (:func:`_remove_behind_saves`). Unwrapped, only a failure inside a routed save is kept
    (:func:`route_write` raises it on every rank right after the barrier that follows the save);
    ``trainer.save_checkpoint`` raises as before.

    Why: only global rank zero saves. The wrapper raised a failure of its thread from its next ``save_checkpoint``
    (or its ``teardown``), and a synchronous save raised its own inside ``trainer.save_checkpoint``, on rank zero
    alone, before the barrier that follows every save: the other ranks waited there until the process group timed
    out or rank zero's process was gone ("Connection closed by peer").
    """
    inner = _caught_io(trainer)
    if inner is None:
        return []
    wrapper = _wrapped_io(trainer)
    wrapped = wrapper is not None

    def replacement(p: Patch) -> Callable[..., None]:
        def save_checkpoint(checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
            if not wrapped and inner not in _catching:
                p.original(checkpoint, path, storage_options)  # outside a routed save: raised to its caller
                return
            try:
                if inner in _held_failures:
                    return  # queued behind a failure: dropped, so no later save outlives the one that failed
                with inner.failures_raised_on_every_rank():
                    p.original(checkpoint, path, storage_options)
            except Exception as e:  # noqa: BLE001 - raised on every rank together by `route_write`
                where = os.fspath(path)
                message = one_line(e, first=True)
                thread = " The save ran in `AsyncCheckpointIO`'s thread." if wrapped else ""
                if where in message:  # the plugin's own message names the checkpoint (and the fix) already
                    line = one_line(f"{message}{thread}")
                else:
                    line = one_line(f"Checkpoint save of {where!r} failed: {type(e).__name__}: {message}.{thread}")
                _held_failures.setdefault(inner, _save_error(line, e))
            finally:
                if wrapped:
                    _save_finished(inner)

        return save_checkpoint

    patches = [patch(inner, "save_checkpoint", replacement, key=_HELD_SAVES_KEY)]
    if wrapper is not None:
        # a stage starts with none queued: a count left by a stage that ended in an error (its thread's last saves ran
        # after the patches were restored) would hold every later removal back
        _wrapper_queues[inner] = _WrapperQueue()

        def submission(p: Patch) -> Callable[..., None]:
            def save_checkpoint(*args: Any, **kwargs: Any) -> None:
                queue = _queue_of(inner)
                with queue.lock:
                    queue.pending += 1
                try:
                    p.original(*args, **kwargs)
                except BaseException:
                    # not queued (the wrapper refused it before its executor took it): nothing to wait for. Its
                    # thread's own failures are held (the replacement above), so none is raised after queueing.
                    with queue.lock:
                        queue.pending = max(0, queue.pending - 1)
                    raise

            return save_checkpoint

        patches.append(patch(wrapper[0], "save_checkpoint", submission, key=_HELD_SAVES_KEY))
    return patches


#: the key of :func:`hold_direct_save_failures`' patch
_DIRECT_SAVES_KEY = "lightning_accel-direct-delta-saves"


def hold_direct_save_failures(trainer: pl.Trainer, *, once: bool = False) -> list[Patch]:
    """Under more than one process with a synchronous ``DeltaCheckpointIO`` (not inside ``AsyncCheckpointIO``): a
    save that ``trainer.save_checkpoint`` requests outside a checkpoint callback (a user's callback during the fit, a
    ``final.ckpt`` after it) and that fails on global rank zero raises on every rank, right after the save. Returns the
    patch to restore at ``teardown`` (none without such a plugin, or with ``once``).

    Why: ``Trainer.save_checkpoint`` writes on global rank zero and then waits in a barrier on every rank; the failed
    save was raised on rank zero alone, before the barrier, and the other ranks waited there until rank zero's
    process was gone ("Connection closed by peer") or the process group timed out. ``Strategy.save_checkpoint`` runs
    on every rank: it is wrapped so that every rank learns whether rank zero's write failed (one one-integer
    collective per such save; a callback's routed save raises through :func:`route_write` instead and adds none).

    The wrapper is the strategy's own and is restored at ``teardown``: a live patch holds its object, and one kept
    after the stage kept the finished Trainer's strategy and model alive for as long as the process lived. A save
    after the stage is covered by ``once=True`` instead, from the callbacks' ``on_save_checkpoint`` (every rank,
    right before the save): the wrapper then restores itself after that one save. A ``weights_only=True`` save after
    the stage calls no callback hook and is not covered (the plugin warns about it, as about any unrouted write).
    """
    strategy = trainer.strategy
    if _caught_io(trainer) is None or _wrapped_io(trainer) is not None:
        return []
    if active_patch(strategy, _DIRECT_SAVES_KEY) is not None:
        return []  # installed for this stage, or for this one save already

    def replacement(p: Patch) -> Callable[..., None]:
        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
            if once:
                p.restore()  # before the save: a failure below must not leave it (and the strategy) held
            io: Any = strategy.checkpoint_io
            if (
                not isinstance(io, DeltaCheckpointIO)
                or io.async_save
                or io in _catching  # a callback's routed save: `route_write` raises it on every rank
                or not distributed_ready()
                or world_size() < 2
            ):
                p.original(checkpoint, filepath, storage_options=storage_options)
                return
            error: BaseException | None = None
            try:
                with io.failures_raised_on_every_rank():
                    p.original(checkpoint, filepath, storage_options=storage_options)
            except Exception as e:  # noqa: BLE001 - every rank learns of it first; raised again just below
                error = e
            raise_if_any_rank_failed(
                error,
                lambda rank, more: (
                    f"A checkpoint save failed on global rank {rank}{more}, which writes the checkpoints"
                ),
                device=strategy.root_device,
            )
            if error is not None:
                raise error

        return save_checkpoint

    installed = patch(strategy, "save_checkpoint", replacement, key=_DIRECT_SAVES_KEY)
    return [] if once else [installed]


def _take_save_error(trainer: pl.Trainer) -> CheckpointSaveError | None:
    """The failure this rank's plugin holds for every rank to raise (its own async saves', or those
    :func:`hold_save_failures` kept), now counted as raised; None when there is none."""
    io = _held_io(trainer)
    if io is not None:
        return io.take_save_error()
    caught = _caught_io(trainer)
    return _held_failures.pop(caught, None) if caught is not None else None


def raise_save_failure_on_every_rank(trainer: pl.Trainer) -> None:
    """Every rank: raise a save's failure still unreported (on global rank zero, the rank that saves under DDP, or on
    any rank where every rank saves), on every rank at once.

    One collective on every rank (a boolean), a second (rank zero's message) only after a failure. A rank whose own
    save failed raises that failure (a :class:`~lightning_accel.checkpoint.CheckpointSaveError`), every other rank a
    ``CheckpointSaveError`` naming rank zero's failure. Nothing is done (no collective) where :func:`route_write`
    does nothing (a single process, ``on_save_error="warn"``, no ``DeltaCheckpointIO``).

    Raises:
        CheckpointSaveError: a save or an async removal failed.
    """
    if not _routed(trainer):
        return
    error = _take_save_error(trainer)
    if not trainer.strategy.reduce_boolean_decision(error is not None, all=False):
        return
    message = trainer.strategy.broadcast(str(error) if error is not None else None, src=0)
    if error is not None:
        raise error
    if message is None:
        raise CheckpointSaveError("A checkpoint save failed on another rank; its error is raised there.")
    raise CheckpointSaveError(one_line(f"{message} (on global rank 0, which writes the checkpoints)"))


def route_write(kind: str, trainer: pl.Trainer, write: Callable[[], None]) -> None:
    """One save or removal of a ``ModelCheckpoint`` (``compat.wrap_model_checkpoint_writes``, installed at ``setup``
    under more than one process with a ``DeltaCheckpointIO``: async and raising its failures, synchronous, or inside
    Lightning's ``AsyncCheckpointIO``).

    A save, on every rank: an async plugin's (or the wrapper's) failure is raised on every rank at once first
    (:func:`raise_save_failure_on_every_rank`), then the save runs with the failures held until the next save; a
    synchronous plugin's failure is held and raised on every rank right after the save. A removal with an async
    plugin is queued with the failures held (the next save raises them); with a synchronous one (also inside
    ``AsyncCheckpointIO``) it does nothing while a failure is held, and a held failure, or the removal's own
    (a file global rank zero may not delete), is raised on every rank right after it (one small collective). Inside
    ``AsyncCheckpointIO`` a removal requested while saves are queued in the wrapper's thread runs there after them,
    and not at all when one of them fails (:func:`_remove_behind_saves`; its own failure is raised at the next save).

    Why: under DDP a failed save (a full disk) was raised on global rank zero alone (by the next save or removal
    with ``async_save=True`` or inside ``AsyncCheckpointIO``, by the save itself otherwise), before the barrier that
    follows every save: the other ranks waited there until rank zero's process was gone ("Connection closed by
    peer"), or for the whole process-group timeout while it lived on.
    """
    io = _held_io(trainer)
    caught = _caught_io(trainer)
    if io is None and caught is None:
        write()
        return
    if io is not None:
        if kind == "save":
            raise_save_failure_on_every_rank(trainer)
        with io.save_errors_held():
            write()
        return
    assert caught is not None
    if kind == "remove":
        # no removal after a failed save: it may be the last complete checkpoint (only global rank zero holds one);
        # inside `AsyncCheckpointIO` none before the saves queued ahead of it either
        if _wrapped_io(trainer) is not None:
            _remove_behind_saves(caught, write)
        else:
            _run_removal(caught, write)
        # every rank, failed or not: global rank zero alone removes, and a failure raised there alone left the others
        # in their next collective
        raise_save_failure_on_every_rank(trainer)
        return
    if _wrapped_io(trainer) is not None:
        raise_save_failure_on_every_rank(trainer)
        write()
        return
    _catching.add(caught)
    try:
        with caught.failures_raised_on_every_rank():
            write()
    finally:
        _catching.discard(caught)
    raise_save_failure_on_every_rank(trainer)


def finish_saves_on_every_rank(trainer: pl.Trainer) -> None:
    """Every rank, at the end of training: finish the saves still queued and raise a failure among them on every rank
    (:func:`raise_save_failure_on_every_rank`), not by rank zero's ``teardown`` alone. Nothing is done (no
    collective) where no save can still be queued (a synchronous plugin's failures are raised at each save)."""
    io = _held_io(trainer)
    wrapped = _wrapped_io(trainer)
    if io is not None:
        with io.save_errors_held():
            io.wait()
    elif wrapped is not None:
        wrapped[0].teardown()  # joins the wrapper's thread (its failures are held: it has none to raise)
    else:
        return
    raise_save_failure_on_every_rank(trainer)


def trainer_storage_options(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The ``storage_options`` of the Trainer's ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``), or None."""
    io = delta_io(trainer)
    return dict(io.storage_options) if io is not None else None


def _exit_now(signum: int, frame: FrameType | None) -> None:
    os._exit(128 + signum)


class ElasticExit(Callback):
    """Under torchrun, end a training worker at once on SIGTERM (exit status 143) instead of Lightning's handler.

    When a worker dies, torchrun's agents stop the survivors with SIGTERM and restart the whole group. Lightning's
    SIGTERM handler broadcasts a tensor from rank 0 inside the handler; with a dead peer that broadcast never
    completes, so each agent waits its fixed 30 s before SIGKILL (``benchmarks/multinode.py`` measured 30.1 s per
    node and restart; with this callback the survivors are gone in well under a second). Exiting loses only what
    SIGKILL would: a checkpoint being written is never published half-way (``DeltaCheckpointIO`` writes the
    manifest last), so the restarted group resumes from the last complete one.

    It acts only in processes that torchrun started (Lightning's ``TorchElasticEnvironment.detect()``), from
    ``on_train_start`` (Lightning installs its own handler when the fit starts) to the end of the fit; elsewhere it
    does nothing. No collective: every rank installs its own handler. The ``lightning-accel`` CLI adds it by itself
    under torchrun.
    """

    def __init__(self) -> None:
        super().__init__()
        self._previous: Any = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not TorchElasticEnvironment.detect() or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can be set from the main thread only
        self._previous = signal.signal(signal.SIGTERM, _exit_now)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning restores the handlers it replaced before callbacks' teardown; put ours back only if still current
        if self._previous is not None and signal.getsignal(signal.SIGTERM) is _exit_now:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None


class CheckpointGuard(Callback):
    """Refuse, before the first step, a fit whose checkpoints cannot work out: a checkpoint directory another run
    writes, or an optimizer state restored into a different optimizer.

    1. ``on_fit_start``: ``DeltaCheckpointIO`` otherwise takes a directory's writer lock at its first save, so a second
       run on the same directory trained a whole epoch before it was refused. Global rank zero (the rank that saves)
       claims each checkpoint callback's ``dirpath`` (resolved by ``ModelCheckpoint.setup`` by then); the outcome is
       broadcast so every rank raises the same error together (type and message: a locked directory, a ``dirpath``
       that is a file or cannot be written), none left waiting in a collective. Nothing happens without a
       ``DeltaCheckpointIO``.
    2. ``on_train_start`` (after Lightning restored the optimizer state, before the first step): a param group that
       lacks a hyper-parameter of its optimizer's ``defaults`` (AdamW's state restored into SGD has no ``momentum``)
       is a one-line ``ValueError`` instead of a ``KeyError`` deep in the first ``step``. Every rank checks its own
       optimizers, which hold the same state: no collective.
    3. ``teardown``: a ``DeltaCheckpointIO`` inside Lightning's ``AsyncCheckpointIO`` is torn down (its directory's
       writer lock released), which the wrapper does not do (:func:`teardown_wrapped_io`).
    4. With a ``DeltaCheckpointIO`` under more than one process (async and raising its failures, synchronous, or
       inside Lightning's ``AsyncCheckpointIO``: :func:`hold_save_failures`), the saves and removals of every plain
       ``ModelCheckpoint`` (any checkpoint callback that is not a :class:`DeltaModelCheckpoint`, which does this
       itself) are routed as a ``DeltaModelCheckpoint``'s
       (:func:`route_write`, from ``setup`` to ``teardown``), and ``on_train_end`` finishes the queued saves: a failed
       save is raised on every rank together, not on global rank zero alone while the other ranks wait in the
       barrier that follows each save.

    ``setup`` marks the start of a stage for the plugin (:func:`attach_io`).

    The ``lightning-accel`` CLI adds this callback by itself.
    """

    def __init__(self) -> None:
        super().__init__()
        # the plain ModelCheckpoints' saves and removals routed through `route_write` (from `setup` to `teardown`)
        self._write_patches: list[Patch] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        attach_io(trainer)  # every rank: no collective
        if _routed(trainer) and not self._write_patches:
            self._write_patches = hold_direct_save_failures(trainer) + hold_save_failures(trainer)
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and not isinstance(cb, DeltaModelCheckpoint):
                    self._write_patches += compat.wrap_model_checkpoint_writes(cb, route_write, key=_WRITES_KEY)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        cover_save_after_stage(trainer, self._write_patches)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        io = delta_io(trainer)
        dirs = [str(d) for cb in trainer.checkpoint_callbacks if (d := getattr(cb, "dirpath", None))]
        if io is None or not dirs:
            return
        error: BaseException | None = None
        refusal: ErrorDescription | None = None
        if trainer.is_global_zero:
            try:
                for d in dirs:
                    io.claim(d)
            except Exception as e:  # noqa: BLE001 - whatever it is, every rank must learn of it before it raises
                error, refusal = e, describe_error(e)
        # Plain strings and numbers only: an exception object (or its class) may not unpickle on the other ranks.
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if error is not None:
            raise error
        if refusal is not None:
            raise _rebuild_error(refusal, dirs[0])

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is None:
            return
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                missing = sorted(set(opt.defaults) - set(group))
                if missing:
                    extra = sorted(set(group) - set(opt.defaults) - {"params", "initial_lr"})
                    raise ValueError(
                        f"`ckpt_path` {trainer.ckpt_path!r} holds another optimizer's state than the configured "
                        f"{type(opt).__name__} (its param groups lack {missing}, have {extra[:2]}...). Resume with "
                        "the optimizer it was saved with, or start without `--ckpt_path` and load only the weights."
                    )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank, with plain ``ModelCheckpoint`` saves routed: finish the queued saves and raise a failure among
        them on every rank (:func:`finish_saves_on_every_rank`)."""
        if self._write_patches:
            finish_saves_on_every_rank(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Restore the plain ``ModelCheckpoint`` writes routed at ``setup``, and tear down a ``DeltaCheckpointIO``
        wrapped by ``AsyncCheckpointIO`` (:func:`teardown_wrapped_io`)."""
        for p in self._write_patches:
            p.restore()
        self._write_patches = []
        teardown_wrapped_io(trainer)


def _rebuild_error(described: ErrorDescription, directory: str) -> Exception:
    """Rank 0's claim error on another rank (:func:`~lightning_accel._utils.rank.rebuild_error`); a locked directory
    is rebuilt with its directory (its holder is rank 0's to read)."""
    module, qualname, _, message = described
    if module == CheckpointDirectoryLockedError.__module__ and qualname == CheckpointDirectoryLockedError.__qualname__:
        return CheckpointDirectoryLockedError(message, directory=directory, holder={})
    return rebuild_error(described)


class DeltaModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that lists, checks and writes its ``dirpath`` with fsspec ``storage_options``.

    Every ``ModelCheckpoint`` argument is accepted unchanged; the additions are keyword-only.

    On a resumed fit (``ckpt_path=...`` whose callback state Lightning restored for this ``dirpath``) it reconciles the
    directory when training starts (:meth:`reconcile`): delta checkpoints that a killed run left and that this
    callback no longer tracks are removed, with a warning naming them.

    Args:
        dirpath: as for ``ModelCheckpoint`` (e.g. ``"s3://bucket/run/ckpt"``).
        storage_options: fsspec options for ``dirpath`` (endpoint, credentials). ``None`` (default): the options of
            the Trainer's ``DeltaCheckpointIO``, read in ``setup``, so they are written once, on the plugin. Given
            with a ``DeltaCheckpointIO`` whose options differ, ``setup`` refuses them (the plugin's write the
            checkpoints): give them to the plugin only. Without a ``DeltaCheckpointIO`` they list and check a
            remote ``dirpath`` but never reach the saves (Lightning hands the ``CheckpointIO`` no options): warned.
        keep_orphans: keep the untracked checkpoints of a killed run (warn only; ``lightning-accel ckpt gc DIR``
            removes them later).
        **kwargs: the other ``ModelCheckpoint`` arguments.

    Attributes:
        orphans: the checkpoints the last reconciliation removed (or, with ``keep_orphans``, found), as URLs/paths.

    Raises:
        TypeError: ``storage_options`` is not a dict, ``keep_orphans`` not a bool.
        ValueError: at ``setup``, ``storage_options`` differ from those of the Trainer's ``DeltaCheckpointIO``.
    """

    def __init__(
        self,
        dirpath: Any = None,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_orphans: bool = False,
        **kwargs: Any,
    ) -> None:
        # Validates the options (one line naming the argument) before Lightning sees anything.
        self.storage_options = None if storage_options is None else FileStore(storage_options).storage_options
        self.keep_orphans = check_bool("keep_orphans", keep_orphans)
        self.orphans: list[str] = []
        self._restored: dict[str, Any] | None = None
        self._store: FileStore | None = None  # the file store of `dirpath`, with the options (made in `setup`)
        # the saves and removals routed through `_around_write` (from `setup` to `teardown`, when the plugin needs it)
        self._write_patches: list[Patch] = []
        super().__init__(dirpath=dirpath, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        # `save_top_k` beside Lightning's keys: without a `monitor` Lightning tracks only the newest checkpoint, so
        # its state alone cannot tell "keep every checkpoint" (-1) from "keep one" (1); `ckpt gc` reads it.
        return {**super().state_dict(), "save_top_k": self.save_top_k}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._restored = dict(state_dict)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Reconcile the directory of a resumed fit (:meth:`reconcile`) on global rank zero, the rank that writes it;
        under several processes a failure there (a store that cannot be listed, a damaged manifest) is raised on every
        rank, the same type and line, before the first step.

        Why: raised on rank zero alone, it left the other ranks waiting in the first step's collectives until the
        process group failed ("Connection closed by peer") or timed out. One boolean collective on every rank of a
        resumed fit (``ckpt_path`` set), a second carrying the error only after a failure; none otherwise.
        """
        super().on_train_start(trainer, pl_module)
        if trainer.world_size == 1:
            self.reconcile(trainer)
            return
        if not trainer.ckpt_path:
            return  # nothing to reconcile on any rank (the same on every rank): no collective
        error: BaseException | None = None
        described: ErrorDescription | None = None
        if trainer.is_global_zero:
            try:
                self.reconcile(trainer)
            except Exception as e:  # noqa: BLE001 - whatever it is, every rank must learn of it before it raises
                error, described = e, describe_error(e)
        if not trainer.strategy.reduce_boolean_decision(error is not None, all=False):
            return
        # Plain strings and numbers only: an exception object (or its class) may not unpickle on the other ranks.
        described = trainer.strategy.broadcast(described, src=0)
        if error is not None:
            raise error
        if described is None:
            raise RuntimeError(
                "Reconciling the checkpoint directory failed on global rank 0; its error is raised there."
            )
        raise rebuild_error(described, where="global rank 0, reconciling the checkpoint directory: ")

    def reconcile(self, trainer: pl.Trainer) -> list[str]:
        """Remove the delta checkpoints of ``dirpath`` that a killed run left and Lightning will never remove.

        Runs only on a resumed fit whose ``ckpt_path`` lies in ``dirpath`` and whose state Lightning restored into
        this callback, with a ``DeltaCheckpointIO``. *Tracked* are the checkpoints of the restored state
        (``best_k_models``, ``best_model_path``, ``kth_best_model_path``, ``last_model_path``), those of the other
        checkpoint callbacks on the same directory, the resumed checkpoint and every plain ``last.ckpt``. A
        candidate must be a manifest this plugin wrote (recognised by its bytes: any other file is left alone) whose
        name this callback's ``filename`` or ``last`` template produces; a ``filename`` with a ``/`` saves into
        subdirectories of ``dirpath``, whose manifests are candidates by their path below it (only in a subdirectory
        with a blob store of its own: a folder without one holds nothing this plugin wrote). It is removed when it
        is older than the resumed checkpoint (a removal the killed run never made), or newer when the run resumes
        from a ``last`` checkpoint (saves of later steps made after that ``last.ckpt``: the resumed run saves those
        steps again; a save of the resumed step itself, which a callback after the one writing ``last.ckpt`` makes,
        is kept). Newer ones are kept when resuming from an older step checkpoint on purpose. With
        ``save_top_k=-1`` (keep every checkpoint) Lightning removes nothing, so no older checkpoint is a removal it
        missed: only the newer ones go. Their blobs go after the store's ``gc_grace_s``.

        Returns:
            The checkpoints removed (or found, with ``keep_orphans``).
        """
        io = delta_io(trainer)
        state, ckpt_path, dirpath = self._restored, trainer.ckpt_path, self.dirpath
        self.orphans = []
        if io is None or state is None or not ckpt_path or not dirpath or state.get("dirpath") != dirpath:
            return []
        directory = store_dir(str(dirpath))
        if split_path(str(ckpt_path))[0] != directory:
            return []
        io.wait()
        store = io.store
        try:
            resumed_at = store.open_manifest(str(ckpt_path)).created
        except (ValueError, RuntimeError, OSError):  # a plain torch.save file: no creation time to compare
            return []
        tracked = compat.model_checkpoint_tracked(state) | {str(ckpt_path)}
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath and store_dir(str(cb.dirpath)) == directory:
                tracked |= {cb.best_model_path, cb.kth_best_model_path, cb.last_model_path, *cb.best_k_models}
        last_name = _name_pattern(self, self.CHECKPOINT_NAME_LAST)
        made_here = (_name_pattern(self, self.filename), last_name)
        plain_last = self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION
        from_last = last_name.fullmatch(posixpath.basename(str(ckpt_path))) is not None
        # Without a `monitor` Lightning's state tracks only the newest checkpoint, whatever `save_top_k` keeps: with
        # -1 every older checkpoint is one the user keeps, never a removal the killed run missed.
        keeps_all = self.save_top_k == -1
        resumed_step = trainer.global_step  # restored from the resumed checkpoint before training starts
        found = []
        # a `filename` with a `/` (`{epoch}-{val/loss:.2f}`) saves into subdirectories: matched by the path below
        # `dirpath`, as the callback's templates write it
        for url, created in store.untracked_manifests(directory, tracked, subdirectories=True):
            name = relative_to(url, directory)
            if name == plain_last or not any(p.fullmatch(name) for p in made_here):
                continue
            # A newer save of the resumed step is this callback's own, made after the one writing `last.ckpt` took
            # the callbacks' state (callbacks save in order): the resumed run never makes it again, so it is kept.
            if (created >= resumed_at and from_last and not store.saved_at_step(url, resumed_step)) or (
                created < resumed_at and not keeps_all
            ):
                found.append(url)
        if not self.keep_orphans:
            # a subdirectory another live writer holds is its to change: its checkpoints are left, and the fit goes on
            held: set[str] = set()
            for sub in {split_path(u)[0] for u in found} - {directory}:
                try:
                    store.claim(sub)
                except CheckpointDirectoryLockedError:
                    held.add(sub)
            found = [u for u in found if split_path(u)[0] not in held]
        if not found:
            return []
        names = ", ".join(relative_to(u, directory) for u in found[:6]) + (" ..." if len(found) > 6 else "")
        count = f"{len(found)} checkpoint" + ("s" if len(found) != 1 else "")
        where = f"{directory} (resumed from {posixpath.basename(str(ckpt_path))})"
        if self.keep_orphans:
            rank_zero_warn(
                f"{count} in {where}, left by a killed run, not tracked by ModelCheckpoint, which will never "
                f"remove them: {names}. Kept (`keep_orphans=True`); `lightning-accel ckpt gc {directory}` removes "
                "them."
            )
        else:
            rank_zero_warn(
                f"Removing {count} in {where} that a killed run left and ModelCheckpoint no longer "
                f"tracks (it would never remove them): {names}. Pass `DeltaModelCheckpoint(keep_orphans=True)` to "
                "keep them."
            )
            store.remove_checkpoints(found, drop_emptied=True)
        self.orphans = found
        return found

    @override
    def file_exists(self, filepath: Any, trainer: pl.Trainer) -> bool:
        """Whether ``filepath`` exists on global rank zero (as Lightning's, one collective on every rank), counting a
        checkpoint that an async ``DeltaCheckpointIO`` still has queued as existing (and one queued for removal as
        gone).

        Why: Lightning names a save that would reuse an existing file name ``-v1``, ``-v2``... by asking this; with
        ``async_save`` the previous save of the name was often not written yet, so the next one took the same name
        and replaced it (``filename="{epoch}"`` saving every few steps with ``save_top_k=-1`` kept 2 of 4).

        With ``DeltaCheckpointIO(on_save_error="warn")`` a store that cannot be reached (an object-store outage) is
        warned and counted as "does not exist": the save under that name then fails and is warned like any other, and
        training goes on as that option promises, instead of stopping on this check. Otherwise the store's error is
        raised on global rank zero and an ``OSError`` naming it on every other rank, all after the same collectives
        (a raise on rank zero alone left the others waiting in the collective until its timeout).
        """
        local = False
        error: BaseException | None = None
        if trainer.is_global_zero:
            io = delta_io(trainer)
            queued = io.exists(filepath) if io is not None else None
            if queued is not None:
                local = queued
            else:
                store = self._store if self._store is not None else FileStore(self._options(trainer))
                try:
                    local = store.exists(filepath)
                except Exception as e:  # noqa: BLE001 - any store error (botocore's are not OSErrors); re-raised
                    if io is None or io.on_save_error != "warn":
                        error = e
                    else:
                        rank_zero_warn(
                            f"Could not check whether checkpoint {filepath} exists ({one_line(e, first=True)}); "
                            "saving under that name (`on_save_error='warn'` keeps training)."
                        )
        if trainer.strategy.reduce_boolean_decision(error is not None, all=False):
            if error is not None:
                raise error
            raise OSError(
                f"Could not check whether checkpoint {filepath} exists: the store failed on global rank 0 (its error "
                "is raised there); `DeltaCheckpointIO(on_save_error='warn')` keeps training through store outages."
            )
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        cover_save_after_stage(trainer, self._write_patches)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        for p in self._write_patches:
            p.restore()
        self._write_patches = []
        teardown_wrapped_io(trainer)  # the directory's writer lock, which `AsyncCheckpointIO` would keep

    def _around_write(self, kind: str, trainer: pl.Trainer, write: Callable[[], None]) -> None:
        """Every save and removal of this callback: :func:`route_write`."""
        route_write(kind, trainer, write)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank, after Lightning's: the saves still queued are finished and a failure among them is raised on
        every rank, not by rank zero's ``teardown`` alone (:func:`finish_saves_on_every_rank`)."""
        super().on_train_end(trainer, pl_module)
        finish_saves_on_every_rank(trainer)

    def _options(self, trainer: pl.Trainer | None) -> dict[str, Any] | None:
        if self.storage_options is not None:
            return self.storage_options
        return trainer_storage_options(trainer) if trainer is not None else None

    def _check_options_agree(self, trainer: pl.Trainer) -> None:
        """Refuse ``storage_options`` that differ from the Trainer's ``DeltaCheckpointIO``'s (every rank, before
        anything is listed or written; no collective: every rank has the same configuration).

        Why: the plugin's options write, load and remove the checkpoints, this callback's list and check its
        ``dirpath``; two different sets silently reached two endpoints or identities (a listing that found nothing
        the plugin wrote, or saves without the credentials given here only).

        Raises:
            ValueError: both options differ, naming both with their secrets redacted.
        """
        io = delta_io(trainer)
        if self.storage_options is None or io is None or self.storage_options == io.storage_options:
            return
        raise ValueError(
            f"`DeltaModelCheckpoint(storage_options={_redacted(self.storage_options)!r})` differs from the "
            f"plugin's `DeltaCheckpointIO(storage_options={_redacted(io.storage_options)!r})`: the plugin's write, "
            "load and remove the checkpoints, the callback's list its `dirpath`, so they must be the same. Give them "
            "once, to `DeltaCheckpointIO(storage_options=...)`, and leave `DeltaModelCheckpoint`'s out (it then "
            "uses the plugin's)."
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._check_options_agree(trainer)
        # Lightning's `setup` re-creates its filesystem without options and then lists `dirpath` to warn when it is
        # not empty; that listing is what fails on a custom endpoint. It is skipped and done here, on the filesystem
        # with the options.
        with compat.model_checkpoint_setup_without_listing(self):
            super().setup(trainer, pl_module, stage)
        attach_io(trainer)  # a stage starts: the plugin holds its locks until its teardown (every rank, no collective)
        if _routed(trainer) and not self._write_patches:
            self._write_patches = hold_direct_save_failures(trainer) + hold_save_failures(trainer)
            self._write_patches += compat.wrap_model_checkpoint_writes(self, self._around_write, key=_WRITES_KEY)
        options = self._options(trainer)
        dirpath = str(self.dirpath) if self.dirpath else ""
        if self.storage_options and dirpath and not is_local_url(dirpath) and delta_io(trainer) is None:
            io_name = type(trainer.strategy.checkpoint_io).__name__
            # Lightning hands a checkpoint callback's saves to the CheckpointIO without options (and its
            # `TorchCheckpointIO` refuses any): only a `DeltaCheckpointIO` carries options of its own to the saves.
            rank_zero_warn(
                f"`DeltaModelCheckpoint(storage_options=...)` list and check {dirpath}, but the Trainer's `{io_name}` "
                "writes and removes the checkpoints there without them (Lightning passes a callback's options to no "
                "CheckpointIO). Pass them to `DeltaCheckpointIO(storage_options=...)` in `plugins` instead, or give "
                f"`{io_name}` the same endpoint and credentials (e.g. through the environment)."
            )
        store = self._store = FileStore(options)
        if options and dirpath and not is_local_url(dirpath):
            compat.set_checkpoint_filesystem(self, store.filesystem(dirpath))
        listing = trainer.is_global_zero and stage == "fit" and self.save_top_k != 0 and dirpath
        if listing and store.isdir(dirpath) and store.list_files(dirpath):
            rank_zero_warn(f"Checkpoint directory {dirpath} exists and is not empty.")


#: parts of an fsspec option's name that mark its value as a secret (s3fs `key`/`secret`/`token`, `password`, ...)
_SECRET_NAME = re.compile(r"secret|key|token|passw|credential|auth|signature", re.IGNORECASE)


def _redacted(options: Any) -> Any:
    """``options`` with the value of every option whose name looks secret (:data:`_SECRET_NAME`) replaced by
    ``"***"``, at any depth (``client_kwargs``), for an error message."""
    if isinstance(options, dict):
        return {k: "***" if isinstance(k, str) and _SECRET_NAME.search(k) else _redacted(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return type(options)(_redacted(v) for v in options)
    return options


# A metric value as `format()` writes a number: sign, digits with `_`/`,` grouping, fraction, exponent, `%`; nan/inf.
_NUMBER = r"[-+ ]?(?:(?:\d[\d_,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?%?|nan|inf|NAN|INF)"


def _name_pattern(cb: ModelCheckpoint, template: str | None) -> re.Pattern[str]:
    """The file names ``cb`` makes from ``template`` (its ``filename``, default ``{epoch}-{step}``, or the ``last``
    name): each ``{metric[:format]}`` becomes ``metric=<number>`` (with ``auto_insert_metric_name``) or ``<number>``,
    then an optional version suffix (``-v1``) and the extension.

    A value is a number as a format spec writes it (``12``, ``012``, ``-0.25``, ``1.5e-03``, ``1_000``, ``50.0%``,
    ``nan``, ``inf``): Lightning formats metrics, which are numbers. Any other text there is the user's
    (``step=12-keep.ckpt``, a copy kept out of the rotation) and must never match.
    """
    template = template or "{epoch}" + cb.CHECKPOINT_JOIN_CHAR + "{step}"
    parts = re.split(r"\{([^{}:]*)(?::[^{}]*)?\}", template)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
        else:
            prefix = re.escape(part + cb.CHECKPOINT_EQUALS_CHAR) if cb.auto_insert_metric_name else ""
            out.append(prefix + _NUMBER)
    version = re.escape(cb.CHECKPOINT_JOIN_CHAR) + r"v\d+"
    return re.compile("".join(out) + f"(?:{version})?" + re.escape(cb.FILE_EXTENSION))


def resolve_ckpt_path(trainer: pl.Trainer, ckpt_path: Any) -> Any:
    """``ckpt_path`` for ``trainer.fit/validate/test/predict``, with ``"last"`` resolved to a file.

    For ``"last"``, returns the path or URL of the newest ``last*.ckpt`` in the ``dirpath`` of the Trainer's checkpoint
    callbacks (:func:`~lightning_accel.checkpoint.reader.resolve_last`, with the callback's or the plugin's
    ``storage_options``; Lightning's own search drops the ``s3://`` of object-store paths), or ``None`` with
    Lightning's warning when there is none (a fresh run). Any other value, or callbacks without a ``dirpath`` (Lightning
    derives it from the logger later and resolves those itself), is returned unchanged.

    Raises:
        ValueError: a ``DeltaModelCheckpoint``'s ``storage_options`` differ from the plugin's (the refusal its
            ``setup`` makes, before any search with them).
    """
    if ckpt_path != "last":
        return ckpt_path
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath is not None]
    if not callbacks:
        return ckpt_path
    for cb in callbacks:
        if isinstance(cb, DeltaModelCheckpoint):
            # the refusal `setup` would make: a search with the callback's options first failed (an unreachable
            # endpoint, a listing that found nothing the plugin wrote) and hid the true cause
            cb._check_options_agree(trainer)
    found: list[tuple[float, str]] = []
    for cb in callbacks:
        dirpath = str(cb.dirpath)
        if is_local_url(dirpath) and not os.path.isdir(strip_file_scheme(dirpath)):
            continue  # a fresh run: nothing saved yet
        options = cb._options(trainer) if isinstance(cb, DeltaModelCheckpoint) else trainer_storage_options(trainer)
        hit = resolve_last(dirpath, storage_options=options, with_time=True)
        if hit is not None:
            found.append((hit[1], hit[0]))
    if not found:
        where = ", ".join(str(c.dirpath) for c in callbacks)
        # the hint only where it applies: a callback that already saves `last.ckpt` has just not saved one yet
        hint = "" if any(c.save_last for c in callbacks) else " HINT: Set `ModelCheckpoint(..., save_last=True)`."
        rank_zero_warn(
            f'`ckpt_path="last"` is set, but there is no last checkpoint in {where}. No checkpoint will be loaded '
            f"(a first run starts from the initial weights).{hint}"
        )
        return None
    return max(found)[1]
