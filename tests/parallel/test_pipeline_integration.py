"""``PipelineStrategy`` on 2 gloo processes (one launch, tiny ``nn.Sequential`` models): the interleaved checkpoint's
optimizer state loads without the pipeline, setting up leaves BatchNorm statistics alone, frozen pieces never leave a
stage without a parameter to train (or every rank refuses alike), and the measuring ``AutoStrategy`` times the
pipeline of a BatchNorm model."""

from __future__ import annotations

import os
from collections import UserDict, namedtuple
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import run_in_processes


class Net(pl.LightningModule):
    """``layers`` as an ``nn.Sequential`` (the pieces), an MSE loss against the batch's target, AdamW over the
    parameters that train (a fine-tuning idiom: an empty list when nothing trains)."""

    def __init__(self, *layers: nn.Module, example: torch.Tensor | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(*layers)
        if example is not None:
            self.example_input_array = example

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def interleaved_net() -> Net:
    """Four Linears of which the middle two have one shape: a by-position load that swaps them goes unnoticed."""
    torch.manual_seed(0)
    layers = (nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return Net(*layers)


def batchnorm_net() -> Net:
    torch.manual_seed(0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)) * 5 + 3  # far from the running stats' start
    return Net(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4), example=x)


def frozen_net(trainable_pieces: tuple[int, ...]) -> Net:
    """A heavy first Linear (the backbone, frozen) and light ones; only ``trainable_pieces`` train."""
    torch.manual_seed(0)
    net = Net(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 4))
    for i, m in enumerate(net.net):
        m.requires_grad_(i in trainable_pieces)
    return net


def loader(rows: int = 8) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)  # one step per epoch: a resume sees the same data


def trainer(strategy: Any, devices: int = 2, steps: int = 1) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip


def _state(module: pl.LightningModule) -> dict[str, Any]:
    return {k: v.numpy() for k, v in module.state_dict().items() if v is not None}


def _interleaved(tmp: str) -> dict[str, Any]:
    """Interleaved (4 stages, rank 0 runs stages 0 and 2): a checkpoint, its resume, and the straight run."""
    one, two, straight = (os.path.join(tmp, f"{n}.ckpt") for n in ("one", "two", "straight"))
    t = trainer(_pipeline(schedule="interleaved1f1b"))
    t.fit(interleaved_net(), loader())
    t.save_checkpoint(one)
    t = trainer(_pipeline(schedule="interleaved1f1b"), steps=2)
    t.fit(interleaved_net(), loader(), ckpt_path=one)
    t.save_checkpoint(two)
    t = trainer(_pipeline(schedule="interleaved1f1b"), steps=2)
    t.fit(interleaved_net(), loader())
    t.save_checkpoint(straight)
    return {}


def _batchnorm_validate(tmp: str) -> dict[str, Any]:
    """Validate only: the split measures ``example_input_array`` in training mode, which must not move the stats."""
    model = batchnorm_net()
    (val,) = trainer(_pipeline()).validate(model, loader(16), verbose=False)
    bn = model.net[1]
    return {
        "val_loss": val["val_loss"],
        "holds_bn": bn.running_mean is not None,
        "running_mean": None if bn.running_mean is None else bn.running_mean.numpy(),
        "tracked": None if bn.num_batches_tracked is None else int(bn.num_batches_tracked),
    }


def _trial(tmp: str) -> dict[str, Any]:
    """The measuring selector times the pipeline of the BatchNorm model (on the strategy's example, not one sample)."""
    from lightning_accel.parallel import AutoStrategy

    auto = AutoStrategy(policy="measure", candidates=["ddp", "pipeline"], device_memory_bytes=2**30, trial_steps=1)
    trainer(auto).fit(batchnorm_net(), loader())
    assert auto.choice is not None
    return {"measured": sorted(auto.choice.measured), "dropped": dict(auto.choice.dropped)}


def _frozen(tmp: str) -> dict[str, Any]:
    """A frozen backbone: the heavy frozen Linear shares its stage with one that trains; with one trainable piece for
    two stages every rank refuses, before any rank builds an optimizer."""
    from lightning_accel.parallel import PipelineStrategy

    t = trainer(_pipeline())
    t.fit(frozen_net((2, 4)), loader())
    assert isinstance(t.strategy, PipelineStrategy) and t.strategy.runner is not None
    out: dict[str, Any] = {"bounds": list(t.strategy.runner.layout.bounds), "step": t.global_step}
    try:
        trainer(_pipeline()).fit(frozen_net((4,)), loader())
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    return out


def _pipeline(**kw: Any) -> Any:
    from lightning_accel.parallel import PipelineStrategy

    # the first Trainer's timeout is the process group's: a rank failing alone stops the other within a minute
    return PipelineStrategy(timeout=timedelta(seconds=60), **kw)


