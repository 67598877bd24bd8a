"""The tune loop with a scripted trial runner: which trials it runs and what it decides (no training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accel.tune import tuner
from lightning_accel.tune.levers import job_precision
from lightning_accel.tune.runner import TrialMeasure

LOSSES = [2.3, 2.1, 1.9, 1.8, 1.7, 1.6, 1.5, 1.45, 1.4, 1.35, 1.3, 1.25]
JOB: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1},
    "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
}


def _script(times: list[float]) -> tuple[list[str], Any]:
    """A ``run_trial`` that returns ``times`` in order and records each trial's precision."""
    seen: list[str] = []
    left = list(times)

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        m = TrialMeasure()
        m.step_s, m.losses, m.seconds, m.dominant = left.pop(0), list(LOSSES), 1.0, "compute"
        seen.append(job_precision(job))
        return m

    return seen, fake


def _tune(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, times: list[float]) -> tuple[list[str], tuner.TuneResult]:
    seen, fake = _script(times)
    monkeypatch.setattr(tuner, "run_trial", fake)
    res = tuner.tune_job(
        JOB,
        budget="10m",
        out=None,
        levers=["precision"],
        skip=["Fused"],  # the one option left: bf16-mixed
        use_cache=False,
        cache_dir=tmp_path,
        verbose=False,
    )
    return seen, res


def test_a_candidate_is_compared_with_the_best_job_measured_around_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the baseline ran under load (100 ms); the candidate (90 ms) beats that stale time by 10 %, but the baseline's
    # trial right after it takes 82 ms: against the mean of the two (91 ms) the candidate is only 1 % faster
    seen, res = _tune(monkeypatch, tmp_path, [0.100, 0.090, 0.082])
    assert seen == ["32-true", "bf16-mixed", "32-true"]  # baseline, candidate, the best job again
    trial = res.trials[1]
    assert trial.ref_step_s == pytest.approx(0.091)
    assert trial.decision == "rejected" and "only 1.1 % faster" in trial.reason
    assert res.chosen == {}


def test_a_candidate_that_holds_its_gain_against_the_fresh_time_is_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen, res = _tune(monkeypatch, tmp_path, [0.100, 0.080, 0.098])
    assert len(seen) == 3
    assert res.trials[1].ref_step_s == pytest.approx(0.099) and res.trials[1].decision == "kept"
    assert res.chosen == {"precision": res.trials[1].name}


def test_the_grid_keeps_each_rows_fastest_round_and_gives_a_twin_extra_its_rows_times(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # rows: as configured, bf16-mixed; extras: the bf16 job again (a twin, not measured) and an fp64 job (measured)
    seen, fake = _script([0.100, 0.080, 0.300, 0.300, 0.070, 0.090])
    monkeypatch.setattr(tuner, "run_trial", fake)
    bf16 = tuner._options("precision", JOB, ["Fused"])[0].apply(JOB)
    other = {**JOB, "trainer": {**JOB["trainer"], "precision": "64-true"}}
    rows = tuner.exhaustive(
        JOB, ["precision"], skip=["Fused"], rounds=2, extra={"tuned": bf16, "other": other}, root=tmp_path / "g"
    )
    assert seen == ["32-true", "bf16-mixed", "64-true", "64-true", "bf16-mixed", "32-true"]  # forward, then back
    plain, fast, twin, odd = rows
    assert plain["step_s"] == 0.090 and fast["step_s"] == 0.070 and odd["step_s"] == 0.300
    assert twin["same_as"] == ["precision: bf16-mixed"] and twin["step_s"] == 0.070 and twin["runs"] == [0.080, 0.070]
