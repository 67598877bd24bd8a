"""``DeltaModelCheckpoint``: Lightning's ``ModelCheckpoint`` on the same filesystem (and storage options) as the
checkpoint plugin, and ``ckpt_path="last"`` resolved on object stores.

Lightning's ``ModelCheckpoint`` opens its ``dirpath`` with ``get_filesystem(dirpath)`` and no storage options, so with
an S3 endpoint or credentials given only to ``DeltaCheckpointIO(storage_options=...)`` its ``setup`` and its search
for ``last`` checkpoints fail (``NoCredentialsError``); only ``AWS_ENDPOINT_URL`` / ``AWS_ACCESS_KEY_ID`` in the
environment reach it. :class:`DeltaModelCheckpoint` takes ``storage_options`` itself, or, when given none, uses those
of the Trainer's ``DeltaCheckpointIO``: one set of options for saves, loads, removals, listings and existence checks.

``Trainer.fit(ckpt_path="last")`` on an object store finds nothing in Lightning (its search drops the ``s3://`` of
the listed paths and then looks on the local disk), so :func:`resolve_ckpt_path` resolves ``"last"`` for the
Trainer's checkpoint callbacks with :func:`~lightning_accel.checkpoint.reader.resolve_last`; the ``lightning-accel``
CLI calls it for ``--ckpt_path last``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.atomic import is_local_url, strip_file_scheme
from lightning_accel._utils.fs import FileStore
from lightning_accel.checkpoint.lock import CheckpointDirectoryLockedError
from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
from lightning_accel.checkpoint.reader import resolve_last

__all__ = ["CheckpointGuard", "DeltaModelCheckpoint", "resolve_ckpt_path", "trainer_storage_options"]


def delta_io(trainer: pl.Trainer) -> DeltaCheckpointIO | None:
    """The Trainer's ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``), or None."""
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncCheckpointIO):
        io = io.checkpoint_io
    return io if isinstance(io, DeltaCheckpointIO) else None


def trainer_storage_options(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The ``storage_options`` of the Trainer's ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``), or None."""
    io = delta_io(trainer)
    return dict(io.storage_options) if io is not None else None


class CheckpointGuard(Callback):
    """Refuse, before the first step, a fit whose checkpoints cannot work out: a checkpoint directory another run
    writes, or an optimizer state restored into a different optimizer.

    1. ``on_fit_start``: ``DeltaCheckpointIO`` otherwise takes a directory's writer lock at its first save, so a second
       run on the same directory trained a whole epoch before it was refused. Global rank zero (the rank that saves)
       claims each checkpoint callback's ``dirpath`` (resolved by ``ModelCheckpoint.setup`` by then); the outcome is
       broadcast so every rank raises the same error together, none left waiting in a collective. Nothing happens
       without a ``DeltaCheckpointIO``.
    2. ``on_train_start`` (after Lightning restored the optimizer state, before the first step): a param group that
       lacks a hyper-parameter of its optimizer's ``defaults`` (AdamW's state restored into SGD has no ``momentum``)
       is a one-line ``ValueError`` instead of a ``KeyError`` deep in the first ``step``. Every rank checks its own
       optimizers, which hold the same state: no collective.

    The ``lightning-accel`` CLI adds this callback by itself.
    """

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        io = delta_io(trainer)
        dirs = [str(d) for cb in trainer.checkpoint_callbacks if (d := getattr(cb, "dirpath", None))]
        if io is None or not dirs:
            return
        refusal = ""
        if trainer.is_global_zero:
            try:
                for d in dirs:
                    io.claim(d)
            except CheckpointDirectoryLockedError as e:
                refusal = str(e)
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal:
            raise CheckpointDirectoryLockedError(refusal, directory=dirs[0], holder={})

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


class DeltaModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that lists, checks and writes its ``dirpath`` with fsspec ``storage_options``.

    Every ``ModelCheckpoint`` argument is accepted unchanged; the one addition is keyword-only.

    Args:
        dirpath: as for ``ModelCheckpoint`` (e.g. ``"s3://bucket/run/ckpt"``).
        storage_options: fsspec options for ``dirpath`` (endpoint, credentials). ``None`` (default): the options of
            the Trainer's ``DeltaCheckpointIO``, read in ``setup``, so they are written once, on the plugin.
        **kwargs: the other ``ModelCheckpoint`` arguments.

    Raises:
        TypeError: ``storage_options`` is not a dict.
    """

    def __init__(self, dirpath: Any = None, *, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # Validates the options (one line naming the argument) before Lightning sees anything.
        self.storage_options = None if storage_options is None else FileStore(storage_options).storage_options
        super().__init__(dirpath=dirpath, **kwargs)

    def _options(self, trainer: pl.Trainer | None) -> dict[str, Any] | None:
        if self.storage_options is not None:
            return self.storage_options
        return trainer_storage_options(trainer) if trainer is not None else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning's `setup` re-creates its filesystem without options and then lists `dirpath` to warn when it is
        # not empty; that listing is what fails on a custom endpoint. It is skipped and done here, on the filesystem
        # with the options.
        with compat.model_checkpoint_setup_without_listing(self):
            super().setup(trainer, pl_module, stage)
        options = self._options(trainer)
        dirpath = str(self.dirpath) if self.dirpath else ""
        if options and dirpath and not is_local_url(dirpath):
            store = FileStore(options)
            compat.set_checkpoint_filesystem(self, store.filesystem(dirpath))
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0 and dirpath:
            store = FileStore(options)
            if store.isdir(dirpath) and store.list_files(dirpath):
                rank_zero_warn(f"Checkpoint directory {dirpath} exists and is not empty.")


def resolve_ckpt_path(trainer: pl.Trainer, ckpt_path: Any) -> Any:
    """``ckpt_path`` for ``trainer.fit/validate/test/predict``, with ``"last"`` resolved to a file.

    For ``"last"``, returns the path or URL of the newest ``last*.ckpt`` in the ``dirpath`` of the Trainer's checkpoint
    callbacks (:func:`~lightning_accel.checkpoint.reader.resolve_last`, with the callback's or the plugin's
    ``storage_options``; Lightning's own search drops the ``s3://`` of object-store paths), or ``None`` with
    Lightning's warning when there is none (a fresh run). Any other value, or callbacks without a ``dirpath`` (Lightning
    derives it from the logger later and resolves those itself), is returned unchanged.
    """
    if ckpt_path != "last":
        return ckpt_path
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath is not None]
    if not callbacks:
        return ckpt_path
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
        rank_zero_warn(
            f'`ckpt_path="last"` is set, but there is no last checkpoint in {where}.'
            " No checkpoint will be loaded. HINT: Set `ModelCheckpoint(..., save_last=True)`."
        )
        return None
    return max(found)[1]
