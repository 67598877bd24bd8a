"""Tiny models and datasets for callback tests: a virtual clock that the data and the model advance."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


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


class TinyModule(pl.LightningModule):
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
