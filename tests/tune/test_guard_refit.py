"""RollbackGuard across several fits of one Trainer: the reason given to a lever switched off again says what
happened, and ``switched_off`` (what later checkpoints record) stays the levers the guard holds off."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

from lightning_accel.callbacks import RollbackGuard
from tests import tiny


class NaNAt(Callback):
    """Makes the loss NaN at the given global steps, once each."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step in self.steps:
            self.steps.discard(trainer.global_step)
            loss.mul_(math.nan)


class Toy:
    """A lever, on from the start until switched off; it keeps every reason it was given."""

    lever_name = "toy"

    def __init__(self) -> None:
        self.off = False
        self.reasons: list[str] = []

    @property
    def lever_active(self) -> bool:
        return not self.off

    def switch_off(self, reason: str) -> bool:
        self.reasons.append(reason)
        was, self.off = not self.off, True
        return was


def _guard(toy: Toy) -> RollbackGuard:
    return RollbackGuard(snapshot_every=3, check_every=1, grad_norm_every=1, levers=[toy], verbose=False)


def test_a_second_fit_without_resume_does_not_claim_a_resume() -> None:
    toy = Toy()
    guard = _guard(toy)
    trainer = tiny.trainer(max_epochs=1, limit_train_batches=8, callbacks=[guard, NaNAt(5)])
    trainer.fit(tiny.classifier(), tiny.loader())
    assert guard.switched_off == ["toy"] and len(toy.reasons) == 1
    trainer.fit_loop.max_epochs = 2
    trainer.fit(trainer.lightning_module, tiny.loader())  # the same Trainer, nothing resumed
    assert trainer.global_step == 16
    assert len(toy.reasons) == 2 and "resumed" not in toy.reasons[1]
    assert "earlier fit" in toy.reasons[1]
    assert guard.switched_off == ["toy"]


def test_the_reason_names_the_checkpoint_on_a_resume(tmp_path: Path) -> None:
    toy = Toy()
    guard = _guard(toy)
    trainer = tiny.trainer(max_epochs=1, limit_train_batches=8, callbacks=[guard, NaNAt(5)])
    trainer.fit(tiny.classifier(), tiny.loader())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    toy2 = Toy()
    trainer2 = tiny.trainer(max_epochs=2, limit_train_batches=8, callbacks=[_guard(toy2)])
    trainer2.fit(tiny.classifier(), tiny.loader(), ckpt_path=str(tmp_path / "a.ckpt"))
    assert toy2.off and len(toy2.reasons) == 1 and "resumed from" in toy2.reasons[0]


def test_resuming_an_older_checkpoint_keeps_a_lever_still_off_on_record(tmp_path: Path) -> None:
    toy = Toy()
    guard = _guard(toy)
    trainer = tiny.trainer(max_epochs=1, limit_train_batches=8, callbacks=[guard, NaNAt(12)])
    model = tiny.classifier()
    trainer.fit(model, tiny.loader())
    trainer.save_checkpoint(tmp_path / "old.ckpt")  # before any rollback: nothing switched off
    assert guard.switched_off == []
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, tiny.loader())
    assert guard.switched_off == ["toy"] and toy.off
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model, tiny.loader(), ckpt_path=str(tmp_path / "old.ckpt"))
    assert toy.off  # the lever object cannot be switched on again: the record must say it is off
    assert guard.switched_off == ["toy"]
    trainer.save_checkpoint(tmp_path / "new.ckpt")
    state: dict[str, Any] = torch.load(tmp_path / "new.ckpt", weights_only=False)["callbacks"]
    assert next(v for k, v in state.items() if "RollbackGuard" in k)["switched_off"] == ["toy"]
