"""Shard-aware shuffling for packed origins: each rank reads within a window of shards.

A packed remote origin is read a whole shard at a time into a node-local stage directory of ``stage_bytes``
(:class:`~lightning_accel.data.pack.PackedReader`). Under a global shuffle every batch touches nearly every shard, so a
stage smaller than the pack downloads each shard many times per epoch (``benchmarks/_data_shards.py --quick``:
``stage_bytes`` = 1/4 of the pack, 2 workers: 48x the data in one cold epoch; the window shuffle: 1.00x).
:func:`windowed_order` shuffles the way LitData and MosaicML Streaming (``py1b``-like blocks) do instead:

1. shuffle the shards (seeded by ``seed`` and ``epoch``, the same on every rank);
2. concatenate their samples in that order, pad (repeating the head) or drop the tail to a multiple of the number of
   ranks, and give each rank one contiguous part: a rank's samples lie in a contiguous run of shards, so the ranks of
   a node share at most the shards at the borders of their parts with other nodes;
3. cut each rank's part into blocks of ``window`` shards' worth of samples and shuffle inside each block (seeded by
   ``seed``, ``epoch`` and the rank).

A rank therefore reads from at most ``window + 1`` shards at a time (plus the next block's first shards while it
reads ahead), each shard's samples come in one stretch, and a finished block's shards are never read again that
epoch: with the stage's least-recently-*used* eviction they are the first to go. The price is less randomness: a batch
draws from ``window`` shards, not the whole data set. Pack with ``pack_origin(..., shuffle_seed=...)`` so that shards
hold a random mix of classes; the measured cost on the digits task is in ``docs/data.md``.
"""

from __future__ import annotations

import array
import math
import zlib
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from lightning_accel._utils.checks import check_int
from lightning_accel.data.dataset import EpochOrderSampler

__all__ = ["ShardWindowSampler", "auto_window", "windowed_order"]

_WINDOW_FIX = "It counts the shards shuffled together."


def _rng(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def windowed_order(
    shard_of: Sequence[int],
    *,
    epoch: int,
    seed: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
    window: int = 4,
    drop_last: bool = False,
) -> list[int]:
    """This rank's order of ``range(len(shard_of))`` for ``epoch`` (see the module docstring).

    Args:
        shard_of: the shard of each position.
        epoch: the epoch (the order changes every epoch, deterministically).
        seed: the shuffle seed (identical on every rank).
        num_replicas: number of ranks.
        rank: this rank.
        window: shards' worth of samples shuffled together.
        drop_last: drop the tail that does not divide evenly among the ranks instead of padding it.

    Returns:
        The positions this rank reads, ``ceil(n / num_replicas)`` of them (``floor`` with ``drop_last``). The ranks'
        lists are disjoint except for the padding, which repeats the first positions of the epoch's sequence.

    Raises:
        TypeError: ``window`` or ``rank`` is not an integer.
        ValueError: ``window`` < 1 or ``rank`` outside ``[0, num_replicas)``.
    """
    check_int("shuffle_window", window, low=1, fix=_WINDOW_FIX)
    check_int("rank", rank, low=0, high=num_replicas - 1, fix=f"There are {num_replicas} ranks.")
    n = len(shard_of)
    if n == 0:
        return []
    groups: dict[int, list[int]] = {}
    for pos, s in enumerate(shard_of):
        groups.setdefault(int(s), []).append(pos)
    shards = sorted(groups)
    perm = torch.randperm(len(shards), generator=_rng(seed, epoch)).tolist()
    seq = [pos for j in perm for pos in groups[shards[j]]]
    if drop_last:
        per = n // num_replicas
        seq = seq[: per * num_replicas]
    else:
        per = math.ceil(n / num_replicas)
        pad = per * num_replicas - n
        seq += (seq * math.ceil(pad / n))[:pad] if pad else []
    part = seq[rank * per : (rank + 1) * per]
    block = max(1, window * math.ceil(n / len(shards)))
    g = _rng(seed, epoch, rank, 1)
    out: list[int] = []
    for lo in range(0, len(part), block):
        chunk = part[lo : lo + block]
        out.extend(chunk[i] for i in torch.randperm(len(chunk), generator=g).tolist())
    return out


def auto_window(stage_bytes: int, shard_bytes: Sequence[int], local_ranks: int = 1) -> int:
    """The widest window whose shards fit the stage: every rank of the node holds its current block and the next
    one's first shards (read-ahead), i.e. about ``2 * (window + 1)`` shards per rank, of the largest size."""
    biggest = max(1, max(shard_bytes, default=1))
    per_rank = stage_bytes // biggest // max(1, local_ranks)
    return max(1, per_rank // 2 - 1)


class ShardWindowSampler(EpochOrderSampler):
    """An :class:`~lightning_accel.data.dataset.EpochOrderSampler` whose order is :func:`windowed_order`.

    Args:
        dataset: the dataset to sample (its ``publish_order`` is called when present).
        shard_of: the shard of each dataset position.
        num_replicas: number of ranks.
        rank: this rank.
        window: shards' worth of samples shuffled together.
        seed: shuffle seed.
        drop_last: drop the tail instead of padding to equal parts.
        batch_size: the DataLoader's batch size (to map a batch to its position in the order).
    """

    def __init__(
        self,
        dataset: Dataset,
        shard_of: Sequence[int],
        *,
        num_replicas: int = 1,
        rank: int = 0,
        window: int = 4,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
    ) -> None:
        super().__init__(
            dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=drop_last, batch_size=batch_size
        )
        n = len(dataset)  # type: ignore[arg-type]  # a map-style dataset has a length
        if len(shard_of) != n:
            raise ValueError(f"`shard_of` has {len(shard_of)} entries for a dataset of {n}.")
        check_int("shuffle_window", window, low=1, fix=_WINDOW_FIX)
        self.shard_of = [int(s) for s in shard_of]
        self.window = window
        # The order also follows which shard each sample is in: a re-pack (other shard sizes, other files) moves the
        # samples between shards, and the same positions name others. Fixed here; `layout` runs at every save.
        self._shards_crc = zlib.crc32(array.array("q", self.shard_of).tobytes())

    def layout(self) -> dict[str, int]:
        return {**super().layout(), "window": self.window, "shards": self._shards_crc}

    def epoch_order(self) -> list[int]:
        return windowed_order(
            self.shard_of,
            epoch=self.epoch,
            seed=self.seed,
            num_replicas=self.num_replicas,
            rank=self.rank,
            window=self.window,
            drop_last=self.drop_last,
        )
