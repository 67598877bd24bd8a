"""The comma-separated flags of ``lightning-accel tune`` (``--levers``, ``--skip``) read alike: an empty entry (a
leading, trailing or doubled comma) is refused in one line naming the flag, the value and the fix, before any trial."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.tune import tuner
from lightning_accel.tune.cli import main
from lightning_accel.tune.runner import TrialMeasure

JOB: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1},
    "model": {"class_path": "lightning_accel.models.ImageClassifier", "init_args": {"width": 4}},
}


@pytest.fixture
def trials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    seen: list[str] = []

    def fake(job: dict[str, Any], *, warmup: int, steps: int, root: str | Path) -> TrialMeasure:
        seen.append("trial")
        m = TrialMeasure()
        m.step_s, m.losses, m.seconds, m.dominant = 0.1, [2.3, 2.1, 1.9, 1.8, 1.7, 1.6], 1.0, "compute"
        return m

    monkeypatch.setattr(tuner, "run_trial", fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(json.dumps(JOB))
    return seen


BASE = ["--config", "job.yaml", "--out", "tuned.yaml", "--cache-dir", "cache", "--no-cache", "--warmup", "2"]


@pytest.mark.parametrize(
    ("flags", "flag", "value", "fix"),
    [
        (["--levers", "precision,", "--skip", "Fused"], "--levers", "precision,", "`--levers precision`"),
        (["--levers", ",precision", "--skip", "Fused"], "--levers", ",precision", "`--levers precision`"),
        (["--levers", "precision,,data", "--skip", "Fused"], "--levers", "precision,,data", "`--levers precision`"),
        (["--levers", "precision", "--skip", "compile,"], "--skip", "compile,", "`--skip compile`"),
        (["--levers", "precision", "--skip", "Fused, ,compile"], "--skip", "Fused, ,compile", "`--skip compile`"),
    ],
    ids=["levers-trailing", "levers-leading", "levers-doubled", "skip-trailing", "skip-blank"],
)
def test_an_empty_entry_is_refused_alike_by_levers_and_skip(
    flags: list[str], flag: str, value: str, fix: str, trials: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BASE, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"`{flag}`" in err and repr(value) in err and "empty entry" in err and fix in err, err
    assert trials == [] and not Path("tuned.yaml").exists()


def test_entries_with_spaces_around_the_commas_are_read(trials: list[str]) -> None:
    assert main([*BASE, "--levers", " precision ", "--skip", "Fused , compile"]) == 0
    assert trials and Path("tuned.yaml").is_file()


@pytest.mark.parametrize("word", [" ", "\t", ""])
def test_a_blank_skip_word_from_python_is_refused_not_matched_against_every_name(
    word: str, trials: list[str], tmp_path: Path
) -> None:
    # every option name holds a space ("precision: bf16-mixed"): a blank word left out every option without a word
    with pytest.raises(
        ValueError, match=r"`skip` must hold non-blank words of option names, got '[^']*'\. Pass e.g."
    ) as e:
        tuner.tune_job(JOB, out=None, levers=["precision"], skip=["Fused", word], cache_dir=tmp_path, verbose=False)
    assert "\n" not in str(e.value) and trials == []
