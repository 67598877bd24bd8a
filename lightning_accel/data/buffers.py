"""Batch buffers: shared-memory batches for DataLoader workers, and a pool that recycles private ones.

:class:`~lightning_accel.data.cache.SampleCache` allocates each batch here: in shared memory inside a worker (the
batch then crosses to the main process as one file descriptor), from :class:`BufferPool` in the reading process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_accel._utils import compat
from lightning_accel._utils.checks import check_int
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess

__all__ = ["BufferPool", "alloc_shared"]


def alloc_shared(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of ``shape``/``dtype`` in shared memory (a batch made inside a DataLoader worker)."""
    # As torch's default_collate does inside workers: allocate the batch directly in shared memory so sending it to
    # the main process is a file-descriptor handoff instead of a 9.6 MB copy (64 x 3 x 224 x 224 uint8).
    return compat.empty_shared(shape, dtype)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(1, size)
    return tuple(reversed(strides))


class _FreeBuffers:
    """One process's pooled batch storages by (shape, dtype), and how many batches reused one."""

    __slots__ = ("reused", "stores")

    def __init__(self) -> None:
        self.stores: dict[tuple[tuple[int, ...], torch.dtype], list[torch.UntypedStorage]] = {}
        self.reused = 0


class BufferPool:
    """Recycles batch buffers once nothing outside the pool references them.

    Why: a fresh 9.6 MB batch (64 x 3 x 224 x 224 uint8) is a fresh ``mmap`` from glibc (above its mmap threshold,
    and always so for reader threads, whose malloc arenas trim freed memory), so every warm batch pays ~2,350 page
    faults (zero-filled pages) before its first byte is copied; copying entries into a reused buffer avoids them (the
    warm-epoch rows of ``benchmarks/data_cache.py`` measure the difference).

    Contract: the pool keeps each buffer's *storage* and hands out a new tensor over it; a storage is reused only
    when its use count is back to 1 (the pool's own reference), i.e. the batch tensor and every view of it (slices,
    numpy arrays) are gone. A caller that keeps batches simply makes the pool allocate: at most ``max_buffers``
    storages per (shape, dtype) are kept, beyond that batches are plain allocations. Only private (non-shared)
    memory is pooled: a shared-memory batch leaves its worker process. The pooled storages are per process (a
    forked child's copies of them are its parent's batches, and a pickled pool carries none).
    """

    def __init__(self, max_buffers: int = 8) -> None:
        # each kept storage is a whole batch (9.6 MB at 64 x 3 x 224 x 224 uint8): a pool of thousands would hold
        # gigabytes nobody asked for
        self.max_buffers = check_int(
            "max_buffers", max_buffers, low=0, high=1024, fix="0 turns pooling off; use e.g. 8."
        )
        self._free: PerProcess[_FreeBuffers] = PerProcess(_FreeBuffers)
        self._lock = ForkSafeLock()

    @property
    def reused(self) -> int:
        """Batches this process handed out on a recycled storage."""
        return self._free.get().reused

    def reserve(self, shape: Sequence[int], dtype: torch.dtype, count: int) -> int:
        """Allocate and touch (page in) buffers of ``shape``/``dtype`` until the pool holds ``count`` of them (at most
        ``max_buffers``); returns how many it added. Touching is what a first use would pay in page faults."""
        shape_t = tuple(int(s) for s in shape)
        if self.max_buffers <= 0 or compat.storage_use_count_fn() is None:
            return 0
        key = (shape_t, dtype)
        added = 0
        while True:
            with self._lock:
                stores = self._free.get().stores.setdefault(key, [])
                if len(stores) >= min(count, self.max_buffers):
                    return added
            buf = torch.zeros(shape_t, dtype=dtype)  # zero-fill outside the lock: the page faults happen here
            with self._lock:
                stores = self._free.get().stores.setdefault(key, [])
                if len(stores) >= min(count, self.max_buffers):
                    return added
                stores.append(buf.untyped_storage())
                added += 1

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype``, on a recycled storage when one is free."""
        shape_t = tuple(int(s) for s in shape)
        use_count = compat.storage_use_count_fn()
        if self.max_buffers <= 0 or use_count is None:
            return torch.empty(shape_t, dtype=dtype)
        key = (shape_t, dtype)
        with self._lock:
            free = self._free.get()
            stores = free.stores.setdefault(key, [])
            storage = next((s for s in stores if use_count(s) == 1), None)
            if storage is not None:
                free.reused += 1
            elif len(stores) < self.max_buffers:
                storage = torch.empty(shape_t, dtype=dtype).untyped_storage()
                stores.append(storage)
            else:
                return torch.empty(shape_t, dtype=dtype)
            # Created under the lock: from here the use count is 2, so no other thread can take this storage.
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape_t, _contiguous_strides(shape_t))
