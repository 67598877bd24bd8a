"""The trial probe in a Trainer: what it records per optimizer step (gradient accumulation included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

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

    trainer.save_checkpoint = spy  # type: ignore[method-assign]
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


@pytest.mark.parametrize(
    ("strategy", "want"),
    [
        ("ddp_1bit", {"warmup_steps": 3, "compression": "1bit"}),
        (  # the job's own arguments stay; an explicit fp32 is the job's choice, not a warm-up
            {
                "class_path": "lightning_accel.strategies.OneBitDDPStrategy",
                "init_args": {"warmup_steps": 50, "compression": "fp32", "block_size": 256},
            },
            {"warmup_steps": 3, "compression": "fp32", "block_size": 256},
        ),
    ],
)
def test_a_ddp_1bit_trial_compresses_in_its_timed_steps(strategy: Any, want: dict[str, Any]) -> None:
    # ddp_1bit's own warm-up ("auto": >= 10 fp32 steps) would cover almost all of a 3 + 12 step trial: the lever was
    # kept or rejected on plain DDP's time (and its losses matched the baseline's exactly)
    from lightning_accel.tune.runner import _trial_job

    job = {"trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy}, "model": {"class_path": "m.M"}}
    trial = _trial_job(job, warmup=3, steps=12, root="r", save=False)
    s = trial["trainer"]["strategy"]
    assert s["class_path"].endswith("OneBitDDPStrategy") and s["init_args"] == want
    assert job["trainer"]["strategy"] == strategy  # the job itself (what tuned.yaml is written from) is unchanged
    plain = _trial_job({**job, "trainer": {"strategy": "ddp"}}, warmup=3, steps=12, root="r", save=False)
    assert plain["trainer"]["strategy"] == "ddp"


def test_the_breakdown_amortises_the_trials_saves_as_the_step_time_does(tmp_path: Path) -> None:
    # a job saving once per epoch of 64 steps: the trial's two saves (the untimed warm-up one included) counted raw
    # over its few timed steps read as a checkpoint-bound job, and the verdict sent the tune to the checkpoint lever
    job = _job(n=1024, enable_checkpointing=True)
    m = run_trial(job, warmup=2, steps=4, root=tmp_path)
    assert m.error is None and m.save_s > 0
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
