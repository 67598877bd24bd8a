"""What a user passes to ``CachedDataModule`` / ``CacheDataLoader`` is honoured, or they are told once why not."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from lightning_accel.data import CachedDataModule
from lightning_accel.data.dataset import CacheDataLoader


class _Counting(Dataset):
    """``n`` scalar samples; counts the reads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor(i)


@pytest.mark.parametrize("read_threads", [1, 2])
def test_the_main_process_read_ahead_stops_at_the_batches_the_pass_takes(read_threads: int) -> None:
    ds = _Counting(40)
    loader = CacheDataLoader(ds, batch_size=2, read_ahead=4, read_threads=read_threads, pass_batches=lambda: 3)
    batches = list(loader)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]
    assert ds.reads == 6  # not the 4 batches read ahead beyond the third
    assert len(loader) == 20  # the loader's length stays the whole epoch's (the Trainer caps it itself)


def test_worker_prefetch_stops_at_the_batches_the_pass_takes() -> None:
    ds = _Counting(40)
    loader = CacheDataLoader(ds, batch_size=2, num_workers=1, warm_num_workers=None, pass_batches=lambda: 2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("limit", [None, float("inf"), 50])
def test_an_unbounded_or_long_pass_reads_the_whole_epoch(limit: float | None) -> None:
    ds = _Counting(10)
    loader = CacheDataLoader(ds, batch_size=3, read_ahead=2, pass_batches=lambda: limit)
    assert sum(len(b) for b in loader) == 10 and ds.reads == 10


def _tree(root: Path) -> Path:
    from lightning_accel.datasets import materialize_digits

    materialize_digits(root, size=16, num_images=30)
    return root


def _dm(origin: Any, tmp: Path, **kw: Any) -> CachedDataModule:
    kw = {"num_workers": 0, **kw}
    return CachedDataModule(origin, cache_dir=str(tmp / "cache"), image_size=16, ram_bytes=0, batch_size=4, **kw)


def test_a_relative_origin_is_resolved_against_the_working_directory_of_the_constructor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that starts (or a job that moves) in another directory must read the directory the user named."""
    _tree(tmp_path / "a" / "data")
    _tree(tmp_path / "a" / "val")
    (tmp_path / "b" / "data").mkdir(parents=True)  # an empty namesake elsewhere
    monkeypatch.chdir(tmp_path / "a")
    dm = _dm("data", tmp_path, val_origin="val")
    assert dm.origin == str(tmp_path / "a" / "data") and dm.val_origin == str(tmp_path / "a" / "val")
    monkeypatch.chdir(tmp_path / "b")
    dm.setup("fit")
    assert dm.train_set is not None and len(dm.train_set) == 30
    assert dm.train_set.cache.listing.origin == str(tmp_path / "a" / "data")


def test_a_relative_file_url_is_resolved_in_the_constructor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    dm = _dm("file://data", tmp_path)
    assert dm.origin == f"file://{tmp_path / 'data'}"


def test_a_window_ignored_by_auto_on_an_unpacked_origin_is_reported_once(tmp_path: Path) -> None:
    dm = _dm(str(_tree(tmp_path / "data")), tmp_path, shuffle="auto", shuffle_window=3)
    dm.setup("fit")
    with pytest.warns(UserWarning, match=r"`shuffle_window` 3 is unused: `shuffle='auto'` chose the global shuffle"):
        dm.train_dataloader()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()  # once per data module, not per reload


def test_auto_without_a_window_says_nothing(tmp_path: Path) -> None:
    dm = _dm(str(_tree(tmp_path / "data")), tmp_path, shuffle="auto")
    dm.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()


class _Publishing(_Counting):
    """Records the orders its sampler publishes."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.published: list[list[int]] = []

    def publish_order(self, order: Any, batch_size: int) -> None:
        self.published.append(list(order))


def test_the_order_published_to_the_workers_stops_at_the_batches_the_pass_takes() -> None:
    """The workers read the origin ahead, and commit their write-behind queue at the last batches, of what is published:
    a pass cut to 2 batches must publish those 2 batches, not the epoch's 20."""
    from lightning_accel.data.dataset import EpochOrderSampler

    ds = _Publishing(40)
    sampler = EpochOrderSampler(ds, shuffle=False, batch_size=2)
    loader = CacheDataLoader(ds, batch_size=2, sampler=sampler, read_ahead=0, pass_batches=lambda: 2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert ds.published == [[0, 1, 2, 3]]
    whole = CacheDataLoader(ds, batch_size=2, sampler=EpochOrderSampler(ds, shuffle=False, batch_size=2), read_ahead=0)
    list(whole)
    assert ds.published[-1] == list(range(40))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_fit_limited_to_one_batch_decodes_only_that_batch(tmp_path: Path, num_workers: int) -> None:
    """``limit_train_batches=1`` with the default read-ahead (4 batches) and worker prefetch: one batch is decoded."""
    import lightning as L

    from lightning_accel.models import ImageClassifier

    dm = _dm(str(_tree(tmp_path / "data")), tmp_path, val_fraction=0, num_workers=num_workers)
    model = ImageClassifier(width=8, blocks=(1,))
    model.example_input_array = None
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    assert dm.cache_stats["origin_fetches"] == 4  # the batch the step took, not the 7 batches of the epoch


def test_a_window_ignored_by_auto_on_a_local_pack_is_reported(tmp_path: Path) -> None:
    from lightning_accel.data import pack_origin

    pack_origin(str(_tree(tmp_path / "data")), str(tmp_path / "packed"), shard_bytes=4_000)
    dm = _dm(str(tmp_path / "packed"), tmp_path, shuffle="auto", shuffle_window=2)
    dm.setup("fit")
    with pytest.warns(UserWarning, match=r"`shuffle_window` 2 is unused: .* because the pack is local"):
        loader = dm.train_dataloader()
    assert type(loader.sampler).__name__ == "EpochOrderSampler"  # the global shuffle, as reported
