"""Evaluating through a pipeline (2 gloo processes): a last batch the micro-batches do not divide (the usual last
batch of a validation loader, which keeps every sample) is evaluated in fewer micro-batches, with the loss of one
process, instead of stopping the fit at the end of its first epoch; each step gets the arguments Lightning gives it (no
``batch_idx`` when it takes none, ``dataloader_idx`` with several loaders), and the random numbers it draws before
``self(x)`` are the ones the first stage's input was made with."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.parallel.plans import BATCH_SPLITS
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


class WritesPredictions(Net):
    """A ``predict_step`` that writes its predictions away (a ``BasePredictionWriter``'s job) and returns nothing."""

    def predict_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        self(batch[0])


def _predict_nothing(strategy: Any, devices: int) -> Any:
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    return t.predict(WritesPredictions(), _loader(8))


def _pipeline_predict_nothing(rank: int, world: int) -> Any:
    from datetime import timedelta

    from lightning_accel.parallel import PipelineStrategy

    return _predict_nothing(PipelineStrategy(timeout=timedelta(seconds=60)), 2)


def test_a_predict_step_that_returns_nothing_predicts_none_per_batch() -> None:
    ref = _predict_nothing("auto", 1)
    assert ref == [None, None]
    assert run_in_processes(_pipeline_predict_nothing, 2, init_process_group=False, timeout=300) == [ref, ref]


class OutputsNet(Net):
    """Returns more than its loss: the batch-end hooks read it (``outputs``)."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        out = self(batch[0])
        return {
            "loss": torch.nn.functional.mse_loss(out, batch[1]),
            "preds": out.detach(),
            "err": (out - batch[1]).abs().mean(),
        }

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])


def _outputs_run(strategy: Any, devices: int) -> dict[str, Any]:
    seen: dict[str, list[Any]] = {"train": [], "val": []}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
            seen["train"].append((sorted(outputs), outputs["preds"].flatten().tolist(), float(outputs["err"])))

        def on_validation_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
            seen["val"].append(float(outputs))

    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=[Record()],
    )  # fmt: skip
    t.fit(OutputsNet(), _loader(16), _loader(8))
    return seen


def _pipeline_outputs(rank: int, world: int) -> list[dict[str, Any]]:
    from datetime import timedelta

    from lightning_accel.parallel import PipelineStrategy

    # "world": both ranks read the same batches, the pipeline runs them gathered and each rank gets its own rows back
    return [_outputs_run(PipelineStrategy(batch_split=s, timeout=timedelta(seconds=60)), 2) for s in BATCH_SPLITS]


def test_the_batch_end_hooks_get_what_the_steps_returned() -> None:
    # the pipeline handed `on_train_batch_end` {"loss"} alone (a callback reading `outputs["preds"]` failed) and
    # `on_validation_batch_end` its own loss whatever the step returned
    ref = _outputs_run("auto", 1)
    for r in [
        r for rank in run_in_processes(_pipeline_outputs, 2, init_process_group=False, timeout=300) for r in rank
    ]:
        assert len(r["train"]) == len(ref["train"]) == 4 and len(r["val"]) == len(ref["val"]) == 2
        for (keys, preds, err), (ref_keys, ref_preds, ref_err) in zip(r["train"], ref["train"], strict=True):
            assert keys == ref_keys == ["err", "loss", "preds"]
            assert max(abs(a - b) for a, b in zip(preds, ref_preds, strict=True)) < 1e-5 and abs(err - ref_err) < 1e-5
        assert max(abs(a - b) for a, b in zip(r["val"], ref["val"], strict=True)) < 1e-5


class Named(torch.utils.data.Dataset):
    """Samples with a name: ``default_collate`` gathers the names of a batch into a list, one per sample."""

    def __init__(self) -> None:
        self.x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "id": f"s{i}"}


class NamedNet(Net):
    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:  # type: ignore[override]
        return {"id": batch["id"], "y": self(batch["x"])}


def _named_predictions(strategy: Any, devices: int) -> dict[str, float]:
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    out: dict[str, float] = {}
    for p in t.predict(NamedNet(), torch.utils.data.DataLoader(Named(), batch_size=4)) or []:
        assert isinstance(p, dict) and len(p["id"]) == p["y"].shape[0], p  # one name per prediction
        out.update(zip(p["id"], p["y"].flatten().tolist(), strict=True))
    return out


def _pipeline_named(rank: int, world: int) -> dict[str, float]:
    from datetime import timedelta

    from lightning_accel.parallel import PipelineStrategy

    # each rank reads 2 rows of every batch of 4; its pipeline gathers them and splits them over 4 micro-batches
    return _named_predictions(PipelineStrategy(batch_split="world", timeout=timedelta(seconds=60)), 2)


def test_per_sample_names_go_with_their_rows() -> None:
    # a list of names, one per sample, reached every micro-batch whole: each prediction batch held 4x its names
    ref = _named_predictions("auto", 1)
    r0, r1 = run_in_processes(_pipeline_named, 2, init_process_group=False, timeout=300)
    assert not set(r0) & set(r1) and set(r0) | set(r1) == set(
        ref
    )  # each sample predicted once, by the rank that read it
    assert max(abs(v - ref[k]) for k, v in {**r0, **r1}.items()) < 1e-6


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
