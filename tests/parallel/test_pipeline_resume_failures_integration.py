"""``PipelineStrategy`` resuming from a checkpoint one rank cannot read (2 gloo processes): a node-local path, or a
file not yet visible on another node. Every rank reads the file itself; the rank that could not raised alone, and the
others went on into training and waited in its first collective for the process group's timeout."""

from __future__ import annotations

import datetime
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
        self.example_input_array = torch.randn(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _trainer(steps: int) -> pl.Trainer:
    from lightning_accel.parallel import PipelineStrategy

    # a short process-group timeout: a rank left alone in a collective fails the test in seconds, not 30 minutes
    strategy = PipelineStrategy(timeout=datetime.timedelta(seconds=30))
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g)), batch_size=8)


def _error(fn: Any) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _work(rank: int, world: int, tmp: str) -> dict[str, Any]:
    first = _trainer(2)
    first.fit(Net(), _loader())
    ckpt = f"{tmp}/pipeline.ckpt"
    first.save_checkpoint(ckpt)
    resumed = _trainer(4)
    if rank == 1:

        def missing(path: Any, *args: Any, **kwargs: Any) -> Any:
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{path}'")

        resumed.strategy.checkpoint_io.load_checkpoint = missing  # type: ignore[method-assign]
    out: dict[str, Any] = {"resume": _error(lambda: resumed.fit(Net(), _loader(), ckpt_path=ckpt))}
    # every rank still in step: the same resume, readable everywhere, trains on
    again = _trainer(4)
    out["after"] = _error(lambda: again.fit(Net(), _loader(), ckpt_path=ckpt))
    out["step"] = again.global_step
    return out


def test_a_checkpoint_one_rank_cannot_read_fails_the_resume_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = run_in_processes(_work, 2, (str(tmp_path),), init_process_group=False, timeout=180)
    assert r1["resume"].startswith("FileNotFoundError: [Errno 2] No such file or directory")
    msg = r0["resume"]
    assert msg.startswith("RuntimeError: PipelineStrategy: rank 1 could not read the checkpoint `"), msg
    assert "\n" not in msg and msg.endswith("so no rank can: FileNotFoundError: [Errno 2] No such file or directory: "
                                            f"'{tmp_path}/pipeline.ckpt'")  # fmt: skip
    assert r0["after"] is None and r1["after"] is None
    assert r0["step"] == r1["step"] == 4
