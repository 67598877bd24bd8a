"""RollbackGuard in a Trainer: a NaN rolls back and switches the latest lever off, an LR spike is undone, the fit
stops after ``max_rollbacks``, the guard's state resumes from a checkpoint, a PerformanceMonitor report gets a line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback

from lightning_accel.callbacks import PerformanceMonitor, RollbackGuard
from lightning_accel.recipes import LinearScalingLR, PerStepLR, StructuredPruning, WarmupCosineLR
from tests import tiny


class NaNAt(Callback):
    """Makes the loss (hence the gradients and the weights) NaN at the given global steps, once each (a transient
    fault: a step trained again after a rollback is clean)."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step in self.steps:
            self.steps.discard(trainer.global_step)
            loss.mul_(math.nan)


class Toy:
    """A lever that switches on at ``on_at`` (polled: the guard sees it at its next check)."""

    lever_name = "toy"

    def __init__(self, trainer_ref: list[Any], on_at: int = 0) -> None:
        self.ref, self.on_at, self.off = trainer_ref, on_at, False

    @property
    def lever_active(self) -> bool:
        t = self.ref[0] if self.ref else None
        return not self.off and t is not None and t.global_step >= self.on_at

    def switch_off(self, reason: str) -> bool:
        was, self.off = self.lever_active, True
        return was


class Older(Toy):
    lever_name = "older"


def _finite(m: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in m.parameters())


def test_nan_rolls_back_and_switches_the_latest_lever_off() -> None:
    ref: list[Any] = []
    older, toy = Older(ref, on_at=0), Toy(ref, on_at=6)
    guard = RollbackGuard(snapshot_every=4, check_every=1, grad_norm_every=1, levers=[toy, older], verbose=False)
    mon = PerformanceMonitor(report_path="", verbose=False, count_flops=False, skip_steps=1)
    model = tiny.classifier()
    trainer = tiny.trainer(max_epochs=2, limit_train_batches=8, callbacks=[guard, NaNAt(9), mon])
    ref.append(trainer)
    trainer.fit(model, tiny.loader())
    assert _finite(model) and trainer.global_step == 16
    assert guard.rollbacks == 1 and len(guard.events) == 1
    e = guard.events[0]
    assert e["action"] == "rollback" and e["switched_off"] == "toy" and "non-finite" in e["reason"]
    assert e["step"] == 10 and e["restored_step"] == 8  # the step that produced the NaN is step 10's update
    assert toy.off and not older.off and guard.switched_off == ["toy"]
    assert trainer.callback_metrics["guard/rollbacks"] == 1.0
    assert mon.report is not None and "toy" in mon.report.extras["guard"]


class StepCount(Callback):
    """Counts the optimizer steps taken."""

    def __init__(self) -> None:
        self.n = 0

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.n += 1


def test_a_max_steps_fit_trains_the_steps_a_rollback_took_back() -> None:
    guard = RollbackGuard(snapshot_every=4, check_every=1, grad_norm_every=1, verbose=False)
    count = StepCount()
    model = tiny.classifier()
    trainer = tiny.trainer(max_epochs=-1, max_steps=16, limit_train_batches=8, callbacks=[guard, NaNAt(9), count])
    trainer.fit(model, tiny.loader())
    e = guard.events[0]
    assert (e["step"], e["restored_step"], e["replayed"]) == (10, 8, 2)
    assert trainer.global_step == 16 and count.n == 18  # 10 steps, back to 8, then 8 more
    assert _finite(model)


def test_a_rollback_mid_accumulation_window_drops_the_bad_gradients() -> None:
    # the check after the window's first batch sees its NaN loss; the NaN gradient it left in `.grad` must not reach
    # the restored weights through the window's step (that re-poisoned them: rollback after rollback, then a stop)
    guard = RollbackGuard(snapshot_every=4, check_every=1, verbose=False)
    model = tiny.classifier()
    trainer = tiny.trainer(
        max_epochs=-1, max_steps=12, limit_train_batches=8, accumulate_grad_batches=2, callbacks=[guard, NaNAt(9)]
    )
    trainer.fit(model, tiny.loader())
    assert [e["action"] for e in guard.events] == ["rollback"] and guard.events[0]["restored_step"] == 8
    assert trainer.global_step == 12 and _finite(model)


