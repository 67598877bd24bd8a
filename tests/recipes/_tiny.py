"""Tiny, fast fixtures for Trainer-level recipe tests: digits as in-memory 3x8x8 tensors, a width-4 classifier."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.datasets import load_digits_arrays
from lightning_accel.models import ImageClassifier


def digits_tensors(n: int = 256) -> TensorDataset:
    images, labels = load_digits_arrays()
    x = torch.from_numpy(images[:n]).float().div_(16.0).unsqueeze(1).repeat(1, 3, 1, 1)
    return TensorDataset(x, torch.from_numpy(labels[:n]))


def loader(batch_size: int = 32, n: int = 256, shuffle: bool = False) -> DataLoader:
    return DataLoader(digits_tensors(n), batch_size=batch_size, shuffle=shuffle)


def classifier(width: int = 4, lr: float = 0.01) -> ImageClassifier:
    m = ImageClassifier(width=width, lr=lr)
    m.example_input_array = torch.zeros(2, 3, 8, 8)
    return m


def trainer(**kw: Any) -> Trainer:
    args: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.update(kw)
    return Trainer(**args)


class LRProbe(Callback):
    """Records the first param group's learning rate used by each training batch."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


class TinyDigits(LightningDataModule):
    """In-memory digits (3x8x8) for CLI tests: ``n`` images, ``batch_size`` per step, no workers."""

    def __init__(self, batch_size: int = 32, n: int = 256) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n = n

    def train_dataloader(self) -> DataLoader:
        return loader(self.batch_size, self.n, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return loader(self.batch_size, min(self.n, 64))
