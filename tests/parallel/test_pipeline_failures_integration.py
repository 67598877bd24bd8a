"""``PipelineStrategy`` on 2 gloo processes when something goes wrong on one rank: a step that calls the network
directly instead of ``self(x)``, a split that fails on one rank only, and the process groups left after ``fit``.
Every failure must reach every rank as one clear error, long before the process group's timeout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import run_in_processes


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Bypass(Net):
    """Calls its network directly: the pipeline cannot run it stage by stage."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])


class NoLoss(Net):
    """Returns no loss: its step fails on the last stage alone, inside the schedule."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"pred": self(batch[0])}


class OneRankFails(Net):
    """Its pieces cannot be found on rank 1 alone (what a rank-dependent model or a bad file on one node does)."""

    def pipeline_modules(self) -> list[nn.Module]:
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("the network file is missing on this node")
        return list(self.net)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def trainer() -> pl.Trainer:
    from lightning_accel.parallel import PipelineStrategy

    # the first Trainer's timeout is the process group's: a rank left waiting fails after it, not after 30 minutes
    strategy = PipelineStrategy(timeout=timedelta(seconds=20))
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        return f"{type(e).__name__}: {e}"
    return ""


def _groups_after_fit() -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    made: list[Any] = []

    class Groups(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            made.extend(trainer.strategy.runner.groups)  # type: ignore[attr-defined]

    t = trainer()
    t.callbacks.append(Groups())
    model = Net()
    t.fit(model, loader())
    alive = [g for g in made if g in c10d._world.pg_map]
    # the split stays with the module: a later `validate` runs on it
    validated = trainer().validate(model, loader(), verbose=False)
    return {"made": len(made), "alive": len(alive), "val": validated[0]["val_loss"] if validated else None}


def _work(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    out["groups"] = _error(lambda: out.update(_groups_after_fit()))
    out["bypass"] = _error(lambda: trainer().fit(Bypass(), loader()))
    out["no_loss"] = _error(lambda: trainer().fit(NoLoss(), loader()))
    out["one_rank"] = _error(lambda: trainer().fit(OneRankFails(), loader()))  # last: a rank may be left waiting
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_in_processes(_work, 2, init_process_group=False, timeout=300)


def test_fit_destroys_its_process_groups_and_a_later_validate_still_runs(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert got["groups"] == ""
        assert got["made"] > 0 and got["alive"] == 0
        assert isinstance(got["val"], float)


def test_a_step_that_calls_the_network_directly_fails_on_every_rank_naming_the_module(
    results: list[dict[str, Any]],
) -> None:
    for got in results:
        msg = got["bypass"]
        assert msg.startswith("TypeError: PipelineStrategy: `Bypass.training_step` called `self.net`"), msg
        assert "call `self(x)`" in msg and "\n" not in msg
        assert "timed out" not in msg.lower()


def test_a_split_failing_on_one_rank_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["one_rank"], results[0]["one_rank"]
    assert own == "RuntimeError: the network file is missing on this node"
    assert other.startswith("RuntimeError: PipelineStrategy: rank 1 could not split `OneRankFails`"), other
    assert "the network file is missing on this node" in other


def test_a_step_failing_on_the_last_stage_fails_on_every_rank(results: list[dict[str, Any]]) -> None:
    own, other = results[1]["no_loss"], results[0]["no_loss"]
    assert own == (
        "TypeError: PipelineStrategy: `NoLoss.training_step` returned dict; it must return the loss tensor (or a dict "
        "with 'loss')."
    )
    assert other == own
