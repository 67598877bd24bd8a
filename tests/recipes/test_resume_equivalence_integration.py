"""A fit resumed from an epoch-end checkpoint ends where the uninterrupted fit ends, with every recipe callback at once:
linear LR scaling (and the model's warm-up + cosine schedule), distillation from a teacher and iterative pruning, on one
process and on two DDP processes (gloo)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.callbacks import KnowledgeDistillation, LinearScalingLR, StructuredPruning
from tests.helpers import run_in_processes
from tests.tiny import classifier, loader, trainer


def _callbacks(teacher: torch.nn.Module) -> list[Callback]:
    return [
        LinearScalingLR(base_batch_size=16),
        KnowledgeDistillation(copy.deepcopy(teacher), temperature=2.0, alpha=0.5),
        StructuredPruning(0.5, schedule=[1, 2]),
    ]


def _fit(root: str, resume_from: int | None, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    """Three epochs from the same initial weights: uninterrupted (checkpointing every epoch) or resumed from the
    checkpoint of epoch ``resume_from``; the final ``state_dict`` and learning rate."""
    pl.seed_everything(0)
    teacher = classifier(width=8)
    pl.seed_everything(1)
    model = classifier(width=8)
    first = resume_from is None
    ckpt = [ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, filename="{epoch}")] if first else []
    t = trainer(
        max_epochs=3, callbacks=[*_callbacks(teacher), *ckpt], enable_checkpointing=first, default_root_dir=root,
        **trainer_kwargs,
    )  # fmt: skip
    path = None if first else os.path.join(root, f"epoch={resume_from}.ckpt")
    t.fit(model, loader(batch_size=16), ckpt_path=path)
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["lr"] = torch.tensor(t.optimizers[0].param_groups[0]["lr"])
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("resume_from", [0, 1])
def test_a_resumed_fit_ends_as_the_uninterrupted_one(tmp_path: Path, resume_from: int) -> None:
    """From epoch 0's checkpoint both pruning steps run in the resumed fit; from epoch 1's, one ran before."""
    want = _fit(str(tmp_path), None)
    _assert_same(_fit(str(tmp_path), resume_from), want)


def _ddp_fit(rank: int, world_size: int, root: str, resume_from: int | None) -> dict[str, Any]:
    out = _fit(root, resume_from, devices=2, strategy="ddp")
    return {k: (tuple(v.shape), v.flatten().tolist()) for k, v in out.items()}


@pytest.mark.slow
def test_a_resumed_ddp_fit_ends_as_the_uninterrupted_one(tmp_path: Path) -> None:
    want = run_in_processes(_ddp_fit, 2, args=(str(tmp_path), None), init_process_group=False, timeout=300)
    got = run_in_processes(_ddp_fit, 2, args=(str(tmp_path), 1), init_process_group=False, timeout=300)
    for rank in range(2):
        assert got[rank] == want[rank]
    # one model on both ranks (the BatchNorm statistics are each rank's own, as under DDP without pruning)
    params = [k for k in want[0] if "running_" not in k and "num_batches" not in k]
    assert [want[0][k] for k in params] == [want[1][k] for k in params]
