"""lightning-accel: PyTorch Lightning plugins that make training faster and cheaper.

Public names are resolved lazily (PEP 562) so ``import lightning_accel`` stays cheap; see ``__all__``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    "DigitsDataModule": "lightning_accel.datasets.datamodule",
    "materialize_digits": "lightning_accel.datasets.digits",
    "ImageClassifier": "lightning_accel.models.lit",
    "TinyGPT": "lightning_accel.models.lit",
    "PerformanceMonitor": "lightning_accel.callbacks.performance_monitor",
    "CudaMemoryManager": "lightning_accel.callbacks.cuda_memory_manager",
    "select_strategy": "lightning_accel.parallel.select",
    "AutoStrategy": "lightning_accel.parallel.strategy",
    "FusedPrecision": "lightning_accel.precision.plugin",
    "apply_fusions": "lightning_accel.precision.surgery",
    # training recipes (issue 8): schedule class + callbacks
    "WarmupCosineLR": "lightning_accel.recipes.lr",
    "LinearScalingLR": "lightning_accel.callbacks.linear_scaling_lr",
    "PerStepLR": "lightning_accel.callbacks.per_step_lr",
    "KnowledgeDistillation": "lightning_accel.callbacks.knowledge_distillation",
    "StructuredPruning": "lightning_accel.callbacks.structured_pruning",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
