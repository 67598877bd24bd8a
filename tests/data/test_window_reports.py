"""A ``shuffle_window`` that cannot shuffle within windows is reported once, on rank 0, with what it does instead."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.data import CachedDataModule, ShardWindowSampler, pack_origin


def _packed(tmp: Path) -> tuple[str, int]:
    from lightning_accel.datasets import materialize_digits

    materialize_digits(tmp / "data", size=16, num_images=30)
    info = pack_origin(str(tmp / "data"), str(tmp / "packed"), shard_bytes=4_000)
    assert info.pack is not None
    return str(tmp / "packed"), len(info.pack.shard_sizes)


def _dm(origin: str, tmp: Path, **kw: Any) -> CachedDataModule:
    return CachedDataModule(
        origin, cache_dir=str(tmp / "cache"), image_size=16, ram_bytes=0, batch_size=4, num_workers=0, **kw
    )


@pytest.mark.parametrize("extra", [0, 40])
def test_a_window_as_wide_as_the_pack_is_reported_once(tmp_path: Path, extra: int) -> None:
    origin, shards = _packed(tmp_path)
    assert shards > 2
    dm = _dm(origin, tmp_path, shuffle="window", shuffle_window=shards + extra)
    dm.setup("fit")
    match = rf"`shuffle_window` {shards + extra} covers all {shards} shards of the pack: .* Pass a `shuffle_window`"
    with pytest.warns(UserWarning, match=match):
        loader = dm.train_dataloader()
    assert isinstance(loader.sampler, ShardWindowSampler)  # the order asked for, as reported
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()  # once per data module, not per reload


def test_a_window_narrower_than_the_pack_says_nothing(tmp_path: Path) -> None:
    origin, shards = _packed(tmp_path)
    dm = _dm(origin, tmp_path, shuffle="window", shuffle_window=shards - 1)
    dm.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()


def test_the_report_says_when_the_stage_cannot_hold_the_pack(tmp_path: Path) -> None:
    dm = _dm(str(tmp_path), tmp_path, shuffle="window", shuffle_window=3)
    with pytest.warns(UserWarning, match=r"the stage \(`stage_bytes` 100\) is smaller than the pack \(180 bytes\)"):
        dm._report_whole_pack_window(True, 100, [60, 60, 60])
