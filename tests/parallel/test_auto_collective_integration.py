"""AutoStrategy chooses at setup on a model whose forward runs a collective (2 gloo processes): every rank runs the
estimate's forward and backward on ``example_input_array``, so the collective is joined by every rank and the fit
goes on instead of rank 0 waiting for ranks that sit in the choice's broadcast."""

from __future__ import annotations

import datetime
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_accel.parallel import AutoStrategy
from tests.helpers import run_in_processes


class SyncCenter(nn.Module):
    """Centres its input by the mean over every rank's batch in training mode: a collective in forward, as
    ``nn.SyncBatchNorm`` runs on GPUs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_available() and dist.is_initialized():
            mean = x.detach().mean(0)
            dist.all_reduce(mean)
            return x - mean / dist.get_world_size()
        return x


class CenteredNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), SyncCenter(), nn.ReLU(), nn.Linear(16, 8))
        self.example_input_array = torch.randn(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(rank: int, world: int) -> dict[str, Any]:
    # a short process-group timeout: a rank left alone in a collective fails the test in seconds, not 30 minutes
    strategy = AutoStrategy(device_memory_bytes=10**9, example_batch_size=4, timeout=datetime.timedelta(seconds=45))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)
    trainer.fit(CenteredNet(), loader)
    assert strategy.choice is not None
    return {
        "strategy": strategy.choice.strategy,
        "activations": strategy.choice.facts["activations_source"],
        "steps": trainer.global_step,
    }


def test_choice_runs_the_model_on_every_rank() -> None:
    r0, r1 = run_in_processes(_fit, 2, init_process_group=False, timeout=240)
    assert r0 == r1 == {"strategy": "ddp", "activations": "measured", "steps": 3}
