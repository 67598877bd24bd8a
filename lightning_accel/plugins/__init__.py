"""Public namespace of every Trainer plugin (re-exports only), laid out as ``lightning.pytorch.plugins``, so
``class_path: lightning_accel.plugins.<Name>`` stays short and stable; each plugin lives in its room beside the core it
adapts (``checkpoint/plugin.py``, ``precision/plugin.py``).

- :class:`DeltaCheckpointIO` — a ``CheckpointIO`` that stores what changed since the last save.
- :class:`FusedPrecision` — a ``Precision`` plugin: mixed precision plus fused Conv+BN+ReLU, Linear+Dropout, norms.
"""

from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
from lightning_accel.precision.plugin import FusedPrecision

__all__ = ["DeltaCheckpointIO", "FusedPrecision"]


def __dir__() -> list[str]:
    # tab completion and `dir()` show the public names, not the sub-packages and helpers imported above
    return __all__
