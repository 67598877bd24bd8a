from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_accel.datasets import DigitsDataModule
from lightning_accel.datasets.datamodule import split_indices


def test_split_is_deterministic_and_disjoint() -> None:
    tr, va = split_indices(100, 0.2, seed=1)
    assert len(va) == 20 and not set(tr) & set(va) and sorted(tr + va) == list(range(100))
    assert (tr, va) == split_indices(100, 0.2, seed=1)
    with pytest.raises(ValueError, match="`val_fraction`"):
        split_indices(10, 1.0, 0)


def test_datamodule_batches(digits_dir: Path) -> None:
    dm = DigitsDataModule(data_dir=str(digits_dir), image_size=32, batch_size=16, num_workers=0)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(dm.train_set) + len(dm.val_set) == 1797
    with pytest.raises(ValueError, match="`batch_size`"):
        DigitsDataModule(batch_size=0)
