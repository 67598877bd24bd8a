"""Unit tests of the LR recipes core: linear scaling rule, idempotent scaling, WarmupCosineLR."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_accel.recipes.lr import (
    APPLIED_KEY,
    WarmupCosineLR,
    apply_lr_scale,
    linear_scaling_factor,
    warmup_cosine_value,
)


def _opt(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    ps = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (i + 1)} for i in range(groups)]
    return torch.optim.SGD(ps, lr=lr, momentum=0.9)


def test_linear_scaling_factor() -> None:
    assert linear_scaling_factor(256, 64) == 4.0
    assert linear_scaling_factor(32, 64) == 0.5
    for bad, kind in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(
            kind, match="`base_batch_size` must be an integer >= 1, got .*Pass the batch size in samples"
        ):
            linear_scaling_factor(64, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`global_batch_size`"):
        linear_scaling_factor(0, 64)


def test_apply_lr_scale_is_idempotent_and_rescales() -> None:
    opt = _opt(0.1, groups=2)
    apply_lr_scale(opt, 4.0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 0.8])
    assert all(g[APPLIED_KEY] == 4.0 for g in opt.param_groups)
    assert apply_lr_scale(opt, 4.0) == 1.0  # second call: nothing changes
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 0.8])
    apply_lr_scale(opt, 2.0)  # e.g. resumed on half the devices: total factor 2, not 8
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.4])
    # the key travels with the optimizer state, so a restored optimizer is recognised as scaled
    fresh = _opt(0.1, groups=2)
    fresh.load_state_dict(opt.state_dict())
    apply_lr_scale(fresh, 2.0)
    assert [g["lr"] for g in fresh.param_groups] == pytest.approx([0.2, 0.4])
    with pytest.raises(ValueError, match="`factor` must be a number > 0 and < inf, got 0.0"):
        apply_lr_scale(opt, 0.0)
    with pytest.raises(ValueError, match="`factor`"):
        apply_lr_scale(opt, float("inf"))


def test_apply_lr_scale_scales_attached_schedulers() -> None:
    opt = _opt(0.1)
    sched = WarmupCosineLR(opt, total_steps=10, warmup_steps=2)
    other = torch.optim.lr_scheduler.StepLR(_opt(0.1), step_size=1)
    apply_lr_scale(opt, 3.0, [sched, other])
    assert sched.base_lrs == pytest.approx([0.3])
    assert other.base_lrs == pytest.approx([0.1])  # not attached to `opt`
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)  # peak = scaled base right after warm-up


def _run(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "make",
    [
        # (optimizer, k) -> the scheduler built at k x the unscaled rates
        lambda opt, k: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1 * k, total_steps=12),
        lambda opt, k: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01 * k, max_lr=0.1 * k, step_size_up=3),
        lambda opt, k: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 12, eta_min=1e-3),  # `eta_min` is absolute
        lambda opt, k: WarmupCosineLR(opt, total_steps=12, warmup_steps=3, min_lr=1e-3),
    ],
    ids=["OneCycleLR", "CyclicLR", "CosineAnnealingLR", "WarmupCosineLR"],
)
def test_scaled_schedules_follow_the_scaled_rates(make: Callable[[torch.optim.Optimizer, float], Any]) -> None:
    # scaled after the scheduler was built (as LinearScalingLR does) == built at the scaled rates: a warm-up or a
    # cycle reaches the scaled peak (OneCycleLR's `max_lr`/`min_lr` live in the param group, CyclicLR's on itself)
    opt = _opt(0.1)
    sched = make(opt, 1)
    apply_lr_scale(opt, 4.0, [sched])
    ref_opt = _opt(0.4)
    assert _run(opt, sched, 12) == pytest.approx(_run(ref_opt, make(ref_opt, 4), 12))


def _chained(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ChainedScheduler:
    warm = torch.optim.lr_scheduler.LinearLR(opt, 0.25, 1.0, total_iters=3)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 12) / 12)))
    return torch.optim.lr_scheduler.ChainedScheduler([warm, decay])


@pytest.mark.parametrize("nested", [False, True])
def test_the_schedulers_of_a_chained_schedule_are_scaled(nested: bool) -> None:
    # a LambdaLR inside a ChainedScheduler computes from its own base rates, which were not scaled: the rate fell back
    # to the unscaled one at the first step
    opt = _opt(0.1, groups=2)
    ref_opt = _opt(0.4, groups=2)  # built at the scaled rates
    chained, ref = _chained(opt), _chained(ref_opt)
    if nested:  # a chain inside a chain
        chained = torch.optim.lr_scheduler.ChainedScheduler([chained])
        ref = torch.optim.lr_scheduler.ChainedScheduler([ref])
    apply_lr_scale(opt, 4.0, [chained])
    for _ in range(14):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups])
        for o, s in ((opt, chained), (ref_opt, ref)):
            o.step()
            s.step()
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.ConstantLR(opt, 0.5, 2)], [])
    with pytest.raises(ValueError, match="`schedulers` holds a SequentialLR"):
        apply_lr_scale(opt, 8.0, [torch.optim.lr_scheduler.ChainedScheduler([seq])])


def test_rescaling_a_schedule_past_its_warmup_keeps_the_absolute_floor() -> None:
    # a resume on more devices rescales mid-cosine: the current rate was multiplied by the ratio, as if `min_lr`
    # scaled too, so the first resumed step trained at 2 x (min + (b - min) c) instead of min + (2b - min) c
    opt = _opt(0.1, groups=2)
    sched = WarmupCosineLR(opt, total_steps=20, warmup_steps=2, min_lr=0.01)
    apply_lr_scale(opt, 2.0, [sched])
    for _ in range(12):
        opt.step()
        sched.step()
    apply_lr_scale(opt, 4.0, [sched])  # x2 again
    expected = [warmup_cosine_value(12, 0.4 * (i + 1), 20, 2, 0.01) for i in range(2)]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected)
    assert sched.get_last_lr() == pytest.approx(expected)


def test_tensor_rates_are_replaced_not_mutated() -> None:
    lr = torch.tensor(0.1)
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=lr)  # both groups hold the caller's tensor
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    apply_lr_scale(opt, 4.0, [sched])
    assert float(lr) == pytest.approx(0.1)  # the caller's tensor is left alone ...
    assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([0.4, 0.4])  # ... and shared: scaled once
    assert [float(b) for b in sched.base_lrs] == pytest.approx([0.4, 0.4])


def test_a_sequential_schedule_is_refused_before_anything_changes() -> None:
    opt = _opt(0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 9)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], [3])
    with pytest.raises(ValueError, match="`schedulers` holds a SequentialLR.*x4.*WarmupCosineLR"):
        apply_lr_scale(opt, 4.0, [seq])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01) and APPLIED_KEY not in opt.param_groups[0]
    assert apply_lr_scale(opt, 1.0, [seq]) == 1.0  # nothing to scale: accepted


def test_fallback_applied_for_groups_without_key() -> None:
    opt = _opt(0.4)  # already scaled x4 by a run whose optimizer state lacks the key
    apply_lr_scale(opt, 4.0, fallback_applied=4.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)


def _lrs(sched: WarmupCosineLR, opt: torch.optim.Optimizer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_cosine_shape() -> None:
    opt = _opt(1.0)
    sched = WarmupCosineLR(opt, total_steps=20, warmup_steps=4, min_lr=0.1)
    lrs = _lrs(sched, opt, 25)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:20], lrs[5:21], strict=True))  # non-increasing after warm-up
    assert lrs[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert lrs[20:] == pytest.approx([0.1] * 5)
    assert warmup_cosine_value(0, 1.0, 10, 0, 0.0) == pytest.approx(1.0)


def test_warmup_fraction_and_bad_arguments() -> None:
    sched = WarmupCosineLR(_opt(), total_steps=100, warmup_fraction=0.1)
    assert sched.warmup_steps == 10
    with pytest.raises(ValueError, match="`warmup_steps` \\(10\\) must be shorter than the training, `total_steps`"):
        WarmupCosineLR(_opt(), total_steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="not both"):
        WarmupCosineLR(_opt(), total_steps=10, warmup_steps=1, warmup_fraction=0.1)
    with pytest.raises(ValueError, match="`warmup_fraction`"):
        WarmupCosineLR(_opt(), total_steps=10, warmup_fraction=1.0)
    with pytest.raises(ValueError, match="`warmup_steps`"):
        WarmupCosineLR(_opt(), total_steps=10, warmup_steps=-1)
    with pytest.raises(ValueError, match="`min_lr`"):
        WarmupCosineLR(_opt(), total_steps=10, min_lr=-1.0)
    with pytest.raises(ValueError, match="`min_lr` \\(0.15\\) must be at most the base .* got 0.1 for group 0"):
        WarmupCosineLR(_opt(0.1, groups=2), total_steps=10, min_lr=0.15)  # the second group's base is 0.2
    assert WarmupCosineLR(_opt(0.1), total_steps=10, min_lr=0.1).min_lr == 0.1  # a flat end is allowed
    with pytest.raises(ValueError, match="`total_steps` must be an integer >= 1, got 0"):
        WarmupCosineLR(_opt(), total_steps=0)
    with pytest.raises(TypeError, match="`total_steps`"):
        WarmupCosineLR(_opt(), total_steps=True)
    with pytest.raises(TypeError, match="`warmup_steps` must be an integer >= 0 or None, got True"):
        WarmupCosineLR(_opt(), total_steps=10, warmup_steps=True)
    assert WarmupCosineLR(_opt(), total_steps=10.0).total_steps == 10  # a whole float is a step count


@pytest.mark.parametrize("given", [None, torch.nn.Linear(2, 2)])
def test_something_else_than_an_optimizer_is_named(given: Any) -> None:
    # the model (or nothing) where the optimizer belongs, named before `param_groups` is read
    with pytest.raises(TypeError, match=r"`optimizer` must be a torch.optim.Optimizer, got (NoneType|Linear)\. Pass"):
        WarmupCosineLR(given, total_steps=10)
    with pytest.raises(ValueError, match="infinite"):
        WarmupCosineLR(_opt(), total_steps=float("inf"))


@pytest.mark.parametrize(("fraction", "total", "warm"), [(0.95, 10, 9), (0.6, 1, 0), (0.9, 5, 4), (0.5, 3, 2)])
def test_a_warmup_fraction_is_never_the_whole_run(fraction: float, total: int, warm: int) -> None:
    # any fraction in [0, 1) is valid: rounding it to whole steps must leave at least one step of cosine
    assert WarmupCosineLR(_opt(), total_steps=total, warmup_fraction=fraction).warmup_steps == warm
    unbound = WarmupCosineLR(_opt(), warmup_fraction=fraction)
    unbound.bind(total)  # PerStepLR's path
    assert unbound.warmup_steps == warm


def test_unbound_schedule_must_be_bound_before_stepping() -> None:
    opt = _opt(1.0)
    sched = WarmupCosineLR(opt, warmup_fraction=0.25)
    assert not sched.bound
    opt.step()
    with pytest.raises(RuntimeError, match="PerStepLR"):
        sched.step()
    opt2 = _opt(1.0)
    sched2 = WarmupCosineLR(opt2, warmup_fraction=0.25)
    sched2.bind(8)
    assert sched2.warmup_steps == 2
    assert _lrs(sched2, opt2, 3) == pytest.approx([0.5, 1.0, 1.0])
    with pytest.raises(ValueError, match="`warmup_steps` \\(4\\)"):
        WarmupCosineLR(_opt(), warmup_steps=4).bind(4)


def test_resume_continues_the_same_curve() -> None:
    opt = _opt(1.0)
    sched = WarmupCosineLR(opt, total_steps=30, warmup_steps=5, min_lr=0.01)
    full = _lrs(sched, opt, 30)
    opt_a = _opt(1.0)
    sched_a = WarmupCosineLR(opt_a, total_steps=30, warmup_steps=5, min_lr=0.01)
    first = _lrs(sched_a, opt_a, 12)
    opt_b = _opt(1.0)
    opt_b.load_state_dict(opt_a.state_dict())
    # the same schedule arguments, no `total_steps`: the restored horizon and step continue the curve
    sched_b = WarmupCosineLR(opt_b, warmup_steps=5, min_lr=0.01)
    sched_b.load_state_dict(sched_a.state_dict())
    second = _lrs(sched_b, opt_b, 18)
    assert first + second == pytest.approx(full)


def _stepped(total: int, steps: int, spe: float | None, **kw: object) -> WarmupCosineLR:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = WarmupCosineLR(opt, warmup_steps=None, min_lr=0.001, **kw)  # type: ignore[arg-type]
    s.bind(total, steps_per_epoch=spe)
    for _ in range(steps):
        opt.step()
        s.step()
    return s


def _restored(state: dict, total: int, spe: float | None) -> tuple[WarmupCosineLR, int, list[float]]:
    """A fresh schedule restored from ``state`` and re-bound to a fit of ``total`` steps: the schedule, its position
    after the bind, its rates to the end."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = WarmupCosineLR(opt, min_lr=0.001)
    s.load_state_dict(state)
    s.bind(total, steps_per_epoch=spe)
    start = s.last_epoch + s.step_offset
    lrs = []
    for _ in range(total):
        lrs.append(float(opt.param_groups[0]["lr"]))
        if s.last_epoch + s.step_offset >= total:
            break
        opt.step()
        s.step()
    return s, start, lrs


