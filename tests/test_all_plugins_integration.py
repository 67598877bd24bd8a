"""``examples/configs/all_plugins.yaml`` as a user runs it: 2 CPU processes, 2 epochs, then validate, then a resume."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "configs" / "all_plugins.yaml"
_SMALL = [
    "--trainer.strategy.init_args.warmup_steps=2",  # compress from step 2: the short resumed fit compresses too
    # the config's "auto" measures loopback and keeps fp32; force 1-bit so the compressed state goes through resume
    "--trainer.strategy.init_args.compression=1bit",
    "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--data.init_args.num_images=400",
]


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lightning-accel")
    cmd = [exe] if exe else [sys.executable, "-m", "lightning_accel.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)  # a rank variable would make the command an externally launched rank that waits forever
    env["MASTER_PORT"] = str(free_port())  # a fresh port per launch: the previous launch's may still be held
    argv = [*cmd, args[0], "--config", str(CONFIG), *_SMALL, *args[1:]]  # overrides after the config
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_all_plugins_fit_validate_resume(tmp_path: Path) -> None:
    _cli(tmp_path, "fit", "--trainer.max_epochs=2")
    ckpts = tmp_path / "runs" / "all_plugins" / "checkpoints"
    assert (ckpts / "last.ckpt").read_bytes()[:1] == b"{"  # a DeltaCheckpointIO manifest
    logs = tmp_path / "runs" / "all_plugins" / "lightning_logs"
    assert (logs / "version_0" / "perf_report.json").is_file()
    val = _cli(tmp_path, "validate", f"--ckpt_path={ckpts / 'last.ckpt'}")
    assert "val_acc" in val.stdout + val.stderr
    _cli(tmp_path, "fit", "--trainer.max_epochs=3", "--ckpt_path=last")
    runs = sorted(p for p in logs.iterdir() if (p / "metrics.csv").is_file())
    rows = list(csv.DictReader((runs[-1] / "metrics.csv").read_text().splitlines()))
    steps = sorted({int(r["step"]) for r in rows if r.get("train_loss")})
    epochs = {int(r["epoch"]) for r in rows if r.get("val_acc")}
    assert epochs == {2}, rows  # the resumed fit ran the third epoch only ...
    assert steps and steps[0] >= 8  # ... starting after the 8 saved optimizer steps
    comm = [r for r in rows if r.get("comm/compression_ratio")]
    assert comm and float(comm[-1]["comm/compression_ratio"]) > 1.0  # 1-bit compression was active
