"""Delta checkpoints: content-addressed blobs, lossless XOR deltas and opt-in quantized deltas, atomic everywhere.

Core (no Lightning import): :mod:`~lightning_accel.checkpoint.codec` (tensor codecs),
:mod:`~lightning_accel.checkpoint.skeleton` (safe non-tensor state), :mod:`~lightning_accel.checkpoint.manifest`
(the on-disk format), :mod:`~lightning_accel.checkpoint.policy` (what each tensor of a save becomes),
:mod:`~lightning_accel.checkpoint.options` (:class:`StoreOptions`), :mod:`~lightning_accel.checkpoint.store`
(save, load, verify, garbage collection), :mod:`~lightning_accel.checkpoint.background` (async saving),
:mod:`~lightning_accel.checkpoint.reader` (:func:`read_checkpoint`: the one reader of delta manifests and plain
``torch.save`` files, used by everything that opens a checkpoint).
:mod:`~lightning_accel.checkpoint.lock` (one writer per directory).
Adapters: :class:`DeltaCheckpointIO` (``plugin.py``); :class:`DeltaModelCheckpoint` and :func:`resolve_ckpt_path`
(``callbacks.py``: ``ModelCheckpoint`` with the plugin's storage options, ``ckpt_path="last"`` on object stores).
Command line: ``python -m lightning_accel.checkpoint verify|export|gc ...``.
"""

from __future__ import annotations

from lightning_accel.checkpoint.callbacks import (
    CheckpointGuard,
    DeltaModelCheckpoint,
    ElasticExit,
    resolve_ckpt_path,
)
from lightning_accel.checkpoint.lock import CheckpointDirectoryLockedError
from lightning_accel.checkpoint.options import StoreOptions
from lightning_accel.checkpoint.plugin import CheckpointSaveError, DeltaCheckpointIO
from lightning_accel.checkpoint.reader import read_checkpoint, resolve_last
from lightning_accel.checkpoint.store import (
    CheckpointCorruptError,
    DeltaStore,
    NotADeltaCheckpointError,
    SaveStats,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDirectoryLockedError",
    "CheckpointSaveError",
    "DeltaCheckpointIO",
    "CheckpointGuard",
    "ElasticExit",
    "DeltaModelCheckpoint",
    "DeltaStore",
    "NotADeltaCheckpointError",
    "SaveStats",
    "StoreOptions",
    "read_checkpoint",
    "resolve_ckpt_path",
    "resolve_last",
]
