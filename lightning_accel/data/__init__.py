"""Decoded-sample cache: RAM / LMDB / fsspec object-store tiers, batch reads, read-ahead and GPU augmentation.

Core (no ``lightning`` import): :class:`SampleCache`, :class:`CachedDataset`, :class:`EpochOrderSampler`,
:class:`ShardWindowSampler`, :class:`LmdbTier`, :class:`ObjectStore`, :func:`pack_origin`, :class:`ImageDecoder`,
:class:`GpuAugment`, the entry codec and :class:`CacheStats`. The Lightning adapter is :class:`CachedDataModule`
(``datamodule.py``). Guide: ``docs/data.md``.
"""

from __future__ import annotations

from lightning_accel.data.augment import GpuAugment
from lightning_accel.data.cache import BatchResult, SampleCache
from lightning_accel.data.codec import CorruptEntryError, Sample, decode_entry, encode_entry
from lightning_accel.data.datamodule import CachedDataModule
from lightning_accel.data.dataset import CacheDataLoader, CachedDataset, EpochOrderSampler, collate_batch
from lightning_accel.data.decode import DecodeError, ImageDecoder
from lightning_accel.data.origin import Listing, ObjectStore, OriginError, list_origin
from lightning_accel.data.pack import PackedReader, PackIndex, pack_origin
from lightning_accel.data.sampler import ShardWindowSampler
from lightning_accel.data.stats import CacheStats
from lightning_accel.data.tiers import BudgetTooSmallError, LmdbTier

__all__ = [
    "BatchResult",
    "BudgetTooSmallError",
    "CacheDataLoader",
    "CacheStats",
    "CachedDataModule",
    "CachedDataset",
    "CorruptEntryError",
    "DecodeError",
    "EpochOrderSampler",
    "GpuAugment",
    "ImageDecoder",
    "Listing",
    "LmdbTier",
    "ObjectStore",
    "OriginError",
    "PackIndex",
    "PackedReader",
    "Sample",
    "SampleCache",
    "ShardWindowSampler",
    "collate_batch",
    "decode_entry",
    "encode_entry",
    "list_origin",
    "pack_origin",
]