def _work(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # each case's failure is its test's alone (the one that can leave a rank waiting runs last)
    cases = {"interleaved": _interleaved, "bn": _batchnorm_validate, "trial": _trial, "frozen": _frozen}
    for name, case in cases.items():
        try:
            out[name] = case(tmp)
        except Exception as e:  # noqa: BLE001 -- reported by the case's test
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("pipeline")
    return run_in_processes(_work, 2, (str(tmp),), init_process_group=False, timeout=300), tmp


def test_an_interleaved_checkpoint_lists_the_optimizer_state_in_the_model_order(
    results: tuple[list[dict[str, Any]], Path],
) -> None:
    got, tmp = results
    assert got[0]["interleaved"] == got[1]["interleaved"] == {}
    ck = torch.load(tmp / "one.ckpt", weights_only=False)
    saved = ck["optimizer_states"][0]
    model = interleaved_net()
    names = [n for n, _ in model.named_parameters()]
    assert saved["param_groups"][0]["params"] == names and list(saved["state"]) == names
    # loaded without the pipeline, the way Lightning loads it (by position): every parameter gets its own state
    model.load_state_dict(ck["state_dict"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(saved)
    for n, p in model.named_parameters():
        assert torch.equal(opt.state[p]["exp_avg"], saved["state"][n]["exp_avg"]), n
    # and the same pipeline resumes from it as if it had never stopped
    two = torch.load(tmp / "two.ckpt", weights_only=False)
    straight = torch.load(tmp / "straight.ckpt", weights_only=False)
    assert two["global_step"] == straight["global_step"] == 2
    for k, v in straight["state_dict"].items():
        assert torch.allclose(two["state_dict"][k], v, atol=1e-6), k


def test_setting_up_the_pipeline_leaves_batchnorm_statistics_alone(
    results: tuple[list[dict[str, Any]], Path],
) -> None:
    model = batchnorm_net()
    (ref,) = trainer("auto", devices=1).validate(model, loader(16), verbose=False)
    assert int(model.net[1].num_batches_tracked) == 0
    got = [r["bn"] for r in results[0]]
    assert all("error" not in g for g in got), got
    assert sum(g["holds_bn"] for g in got) == 1
    for g in got:
        assert abs(g["val_loss"] - ref["val_loss"]) < 1e-6
        if g["holds_bn"]:  # untouched: what the model had before any training
            assert g["tracked"] == 0 and not g["running_mean"].any()


def test_the_measure_trial_times_the_pipeline_of_a_batchnorm_model(results: tuple[list[dict[str, Any]], Path]) -> None:
    for r in results[0]:
        assert r["trial"]["dropped"] == {} and r["trial"]["measured"] == ["ddp", "pipeline"]


def test_a_frozen_backbone_shares_a_stage_with_a_trainable_piece_or_every_rank_refuses(
    results: tuple[list[dict[str, Any]], Path],
) -> None:
    for r in results[0]:
        got = r["frozen"]
        assert "error" not in got, got["error"]
        assert got["bounds"] == [(0, 3), (3, 5)] and got["step"] == 1
        assert got["refused"].startswith("PipelineStrategy: pipeline stage(s) 0 (piece")
        assert "of `Net` hold no parameter that trains" in got["refused"] and "Use at most 1 stage (" in got["refused"]


Pair = namedtuple("Pair", ["x", "y"])


class Tokens(UserDict):
    """A tokenizer's ``BatchEncoding`` is a ``UserDict``: a mapping, not a dict."""


def _as_tokens(samples: list[Any]) -> Tokens:
    return Tokens(x=torch.stack([s[0] for s in samples]), y=torch.stack([s[1] for s in samples]))


def _as_pair(samples: list[Any]) -> Pair:
    return Pair(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))


class TypedBatchNet(Net):
    """Reads its batch by key (a ``Tokens``) or by field (a ``Pair``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = (batch["x"], batch["y"]) if isinstance(batch, Tokens) else (batch.x, batch.y)
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss


def _typed_batch_fit(collate: Any, strategy: Any, devices: int, rows: list[int], batch_size: int) -> list[float]:
    """Fit on ``rows`` of a 16-sample set, in order; the losses logged at each step."""
    torch.manual_seed(0)
    model = TypedBatchNet(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()], use_distributed_sampler=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, rows), batch_size=batch_size, collate_fn=collate)
    t.fit(model, loader)
    return losses


def _typed_batches(rank: int, world: int) -> dict[str, list[float]]:
    from lightning_accel.parallel import PipelineStrategy

    # rank r reads rows 4r..4r+3 of every 8: the pipeline gathers them into one process's batch of 8, in order
    rows = [8 * k + 4 * rank + i for k in range(2) for i in range(4)]
    out: dict[str, list[float]] = {}
    for name, collate in (("tokens", _as_tokens), ("pair", _as_pair)):
        strategy = PipelineStrategy(batch_split="world", timeout=timedelta(seconds=60))
        out[name] = _typed_batch_fit(collate, strategy, 2, rows, 4)
    return out


def test_a_mapping_or_namedtuple_batch_trains_as_in_one_process() -> None:
    # a `UserDict` batch was neither gathered nor split: the first stage ran rank 0's rows, the last stage scored them
    # against rank 1's; a namedtuple batch failed to split ("missing 1 required positional argument")
    ref = _typed_batch_fit(_as_tokens, "auto", 1, list(range(16)), 8)
    assert len(ref) == 2
    for r in run_in_processes(_typed_batches, 2, init_process_group=False, timeout=300):
        for name in ("tokens", "pair"):
            assert max(abs(a - b) for a, b in zip(r[name], ref, strict=True)) < 1e-6, (name, r[name], ref)
