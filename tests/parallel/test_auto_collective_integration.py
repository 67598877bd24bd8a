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


class FailsOnRankOne(nn.Module):
    """The identity, but on rank 1 it raises for a batch of 2 rows: the pipeline trial's micro-batches (a global
    batch of 8 in 4 micro-batches), as an out-of-memory on one rank's smaller device would. The estimate, the DDP trial
    and the fit run batches of 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2 and dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("CUDA out of memory on rank 1")
        return x


class FailsOnOneRank(CenteredNet):
    def __init__(self) -> None:
        super().__init__()
        # the failing piece on the pipeline's last stage (rank 1): rank 0 has sent its activations and waits for
        # their gradients from rank 1
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), FailsOnRankOne())


def _fit_after_a_trial_fails_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    # a short process-group timeout: a rank left alone in a collective fails the test in seconds, not 30 minutes
    strategy = AutoStrategy(
        "measure", device_memory_bytes=10**9, candidates=["pipeline", "ddp"], trial_steps=1,
        timeout=datetime.timedelta(seconds=45),
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)
    trainer.fit(FailsOnOneRank(), loader)
    assert strategy.choice is not None
    return {"plan": strategy.choice.plan, "dropped": strategy.choice.dropped, "steps": trainer.global_step}


def test_a_trial_that_fails_on_one_rank_is_dropped_on_every_rank_and_the_fit_goes_on() -> None:
    r0, r1 = run_in_processes(_fit_after_a_trial_fails_on_one_rank, 2, init_process_group=False, timeout=240)
    # rank 0 waited in the pipeline for rank 1's gradients: it is let go, and the error named is rank 1's own
    want = {"plan": "ddp", "dropped": {"pipeline": "rank 1: RuntimeError: CUDA out of memory on rank 1"}, "steps": 2}
    assert r0 == r1 == want
