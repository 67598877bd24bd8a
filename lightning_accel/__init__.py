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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
