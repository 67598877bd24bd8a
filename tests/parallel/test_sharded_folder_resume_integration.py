"""``ShardedStrategy`` resuming from a ``torch.distributed.checkpoint`` folder that one rank does not see (2 gloo
processes; a node-local folder, or one not yet visible on another node): that rank read the path as a file while the
others ran the folder's collectives, and every rank waited for the process group's timeout."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import run_in_processes


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _trainer(steps: int) -> pl.Trainer:
    from lightning_accel.parallel import ShardedStrategy

    # a short process-group timeout: a rank left alone in a collective fails the test in seconds, not 30 minutes
    strategy = ShardedStrategy(save_distributed_checkpoint=True, timeout=datetime.timedelta(seconds=30))
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g)), batch_size=4)


def _error(fn: Any) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _work(rank: int, world: int, tmp: str) -> dict[str, Any]:
    first = _trainer(2)
    first.fit(Net(), _loader())
    ckpt = f"{tmp}/sharded.ckpt"
    first.save_checkpoint(ckpt)
    real = os.path.isdir
    if rank == 1:  # the folder is not there on this rank's node
        os.path.isdir = lambda p: False if os.fspath(p) == ckpt else real(p)  # type: ignore[assignment]
    try:
        out: dict[str, Any] = {"resume": _error(lambda: _trainer(4).fit(Net(), _loader(), ckpt_path=ckpt))}
    finally:
        os.path.isdir = real  # type: ignore[assignment]
    # every rank still in step: the same resume, seen everywhere, trains on
    again = _trainer(4)
    out["after"] = _error(lambda: again.fit(Net(), _loader(), ckpt_path=ckpt))
    out["step"] = again.global_step
    return out


def test_a_checkpoint_folder_one_rank_does_not_see_fails_the_resume_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = run_in_processes(_work, 2, (str(tmp_path),), init_process_group=False, timeout=180)
    ckpt = f"{tmp_path}/sharded.ckpt"
    own = (
        f"FileNotFoundError: `{ckpt}` is a checkpoint folder on rank 0 but not on rank 1. Resume from a path that "
        "every node sees (shared storage)."
    )
    assert r1["resume"] == own
    assert (
        r0["resume"]
        == f"RuntimeError: ShardedStrategy: rank 1 could not read the checkpoint `{ckpt}`, so no rank can: {own}"
    )
    assert r0["after"] is None and r1["after"] is None
    assert r0["step"] == r1["step"] == 4