def test_replay_off_or_an_epoch_bound_fit_keeps_the_step_counter() -> None:
    for kwargs, replay in (({"max_epochs": -1, "max_steps": 16}, False), ({"max_epochs": 2}, True)):
        guard = RollbackGuard(snapshot_every=4, check_every=1, replay_lost_steps=replay, verbose=False)
        count = StepCount()
        trainer = tiny.trainer(limit_train_batches=8, callbacks=[guard, NaNAt(9), count], **kwargs)
        trainer.fit(tiny.classifier(), tiny.loader())
        assert guard.rollbacks == 1 and "replayed" not in guard.events[0]
        assert trainer.global_step == count.n == 16


def test_a_learning_rate_spike_is_undone() -> None:
    class LRSpike(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 30:
                for g in trainer.optimizers[0].param_groups:
                    g["lr"] *= 300.0

    torch.manual_seed(0)
    guard = RollbackGuard(snapshot_every=5, verbose=False)
    model = tiny.classifier(lr=0.01)
    trainer = tiny.trainer(max_epochs=6, limit_train_batches=8, callbacks=[guard, LRSpike()])
    trainer.fit(model, tiny.loader(shuffle=True))
    assert guard.rollbacks >= 1 and guard.events[0]["restored_step"] <= 30
    assert trainer.optimizers[0].param_groups[0]["lr"] < 0.02  # the snapshot's learning rate is back
    assert _finite(model)


def test_stops_after_max_rollbacks_with_one_line(recwarn: Any) -> None:
    guard = RollbackGuard(snapshot_every=2, check_every=1, max_rollbacks=1, verbose=False)
    model = tiny.classifier()
    trainer = tiny.trainer(max_epochs=3, limit_train_batches=8, callbacks=[guard, NaNAt(*range(5, 24))])
    trainer.fit(model, tiny.loader())
    assert [e["action"] for e in guard.events] == ["rollback", "stop"]
    assert trainer.global_step < 24 and _finite(model)
    lines = [str(w.message) for w in recwarn if "stopped the fit" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0] and "after 1 rollback(s)" in lines[0]


def test_guard_state_resumes_and_switched_off_levers_stay_off(tmp_path: Path) -> None:
    ref: list[Any] = []
    toy = Toy(ref)
    guard = RollbackGuard(snapshot_every=3, levers=[toy], verbose=False)
    model = tiny.classifier()
    trainer = tiny.trainer(max_epochs=1, limit_train_batches=8, callbacks=[guard, NaNAt(5)])
    ref.append(trainer)
    trainer.fit(model, tiny.loader())
    assert guard.switched_off == ["toy"]
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)

    ref2: list[Any] = []
    toy2 = Toy(ref2)
    guard2 = RollbackGuard(snapshot_every=3, levers=[toy2], verbose=False)
    trainer2 = tiny.trainer(max_epochs=2, limit_train_batches=8, callbacks=[guard2])
    ref2.append(trainer2)
    trainer2.fit(tiny.classifier(), tiny.loader(), ckpt_path=str(path))
    assert guard2.rollbacks == 1 and guard2.events == guard.events
    assert toy2.off  # switched off again at the start of the resumed fit
    assert guard2.watches["loss"].count > guard.watches["loss"].count  # the statistics went on


def test_a_snapshot_never_holds_the_update_of_a_bad_step() -> None:
    # snapshots fall due every step, the gradient norm is not sampled at the NaN step and its loss (computed before
    # the update) is finite: a snapshot taken right after the check would hold NaN weights
    guard = RollbackGuard(snapshot_every=1, check_every=1, grad_norm_every=8, verbose=False)
    model = tiny.classifier()
    trainer = tiny.trainer(max_epochs=1, limit_train_batches=8, callbacks=[guard, NaNAt(5)])
    trainer.fit(model, tiny.loader())
    assert guard.rollbacks == 1 and guard.events[0]["restored_step"] == 4 and _finite(model)  # 5 had NaN grads


class LRs(Callback):
    """The first param group's learning rate at each training batch."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


class Scheduled(pl.LightningModule):
    """A linear model whose ``WarmupCosineLR`` has no length: ``PerStepLR`` binds it at the start of the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": WarmupCosineLR(opt, warmup_steps=2)}


