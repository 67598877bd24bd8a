"""A checkpoint saved under DDP resumes under the plans ``AutoStrategy`` may choose next time (2 gloo processes, one
launch): the sharded and pipeline strategies restore its optimizer state, which lists the parameters by position,
and train on exactly as DDP resuming its own checkpoint does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from tests.helpers import run_in_processes


class TiedNet(pl.LightningModule):
    """An ``nn.Sequential`` whose last layer shares its weight with the first (on different pipeline stages), with two
    parameter groups and SGD momentum: a lost or misplaced momentum buffer changes the next updates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4),
            torch.nn.Tanh(), torch.nn.Linear(4, 4),
        )  # fmt: skip
        self.net[6].weight = self.net[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters())
        weights = [p for n, p in named if n.endswith("weight")]
        biases = [p for n, p in named if n.endswith("bias")]
        return torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.1, momentum=0.9)


def _loader(rank: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g))
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)


def _fit(strategy: Any, rank: int, steps: int, *, save: str | None = None, resume: str | None = None) -> Any:
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(TiedNet(), _loader(rank), ckpt_path=resume)
    if save:
        t.save_checkpoint(save)
    return {k: v.detach().cpu().numpy() for k, v in t.strategy.lightning_module_state_dict().items()}


def _resume_ddp_checkpoint(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from lightning_accel.parallel import PipelineStrategy, ShardedStrategy

    ckpt = os.path.join(tmp, "ddp.ckpt")
    _fit("ddp", rank, 2, save=ckpt)
    out = {"ddp": _fit("ddp", rank, 4, resume=ckpt)}
    out["fsdp"] = _fit(ShardedStrategy(batch_split="world"), rank, 4, resume=ckpt)
    out["pipeline"] = _fit(PipelineStrategy(batch_split="world"), rank, 4, resume=ckpt)
    return out


def test_a_ddp_checkpoint_resumes_under_the_sharded_and_pipeline_plans(tmp_path: Path) -> None:
    r0, _ = run_in_processes(_resume_ddp_checkpoint, 2, (str(tmp_path),), init_process_group=False, timeout=300)
    ref = r0["ddp"]
    for plan in ("fsdp", "pipeline"):
        assert set(r0[plan]) >= set(ref), plan
        for k, v in ref.items():
            diff = float(abs(r0[plan][k] - v).max())
            assert diff < 1e-5, f"{plan} resumed from DDP's checkpoint: `{k}` is {diff:.2e} from DDP's own resume"
