"""Resumed ``PerStepLR`` schedules under accumulation changes: a ``GradientAccumulationScheduler`` with another
batch size, another ``accumulate_grad_batches`` with the same steps per epoch, and frequencies a later epoch's
accumulation never meets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from lightning_accel.callbacks import PerStepLR
from lightning_accel.recipes.lr import WarmupCosineLR, warmup_cosine_value
from tests.tiny import LRProbe, classifier, loader, trainer


def _model(frequency: int = 1) -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = WarmupCosineLR(opt, warmup_steps=1, min_lr=0.001)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": frequency}}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


def test_a_resume_under_an_accumulation_scheduler_at_another_batch_size_continues_from_the_same_epoch(
    tmp_path: Path,
) -> None:
    # 2 epochs of 8 batches of 32 at accumulation {0: 1, 1: 2}: 8 + 4 steps; checkpoint at the end of epoch 0 (step 8)
    first = trainer(
        callbacks=[
            PerStepLR(),
            GradientAccumulationScheduler({0: 1, 1: 2}),
            ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1),
        ],
        enable_checkpointing=True,
        limit_train_batches=None,
        max_epochs=2,
    )
    first.fit(_model(), loader(32, 256))
    # resumed at batch 64: 4 batches per epoch, 4 + 2 steps; epoch 0's whole steps are this fit's 4, not the old 8
    probe = LRProbe()
    t = trainer(
        callbacks=[PerStepLR(), GradientAccumulationScheduler({0: 1, 1: 2}), probe],
        limit_train_batches=None,
        max_epochs=2,
    )
    t.fit(_model(), loader(64, 256), ckpt_path=tmp_path / "epoch=0-step=8.ckpt")
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR) and sched.total_steps == 6
    expected = [warmup_cosine_value(4 + k, 0.1, 6, 1, 0.001) for k in range(2)]
    assert probe.lrs[::2] == pytest.approx(expected, rel=1e-9)
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)


def test_a_mid_epoch_resume_at_another_accumulation_with_the_same_steps_per_epoch_counts_this_fits_steps(
    tmp_path: Path,
) -> None:
    # 5 batches per epoch: accumulation 3 steps after batches 3 and 5, accumulation 4 after 4 and 5 (2 steps each)
    first = trainer(
        callbacks=[PerStepLR(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)],
        enable_checkpointing=True,
        limit_train_batches=5,
        max_epochs=2,
        accumulate_grad_batches=3,
    )
    first.fit(_model(), loader(32, 256))
    # resumed after batch 3 of epoch 0 (1 step taken): this fit takes its 2 steps after batches 4 and 5 of epoch 0,
    # then 2 in epoch 1; the schedule starts at position 0 and ends at min_lr with the fit, at 4
    probe = LRProbe()
    t = trainer(callbacks=[PerStepLR(), probe], limit_train_batches=5, max_epochs=2, accumulate_grad_batches=4)
    t.fit(_model(), loader(32, 256), ckpt_path=tmp_path / "epoch=0-step=1.ckpt")
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR) and sched.total_steps == 4
    # batch 4 of epoch 0 at position 0 (a step after it), batch 5 at 1; epoch 1's batches 1-4 at 2 and batch 5 at 3
    expected = [warmup_cosine_value(p, 0.1, 4, 1, 0.001) for p in [0, 1, 2, 2, 2, 2, 3]]
    assert probe.lrs == pytest.approx(expected, rel=1e-9)
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)


def test_a_frequency_a_later_epochs_accumulation_never_meets_is_refused_at_the_start() -> None:
    # 4 batches: accumulation 1 steps after 1, 2, 3, 4 (frequency 3 meets 3); accumulation 2 after 2 and 4 (never 3)
    t = trainer(callbacks=[PerStepLR(), GradientAccumulationScheduler({0: 1, 1: 2})], max_epochs=2)
    with pytest.raises(ValueError, match=r"`frequency` 3 never steps it.*epoch 1.*`accumulate_grad_batches` 2"):
        t.fit(_model(frequency=3), loader(32, 256))
    assert t.global_step == 0


def test_a_later_epoch_that_max_steps_never_reaches_is_not_checked() -> None:
    # `max_steps` 8 ends the fit with epoch 1 (4 steps each at accumulation 1): epoch 2's accumulation 2 never trains
    probe = LRProbe()
    t = trainer(callbacks=[PerStepLR(), GradientAccumulationScheduler({0: 1, 2: 2}), probe], max_epochs=3, max_steps=8)
    t.fit(_model(frequency=3), loader(32, 256))
    assert t.global_step == 8 and len(probe.lrs) == 8
    # the frequency-3 steps after batch 3 of each epoch: one per epoch
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR) and sched.total_steps == 2 and sched.last_epoch == 2
