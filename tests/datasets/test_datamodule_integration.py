"""`DigitsDataModule` in real `Trainer` fits: a last training batch of one image with a BatchNorm model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel.datasets import DigitsDataModule
from lightning_accel.models import ImageClassifier
from tests.helpers import run_in_processes


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_a_last_batch_of_one_image_is_dropped_for_a_batchnorm_model(tmp_path: Path) -> None:
    """81 training images in batches of 16 leave a last batch of 1: at 8 px `SmallResNet`'s last feature map is 1x1,
    and its BatchNorm stopped the fit with "Expected more than 1 value per channel when training"."""
    dm = DigitsDataModule(tmp_path / "d", image_size=8, num_images=101, batch_size=16, num_workers=0)
    trainer = _trainer(devices=1)
    trainer.fit(ImageClassifier(width=4), datamodule=dm)
    assert dm.train_set is not None and len(dm.train_set) == 81
    assert trainer.global_step == 5  # 5 full batches; the lone 81st image is left out of the epoch


class _NoNorm(pl.LightningModule):
    """A classifier without BatchNorm: it trains on a batch of one image, so nothing is dropped for it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
        self.sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.sizes.append(int(x.shape[0]))
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_image_is_kept_without_batchnorm_and_for_other_last_batches(tmp_path: Path) -> None:
    dm = DigitsDataModule(tmp_path / "d", image_size=8, num_images=101, batch_size=16, num_workers=0)
    model = _NoNorm()
    _trainer(devices=1).fit(model, datamodule=dm)
    assert model.sizes == [16, 16, 16, 16, 16, 1]
    # a last batch of 2 or more is kept with BatchNorm too: 82 training images, 5 batches of 16 and one of 2
    dm = DigitsDataModule(tmp_path / "d2", image_size=8, num_images=102, batch_size=16, num_workers=0)
    trainer = _trainer(devices=1)
    trainer.fit(ImageClassifier(width=4), datamodule=dm)
    assert dm.train_set is not None and len(dm.train_set) == 82 and trainer.global_step == 6


def _ddp_lone_last(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0)
    # 66 training images: 33 per rank, in batches of 16 a last batch of 1 on each rank
    dm = DigitsDataModule(root, image_size=8, num_images=83, batch_size=16, num_workers=0)
    trainer = _trainer(devices=2, strategy="ddp")
    model = ImageClassifier(width=4)
    trainer.fit(model, datamodule=dm)
    assert dm.train_set is not None
    return {
        "n": len(dm.train_set),
        "steps": trainer.global_step,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    }


@pytest.mark.slow
def test_the_lone_last_batch_is_dropped_on_every_rank_under_ddp(tmp_path: Path) -> None:
    r0, r1 = run_in_processes(_ddp_lone_last, 2, (str(tmp_path / "d"),), init_process_group=False, timeout=240)
    assert r0["n"] == r1["n"] == 66
    assert r0["steps"] == r1["steps"] == 2
    assert torch.allclose(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))  # DDP kept one model


def test_the_cached_module_drops_a_lone_last_batch_for_a_batchnorm_model(tmp_path: Path) -> None:
    """The same fit through `DigitsCachedDataModule` (the cached loader and its sampler): the lone 97th image at 8 px
    stopped it with BatchNorm's "Expected more than 1 value per channel when training"."""
    from lightning_accel.datasets import DigitsCachedDataModule

    cached: dict[str, Any] = dict(
        digits_size=8,
        image_size=8,
        num_images=97,
        val_fraction=0.0,
        batch_size=16,
        num_workers=0,
        ram_bytes=0,
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
    )
    dm = DigitsCachedDataModule(str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), **cached)
    trainer = _trainer(devices=1)
    trainer.fit(ImageClassifier(width=4), datamodule=dm)
    assert dm.train_set is not None and len(dm.train_set) == 97
    assert trainer.global_step == 6  # 6 full batches; the lone 97th image is left out of the epoch
    # without BatchNorm nothing is dropped: 7 batches, the last of one image
    plain = DigitsCachedDataModule(str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), **cached)
    trainer = _trainer(devices=1)
    trainer.fit(_NoNorm(), datamodule=plain)
    assert trainer.global_step == 7
