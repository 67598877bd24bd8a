"""``--steps`` / ``--warmup`` whose baseline trial cannot end within ``--budget``: the tune stops after the baseline's
first steps with one line giving the numbers and the fix, instead of running past its budget."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_accel.tune.cli import main
from tests.tune.test_tune_integration import JOB


class SlowSteps(Callback):
    """Makes every training batch take at least 50 ms."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        time.sleep(0.05)


def test_steps_that_cannot_fit_the_budget_stop_the_tune_in_one_line(tmp_path: Path, capsys: Any) -> None:
    job: dict[str, Any] = yaml.safe_load(yaml.safe_dump(JOB))
    job["trainer"]["callbacks"] = [{"class_path": f"{__name__}.SlowSteps"}]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    argv = ["--config", str(tmp_path / "job.yaml"), "--budget", "10s", "--out", str(tmp_path / "out" / "tuned.yaml")]
    argv += ["--warmup", "2", "--steps", "1000", "--levers", "precision", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2  # 1003 steps of >= 50 ms: over 50 s for the baseline alone
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lightning-accel tune: error: `--steps 1000` (after `--warmup 2`) does not fit in "), err
    assert "`--budget 10s`" in err and "1000 steps left at" in err and "Lower `--steps`" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
