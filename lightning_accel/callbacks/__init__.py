"""Public namespace of every callback (re-exports only), laid out as ``lightning.pytorch.callbacks``, so
``class_path: lightning_accel.callbacks.<Name>`` stays short and stable; each callback lives in its room beside the
core it adapts (``checkpoint/callbacks.py``, ``perf/callbacks.py``, ``recipes/callbacks.py``).
"""

from lightning_accel.checkpoint.callbacks import CheckpointGuard, DeltaModelCheckpoint, ElasticExit
from lightning_accel.perf.callbacks import CudaMemoryManager, HostMemoryManager, PerformanceMonitor
from lightning_accel.recipes.callbacks import KnowledgeDistillation, LinearScalingLR, PerStepLR, StructuredPruning
from lightning_accel.tune.guard import RollbackGuard

__all__ = [
    "CheckpointGuard",
    "CudaMemoryManager",
    "DeltaModelCheckpoint",
    "ElasticExit",
    "HostMemoryManager",
    "KnowledgeDistillation",
    "LinearScalingLR",
    "PerStepLR",
    "PerformanceMonitor",
    "RollbackGuard",
    "StructuredPruning",
]


def __dir__() -> list[str]:
    # tab completion and `dir()` show the public names, not the sub-packages and helpers imported above
    return __all__
