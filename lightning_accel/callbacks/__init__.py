"""Lightning callbacks (one per file), each a thin adapter over a core object; names are resolved lazily."""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it (imported on first access, so importing one callback loads only its file)
_CALLBACKS: dict[str, str] = {
    "CudaMemoryManager": "lightning_accel.callbacks.cuda_memory_manager",
    "KnowledgeDistillation": "lightning_accel.callbacks.knowledge_distillation",
    "LinearScalingLR": "lightning_accel.callbacks.linear_scaling_lr",
    "PerformanceMonitor": "lightning_accel.callbacks.performance_monitor",
    "PerStepLR": "lightning_accel.callbacks.per_step_lr",
    "StructuredPruning": "lightning_accel.callbacks.structured_pruning",
}

__all__ = sorted(_CALLBACKS)


def __getattr__(name: str) -> Any:
    module = _CALLBACKS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