def test_the_first_snapshot_holds_what_callbacks_after_the_guard_set_at_train_start() -> None:
    # the guard comes first in the list: its `on_train_start` runs before LinearScalingLR scales the rate and before
    # PerStepLR binds the schedule; a rollback to a snapshot taken there would undo both
    guard, probe = RollbackGuard(check_every=1, verbose=False), LRs()
    model = tiny.classifier(lr=0.01)
    trainer = tiny.trainer(
        max_steps=8, max_epochs=-1, limit_train_batches=8, callbacks=[guard, LinearScalingLR(16), NaNAt(3), probe]
    )
    trainer.fit(model, tiny.loader(batch_size=32))  # global batch 32 over base 16: x2
    assert guard.rollbacks == 1 and guard.events[0]["restored_step"] == 0
    n = guard.events[0]["replayed"]  # the model's own cosine schedule, from the scaled peak, before and after it
    assert probe.lrs[0] == pytest.approx(0.02) and probe.lrs[:n] == probe.lrs[n : 2 * n] and _finite(model)

    guard, probe = RollbackGuard(check_every=1, verbose=False), LRs()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(320, 4)), batch_size=32)
    trainer = tiny.trainer(
        max_steps=10, max_epochs=-1, limit_train_batches=10, callbacks=[guard, PerStepLR(), NaNAt(4), probe]
    )
    trainer.fit(Scheduled(), data)  # before: "WarmupCosineLR was stepped before `total_steps` was known"
    assert guard.rollbacks == 1 and guard.events[0]["restored_step"] == 0 and trainer.global_step == 10
    n = guard.events[0]["replayed"]
    assert probe.lrs[:n] == probe.lrs[n : 2 * n]  # the replayed steps take the same rates


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


@pytest.mark.parametrize("guard_first", [True, False])
@pytest.mark.parametrize(("epoch", "nan_step"), [(0, 2), (1, 4)])
def test_a_rollback_after_pruning_restores_the_pruned_model(guard_first: bool, epoch: int, nan_step: int) -> None:
    # 4 steps an epoch; the NaN comes in the pruning step itself (epoch 1) or two steps after it (epoch 0)
    guard = RollbackGuard(check_every=1, verbose=False)
    prune = StructuredPruning(0.5, schedule=epoch)
    cbs = [guard, prune] if guard_first else [prune, guard]
    model = MLP()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(128, 4)), batch_size=32)
    trainer = tiny.trainer(max_epochs=2, limit_train_batches=4, callbacks=[*cbs, NaNAt(nan_step)])
    trainer.fit(model, data)  # before: "The size of tensor a (4) must match the size of tensor b (8)"
    assert guard.rollbacks == 1 and guard.events[0]["restored_step"] == 4 * epoch
    assert model.net[0].out_features == 4 and _finite(model)


class SavedFinite(Callback):
    """Records, for every checkpoint saved, its global step and whether every weight in it is finite."""

    def __init__(self) -> None:
        self.saves: list[tuple[int, bool]] = []

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        weights = [v for v in checkpoint["state_dict"].values() if v.is_floating_point()]
        self.saves.append((trainer.global_step, all(bool(torch.isfinite(v).all()) for v in weights)))


def test_a_step_checkpoint_between_two_checks_never_holds_a_bad_step(tmp_path: Path) -> None:
    """``every_n_train_steps=4`` saves at step 8; the default check interval (5 on a CPU) would check the NaN of
    step 6 only at step 10, after that save: the steps pending are checked before a step save."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    guard, saved = RollbackGuard(snapshot_every=4, verbose=False), SavedFinite()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer = tiny.trainer(
        max_epochs=1, limit_train_batches=8, enable_checkpointing=True, callbacks=[guard, NaNAt(5), ckpt, saved]
    )
    trainer.fit(tiny.classifier(), tiny.loader())
    assert guard.rollbacks == 1 and guard.events[0]["step"] == 8
    assert [step for step, _ in saved.saves] == [4, 8] and all(ok for _, ok in saved.saves)


def test_a_checkpoint_saved_by_the_clock_never_holds_a_bad_step(tmp_path: Path) -> None:
    """``train_time_interval`` saves whenever its interval has passed, at any step (0 s: at every step, so the test
    does not depend on the clock); the default check interval (5 on a CPU) checked the NaN of step 2 only at step 5,
    after the saves of steps 3 and 4 had written its weights: every step is checked before such a save."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint

    guard, saved = RollbackGuard(snapshot_every=2, verbose=False), SavedFinite()
    ckpt = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(0), save_top_k=-1)
    trainer = tiny.trainer(
        max_epochs=1, limit_train_batches=8, enable_checkpointing=True, callbacks=[guard, NaNAt(2), ckpt, saved]
    )
    trainer.fit(tiny.classifier(), tiny.loader())
    assert guard.rollbacks == 1 and guard.events[0]["step"] == 3  # the update of step 2's NaN, checked at once
    assert guard.events[0]["restored_step"] <= 2
    assert [step for step, _ in saved.saves] == list(range(1, 9)) and all(ok for _, ok in saved.saves), saved.saves
    for path in tmp_path.glob("*.ckpt"):  # what a resume would load
        state = torch.load(path, weights_only=False)["state_dict"]
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()), path.name


