"""Buffers under the sharded and pipeline strategies (2 gloo processes): BatchNorm's running statistics follow
DistributedDataParallel's rule (rank 0's copied to every rank before each training forward) instead of drifting
apart on each rank, every rank evaluates with the statistics the checkpoint holds, and a sharded checkpoint folder holds
rank 0's, as DistributedDataParallel's file does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from tests.helpers import run_in_processes


class BatchNormNet(pl.LightningModule):
    """Linear -> BatchNorm -> Tanh -> Linear (an ``nn.Sequential``: the pipeline splits it), SGD with momentum, and
    a bool buffer beside the statistics (a mask every rank must keep)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        # inside the network: the pipeline keeps only the buffers its stages use
        self.net[1].register_buffer("mask", torch.tensor([True, False, True]))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    # shifted and scaled inputs: each rank's half of the batches gives its own running statistics
    x = torch.randn(64, 4, generator=g) * 3 + 1
    ds = torch.utils.data.TensorDataset(x, torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _stats(model: pl.LightningModule) -> list[float]:
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d))
    out: list[float] = []
    for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked):
        assert isinstance(t, torch.Tensor)  # buffers stay plain tensors: no plan shards them
        out += [float(v) for v in t.reshape(-1)]
    return out


def _fits(rank: int, world: int) -> dict[str, Any]:
    from lightning_accel.strategies import PipelineStrategy, ShardedStrategy

    out: dict[str, Any] = {}
    strategies: dict[str, Any] = {
        "ddp": lambda: "ddp",
        "sharded": lambda: ShardedStrategy(),
        # one stage per rank, 2 replicas, one micro-batch: the step of DDP
        "pipeline": lambda: PipelineStrategy(pipeline_size=1, microbatches=1),
    }
    for name, make in strategies.items():
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=make(), max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )  # fmt: skip
        model = BatchNormNet()
        trainer.fit(model, _loader())
        after_fit = _stats(model)
        trainer.validate(model, _loader(), verbose=False)
        out[name] = {"fit": after_fit, "validate": _stats(model), "mask": model.get_buffer("net.1.mask").tolist()}
    return out


def test_batchnorm_statistics_follow_ddp_and_every_rank_evaluates_with_rank_0s() -> None:
    ranks = run_in_processes(_fits, 2, init_process_group=False, timeout=600)
    for name in ("sharded", "pipeline"):
        for rank, r in enumerate(ranks):
            # before each step rank 0's statistics reach every rank: after the fit each rank holds them plus its
            # own last update, exactly as under DDP (without the copy rank 1's drift from its own batches only)
            got, want = r[name]["fit"], r["ddp"]["fit"]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6, (name, rank, got, want)
            assert r[name]["mask"] == [True, False, True]
        # evaluation starts from rank 0's statistics (those the checkpoint holds) on every rank
        assert ranks[1][name]["validate"] == ranks[0][name]["validate"], name
        assert ranks[0][name]["validate"] == ranks[0][name]["fit"], name


def _saves(rank: int, world: int, tmp: str) -> None:
    from lightning_accel.strategies import ShardedStrategy

    for name, make in (("ddp", lambda: "ddp"), ("folder", lambda: ShardedStrategy(save_distributed_checkpoint=True))):
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=make(), max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(BatchNormNet(), _loader())
        trainer.save_checkpoint(os.path.join(tmp, name))


def test_a_sharded_checkpoint_folder_holds_rank_0s_batchnorm_statistics(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_in_processes(_saves, 2, (str(tmp_path),), init_process_group=False, timeout=600)
    assert (tmp_path / "folder").is_dir()
    dcp_to_torch_save(tmp_path / "folder", tmp_path / "folder.pt")
    got = torch.load(tmp_path / "folder.pt", weights_only=False)["state_dict"]
    want = torch.load(tmp_path / "ddp", weights_only=False)["state_dict"]
    # each rank's statistics include its own last batch: the folder holds rank 0's, like DDP's file (and a run resumed
    # from it goes on with them), not those of whichever rank the writer picked for a replicated tensor
    for key in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked", "net.1.mask"):
        assert torch.allclose(got[key].double(), want[key].double(), atol=1e-6), (key, got[key], want[key])
