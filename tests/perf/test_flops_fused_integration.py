"""``PerformanceMonitor``'s FLOPs per step (hence MFU) with ``FusedPrecision``: the same as for the unfused model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel as la


class ConvNet(pl.LightningModule):
    """Conv2d + BatchNorm2d + ReLU and Linear + GELU + Dropout (both fused by surgery), LayerNorm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
            nn.Linear(4 * 6 * 6, 8), nn.GELU(), nn.Dropout(0.2), nn.LayerNorm(8), nn.Linear(8, 3),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _flops_per_step(root: Path, plugins: list[Any], precision: str | None) -> int | None:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(12, 3, 6, 6), torch.randint(0, 3, (12,))), batch_size=4)
    monitor = la.PerformanceMonitor(log_every_n_steps=1, skip_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        default_root_dir=root,  # where the monitor writes its report
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
        plugins=plugins,
        precision=precision,  # type: ignore[arg-type]
    )
    trainer.fit(ConvNet(), loader)
    assert monitor.report is not None
    return monitor.report.flops_per_step


def test_fused_precision_counts_the_flops_of_the_unfused_model(tmp_path: Path) -> None:
    """The fused conv + BN + ReLU recomputes its convolution in backward: that work is not the model's FLOPs, and
    counted it raised the step's count (and MFU) by a third of the convolution's share."""
    unfused = _flops_per_step(tmp_path / "unfused", [], "bf16-mixed")
    fused = _flops_per_step(tmp_path / "fused", [la.FusedPrecision("bf16-mixed", backend="reference")], None)
    assert unfused is not None and unfused > 0
    assert fused == unfused