@pytest.mark.parametrize(
    "save",
    ["every_n_train_steps", "train_time_interval", "epoch_end", "val_check_interval"],
)
def test_a_save_right_after_a_nan_gradient_never_holds_its_update(tmp_path: Path, save: str) -> None:
    """The batch of global step 7 gives a finite loss but NaN gradients (its loss is made NaN after Lightning kept
    it), and its update makes every weight NaN before the save of step 8; the gradient norm is sampled every 10th step
    on a CPU, so only the loss of step 9 would have shown it: the gradients of a step that was not sampled are
    checked before a save that would hold its update."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint

    saves: dict[str, dict[str, Any]] = {
        "every_n_train_steps": {"every_n_train_steps": 4},
        "train_time_interval": {"train_time_interval": timedelta(0)},
        "epoch_end": {},
        "val_check_interval": {},
    }
    kwargs = saves[save]
    guard, saved = RollbackGuard(snapshot_every=2, verbose=False), SavedFinite()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **kwargs)
    validate = save == "val_check_interval"
    trainer = tiny.trainer(
        max_epochs=1,
        limit_train_batches=12 if validate else 8,
        limit_val_batches=2 if validate else 0,
        val_check_interval=8 if validate else None,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[guard, NaNAt(7), ckpt, saved],
    )
    trainer.fit(tiny.classifier(), tiny.loader(), tiny.loader() if validate else None)
    assert 8 in [step for step, _ in saved.saves] and all(ok for _, ok in saved.saves), (saved.saves, guard.events)
    assert guard.rollbacks == 1 and guard.events[0]["step"] == 8 and "weights non-finite" in guard.events[0]["reason"]


def test_a_validation_inside_the_epoch_checks_the_steps_before_its_save(tmp_path: Path) -> None:
    """``val_check_interval=4`` validates (and ModelCheckpoint saves) after step 4, before the first check at step 5:
    the validation start checks the steps pending."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    guard, saved = RollbackGuard(snapshot_every=2, verbose=False), SavedFinite()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    trainer = tiny.trainer(
        max_epochs=1,
        limit_train_batches=8,
        limit_val_batches=2,
        val_check_interval=4,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[guard, NaNAt(2), ckpt, saved],
    )
    trainer.fit(tiny.classifier(), tiny.loader(), tiny.loader())
    assert guard.rollbacks == 1 and guard.events[0]["step"] == 4
    assert [step for step, _ in saved.saves] == [4, 8] and all(ok for _, ok in saved.saves)
    assert trainer.callback_metrics["guard/rollbacks"] == 1.0


class ManualSilent(pl.LightningModule):
    """Manual optimization whose ``training_step`` returns nothing (as Lightning's examples do); its loss turns NaN in
    the batch after global step ``nan_at``, once."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = tiny.classifier().model
        self.nan_at: int | None = nan_at

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.trainer.global_step == self.nan_at:
            self.nan_at, loss = None, loss * math.nan
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_manual_optimization_that_returns_no_loss_is_watched() -> None:
    # the guard read only `training_step`'s loss: here there is none, it watched nothing, and the NaN ran on into
    # every later step's weights
    guard = RollbackGuard(snapshot_every=4, check_every=1, watch_grad_norm=False, verbose=False)
    model = ManualSilent(nan_at=9)
    trainer = tiny.trainer(max_epochs=2, limit_train_batches=8, callbacks=[guard])
    trainer.fit(model, tiny.loader())
    assert _finite(model) and guard.rollbacks == 1
    e = guard.events[0]
    assert e["step"] == 10 and e["restored_step"] == 8 and "loss non-finite" in e["reason"]
