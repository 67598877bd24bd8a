"""Embedded real data: scikit-learn's handwritten digits (1,797 images, 10 classes).

``materialize_digits`` renders them as an ImageFolder-style tree of JPEG files; ``digits_tokens`` gives the same
images as token sequences for the reference GPT model. ``DigitsDataModule`` (plain ImageFolder + DataLoader) is the
baseline that the plugins are measured against; ``DigitsCachedDataModule`` reads the same JPEGs through the
decoded-sample cache (``lightning_accel.data.CachedDataModule``), rendering them first (the quickstart's data).
"""

from __future__ import annotations

from lightning_accel.datasets.datamodule import DigitsCachedDataModule, DigitsDataModule
from lightning_accel.datasets.digits import (
    DIGITS_CLASSES,
    DigitsInfo,
    digits_tokens,
    load_digits_arrays,
    materialize_digits,
)

__all__ = [
    "DIGITS_CLASSES",
    "DigitsCachedDataModule",
    "DigitsDataModule",
    "DigitsInfo",
    "digits_tokens",
    "load_digits_arrays",
    "materialize_digits",
]
