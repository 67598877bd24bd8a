"""Trainer-level: validation labels follow the training classes, and a resume on data with other classes fails
before its first step."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_accel.data import CachedDataModule
from lightning_accel.models import ImageClassifier


def _tree(root: Path, classes: dict[str, int], src: Path) -> Path:
    """Class folders of JPEGs taken from one digit folder per class, so that a class's images look alike."""
    for name, (digit, n) in classes.items():
        (root / name).mkdir(parents=True)
        for k, p in enumerate(sorted((src / str(digit)).glob("*.jpg"))[:n]):
            shutil.copy(p, root / name / f"{k:03d}.jpg")
    return root


class _Labels(ImageClassifier):
    """Records the label of every validation sample and the training steps taken."""

    def __init__(self) -> None:
        super().__init__(width=8, blocks=(1,), num_classes=3)
        self.example_input_array = None
        self.val_labels: list[int] = []
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_labels += batch[1].tolist()


def _trainer(tmp: Path, **kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp),
        **kw,
    )


def _dm(origin: Path, tmp: Path, **kw: Any) -> CachedDataModule:
    kw = {"cache_dir": str(tmp / "cache"), "ram_bytes": 0, "image_size": 16, "batch_size": 8, "num_workers": 0, **kw}
    return CachedDataModule(str(origin), **kw)


def test_fit_validates_with_the_training_labels_and_resume_checks_the_classes(
    small_digits: Path, tmp_path: Path
) -> None:
    train = _tree(tmp_path / "train", {"a": (1, 8), "b": (2, 8), "c": (3, 8)}, small_digits)
    val = _tree(tmp_path / "val", {"c": (3, 4)}, small_digits)  # only "c": label 2, as in training
    dm = _dm(train, tmp_path, val_origin=str(val))
    model = _Labels()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model, datamodule=dm)
    assert dm.classes == ["a", "b", "c"] and model.val_labels == [2] * 4
    ckpt = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    assert ckpt and torch.load(ckpt, weights_only=False)["CachedDataModule"]["classes"] == ["a", "b", "c"]

    other = _tree(tmp_path / "other", {"a": (1, 8), "c": (3, 8), "d": (4, 8)}, small_digits)
    resumed = _Labels()
    with pytest.raises(ValueError, match=r"the checkpoint was trained on 3 classes \['a', 'b', 'c'\]") as e:
        _trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=_dm(other, tmp_path / "o"), ckpt_path=ckpt)
    assert "\n" not in str(e.value) and resumed.steps == 0  # refused before the first step
