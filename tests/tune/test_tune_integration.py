"""``lightning-accel tune`` end to end on a tiny job: trials, tuned.yaml that ``fit`` runs unchanged, the reports, the
cache; and under 2 gloo processes every rank takes the same decisions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_accel.cli import main
from lightning_accel.models import ImageClassifier
from tests.helpers import run_in_processes

JOB: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 2,
    },
    "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4, "lr": 0.01}},
    "data": {"class_path": "tests.tiny.TinyDigits", "init_args": {"batch_size": 16, "n": 128}},
}


def test_tune_cli_writes_a_config_fit_runs_and_a_second_tune_is_cached(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "out").mkdir()
    mine = tmp_path / "out" / "notes.txt"
    mine.write_bytes(b"the user's file")
    argv = [
        "tune",
        "--config",
        "job.yaml",
        "--budget",
        "60s",
        "--out",
        "out/tuned.yaml",
        "--warmup",
        "2",
        "--steps",
        "4",
        "--levers",
        "checkpoint",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    report = json.loads((tmp_path / "out" / "tune_report.json").read_text())
    trials = report["trials"]
    assert [t["decision"] for t in trials][0] == "baseline"
    assert [t["name"] for t in trials[1:]] == [
        "checkpoint: DeltaCheckpointIO(async_save=False)",
        "checkpoint: DeltaCheckpointIO(async_save=True)",
    ]
    for t in trials:
        assert t["step_s"] > 0 and len(t["losses"]) == 7 and t["breakdown"]["compute"] > 0
        assert t["decision"] in ("baseline", "kept", "rejected") and t["reason"]
    assert all(t["numerics"]["ok"] for t in trials[1:])  # checkpoint IO does not change the loss
    tuned = yaml.safe_load((tmp_path / "out" / "tuned.yaml").read_text())
    assert tuned["trainer"]["callbacks"][-1] == {"class_path": "lightning_accel.callbacks.RollbackGuard"}
    assert tuned["model"] == JOB["model"] and tuned["trainer"]["max_epochs"] == 1
    md = (tmp_path / "out" / "tune_report.md").read_text()
    assert "| baseline |" in md and "decision" in md
    assert (tmp_path / "out" / "tune_report.png").read_bytes()[:4] == b"\x89PNG"
    assert mine.read_bytes() == b"the user's file"
    assert not any(p.name.startswith(".tune-") for p in (tmp_path / "out").iterdir())  # the trials' work dir: gone

    # the same job again: read from the cache, no trial runs
    (tmp_path / "out" / "tuned.yaml").unlink()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    again = json.loads((tmp_path / "out" / "tune_report.json").read_text())
    assert again["cached"] is True and again["seconds"] < 1.0
    assert yaml.safe_load((tmp_path / "out" / "tuned.yaml").read_text()) == tuned

    # `fit` runs the written config unchanged
    main(["fit", "--config", "out/tuned.yaml"])
    assert list((tmp_path / "checkpoints").iterdir())  # Lightning's default ModelCheckpoint, through the tuned IO


def test_tune_cli_refuses_a_bad_budget_in_one_line(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    with pytest.raises(SystemExit) as e:
        main(["tune", "--config", str(tmp_path / "job.yaml"), "--budget", "soon"])
    assert e.value.code == 2
    assert "`--budget` must be a duration such as 90s, 5m or 1h, got 'soon'" in capsys.readouterr().err


def _tune_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning_accel.tune import tune_job

    job = json.loads(json.dumps(JOB))
    job["trainer"].update(devices=2, strategy="ddp")
    res = tune_job(
        job,
        budget="40s",
        out=f"{root}/tuned.yaml",
        warmup=2,
        steps=4,
        levers=["precision"],
        cache_dir=f"{root}/cache",
        verbose=False,
    )
    return {
        "decisions": [(t.name, t.decision, t.reason) for t in res.trials],
        "step_s": [t.step_s for t in res.trials],
        "chosen": res.chosen,
        "config": res.config,
    }


def test_every_rank_takes_rank_zeros_decisions_under_two_gloo_processes(tmp_path: Path) -> None:
    ranks = run_in_processes(_tune_rank, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert ranks[0]["chosen"] == ranks[1]["chosen"] and ranks[0]["config"] == ranks[1]["config"]
    assert ranks[0]["step_s"] == ranks[1]["step_s"]  # the slowest rank's time, on both
    names = [d[0] for d in ranks[0]["decisions"]]
    assert names[0] == "baseline" and len(names) > 1
    assert all(n.startswith(("precision: ", "strategy: ")) for n in names[1:])  # the levers the test allows
    assert (tmp_path / "tuned.yaml").is_file()


class OneRankFault(ImageClassifier):
    """The tiny job's classifier, whose training step raises an out-of-memory on rank ``rank`` alone, at step ``at``,
    when the trial runs on the strategy class ``strategy`` (the other ranks then wait in the step's all-reduce)."""

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 4,
        blocks: tuple[int, ...] = (1, 1, 1),
        lr: float = 0.01,
        weight_decay: float = 5e-4,
        rank: int = 1,
        strategy: str = "OneBitDDPStrategy",
        at: int = 2,
    ) -> None:
        super().__init__(num_classes, width, blocks, lr, weight_decay)  # all of them: its hyper-parameters
        self.fault_rank, self.fault_strategy, self.fault_at = rank, strategy, at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        t = self.trainer
        here = t.global_rank == self.fault_rank and type(t.strategy).__name__ == self.fault_strategy
        if here and t.global_step == self.fault_at:
            raise torch.OutOfMemoryError("out of memory on this rank alone")
        return super().training_step(batch, batch_idx)


def _tune_with_a_fault_on_rank_one(rank: int, world: int, root: str) -> list[tuple[str, str, str, float | None]]:
    from lightning_accel.tune import tune_job

    job = json.loads(json.dumps(JOB))
    job["trainer"].update(devices=2, strategy="ddp")
    job["model"] = {"class_path": f"{__name__}.OneRankFault", "init_args": {"width": 4}}
    res = tune_job(
        job,
        budget="2m",
        out=f"{root}/tuned.yaml",
        warmup=2,
        steps=3,
        levers=["strategy", "precision"],
        skip=["Fused", "Auto"],  # ddp_1bit (the fault), then bf16-mixed on the group made again
        cache_dir=f"{root}/cache",
        verbose=False,
    )
    return [(t.name, t.decision, t.reason, t.step_s) for t in res.trials]


def test_a_trial_that_fails_on_one_rank_fails_on_every_rank_and_the_tune_goes_on(tmp_path: Path) -> None:
    # before: rank 0 waited in the step's all-reduce for rank 1, which had left the trial (30 minutes, then out of step)
    ranks = run_in_processes(_tune_with_a_fault_on_rank_one, 2, (str(tmp_path),), init_process_group=False, timeout=150)
    assert ranks[0] == ranks[1]
    trials = {name: (decision, reason, step) for name, decision, reason, step in ranks[0]}
    decision, reason, step = trials["strategy: ddp_1bit"]
    assert decision == "rejected" and step is None
    assert reason == "trial failed: out of memory: out of memory on this rank alone (on rank 1)"
    decision, reason, step = trials["precision: bf16-mixed"]  # the next lever ran on both ranks, on a sound group
    assert decision in ("kept", "rejected") and step is not None and not reason.startswith("trial failed")
    assert (tmp_path / "tuned.yaml").is_file()
