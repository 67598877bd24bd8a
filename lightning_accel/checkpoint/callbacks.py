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

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.atomic import is_local_url
from lightning_accel._utils.fs import FileStore
from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
from lightning_accel.checkpoint.reader import resolve_last

__all__ = ["DeltaModelCheckpoint", "resolve_ckpt_path", "trainer_storage_options"]


def trainer_storage_options(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The ``storage_options`` of the Trainer's ``DeltaCheckpointIO`` (also inside ``AsyncCheckpointIO``), or None."""
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncCheckpointIO):
        io = io.checkpoint_io
    return dict(io.storage_options) if isinstance(io, DeltaCheckpointIO) else None


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
        # not empty; that listing is what fails on a custom endpoint. It is skipped (save_top_k=0 short-circuits it)
        # and done here, on the filesystem with the options.
        top_k = self.save_top_k
        self.save_top_k = 0
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.save_top_k = top_k
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
    """``ckpt_path`` for ``trainer.fit/validate/test/predict``, with ``"last"`` resolved on object stores.

    For ``"last"`` and a Trainer whose checkpoint callbacks write to a remote ``dirpath``, returns the URL of the
    newest ``last*.ckpt`` there (:func:`~lightning_accel.checkpoint.reader.resolve_last`, with the callback's or the
    plugin's ``storage_options``), or ``None`` with Lightning's warning when there is none (a fresh run). Any other
    value, or local directories only, is returned unchanged (Lightning resolves those itself).
    """
    if ckpt_path != "last":
        return ckpt_path
    remote = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]
    remote = [cb for cb in remote if not is_local_url(str(cb.dirpath))]
    if not remote:
        return ckpt_path
    found: list[tuple[float, str]] = []
    for cb in remote:
        options = cb._options(trainer) if isinstance(cb, DeltaModelCheckpoint) else trainer_storage_options(trainer)
        hit = resolve_last(str(cb.dirpath), storage_options=options, with_time=True)
        if hit is not None:
            found.append((hit[1], hit[0]))
    if not found:
        where = ", ".join(str(c.dirpath) for c in remote)
        rank_zero_warn(
            f'`ckpt_path="last"` is set, but there is no last checkpoint in {where}.'
            " No checkpoint will be loaded. HINT: Set `ModelCheckpoint(..., save_last=True)`."
        )
        return None
    return max(found)[1]
