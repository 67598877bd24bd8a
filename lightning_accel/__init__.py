"""lightning-accel: PyTorch Lightning plugins that make training faster and cheaper.

Public names are resolved lazily (PEP 562) so ``import lightning_accel`` stays cheap; see ``__all__``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    "CachedDataModule": "lightning_accel.data.datamodule",
    "GpuAugment": "lightning_accel.data.augment",
    "DigitsDataModule": "lightning_accel.datasets.datamodule",
    "materialize_digits": "lightning_accel.datasets.digits",
    "ImageClassifier": "lightning_accel.models.lit",
    "TinyGPT": "lightning_accel.models.lit",
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
