"""The measuring selector never changes the training (2 gloo processes, one launch): every candidate it can pick
trains on DDP's global batch with DDP's steps per epoch and losses, a candidate whose trial fails is dropped with
its error while the fit goes on, and the trial leaves torch's RNG as it found it (dropout draws the same masks as in
the same seed's run under the chosen strategy)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks._models import GPT2LM
from tests.helpers import run_in_processes

TOL = 1e-4


class FailsUnderTensorParallel(GPT2LM):
    """Its forward raises once its parameters are DTensors: the tensor-parallel trial fails in its first step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.parameters()):
            raise RuntimeError("this model refuses tensor parallelism")
        return super().forward(x)


def fit_and_watch(strategy: Any, model: Any) -> dict[str, Any]:
    """Fit one epoch; per step, the distinct sample indices trained on across all ranks and the global loss."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    seen: list[int] = []
    losses: list[float] = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            ids = batch[1].reshape(-1).cpu()
            parts: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, ids.tolist())
            seen.append(len({i for p in parts for i in p}))

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            loss = torch.tensor([float(trainer.callback_metrics["train_loss"])])
            torch.distributed.all_reduce(loss)
            losses.append(float(loss) / torch.distributed.get_world_size())

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 17), generator=g), torch.arange(16))
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()], num_sanity_val_steps=0,
    )  # fmt: skip
    t.fit(model, torch.utils.data.DataLoader(ds, batch_size=4))
    return {
        "seen": seen, "losses": losses, "steps_per_epoch": t.num_training_batches, "strategy": type(t.strategy).__name__
    }  # fmt: skip


def _runs(rank: int, world: int) -> dict[str, Any]:
    from lightning_accel.parallel import AutoStrategy

    torch.set_num_threads(1)
    out: dict[str, Any] = {"ddp": fit_and_watch("ddp", GPT2LM())}
    for plan in ("fsdp", "tp", "pipeline"):
        auto = AutoStrategy(
            policy="measure", candidates=[plan], device_memory_bytes=2**30, trial_steps=1, example_batch_size=4
        )
        out[plan] = fit_and_watch(auto, GPT2LM())
        assert auto.choice is not None
        out[plan]["plan"] = auto.choice.plan
    auto = AutoStrategy(policy="measure", candidates=["ddp", "tp"], device_memory_bytes=2**30, trial_steps=1)
    out["failing"] = fit_and_watch(auto, FailsUnderTensorParallel())
    assert auto.choice is not None
    out["failing"].update(plan=auto.choice.plan, dropped=auto.choice.dropped, table=auto.choice.table())
    return out


def test_every_candidate_trains_on_ddps_batch_and_a_failing_trial_is_dropped() -> None:
    r0, r1 = run_in_processes(_runs, 2, (), init_process_group=False, timeout=900)
    ddp = r0["ddp"]
    assert ddp["seen"] == [8, 8] and ddp["steps_per_epoch"] == 2  # 16 samples, 4 per rank and step
    names = {"fsdp": "ShardedStrategy", "tp": "ShardedStrategy", "pipeline": "PipelineStrategy"}
    for plan, cls in names.items():
        got = r0[plan]
        assert got["plan"] == plan and got["strategy"] == cls, (plan, got)
        assert got["seen"] == ddp["seen"] and got["steps_per_epoch"] == ddp["steps_per_epoch"], (plan, got)
        diff = max(abs(a - b) for a, b in zip(got["losses"], ddp["losses"], strict=True))
        assert diff <= TOL, f"{plan}: losses {got['losses']} vs DDP {ddp['losses']}"
    for r in (r0, r1):  # the failing tensor-parallel trial is dropped on both ranks, with its error; DDP trains
        f = r["failing"]
        assert f["plan"] == "ddp" and f["strategy"] == "AutoStrategy" and f["steps_per_epoch"] == 2
        assert "refuses tensor parallelism" in f["dropped"]["tp"]
        assert "trial dropped: rank 0: RuntimeError: this model refuses tensor parallelism" in f["table"]


def _dropout_fit(strategy: Any) -> dict[str, Any]:
    """Three steps of a dropout network from seed 0 (the masks come from torch's RNG); the weights after them."""
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class DropoutNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 8))
            self.example_input_array = torch.randn(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self(batch[0]), batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g)), batch_size=4)
    pl.seed_everything(0, verbose=False)
    model = DropoutNet()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, loader)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}  # a tensor would not cross processes


def _ddp_and_measured(rank: int, world: int) -> dict[str, Any]:
    from lightning_accel.parallel import AutoStrategy

    auto = AutoStrategy(policy="measure", candidates=["ddp"], device_memory_bytes=2**30, trial_steps=2)
    measured = _dropout_fit(auto)
    assert auto.choice is not None and auto.choice.measured
    return {"ddp": _dropout_fit("ddp"), "measured": measured, "chosen": auto.choice.strategy}


def test_the_trial_leaves_the_rng_as_it_found_it() -> None:
    for r in run_in_processes(_ddp_and_measured, 2, (), init_process_group=False, timeout=300):
        assert r["chosen"] == "ddp"
        for key, want in r["ddp"].items():
            assert (r["measured"][key] == want).all(), key
