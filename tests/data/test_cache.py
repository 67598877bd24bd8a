from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.data import (
    CorruptEntryError,
    DecodeError,
    ImageDecoder,
    LmdbTier,
    ObjectStore,
    SampleCache,
    decode_entry,
    list_origin,
)


def _cache(origin: Path, tmp: Path, *, ram: int = 0, ssd: int | None = 64 << 20, **kw) -> SampleCache:
    store = ObjectStore(str(origin))
    return SampleCache(
        store,
        list_origin(store),
        ImageDecoder(16),
        ram=LmdbTier(tmp / "ram", ram, name="ram") if ram else None,
        ssd=LmdbTier(tmp / "ssd", ssd, name="ssd") if ssd != 0 else None,
        **kw,
    )


def test_cold_then_warm_identical_to_imagefolder(small_digits: Path, tmp_cache_dir: Path) -> None:
    from torchvision.datasets import ImageFolder  # type: ignore[import-untyped]

    c = _cache(small_digits, tmp_cache_dir)
    idx = [5, 0, 199, 42]
    cold = c.load(idx)
    s = c.stats.as_dict()
    assert (s["origin_fetches"], s["ssd_hits"], s["writes"]) == (4, 0, 4)
    assert s["bytes_fetched"] == sum((small_digits / c.listing.keys[i]).stat().st_size for i in idx)
    warm = c.load(idx)
    s = c.stats.as_dict()
    assert (s["origin_fetches"], s["ssd_hits"], s["bytes_fetched"]) == (4, 4, s["bytes_fetched"])
    ref = ImageFolder(str(small_digits), transform=ImageDecoder(16).pil_transform())
    expect = torch.stack([ref[i][0] for i in idx])
    assert cold.images.dtype == torch.uint8 and cold.images.shape == (4, 3, 16, 16)
    assert torch.equal(cold.images, expect) and torch.equal(warm.images, expect)  # bit-identical decode
    assert cold.labels.tolist() == warm.labels.tolist() == [ref[i][1] for i in idx]


def test_warm_reads_touch_no_origin(small_digits: Path, tmp_cache_dir: Path) -> None:
    c = _cache(small_digits, tmp_cache_dir)
    c.load(list(range(30)))
    shutil_target = tmp_cache_dir / "gone"
    c2 = _cache(small_digits, tmp_cache_dir)  # same tiers, new process-local state
    c2.store = ObjectStore(str(shutil_target))  # an origin that does not exist: any read would fail
    c2.namespace = c.namespace
    out = c2.load(list(range(30)))
    assert len(out.kept) == 30 and c2.stats.as_dict()["bytes_fetched"] == 0


def test_misses_go_to_ssd_and_hits_are_promoted_to_ram(small_digits: Path, tmp_cache_dir: Path) -> None:
    c = _cache(small_digits, tmp_cache_dir, ram=8 << 20, misses_to="ssd")
    c.load(list(range(10)))
    assert c.ram is not None and len(c.ram) == 0 and c.ssd is not None and len(c.ssd) == 10
    c.load(list(range(10)))  # SSD hits, promoted to RAM
    assert len(c.ram) == 10
    c.load(list(range(10)))
    s = c.stats.as_dict()
    assert (s["ssd_hits"], s["ram_hits"]) == (10, 10)
    assert s["ram_hit_rate"] == pytest.approx(10 / 30)
    c_ram_only = _cache(small_digits, tmp_cache_dir / "r", ram=8 << 20, ssd=0)
    c_ram_only.load([0, 1])
    assert c_ram_only.ram is not None and len(c_ram_only.ram) == 2  # no SSD tier: misses go to RAM


