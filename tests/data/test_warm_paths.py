"""When a loader may take the warm path: a rank's own samples cached, undecodable samples remembered with the cache,
and cache directories that mean the same place from any working directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.data import (
    CacheDataLoader,
    CachedDataModule,
    CachedDataset,
    DecodeError,
    EpochOrderSampler,
    ImageDecoder,
    LmdbTier,
    ObjectStore,
    SampleCache,
    list_origin,
)
from lightning_accel.data.tiers import default_ram_dir


def _cache(origin: Path, tmp: Path, **kw: Any) -> SampleCache:
    store = ObjectStore(str(origin))
    return SampleCache(store, list_origin(store), ImageDecoder(16), ssd=LmdbTier(tmp / "ssd", 64 << 20), **kw)


def _epoch(loader: Any) -> int:
    n = 0
    for x, y in loader:
        assert x.shape[1:] == (3, 16, 16) and len(x) == len(y)
        n += len(x)
    return n


def _bad_origin(small_digits: Path, tmp: Path) -> tuple[Path, Path]:
    origin = tmp / "origin"
    shutil.copytree(small_digits, origin)
    bad = sorted((origin / "3").glob("*.jpg"))[0]
    bad.write_bytes(b"this is not a jpeg")
    return origin, bad


# ---- the warm check looks at what this rank reads ------------------------------------------------------------------
def test_a_rank_goes_warm_once_its_own_shard_is_cached(small_digits: Path, tmp_path: Path) -> None:
    """One rank of two on its own node (its own cache): it only ever reads its half, so a check over the whole split
    kept it cold for good."""
    ds = CachedDataset(_cache(small_digits, tmp_path))
    sampler = EpochOrderSampler(ds, num_replicas=2, rank=0, shuffle=False, batch_size=25)
    loader = CacheDataLoader(ds, batch_size=25, sampler=sampler, num_workers=1, persistent_workers=True)
    assert _epoch(loader) == 100 and not loader.is_warm
    assert ds.cached_fraction() == 0.5  # the other rank's half is another node's
    assert ds.cached_fraction(positions=sampler.epoch_order()) == 1.0
    assert _epoch(loader) == 100
    assert loader.is_warm and loader.num_workers == 0
    assert ds.stats.as_dict()["origin_fetches"] == 100


def test_a_shuffled_rank_stays_cold_while_its_next_epoch_holds_misses(small_digits: Path, tmp_path: Path) -> None:
    ds = CachedDataset(_cache(small_digits, tmp_path))
    sampler = EpochOrderSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3, batch_size=25)
    loader = CacheDataLoader(ds, batch_size=25, sampler=sampler, num_workers=0, read_ahead=0, warm_num_workers=None)
    _epoch(loader)
    sampler.set_epoch(1)
    order = sampler.epoch_order()
    assert ds.cached_fraction(positions=order) < 1.0  # another half of the split: some samples not read yet
    loader.warm_num_workers = 0
    loader.cold_num_workers = 2  # as a loader with cold workers: only the check decides
    loader._check_warm()
    assert not loader.is_warm
    ds.cache.load([ds.indices[p] for p in order])  # this epoch's samples cached (e.g. by an earlier run)
    loader._check_warm()
    assert loader.is_warm


def test_cached_fraction_checks_its_positions(small_digits: Path, tmp_path: Path) -> None:
    ds = CachedDataset(_cache(small_digits, tmp_path), indices=range(10))
    with pytest.raises(ValueError, match=r"`positions` must lie in \[0, 10\), got 10"):
        ds.cached_fraction(positions=[0, 10])
    assert ds.cached_fraction(positions=[]) == 1.0


def test_the_warm_check_looks_only_at_the_batches_a_pass_takes(small_digits: Path, tmp_path: Path) -> None:
    ds = CachedDataset(_cache(small_digits, tmp_path))
    ds.cache.load(ds.indices[:40])  # the first two batches of 20 cached

    def loader(limit: float | None) -> CacheDataLoader:
        sampler = EpochOrderSampler(ds, shuffle=False, batch_size=20)
        out = CacheDataLoader(ds, batch_size=20, sampler=sampler, read_ahead=0, pass_batches=lambda: limit)
        out.cold_num_workers = 2  # as a loader with cold workers: only the check decides
        out._check_warm()
        return out

    assert loader(2).is_warm
    assert not loader(3).is_warm and not loader(None).is_warm and not loader(float("inf")).is_warm
    with pytest.raises(TypeError, match=r"^`pass_batches` must be a callable `fn\(\) -> int \| None` or None, got 2"):
        CacheDataLoader(ds, batch_size=20, pass_batches=2)  # type: ignore[arg-type]


# ---- undecodable samples are remembered -----------------------------------------------------------------------------
def test_an_undecodable_sample_is_remembered_with_the_cache(small_digits: Path, tmp_path: Path) -> None:
    origin, bad = _bad_origin(small_digits, tmp_path)
    c = _cache(origin, tmp_path / "c", on_decode_error="skip")
    i = c.listing.keys.index(f"3/{bad.name}")
    assert c.load([0, i, 1]).kept == [0, 2]
    assert c.not_yet_seen_cached([0, i, 1]) == []  # known: nothing left to decode
    # a later run (another process tree) finds the record in the tier: the sample is skipped without a read
    c2 = _cache(origin, tmp_path / "c", on_decode_error="skip")
    assert c2.cached([i]) == [True]
    out = c2.load([0, i, 1])
    s = c2.stats.as_dict()
    assert out.kept == [0, 2] and out.images.shape[0] == 2 and out.labels.tolist() == c2.load([0, 1]).labels.tolist()
    assert (s["origin_fetches"], s["decode_skipped"], s["bytes_fetched"]) == (0, 1, 0)
    # a batch of only the known-bad sample keeps its row shape
    assert tuple(c2.load([i]).images.shape) == (0, 3, 16, 16)
    # with "raise" the sample is decoded again, and the error names it
    c3 = _cache(origin, tmp_path / "c", on_decode_error="raise")
    with pytest.raises(DecodeError, match=rf"3/{bad.name}"):
        c3.load([0, i])


def test_a_fixed_file_is_decoded_again(small_digits: Path, tmp_path: Path) -> None:
    origin, bad = _bad_origin(small_digits, tmp_path)
    c = _cache(origin, tmp_path / "c", on_decode_error="skip")
    i = c.listing.keys.index(f"3/{bad.name}")
    assert c.load([i]).kept == []
    good = small_digits / "3" / bad.name
    shutil.copyfile(good, bad)  # fixed: another size and mtime, so another content identity
    os.utime(bad, (1, 1))
    c2 = _cache(origin, tmp_path / "c", on_decode_error="skip")
    out = c2.load([i])
    assert out.kept == [0] and c2.stats.as_dict()["origin_fetches"] == 1


def test_a_loader_that_skips_samples_goes_warm(small_digits: Path, tmp_path: Path) -> None:
    origin, _ = _bad_origin(small_digits, tmp_path)
    ds = CachedDataset(_cache(origin, tmp_path / "c", on_decode_error="skip"))
    sampler = EpochOrderSampler(ds, batch_size=50)
    loader = CacheDataLoader(ds, batch_size=50, sampler=sampler, num_workers=1, persistent_workers=True)
    assert _epoch(loader) == 199 and not loader.is_warm
    assert ds.cached_fraction() == 1.0
    assert _epoch(loader) == 199
    s = ds.stats.as_dict()
    assert loader.is_warm and loader.num_workers == 0
    assert (s["origin_fetches"], s["decode_skipped"]) == (200, 2)  # read once; skipped in both epochs


# ---- cache directories from any working directory -------------------------------------------------------------------
def test_a_relative_ram_dir_is_resolved_when_the_module_is_made(
    small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    dm = CachedDataModule(str(small_digits), cache_dir="cache", ram_dir="ram/node{node_rank}", num_workers=0)
    assert dm.ram_dir == str(tmp_path / "ram" / "node0")
    assert dm.cache_dir == str(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a process started in another directory (a spawned rank, a job script's cd)
    dm.setup("fit")
    assert dm.train_set is not None
    ram = dm.train_set.cache.ram
    assert ram is not None and ram.path == str(tmp_path / "ram" / "node0")
    assert not (elsewhere / "ram").exists()


def test_a_relative_ram_root_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_ACCEL_RAM_ROOT", "shm")
    assert default_ram_dir("abc") == str(tmp_path / "shm" / "abc")


def test_decoded_rows_match_across_paths(small_digits: Path, tmp_path: Path) -> None:
    """The skipped sample's neighbours are the very images a fresh decode gives (no row shifted by the skip)."""
    origin, bad = _bad_origin(small_digits, tmp_path)
    c = _cache(origin, tmp_path / "c", on_decode_error="skip")
    i = c.listing.keys.index(f"3/{bad.name}")
    first = c.load([i - 1, i, i + 1]).images.clone()
    again = _cache(origin, tmp_path / "c", on_decode_error="skip").load([i - 1, i, i + 1]).images
    fresh = torch.stack([ImageDecoder(16)((origin / c.listing.keys[j]).read_bytes()) for j in (i - 1, i + 1)])
    assert torch.equal(first, fresh) and torch.equal(again, fresh)


# ---- Trainer limits: overfit_batches ---------------------------------------------------------------------------------
def test_overfit_batches_trains_on_the_same_batches_and_goes_warm(small_digits: Path, tmp_path: Path) -> None:
    import lightning as L

    from lightning_accel.models import ImageClassifier

    seen: list[list[int]] = []
    warm: list[bool] = []

    class _Model(ImageClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(batch[1].tolist())
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self) -> None:
            loader: Any = self.trainer.train_dataloader
            warm.append(bool(loader.is_warm))

    dm = CachedDataModule(
        str(small_digits),
        cache_dir=str(tmp_path / "cache"),
        ram_dir=str(tmp_path / "ram"),
        ram_bytes="4MiB",
        image_size=16,
        batch_size=8,
        num_workers=1,
        val_fraction=0.2,
    )
    model = _Model(width=8, blocks=(1,))
    model.example_input_array = None
    trainer = L.Trainer(
        max_epochs=3,
        overfit_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    assert len(seen) == 6 and seen[0:2] == seen[2:4] == seen[4:6]  # the same two batches every epoch
    # 16 of the 160 training samples are read per epoch: the loader goes warm once those are cached
    assert warm == [False, True, True]
