"""Lightning callbacks (one per file), each a thin adapter over a core object; names are resolved lazily."""

from __future__ import annotations

from lightning_accel._utils.lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _CALLBACKS)


def __dir__() -> list[str]:
    return __all__
