"""The trial probe in a Trainer: what it records per optimizer step (gradient accumulation included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, TQDMProgressBar

from lightning_accel.models import ImageClassifier
from lightning_accel.tune.cli import main
from lightning_accel.tune.runner import TrialProbe, run_trial
from tests import tiny


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_probe_records_and_saves_once_per_optimizer_step(tmp_path: Path, accumulate: int) -> None:
    probe = TrialProbe(warmup=2, steps=4, ckpt_dir=str(tmp_path))
    trainer = tiny.trainer(
        max_epochs=-1, max_steps=7, limit_train_batches=8, accumulate_grad_batches=accumulate, callbacks=[probe]
    )
    saves: list[str] = []
    save = trainer.save_checkpoint

    def spy(path: Any, *args: Any, **kwargs: Any) -> None:
        saves.append(Path(path).name)
        save(path, *args, **kwargs)

    trainer.save_checkpoint = spy  # type: ignore[method-assign, assignment]
    trainer.fit(tiny.classifier(), tiny.loader())
    # the starts of steps 2..6 (one per optimizer step, not one per batch of its window); one warm-up and one timed save
    assert len(probe.starts) == 5 and saves == ["warm.ckpt", "step4.ckpt"]
    assert probe.save_step == 1 and probe.steps_per_epoch == 8 // accumulate  # the epoch's saves amortise over steps
    assert len(probe.losses) == 7 * accumulate  # every batch's loss


def _job(*, n: int = 128, batch_size: int = 16, callbacks: list[Any] | None = None, **trainer: Any) -> dict[str, Any]:
    """The digits CNN job the trials below run: one CPU epoch of ``n`` samples, no checkpoints unless
    ``enable_checkpointing=True``; ``trainer`` adds Trainer settings."""
    t: dict[str, Any] = {"accelerator": "cpu", "max_epochs": 1, "enable_checkpointing": False, **trainer}
    if callbacks is not None:
        t["callbacks"] = callbacks
    return {
        "seed_everything": 0,
        "trainer": t,
        "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
        "data": {"class_path": "tests.tiny.TinyDigits", "init_args": {"batch_size": batch_size, "n": n}},
    }


class InterruptAt(Callback):
    """Ctrl-C in the middle of a trial: ``KeyboardInterrupt`` at the start of step ``step``."""

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_in_a_trial_stops_the_tune_instead_of_failing_the_trial(tmp_path: Path, monkeypatch: Any) -> None:
    # Lightning turns Ctrl-C inside `fit` into `sys.exit(1)`: the tune must stop there (exit 130, nothing written,
    # its trial folder removed), not report "trial failed: SystemExit: 1" and go on with the next trial
    monkeypatch.chdir(tmp_path)
    job = _job(callbacks=[{"class_path": f"{__name__}.InterruptAt", "init_args": {"step": 2}}])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    argv = ["--config", "job.yaml", "--out", "out/tuned.yaml", "--warmup", "2", "--steps", "3"]
    code = main([*argv, "--levers", "precision", "--cache-dir", str(tmp_path / "cache")])
    assert code == 130
    assert not (tmp_path / "out" / "tuned.yaml").exists()
    assert not list((tmp_path / "out").glob(".tune-*")) and not (tmp_path / "cache").exists()
    with pytest.raises(KeyboardInterrupt):  # the runner itself: raised, not an error in the trial's measure
        run_trial(job, warmup=2, steps=3, root=tmp_path / "t")


class SigtermAt(Callback):
    """Sends this process a SIGTERM (a `kill`, a scheduler's preemption) at ``step`` of a trial in ``precision``."""

    def __init__(self, step: int = 2, precision: str = "bf16-mixed") -> None:
        self.step, self.precision = step, precision

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and str(trainer.precision) == self.precision:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_in_a_trial_stops_the_tune_and_removes_its_folder(tmp_path: Path, monkeypatch: Any) -> None:
    # before: Lightning turned the SIGTERM into a SIGTERMException at the batch's end, the tune reported
    # "trial failed: SIGTERMException" for the option and went on with the next ones (and a SIGTERM between two
    # trials killed it on the spot, leaving its trial folder behind)
    import signal

    monkeypatch.chdir(tmp_path)
    job = _job(callbacks=[{"class_path": f"{__name__}.SigtermAt", "init_args": {"step": 2}}])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    argv = ["--config", "job.yaml", "--out", "out/tuned.yaml", "--warmup", "2", "--steps", "3", "--levers", "precision"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--skip", "Fused", "--cache-dir", str(tmp_path / "cache")])
    assert e.value.code == 128 + signal.SIGTERM
    assert not (tmp_path / "out" / "tuned.yaml").exists() and not (tmp_path / "cache").exists()
    assert not list((tmp_path / "out").glob(".tune-*"))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the tune's handler is gone with it


@pytest.mark.parametrize(
    ("strategy", "want"),
    [
        ("ddp_1bit", {"warmup_steps": 3, "compression": "1bit"}),
        (  # the job's own arguments stay
            {
                "class_path": "lightning_accel.strategies.OneBitDDPStrategy",
                "init_args": {"warmup_steps": 50, "compression": "1bit", "block_size": 256},
            },
            {"warmup_steps": 3, "compression": "1bit", "block_size": 256},
        ),
        (  # an explicit fp32 is the job's choice, and plain DDP has no warm-up: the strategy refuses one beside it
            {
                "class_path": "lightning_accel.strategies.OneBitDDPStrategy",
                "init_args": {"compression": "fp32", "log_stats": False},
            },
            {"compression": "fp32", "log_stats": False},
        ),
    ],
)
def test_a_ddp_1bit_trial_compresses_in_its_timed_steps(strategy: Any, want: dict[str, Any]) -> None:
    # ddp_1bit's own warm-up ("auto": >= 10 fp32 steps) would cover almost all of a 3 + 12 step trial: the lever was
    # kept or rejected on plain DDP's time (and its losses matched the baseline's exactly)
    from lightning_accel.strategies import OneBitDDPStrategy
    from lightning_accel.tune.runner import _trial_job

    job = {"trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy}, "model": {"class_path": "m.M"}}
    trial = _trial_job(job, warmup=3, steps=12, root="r", save=False)
    s = trial["trainer"]["strategy"]
    assert s["class_path"].endswith("OneBitDDPStrategy") and s["init_args"] == want
    OneBitDDPStrategy(**s["init_args"])  # what the trial builds is accepted
    assert job["trainer"]["strategy"] == strategy  # the job itself (what tuned.yaml is written from) is unchanged
    plain = _trial_job({**job, "trainer": {"strategy": "ddp"}}, warmup=3, steps=12, root="r", save=False)
    assert plain["trainer"]["strategy"] == "ddp"


def test_the_breakdown_amortises_the_trials_saves_as_the_step_time_does(tmp_path: Path) -> None:
    # a job saving once per epoch of 64 steps: the trial's two saves (the untimed warm-up one included) counted raw
    # over its few timed steps read as a checkpoint-bound job, and the verdict sent the tune to the checkpoint lever
    job = _job(n=1024, enable_checkpointing=True)
    m = run_trial(job, warmup=2, steps=4, root=tmp_path)
    assert m.error is None and m.save_s > 0 and m.train_step_s is not None
    assert m.breakdown["checkpoint"] == pytest.approx(m.save_s / 64)  # what `step_s` adds for the save
    assert m.step_s == pytest.approx(m.train_step_s + m.save_s / 64)
    assert m.dominant == max(m.breakdown, key=lambda c: m.breakdown[c])


def test_a_verdict_the_raw_saves_made_is_given_again_from_the_amortised_breakdown() -> None:
    from lightning_accel.tune.runner import TrialMeasure, _amortise_saves

    m = TrialMeasure()
    m.breakdown = {"data": 0.001, "compute": 0.010, "comm": 0.0, "checkpoint": 0.030, "eval": 0.0, "other": 0.0}
    m.dominant, m.verdict = "checkpoint", "71 % of step time stalls in checkpoint saves: ..."
    _amortise_saves(m, 0.0005, {"device": "cpu", "precision": "32-true"})
    assert m.breakdown["checkpoint"] == 0.0005 and m.dominant == "compute"
    assert "compute" in m.verdict and "checkpoint saves" not in m.verdict


def test_under_gradient_accumulation_the_breakdown_is_per_optimizer_step_after_the_warmup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the monitor counts batches: its warm-up was `warmup` batches (the first optimizer steps were timed) and the
    # report's data/compute columns were per batch beside a step time per optimizer step (a quarter of it here)
    from lightning_accel.perf.callbacks import PerformanceMonitor

    monitors: list[PerformanceMonitor] = []
    end = PerformanceMonitor.on_train_end

    def spy(self: PerformanceMonitor, trainer: Trainer, pl_module: LightningModule) -> None:
        end(self, trainer, pl_module)
        monitors.append(self)

    monkeypatch.setattr(PerformanceMonitor, "on_train_end", spy)
    job = _job(n=512, batch_size=8, accumulate_grad_batches=4)
    m = run_trial(job, warmup=2, steps=3, root=tmp_path)
    assert m.error is None and len(monitors) == 1 and monitors[0].report is not None
    rep = monitors[0].report
    assert rep.steps == 4 * (3 + 1)  # the timed optimizer steps' batches, none of the warm-up's
    for k, v in rep.seconds.items():
        assert m.breakdown[k] == pytest.approx(v / (3 + 1))


class HoldMemory(Callback):
    """A trial that holds ``mib`` MiB of host memory while it trains."""

    def __init__(self, mib: int = 256) -> None:
        self.mib = mib
        self.block: Any = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.block is None:
            self.block = torch.ones(self.mib * 2**18)  # touched: resident

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.block = None


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the peak is reset through Linux's /proc")
def test_a_trials_host_memory_is_its_own_peak_not_the_tunes(tmp_path: Path) -> None:
    # every trial runs in the tune's one process, whose peak resident memory only grows: a trial after a hungry one
    # reported the hungry one's peak (a lever that saves memory could not show it)
    job = _job()
    hungry = {**job, "trainer": {**job["trainer"], "callbacks": [{"class_path": f"{__name__}.HoldMemory"}]}}
    a = run_trial(hungry, warmup=2, steps=3, root=tmp_path / "a")
    b = run_trial(job, warmup=2, steps=3, root=tmp_path / "b")
    assert a.error is None and b.error is None and a.peak_mem is not None and b.peak_mem is not None
    assert b.peak_mem < a.peak_mem - 128 * 2**20


def test_a_job_with_a_learning_rate_monitor_is_measured(tmp_path: Path) -> None:
    # `fit` runs it (with its default logger); a trial has no logger, and LearningRateMonitor refuses a Trainer
    # without one: the baseline failed and no job that logs its learning rate could be tuned
    job = _job(
        callbacks=[
            {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
            "lightning.pytorch.callbacks.DeviceStatsMonitor",
        ]
    )
    m = run_trial(job, warmup=2, steps=3, root=tmp_path)
    assert m.error is None and m.step_s is not None


class PlateauClassifier(ImageClassifier):
    """The digits CNN with ``ReduceLROnPlateau`` on ``val_loss``, which its validation logs."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def test_a_job_whose_plateau_scheduler_monitors_a_validation_metric_is_measured(tmp_path: Path) -> None:
    # `fit` runs it (its validation logs val_loss); a trial does not validate, and its epochs of 4 steps end before
    # the trial does: Lightning raised "ReduceLROnPlateau conditioned on metric val_loss which is not available"
    job = _job(n=64)
    job["model"]["class_path"] = f"{__name__}.PlateauClassifier"
    m = run_trial(job, warmup=2, steps=4, root=tmp_path)
    assert m.error is None and m.step_s is not None and len(m.losses) == 7


class ManualClassifier(ImageClassifier):
    """The digits CNN under manual optimization; ``training_step`` returns its loss only with ``returns``."""

    def __init__(self, width: int = 4, returns: bool = False) -> None:
        super().__init__(width=width)
        self.automatic_optimization = False
        self.returns = returns

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss if self.returns else None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def test_a_manual_optimization_job_that_returns_no_loss_records_its_losses(tmp_path: Path) -> None:
    # its trials recorded NaN losses: every trial failed the numerics ("loss is nan at step 0"), the job's own too,
    # and no lever could ever be kept
    runs = {}
    for returns in (False, True):
        job = _job()
        job["model"] = {"class_path": f"{__name__}.ManualClassifier", "init_args": {"returns": returns}}
        runs[returns] = run_trial(job, warmup=2, steps=3, root=tmp_path / str(returns))
    silent, returning = runs[False], runs[True]
    assert silent.error is None and len(silent.losses) == 6
    assert silent.losses == pytest.approx(returning.losses)  # the loss given to manual_backward: the one it returns


class BestCheckpoint(ModelCheckpoint):
    """A job's own checkpoint callback, under a name of its own."""


class Patience(EarlyStopping):
    """A job's own early stopping on ``val_loss``."""

    def __init__(self, patience: int = 3) -> None:
        super().__init__(monitor="val_loss", patience=patience)


class Bar(TQDMProgressBar):
    """A job's own progress bar."""


@pytest.mark.parametrize("callback", ["BestCheckpoint", "Patience", "Bar"])
def test_a_job_with_its_own_subclass_of_a_callback_trials_leave_out_is_measured(tmp_path: Path, callback: str) -> None:
    # left out by name only: Lightning refused the subclass beside the trial's `enable_checkpointing=False` /
    # `enable_progress_bar=False` (or stopped on a missing val_loss), and the baseline of a job `fit` runs failed
    m = run_trial(_job(callbacks=[f"{__name__}.{callback}"]), warmup=2, steps=3, root=tmp_path)
    assert m.error is None and m.step_s is not None


class TwoOptimizers(LightningModule):
    """Manual optimization with two optimizers that both step in every batch (the global step moves by 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Linear(3 * 8 * 8, 10), torch.nn.Linear(3 * 8 * 8, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        total = torch.zeros(())
        for head, opt in zip((self.a, self.b), self.optimizers(), strict=True):
            loss = torch.nn.functional.cross_entropy(head(x.flatten(1)), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            total = total + loss.detach()
        return total

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.Adam(self.b.parameters(), lr=0.01)


def test_the_probe_saves_when_the_global_step_passes_over_its_save_steps(tmp_path: Path) -> None:
    # the saves were made at global steps equal to warmup and warmup + steps // 2 (3 and 9): stepping by 2, the job
    # reached neither, no save was timed, and its checkpoint cost (and checkpoint lever) measured nothing
    probe = TrialProbe(warmup=3, steps=12, ckpt_dir=str(tmp_path))
    trainer = tiny.trainer(max_epochs=-1, max_steps=16, limit_train_batches=8, callbacks=[probe])
    trainer.fit(TwoOptimizers(), tiny.loader())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step10.ckpt", "warm.ckpt"]
    # the starts of steps 4, 6, 8: the period after the third (8 -> 10) holds the timed save, left out of the median
    assert probe.save_s > 0 and probe.save_step == 2 and probe.step_s is not None
