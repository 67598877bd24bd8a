"""The tuner's functional core with injected timings, losses and clocks (no Lightning, no training)."""

from __future__ import annotations

import math
import re

import pytest

from lightning_accel.tune.core import (
    ORDER_ALLOWANCE,
    TOLERANCES,
    Budget,
    TuneCache,
    check_numerics,
    decide,
    fingerprint,
    lever_order,
    named_as_flags,
    parse_duration,
    progress_line,
    tolerance,
)
from tests.tiny import VirtualTime

BASE = [2.30, 2.10, 1.95, 1.80, 1.70, 1.62, 1.55, 1.50]


def _ok(gap: float = 0.0):  # noqa: ANN202 - a passing numerics check
    return check_numerics(BASE, [x * (1 + gap) for x in BASE], "32-true")


@pytest.mark.parametrize(
    ("step", "keep", "words"),
    [
        (0.090, True, "10.0 % faster"),
        (0.0975, False, "only 2.5 % faster (needs 3 %)"),
        (0.100, False, "as fast as the best so far (needs 3 % faster)"),
        (0.10001, False, "as fast as the best so far"),
        (0.09999, False, "as fast as the best so far"),
        (0.120, False, "20.0 % slower"),
    ],
)
def test_decide_keeps_only_what_beats_the_margin(step: float, keep: bool, words: str) -> None:
    d = decide(0.100, step, numerics=_ok(), memory_ok=True, margin=0.03)
    assert d.keep is keep and words in d.reason, d
    assert "-0.0" not in d.reason and " 0.0 %" not in d.reason, d


def test_decide_refuses_a_faster_lever_that_fails_numerics_memory_or_errors() -> None:
    bad = check_numerics(BASE, [x * 1.3 for x in BASE], "32-true")
    assert not decide(0.1, 0.05, numerics=bad, memory_ok=True).keep
    assert "numerics" in decide(0.1, 0.05, numerics=bad, memory_ok=True).reason
    assert decide(0.1, 0.05, numerics=_ok(), memory_ok=False).reason == "memory does not fit the device"
    d = decide(0.1, None, numerics=None, memory_ok=True, error="RuntimeError: boom")
    assert not d.keep and "boom" in d.reason
    with pytest.raises(ValueError, match="`margin` must be in"):
        decide(0.1, 0.05, numerics=_ok(), memory_ok=True, margin=1.5)


def test_numerics_tolerance_depends_on_the_precision() -> None:
    drift = [x * 1.035 for x in BASE]  # 3.5 %: beyond fp32's 2 %, within bf16's 5 %
    assert not check_numerics(BASE, drift, "32-true").ok
    assert check_numerics(BASE, drift, "bf16-mixed").ok
    assert tolerance("bf16") == TOLERANCES["bf16-mixed"]
    assert tolerance("32", reorders=True) == pytest.approx(TOLERANCES["32-true"] + ORDER_ALLOWANCE)
    with pytest.raises(ValueError, match="`precision` must be one of"):
        tolerance("8-bit")


def test_numerics_fails_on_nan_and_inf_and_names_the_step() -> None:
    for bad in (math.nan, math.inf):
        n = check_numerics(BASE, [*BASE[:3], bad, *BASE[4:]], "bf16-mixed")
        assert not n.ok and "step 3" in n.reason


def test_numerics_compares_running_means_so_one_noisy_batch_passes() -> None:
    noisy = list(BASE)
    noisy[5] *= 1.08  # one batch 8 % off moves the running mean by ~1.3 %
    assert check_numerics(BASE, noisy, "32-true").ok
    drifting = [x * (1 + 0.01 * i) for i, x in enumerate(BASE)]  # a drift that grows
    assert not check_numerics(BASE, drifting, "32-true").ok


