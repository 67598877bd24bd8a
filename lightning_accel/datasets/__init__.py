"""Embedded real data: scikit-learn's handwritten digits (1,797 images, 10 classes) and a photo data set drawn from
scikit-learn's two sample photographs (10 shape classes on random crops, 384 px JPEGs).

``materialize_digits`` renders them as an ImageFolder-style tree of JPEG files; ``digits_tokens`` gives the same
images as token sequences for the reference GPT model. ``DigitsDataModule`` (plain ImageFolder + DataLoader) is the
baseline that the plugins are measured against; ``DigitsCachedDataModule`` reads the same JPEGs through the
decoded-sample cache (``lightning_accel.data.CachedDataModule``), rendering them first (the quickstart's data).
``materialize_photos`` renders the photo data set; ``PhotosCachedDataModule`` is the cache over it (the end-to-end
job's data).
"""

from __future__ import annotations

from lightning_accel.datasets.datamodule import DigitsCachedDataModule, DigitsDataModule, PhotosCachedDataModule
from lightning_accel.datasets.digits import (
    DIGITS_CLASSES,
    DigitsInfo,
    digits_tokens,
    load_digits_arrays,
    materialize_digits,
)
from lightning_accel.datasets.photos import PHOTO_CLASSES, PhotosInfo, load_photo_arrays, materialize_photos

__all__ = [
    "DIGITS_CLASSES",
    "DigitsCachedDataModule",
    "DigitsDataModule",
    "DigitsInfo",
    "PHOTO_CLASSES",
    "PhotosCachedDataModule",
    "PhotosInfo",
    "digits_tokens",
    "load_digits_arrays",
    "load_photo_arrays",
    "materialize_digits",
    "materialize_photos",
]
