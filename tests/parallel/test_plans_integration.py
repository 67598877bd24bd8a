"""Every plan in a Trainer on 2 gloo processes (one launch): the sharded (FSDP2), tensor-parallel and pipeline
strategies train TinyGPT with the loss of single-process training, save through the CheckpointIO and resume; the
measuring AutoStrategy times every plan and picks one the same way on both ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.models.lit import TinyGPT
from tests.helpers import run_in_processes

#: fp32 on CPU, the same batches in the same order: the plans differ from one process only in summation order
#: (benchmarks/parallel.py reports how close each plan's losses stay to one process's)
TOL = 1e-4
STEPS = 4  # one batch per epoch: every checkpoint is at an epoch boundary, so resuming sees the same data


class ConstantLRGPT(TinyGPT):
    """TinyGPT with a constant learning rate: its cosine schedule's length would depend on `max_steps`, which
    differs between the run that saves and the one that resumes."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def make_model() -> Any:
    torch.manual_seed(0)
    m = ConstantLRGPT(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.0)
    m.example_input_array = torch.zeros(4, 16, dtype=torch.long)
    return m


def loader(replicas: int = 1, rank: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 27, (8, 17), generator=g))
    sampler: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
        ds, num_replicas=replicas, rank=rank, shuffle=False
    )
    return torch.utils.data.DataLoader(ds, batch_size=8 // replicas, sampler=sampler)


def fit(strategy: Any, devices: int, steps: int, *, replicas: int = 1, rank: int = 0, **kw: Any) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    save = kw.pop("save", None)
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
        num_sanity_val_steps=0, gradient_clip_val=0.5, use_distributed_sampler=False, **kw.pop("trainer", {}),
    )  # fmt: skip
    t.fit(make_model(), loader(replicas, rank), ckpt_path=kw.pop("resume", None))
    if save:
        t.save_checkpoint(save)
    return {"losses": losses, "strategy": type(t.strategy).__name__, "step": t.global_step, "st": t.strategy}


