"""Evaluating through a pipeline (2 gloo processes): a last batch the micro-batches do not divide (the usual last
batch of a validation loader, which keeps every sample) is evaluated in fewer micro-batches, with the loss of one
process, instead of stopping the fit at the end of its first epoch; each step gets the arguments Lightning gives it (no
``batch_idx`` when it takes none, ``dataloader_idx`` with several loaders), and the random numbers it draws before
``self(x)`` are the ones the first stage's input was made with."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from tests.helpers import run_in_processes
from tests.parallel.test_plans_integration import SmallNet


class Net(SmallNet):
    """``SmallNet``'s step, its network regrouped into 4 pieces (4 interleaved stages on 2 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        tanh_linear = [torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, n)) for n in (8, 8, 1)]
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), *tanh_linear)


def _loader(samples: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(samples, 4, generator=g), torch.randn(samples, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)  # batches of 4, 4, 4 and 2 (4 micro-batches: 2 ranks)


def _fit_validate(strategy: Any, devices: int) -> dict[str, Any]:
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    model = Net()
    t.fit(model, _loader(16), _loader(14))
    return {"val_loss": float(t.callback_metrics["val_loss"]), "step": t.global_step}


def _pipeline(rank: int, world: int) -> list[dict[str, Any]]:
    from lightning_accel.parallel import PipelineStrategy

    # 1F1B evaluates the last batch in 2 micro-batches (GPipe's schedule), the interleaved one in 2 rounds of 2 stages
    return [_fit_validate(PipelineStrategy(schedule=s), 2) for s in ("1f1b", "interleaved1f1b")]


def test_a_last_batch_the_micro_batches_do_not_divide_is_evaluated_like_one_process() -> None:
    ref = _fit_validate("auto", 1)
    for r in [r for rank in run_in_processes(_pipeline, 2, init_process_group=False, timeout=300) for r in rank]:
        assert r["step"] == ref["step"] == 4
        assert abs(r["val_loss"] - ref["val_loss"]) < 1e-6, (r, ref)


class LoaderNet(Net):
    """A ``training_step`` without ``batch_idx`` and evaluation steps that need ``dataloader_idx`` (several loaders)."""

    def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:  # type: ignore[override]
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]) + 100 * dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> torch.Tensor:  # type: ignore[override]
        return self(batch[0]) * 0 + dataloader_idx


def _loaders_run(strategy: Any, devices: int) -> dict[str, Any]:
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    model = LoaderNet()
    t.fit(model, _loader(16), [_loader(8), _loader(12)])
    val_loss = [float(t.callback_metrics[f"val_loss/dataloader_idx_{i}"]) for i in (0, 1)]
    predictions = t.predict(model, [_loader(8), _loader(4)])
    assert predictions is not None
    return {
        "step": t.global_step,
        "val_loss": val_loss,
        "predicted": [[float(p.mean()) for p in loader] for loader in predictions],  # type: ignore[union-attr]
    }


def _pipeline_loaders(rank: int, world: int) -> dict[str, Any]:
    from datetime import timedelta

    from lightning_accel.parallel import PipelineStrategy

    # a step that a rank alone fails would leave the other waiting: the group's timeout bounds it
    return _loaders_run(PipelineStrategy(timeout=timedelta(seconds=60)), 2)


def test_each_step_gets_the_arguments_lightning_passes() -> None:
    ref = _loaders_run("auto", 1)
    assert ref["predicted"] == [[0.0, 0.0], [1.0]] and ref["val_loss"][1] > 100
    for r in run_in_processes(_pipeline_loaders, 2, init_process_group=False, timeout=300):
        assert r["step"] == ref["step"] == 4
        assert r["predicted"] == ref["predicted"]
        assert max(abs(a - b) for a, b in zip(r["val_loss"], ref["val_loss"], strict=True)) < 1e-5, (r, ref)


class Jitter(torch.nn.Module):
    """The identity, drawing a random number on each call (as dropout draws its mask): the rank that runs it has drawn
    more than the others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.rand(1)
        return x


class NoisePredictor(pl.LightningModule):
    """Predicts the noise it feeds its network (a diffusion model's step): the network is the identity, so the loss is
    0 exactly when the last stage's target is the noise the first stage's input was made of."""

    def __init__(self) -> None:
        super().__init__()
        first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        for lin in (first, last):
            torch.nn.init.eye_(lin.weight)
            torch.nn.init.zeros_(lin.bias)
        self.net = torch.nn.Sequential(first, Jitter(), last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        noise = torch.randn_like(batch[0])
        loss = torch.nn.functional.mse_loss(self(noise), noise)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _noise_fit(rank: int, world: int) -> float:
    from datetime import timedelta

    from lightning_accel.parallel import PipelineStrategy

    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(timeout=timedelta(seconds=60)), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    t.fit(NoisePredictor(), _loader(16))
    return float(t.callback_metrics["train_loss"])


def test_the_last_stage_draws_the_random_numbers_the_first_stage_drew() -> None:
    losses = run_in_processes(_noise_fit, 2, init_process_group=False, timeout=300)
    assert losses[0] == losses[1] and losses[0] < 1e-12, losses  # two independent noises: about 2
