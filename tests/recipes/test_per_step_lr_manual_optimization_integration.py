"""PerStepLR's horizon for a manually optimized module with two optimizers, each stepping its own WarmupCosineLR once
per batch: Lightning counts both optimizers' steps in ``global_step`` (and so in ``max_steps``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_accel.recipes import PerStepLR, WarmupCosineLR
from lightning_accel.recipes.lr import warmup_cosine_value


class _TwoOptimizers(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.automatic_optimization = False
        self.lrs: list[tuple[float, float]] = []

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()  # type: ignore[misc]
        sched_a, sched_b = self.lr_schedulers()  # type: ignore[misc]
        self.lrs.append((opt_a.param_groups[0]["lr"], opt_b.param_groups[0]["lr"]))
        loss = F.cross_entropy(self.b(self.a(x)), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        sched_a.step()
        sched_b.step()

    @override
    def configure_optimizers(self) -> Any:
        opt_a = torch.optim.SGD(self.a.parameters(), lr=0.1)
        opt_b = torch.optim.SGD(self.b.parameters(), lr=0.01)
        return [opt_a, opt_b], [WarmupCosineLR(opt_a, warmup_steps=2), WarmupCosineLR(opt_b, warmup_steps=2)]


@pytest.mark.parametrize(("limits", "batches"), [({"max_steps": 10}, 5), ({"max_epochs": 2}, 20)])
def test_each_schedule_spans_the_batches_the_fit_trains(limits: dict[str, int], batches: int) -> None:
    model = _TwoOptimizers()
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PerStepLR()],
        **limits,
    )
    data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    trainer.fit(model, DataLoader(data, batch_size=4))
    assert len(model.lrs) == batches
    assert [cfg.scheduler.total_steps for cfg in trainer.lr_scheduler_configs] == [batches, batches]
    for step, (a, b) in enumerate(model.lrs):
        assert math.isclose(a, warmup_cosine_value(step, 0.1, batches, 2, 0.0))
        assert math.isclose(b, warmup_cosine_value(step, 0.01, batches, 2, 0.0))
