"""lightning-accel: PyTorch Lightning plugins that make training faster and cheaper.

Public names are resolved lazily (PEP 562) so ``import lightning_accel`` stays cheap; see ``__all__``.
"""

from __future__ import annotations

from lightning_accel._utils.lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    "DeltaCheckpointIO": "lightning_accel.checkpoint.plugin",
    "CachedDataModule": "lightning_accel.data.datamodule",
    "GpuAugment": "lightning_accel.data.augment",
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
    "OneBitDDPStrategy": "lightning_accel.strategies.onebit",
    "OneBitState": "lightning_accel.comm.state",
    "onebit_hook": "lightning_accel.comm.hook",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def _register_strategies() -> None:
    # `Trainer(strategy="ddp_1bit")` and LightningCLI's `--trainer.strategy=ddp_1bit` resolve names through
    # Lightning's StrategyRegistry, so the alias must exist once `import lightning_accel` returns. This imports
    # lightning.pytorch (needed for the registry anyway) but no optional module (triton is imported on CUDA use).
    from lightning_accel.strategies import register_strategies

    register_strategies()


_register_strategies()


__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
