from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.data import (
    CacheDataLoader,
    CachedDataset,
    EpochOrderSampler,
    ImageDecoder,
    LmdbTier,
    ObjectStore,
    SampleCache,
    collate_batch,
    decode_entry,
    list_origin,
)
from lightning_accel.data.dataset import _HDR

REPO = Path(__file__).resolve().parents[2]


def _dataset(
    origin: str,
    tmp: Path,
    *,
    opts: dict[str, Any] | None = None,
    ram: int = 0,
    prefetch: bool | None = None,
    **kw: Any,
) -> CachedDataset:
    store = ObjectStore(origin, opts)
    cache = SampleCache(
        store,
        list_origin(store),
        ImageDecoder(16),
        ram=LmdbTier(tmp / "ram", ram, name="ram") if ram else None,
        ssd=LmdbTier(tmp / "ssd", 64 << 20),
        prefetch=prefetch,
    )
    return CachedDataset(cache, **kw)


def _epoch(loader: Any) -> tuple[list[int], int]:
    labels, n = [], 0
    for x, y in loader:
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, 16, 16) and len(x) == len(y)
        labels += y.tolist()
        n += len(x)
    return labels, n


@pytest.mark.parametrize(("ctx", "workers"), [("fork", 2), ("spawn", 1)])
def test_workers_share_tiers_and_statistics(small_digits: Path, tmp_cache_dir: Path, ctx: str, workers: int) -> None:
    ds = _dataset(str(small_digits), tmp_cache_dir, ram=8 << 20, prefetch=True)
    sampler = EpochOrderSampler(ds, batch_size=32, seed=1)
    loader = DataLoader(
        ds,
        batch_size=32,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context=ctx,
        persistent_workers=True,
        collate_fn=collate_batch,
    )
    assert ds.cache.ram is not None and ds.cache.ssd is not None
    ds.cache.ram.open()  # the parent holds both environments open while workers start
    ds.cache.ssd.open()
    labels0, n0 = _epoch(loader)
    sampler.set_epoch(1)
    labels1, n1 = _epoch(loader)  # the misses went to the RAM tier (it has room): RAM hits
    sampler.set_epoch(2)
    _, n2 = _epoch(loader)
    s = ds.stats.as_dict()  # counted inside the workers, read in the main process
    assert n0 == n1 == n2 == 200 and sorted(labels0) == sorted(labels1) == sorted(ds.cache.listing.labels)
    assert labels0 != labels1  # another shuffle
    assert s["requests"] == 600 and s["origin_fetches"] == 200 and s["ssd_hits"] == 0
    assert s["ram_hits"] == 400  # epochs 2 and 3: every sample from the node-wide RAM tier, whichever worker wrote it
    assert s["prefetched"] > 0  # workers read ahead in the published order


def test_split_is_deterministic_and_disjoint() -> None:
    from lightning_accel.data.dataset import split_indices

    tr, va = split_indices(100, 0.2, seed=1)
    assert len(va) == 20 and not set(tr) & set(va) and sorted(tr + va) == list(range(100))
    assert (tr, va) == split_indices(100, 0.2, seed=1)
    with pytest.raises(ValueError, match=r"`val_fraction` must be a number >= 0 and < 1, got 1\.0\. 0 holds out"):
        split_indices(10, 1.0, 0)
    with pytest.raises(TypeError, match=r"`val_fraction` must be a number >= 0 and < 1, got True \(bool\)"):
        split_indices(10, True, 0)


