"""``out`` that is a symbolic link to a tuned config: the tune writes through the link, which stays a link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lightning_accel.tune import tuner
from tests.tune.test_tuner import JOB, _script


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="symbolic links")
def test_out_that_is_a_link_is_written_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs, here = tmp_path / "runs", tmp_path / "current"
    runs.mkdir()
    here.mkdir()
    _, fake = _script([0.1, 0.2, 0.1] * 2)
    monkeypatch.setattr(tuner, "run_trial", fake)
    kwargs = {"budget": "10m", "levers": ["precision"], "skip": ["Fused"], "use_cache": False, "verbose": False}
    tuner.tune_job(JOB, out=runs / "tuned.yaml", cache_dir=tmp_path / "c1", **kwargs)
    first = (runs / "tuned.yaml").read_text()
    link = here / "tuned.yaml"
    link.symlink_to(Path("..") / "runs" / "tuned.yaml")
    os.chmod(runs / "tuned.yaml", 0o640)
    _, fake = _script([0.1, 0.05, 0.1])  # a new result: the precision option is kept this time
    monkeypatch.setattr(tuner, "run_trial", fake)
    res = tuner.tune_job(JOB, out=link, cache_dir=tmp_path / "c2", **kwargs)
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "runs", "tuned.yaml")
    text = (runs / "tuned.yaml").read_text()
    assert text != first and "kept: precision" in text.splitlines()[0]
    assert (runs / "tuned.yaml").stat().st_mode & 0o777 == 0o640  # the target replaced, its mode kept
    assert res.paths["tuned"] == str(link)
    # the reports go beside `out` as given, and name it
    assert json.loads((here / "tune_report.json").read_text())["tuned"] == "tuned.yaml"
    assert not [p.name for p in (*runs.iterdir(), *here.iterdir()) if p.name.endswith(".tmp")]
