"""``CachedDataset``: a map-style dataset over a :class:`SampleCache` that reads whole batches and reads ahead.

Fast warm path (why batches): the DataLoader calls ``__getitems__`` with a whole batch of indices when automatic
batching is on. One call reads every sample of the batch in one LMDB read transaction straight into one (shared
memory) uint8 tensor, and the worker sends that tensor to the main process as a single file-descriptor handoff.
Batch reads beat per-sample ``__getitem__`` through workers, and batch reads in the main process beat both (the warm
rows of ``benchmarks/data_cache.py``; ``docs/data.md``): the per-sample path pays a Python call, a transaction, a
tensor and a collate copy per sample.
Use :func:`collate_batch` as the DataLoader's ``collate_fn`` (it passes the ready batch through).

Read-ahead in sampler order: :class:`EpochOrderSampler` (a ``DistributedSampler``, so Lightning keeps it instead of
injecting its own) publishes each epoch's order of this rank into a small shared-memory array before yielding the
first index. A worker that is handed batch ``b`` knows that batches ``b + k * num_workers`` are its next ones (the
DataLoader deals batches round-robin) and starts origin reads for their uncached samples on a bounded thread pool.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import numbers
import os
import queue
import random
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    SequentialSampler,
    default_collate,
    get_worker_info,
)

from lightning_accel._utils.checks import check_bool, check_int, check_number, check_seed
from lightning_accel._utils.compat import (
    index_sampler,
    register_before_thread_shutdown,
    shutdown_persistent_workers,
    wrap_index_sampler,
)
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess
from lightning_accel._utils.rank import is_global_zero
from lightning_accel.data.buffers import BufferPool
from lightning_accel.data.cache import SampleCache
from lightning_accel.data.origin import MAX_CONCURRENCY, text_bytes
from lightning_accel.data.pack import new_publisher_id, order_group
from lightning_accel.data.stats import LANES

__all__ = [
    "CacheDataLoader",
    "CachedDataset",
    "EpochOrderSampler",
    "SequentialOrderSampler",
    "collate_batch",
    "default_num_workers",
    "drop_lone_last_batch",
    "has_batch_norm",
    "split_indices",
    "split_keys",
]

log = logging.getLogger(__name__)

_HDR = 4  # order array header: [epoch token, length, batch size, the publishing process's id]


def default_num_workers() -> int:
    """Half the CPUs this process may use, at least 1, at most 8 (the rest feed the model)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        n = os.cpu_count() or 1
    return max(1, min(8, n // 2))


# the BatchNorm layers (torch's common base class is private): they cannot train on a batch of one 1x1 feature map
_BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def has_batch_norm(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` has a BatchNorm layer (which cannot train on a batch of one sample; see
    :func:`drop_lone_last_batch`)."""
    return model is not None and any(isinstance(m, _BATCH_NORMS) for m in model.modules())


def drop_lone_last_batch(model: torch.nn.Module | None, per_rank: int, batch_size: int, owner: str) -> bool:
    """Whether a training loader should drop its last batch: only when that batch holds one sample on a rank
    (``per_rank`` samples, ``batch_size`` a batch) and ``model`` has a BatchNorm layer; said once (info) when so.

    BatchNorm cannot train on one sample once a feature map is down to 1x1 (a ResNet on 8 to 15 px images: "Expected
    more than 1 value per channel when training"), so such a fit crashed at the end of its first epoch; on larger maps
    it would normalise by one image's statistics. Any other last batch is kept, so no sample is left out otherwise; a
    ``batch_size`` of 1 is left as it is (every batch is one sample: dropping would leave nothing). Every rank gets
    the same answer from the same numbers, with no collective.
    """
    if model is None or per_rank <= batch_size or per_rank % batch_size != 1:
        return False
    if not has_batch_norm(model):
        return False
    if is_global_zero():
        log.info(
            f"{owner}: the last training batch of each epoch would hold 1 sample ({per_rank} per rank, `batch_size` "
            f"{batch_size}), which the model's BatchNorm cannot train on; it is dropped."
        )
    return True


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/validation split of ``range(n)`` (same on every rank and run).

    Raises:
        TypeError: ``val_fraction`` is not a number.
        ValueError: ``val_fraction`` is not in [0, 1).
    """
    check_number("val_fraction", val_fraction, low=0.0, high=1.0, high_open=True, fix="0 holds out nothing.")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(round(n * val_fraction))
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def split_keys(keys: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/validation split of the positions of ``keys``, decided by each key's name.

    The ``round(len(keys) * val_fraction)`` keys with the smallest seeded hash are held out (the same counts as
    :func:`split_indices`). A sample keeps its side when others are added, removed or reordered (an origin that
    grew, a re-pack in another order): a split by position put 19 of 20 held-out samples of a 200-image origin into
    training after one image was added, so a run continued on the grown origin validated on samples it had trained
    on. Adding ``k`` samples moves at most the change in the held-out count (about ``k * val_fraction``) across.

    Raises:
        TypeError: ``val_fraction`` is not a number.
        ValueError: ``val_fraction`` is not in [0, 1).
    """
    check_number("val_fraction", val_fraction, low=0.0, high=1.0, high_open=True, fix="0 holds out nothing.")
    n_val = int(round(len(keys) * val_fraction))
    if n_val == 0:
        return list(range(len(keys))), []
    # md5 as a well-mixed, fast hash (not for security): 1.3 M ImageNet-like keys in about 1.4 s here
    salt = f"{seed}\0".encode()
    digests = [hashlib.md5(salt + text_bytes(k), usedforsecurity=False).digest() for k in keys]
    rank = sorted(range(len(keys)), key=lambda i: (digests[i], i))
    return sorted(rank[n_val:]), sorted(rank[:n_val])


def collate_batch(batch: Any) -> Any:
    """``collate_fn`` for :class:`CachedDataset`: a ready ``(images, labels)`` batch passes through untouched;
    anything else (a list of samples) goes to torch's ``default_collate``."""
    if isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch
    return default_collate(batch)


class _ReadAhead:
    """One process's view of the published order: where each dataset position sits in it, and the last batch this
    process has started reading ahead (a worker reads ahead for its own batches only)."""

    __slots__ = ("group", "hinted_to", "marked_to", "misaligned", "pos", "token")

    def __init__(self) -> None:
        self.token = 0  # the order token `pos` was built for (0: none yet)
        self.pos: torch.Tensor | None = None  # dataset position -> position in the order (-1: not in it)
        self.hinted_to = -1
        self.marked_to = -1  # the last batch whose staged shards this process has marked as needed
        self.group = ""  # the order's name in the stage's "needed" markers (`pack.order_group`)
        self.misaligned = False  # the loader's batches are not the sampler's `batch_size`: no "needed" markers


class CachedDataset(Dataset):
    """Samples ``indices`` of a cache's listing as ``(uint8 tensor, label)``; batches as ``(images, labels)``.

    Args:
        cache: the sample cache (shared by e.g. the train and validation subsets).
        indices: listing positions this dataset covers (default: all).
        transform: optional per-sample CPU transform applied after the cache (random augmentation goes here or,
            better, in :class:`~lightning_accel.data.augment.GpuAugment` on the device).
        prefetch_batches: how many of its own upcoming batches a worker reads ahead from the origin.
        stats_lane: the rows of the cache's :class:`~lightning_accel.data.stats.CacheStats` its DataLoader workers
            count in (``0`` to ``LANES - 1``). Datasets whose loaders run at once over one statistics object (training
            with persistent workers and validation) need different lanes: workers of the same id would otherwise add
            to one row from two processes and lose counts.
    """

    def __init__(
        self,
        cache: SampleCache,
        indices: Sequence[int] | None = None,
        *,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        prefetch_batches: int = 2,
        stats_lane: int = 0,
    ) -> None:
        self.cache = cache
        if indices is not None:
            # `int(i)` would turn 2.7 into 2 (another sample) and True into 1: a listing position is an int
            bad = next((i for i in indices if isinstance(i, bool) or not isinstance(i, numbers.Integral)), None)
            if bad is not None:
                raise TypeError(
                    f"`indices` must hold integers (positions in the cache's listing), got {bad!r} "
                    f"({type(bad).__name__}). Pass `int` positions."
                )
        self.indices = list(range(len(cache))) if indices is None else [int(i) for i in indices]
        if self.indices and not 0 <= min(self.indices) <= max(self.indices) < len(cache):
            raise ValueError(
                f"`indices` must lie in [0, {len(cache)}), got min {min(self.indices)} and max {max(self.indices)}."
            )
        check_int(
            "prefetch_batches",
            prefetch_batches,
            low=0,
            fix="It counts batches read ahead per reader; 0 to read only on demand.",
        )
        self.stats_lane = check_int("stats_lane", stats_lane, low=0, high=LANES - 1, fix="Give each loader its own.")
        self.transform = transform
        self.prefetch_batches = prefetch_batches
        # [token, n, batch_size, publisher id, order...]: written by the sampler in the main process, read by workers.
        self._order = torch.zeros(_HDR + max(1, len(self.indices)), dtype=torch.int64)
        self._order.share_memory_()
        # done[b] = 1 once batch b of the current order has been read (by any worker): a "needed" marker placed for
        # a batch another worker already read is removed at once instead of outliving the epoch.
        self._done = torch.zeros(max(1, len(self.indices)), dtype=torch.uint8)
        self._done.share_memory_()
        self._publisher: PerProcess[int] = PerProcess(new_publisher_id)
        self._ahead: PerProcess[_ReadAhead] = PerProcess(_ReadAhead)
        self._lock = ForkSafeLock()

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def stats(self) -> Any:
        """The cache's shared :class:`~lightning_accel.data.stats.CacheStats`."""
        return self.cache.stats

    def cached_fraction(
        self, max_checks: int = 4096, seed: int = 0, *, positions: Sequence[int] | None = None
    ) -> float:
        """Fraction of this dataset's samples (or of ``positions``, dataset positions such as one rank's epoch order)
        held by some local tier; samples known to be undecodable (``on_decode_error="skip"``) count as held.

        Every sample this process tree has read from a tier or stored counts without a lookup (right after a cold
        pass, that is all of them: the check costs no LMDB reads); of the others, a seeded sample of at most
        ``max_checks`` is looked up in the tiers and stands for the rest.

        Raises:
            ValueError: a position outside ``[0, len(self))``.
        """
        if positions is None:
            wanted = self.indices
        else:
            pos = [int(p) for p in positions]
            if pos and not 0 <= min(pos) <= max(pos) < len(self.indices):
                bad = min(pos) if min(pos) < 0 else max(pos)
                raise ValueError(
                    f"`positions` must lie in [0, {len(self.indices)}), got {bad}. Pass positions in this dataset "
                    "(e.g. a sampler's order), not listing indices."
                )
            wanted = [self.indices[p] for p in dict.fromkeys(pos)]  # padding repeats positions: count each once
        if not wanted:
            return 1.0
        rest = self.cache.not_yet_seen_cached(wanted)
        if not rest:
            return 1.0
        probe = random.Random(seed).sample(rest, max_checks) if len(rest) > max_checks else rest
        found = sum(self.cache.cached(probe))
        return (len(wanted) - len(rest) + len(rest) * found / len(probe)) / len(wanted)

    # ---- order publication (main process) and read-ahead (any process) --------------------------------------------
    def publish_order(self, order: Sequence[int], batch_size: int) -> None:
        """Record this epoch's order (dataset positions) so workers can read ahead; called by the sampler."""
        n = min(len(order), self._order.numel() - _HDR)
        bs = max(1, int(batch_size))
        self._order[_HDR : _HDR + n] = torch.as_tensor(list(order[:n]), dtype=torch.int64)
        self._order[1] = n
        self._order[2] = bs
        self._order[3] = self._publisher.get()
        self._done[: math.ceil(n / bs)] = 0
        self._order[0] += 1  # the token last: a worker that sees it sees the order too
        if self.prefetch_batches > 0 and n:
            # A packed remote origin stages shards node-wide: start on the first batches' shards here (the main
            # process, whose filesystem is already up) while the workers start and create their own clients.
            head = order[: min(n, 4 * self.prefetch_batches * bs)]
            self.cache.stage_ahead([self.indices[i] for i in head])
            # ...and mark them needed by their batches: a worker's horizon covers only batches after its own first
            # one, so batch 0 (and each worker's first) had only the `.ahead` marker, which the first read by any
            # reader removes. Another worker reading the same shard for its batch first left it unprotected.
            if self.cache.stages_shards:
                group = order_group(int(self._order[3]), int(self._order[0]))
                self._need(group, 0, math.ceil(len(head) / bs) - 1, n, bs)

    def _read_ahead(self, positions: Sequence[int]) -> None:
        if self.prefetch_batches <= 0 or not positions or not getattr(self.cache, "prefetch", True):
            return
        with self._lock:  # main-process reader threads share this state
            self._read_ahead_locked(positions)

    def _refresh_order(self) -> _ReadAhead | None:
        """This process's read-ahead state, its position lookup rebuilt when the sampler published a new order;
        None before any order."""
        token = int(self._order[0])
        if token == 0:
            return None
        ahead = self._ahead.get()
        if token != ahead.token:  # a new epoch: rebuild position lookup, forget old hints
            n = int(self._order[1])
            order = self._order[_HDR : _HDR + n]
            pos = torch.full((len(self.indices),), -1, dtype=torch.int64)
            pos[order] = torch.arange(n, dtype=torch.int64)
            ahead.pos, ahead.token, ahead.hinted_to, ahead.marked_to = pos, token, -1, -1
            ahead.group = order_group(int(self._order[3]), token)
            self.cache.drop_pending()
        return ahead

    def _ends_epoch(self, positions: Sequence[int]) -> bool:
        """True when this batch is one of the epoch's last ``num_workers`` (each worker's last one, as the
        DataLoader deals batches round-robin), or when the order is unknown."""
        info = get_worker_info()
        with self._lock:
            ahead = self._refresh_order() if positions else None
            if ahead is None or ahead.pos is None:
                return True
            p = int(ahead.pos[positions[0]])
            n, bs = int(self._order[1]), int(self._order[2])
        nw = 1 if info is None else info.num_workers
        return p < 0 or p // bs >= math.ceil(n / bs) - nw

    def _read_ahead_locked(self, positions: Sequence[int]) -> None:
        ahead = self._refresh_order()
        if ahead is None or ahead.pos is None:
            return
        p = int(ahead.pos[positions[0]])
        if p < 0:
            return
        n, bs = int(self._order[1]), int(self._order[2])
        info = get_worker_info()
        nw = 1 if info is None else info.num_workers
        b = p // bs
        upcoming: list[int] = []
        for k in range(1, self.prefetch_batches + 1):
            nb = b + k * nw
            if nb <= ahead.hinted_to:
                continue
            lo, hi = nb * bs, min(n, (nb + 1) * bs)
            if lo >= n:
                break
            upcoming.extend(int(i) for i in self._order[_HDR + lo : _HDR + hi])
            ahead.hinted_to = nb
        if upcoming:
            self.cache.hint([self.indices[i] for i in upcoming])
        if self.cache.stages_shards and not ahead.misaligned:
            if p % bs or (len(positions) != bs and p + len(positions) < n):
                if self._order[_HDR + p : _HDR + p + len(positions)].tolist() != list(positions):
                    return  # not a run of this order: the previous epoch's batch (see `_batch_read`)
                ahead.misaligned = True
                self.cache.drop_needs(ahead.group)  # the sampler's marks for its first batches would never go
                warnings.warn(
                    f"the DataLoader's batches ({len(positions)} samples) are not the sampler's `batch_size` ({bs}): "
                    "staged shards are not kept for upcoming batches, so a small stage may fetch some twice. Pass "
                    "the DataLoader's batch size to the sampler (CacheDataLoader does it for you).",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
            self._mark_needed(ahead, b, n, bs, nw)

    def _mark_needed(self, ahead: _ReadAhead, b: int, n: int, bs: int, nw: int) -> None:
        """Mark the staged shards of every batch up to this worker's read-ahead horizon as needed by it, whichever
        worker reads it (see :meth:`~lightning_accel.data.pack.PackedReader.need`): a worker that runs ahead must
        not let a shard go that another worker's batch still needs."""
        last = min(math.ceil(n / bs) - 1, b + self.prefetch_batches * nw)
        first = max(ahead.marked_to, b) + 1
        if first > last:
            return
        self._need(ahead.group, first, last, n, bs)
        ahead.marked_to = last

    def _need(self, group: str, first: int, last: int, n: int, bs: int) -> None:
        """Mark the shards of batches ``first`` to ``last`` of the published order ``group`` (``n`` positions in
        batches of ``bs``) as needed by those batches until each is read."""
        batches = [
            (x, [self.indices[int(i)] for i in self._order[_HDR + x * bs : _HDR + min(n, (x + 1) * bs)]])
            for x in range(first, last + 1)
        ]
        done = self._done
        self.cache.need(group, batches, lambda x: bool(done[x]))

    def _batch_of(self, positions: Sequence[int]) -> tuple[str, int] | None:
        """``(order group, batch number)`` of ``positions`` in the published order when shards are staged and marked
        per batch (see :meth:`_mark_needed`); None otherwise, or when it is not a batch of the current order."""
        if self.prefetch_batches <= 0 or not positions or not self.cache.stages_shards:
            return None
        with self._lock:
            ahead = self._refresh_order()
            if ahead is None or ahead.pos is None:
                return None
            p = int(ahead.pos[positions[0]])
            group, misaligned = ahead.group, ahead.misaligned
        n, bs = int(self._order[1]), int(self._order[2])
        if misaligned or p < 0 or p % bs:
            return None
        b = p // bs
        if self._order[_HDR + b * bs : _HDR + min(n, (b + 1) * bs)].tolist() != list(positions):
            # not a batch of the current order: a persistent worker finishing the previous epoch's batch after the
            # sampler published the next order (an epoch cut short by `limit_train_batches`)
            return None
        return group, b

    def _batch_read(self, positions: Sequence[int]) -> None:
        """This batch's shards are no longer needed by it (see :meth:`_mark_needed`)."""
        # Looked up again after the read: the sampler may have published the next order meanwhile.
        batch = self._batch_of(positions)
        if batch is None:
            return
        group, b = batch
        self._done[b] = 1  # before the markers go: a late marker for it sees it done (see `need`)
        self.cache.release_batch(group, b, [self.indices[q] for q in positions])

    # ---- reads ---------------------------------------------------------------------------------------------------
    def __getitems__(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch as ``(images, labels)`` (skipped undecodable samples are left out)."""
        self._read_ahead(positions)
        in_worker = get_worker_info() is not None
        # A shard this batch stages waits for earlier batches of the order rather than evict one they still need.
        with self.cache.reading(self._batch_of(positions)):
            res = self.cache.load([self.indices[p] for p in positions], shared=in_worker and self.transform is None)
        self._batch_read(positions)
        if self.cache.writes_behind and self._ends_epoch(positions):
            # A worker's last batch of the epoch: commit its write-behind queue first, so the next epoch (any
            # worker, or the main process's warm check) finds every sample this epoch decoded.
            self.cache.flush()
        images = res.images
        if self.transform is not None:
            images = torch.stack([self.transform(x) for x in images]) if len(images) else images
        return images, res.labels

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int]:
        res = self.cache.load([self.indices[position]])
        if not res.kept:
            raise IndexError(f"sample {position} was skipped (undecodable, `on_decode_error='skip'`)")
        x = res.images[0]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(res.labels[0])


class EpochOrderSampler(DistributedSampler):
    """A ``DistributedSampler`` that tells its :class:`CachedDataset` each epoch's order before yielding it.

    Being a ``DistributedSampler``, Lightning keeps it (it only injects one when the sampler is not) and calls its
    ``set_epoch`` every epoch. With one process, ``num_replicas=1, rank=0`` gives a plain (seeded) shuffle.

    Args:
        dataset: the dataset to sample (its ``publish_order`` is called when present).
        num_replicas: number of ranks.
        rank: this rank.
        shuffle: shuffle every epoch (seeded by ``seed + epoch``, identical on every rank).
        seed: shuffle seed.
        drop_last: drop the tail instead of padding to equal shards.
        batch_size: the DataLoader's batch size (to map a batch to its position in the order;
            :class:`CacheDataLoader` sets it to its own).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
    ) -> None:
        check_int("batch_size", batch_size, low=1, fix="It is the DataLoader's batch size.")
        check_seed("seed", seed, what="the shuffle and the train/validation split")
        check_int("num_replicas", num_replicas, low=1, fix="It is the number of ranks (the world size).")
        check_int("rank", rank, low=0, high=num_replicas - 1, fix=f"There are {num_replicas} ranks.")
        # strings are truthy: drop_last="no" dropped the tail, shuffle="false" shuffled
        check_bool("shuffle", shuffle)
        check_bool("drop_last", drop_last)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        #: whether the DataLoader drops a last partial batch (:class:`CacheDataLoader` sets it): the epoch of a state
        #: saved with fewer positions left than a batch is then over
        self.loader_drop_last = False
        #: whether the loader's model cannot train on a batch of one sample (BatchNorm; the data module sets it): an
        #: epoch whose order would end in a lone batch ends one position early instead. The loader's `drop_last`
        #: covers whole epochs; a resumed epoch under another batch size or layout starts at another point, and its
        #: remainder (e.g. 16 positions left in batches of 5) can leave one sample even when a whole epoch does not.
        self.trim_lone_last = False
        #: ``fn()`` giving the most batches the DataLoader's pass takes (:class:`CacheDataLoader` sets it from its
        #: ``pass_batches``): the order published to the dataset stops there, so the workers' origin read-ahead stops
        #: with the pass, and their last batches of the pass commit the write-behind queue as an epoch's last do
        self.pass_batches: Callable[[], float | None] | None = None
        self.resume_epoch = -1  # the epoch `resume_skip` applies to (-1: none)
        self.resume_skip = 0
        # positions `__len__` adds in the resumed epoch: the batches the checkpointed run had done are counted by the
        # Trainer in its batch size, the rest in this loader's (see `load_state_dict`)
        self.resume_extra = 0
        self.progress_epoch = -1  # positions of `progress_epoch`'s order the consumer has taken (see `advance`)
        self.consumed = 0
        # the pass `publish_ahead` published (what it depends on, the order), for the DataLoader's pass to take
        self._published_ahead: tuple[tuple[int, int, int, bool], list[int]] | None = None

    def epoch_order(self) -> list[int]:
        """This rank's whole order for the current epoch (``DistributedSampler``'s; subclasses change it)."""
        return list(super().__iter__())

    def resume(self, epoch: int, consumed: int, extra: int = 0) -> None:
        """Skip the first ``consumed`` positions of ``epoch``'s order (a run resumed mid-epoch) for that epoch only;
        ``len`` stays the whole epoch's (plus ``extra``), as the Trainer counts the batches already done."""
        self.resume_epoch, self.resume_skip = int(epoch), max(0, int(consumed))
        self.resume_extra = int(extra)
        self.progress_epoch, self.consumed = self.resume_epoch, self.resume_skip

    def __len__(self) -> int:
        """The epoch's positions; in a resumed epoch whose checkpoint counted a smaller batch size, more, so that
        ``ceil(len / batch_size)`` covers the batches the Trainer counts as done plus the batches left."""
        if self.resume_epoch == self.epoch:
            return self.num_samples + self.resume_extra
        return self.num_samples

    def advance(self, n: int) -> None:
        """Count ``n`` positions of the current epoch as consumed by training (the consumer calls this per batch;
        the DataLoader's workers read ahead, so the sampler cannot know by itself)."""
        if self.progress_epoch != self.epoch:
            self.progress_epoch, self.consumed = self.epoch, 0
        self.consumed += int(n)

    def finish_epoch(self) -> None:
        """Count the current epoch as consumed whole: training ended it before its last position (the Trainer's
        ``limit_train_batches``). A state saved from here on resumes at the next epoch, as the Trainer does, instead
        of at the positions this epoch never reached."""
        if self.progress_epoch != self.epoch:
            self.progress_epoch, self.consumed = self.epoch, 0
        self.consumed = max(self.consumed, self.num_samples)

    def layout(self) -> dict[str, int]:
        """What this rank's order depends on besides the seed and the epoch: positions saved under another layout
        name other samples (subclasses add theirs). An unshuffled order says so (``"shuffle": 0``; a state without
        the key was shuffled): an ``overfit_batches`` fit's positions name other samples in a shuffled fit."""
        out = {"num_replicas": self.num_replicas, "drop_last": int(self.drop_last), "num_samples": self.num_samples}
        return out if self.shuffle else {**out, "shuffle": 0}

    def state_dict(self) -> dict[str, int]:
        """Where training is in the epoch: ``{"epoch", "consumed"}`` (positions of this rank's order), with the seed
        and the :meth:`layout` they refer to."""
        return {
            "epoch": self.progress_epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "batch_size": self.batch_size,
            **self.layout(),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`): that epoch's order skips what was consumed.

        A state whose epoch was finished (every position consumed, or fewer than a batch left when the DataLoader drops
        a last partial batch: an end-of-epoch checkpoint) resumes at the start of the next epoch; Lightning builds the
        resumed epoch's iterator before it calls ``set_epoch``, so the sampler must already be there. A state saved
        under another :meth:`layout` (world size, ``drop_last``, shuffle window) resumes at the same fraction of the
        epoch, with a warning: its positions name other samples here, so some of this epoch's samples may be read
        twice or not at all (the step count stays the uninterrupted run's).

        Raises:
            ValueError: the state resumes mid-epoch (some of the epoch consumed, some left) and was saved with another
                shuffle seed (the remaining samples would be others). A finished epoch's state resumes at the next
                epoch, whole, under this sampler's seed.
        """
        saved_seed = int(state.get("seed", self.seed))
        epoch, consumed = int(state.get("epoch", -1)), max(0, int(state.get("consumed", 0)))
        # The Trainer restores the batches it counts as done in the checkpoint's batch size and ends the epoch after
        # `len(loader)` batches: under another batch size, the last batch of the epoch would never be asked for.
        saved_batch = int(state.get("batch_size", 0) or 0)
        done_batches = -(-consumed // saved_batch) if saved_batch > 0 and saved_batch != self.batch_size else None
        here = self.layout()
        saved = {k: int(v) for k, v in state.items() if k not in _POSITION_KEYS}
        moved = bool(epoch >= 0 and consumed and _layouts_differ(saved, here))
        if moved:
            before = saved.get("num_samples") or self.num_samples
            consumed = min(self.num_samples, round(consumed * self.num_samples / before))
        left = self.num_samples - consumed
        # a single position left with `trim_lone_last` is a batch of one that `__iter__` drops: that epoch is over too
        lone = self.trim_lone_last and left == 1 and self.batch_size > 1
        finished = epoch >= 0 and (left <= 0 or lone or (self.loader_drop_last and left < self.batch_size))
        # (an unshuffled order does not depend on the seed: an `overfit_batches` fit resumes under any)
        if saved_seed != self.seed and self.shuffle and epoch >= 0 and consumed and not finished:
            # Checked only here: an end-of-epoch state was refused too, though the message offered it as the fix.
            raise ValueError(
                f"the checkpoint's sampler used `seed` {saved_seed}, this one {self.seed}: resuming mid-epoch "
                "needs the same seed. Set `seed` back, or resume from an end-of-epoch checkpoint."
            )
        if moved:
            warnings.warn(
                f"the checkpoint's sampler state was saved under {saved}, this sampler has {here}: epoch {epoch} "
                f"resumes at the same fraction ({consumed} of {self.num_samples} positions), and some of its samples "
                "may be read twice or not at all. Resume with the same layout for an exact continuation.",
                UserWarning,
                stacklevel=2,
            )
        if finished:
            epoch, consumed = epoch + 1, 0  # that epoch was finished: the next one starts whole
            done_batches = None
        # Only ever longer: the Trainer fixes `len(loader)` once for the whole run, and a shorter resumed epoch would
        # cut the later ones short (a longer one ends them early and naturally, when the sampler runs out).
        extra = 0 if done_batches is None else max(0, done_batches * self.batch_size - consumed)
        self.resume(epoch, consumed, extra)
        if epoch >= 0:
            # Lightning creates the resumed epoch's iterator before it calls `set_epoch` (workers and the read-ahead
            # thread start drawing indices at once): the epoch must be right already.
            self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler``'s; a pending resume skip ends with its epoch."""
        if epoch != self.resume_epoch:
            self.resume_epoch, self.resume_skip, self.resume_extra = -1, 0, 0
        super().set_epoch(epoch)

    def _pass_order(self) -> list[int]:
        """This epoch's order as the next pass yields it (a resumed epoch's skip and a lone last sample dropped)."""
        order = self.epoch_order()
        if self.resume_epoch == self.epoch:
            order = order[self.resume_skip :]
        if self.trim_lone_last and len(order) > self.batch_size and len(order) % self.batch_size == 1:
            order = order[:-1]
        return order

    def _pass_key(self) -> tuple[int, int, int, bool]:
        skip = self.resume_skip if self.resume_epoch == self.epoch else 0
        return self.epoch, skip, self.batch_size, self.trim_lone_last

    def publish_ahead(self) -> None:
        """Publish this epoch's order to the dataset now, before the DataLoader's pass over the sampler; that pass
        (the next ``iter`` of this epoch) then yields the same order without publishing it a second time.

        :class:`CacheDataLoader` calls it before starting its workers so that a packed remote origin stages the first
        batches' shards meanwhile. Publishing twice bumped the order's token and marked those shards needed once
        more, in the main process, on the path to the first batch."""
        order = self._pass_order()
        self._publish(order)
        self._published_ahead = (self._pass_key(), order)

    def _publish(self, order: list[int]) -> None:
        publish = getattr(self.dataset, "publish_order", None)
        if publish is not None:
            n = _finite_limit(self.pass_batches)
            # A pass cut short (`limit_train_batches`) never reached the epoch's last batches: the workers read the
            # origin ahead for batches nobody took, and never committed what they had decoded (write-behind).
            publish(order if n is None else order[: n * self.batch_size], self.batch_size)

    def __iter__(self) -> Iterator[int]:
        ahead, self._published_ahead = self._published_ahead, None
        if ahead is not None and ahead[0] == self._pass_key():
            return iter(ahead[1])
        order = self._pass_order()
        self._publish(order)
        return iter(order)


class SequentialOrderSampler(EpochOrderSampler, SequentialSampler):
    """An unshuffled :class:`EpochOrderSampler` that is also a ``SequentialSampler``.

    Each rank reads ``DistributedSampler(shuffle=False)``'s part (rank ``r`` of ``n`` takes positions ``r, r + n,
    ...``; with one process, every position in order): what Lightning itself makes of a loader under
    ``Trainer(overfit_batches=...)`` (a ``SequentialSampler``, and a ``DistributedSampler`` over it under DDP).
    Lightning replaces, with a warning that the loader shuffles, every sampler of an overfit fit that is not a
    ``SequentialSampler``; this one it keeps, so the loader keeps counting the batches consumed and a run resumed
    mid-epoch continues at the batch the checkpoint was saved at.

    Args:
        dataset: the dataset to sample (its ``publish_order`` is called when present).
        num_replicas: number of ranks.
        rank: this rank.
        seed: recorded in the state (the order does not depend on it).
        drop_last: drop the tail instead of padding to equal shards.
        batch_size: the DataLoader's batch size (see :class:`EpochOrderSampler`).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
    ) -> None:
        super().__init__(
            dataset, num_replicas, rank, shuffle=False, seed=seed, drop_last=drop_last, batch_size=batch_size
        )
        self.data_source = dataset  # type: ignore[assignment]  # SequentialSampler's attribute (a sized dataset)


def check_warm_num_workers(value: object) -> None:
    """``warm_num_workers`` as :class:`CacheDataLoader` and the data module take it: 0 or more, or None."""
    check_int(
        "warm_num_workers",
        value,
        low=0,
        allow_none=True,
        fix="0 reads warm batches in the main process; None keeps `num_workers`.",
    )


# The keys of a sampler's state that are positions, not layout; and the value a layout key has for a sampler that
# does not list it (a global shuffle has no window; a shuffled order lists no `shuffle`). A key without a default that
# one side lacks is not compared: states saved before the key existed resume as they did.
_POSITION_KEYS = frozenset({"epoch", "consumed", "seed", "batch_size"})
_LAYOUT_DEFAULTS = {"window": 0, "shuffle": 1}


def _layouts_differ(saved: dict[str, int], here: dict[str, int]) -> bool:
    """True when a sampler state saved under ``saved`` names other samples under ``here`` (compared over the keys of
    both: a switch between the global and the shard-window shuffle changes the order, though only one lists a
    window)."""
    for key in saved.keys() | here.keys():
        a, b = saved.get(key, _LAYOUT_DEFAULTS.get(key)), here.get(key, _LAYOUT_DEFAULTS.get(key))
        if a is not None and b is not None and a != b:
            return True
    return False


class CacheDataLoader(DataLoader):
    """A ``DataLoader`` for :class:`CachedDataset` that picks the fastest path per epoch.

    Cold epochs (some samples not cached) run with ``num_workers`` worker processes, because decoding is CPU-bound and
    parallelises. Once every sample of the epoch is cached (the samples this rank reads: the sampler's order of the
    epoch, under DDP this rank's part), epochs run with ``warm_num_workers`` (default 0: batch reads in the main
    process, ahead of the consumer on one background thread). On a machine with few cores, main-process batch reads
    are faster than the same reads in workers (the warm and warm-workers rows of ``benchmarks/data_cache.py``),
    because each worker must allocate and fill a fresh 9.6 MB shared-memory batch (slower than private memory) and
    competes with the main process for the cores. On machines with many idle cores, set ``warm_num_workers`` to
    ``num_workers``.

    The main-process path reads whole batches on one background thread (``read_threads``), ``read_ahead`` batches
    ahead, so the reads overlap with the training step; batches are filled into recycled buffers
    (:class:`~lightning_accel.data.buffers.BufferPool`). One thread is the default because more are slower on
    few cores: they contend for the GIL on every per-sample copy (measured with ``benchmarks/data_cache.py``).
    Switching is one-way (cold -> warm) and checked at the start of each epoch.

    Args:
        dataset: the dataset.
        warm_num_workers: workers once the cache is warm (``None``: never switch).
        read_ahead: batches the main-process path reads ahead of the consumer (0: read on demand, no threads).
        read_threads: threads that read those batches in parallel, 1 to 1024 (default 1, see above).
        on_epoch_end: called (no arguments) in the iterating process when a pass over the loader reaches its last
            batch (just before handing it out, its samples read) or ends, e.g. to report what the epoch skipped;
            not called for a pass abandoned early.
        batch_transform: ``fn(batch, k)`` applied to the ``k``-th batch of each pass (from 0, in sampler order) on a
            background thread of the iterating process, ``transform_ahead`` batches ahead of the consumer, so the work
            overlaps with the consumer's (e.g. CPU augmentation beside the training step: torch ops release the GIL).
            One thread, batches in order: a function that counts (a random stream) sees them as the consumer would.
        transform_ahead: batches ``batch_transform`` runs ahead of the consumer.
        pass_batches: ``fn()`` giving the most batches the consumer takes of a pass (``None``, ``inf`` or no
            function: all of them), e.g. a Trainer's ``limit_train_batches`` / ``overfit_batches``, asked at the start
            of each pass. A pass then yields at most that many batches (``len(loader)`` stays the whole epoch's), so
            neither the read-ahead nor the workers' prefetch reads batches the consumer never takes, and the warm
            check looks only at the samples of those batches (a check over the whole order kept the loader cold for
            good).
        warm_check: ``fn()`` false when the coming pass must not switch the loader to the warm path, e.g. a Trainer's
            sanity check (bounded by ``pass_batches`` to 2 batches, which say nothing of the passes after it: the
            switch is one-way); ``None``: every pass may.
        **kwargs: ``DataLoader`` arguments (``collate_fn`` defaults to :func:`collate_batch`).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        warm_num_workers: int | None = 0,
        read_ahead: int = 4,
        read_threads: int | None = None,
        on_epoch_end: Callable[[], None] | None = None,
        batch_transform: Callable[[Any, int], Any] | None = None,
        transform_ahead: int = 2,
        pass_batches: Callable[[], float | None] | None = None,
        warm_check: Callable[[], bool] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("collate_fn", collate_batch)
        check_int("transform_ahead", transform_ahead, low=1, fix="It counts batches transformed ahead of the consumer.")
        if pass_batches is not None and not callable(pass_batches):
            raise TypeError(
                f"`pass_batches` must be a callable `fn() -> int | None` or None, got {pass_batches!r} "
                f"({type(pass_batches).__name__}). Pass e.g. `lambda: trainer.num_training_batches`."
            )
        if warm_check is not None and not callable(warm_check):
            raise TypeError(
                f"`warm_check` must be a callable `fn() -> bool` or None, got {warm_check!r} "
                f"({type(warm_check).__name__}). Pass e.g. `lambda: not trainer.sanity_checking`."
            )
        super().__init__(dataset, **kwargs)
        check_warm_num_workers(warm_num_workers)
        if isinstance(self.sampler, EpochOrderSampler) and self.batch_size is not None:
            self.sampler.batch_size = self.batch_size  # the batches workers map to the order are this loader's
            self.sampler.loader_drop_last = bool(self.drop_last)
            self.sampler.pass_batches = pass_batches
        self.cold_num_workers = self.num_workers
        self.warm_num_workers = warm_num_workers
        self.read_ahead = check_int("read_ahead", read_ahead, low=0, fix="It counts batches read ahead (0: none).")
        # Each is a thread, and the batches in flight grow with them: 10**6 read the whole epoch ahead into memory.
        check_int(
            "read_threads",
            read_threads,
            low=1,
            high=MAX_CONCURRENCY,
            allow_none=True,
            fix="None reads on one thread (the fastest on few cores).",
        )
        self.read_threads = 1 if read_threads is None else read_threads
        self.is_warm = False
        self.on_epoch_end = on_epoch_end
        self.batch_transform = batch_transform
        self.transform_ahead = transform_ahead
        self.pass_batches = pass_batches
        self.warm_check = warm_check

    def _bounded_index_sampler(self, base: Any) -> Any:
        # What every pass draws its batches' indices from, on every path (the DataLoader's own iterators, persistent
        # workers included, and `_parallel_batches`): bounded here, the read-ahead thread and the workers' prefetch
        # stop at the batches the consumer takes. Four batches read ahead and two per worker were read past a pass
        # of one or two batches (`limit_train_batches`), each a cold read from the origin.
        return base if self.pass_batches is None else _FirstBatches(base, self.pass_batches)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position (Lightning saves a train loader's ``state_dict`` in the checkpoint and restores it
        on a mid-epoch resume)."""
        sd = getattr(self.sampler, "state_dict", None)
        return {"sampler": sd()} if sd is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the sampler skips what the checkpointed run had consumed of that epoch."""
        load = getattr(self.sampler, "load_state_dict", None)
        if load is not None and "sampler" in state:
            load(state["sampler"])

    def _check_warm(self) -> None:
        if self.is_warm or self.warm_num_workers is None or self.warm_num_workers == self.cold_num_workers:
            return
        if self.warm_check is not None and not self.warm_check():
            return
        if not self._pass_cached():
            return
        self.is_warm = True
        if hasattr(self.dataset, "prefetch_batches"):
            self.dataset.prefetch_batches = 0  # everything is cached: skip the per-batch "what is missing" lookups
        # The cold workers are idle: stop them behind, while this epoch already reads in the main process.
        shutdown_persistent_workers(self, wait=False)
        self.num_workers = self.warm_num_workers
        if self.num_workers > 0 and self.prefetch_factor is None:
            self.prefetch_factor = 2

    def _pass_cached(self) -> bool:
        """Whether every sample the coming pass reads is cached: this rank's order of the epoch (that of an
        :class:`EpochOrderSampler` of this dataset, or of the ``SequentialSampler`` / ``DistributedSampler`` Lightning
        puts in for ``overfit_batches``), cut to the batches ``pass_batches`` says the consumer takes; else the whole
        dataset.

        Why this rank's order: a rank only reads its part of the split, and a node's cache holds what its ranks read.
        Over the whole split, a node of a multi-node job (whose other nodes read the rest) never found its cache
        complete: its unshuffled validation loader stayed cold for good, as a rank on its own node did."""
        ds = self.dataset
        if isinstance(ds, CachedDataset):
            s = self.sampler
            order: Sequence[int] | None = None
            if isinstance(s, EpochOrderSampler) and s.dataset is ds:
                order = s._pass_order()
            elif isinstance(s, SequentialSampler) and s.data_source is ds:
                order = range(len(ds))  # what Lightning puts in for `overfit_batches`
            elif isinstance(s, DistributedSampler) and s.dataset is ds:
                # Lightning's, over that `SequentialSampler`, under DDP: this rank's part, fixed by the seed and the
                # epoch (no random state drawn). Over the whole split, the ranks' 2 batches never made it complete.
                order = list(s)
            n = _finite_limit(self.pass_batches)  # the batches the pass takes, as `_FirstBatches` cuts them
            if order is not None and self.batch_size and n is not None:
                order = order[: n * self.batch_size]
            return ds.cached_fraction(positions=order) >= 1.0
        frac = getattr(ds, "cached_fraction", None)
        return frac is not None and frac() >= 1.0

    def __iter__(self) -> Any:
        it = self._iter()
        fn = self.batch_transform
        if fn is not None:
            it = _read_ahead((fn(b, k) for k, b in enumerate(it)), self.transform_ahead, name="la-transform-ahead")
        if self.on_epoch_end is None:
            return it
        return _then(it, self._pass_batches(), self.on_epoch_end)

    def _pass_batches(self) -> int | None:
        """The batches this pass yields (None: unknown). ``len(self)`` but in a resumed epoch, whose pass yields only
        the batches not yet seen while its length stays the whole epoch's, and in a pass ``pass_batches`` cuts short:
        the Trainer stops asking after those, so counting to ``len(self)`` would never reach the pass's end (its
        report came only at teardown)."""
        try:
            n = len(self)
        except TypeError:  # a sampler without a length
            return None
        s, bs = self.sampler, self.batch_size
        if isinstance(s, EpochOrderSampler) and s.resume_epoch == s.epoch and s.resume_skip > 0 and bs:
            left = max(0, s.num_samples - s.resume_skip)
            n = left // bs if self.drop_last else -(-left // bs)
        cut = _finite_limit(self.pass_batches)  # as `_FirstBatches` cuts the pass
        return n if cut is None else min(n, cut)

    def _iter(self) -> Any:
        self._check_warm()
        cache = getattr(self.dataset, "cache", None)
        if (
            not self.is_warm
            and isinstance(self.sampler, EpochOrderSampler)
            and getattr(cache, "packed", None) is not None
            and getattr(cache, "prefetch", False)
        ):
            # A packed remote origin: publish this epoch's order now (the sampler stages the first batches' shards
            # as it publishes), so the downloads overlap with starting the workers. The DataLoader's own pass over
            # the sampler yields that order without publishing it again.
            self.sampler.publish_ahead()
        if self.num_workers == 0 and self.read_ahead > 0:
            if self.batch_sampler is not None and self.read_threads > 1:
                return _parallel_batches(self, self.read_threads, self.read_ahead)
            return _read_ahead(super().__iter__(), self.read_ahead)
        pool = getattr(cache, "buffers", None)
        if not self.is_warm and self.warm_num_workers == 0 and self.read_ahead > 0 and pool is not None:
            return _reserving(super().__iter__(), pool, self.read_ahead + 3)
        return super().__iter__()


wrap_index_sampler(CacheDataLoader, CacheDataLoader._bounded_index_sampler)


class _FirstBatches:
    """``base`` (a batch sampler, or a sampler under automatic batching off) cut to the first ``limit()`` items of each
    pass, ``limit()`` asked as the pass starts (``None`` or ``inf``: all); its length stays ``base``'s."""

    def __init__(self, base: Any, limit: Callable[[], float | None]) -> None:
        self.base = base
        self.limit = limit

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Iterator[Any]:
        n = _finite_limit(self.limit)
        it = iter(self.base)
        return it if n is None else itertools.islice(it, n)


def _finite_limit(limit: Callable[[], float | None] | None) -> int | None:
    """``limit()`` as a count of batches (at least 0); None for no function, ``None`` or a non-finite value."""
    n = limit() if limit is not None else None
    if isinstance(n, numbers.Real) and not isinstance(n, bool) and math.isfinite(n):
        return max(0, int(n))
    return None


def _then(it: Iterator[Any], n: int | None, done: Callable[[], None]) -> Iterator[Any]:
    """``it``'s items, calling ``done()`` just before the ``n``-th (the pass's last) is handed out, or when ``it`` ends
    sooner. Not at exhaustion only: Lightning stops asking after the loader's length and never reaches it."""
    called = False
    for k, item in enumerate(it, 1):
        if k == n:
            called = True
            done()
        yield item
    if not called:
        done()


def _parallel_batches(loader: DataLoader, threads: int, depth: int) -> Iterator[Any]:
    """Main-process batches read by ``threads`` threads, yielded in sampler order, at most ``depth`` ahead."""
    from lightning_accel._utils.compat import pin_memory

    ds: Any = loader.dataset
    collate = loader.collate_fn
    pin = bool(loader.pin_memory) and torch.cuda.is_available()

    def work(idx: list[int]) -> Any:
        data = ds.__getitems__(idx) if hasattr(ds, "__getitems__") else [ds[i] for i in idx]
        out = collate(data)
        return pin_memory(out) if pin else out

    pool = ThreadPoolExecutor(threads, thread_name_prefix="la-read")
    pending: deque[Future[Any]] = deque()
    try:
        assert loader.batch_sampler is not None
        for idx in index_sampler(loader):  # the batch sampler, cut to the batches the pass takes
            pending.append(pool.submit(work, idx))
            if len(pending) >= max(depth, threads):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=False)


def _reserving(it: Iterator[Any], pool: BufferPool, count: int) -> Iterator[Any]:
    """Yield ``it`` (a cold epoch's worker batches); after its first batch, fault in ``count`` buffers of that batch's
    shape in ``pool`` on a thread, for the main-process reads of the first warm epoch.

    Why: those reads fill recycled buffers, but the first warm epoch found the pool empty and paid the page faults of
    every fresh 9.6 MB buffer (~2,350 faults each at 224 px: a visible share of its CPU, see the first-warm row of
    ``benchmarks/data_cache.py``). Here the faults are taken once, early in the cold epoch, while the main process waits
    for the workers (little CPU against a cold epoch of seconds). The thread keeps the normal priority: a lowered one
    would hold the GIL while the scheduler starves it and stall the main thread.
    """
    first = True
    for batch in it:
        if first:
            first = False
            images = batch[0] if isinstance(batch, (tuple, list)) and batch else None
            if isinstance(images, torch.Tensor) and images.dim() > 1:
                # not a daemon: a daemon thread inside torch at interpreter exit aborts the process
                threading.Thread(
                    target=pool.reserve, args=(tuple(images.shape), images.dtype, count), name="la-reserve-buffers"
                ).start()
        yield batch


#: the running :func:`_read_ahead` producers, stopped and joined at interpreter exit
_PRODUCERS: set[tuple[threading.Event, threading.Thread]] = set()
_PRODUCER_EXIT_WAIT_S = 10.0


def _stop_producers() -> None:
    """Stop and join the producers that are still running when the interpreter exits.

    Why: a daemon thread still inside torch (a transform, a tensor freed) when the interpreter shuts down is killed
    there, in C++ that cannot unwind, and the whole process aborts (SIGABRT) after a successful fit; a launcher such as
    torchrun then reports the run failed. This runs while threads can still finish, before the interpreter's
    executors stop taking work (a producer may be reading through one).
    """
    live = list(_PRODUCERS)
    for stop, _ in live:
        stop.set()
    deadline = time.monotonic() + _PRODUCER_EXIT_WAIT_S
    for _, t in live:
        t.join(max(0.0, deadline - time.monotonic()))


register_before_thread_shutdown(_stop_producers)


def _read_ahead(it: Iterator[Any], depth: int, name: str = "la-read-ahead") -> Iterator[Any]:
    """Iterate ``it`` on a daemon thread (``name``), ``depth`` items ahead of the consumer; errors re-raise in the
    consumer. Closing the consumer early stops the thread and waits (at most :data:`_PRODUCER_EXIT_WAIT_S`) for the item
    it is producing; so does interpreter exit."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(msg: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in it:
                if not put(("item", item)):
                    return
            put(("end", None))
        except BaseException as e:  # delivered to the consumer
            put(("error", e))

    t = threading.Thread(target=produce, name=name, daemon=True)
    entry = (stop, t)
    _PRODUCERS.add(entry)
    t.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        if t is not threading.current_thread():
            t.join(_PRODUCER_EXIT_WAIT_S)
        _PRODUCERS.discard(entry)
