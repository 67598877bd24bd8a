"""SIGKILL a training subprocess at random moments during saves (local and moto S3): the latest complete
checkpoint loads and the next run resumes from it. ``benchmarks/checkpoint_kill.py --kills N`` runs it longer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.checkpoint_kill import kill_loop


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_saves_local(tmp_path: Path) -> None:
    result = kill_loop(str(tmp_path / "ckpt"), kills=2, seed=1, lightning=False)
    # A save survived the first kill, and the second run resumed from it (kill_loop checks the exact step).
    assert result["steps"][0] >= 1 and result["resumes"] == 1
    assert result["steps"] == sorted(result["steps"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_saves_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    result = kill_loop(f"s3://{bucket}/ckpt", kills=2, storage_options=opts, seed=2, lightning=False)
    assert result["steps"][0] >= 1 and result["resumes"] == 1 and result["checkpoints_verified"] >= 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkills_of_resumed_lightning_runs_leave_only_tracked_checkpoints() -> None:
    """Lightning runs with ``DeltaModelCheckpoint(save_top_k=2)`` killed and resumed from ``last``: what a killed run
    left untracked is removed by the next one, and every remaining checkpoint verifies
    (``benchmarks/_delta_faults.py`` runs 20 rounds)."""
    from benchmarks._delta_faults import orphan_case

    got = orphan_case(True, kills=3, seed=3)
    res = got["results"]["reconciled"]
    assert res["untracked_at_end"] == [] and res["checkpoints_verified"] >= 3, res
    assert res["resumed_steps"] == sorted(res["resumed_steps"]) and res["resumed_steps"][-1] > 0, res
    assert got["ratios"]["orphan_bytes_after_kills_vs_tracked"] <= 1.1, got
