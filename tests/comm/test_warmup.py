"""``warmup_steps="auto"`` (``comm/warmup.py``) and the variance-refresh schedule (``OneBitState.refresh_due``)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_accel.comm import OneBitConfig, OneBitState, WarmupWatch, warmup_cap
from lightning_accel.comm.warmup import AUTO_MIN_WARMUP, CHECK_EVERY


def test_config_accepts_auto_and_rejects_bad_values_naming_them() -> None:
    assert OneBitConfig().warmup_steps == "auto" and OneBitConfig().variance_refresh == 8
    assert OneBitConfig(warmup_steps=4).warmup_steps == 4
    with pytest.raises(TypeError, match=r"`warmup_steps`.*'10'.*'auto'"):
        OneBitConfig(warmup_steps="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`warmup_steps`.*>= 2"):
        OneBitConfig(warmup_steps=1)
    with pytest.raises(ValueError, match=r"`variance_refresh`.*-1"):
        OneBitConfig(variance_refresh=-1)


def test_warmup_cap_is_15_percent_of_the_fit_within_bounds() -> None:
    assert warmup_cap(240) == 36
    assert warmup_cap(20) == AUTO_MIN_WARMUP
    assert warmup_cap(math.inf) == 1000 and warmup_cap(-1) == 1000


def _state(**kw: object) -> OneBitState:
    return OneBitState(config=OneBitConfig(compressed_signal="momentum", compression="1bit", **kw))  # type: ignore[arg-type]


def test_refresh_steps_are_r_3r_7r_into_the_compressed_stage() -> None:
    st = _state(warmup_steps=10)
    assert st.warmup_end == 10
    due = []
    for step in range(0, 200):
        st.step = step
        if st.compressing and st.compressed_since is None:
            st.compressed_since = step  # what the compressor records at the first compressed step
        if st.refresh_due:
            due.append(step)
    assert due == [18, 34, 66, 130]
    st.trial_until = 140  # never during a compression="auto" trial
    st.step = 130
    assert not st.refresh_due
    off = _state(warmup_steps=10, variance_refresh=0)
    off.compressed_since, off.step = 10, 18
    assert not off.refresh_due


def test_auto_warmup_starts_at_the_minimum_is_decidable_and_saved_with_the_state() -> None:
    st = _state()
    assert st.warmup_end == AUTO_MIN_WARMUP  # the hook alone: "auto" is the gradient path's 10
    st.warmup_end = None  # what the strategy does while its watch decides
    st.step = 50
    assert not st.compressing and not st.needs_decision and not st.refresh_due
    st.warmup_end = 12
    assert st.compressing
    saved = st.state_dict()
    assert saved["warmup_end"] == 12
    again = _state()
    again.load_state_dict(saved)
    assert again.warmup_end == 12
    explicit = _state(warmup_steps=4)  # an explicit integer wins over the saved value
    explicit.load_state_dict(saved)
    assert explicit.warmup_end == 4


def _adam(v_values: list[float]) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in v_values]
    opt = torch.optim.AdamW(params, betas=(0.9, 0.95))
    for p, v in zip(params, v_values, strict=True):
        opt.state[p] = {"step": torch.tensor(20.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.full((4,), v)}
    return opt, params


def _scale(opt: torch.optim.Optimizer, factor: float) -> None:
    for s in opt.state.values():
        s["exp_avg_sq"].mul_(factor)


def test_watch_ends_when_the_per_tensor_variance_settles() -> None:
    opt, _ = _adam([1.0, 4.0])
    watch = WarmupWatch([opt], cap=100)
    end = next(s for s in range(0, 40) if watch.end_at(s))
    assert end == AUTO_MIN_WARMUP + CHECK_EVERY  # the first check that has an earlier value to compare with
    assert watch.changes == [(AUTO_MIN_WARMUP, math.inf), (AUTO_MIN_WARMUP + CHECK_EVERY, 0.0)]
    assert "moved 0.0%" in watch.reason


def test_watch_keeps_warming_while_the_variance_trends_and_stops_at_the_cap() -> None:
    opt, _ = _adam([1.0, 4.0])
    watch = WarmupWatch([opt], cap=32)
    for s in range(0, 40):
        if s % CHECK_EVERY == 0:
            _scale(opt, 0.7)  # 30 % lower at every check: still trending
        if watch.end_at(s):
            break
    assert s == 32 and "cap" in watch.reason
    assert all(c > 0.2 for _, c in watch.changes[1:])


def test_watch_ends_at_the_minimum_when_nothing_is_frozen_or_the_variance_is_refreshed() -> None:
    opt, _ = _adam([1.0])
    for watch in (WarmupWatch([], cap=100), WarmupWatch([opt], cap=100, refreshed=True)):
        assert next(s for s in range(0, 20) if watch.end_at(s)) == AUTO_MIN_WARMUP
        assert watch.changes == []


def test_watch_resumed_between_checks_decides_as_the_uninterrupted_one() -> None:
    """Its state saved after the first check (through ``torch.save``/``load(weights_only=True)``, as in a checkpoint)
    and loaded into a new watch: the second check compares with the first one's means, not with nothing."""
    import io

    opt, _ = _adam([1.0, 4.0])
    full = WarmupWatch([opt], cap=100)
    assert not any(full.end_at(s) for s in range(0, 12))  # the first check, at 10: nothing to compare with
    buf = io.BytesIO()
    torch.save(full.state_dict(), buf)
    buf.seek(0)
    resumed = WarmupWatch([opt], cap=100)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    fresh = WarmupWatch([opt], cap=100)  # what a resume made before the state was saved
    ends = [next(s for s in range(12, 40) if w.end_at(s)) for w in (full, resumed, fresh)]
    assert ends == [AUTO_MIN_WARMUP + CHECK_EVERY] * 2 + [AUTO_MIN_WARMUP + 2 * CHECK_EVERY]
    assert resumed.changes == full.changes


