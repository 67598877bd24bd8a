"""Shard-aware shuffling: the window order's contract, its state for mid-epoch resume, and the bytes it fetches."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.data import (
    CacheDataLoader,
    CachedDataset,
    EpochOrderSampler,
    ImageDecoder,
    LmdbTier,
    ObjectStore,
    SampleCache,
    list_origin,
    pack_origin,
)
from lightning_accel.data.sampler import ShardWindowSampler, auto_window, windowed_order


def _shards(n: int, per: int) -> list[int]:
    return [i // per for i in range(n)]


@pytest.mark.parametrize(("n", "ranks"), [(95, 4), (100, 1), (7, 3)])
def test_window_order_is_a_deterministic_disjoint_split_within_windows(n: int, ranks: int) -> None:
    shard_of = _shards(n, 10)
    parts = [windowed_order(shard_of, epoch=2, seed=5, num_replicas=ranks, rank=r, window=2) for r in range(ranks)]
    per = -(-n // ranks)
    assert [len(p) for p in parts] == [per] * ranks
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(n))  # everything once, plus the padding's repeats of the first positions
    assert len(flat) - len(set(flat)) == per * ranks - n
    again = [windowed_order(shard_of, epoch=2, seed=5, num_replicas=ranks, rank=r, window=2) for r in range(ranks)]
    assert again == parts
    # each block of `window` shards' samples spans at most window + 1 shards, and a rank never returns to a shard
    # it finished (a staged shard is used in one stretch)
    for p in parts:
        blocks = [p[lo : lo + 20] for lo in range(0, len(p), 20)]
        assert all(len({shard_of[i] for i in b}) <= 3 for b in blocks)
        where: dict[int, list[int]] = {}
        for k, b in enumerate(blocks):
            for s in {shard_of[i] for i in b}:
                where.setdefault(s, []).append(k)
        assert all(ks == list(range(ks[0], ks[0] + len(ks))) and len(ks) <= 2 for ks in where.values())
    other = windowed_order(shard_of, epoch=3, seed=5, num_replicas=ranks, rank=0, window=2)
    assert other != parts[0] or n < 10  # a new order every epoch


class _Orders(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.published: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def publish_order(self, order: list[int], batch_size: int) -> None:
        self.published.append(list(order))


@pytest.mark.parametrize("window", [None, 2])
def test_an_order_published_ahead_is_the_next_pass_and_is_published_once(window: int | None) -> None:
    ds = _Orders(40)
    if window is None:
        s: EpochOrderSampler = EpochOrderSampler(ds, seed=3, batch_size=8)
    else:
        s = ShardWindowSampler(ds, _shards(40, 10), window=window, seed=3, batch_size=8)
    s.set_epoch(1)
    s.publish_ahead()
    assert list(s) == ds.published[0] and len(ds.published) == 1  # the pass yields what was published, once
    assert list(s) == ds.published[0] and len(ds.published) == 2  # a later pass publishes again
    s.publish_ahead()
    s.set_epoch(2)  # another epoch: the order published ahead is not it
    order = list(s)
    assert order == ds.published[-1] and order != ds.published[0] and len(ds.published) == 4


def test_window_order_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`shuffle_window`"):
        windowed_order([0, 0], epoch=0, window=0)
    with pytest.raises(ValueError, match=r"`rank` must be an integer >= 0 and <= 1, got 2\. There are 2 ranks"):
        windowed_order([0, 0], epoch=0, num_replicas=2, rank=2)
    with pytest.raises(TypeError, match=r"`shuffle_window` must be an integer >= 1, got True \(bool\)"):
        windowed_order([0, 0], epoch=0, window=True)
    assert auto_window(16 << 20, [4 << 20] * 10) == 1
    assert auto_window(64 << 20, [4 << 20] * 10, local_ranks=2) == 3


def test_sampler_state_resumes_the_epoch_where_training_stopped() -> None:
    ds: Any = list(range(50))
    a = ShardWindowSampler(ds, _shards(50, 10), window=2, seed=1, batch_size=8)
    a.set_epoch(3)
    full = list(a)
    a.advance(8)
    a.advance(8)
    state = a.state_dict()
    layout = {"num_replicas": 1, "drop_last": 0, "num_samples": 50, "window": 2}
    position = {"epoch": 3, "consumed": 16, "seed": 1, "batch_size": 8}
    assert {k: v for k, v in state.items() if k != "shards"} == {**position, **layout}
    b = ShardWindowSampler(ds, _shards(50, 10), window=2, seed=1, batch_size=8)
    b.load_state_dict(state)
    b.set_epoch(3)
    assert list(b) == full[16:] and list(b) == full[16:]  # the tail, however often the loader iterates it
    assert len(b) == 50  # the Trainer counts the batches already done itself
    b.set_epoch(4)
    assert len(list(b)) == 50  # the next epoch is whole again
    c = EpochOrderSampler(ds, seed=2)
    with pytest.raises(ValueError, match="`seed`"):
        c.load_state_dict(state)


def test_a_finished_epoch_resumes_at_the_next_one_before_set_epoch() -> None:
    """An end-of-epoch state: the next epoch must be whole already when the loader's workers draw its indices (Lightning
    builds the iterator before it calls ``set_epoch``)."""
    ds: Any = list(range(20))
    a = EpochOrderSampler(ds, seed=1, batch_size=8)
    a.set_epoch(4)
    a.advance(20)
    nxt = EpochOrderSampler(ds, seed=1, batch_size=8)
    nxt.set_epoch(5)
    b = EpochOrderSampler(ds, seed=1, batch_size=8)
    b.load_state_dict(a.state_dict())
    assert b.epoch == 5 and list(b) == list(nxt)
    # a loader that drops the last partial batch: 4 positions left are no batch, the epoch was finished too
    a.set_epoch(4)
    a.consumed = 16
    c = EpochOrderSampler(ds, seed=1, batch_size=8)
    c.loader_drop_last = True
    c.load_state_dict(a.state_dict())
    assert c.epoch == 5 and list(c) == list(nxt)
    d = EpochOrderSampler(ds, seed=1, batch_size=8)  # without it those 4 are one more batch of epoch 4
    d.load_state_dict(a.state_dict())
    assert d.epoch == 4 and len(list(d)) == 4


def test_another_seed_is_refused_mid_epoch_only() -> None:
    """The refusal names an end-of-epoch checkpoint as the way to change the seed: such a state must resume (at the
    next epoch, whole, in the new seed's order), as one saved before the epoch's first batch."""
    ds: Any = list(range(20))
    a = EpochOrderSampler(ds, seed=1, batch_size=8)
    a.set_epoch(4)
    a.advance(8)
    b = EpochOrderSampler(ds, seed=2, batch_size=8)
    with pytest.raises(ValueError, match=r"^the checkpoint's sampler used `seed` 1, this one 2: resuming mid-epoch"):
        b.load_state_dict(a.state_dict())
    a.advance(16)  # the epoch is over
    nxt = EpochOrderSampler(ds, seed=2, batch_size=8)
    nxt.set_epoch(5)
    b.load_state_dict(a.state_dict())
    assert b.epoch == 5 and list(b) == list(nxt)
    a.set_epoch(6)
    a.consumed, a.progress_epoch = 0, 6  # saved before epoch 6's first batch: nothing of it to continue
    c = EpochOrderSampler(ds, seed=2, batch_size=8)
    c.load_state_dict(a.state_dict())
    nxt.set_epoch(6)
    assert c.epoch == 6 and list(c) == list(nxt)


def test_a_state_of_another_layout_resumes_at_the_same_fraction_with_a_warning() -> None:
    ds: Any = list(range(40))
    two = EpochOrderSampler(ds, num_replicas=2, rank=0, seed=1, batch_size=4)
    two.set_epoch(2)
    two.advance(8)  # 8 of this rank's 20 positions
    one = EpochOrderSampler(ds, seed=1, batch_size=4)
    with pytest.warns(UserWarning, match=r"resumes at the same fraction \(16 of 40 positions\)"):
        one.load_state_dict(two.state_dict())
    assert one.epoch == 2 and len(list(one)) == 24
    same = EpochOrderSampler(ds, num_replicas=2, rank=0, seed=1, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(two.state_dict())  # the same layout: exact, silent
    assert len(list(same)) == 12


def test_a_switch_of_shuffle_or_a_repack_is_another_layout() -> None:
    """The global and the shard-window shuffle order one data set differently, and so does the window shuffle of a
    re-packed one: a state saved under one resumes under the other with the warning, never silently."""
    ds: Any = list(range(40))
    window = ShardWindowSampler(ds, _shards(40, 8), window=2, seed=1, batch_size=4)
    window.set_epoch(1)
    full = list(window)
    window.advance(12)
    glob = EpochOrderSampler(ds, seed=1, batch_size=4)
    glob.set_epoch(1)
    glob.advance(12)
    cases = [
        (window.state_dict(), EpochOrderSampler(ds, seed=1, batch_size=4)),  # window -> global
        (glob.state_dict(), ShardWindowSampler(ds, _shards(40, 8), window=2, seed=1, batch_size=4)),  # and back
        (window.state_dict(), ShardWindowSampler(ds, _shards(40, 5), window=2, seed=1, batch_size=4)),  # re-packed
    ]
    for state, resumed in cases:
        with pytest.warns(UserWarning, match=r"resumes at the same fraction \(12 of 40 positions\)"):
            resumed.load_state_dict(state)
    old = {k: v for k, v in window.state_dict().items() if k != "shards"}  # saved before the shards were recorded
    for state in (window.state_dict(), old):
        same = ShardWindowSampler(ds, _shards(40, 8), window=2, seed=1, batch_size=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            same.load_state_dict(state)  # exact, silent
        same.set_epoch(1)
        assert list(same) == full[12:]


def _loader(url: str, opts: dict[str, Any], tmp: Path, stage_bytes: int, window: int | None) -> CacheDataLoader:
    store = ObjectStore(url, opts)
    listing = list_origin(store)
    assert listing.pack is not None
    cache = SampleCache(
        store,
        listing,
        ImageDecoder(16),
        ssd=LmdbTier(tmp / "ssd", 64 << 20),
        stage_dir=tmp / "shards",
        stage_bytes=stage_bytes,
        prefetch=True,
    )
    ds = CachedDataset(cache, prefetch_batches=2)
    sampler: EpochOrderSampler
    if window is None:
        sampler = EpochOrderSampler(ds, seed=0, batch_size=8)
    else:
        sampler = ShardWindowSampler(ds, listing.pack.shard, window=window, seed=0, batch_size=8)
    return CacheDataLoader(ds, batch_size=8, sampler=sampler, num_workers=0)


def _count_publish(published: list[int], publish: Any, order: list[int], batch_size: int) -> None:
    published.append(len(order))
    publish(order, batch_size)


def test_window_shuffle_fetches_a_quarter_stage_pack_about_once(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_path: Path
) -> None:
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/packed"
    listing = pack_origin(str(small_digits), url, dest_storage_options=opts, shard_bytes=8_000, shuffle_seed=0)
    assert listing.pack is not None and len(listing.pack.shards) >= 16
    pack_bytes = sum(listing.pack.shard_sizes)
    stage = pack_bytes // 4
    window = auto_window(stage, listing.pack.shard_sizes)
    fetched = {}
    for name, w in (("window", window), ("global", None)):
        loader = _loader(url, opts, tmp_path / name, stage, w)
        ds: Any = loader.dataset
        published: list[int] = []
        ds.publish_order = functools.partial(_count_publish, published, ds.publish_order)
        seen = torch.cat([y for _, y in loader])
        assert sorted(seen.tolist()) == sorted(listing.labels)  # every sample once
        assert published == [len(listing.labels)]  # published ahead of the pass, not again by it
        fetched[name] = loader.dataset.stats.as_dict()["bytes_fetched"]  # type: ignore[attr-defined]
        staged = sum(p.stat().st_size for p in (tmp_path / name / "shards").glob("*.shard"))
        assert staged <= stage + max(listing.pack.shard_sizes)
    assert fetched["window"] <= 1.1 * pack_bytes
    assert fetched["global"] > 1.5 * pack_bytes  # what the window avoids: shards evicted before their last use


def test_shuffled_pack_mixes_classes_and_keeps_the_listing(small_digits: Path, tmp_path: Path) -> None:
    plain = pack_origin(str(small_digits), str(tmp_path / "a"), shard_bytes=8_000)
    mixed = pack_origin(str(small_digits), str(tmp_path / "b"), shard_bytes=8_000, shuffle_seed=0)
    assert plain.pack is not None and mixed.pack is not None
    assert mixed.keys == plain.keys and mixed.labels == plain.labels

    def classes_per_shard(listing: Any) -> float:
        per: dict[int, set[int]] = {}
        for s, y in zip(listing.pack.shard, listing.labels, strict=True):
            per.setdefault(s, set()).add(y)
        return sum(len(v) for v in per.values()) / len(per)

    assert classes_per_shard(plain) <= 2.5 < 5 <= classes_per_shard(mixed)
    a = SampleCache(ObjectStore(str(tmp_path / "a")), plain, ImageDecoder(16))
    b = SampleCache(ObjectStore(str(tmp_path / "b")), list_origin(ObjectStore(str(tmp_path / "b"))), ImageDecoder(16))
    idx = [0, 17, 99, 150, 199]
    assert torch.equal(a.load(idx).images, b.load(idx).images)


def test_the_unshuffled_sampler_is_the_sequential_order_lightning_keeps() -> None:
    """Lightning keeps only a ``SequentialSampler`` under ``overfit_batches``: the unshuffled sampler is one, and each
    rank reads ``DistributedSampler(shuffle=False)``'s part, as Lightning's own sampler for a plain loader gives it.
    Its state names the unshuffled order: a shuffled sampler resumes it with the layout warning, never silently."""
    from torch.utils.data import DistributedSampler, SequentialSampler

    from lightning_accel.data.dataset import SequentialOrderSampler

    ds: Any = list(range(21))
    assert list(SequentialOrderSampler(ds)) == list(range(21))
    for rank in range(2):
        s = SequentialOrderSampler(ds, 2, rank, batch_size=4)
        assert isinstance(s, SequentialSampler) and isinstance(s, EpochOrderSampler) and s.data_source is ds
        s.set_epoch(3)
        assert list(s) == list(DistributedSampler(ds, 2, rank, shuffle=False)) and len(s) == 11
    s = SequentialOrderSampler(ds, batch_size=4)
    s.advance(8)
    assert s.state_dict()["shuffle"] == 0 and "shuffle" not in EpochOrderSampler(ds, batch_size=4).layout()
    with pytest.warns(UserWarning, match="resumes at the same fraction"):
        EpochOrderSampler(ds, batch_size=4).load_state_dict(s.state_dict())
    again = SequentialOrderSampler(ds, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(s.state_dict())
    assert list(again) == list(range(8, 21))
    other_seed = SequentialOrderSampler(ds, seed=5, batch_size=4)
    other_seed.load_state_dict(s.state_dict())  # the order does not depend on the seed: resumed, not refused
    assert list(other_seed) == list(range(8, 21))
