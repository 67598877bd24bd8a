"""Extending a finished run: the schedule's length follows the new fit, and LinearScalingLR does not scale again."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.recipes import LinearScalingLR, PerStepLR
from lightning_accel.recipes.lr import WarmupCosineLR
from tests.tiny import LRProbe, classifier, loader, trainer


def _model() -> Any:
    m = classifier(width=4, lr=0.01)

    def configure_optimizers() -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": WarmupCosineLR(opt, warmup_steps=1, min_lr=1e-4)}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


def test_extending_a_finished_run_follows_the_new_length_and_does_not_rescale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    probe1 = LRProbe()
    t1 = trainer(
        max_epochs=1,
        callbacks=[LinearScalingLR(base_batch_size=16), PerStepLR(), probe1, ckpt],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    t1.fit(_model(), loader(32, 128))  # 4 steps, batch 32 / base 16: lr x2
    assert probe1.lrs[0] == pytest.approx(0.02) and t1.lr_scheduler_configs[0].scheduler.total_steps == 4
    probe2 = LRProbe()
    t2 = trainer(
        max_epochs=3,
        limit_train_batches=4,
        callbacks=[LinearScalingLR(base_batch_size=16), PerStepLR(), probe2, ModelCheckpoint(dirpath=tmp_path)],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        t2.fit(_model(), loader(32, 128), ckpt_path=str(tmp_path / "last.ckpt"))
    sched = t2.lr_scheduler_configs[0].scheduler
    assert sched.total_steps == 12  # this fit's length, not the finished run's 4
    # step 4 of 12 on the cosine from the scaled peak 0.02: far above min_lr, and not scaled a second time
    expected = 1e-4 + (0.02 - 1e-4) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 3 / 11)).item())
    assert probe2.lrs[0] == pytest.approx(expected, rel=1e-6)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("LinearScalingLR" in m for m in messages), messages
    assert any("length 4 -> 12" in m for m in messages), messages