def _plans(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from lightning_accel.checkpoint import DeltaCheckpointIO
    from lightning_accel.parallel import AutoStrategy, PipelineStrategy, ShardedStrategy

    out: dict[str, Any] = {}
    cases: dict[str, tuple[Any, int, dict[str, Any]]] = {
        # FSDP2 over both ranks, each reading half of every batch; checkpoints through DeltaCheckpointIO
        "fsdp": (ShardedStrategy, 2, {"trainer": {"plugins": [DeltaCheckpointIO()]}}),
        "tp": (lambda: ShardedStrategy(tensor_parallel_size=2), 1, {}),
        "pipeline": (PipelineStrategy, 1, {}),
        "gpipe": (lambda: PipelineStrategy(schedule="gpipe"), 1, {}),
        "interleaved": (lambda: PipelineStrategy(schedule="interleaved1f1b"), 1, {}),  # 4 stages on 2 ranks
    }
    for name, (make, replicas, extra) in cases.items():
        r = rank if replicas > 1 else 0
        if name in ("gpipe", "interleaved"):  # the schedule only: no checkpoint
            out[name] = {"losses": fit(make(), 2, STEPS)["losses"], "strategy": "PipelineStrategy"}
            continue
        ckpt = os.path.join(tmp, f"{name}.ckpt")
        first = fit(make(), 2, 2, replicas=replicas, rank=r, save=ckpt, trainer=dict(extra.get("trainer", {})))
        second = fit(make(), 2, STEPS, replicas=replicas, rank=r, resume=ckpt, trainer=dict(extra.get("trainer", {})))
        out[name] = {"losses": first["losses"] + second["losses"], "strategy": second["strategy"]}
        if name == "pipeline":
            out[name]["bounds"] = list(second["st"].runner.layout.bounds)
    auto = AutoStrategy(policy="measure", device_memory_bytes=2**30, trial_steps=1)
    res = fit(auto, 2, 1)
    assert auto.choice is not None
    out["auto"] = {
        "strategy": res["strategy"],
        "plan": auto.choice.plan,
        "measured": auto.choice.measured,
        "table": auto.choice.table(),
    }
    return out


def test_every_plan_tracks_single_process_and_resumes(tmp_path: Path) -> None:
    ref = fit("auto", 1, STEPS)["losses"]
    results = run_in_processes(_plans, 2, (str(tmp_path),), init_process_group=False, timeout=600)
    r0, r1 = results
    for name in ("fsdp", "tp", "pipeline", "gpipe", "interleaved"):
        got = r0[name]["losses"]
        assert len(got) == STEPS, (name, got)
        if name == "fsdp":  # each rank logs the loss of its half-batch: their mean is the whole batch's
            got = [(a + b) / 2 for a, b in zip(r0[name]["losses"], r1[name]["losses"], strict=True)]
        else:  # tensor parallel and pipeline: every rank logs the same loss
            assert r0[name]["losses"] == r1[name]["losses"], name
        diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        assert diff <= TOL, f"{name}: losses {got} vs single-process {ref} (max diff {diff:.2e})"
    assert r0["fsdp"]["strategy"] == r0["tp"]["strategy"] == "ShardedStrategy"
    assert r0["pipeline"]["strategy"] == "PipelineStrategy" and r0["pipeline"]["bounds"] == [(0, 3), (3, 6)]
    # the measuring selector timed every plan the estimate lets fit, and both ranks chose the same, the fastest
    a0, a1 = r0["auto"], r1["auto"]
    assert set(a0["measured"]) == {"ddp", "fsdp", "tp", "pipeline"}
    assert a0["plan"] == a1["plan"] == min(a0["measured"], key=a0["measured"].get)
    assert a0["measured"] == a1["measured"] and "| pipeline |" in a0["table"]


class PredictingGPT(ConstantLRGPT):
    """Predictions of three shapes: a tensor per batch, a dict and a per-sample list."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        logits = self(batch[0][:, :-1])
        return {"logits": logits, "last": (logits[:, -1].argmax(-1),), "ids": [int(v) for v in batch[0][:, 0]]}


def _predict(rank: int, world: int) -> Any:
    import lightning.pytorch as pl

    from lightning_accel.parallel import PipelineStrategy, ShardedStrategy

    torch.manual_seed(0)
    model = PredictingGPT(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.0)
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(), logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    out = t.predict(model, loader())
    # `batch_split="world"` (what AutoStrategy builds): each rank reads half the samples, as under DDP, and gets
    # the predictions of its own rows of the batch its pipeline gathered
    t2 = pl.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(batch_split="world"), logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    mine = t2.predict(model, loader(2, rank))
    # the same for the tensor-parallel plan's gathered batch
    t3 = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ShardedStrategy(tensor_parallel_size=2, batch_split="world"),
        logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tp_model = PredictingGPT(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.0)
    tp_mine = t3.predict(tp_model, loader(2, rank))

    # numpy, not tensors: a tensor sent back to the parent may be a shared-memory handle that dies with its process
    def plain(out: Any) -> dict[str, Any]:
        (pred,) = out
        got = {
            "logits": pred["logits"].numpy(),
            "last": pred["last"][0].numpy(),
            "last_is_tuple": isinstance(pred["last"], tuple),
        }
        got.update(ids=pred["ids"], batches=len(out), device=pred["logits"].device.type)
        return got

    return {"out": plain(out), "world": plain(mine), "tp_world": plain(tp_mine)}


def test_pipeline_and_tensor_parallel_predict_return_the_single_process_predictions() -> None:
    torch.manual_seed(0)
    ref_model = PredictingGPT(n_layer=4, n_embd=32, n_head=4, block_size=16, dropout=0.0).eval()
    with torch.no_grad():
        ref = [ref_model.predict_step(b, i) for i, b in enumerate(loader())]
    r0, r1 = run_in_processes(_predict, 2, init_process_group=False, timeout=300)
    assert len(ref) == 1
    for got in (r0["out"], r1["out"]):
        assert got["batches"] == 1 and got["device"] == "cpu"
        assert got["logits"].shape == tuple(ref[0]["logits"].shape)
        assert torch.allclose(torch.from_numpy(got["logits"]), ref[0]["logits"], atol=TOL)
        assert torch.equal(torch.from_numpy(got["last"]), ref[0]["last"][0]) and got["last_is_tuple"]
        assert got["ids"] == ref[0]["ids"]
    assert (r0["out"]["logits"] == r1["out"]["logits"]).all()
    # `batch_split="world"`: rank r read samples r, r + 2, ... (DistributedSampler) and predicts those alone
    for rank, got in [*enumerate((r0["world"], r1["world"])), *enumerate((r0["tp_world"], r1["tp_world"]))]:
        assert got["batches"] == 1 and got["device"] == "cpu" and got["last_is_tuple"]
        assert torch.allclose(torch.from_numpy(got["logits"]), ref[0]["logits"][rank::2], atol=TOL)
        assert torch.equal(torch.from_numpy(got["last"]), ref[0]["last"][0][rank::2])
        assert got["ids"] == ref[0]["ids"][rank::2]


class SmallNet(pl.LightningModule):
    """An `nn.Sequential` of five pieces, SGD: a one-step update shows any scale error in the gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _small_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def _fit_accumulate_validate(strategy: Any, devices: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    model = SmallNet()
    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(model, _small_loader())
    state = t.strategy.lightning_module_state_dict()
    (val,) = t.validate(model, _small_loader(), verbose=False)  # a second setup on the module the fit split
    return {"state": {k: v.numpy() for k, v in state.items()}, "val_loss": val["val_loss"]}


def _pipeline_accumulate_validate(rank: int, world: int) -> dict[str, Any]:
    from lightning_accel.parallel import PipelineStrategy

    return _fit_accumulate_validate(PipelineStrategy(), 2)


def test_pipeline_accumulates_the_mean_and_validates_after_fit_like_one_process() -> None:
    ref = _fit_accumulate_validate("auto", 1)
    r0, r1 = run_in_processes(_pipeline_accumulate_validate, 2, init_process_group=False, timeout=300)
    assert sorted(r0["state"]) == sorted(ref["state"])  # the full state is gathered to rank 0
    for k, v in ref["state"].items():  # the mean of the accumulated gradients, not their sum
        assert torch.allclose(torch.from_numpy(r0["state"][k]), torch.from_numpy(v), atol=1e-6), k
    assert abs(r0["val_loss"] - ref["val_loss"]) < 1e-5 and abs(r1["val_loss"] - ref["val_loss"]) < 1e-5


def _clip_by_value(strategy: Any, devices: int) -> list[float]:
    """Three steps with every gradient clamped to +-1e-3 (the norm-clipping default of `fit` left out)."""
    from lightning.pytorch.callbacks import Callback

    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    t = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()], use_distributed_sampler=False,
        gradient_clip_val=1e-3, gradient_clip_algorithm="value",
    )  # fmt: skip
    t.fit(make_model(), loader())
    return losses


def _tensor_parallel_clip_by_value(rank: int, world: int) -> list[float]:
    from lightning_accel.parallel import ShardedStrategy

    return _clip_by_value(ShardedStrategy(tensor_parallel_size=2), 2)


def test_tensor_parallel_clips_by_value_like_one_process() -> None:
    ref = _clip_by_value("auto", 1)
    r0, r1 = run_in_processes(_tensor_parallel_clip_by_value, 2, init_process_group=False, timeout=300)
    assert len(ref) == 3 and r0 == r1
    diff = max(abs(a - b) for a, b in zip(r0, ref, strict=True))
    assert diff <= TOL, f"losses {r0} vs single-process {ref} (max diff {diff:.2e})"
