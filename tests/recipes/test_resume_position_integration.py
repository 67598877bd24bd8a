"""Resumed ``PerStepLR`` schedules continue exactly where an uninterrupted fit is: a checkpoint inside an epoch before
its first optimizer step, one at an epoch's end (its last batch, or ``on_train_epoch_end``) with fewer batches per epoch
than the resumed fit, and a ``GradientAccumulationScheduler`` whose accumulation must hold from the first resumed batch
(``LinearScalingLR`` too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from lightning_accel.callbacks import LinearScalingLR, PerStepLR
from lightning_accel.recipes.lr import WarmupCosineLR
from tests.tiny import LRProbe, classifier, loader, trainer


def _model() -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = WarmupCosineLR(opt, warmup_steps=1, min_lr=0.001)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


class _SaveAfter(Callback):
    """Saves ``path`` after batch ``batch_idx`` (0-based) of epoch ``epoch``, mid-epoch."""

    def __init__(self, path: Path, epoch: int, batch_idx: int) -> None:
        self.path, self.epoch, self.batch_idx = path, epoch, batch_idx

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


class _Probe(LRProbe):
    """Records, per training batch, the learning rate and the Trainer's ``accumulate_grad_batches``."""

    def __init__(self) -> None:
        super().__init__()
        self.accumulations: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.accumulations.append(trainer.accumulate_grad_batches)


def test_a_resume_before_the_epochs_first_optimizer_step_counts_this_fits_steps_over_its_batches(
    tmp_path: Path,
) -> None:
    # saved after batches 1-2 of epoch 0 at accumulation 3 (no optimizer step yet); at accumulation 2 those two
    # batches are this fit's first step, so the resumed fit continues at position 1, as an uninterrupted run does
    ckpt = tmp_path / "mid.ckpt"
    kw: dict[str, Any] = dict(limit_train_batches=6, max_epochs=2)
    trainer(callbacks=[PerStepLR(), _SaveAfter(ckpt, 0, 1)], accumulate_grad_batches=3, **kw).fit(
        _model(), loader(32, 256)
    )
    whole = LRProbe()
    trainer(callbacks=[PerStepLR(), whole], accumulate_grad_batches=2, **kw).fit(_model(), loader(32, 256))
    probe = LRProbe()
    t = trainer(callbacks=[PerStepLR(), probe], accumulate_grad_batches=2, **kw)
    t.fit(_model(), loader(32, 256), ckpt_path=ckpt)
    assert probe.lrs == pytest.approx(whole.lrs[2:], rel=1e-9)
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)


@pytest.mark.parametrize("saved_on", ["last_batch", "epoch_end"])
def test_an_epoch_end_checkpoint_with_fewer_batches_resumes_at_the_next_epochs_start(
    tmp_path: Path, saved_on: str
) -> None:
    # epoch 0 of 4 batches of 64 (4 steps) saved at its end; resumed with batches of 32 (8 per epoch) at accumulation
    # 2. Saved at `on_train_epoch_end`, the restored 4 batches are a finished epoch: epoch 1 starts at batch 0. Saved on
    # the last batch, Lightning starts epoch 1 after 4 batches (its count is below this fit's 8): 2 steps already in
    # this fit's units. Either way the schedule is where an uninterrupted run is at the first resumed batch
    skipped = {"last_batch": 4, "epoch_end": 0}[saved_on]
    save = (
        ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
        if saved_on == "last_batch"
        else ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    )
    kw: dict[str, Any] = dict(limit_train_batches=None, max_epochs=2)
    trainer(callbacks=[PerStepLR(), save], enable_checkpointing=True, **kw).fit(_model(), loader(64, 256))
    whole = LRProbe()
    trainer(callbacks=[PerStepLR(), whole], accumulate_grad_batches=2, **kw).fit(_model(), loader(32, 256))
    probe = LRProbe()
    t = trainer(callbacks=[PerStepLR(), probe], accumulate_grad_batches=2, **kw)
    t.fit(_model(), loader(32, 256), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert len(probe.lrs) == 8 - skipped
    assert probe.lrs == pytest.approx(whole.lrs[8 + skipped :], rel=1e-9)
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)


@pytest.mark.parametrize(("epoch", "batch_idx"), [(0, 3), (1, 1)], ids=["last_batch", "mid_epoch"])
def test_a_resume_under_an_accumulation_scheduler_trains_at_the_scheduled_accumulation_from_its_first_batch(
    tmp_path: Path, epoch: int, batch_idx: int
) -> None:
    # 4 batches per epoch at accumulation {0: 1, 1: 2, 2: 4}: 4 + 2 + 1 steps. Lightning skips `on_train_epoch_start`
    # (where the accumulation scheduler sets the Trainer's accumulation) on a resume inside an epoch or at its last
    # batch; the resumed batches must still accumulate as scheduled, and the schedule follow those steps
    ckpt = tmp_path / "saved.ckpt"
    kw: dict[str, Any] = dict(limit_train_batches=4, max_epochs=3)
    whole = _Probe()
    trainer(
        callbacks=[
            PerStepLR(),
            GradientAccumulationScheduler({0: 1, 1: 2, 2: 4}),
            whole,
            _SaveAfter(ckpt, epoch, batch_idx),
        ],
        **kw,
    ).fit(_model(), loader(32, 256))
    probe = _Probe()
    t = trainer(callbacks=[PerStepLR(), GradientAccumulationScheduler({0: 1, 1: 2, 2: 4}), probe], **kw)
    t.fit(_model(), loader(32, 256), ckpt_path=ckpt)
    done = 4 * epoch + batch_idx + 1
    assert probe.accumulations == whole.accumulations[done:]
    assert probe.lrs == pytest.approx(whole.lrs[done:], rel=1e-9)
    assert t.global_step == 7
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)


def test_linear_scaling_resumed_inside_a_scheduled_accumulation_epoch_trains_at_the_batch_it_scaled_for(
    tmp_path: Path,
) -> None:
    # accumulation {0: 1, 1: 2} at 32 per batch, base 32: x1 in epoch 0, x2 in epoch 1. Resumed after batch 2 of epoch
    # 1, its last 2 batches must accumulate 2 (one step of 64 samples) at the x2 rate, as in the uninterrupted run
    def model() -> Any:
        m = classifier()
        m.configure_optimizers = lambda: torch.optim.SGD(m.parameters(), lr=0.1)  # type: ignore[method-assign]
        return m

    ckpt = tmp_path / "saved.ckpt"
    kw: dict[str, Any] = dict(limit_train_batches=4, max_epochs=2)
    whole = _Probe()
    trainer(
        callbacks=[LinearScalingLR(32), GradientAccumulationScheduler({0: 1, 1: 2}), whole, _SaveAfter(ckpt, 1, 1)],
        **kw,
    ).fit(model(), loader(32, 256))
    probe = _Probe()
    t = trainer(callbacks=[LinearScalingLR(32), GradientAccumulationScheduler({0: 1, 1: 2}), probe], **kw)
    t.fit(model(), loader(32, 256), ckpt_path=ckpt)
    assert whole.accumulations[6:] == [2, 2] and whole.lrs[6:] == pytest.approx([0.2, 0.2])
    assert probe.accumulations == [2, 2]
    assert probe.lrs == pytest.approx([0.2, 0.2])
    assert t.global_step == 6