@pytest.mark.parametrize(
    ("old_spe", "new_spe", "position"),
    [(78.0, 52.0, 52), (78.0, 156.0, 156), (78.0, 78.0, 78)],  # 2 -> 3 processes, 2 -> 1, same size
)
def test_rebinding_at_another_steps_per_epoch_keeps_the_progress_fraction(
    old_spe: float, new_spe: float, position: int
) -> None:
    # one epoch of four done (78 steps at the old size), resumed at a size with `new_spe` steps per epoch
    old = _stepped(int(4 * old_spe), int(old_spe), old_spe)
    new_total = int(4 * new_spe)
    s, start, lrs = _restored(old.state_dict(), new_total, new_spe)
    assert start == position  # a quarter of the new horizon, as before
    assert lrs[0] == pytest.approx(warmup_cosine_value(position, 0.1, new_total, 0, 0.001))
    assert lrs[0] == pytest.approx(float(old.optimizer.param_groups[0]["lr"]))  # the same point of the curve
    assert len(lrs) == new_total - position + 1 and lrs[-2] > 0.001  # no step trained at min_lr before the end
    assert lrs[-1] == pytest.approx(0.001)  # reaches min_lr exactly after this fit's last step
    before = (s.total_steps, s.step_offset)
    s.bind(new_total, steps_per_epoch=new_spe)
    assert (s.total_steps, s.step_offset) == before  # binding again changes nothing


