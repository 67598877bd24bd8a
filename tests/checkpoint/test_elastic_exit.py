"""``ElasticExit``: a worker that torchrun stops exits at once (143); outside torchrun Lightning's handler stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel.checkpoint import ElasticExit
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]

# One process, one fit; at its third step the process sends itself SIGTERM, as torchrun's agent does to the
# survivors of a group whose peer died, then sleeps.
_JOB = """
import os, signal, sys, time
import lightning as L
from lightning_accel.checkpoint import ElasticExit
from tests.tiny import CheckpointModel, tiny_loader

class Stop(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(float(sys.argv[1]))

callbacks = [Stop()] + ([ElasticExit()] if sys.argv[2] == "1" else [])
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
trainer.fit(CheckpointModel(), tiny_loader())
print("FINISHED", trainer.received_sigterm, flush=True)
"""


def _run(elastic_env: bool, with_callback: bool, sleep_s: float) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = str(REPO)
    if elastic_env:  # what torchrun sets in each worker (a one-process group)
        env.update(
            TORCHELASTIC_RUN_ID="test",
            RANK="0",
            GROUP_RANK="0",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    proc = subprocess.run(
        [sys.executable, "-c", _JOB, str(sleep_s), "1" if with_callback else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_under_torchrun_sigterm_ends_the_worker_at_once() -> None:
    code, out = _run(elastic_env=True, with_callback=True, sleep_s=60.0)
    assert code == 128 + signal.SIGTERM, out[-2000:]
    assert "FINISHED" not in out


@pytest.mark.slow
def test_outside_torchrun_lightnings_handler_is_kept() -> None:
    # Lightning's own handler took the signal (it logs it and ends the fit its way), not ElasticExit's immediate exit
    code, out = _run(elastic_env=False, with_callback=True, sleep_s=0.1)
    assert code != 128 + signal.SIGTERM, out[-2000:]
    assert "Received SIGTERM" in out


def test_teardown_leaves_a_handler_others_installed_alone() -> None:
    cb = ElasticExit()
    before = signal.getsignal(signal.SIGTERM)
    cb.teardown(None, None, "fit")  # type: ignore[arg-type]  # never installed: nothing to restore
    assert signal.getsignal(signal.SIGTERM) is before