def test_watch_checks_once_per_step_whatever_the_optimizers_stepping_after_one_backward() -> None:
    """Manual optimization with two optimizers calls it twice at each step: the second call (after the first
    optimizer updated its variance) must not compare that update with the first call's means."""
    opt, _ = _adam([1.0, 4.0])
    watch = WarmupWatch([opt], cap=100)
    assert not watch.end_at(AUTO_MIN_WARMUP)
    _scale(opt, 0.97)  # the first optimizer's step: 3 %, below the threshold
    assert not watch.end_at(AUTO_MIN_WARMUP)
    assert watch.changes == [(AUTO_MIN_WARMUP, math.inf)]


def test_watch_is_not_delayed_by_a_tensor_that_shrank_between_two_checks() -> None:
    """A pruned tensor (its channels kept, with their variance) changes size, not its mean variance: no trend. Sums
    of the variance halved with the channels and delayed the end by one check."""
    opt, params = _adam([1.0, 4.0])
    watch = WarmupWatch([opt], cap=100)
    assert not watch.end_at(AUTO_MIN_WARMUP)
    state = opt.state[params[1]]
    state["exp_avg_sq"] = state["exp_avg_sq"][:2].clone()  # half the channels pruned
    state["exp_avg"] = state["exp_avg"][:2].clone()
    assert watch.end_at(AUTO_MIN_WARMUP + CHECK_EVERY)
    assert watch.changes[-1] == (AUTO_MIN_WARMUP + CHECK_EVERY, 0.0)


def test_watch_reads_a_saved_state_of_per_tensor_sums_as_nothing_to_compare_with() -> None:
    opt, _ = _adam([1.0, 4.0])
    watch = WarmupWatch([opt], cap=100)
    watch.load_state_dict({"last": torch.tensor([4.0, 16.0], dtype=torch.float64), "changes": [[10, math.inf]]})
    assert not watch.end_at(AUTO_MIN_WARMUP + CHECK_EVERY)  # compared with nothing: one check later
    assert watch.end_at(AUTO_MIN_WARMUP + 2 * CHECK_EVERY)
