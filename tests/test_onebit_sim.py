"""``benchmarks/_onebit_sim.py``, the simulation behind ``docs/onebit.md``'s decomposition of the loss gap."""

from __future__ import annotations

import math

import pytest

from benchmarks import _onebit_sim as sim


def test_refresh_schedule_is_r_3r_7r_after_warmup() -> None:
    assert sim.refresh_steps(10, 8, 200) == {18, 34, 66, 130}
    assert sim.refresh_steps(10, 0, 200) == set()


def test_variants_share_the_warmup_and_differ_once_compressed() -> None:
    kw = {"steps": 14, "block": 640}
    ddp = sim.fit(1, "ddp", warmup=10, refresh=0, **kw)
    # no compressed step: the frozen-variance path is never taken, so it is DDP exactly
    assert sim.fit(1, "freeze", warmup=14, refresh=0, **kw)["loss"] == ddp["loss"]
    full = sim.fit(2, "full", warmup=10, refresh=2, **kw)
    freeze = sim.fit(2, "freeze", warmup=10, refresh=2, **kw)
    assert math.isfinite(full["loss"]) and full["loss"] != freeze["loss"]
    assert 0 < full["worker_rel_error"] < 2 and 0 < full["server_rel_error"] < 2
    assert "worker_rel_error" not in freeze  # exact averaging has no compression error


def test_bad_variant_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sim.parse_args(["--variants", "ddp,nope"])
    assert "--variants: unknown nope" in capsys.readouterr().err
