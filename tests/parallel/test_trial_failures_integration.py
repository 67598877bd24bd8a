"""``AutoStrategy(policy="measure")`` when a trial fails on one rank before the plan is built (2 gloo processes): an
out-of-memory copying the model, or in the forward the pipeline's split measures, on that rank alone. The pipeline
plan makes its process groups next (``new_group``: every rank must make each one), so a rank that failed before them
left the others waiting there, and every later group paired up out of step; every rank must drop the plan together
and the fit go on."""

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


class CopyFailsOnceOnRankOne(nn.Module):
    """The identity; the first copy of it on rank 1 runs out of memory, as the trial's copy of a model that barely
    fits would on one rank's smaller device (only the first: the other plans' trials copy it too)."""

    copies = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __deepcopy__(self, memo: dict[int, Any]) -> CopyFailsOnceOnRankOne:
        if dist.is_initialized() and dist.get_rank() == 1 and CopyFailsOnceOnRankOne.copies == 0:
            CopyFailsOnceOnRankOne.copies += 1
            raise RuntimeError("out of memory copying the model on rank 1")
        new = CopyFailsOnceOnRankOne()
        memo[id(self)] = new
        return new


class SplitFailsOnRankOne(nn.Module):
    """The identity; on rank 1 it runs out of memory in the forward that only the pipeline's split runs (measuring
    each piece's activations), before the split makes its process groups."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 1 and self._in_split():
            raise RuntimeError("out of memory measuring the split on rank 1")
        return x

    @staticmethod
    def _in_split() -> bool:
        import inspect

        return any(f.function == "piece_costs" for f in inspect.stack(context=0))


class Net(pl.LightningModule):
    def __init__(self, failing: nn.Module) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), failing)
        self.example_input_array = torch.randn(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(rank: int, world: int, failing: str) -> dict[str, Any]:
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
    module = CopyFailsOnceOnRankOne() if failing == "copy" else SplitFailsOnRankOne()
    trainer.fit(Net(module), loader)
    assert strategy.choice is not None
    # the default group is still in step: a collective after the fit meets the same one on the other rank
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"plan": strategy.choice.plan, "dropped": strategy.choice.dropped, "steps": trainer.global_step,
            "sum": float(t)}  # fmt: skip


def test_a_trial_whose_model_copy_fails_on_one_rank_is_dropped_on_every_rank() -> None:
    r0, r1 = run_in_processes(_fit, 2, ("copy",), init_process_group=False, timeout=240)
    want = {"plan": "ddp", "steps": 2, "sum": 3.0}
    want["dropped"] = {"pipeline": "rank 1: RuntimeError: out of memory copying the model on rank 1"}
    assert r0 == r1 == want


def test_a_pipeline_trial_whose_split_fails_on_one_rank_is_dropped_on_every_rank() -> None:
    r0, r1 = run_in_processes(_fit, 2, ("split",), init_process_group=False, timeout=240)
    want = {"plan": "ddp", "steps": 2, "sum": 3.0}
    want["dropped"] = {"pipeline": "rank 1: RuntimeError: out of memory measuring the split on rank 1"}
    assert r0 == r1 == want
