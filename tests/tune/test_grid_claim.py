"""The exhaustive grid's trial folder ``.tune-grid-<hash>`` is claimed like a tune's: a second grid of the same job
in the same folder is refused instead of deleting the first's live trials, and a folder a killed grid left is taken
over (or swept by a later grid of another job)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.tune import tuner
from lightning_accel.tune.runner import TrialMeasure

LOSSES = [2.3, 2.1, 1.9, 1.8, 1.7, 1.6, 1.5, 1.45, 1.4, 1.35, 1.3, 1.25]
JOB: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1},
    "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
}


def _measure() -> TrialMeasure:
    m = TrialMeasure()
    m.step_s, m.losses, m.seconds, m.dominant = 0.1, list(LOSSES), 1.0, "compute"
    return m


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _grid(root: Path, job: dict[str, Any] = JOB) -> list[dict[str, Any]]:
    return tuner.exhaustive(job, ["precision"], skip=["Fused"], rounds=1, root=root)


def test_a_second_grid_of_the_same_job_is_refused_and_leaves_the_first_ones_trials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # two grids of one job in one folder shared `.tune-grid-<hash>`, and the first to end deleted the other's live
    # trials (their checkpoints, their data cache) under it
    outcomes: list[str] = []
    inner_trials: list[Path] = []

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / "trial.ckpt").write_text("a live trial's file")
        inner_trials.append(Path(root))
        if len(inner_trials) == 1:  # while the first grid runs its first trial, a second grid of the same job starts
            try:
                _grid(tmp_path)
                outcomes.append("ran")
            except ValueError as e:
                outcomes.append(str(e))
            assert (Path(root) / "trial.ckpt").is_file(), "the second grid deleted the first one's live trial"
        return _measure()

    monkeypatch.setattr(tuner, "run_trial", fake)
    assert len(_grid(tmp_path)) == 2
    assert len(outcomes) == 1 and outcomes[0] != "ran"
    line = outcomes[0]
    assert "\n" not in line and ".tune-grid-" in line and f"pid {os.getpid()}" in line and "`root`" in line, line
    assert not any(p.name.startswith(".tune-grid-") for p in tmp_path.iterdir())  # the first grid cleaned up


def test_a_grid_folder_a_killed_grid_left_is_taken_over_and_another_jobs_is_swept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tuner, "run_trial", lambda job, **kw: _measure())
    dead = {"written_by": "lightning-accel tune", "host": platform.node(), "pid": _dead_pid(), "start": "1"}
    other = {**JOB, "trainer": {**JOB["trainer"], "max_epochs": 2}}
    # a killed grid of another job: its folder, claimed by a process that no longer runs
    left = tmp_path / ".tune-grid-0123456789ab"
    (left / "g0").mkdir(parents=True)
    (left / "owner-node0.json").write_text(json.dumps(dead))
    users = tmp_path / ".tune-grid-ba9876543210"  # named like one, claimed by no grid: the user's
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    assert len(_grid(tmp_path, other)) == 2
    assert not left.exists() and (users / "notes.txt").read_text() == "mine"
    # a killed grid of this job: its folder is this grid's to take over, not a reason to refuse
    seen: list[Path] = []
    monkeypatch.setattr(tuner, "run_trial", lambda job, *, root, **kw: seen.append(Path(root)) or _measure())
    assert len(_grid(tmp_path)) == 2
    work = seen[0].parent
    work.mkdir()
    (work / "owner-node0.json").write_text(json.dumps(dead))
    (work / "g0").mkdir()
    assert len(_grid(tmp_path)) == 2
    assert not work.exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rounds": 0}, "`rounds` must be an integer >= 1, got 0"),
        ({"warmup": 0}, "`warmup` must be an integer >= 1, got 0"),
        ({"steps": 2}, "`steps` must be an integer >= 3, got 2"),
        ({"k": 0}, "`k` must be an integer >= 1, got 0"),
        ({"root": "FILE"}, "`root` '.*notes.txt' cannot hold the grid's trial folder: .* is a file, not a folder"),
    ],
)
def test_the_grid_checks_its_arguments_before_any_trial(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    # `rounds=0` measured nothing and returned rows without a time; a `root` that is a file failed with a bare
    # NotADirectoryError from deep inside
    ran: list[str] = []
    monkeypatch.setattr(tuner, "run_trial", lambda job, **kw: ran.append("trial") or _measure())
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    args: dict[str, Any] = {"rounds": 1, "root": tmp_path / "g", **kwargs}
    if args["root"] == "FILE":
        args["root"] = notes
    with pytest.raises((ValueError, TypeError), match=match) as e:
        tuner.exhaustive(JOB, ["precision"], skip=["Fused"], **args)
    assert "\n" not in str(e.value) and not ran and notes.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
