"""Evaluating through a pipeline (2 gloo processes): a last batch the micro-batches do not divide (the usual last
batch of a validation loader, which keeps every sample) is evaluated in fewer micro-batches, with the loss of one
process, instead of stopping the fit at the end of its first epoch."""

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
