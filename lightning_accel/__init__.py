"""lightning-accel: PyTorch Lightning plugins that make training faster and cheaper.

Layout: one room (sub-package) per concern -- ``data``, ``comm`` (1-bit DDP), ``checkpoint``, ``ops`` + ``precision``,
``perf``, ``parallel``, ``recipes`` -- each holding its plain-torch core (modules that never import Lightning) and,
beside it, its thin Lightning adapter, in a module named after the Lightning extension point it implements:
``datamodule.py``, ``strategy.py``, ``plugin.py`` or ``callbacks.py``. ``lightning_accel.callbacks`` and
``lightning_accel.strategies`` are public namespaces only (re-exports), so ``class_path:`` strings stay short and
stable; ``datasets`` and ``models`` are the embedded demo, which may import the rooms but never the reverse. Shared
plumbing (fsspec access, atomic writes, per-process state, the Triton switch, private-API shims) lives in ``_utils``.

Import policy: ``import lightning_accel`` imports Lightning, because ``Trainer(strategy="ddp_1bit")`` resolves the
name through Lightning's ``StrategyRegistry`` and the alias must exist once this import returns. Everything else is
imported eagerly too: measured here, ``import lightning.pytorch`` takes 4.06 s and every room with every adapter
adds 0.11 s, so lazy imports would save under 3 %.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
from lightning_accel.comm.hook import onebit_hook
from lightning_accel.comm.state import OneBitState
from lightning_accel.comm.strategy import OneBitDDPStrategy
from lightning_accel.data.augment import GpuAugment
from lightning_accel.data.datamodule import CachedDataModule
from lightning_accel.datasets.datamodule import DigitsDataModule
from lightning_accel.datasets.digits import materialize_digits
from lightning_accel.models.lit import ImageClassifier, TinyGPT
from lightning_accel.parallel.select import select_strategy
from lightning_accel.parallel.strategy import AutoStrategy, PipelineStrategy, ShardedStrategy
from lightning_accel.perf.callbacks import CudaMemoryManager, PerformanceMonitor
from lightning_accel.precision.plugin import FusedPrecision
from lightning_accel.precision.surgery import apply_fusions
from lightning_accel.recipes.callbacks import KnowledgeDistillation, LinearScalingLR, PerStepLR, StructuredPruning
from lightning_accel.recipes.lr import WarmupCosineLR

__version__ = "0.1.0"

__all__ = [
    "AutoStrategy",
    "CachedDataModule",
    "CudaMemoryManager",
    "DeltaCheckpointIO",
    "DigitsDataModule",
    "FusedPrecision",
    "GpuAugment",
    "ImageClassifier",
    "KnowledgeDistillation",
    "LinearScalingLR",
    "OneBitDDPStrategy",
    "OneBitState",
    "PipelineStrategy",
    "PerStepLR",
    "PerformanceMonitor",
    "ShardedStrategy",
    "StructuredPruning",
    "TinyGPT",
    "WarmupCosineLR",
    "__version__",
    "apply_fusions",
    "materialize_digits",
    "onebit_hook",
    "select_strategy",
]

# `Trainer(strategy="ddp_1bit")` and LightningCLI's `--trainer.strategy=ddp_1bit` resolve names through this registry.
if OneBitDDPStrategy.strategy_name not in StrategyRegistry:
    OneBitDDPStrategy.register_strategies(StrategyRegistry)
# `Trainer(strategy="pipeline")`
if PipelineStrategy.strategy_name not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)


def __dir__() -> list[str]:
    # tab completion and `dir()` show the public names, not the sub-packages and helpers imported above
    return __all__
