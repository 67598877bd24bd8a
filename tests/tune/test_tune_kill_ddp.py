"""``lightning-accel tune`` of a 2-process job (``devices: 2``, gloo) stopped from outside: the signal reaches rank 0
only (``kill`` of the command's process, as a scheduler or a shell does), yet every rank's process ends within
seconds, the exit status is the signal's, and nothing is written."""

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

from tests.helpers import default_ctrl_c


class MarkRunning(Callback):
    """Writes ``path`` (rank 0) at a training batch of the trial numbered ``trial`` (counted by fits in this process),
    then makes each batch slow, so that the kill lands mid-trial; with ``after``, at the end of that trial instead,
    once Lightning has put its signal handlers back (on rank 0, which then waits: the kill lands between trials,
    while rank 1 goes on to the tune's next step)."""

    fits = 0

    def __init__(self, path: str, trial: int = 0, after: bool = False) -> None:
        self.path, self.trial, self.after = path, trial, after

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.after and trainer.global_rank == 0 and type(self).fits > self.trial:
            Path(self.path).write_text(str(os.getpid()))
            time.sleep(3.0)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        type(self).fits += 1

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.after and trainer.global_rank == 0 and type(self).fits > self.trial:
            Path(self.path).write_text(str(os.getpid()))
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# Two of the four combinations (each a 2-process tune, ~12 s): each signal once, each moment once; the SIGTERM between
# trials is the case that left the other rank failing on the closed connection.
@pytest.mark.parametrize(
    ("sig", "code", "after"),
    [(signal.SIGTERM, 143, True), (signal.SIGINT, 130, False)],
    ids=["sigterm-between-trials", "sigint-mid-trial"],
)
def test_a_two_process_tune_killed_on_rank_zero_ends_every_rank(
    tmp_path: Path, sig: signal.Signals, code: int, after: bool
) -> None:
    marker = tmp_path / "running"
    job = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_epochs": 1,
            "enable_checkpointing": False,
            "callbacks": [
                {"class_path": f"{__name__}.MarkRunning", "init_args": {"path": str(marker), "after": after}}
            ],
        },
        "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
        "data": {"class_path": "tests.tiny.TinyDigits", "init_args": {"batch_size": 16, "n": 256}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    out.mkdir()
    argv = ["tune", "--config", "job.yaml", "--budget", "5m", "--out", "out/tuned.yaml", "--warmup", "2"]
    argv += ["--steps", "8", "--levers", "precision", "--skip", "Fused", "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    # a session of its own: every process the tune starts (rank 1) is in its group, found after the kill
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
        deadline = time.monotonic() + 240
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), p.communicate(timeout=60)
        p.send_signal(sig)  # rank 0 alone, as `kill` does
        _, err = p.communicate(timeout=60)
        assert p.returncode == code, err[-3000:]
        deadline = time.monotonic() + 20
        while _group_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(p.pid), f"a rank of the tune outlived it: {err[-3000:]}"
    finally:
        if _group_alive(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    # one last line, rank 0's: no other rank failed on its closed connection after it (a traceback, an `error:` line)
    assert err.strip().splitlines()[-1] == (
        "lightning-accel tune: terminated" if code == 143 else "lightning-accel tune: interrupted"
    ), err[-3000:]
    assert "error:" not in err and "Connection was likely closed" not in err, err[-3000:]
    assert sorted(q.name for q in out.iterdir()) == [], err[-3000:]  # nothing written, no .tune-* folder, no .tmp
    assert not (tmp_path / "cache").exists()