def test_rebinding_an_extended_run_continues_from_the_same_step() -> None:
    old = _stepped(16, 16, 8.0)  # a finished 2-epoch run
    s, start, lrs = _restored(old.state_dict(), 32, 8.0)  # extended to 4 epochs
    assert start == 16 and s.step_offset == 0 and lrs[0] == pytest.approx(warmup_cosine_value(16, 0.1, 32, 0, 0.001))
    assert lrs[-1] == pytest.approx(0.001) and len(lrs) == 17


@pytest.mark.parametrize(
    ("new_spe", "epochs_done", "position"),
    [
        (16.0, 1, 19),  # 1 epoch converted (16 steps) + the 3 steps into epoch 1, which Lightning resumes at batch 3
        (2.0, 1, 2),  # 3 steps reach the 2 of an epoch now: Lightning restarts epoch 1, and the position with it
        (16.0, None, 22),  # no epoch count: the whole position is converted (11 x 16 / 8)
    ],
)
def test_rebinding_mid_epoch_keeps_the_steps_into_the_epoch(
    new_spe: float, epochs_done: int | None, position: int
) -> None:
    old = _stepped(32, 11, 8.0)  # 4 epochs of 8 steps; stopped 3 steps into epoch 1
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = WarmupCosineLR(opt, min_lr=0.001)
    s.load_state_dict(old.state_dict())
    total = int(4 * new_spe)
    s.bind(total, steps_per_epoch=new_spe, epochs_done=epochs_done)
    assert s.last_epoch + s.step_offset == position
    assert opt.param_groups[0]["lr"] == pytest.approx(warmup_cosine_value(position, 0.1, total, 0, 0.001))


def test_bad_last_epoch_and_fallback_factor_are_named() -> None:
    # a string or -2 used to reach torch's check of a resumed schedule, which blames a missing `initial_lr`
    with pytest.raises(TypeError, match="`last_epoch` must be an integer >= -1, got '3' \\(str\\)\\. It is the index"):
        WarmupCosineLR(_opt(), total_steps=10, last_epoch="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`last_epoch` must be an integer >= -1, got -2"):
        WarmupCosineLR(_opt(), total_steps=10, last_epoch=-2)
    # a factor of 0 assumed applied used to divide by zero
    opt = _opt()
    with pytest.raises(ValueError, match="`fallback_applied` must be a number > 0 and < inf, got 0\\. It is the"):
        apply_lr_scale(opt, 2.0, fallback_applied=0)
    with pytest.raises(TypeError, match="`fallback_applied` must be a number"):
        apply_lr_scale(opt, 2.0, fallback_applied="1")  # type: ignore[arg-type]
    assert opt.param_groups[0]["lr"] == 0.1 and APPLIED_KEY not in opt.param_groups[0]  # nothing changed