def test_misses_fill_the_ram_tier_first_overflow_to_ssd_and_spill(small_digits: Path, tmp_cache_dir: Path) -> None:
    probe = _cache(small_digits, tmp_cache_dir / "probe")
    probe.load([0])
    assert probe.ssd is not None
    cost = probe.ssd.cost(probe.key(0), len(probe.ssd.get(probe.key(0)) or b""))
    budget = 100 * cost  # room for fewer than 100 entries, with LMDB's B-tree pages
    c = _cache(small_digits, tmp_cache_dir, ram=budget)
    assert c.ram is not None and c.ssd is not None
    c.load(list(range(0, 8)))
    assert (len(c.ram), len(c.ssd)) == (8, 0)  # misses: the RAM tier first
    c.load(list(range(8, 100)))
    c.load(list(range(100, 200)))
    in_ram = len(c.ram)
    assert 8 < in_ram < 100 and in_ram + len(c.ssd) == 200  # its overflow: the SSD tier, nothing lost
    s = c.stats.as_dict()
    assert (s["writes"], s["rejected"], s["origin_fetches"]) == (200, 0, 200)
    c.stats.reset()
    warm = c.load(list(range(200)))  # the first warm read: no promotion (the RAM tier is full), every sample a hit
    s = c.stats.as_dict()
    assert (s["ram_hits"], s["ssd_hits"], s["origin_fetches"], s["writes"]) == (in_ram, 200 - in_ram, 0, 0)
    assert c.spill(batch=5) == in_ram and len(c.ssd) == 200  # the RAM tier's entries now survive a reboot
    assert c.spill() == 0  # nothing left to copy
    assert torch.equal(warm.images, probe.load(list(range(200))).images)
    with pytest.raises(ValueError, match="`misses_to` must be 'ram' or 'ssd', got 'disk'"):
        _cache(small_digits, tmp_cache_dir / "bad", misses_to="disk")
    with pytest.raises(TypeError, match=r"`on_decode_error` must be 'raise' or 'skip', got True \(bool\)"):
        _cache(small_digits, tmp_cache_dir / "bad", on_decode_error=True)


def test_corrupt_entry_is_evicted_refetched_and_counted(small_digits: Path, tmp_cache_dir: Path) -> None:
    c = _cache(small_digits, tmp_cache_dir)
    good = c.load([3]).images.clone()
    key = c.key(3)
    assert c.ssd is not None
    raw = bytearray(c.ssd.get(key) or b"")
    raw[-10] ^= 0xFF
    c.ssd.delete([key])
    c.ssd.put_many([(key, bytes(raw))])
    with pytest.raises(CorruptEntryError):
        decode_entry(bytes(raw))
    c = _cache(small_digits, tmp_cache_dir)  # the next run (this one trusts the entries it wrote)
    again = c.load([3])
    s = c.stats.as_dict()
    assert torch.equal(again.images, good)
    assert (s["refetches"], s["evictions"], s["origin_fetches"]) == (1, 1, 1)
    assert c.ssd is not None
    decode_entry(c.ssd.get(key) or b"")  # the refetched entry is valid again


