"""Tiny models, data and Trainers shared by the tests (fast on 2 CPU cores).

- :class:`VirtualTime`: a clock that only moves when told (the one fake clock of the suite).
- Timing fixtures: :class:`DecodeDataset` / :class:`TimedModule` / :func:`loaders` advance a virtual clock.
- Checkpoint fixtures: :class:`CheckpointModel` (Linear + BatchNorm + Adam), :func:`tiny_loader`, :func:`ckpt_trainer`.
- Recipe fixtures: digits as in-memory 3x8x8 tensors (:func:`loader`), a width-4 :func:`classifier`, :func:`trainer`,
  :class:`LRProbe`, :class:`TinyDigits`, :class:`DictStudent` (a distillation student).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

from lightning_accel.datasets import load_digits_arrays
from lightning_accel.models import ImageClassifier


class VirtualTime:
    """A clock that only moves when told: decode and compute "take" exactly the time we say."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class DecodeDataset(Dataset):
    """``n`` random samples; each ``__getitem__`` advances the virtual clock by ``decode_s`` (a slow decode)."""

    def __init__(self, vt: VirtualTime | None, n: int = 64, decode_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.vt, self.decode_s = vt, decode_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.vt is not None:
            self.vt.advance(self.decode_s)
        return self.x[i], self.y[i]


class TimedModule(LightningModule):
    """A linear classifier whose training step advances the virtual clock by ``compute_s``."""

    def __init__(self, vt: VirtualTime | None = None, compute_s: float = 0.0, val_s: float = 0.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.vt, self.compute_s, self.val_s = vt, compute_s, val_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.vt is not None:
            self.vt.advance(self.compute_s)
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.vt is not None:
            self.vt.advance(self.val_s)
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loaders(vt: VirtualTime | None, decode_s: float, batch_size: int = 4) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(DecodeDataset(vt, 64, decode_s), batch_size=batch_size, num_workers=0)
    val = DataLoader(DecodeDataset(None, 8), batch_size=batch_size, num_workers=0)
    return train, val


class CheckpointModel(L.LightningModule):
    """Two linear layers + BatchNorm (a float buffer and an int buffer) trained with Adam."""

    def __init__(self, hidden: int = 48, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def tiny_loader(n: int = 128, batch_size: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(dim=1)).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def ckpt_trainer(root: Any, plugins: list[Any], callbacks: list[Any], **kw: Any) -> L.Trainer:
    """A 2-epoch Trainer writing under ``root``, validating 2 batches."""
    defaults: dict[str, Any] = dict(
        default_root_dir=str(root),
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    defaults.update(kw)
    return L.Trainer(plugins=plugins, callbacks=callbacks, **defaults)


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
    """A quiet 1-epoch, 4-batch CPU Trainer without validation or checkpoints; ``kw`` overrides."""
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


class DictStudent(LightningModule):
    """Returns ``{"loss", "logits"}`` from ``training_step`` (the explicit protocol); no BatchNorm, no dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(192, 10))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self.net(x)  # not through self(): the logits come from the dict
        return {"loss": F.cross_entropy(logits, y), "logits": logits}

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)