def test_numerics_compares_a_larger_batch_at_equal_samples_seen() -> None:
    doubled = [(BASE[2 * i] + BASE[2 * i + 1]) / 2 for i in range(len(BASE) // 2)]
    assert check_numerics(BASE, doubled, "32-true", samples_ratio=2).ok
    assert check_numerics(BASE, doubled, "32-true", samples_ratio=2).steps == 4
    assert not check_numerics(BASE, [], "32-true").ok


def test_lever_order_follows_the_verdict() -> None:
    kw = {"multi_device": True, "allow_batch_change": False, "has_checkpoints": True}
    assert lever_order("data", **kw)[0] == "data"
    assert lever_order("compute", **kw)[0] == "precision"
    assert lever_order("comm", **kw)[0] == "strategy"
    assert lever_order("checkpoint", **kw) == ["checkpoint", "data", "precision", "host_memory", "strategy"]
    one = lever_order("comm", multi_device=False, allow_batch_change=True, has_checkpoints=False)
    assert one == ["data", "precision", "host_memory", "batch"]


def test_fingerprint_is_stable_and_sensitive() -> None:
    job: dict[str, dict[str, object]] = {
        "trainer": {"devices": 2, "precision": "32-true"},
        "model": {"class_path": "m.M"},
    }
    env = {"torch": "2.x", "world": 2}
    assert fingerprint(job, env) == fingerprint({"model": {"class_path": "m.M"}, "trainer": dict(job["trainer"])}, env)
    assert fingerprint(job, env) != fingerprint(job, {**env, "world": 1})
    assert fingerprint(job, env) != fingerprint({**job, "seed_everything": 1}, env)


def test_cache_round_trip_and_a_damaged_entry_is_a_miss(tmp_path) -> None:  # noqa: ANN001
    cache = TuneCache(tmp_path / "c")
    key = fingerprint({"a": 1}, {})
    assert cache.load(key) is None
    path = cache.store(key, {"config": {"x": 1}, "trials": []})
    assert cache.load(key) == {"config": {"x": 1}, "trials": []}
    path.write_text("{ not json")
    assert cache.load(key) is None
    with pytest.raises(ValueError, match="`key` must be a fingerprint"):
        cache.path("../escape")


def test_budget_with_an_injected_clock() -> None:
    vt = VirtualTime()
    b = Budget(60, clock=vt)
    assert b.affords(60) and not b.affords(61)
    vt.advance(45)
    assert b.left() == 15 and b.affords(15) and not b.affords(20)
    assert progress_line(2, 5, b, "precision: bf16-mixed") == "tune [2/5] 15 s left | precision: bf16-mixed"
    vt.advance(100)
    assert b.left() == 0.0


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("5m", 300), ("1.5min", 90), ("1.5h", 5400), (30, 30), (2.5, 2.5)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-5m", "0s", "5 days", "1e9h", "inf", "nan", math.inf, -1, True])
def test_parse_duration_refuses(text: str | float) -> None:
    with pytest.raises(ValueError, match="`budget` must be") as e:  # the keyword: the command names its flag instead
        parse_duration(text)
    assert "\n" not in str(e.value)
    with named_as_flags(), pytest.raises(ValueError, match="`--budget` must be"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "why"), [("-1m", "must be positive"), ("+0m", "must be positive")])
def test_a_signed_budget_is_told_it_is_not_positive(text: str, why: str) -> None:
    # "-1m" was "not a duration such as 90s": the message did not say what was wrong with it
    with pytest.raises(ValueError, match=f"`budget` {why}, got '{re.escape(text)}'"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["5", "90", " 1.5 "])
def test_a_budget_without_its_unit_is_refused(text: str) -> None:
    # "5" was 5 seconds: a tune too short for any option, which wrote a config that "kept nothing"
    number = text.strip()
    with pytest.raises(ValueError, match="`budget` must give its unit") as e:
        parse_duration(text)
    assert f"`budget='{number}m'`" in str(e.value) and f"`budget='{number}s'`" in str(e.value)
    with named_as_flags(), pytest.raises(ValueError, match=f"Pass e.g. `--budget {number}m` or `--budget {number}s`"):
        parse_duration(text)
