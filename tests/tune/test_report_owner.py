"""The reports ``tune_report.{json,md,png}`` beside ``out`` belong to the tuned config written with them: a tune with
another ``out`` in the same folder refuses to replace them (its own config would sit beside a report of another
job's config), and the same ``out`` tuned again replaces them as before."""

from __future__ import annotations

import json
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
OTHER: dict[str, Any] = {**JOB, "trainer": {**JOB["trainer"], "max_epochs": 2}}
KW: dict[str, Any] = {"levers": ["precision"], "skip": ["Fused"], "use_cache": False, "verbose": False}


def _fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
    m = TrialMeasure()
    m.step_s, m.losses, m.seconds, m.dominant = 0.1, list(LOSSES), 1.0, "compute"
    return m


def test_a_tune_with_another_out_does_not_replace_the_reports_of_a_tuned_config_beside_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tuner, "run_trial", _fake)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first = tuner.tune_job(JOB, out=a, cache_dir=tmp_path / "c", **KW)
    report = Path(first.paths["json"])
    mine = report.read_bytes()
    assert json.loads(mine)["fingerprint"] == first.fingerprint
    # the second tune wrote its reports over the first one's: a.yaml stayed beside a report of b.yaml's job
    with pytest.raises(ValueError, match="refusing to overwrite it") as e:
        tuner.tune_job(OTHER, out=b, cache_dir=tmp_path / "c", **KW)
    line = str(e.value)
    assert "\n" not in line and "a.yaml" in line and "tune_report.json" in line, line
    assert report.read_bytes() == mine and not b.exists()
    # the same `out` tuned again replaces its own reports, and `force` replaces another config's
    again = tuner.tune_job(JOB, out=a, cache_dir=tmp_path / "c", **KW)
    assert json.loads(report.read_text())["fingerprint"] == again.fingerprint
    forced = tuner.tune_job(OTHER, out=b, cache_dir=tmp_path / "c", force=True, **KW)
    assert json.loads(report.read_text())["fingerprint"] == forced.fingerprint and b.is_file()
    # once the config the reports belong to is gone, they are any tune's to replace
    b.unlink()
    last = tuner.tune_job(JOB, out=tmp_path / "c.yaml", cache_dir=tmp_path / "c", **KW)
    assert json.loads(report.read_text())["tuned"] == "c.yaml" and last.paths["json"] == str(report)
