"""``CachedDataModule`` argument checks: every bad value is one line at construction, naming the argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accel.data import CachedDataModule, CachedDataset


def _make(tmp: Path, **kw: Any) -> CachedDataModule:
    return CachedDataModule(str(tmp), cache_dir=str(tmp / "cache"), **kw)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"ram_bytes": 1}, r"`ram_bytes` 1 is below the minimum of 1048576 bytes: an LMDB tier needs room"),
        ({"ram_bytes": "100KiB", "image_size": 16}, r"`ram_bytes` '100KiB' \(102400 bytes\) is below the minimum"),
        ({"ram_bytes": "1MiB", "image_size": 512}, r"two 512 px samples \(790528 bytes each\)"),
        ({"ssd_bytes": 4096}, r"`ssd_bytes` 4096 is below the minimum"),
        (
            {"max_concurrency": 0},
            r"`max_concurrency` must be an integer >= 1, got 0\. It counts origin reads in flight",
        ),
        ({"retries": -1}, r"`retries` must be an integer >= 0, got -1\. .*0 for none"),
        ({"prefetch_batches": -3}, r"`prefetch_batches` must be an integer >= 0, got -3\. .*0 to read only on demand"),
        ({"num_workers": -1}, r"`num_workers` must be an integer >= 0 or None, got -1"),
        ({"shuffle_window": 0}, r"`shuffle_window` must be an integer >= 1 or None, got 0"),
        ({"policy": "lru"}, r"`policy` must be 'keep' or 'fifo', got 'lru'"),
        ({"shuffle": "local"}, r"`shuffle` must be one of 'auto', 'global', 'window', got 'local'"),
        (
            {"ssd_bytes": "huge"},
            r"`ssd_bytes` must be a byte count .*, or None for no cap, got 'huge'\. Use 0 to disable",
        ),
    ],
)
def test_bad_budgets_and_reader_settings_fail_at_construction(tmp_path: Path, kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as e:
        _make(tmp_path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= 400 and ("0 to disable" in msg or "must be" in msg)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"max_concurrency": 2.5}, r"`max_concurrency` must be an integer >= 1, got 2\.5 \(float\)"),
        ({"batch_size": True}, r"`batch_size` must be an integer >= 1, got True \(bool\)"),
        ({"retries": False}, r"`retries` must be an integer >= 0, got False \(bool\)"),
        ({"prefetch_batches": True}, r"`prefetch_batches` must be an integer >= 0, got True \(bool\)"),
        ({"shuffle_window": True}, r"`shuffle_window` must be an integer >= 1 or None, got True \(bool\)"),
        ({"ram_bytes": True}, r"`ram_bytes` must be a byte count .*, got True \(bool\)\. RAM is finite"),
        ({"ram_bytes": None}, r"`ram_bytes` must be a byte count .*, got None \(NoneType\)\. RAM is finite: use 0"),
        ({"stage_bytes": 1.5}, r"`stage_bytes` must be a byte count .*, got 1\.5 \(float\)"),
        ({"val_fraction": "0.1"}, r"`val_fraction` must be a number >= 0 and < 1, got '0\.1' \(str\)"),
        ({"policy": 1}, r"`policy` must be 'keep' or 'fifo', got 1 \(int\)"),
        ({"ram_ttl": True}, r"`ram_ttl` must be a duration .*, got True \(bool\)"),
    ],
)
def test_wrong_types_are_type_errors(tmp_path: Path, kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern) as e:
        _make(tmp_path, **kw)
    assert "\n" not in str(e.value)


def test_small_but_workable_budgets_and_zero_are_accepted(tmp_path: Path) -> None:
    dm = _make(tmp_path, ram_bytes="1MiB", ssd_bytes=0, image_size=16, max_concurrency=1, retries=0, prefetch_batches=0)
    assert (dm.ram_bytes, dm.ssd_bytes, dm.max_concurrency, dm.retries, dm.prefetch_batches) == (1 << 20, 0, 1, 0, 0)
    assert _make(tmp_path, ram_bytes=0, ssd_bytes=None).ssd_bytes is None
    assert _make(tmp_path, ram_bytes=1 << 20, decode=lambda b: b).ram_bytes == 1 << 20  # custom decode: size unknown


def test_dataset_refuses_a_negative_prefetch(small_digits: Path, tmp_path: Path) -> None:
    from lightning_accel.data import ImageDecoder, ObjectStore, SampleCache, list_origin

    store = ObjectStore(str(small_digits))
    cache = SampleCache(store, list_origin(store), ImageDecoder(16))
    with pytest.raises(ValueError, match=r"`prefetch_batches` must be an integer >= 0"):
        CachedDataset(cache, prefetch_batches=-1)


def test_a_new_image_size_on_the_same_cache_dir_decodes_again(small_digits: Path, tmp_path: Path) -> None:
    """The decode size is part of every entry's key: the cache never serves a sample of the old size."""
    kw: dict[str, Any] = {"cache_dir": str(tmp_path / "cache"), "ram_dir": str(tmp_path / "ram"), "num_workers": 0}
    for size, fetched in ((16, 8), (24, 8), (16, 0)):  # back at 16 px: the first run's entries, read again
        dm = CachedDataModule(str(small_digits), image_size=size, ram_bytes="4MiB", **kw)
        dm.setup("fit")
        assert dm.train_set is not None
        x, _ = dm.train_set.__getitems__(list(range(8)))
        assert tuple(x.shape) == (8, 3, size, size)
        assert dm.cache_stats["origin_fetches"] == fetched
        dm.teardown("fit")
