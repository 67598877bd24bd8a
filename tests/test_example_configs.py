"""Every config in ``examples/configs`` runs as a user runs it (``lightning-accel fit --config ...``), briefly.

The configs with a test of their own (the quickstart, the 1-bit quickstart, all plugins, the recipes) run there; this
file runs the others for a few steps and checks that no config is left without a test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "configs"
_SHORT = [
    "--trainer.max_steps=3",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def _fit(cwd: Path, config: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lightning-accel")
    cmd = [exe] if exe else [sys.executable, "-m", "lightning_accel.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)  # a rank variable would make the command an externally launched rank that waits forever
    env["MASTER_PORT"] = str(free_port())
    argv = [*cmd, "fit", "--config", str(CONFIGS / config), *_SHORT, *args]
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_the_fused_quickstart_fuses_and_saves(tmp_path: Path) -> None:
    out = _fit(tmp_path, "quickstart_fused.yaml")
    assert "coverage: 10/10 eligible modules fused" in out.stdout + out.stderr
    assert (tmp_path / "runs" / "quickstart_fused" / "checkpoints" / "last.ckpt").is_file()


def test_the_photo_recipe_runs_on_two_processes(tmp_path: Path) -> None:
    _fit(tmp_path, "photos_all_plugins.yaml", "--data.init_args.num_images=200")
    run = tmp_path / "runs" / "photos"
    assert (run / "checkpoints" / "last.ckpt").read_bytes()[:1] == b"{"  # a DeltaCheckpointIO manifest
    report = json.loads((run / "lightning_logs" / "version_0" / "perf_report.json").read_text())
    assert report["extras"]["world_size"] == 2


def test_every_example_config_has_a_test() -> None:
    tests = [p.read_text(encoding="utf-8") for p in Path(__file__).resolve().parent.rglob("test_*.py")]
    untested = [c.name for c in sorted(CONFIGS.glob("*.yaml")) if not any(c.name in t for t in tests)]
    assert not untested, f"example configs that no test runs: {untested}"


@pytest.mark.parametrize("config", sorted(c.name for c in CONFIGS.glob("*.yaml")))
def test_every_example_config_names_its_command(config: str) -> None:
    # the header says how to run it, with its own path (a renamed file would otherwise keep a stale command)
    assert f"examples/configs/{config}" in (CONFIGS / config).read_text(encoding="utf-8")