def test_decode_errors_raise_naming_the_key_or_are_skipped(small_digits: Path, tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    bad = sorted((origin / "3").glob("*.jpg"))[0]
    bad.write_bytes(b"this is not a jpeg")
    c = _cache(origin, tmp_path / "c1")
    i = c.listing.keys.index(f"3/{bad.name}")
    with pytest.raises(DecodeError, match=rf"3/{bad.name}.*on_decode_error='skip'"):
        c.load([0, i])
    c = _cache(origin, tmp_path / "c2", on_decode_error="skip")
    out = c.load([0, i, 1])
    assert out.kept == [0, 2] and out.images.shape[0] == 2 and len(out.labels) == 2
    assert c.stats.as_dict()["decode_skipped"] == 1


def test_a_batch_whose_samples_all_fail_keeps_the_row_shape(small_digits: Path, tmp_path: Path) -> None:
    """A decoder without `decode_into` allocates no row before it fails: the empty batch still has 4 dimensions."""

    def strict(data: bytes) -> torch.Tensor:
        if not data.startswith(b"\xff\xd8"):
            raise ValueError("not a JPEG")
        return ImageDecoder(16)(data)

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    bad = sorted((origin / "3").glob("*.jpg"))[:2]
    for p in bad:
        p.write_bytes(b"this is not a jpeg")
    store = ObjectStore(str(origin))
    c = SampleCache(store, list_origin(store), strict, on_decode_error="skip")
    assert tuple(c.load([0]).images.shape) == (1, 3, 16, 16)
    out = c.load([c.listing.keys.index(f"3/{p.name}") for p in bad])
    assert tuple(out.images.shape) == (0, 3, 16, 16) and out.images.dtype == torch.uint8 and out.kept == []


def test_over_budget_keeps_a_stable_subset(small_digits: Path, tmp_cache_dir: Path) -> None:
    store = ObjectStore(str(small_digits))
    budget = 800 * 1024  # 200 entries of 2 LMDB pages each (40 px) need ~1.7 MB: about half fits
    c = SampleCache(store, list_origin(store), ImageDecoder(40), ssd=LmdbTier(tmp_cache_dir, budget))
    order = torch.randperm(200, generator=torch.Generator().manual_seed(0)).tolist()
    for lo in range(0, 200, 20):
        c.load(order[lo : lo + 20])
    c.stats.reset()
    for lo in range(0, 200, 20):  # a second epoch in another order
        c.load(order[::-1][lo : lo + 20])
    s = c.stats.as_dict()
    assert c.ssd is not None
    fits = len(c.ssd) / 200
    assert 0.4 < fits < 0.5
    assert s["ssd_hit_rate"] == pytest.approx(fits)  # every entry kept is a hit, whatever the order
    assert c.ssd.file_bytes() <= budget


def test_budget_too_small_for_one_sample(small_digits: Path, tmp_cache_dir: Path) -> None:
    store = ObjectStore(str(small_digits))
    c = SampleCache(store, list_origin(store), ImageDecoder(224), ssd=LmdbTier(tmp_cache_dir, 100_000))
    with pytest.raises(ValueError, match=r"`ssd_bytes` budget 100000 bytes.*\d+ bytes for a \d+-byte entry"):
        c.load([0])


def test_prefetch_hints_start_reads_only_for_uncached_samples(small_digits: Path, tmp_cache_dir: Path) -> None:
    c = _cache(small_digits, tmp_cache_dir, max_pending=8, prefetch=True)
    c.load([0, 1])
    assert c.hint([0, 1, 2, 3]) == 2  # 0 and 1 are cached
    assert c.hint(list(range(4, 40))) == 6  # bounded by max_pending
    out = c.load([2, 3])
    s = c.stats.as_dict()
    assert s["prefetched"] == 8 and len(out.kept) == 2
    c.drop_pending()
    assert not c._pending.get()


def test_unwritable_cache_dir_warns_and_training_continues(small_digits: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    store = ObjectStore(str(small_digits))
    c = SampleCache(store, list_origin(store), ImageDecoder(16), ssd=LmdbTier(tmp_path / "file" / "ssd", 1 << 20))
    with pytest.warns(RuntimeWarning, match="ssd tier .* disabled"):
        out = c.load([0, 1])
    assert len(out.kept) == 2 and c.stats.as_dict()["origin_fetches"] == 2
    shutil.rmtree(tmp_path / "file", ignore_errors=True)


def test_each_entry_is_verified_once_per_process_tree(small_digits: Path, tmp_cache_dir: Path, monkeypatch) -> None:
    import pickle

    import lightning_accel.data.codec as codec

    c = _cache(small_digits, tmp_cache_dir)
    c.load(list(range(8)))  # cold: decoded and written by this process tree, so trusted
    calls: list[int] = []
    real = codec._digest

    def counted(*a: Any) -> Any:
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(codec, "_digest", counted)
    c.load(list(range(8)))
    assert calls == []
    run2 = _cache(small_digits, tmp_cache_dir)  # a later run over the same tiers: checks each entry once
    run2.load(list(range(8)))
    first = len(calls)
    assert first >= 8
    worker = pickle.loads(pickle.dumps(run2))  # a spawned worker shares the tree's record (shared memory)
    worker.load(list(range(8)))
    run2.load(list(range(8)))
    assert len(calls) == first


def test_local_inline_read_of_a_vanished_file_names_the_url(tmp_path: Path, small_digits: Path) -> None:
    from lightning_accel.data import OriginError

    origin = tmp_path / "origin"
    shutil.copytree(small_digits, origin)
    c = _cache(origin, tmp_path / "cache")
    assert c.prefetch is False  # a local origin is read inline
    victim = c.listing.keys[3]
    (origin / victim).unlink()
    with pytest.raises(OriginError, match=victim.split("/")[-1]):
        c.load([2, 3])


class _PlainDecoder:
    """A decoder without ``decode_into``: returns an HWC -> CHW view (not contiguous), as PILToTensor does."""

    fingerprint = "plain-hwc-view-v1"

    def __call__(self, data: bytes) -> torch.Tensor:
        return ImageDecoder(16)(data).permute(1, 2, 0).contiguous().permute(2, 0, 1)


def test_decoder_without_decode_into_takes_the_tensor_path(small_digits: Path, tmp_cache_dir: Path) -> None:
    store = ObjectStore(str(small_digits))
    c = SampleCache(store, list_origin(store), _PlainDecoder(), ssd=LmdbTier(tmp_cache_dir, 64 << 20))
    ref = _cache(small_digits, tmp_cache_dir / "ref").load([0, 5, 9])
    cold = c.load([0, 5, 9])
    warm = c.load([0, 5, 9])
    assert torch.equal(cold.images, ref.images) and torch.equal(warm.images, ref.images)
    assert torch.equal(cold.labels, ref.labels)
    s = c.stats.as_dict()
    assert s["origin_fetches"] == 3 and s["ssd_hits"] == 3


def test_buffer_pool_reuses_a_storage_only_once_nothing_references_it() -> None:
    from lightning_accel.data.buffers import BufferPool

    pool = BufferPool(max_buffers=2)
    a = pool.take((2, 3), torch.uint8)
    ptr = a.data_ptr()
    b = pool.take((2, 3), torch.uint8)
    assert b.data_ptr() != ptr  # `a` is alive: never handed out twice
    view = a[0]
    del a
    c = pool.take((2, 3), torch.uint8)
    assert c.data_ptr() != ptr  # a view of `a` is alive: still not reused
    assert pool.reused == 0
    del view, c
    d = pool.take((2, 3), torch.uint8)
    assert pool.reused == 1 and d.data_ptr() == ptr
    arr = d.numpy()  # a numpy view holds the storage too
    del d
    e = pool.take((2, 3), torch.uint8)
    assert e.data_ptr() != arr.ctypes.data
    # more live batches than max_buffers: plain allocations, no error
    live = [pool.take((2, 3), torch.uint8) for _ in range(5)]
    assert len({t.data_ptr() for t in live}) == 5
    assert pool.take((4,), torch.float32).shape == (4,)  # pools are per shape and dtype


def test_warm_batches_recycle_buffers_without_corrupting_kept_batches(small_digits: Path, tmp_cache_dir: Path) -> None:
    c = _cache(small_digits, tmp_cache_dir)
    c.load(list(range(20)))
    kept = c.load([0, 1, 2, 3])  # held by the caller: its buffer must not be refilled
    expect = kept.images.clone()
    for _ in range(4):
        c.load([10, 11, 12, 13])  # dropped at once: their buffer is recycled
    assert c.buffers.reused >= 3
    assert torch.equal(kept.images, expect)


def test_write_behind_commits_on_flush_and_reports_a_budget_error(small_digits: Path, tmp_cache_dir: Path) -> None:
    from lightning_accel.data import BudgetTooSmallError

    c = _cache(small_digits, tmp_cache_dir, write_behind=True)
    c.load(list(range(10)))  # returns before its entries are committed
    c.flush()
    assert c.writes_behind and c.stats.as_dict()["writes"] == 10
    assert c.ssd is not None and all(c.ssd.contains([c.key(i) for i in range(10)]))
    store = ObjectStore(str(small_digits))
    tiny = SampleCache(
        store, list_origin(store), ImageDecoder(224), ssd=LmdbTier(tmp_cache_dir / "tiny", 100_000), write_behind=True
    )
    tiny.load([0])  # the write fails in the background ...
    with pytest.raises(BudgetTooSmallError, match="ssd_bytes"):
        tiny.flush()  # ... and the error reaches the caller, with both numbers


def test_write_behind_thread_and_store_baseline_are_per_process(small_digits: Path, tmp_cache_dir: Path) -> None:
    import os
    import pickle

    c = _cache(small_digits, tmp_cache_dir, write_behind=True)
    assert not c.writes_behind  # no thread until the first miss is written behind
    c.load(list(range(4)))
    c.flush()
    assert c.writes_behind and c._seen.get()[1] == c.store.bytes_read > 0
    copy = pickle.loads(pickle.dumps(c))  # a spawned worker: no thread, and a baseline that restarts with the store
    assert not copy.writes_behind and copy._seen.get() == [0, 0] and copy.store.bytes_read == 0
    copy.flush()  # nothing to wait for
    pid = os.fork()
    if pid == 0:  # a forked worker: the parent's writer thread does not exist here; it gets its own
        # ...and counts only its own reads: the parent's were the parent's to add to the statistics (they were
        # added twice when a worker was forked with the main process's downloads not yet accounted)
        ok = not c.writes_behind and c.store.bytes_read == 0 and c._seen.get() == [0, 0]
        c.load(list(range(4, 8)))
        c.flush()
        os._exit(0 if ok and c.writes_behind and all(c.ssd.contains([c.key(i) for i in range(8)])) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert c.ssd is not None and all(c.ssd.contains([c.key(i) for i in range(8)]))  # the child's writes committed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_fills_the_cache_in_its_own_namespace(small_digits: Path, tmp_cache_dir: Path) -> None:
    store = ObjectStore(str(small_digits))
    gpu = SampleCache(store, list_origin(store), ImageDecoder(16, device="cuda"), ssd=LmdbTier(tmp_cache_dir, 64 << 20))
    cpu = _cache(small_digits, tmp_cache_dir / "cpu")
    idx = list(range(0, 200, 7))
    cold = gpu.load(idx)  # one nvJPEG batch for the misses
    warm = gpu.load(idx)
    ref = cpu.load(idx).images
    assert gpu.namespace != cpu.namespace and torch.equal(cold.images, warm.images)
    assert (cold.images.float() - ref.float()).abs().mean() <= 3
    s = gpu.stats.as_dict()
    assert (s["origin_fetches"], s["ssd_hits"], s["writes"]) == (len(idx), len(idx), len(idx))


def test_labels_come_from_the_listing_not_the_cached_entries(small_digits: Path, tmp_cache_dir: Path) -> None:
    """A relabelled sample (same key, same bytes, new label) is served with its new label, without a new decode."""
    from lightning_accel.data import Listing

    c = _cache(small_digits, tmp_cache_dir)
    first = c.load([0, 1, 2])
    old = c.listing
    relabelled = Listing(old.origin, old.keys, [(y + 1) % len(old.classes) for y in old.labels], old.classes)
    c2 = SampleCache(c.store, relabelled, ImageDecoder(16), ssd=LmdbTier(tmp_cache_dir / "ssd", 64 << 20, name="ssd"))
    assert c2.namespace == c.namespace  # same entries, read back
    again = c2.load([0, 1, 2])
    assert c2.stats.as_dict()["origin_fetches"] == 0 and torch.equal(again.images, first.images)
    assert again.labels.tolist() == [relabelled.labels[i] for i in (0, 1, 2)] != first.labels.tolist()


@pytest.mark.parametrize("setting", ["misses_to_ssd", "fifo"])
def test_misses_next_to_promoted_ssd_hits_are_stored(small_digits: Path, tmp_cache_dir: Path, setting: str) -> None:
    """A batch with SSD hits to promote and misses to store keeps both: the misses reach the SSD tier."""
    store = ObjectStore(str(small_digits))
    policy = "fifo" if setting == "fifo" else "keep"
    c = SampleCache(
        store,
        list_origin(store),
        ImageDecoder(16),
        ram=LmdbTier(tmp_cache_dir / "ram", 8 << 20, name="ram", policy=policy),
        ssd=LmdbTier(tmp_cache_dir / "ssd", 64 << 20, name="ssd", policy=policy),
        misses_to="ssd" if setting == "misses_to_ssd" else "ram",
        write_behind=False,
    )
    c.load([0, 1])  # misses: to the SSD tier (a "fifo" RAM tier takes no misses)
    c.load([0, 1, 2, 3])  # 0, 1: SSD hits promoted to RAM; 2, 3: misses
    assert c.ram is not None and c.ssd is not None
    assert c.ssd.contains([c.key(2), c.key(3)]) == [True, True] and len(c.ram) == 2
    assert c.stats.as_dict()["writes"] == 6  # 2 + (2 promoted + 2 misses)
    c.load([2, 3])
    assert c.stats.as_dict()["origin_fetches"] == 4  # read back, not fetched again


def _module_decoders(tmp: Path) -> Path:
    """A module of decoders without a `fingerprint` (a function, a class instance, a partial)."""
    mod = tmp / "mydecoders.py"
    mod.write_text(
        "import functools\n"
        "from lightning_accel.data import ImageDecoder\n"
        "def my_decode(data, size=16):\n"
        "    return ImageDecoder(size)(data)\n"
        "class MyDecode:\n"
        "    def __init__(self, size):\n"
        "        self.size = size\n"
        "    def __call__(self, data):\n"
        "        return ImageDecoder(self.size)(data)\n"
        "DECODERS = [my_decode, MyDecode(16), MyDecode(24), functools.partial(my_decode, size=24)]\n"
    )
    return mod


def test_a_decoder_without_fingerprint_keeps_its_namespace_across_runs(tmp_path: Path) -> None:
    """Its repr holds a memory address; the namespace must not: a later run reads what an earlier one cached."""
    import subprocess
    import sys

    _module_decoders(tmp_path)
    code = (
        "import mydecoders\n"
        "from lightning_accel.data.decode import decoder_fingerprint\n"
        "print('|'.join(decoder_fingerprint(d) for d in mydecoders.DECODERS))\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and " at 0x" not in runs[0]
    fps = runs[0].split("|")
    assert len(set(fps)) == 4  # other state (size 16 vs 24) or another decoder: another namespace


def test_a_decoder_reading_a_module_level_setting_gets_another_namespace_when_it_changes(
    small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs sharing a cache directory, whose decoders differ only in a module-level setting (the image size a
    config sets): the second must decode at its own size, not read the first job's entries."""
    import importlib

    (tmp_path / "settingdecoders.py").write_text(
        "import threading\n"
        "from lightning_accel.data import ImageDecoder\n"
        "SIZE = 16\n"
        "LOCK = threading.Lock()  # no stable form: left out of the identity, not a reason to give it up\n"
        "def by_setting(data):\n"
        "    with LOCK:\n"
        "        return ImageDecoder(SIZE)(data)\n"
        "class BySetting:\n"
        "    def __call__(self, data):\n"
        "        return ImageDecoder(SIZE)(data)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("settingdecoders")
    store = ObjectStore(str(small_digits))
    listing = list_origin(store)
    for decode in (mod.by_setting, mod.BySetting()):
        ssd = tmp_path / f"ssd-{type(decode).__name__}"
        monkeypatch.setattr(mod, "SIZE", 16)
        first = SampleCache(store, listing, decode, ssd=LmdbTier(ssd, 64 << 20, name="ssd"))
        assert first.load([0, 1]).images.shape == (2, 3, 16, 16)
        same = SampleCache(store, listing, decode, ssd=LmdbTier(ssd, 64 << 20, name="ssd"))
        assert same.namespace == first.namespace  # the same setting: the entries are read back
        monkeypatch.setattr(mod, "SIZE", 24)
        second = SampleCache(store, listing, decode, ssd=LmdbTier(ssd, 64 << 20, name="ssd"))
        assert second.namespace != first.namespace
        assert torch.equal(second.load([0, 1]).images, _reference_at(small_digits, listing.keys[:2], 24))


class _ModuleDecoder(torch.nn.Module):
    """A decoder written as an ``nn.Module``: its repr (``_ModuleDecoder()``) shows none of its settings."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, data: bytes) -> torch.Tensor:
        return ImageDecoder(self.size)(data)


class _ReprDecoder:
    """A decoder whose hand-written repr leaves its size out."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return "_ReprDecoder()"

    def __call__(self, data: bytes) -> torch.Tensor:
        return ImageDecoder(self.size)(data)


@pytest.mark.parametrize("kind", [_ModuleDecoder, _ReprDecoder])
def test_a_decoder_whose_repr_hides_its_settings_decodes_again_when_they_change(
    small_digits: Path, tmp_path: Path, kind: type
) -> None:
    """A second run (or job sharing the cache) at another size must not be served the first one's samples."""
    store = ObjectStore(str(small_digits))
    listing = list_origin(store)
    ssd = tmp_path / "ssd"
    first = SampleCache(store, listing, kind(16), ssd=LmdbTier(ssd, 64 << 20, name="ssd"))
    assert first.load([0, 1]).images.shape == (2, 3, 16, 16)
    same = SampleCache(store, listing, kind(16), ssd=LmdbTier(ssd, 64 << 20, name="ssd"))
    assert same.namespace == first.namespace  # the same settings: read back
    assert torch.equal(same.load([0, 1]).images, _reference_at(small_digits, listing.keys[:2], 16))
    assert same.stats.as_dict()["origin_fetches"] == 0
    other = SampleCache(store, listing, kind(24), ssd=LmdbTier(ssd, 64 << 20, name="ssd"))
    assert other.namespace != first.namespace
    assert torch.equal(other.load([0, 1]).images, _reference_at(small_digits, listing.keys[:2], 24))


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        # truthy strings: they used to switch the read-ahead and the write-behind thread on
        ({"prefetch": "no"}, TypeError, r"^`prefetch` must be True or False, got 'no' \(str\)\. None: only for remote"),
        ({"write_behind": "false"}, TypeError, r"^`write_behind` must be True or False, got 'false' \(str\)\. None: "),
        ({"decode": 3}, TypeError, r"^`decode` must be a callable `decode\(data: bytes\) -> torch\.Tensor`, got 3 "),
        ({"decode": None}, TypeError, r"^`decode` must be a callable .*, got None \(NoneType\)\. Pass e\.g\."),
    ],
)
def test_cache_flags_and_decoder_are_checked(
    small_digits: Path, kw: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    store = ObjectStore(str(small_digits))
    args = {"decode": ImageDecoder(16), **kw}
    with pytest.raises(error, match=pattern):
        SampleCache(store, list_origin(store), **args)


def _reference_at(origin: Path, keys: list[str], size: int) -> torch.Tensor:
    return torch.stack([ImageDecoder(size)((origin / k).read_bytes()) for k in keys])


def test_decoder_fingerprint_follows_the_code_and_warns_when_it_cannot(tmp_path: Path) -> None:
    from lightning_accel.data.decode import decoder_fingerprint

    assert decoder_fingerprint(ImageDecoder(16)) == ImageDecoder(16).fingerprint
    assert decoder_fingerprint(lambda b: torch.tensor(list(b))) != decoder_fingerprint(
        lambda b: torch.tensor(list(b[::-1]))
    )  # another body
    size = 16
    assert "16" in decoder_fingerprint(lambda b: ImageDecoder(size)(b))  # a closure's values count

    class Holder:
        def __init__(self) -> None:
            self.handle = object()  # its repr holds an address: no identity is the same in every run

        def __call__(self, data: bytes) -> torch.Tensor:
            return torch.zeros(1)

    with pytest.warns(UserWarning, match=r"`decode` .* has no `fingerprint`.*Set `decode\.fingerprint`"):
        fp = decoder_fingerprint(Holder())
    assert " at 0x" in fp  # the repr: never serves another run's entries


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (10**12, ValueError, r"^`max_pending` must be an integer >= 0 and <= 65536, got 1000000000000\. It counts"),
        (-5, ValueError, r"^`max_pending` must be an integer >= 0 and <= 65536, got -5\. "),
        ("64", TypeError, r"^`max_pending` must be an integer >= 0 and <= 65536, got '64' \(str\)\. "),
    ],
)
def test_max_pending_out_of_range_fails_at_construction(
    small_digits: Path, tmp_path: Path, value: object, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern) as e:
        _cache(small_digits, tmp_path, ssd=0, max_pending=value, prefetch=True)
    assert "\n" not in str(e.value) and "pass a few batches' worth" in str(e.value)
    assert _cache(small_digits, tmp_path, ssd=0, max_pending=65_536).max_pending == 65_536


def test_the_data_module_keeps_its_read_ahead_within_max_pending(small_digits: Path, tmp_path: Path) -> None:
    from lightning_accel.data import CachedDataModule

    dm = CachedDataModule(
        str(small_digits),
        cache_dir=str(tmp_path / "cache"),
        ram_bytes=0,
        num_workers=0,
        batch_size=512,
        prefetch_batches=100,
    )
    dm.setup("fit")
    assert dm.train_set is not None and dm.train_set.cache.max_pending == 65_536