def test_default_num_workers_leaves_cpus_for_the_model() -> None:
    from lightning_accel.data.dataset import default_num_workers

    assert 1 <= default_num_workers() <= max(1, min(8, len(os.sched_getaffinity(0)) // 2))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_read_ahead_state_is_per_process(small_digits: Path, tmp_cache_dir: Path) -> None:
    import pickle

    ds = _dataset(str(small_digits), tmp_cache_dir, prefetch_batches=2, prefetch=True)
    order = list(EpochOrderSampler(ds, batch_size=10, seed=0))
    ds.__getitems__(order[0:10])  # this process has read ahead up to batch 2
    assert ds._ahead.get().hinted_to == 2
    copy = pickle.loads(pickle.dumps(ds))  # a spawned worker: the published order travels, the hints do not
    assert copy._ahead.get().hinted_to == -1 and copy._order[_HDR : _HDR + 200].tolist() == order
    pid = os.fork()
    if pid == 0:  # a forked worker starts from its own batches too
        os._exit(0 if ds._ahead.get().hinted_to == -1 and ds._ahead.get().pos is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert ds._ahead.get().hinted_to == 2


def test_sampler_publishes_the_order_and_shards_ranks(small_digits: Path, tmp_cache_dir: Path) -> None:
    ds = _dataset(str(small_digits), tmp_cache_dir)
    s0 = EpochOrderSampler(ds, num_replicas=2, rank=0, seed=3, batch_size=10)
    s1 = EpochOrderSampler(ds, num_replicas=2, rank=1, seed=3, batch_size=10)
    o1 = list(s1)
    o0 = list(s0)
    assert sorted(o0 + o1) == list(range(200))
    assert int(ds._order[0]) == 2 and int(ds._order[1]) == 100 and int(ds._order[2]) == 10
    assert ds._order[_HDR : _HDR + 100].tolist() == o0  # the last published order (this rank's)


def test_a_resumed_epoch_never_ends_in_a_lone_batch_when_the_model_cannot_train_on_one() -> None:
    """``trim_lone_last`` (a BatchNorm model): a resumed epoch whose remainder would end in a batch of one sample ends
    one position early, and a state with a single position left resumes at the next epoch."""
    data = TensorDataset(torch.arange(160))
    s = EpochOrderSampler(data, batch_size=37, seed=0)
    s.trim_lone_last = True
    s.load_state_dict({"epoch": 0, "consumed": 48, "seed": 0, "batch_size": 16, **s.layout()})
    whole = s.epoch_order()
    assert list(s) == whole[48:-1]  # 112 left: three batches of 37, not a fourth of one
    s.load_state_dict({"epoch": 0, "consumed": 159, "seed": 0, "batch_size": 37, **s.layout()})
    assert (s.epoch, s.resume_epoch) == (1, 1) and len(list(s)) == 160  # the next epoch, whole (160 % 37 = 12)
    plain = EpochOrderSampler(data, batch_size=37, seed=0)  # a model that trains on one sample: nothing dropped
    plain.load_state_dict({"epoch": 0, "consumed": 48, "seed": 0, "batch_size": 16, **plain.layout()})
    assert list(plain) == whole[48:]


def test_read_ahead_fetches_the_next_batches_of_this_reader(small_digits: Path, tmp_cache_dir: Path) -> None:
    ds = _dataset(str(small_digits), tmp_cache_dir, prefetch_batches=2, prefetch=True)
    order = list(EpochOrderSampler(ds, batch_size=10, seed=0))
    ds.__getitems__(order[0:10])
    assert set(ds.cache._pending.get()) == set(order[10:30])  # batches 1 and 2 are in flight
    ds.__getitems__(order[10:20])
    assert set(ds.cache._pending.get()) == set(order[20:40])
    assert ds.stats.as_dict()["origin_fetches"] == 20


def test_local_origin_reads_inline_without_read_ahead(small_digits: Path, tmp_cache_dir: Path) -> None:
    ds = _dataset(str(small_digits), tmp_cache_dir, prefetch_batches=2)
    assert ds.cache.prefetch is False  # default for a local origin: no thread pool, no read-ahead
    order = list(EpochOrderSampler(ds, batch_size=10, seed=0))
    for lo in range(0, 30, 10):
        x, y = ds.__getitems__(order[lo : lo + 10])
        assert len(x) == len(y) == 10
    assert not ds.cache._pending.get() and ds.cache.store._pool is None
    s = ds.stats.as_dict()
    assert s["origin_fetches"] == 30 and s["prefetched"] == 0 and s["bytes_fetched"] > 0


def test_cache_dataloader_switches_to_main_process_reads_when_warm(small_digits: Path, tmp_cache_dir: Path) -> None:
    ds = _dataset(str(small_digits), tmp_cache_dir)
    sampler = EpochOrderSampler(ds, batch_size=50)
    loader = CacheDataLoader(ds, batch_size=50, sampler=sampler, num_workers=1, persistent_workers=True)
    assert ds.cached_fraction() == 0.0
    _epoch(loader)
    assert loader.num_workers == 1 and not loader.is_warm
    tier = ds.cache.ssd
    assert tier is not None

    def no_lookups(keys: Any) -> list[bool]:
        raise AssertionError("the cold pass's record answers without a lookup per key")

    tier.contains = no_lookups  # type: ignore[method-assign]
    assert ds.cached_fraction() == 1.0  # what the workers stored, recorded in shared memory
    labels, n = _epoch(loader)  # the very next epoch runs on the fast path
    assert loader.is_warm and loader.num_workers == 0 and n == 200
    assert ds.stats.as_dict()["ssd_hits"] == 200 and ds.stats.as_dict()["origin_fetches"] == 200
    del tier.contains
    fresh = _dataset(str(small_digits), tmp_cache_dir)  # another process tree (a later run): asks the tiers
    assert fresh.cached_fraction() == 1.0 and fresh.cache.not_yet_seen_cached([0, 1]) == []


def test_a_ram_tier_the_workers_filled_is_full_for_the_main_process(small_digits: Path, tmp_cache_dir: Path) -> None:
    # A RAM tier that holds about a third of the samples; the cold pass in 2 workers fills it (overflow to the SSD
    # tier). The main process's first warm epoch then offers it no promotions: none copied, none refused.
    probe = _dataset(str(small_digits), tmp_cache_dir / "probe")
    probe.cache.load([0])
    ssd = probe.cache.ssd
    assert ssd is not None
    cost = ssd.cost(probe.cache.key(0), len(ssd.get(probe.cache.key(0)) or b""))
    ds = _dataset(str(small_digits), tmp_cache_dir, ram=70 * cost)
    sampler = EpochOrderSampler(ds, batch_size=50)
    loader = CacheDataLoader(ds, batch_size=50, sampler=sampler, num_workers=2, persistent_workers=True)
    _epoch(loader)
    assert ds.cache.ram is not None and 0 < len(ds.cache.ram) < 70
    assert ds.cache._ram_full  # learnt in a worker, known here
    ds.stats.reset()
    labels, n = _epoch(loader)
    s = ds.stats.as_dict()
    assert loader.is_warm and n == 200
    assert (s["writes"], s["rejected"], s["origin_fetches"]) == (0, 0, 0)
    assert s["ram_hits"] == len(ds.cache.ram) and s["ssd_hits"] == 200 - len(ds.cache.ram)


def test_buffer_pool_reserve_pages_in_buffers_that_take_reuses() -> None:
    from lightning_accel.data.buffers import BufferPool

    pool = BufferPool(max_buffers=3)
    assert pool.reserve((4, 3, 8, 8), torch.uint8, 5) == 3  # at most max_buffers
    assert pool.reserve((4, 3, 8, 8), torch.uint8, 5) == 0
    a, b = pool.take((4, 3, 8, 8), torch.uint8), pool.take((4, 3, 8, 8), torch.uint8)
    assert pool.reused == 2 and a.data_ptr() != b.data_ptr()


def test_read_ahead_thread_propagates_errors(small_digits: Path, tmp_path: Path) -> None:
    import shutil

    origin = tmp_path / "o"
    shutil.copytree(small_digits, origin)
    ds = _dataset(str(origin), tmp_path)
    for p in (origin / "7").glob("*.jpg"):
        p.unlink()  # listed but gone: a permanent origin error
    loader = CacheDataLoader(ds, batch_size=50, num_workers=0, warm_num_workers=0)
    with pytest.raises(OSError, match=r"7/\d+\.jpg"):
        _epoch(loader)


def test_read_ahead_closed_early_stops_and_joins_its_thread() -> None:
    from lightning_accel.data import dataset as dataset_mod

    started = threading.Event()

    def slow() -> Any:
        for k in range(1000):
            started.set()
            time.sleep(0.01)
            yield torch.full((8,), k)

    gen: Any = dataset_mod._read_ahead(slow(), 2, name="la-test-read-ahead")  # a generator (typed an Iterator)
    assert int(next(gen)[0]) == 0 and started.is_set()
    (entry,) = [e for e in dataset_mod._PRODUCERS if e[1].name == "la-test-read-ahead"]
    gen.close()
    assert not entry[1].is_alive() and entry not in dataset_mod._PRODUCERS


def test_process_exits_cleanly_with_a_read_ahead_thread_inside_torch() -> None:
    # A daemon thread still inside torch at interpreter shutdown used to abort the process (SIGABRT) after a
    # successful fit; the producer left open here transforms tensors until the interpreter exits.
    code = textwrap.dedent(
        """
        import torch
        from lightning_accel.data import dataset
        def batches():
            while True:
                x = torch.randn(64, 3, 32, 32)
                yield (torch.nn.functional.interpolate(x, scale_factor=2.0), torch.arange(64))
        gen = dataset._read_ahead(batches(), 4)
        next(gen)
        KEEP = gen  # never closed: stopped by the exit hook
        print("ok", flush=True)
        """
    )
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_s3_cold_then_warm_moves_each_byte_once(
    s3_bucket: tuple[str, dict[str, Any]], small_digits: Path, tmp_cache_dir: Path
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    files = sorted(small_digits.rglob("*.jpg"))[:96]
    fs.pipe({f"{bucket}/d/{p.parent.name}/{p.name}": p.read_bytes() for p in files})
    total = sum(p.stat().st_size for p in files)
    ds = _dataset(f"s3://{bucket}/d", tmp_cache_dir, opts=opts)
    sampler = EpochOrderSampler(ds, batch_size=16)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=collate_batch)
    _, n = _epoch(loader)
    cold = ds.stats.as_dict()
    assert n == 96 and cold["origin_fetches"] == 96
    assert cold["bytes_fetched"] == total  # read-ahead never reads a sample twice
    _, n = _epoch(loader)
    warm = ds.stats.as_dict()
    assert n == 96 and warm["bytes_fetched"] == total and warm["ssd_hits"] == 96


_WARMER = textwrap.dedent(
    """
    import sys, time
    from lightning_accel.data import CachedDataset, ImageDecoder, LmdbTier, ObjectStore, SampleCache, list_origin
    store = ObjectStore(sys.argv[1])
    cache = SampleCache(store, list_origin(store), ImageDecoder(16), ssd=LmdbTier(sys.argv[2], 64 << 20))
    ds = CachedDataset(cache)
    for lo in range(0, 200, 4):
        ds.__getitems__(list(range(lo, lo + 4)))
        print(lo + 4, flush=True)
        time.sleep(0.05)
    """
)


def test_warm_up_killed_halfway_leaves_only_complete_entries(small_digits: Path, tmp_cache_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WARMER, str(small_digits), str(tmp_cache_dir / "ssd")],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if int(line) >= 40:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    tier = LmdbTier(tmp_cache_dir / "ssd", 64 << 20)
    n = len(tier)
    assert 40 <= n < 200
    with tier.reader() as get:
        for k in tier._env.begin(db=tier._dbs["index"]).cursor().iternext(values=False):
            entry = get(bytes(k))
            assert entry is not None
            decode_entry(entry)  # every committed entry is complete and passes its checksum
    ds = _dataset(str(small_digits), tmp_cache_dir)
    labels, total = _epoch(CacheDataLoader(ds, batch_size=50, num_workers=0))
    s = ds.stats.as_dict()
    assert total == 200 and s["ssd_hits"] == n and s["origin_fetches"] == 200 - n and s["refetches"] == 0


def test_loader_checks_warm_num_workers() -> None:
    ds: Any = list(range(4))
    with pytest.raises(ValueError, match=r"`warm_num_workers` must be an integer >= 0 or None, got -1\. 0 reads"):
        CacheDataLoader(ds, warm_num_workers=-1)
    with pytest.raises(TypeError, match=r"`warm_num_workers` must be an integer >= 0 or None, got True \(bool\)"):
        CacheDataLoader(ds, warm_num_workers=True)


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        # a truthy string dropped the tail (drop_last="no") or shuffled (shuffle="false")
        ({"drop_last": "no"}, TypeError, r"^`drop_last` must be True or False, got 'no' \(str\)\.$"),
        ({"shuffle": "false"}, TypeError, r"^`shuffle` must be True or False, got 'false' \(str\)\.$"),
        ({"num_replicas": 2.0}, TypeError, r"^`num_replicas` must be an integer >= 1, got 2\.0 \(float\)\. It is"),
        (
            {"num_replicas": 0},
            ValueError,
            r"^`num_replicas` must be an integer >= 1, got 0\. It is the number of ranks",
        ),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"^`rank` must be an integer >= 0 and <= 1, got 2\. There are 2"),
    ],
)
def test_sampler_arguments_are_checked(kw: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        EpochOrderSampler(list(range(10)), **kw)  # type: ignore[arg-type]


def test_loader_bounds_its_read_threads() -> None:
    ds: Any = list(range(4))
    # a thread each, with as many batches in flight: a million read the whole epoch ahead into memory
    with pytest.raises(
        ValueError, match=r"^`read_threads` must be an integer >= 1 and <= 1024 or None, got 1000000\. "
    ):
        CacheDataLoader(ds, read_threads=10**6)
    assert CacheDataLoader(ds, read_threads=1024).read_threads == 1024


def test_dataset_indices_must_be_integers(small_digits: Path, tmp_cache_dir: Path) -> None:
    cache = _dataset(str(small_digits), tmp_cache_dir).cache
    # int(2.7) would be sample 2: another sample than the caller meant
    with pytest.raises(
        TypeError, match=r"^`indices` must hold integers \(positions in the cache's listing\), got 2\.7"
    ):
        CachedDataset(cache, [0, 2.7])  # type: ignore[list-item]
    assert CachedDataset(cache, [3, 1]).indices == [3, 1]
