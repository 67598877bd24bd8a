"""A tiny Lightning model and data for the checkpoint tests (fast on 2 CPU cores)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(L.LightningModule):
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


def trainer(root: Any, plugins: list[Any], callbacks: list[Any], **kw: Any) -> L.Trainer:
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
