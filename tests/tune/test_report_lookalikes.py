"""``tune`` replaces only the reports it can prove it wrote: a user's JSON or PNG that merely looks like one (a JSON
with ``fingerprint`` and ``trials`` keys, any PNG beside a report) is refused, while reports of earlier versions of
``tune`` (no marker yet) are still recognised by their exact structure."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.tune import tuner

matplotlib = pytest.importorskip("matplotlib")


def _old_trial(name: str, decision: str) -> dict[str, Any]:
    """A trial as reports written before the report marker recorded it."""
    return {
        "name": name,
        "lever": name.split(":")[0],
        "changes": {},
        "step_s": 0.1,
        "ref_step_s": 0.1,
        "breakdown": {},
        "dominant": "compute",
        "verdict": "",
        "losses": [2.3, 2.1],
        "numerics": None,
        "peak_mem_bytes": None,
        "memory_ok": True,
        "decision": decision,
        "reason": "",
        "seconds": 1.0,
        "error": None,
    }


def _old_report(n_trials: int = 3) -> dict[str, Any]:
    trials = [_old_trial("baseline", "baseline")] + [
        _old_trial(f"precision: x{i}", "rejected") for i in range(1, n_trials)
    ]
    return {
        "fingerprint": "0123456789abcdef",
        "cached": False,
        "seconds": 3.0,
        "budget_s": 600.0,
        "chosen": {},
        "trials": trials,
    }


def _png(width_in: float, height_in: float, **kw: Any) -> bytes:
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in))
    fig.add_subplot(1, 1, 1).bar([0, 1], [1.0, 2.0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, **kw)
    return buf.getvalue()


def _refused(out: Path, name: str) -> None:
    with pytest.raises(ValueError, match="did not write") as e:
        tuner.check_outputs(out)
    assert name in str(e.value) and "\n" not in str(e.value)
    tuner.check_outputs(out, force=True)  # `force` still replaces it


def test_a_users_json_with_fingerprint_and_trials_keys_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "tune_report.json").write_text(json.dumps({"fingerprint": "my-run-7", "trials": [1, 2], "notes": "x"}))
    _refused(tmp_path / "tuned.yaml", "tune_report.json")
    # the old report's keys, but not its values: not provably tune's either
    look_alike = {**_old_report(), "fingerprint": "my run", "trials": ["a", "b"]}
    (tmp_path / "tune_report.json").write_text(json.dumps(look_alike))
    _refused(tmp_path / "tuned.yaml", "tune_report.json")


def test_a_users_png_beside_an_old_report_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "tune_report.json").write_text(json.dumps(_old_report()))
    (tmp_path / "tune_report.png").write_bytes(_png(8.0, 5.0))  # the user's own chart
    _refused(tmp_path / "tuned.yaml", "tune_report.png")


def test_a_png_claiming_the_marker_outside_its_text_chunk_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "tune_report.png").write_bytes(_png(6.0, 4.2, metadata={"Title": "notes on lightning-accel tune"}))
    _refused(tmp_path / "tuned.yaml", "tune_report.png")


def test_reports_of_earlier_versions_and_current_ones_are_still_replaced(tmp_path: Path) -> None:
    (tmp_path / "tune_report.json").write_text(json.dumps(_old_report(3), indent=1))
    (tmp_path / "tune_report.png").write_bytes(_png(6.0, 4.2))  # what the old report_png drew for 3 trials
    tuner.check_outputs(tmp_path / "tuned.yaml")
    (tmp_path / "tune_report.json").write_text(json.dumps(_old_report(9), indent=1))
    (tmp_path / "tune_report.png").write_bytes(_png(0.7 * 9 + 2, 4.2))
    tuner.check_outputs(tmp_path / "tuned.yaml")
    (tmp_path / "tune_report.png").write_bytes(_png(6.0, 4.2, metadata={"Software": "lightning-accel tune"}))
    tuner.check_outputs(tmp_path / "tuned.yaml")
