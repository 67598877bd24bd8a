"""lightning-accel: PyTorch Lightning plugins that make training faster and cheaper.

The public surface is laid out as Lightning's: :mod:`lightning_accel.plugins` (``DeltaCheckpointIO``,
``FusedPrecision``), :mod:`lightning_accel.callbacks` (every callback) and :mod:`lightning_accel.strategies` (every
strategy) are re-export namespaces, so ``class_path:`` strings stay short and stable; this package's ``__all__``
holds the same names plus the data module and the functional entry points. The demo (``lightning_accel.datasets``,
``lightning_accel.models``) and the internals stay importable from their rooms.

Layout: one room (sub-package) per concern -- ``data``, ``comm`` (1-bit DDP), ``checkpoint``, ``ops`` + ``precision``,
``perf``, ``parallel``, ``recipes`` -- each holding its plain-torch core (modules that never import Lightning) and,
beside it, its thin Lightning adapters (``datamodule.py``, ``strategy.py``, ``plugin.py``, ``callbacks.py``, or an
adapter package). Shared plumbing (fsspec access, atomic writes, per-process state, argument checks, the patching
handle, the Triton switch, private-API shims) lives in ``_utils``; ``docs/architecture.md`` draws the rooms.

Import policy: ``import lightning_accel`` imports Lightning, because ``Trainer(strategy="ddp_1bit")`` resolves the
name through Lightning's ``StrategyRegistry`` and the alias must exist once this import returns. Everything else is
imported eagerly too: the rooms and their adapters add little to the time ``import lightning.pytorch`` takes
(``python -X importtime -c "import lightning_accel"`` shows the split), so lazy imports would save almost nothing.
"""

import importlib
import warnings
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_accel.checkpoint.callbacks import CheckpointGuard, DeltaModelCheckpoint, ElasticExit
from lightning_accel.checkpoint.plugin import DeltaCheckpointIO
from lightning_accel.comm.strategy import LocalStepsStrategy, OneBitDDPStrategy
from lightning_accel.data.augment import GpuAugment
from lightning_accel.data.datamodule import CachedDataModule
from lightning_accel.parallel.select import select_strategy
from lightning_accel.parallel.strategies import AutoStrategy, PipelineStrategy, ShardedStrategy
from lightning_accel.perf.callbacks import CudaMemoryManager, HostMemoryManager, PerformanceMonitor
from lightning_accel.precision.plugin import FusedPrecision
from lightning_accel.precision.surgery import apply_fusions
from lightning_accel.recipes.callbacks import KnowledgeDistillation, LinearScalingLR, PerStepLR, StructuredPruning
from lightning_accel.recipes.lr import WarmupCosineLR

# `la.tune(...)` is the function; the package stays importable as `from lightning_accel.tune import ...`
from lightning_accel.tune import tune
from lightning_accel.tune.guard import RollbackGuard

__version__ = "0.1.0"

__all__ = [
    "AutoStrategy",
    "CachedDataModule",
    "CheckpointGuard",
    "ElasticExit",
    "CudaMemoryManager",
    "DeltaCheckpointIO",
    "DeltaModelCheckpoint",
    "FusedPrecision",
    "GpuAugment",
    "HostMemoryManager",
    "KnowledgeDistillation",
    "LinearScalingLR",
    "LocalStepsStrategy",
    "OneBitDDPStrategy",
    "PerStepLR",
    "PerformanceMonitor",
    "PipelineStrategy",
    "RollbackGuard",
    "ShardedStrategy",
    "StructuredPruning",
    "WarmupCosineLR",
    "__version__",
    "apply_fusions",
    "select_strategy",
    "tune",
]

#: Names this package exported before its public surface held only the plugins: the demo (``datasets``, ``models``)
#: and the 1-bit internals. They still resolve, with a ``DeprecationWarning`` naming their home, for one release.
_MOVED = {
    "DigitsDataModule": "lightning_accel.datasets",
    "materialize_digits": "lightning_accel.datasets",
    "ImageClassifier": "lightning_accel.models",
    "TinyGPT": "lightning_accel.models",
    "OneBitState": "lightning_accel.comm",
    "onebit_hook": "lightning_accel.comm",
}


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_accel' has no attribute {name!r}")
    warnings.warn(
        f"`lightning_accel.{name}` is deprecated; import it from its home: `from {home} import {name}`.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)


# `Trainer(strategy="ddp_1bit")` and LightningCLI's `--trainer.strategy=ddp_1bit` resolve names through this registry.
if OneBitDDPStrategy.strategy_name not in StrategyRegistry:
    OneBitDDPStrategy.register_strategies(StrategyRegistry)
# `Trainer(strategy="diloco")`
if LocalStepsStrategy.strategy_name not in StrategyRegistry:
    LocalStepsStrategy.register_strategies(StrategyRegistry)
# `Trainer(strategy="pipeline")`
if PipelineStrategy.strategy_name not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)


def __dir__() -> list[str]:
    # tab completion and `dir()` show the public names, not the sub-packages and helpers imported above
    return __all__
