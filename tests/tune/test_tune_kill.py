"""``lightning-accel tune`` killed from outside (SIGTERM, SIGINT) in the middle of a trial, as a shell or a scheduler
does: the right exit status, nothing written, no trial folder or temporary file left, no process left behind (the
trial's DataLoader workers among them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from tests import tiny
from tests.helpers import default_ctrl_c


class SlowWorkers(tiny.TinyDigits):
    """The tiny digits through 2 DataLoader workers (processes a kill must not leave behind)."""

    def train_dataloader(self) -> DataLoader:
        base = super().train_dataloader()
        return DataLoader(base.dataset, batch_size=self.batch_size, num_workers=2, persistent_workers=True)


class MarkRunning(Callback):
    """Writes ``path`` at the first training batch, then makes each batch slow, so that the kill lands mid-trial."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        Path(self.path).write_text("running")
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "sigint"])
def test_a_tune_killed_mid_trial_leaves_nothing_behind(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    marker = tmp_path / "running"
    job = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "enable_checkpointing": False,
            "callbacks": [{"class_path": f"{__name__}.MarkRunning", "init_args": {"path": str(marker)}}],
        },
        "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
        "data": {"class_path": f"{__name__}.SlowWorkers", "init_args": {"batch_size": 16, "n": 256}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    out.mkdir()
    argv = ["tune", "--config", "job.yaml", "--budget", "5m", "--out", "out/tuned.yaml", "--warmup", "2"]
    argv += ["--steps", "6", "--levers", "precision", "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    # a session of its own: every process the tune starts (the workers) is in its group, found after the kill
    p = subprocess.Popen(
        [sys.executable, "-m", "lightning_accel.cli", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_ctrl_c,  # the Ctrl-C sent below reaches it however the tests were started
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), p.communicate(timeout=60)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "lightning-accel tune: terminated" if code == 143 else "lightning-accel tune: interrupted"
    )
    deadline = time.monotonic() + 30  # the workers notice their parent is gone within their watchdog's interval
    while _group_alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(p.pid), "a process of the tune outlived it"
    assert sorted(q.name for q in out.iterdir()) == []  # no tuned.yaml, no report, no .tune-* folder, no .tmp
    assert not (tmp_path / "cache").exists()
