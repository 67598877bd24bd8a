"""Delta checkpoints: content-addressed blobs, lossless XOR deltas and opt-in quantized deltas, atomic everywhere.

Core (no Lightning import): :mod:`~lightning_accel.checkpoint.codec` (tensor codecs),
:mod:`~lightning_accel.checkpoint.skeleton` (safe non-tensor state), :mod:`~lightning_accel.checkpoint.store`
(manifests, chains, garbage collection), :mod:`~lightning_accel.checkpoint.background` (async saving).
Adapter: :class:`DeltaCheckpointIO` (imported lazily because it needs Lightning).
Command line: ``python -m lightning_accel.checkpoint verify|export ...``.
"""

from __future__ import annotations

from lightning_accel._utils.lazy import lazy_getattr
from lightning_accel.checkpoint.store import (
    CheckpointCorruptError,
    DeltaStore,
    NotADeltaCheckpointError,
    SaveStats,
)

__all__ = ["CheckpointCorruptError", "DeltaCheckpointIO", "DeltaStore", "NotADeltaCheckpointError", "SaveStats"]


# Lightning adapters, imported on first access so the core stays importable without Lightning's import cost
__getattr__ = lazy_getattr(
    __name__,
    {
        "DeltaCheckpointIO": "lightning_accel.checkpoint.plugin",
    },
)
