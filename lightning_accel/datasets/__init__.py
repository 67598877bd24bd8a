"""Embedded real data: scikit-learn's handwritten digits (1,797 images, 10 classes).

``materialize_digits`` renders them as an ImageFolder-style tree of JPEG files; ``digits_tokens`` gives the same
images as token sequences for the reference GPT model. ``DigitsDataModule`` (plain ImageFolder + DataLoader) is the
baseline that the plugins are measured against; it is imported lazily because it needs Lightning.
"""

from __future__ import annotations

from lightning_accel._utils.lazy import lazy_getattr
from lightning_accel.datasets.digits import (
    DIGITS_CLASSES,
    DigitsInfo,
    digits_tokens,
    load_digits_arrays,
    materialize_digits,
)

__all__ = [
    "DIGITS_CLASSES",
    "DigitsDataModule",
    "DigitsInfo",
    "digits_tokens",
    "load_digits_arrays",
    "materialize_digits",
]


# Lightning adapters, imported on first access so the core stays importable without Lightning's import cost
__getattr__ = lazy_getattr(
    __name__,
    {
        "DigitsDataModule": "lightning_accel.datasets.datamodule",
    },
)
