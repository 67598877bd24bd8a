"""RollbackGuard's core: the trigger rule on injected loss sequences, the in-place snapshot, argument checks."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_accel._utils.levers import Lever, find_levers
from lightning_accel.callbacks import RollbackGuard
from lightning_accel.tune._watch import SeriesWatch, Snapshot, WatchRule


def _feed(values: list[float], rule: WatchRule | None = None, strict_from: int | None = None) -> list[tuple]:
    w = SeriesWatch("loss", rule or WatchRule())
    out = []
    for i, v in enumerate(values):
        t = w.update(i, v, strict=strict_from is not None and i >= strict_from)
        if t is not None:
            out.append((t.step, t.kind, t.streak_start))
    return out


def _noisy(n: int, seed: int, start: float = 2.3, end: float = 0.3, noise: float = 0.08) -> list[float]:
    """A falling training loss with multiplicative, heavy-tailed (Student-t, 3 dof) noise, as small batches give."""
    torch.manual_seed(seed)
    t = torch.distributions.StudentT(3.0).sample((n,)).clamp(-6, 6)
    base = [end + (start - end) * math.exp(-4.0 * i / n) for i in range(n)]
    return [b * (1.0 + noise * float(e)) for b, e in zip(base, t, strict=True)]


def test_a_nan_streak_triggers_at_its_length() -> None:
    vals = [1.0] * 30 + [math.nan, 1.0] + [math.nan, math.inf] + [1.0] * 5
    assert _feed(vals, WatchRule(nan_streak=2)) == [(33, "nonfinite", 32)]  # a lone NaN is not a streak of 2
    assert _feed(vals) == [(30, "nonfinite", 30), (32, "nonfinite", 32), (33, "nonfinite", 33)]


def test_a_sustained_spike_triggers_and_a_short_one_does_not() -> None:
    clean = _noisy(200, seed=0)
    short = clean[:100] + [10.0, 10.0] + clean[102:]  # 2 outliers < spike_steps=4
    assert _feed(short) == []
    sustained = clean[:100] + [10.0] * 6 + clean[106:]
    assert _feed(sustained) == [(103, "spike", 100)]
    # the outliers did not teach the EMA: the same spike later is caught again
    twice = clean[:100] + [10.0] * 4 + clean[104:150] + [10.0] * 4 + clean[154:]
    assert [k for _, k, _ in _feed(twice)] == ["spike", "spike"]


def test_the_watch_window_after_a_lever_is_stricter() -> None:
    clean = _noisy(200, seed=1)
    bump = clean[:120] + [v * 2.0 for v in clean[120:122]] + clean[122:]  # doubled, two steps
    assert _feed(bump) == []
    assert _feed(bump, strict_from=118) == [(121, "spike", 120)]
    # strict arms the spike rule before `arm_after` values
    early = [1.0, 1.01, 0.99, 1.0, 5.0, 5.0] + [1.0] * 10
    assert _feed(early) == [] and _feed(early, strict_from=0) == [(5, "spike", 4)]


@pytest.mark.parametrize("seed", range(6))
def test_clean_noisy_trajectories_never_trigger(seed: int) -> None:
    assert _feed(_noisy(2000, seed=seed, noise=0.12)) == []
    # a plateau with tiny noise: the relative floor keeps jitter from looking like 100 sigma
    torch.manual_seed(seed)
    flat = (0.05 + 0.0005 * torch.randn(1000)).tolist()
    assert _feed(flat) == []


def test_rule_state_round_trips() -> None:
    a = SeriesWatch("loss", WatchRule())
    for i, v in enumerate(_noisy(50, seed=2)):
        a.update(i, v)
    b = SeriesWatch("loss", WatchRule())
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.update(50, 100.0) == a.update(50, 100.0)


def test_snapshot_restores_model_and_optimizer_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
        sched.step()

    step()
    snap = Snapshot()
    snap.take(1, model, [opt], {"sched": sched.state_dict()})
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    expect_opt = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    ids = [id(p) for p in model.parameters()]
    buffers = [b.data_ptr() for b in snap._model]
    for _ in range(3):
        step()
    opt.param_groups[0]["lr"] = 99.0  # an LR spike set by hand
    extra = snap.restore(model, [opt])
    sched.load_state_dict(extra["sched"])
    assert [id(p) for p in model.parameters()] == ids  # in place: DDP and fused modules keep their tensors
    for k, v in model.state_dict().items():
        assert torch.equal(v, expect[k]), k
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, expect_opt[id(p)][k]), k
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3) and sched.last_epoch == 1
    snap.take(5, model, [opt])
    assert [b.data_ptr() for b in snap._model] == buffers  # the buffers are reused
    assert snap.bytes > 0 and snap.step == 5


def test_snapshot_before_the_first_step_resets_the_optimizer_state() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters())
    snap = Snapshot()
    snap.take(0, model, [opt])
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    snap.restore(model, [opt])
    assert not opt.state
    with pytest.raises(RuntimeError, match="no snapshot"):
        Snapshot().restore(model, [opt])


def test_snapshot_refuses_a_resized_model_in_one_line_and_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    snap = Snapshot()
    snap.take(3, model)
    model[0] = nn.Linear(4, 4)  # what pruning does: same tensor count, smaller tensors
    model[1] = nn.Linear(4, 1)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"model tensor 0 has shape \(4, 4\), its snapshot \(step 3\) \(8, 4\)") as e:
        snap.restore(model)
    assert "\n" not in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_snapshot_refuses_another_optimizer_count_before_copying_anything() -> None:
    model = nn.Linear(4, 2)
    snap = Snapshot()
    snap.take(5, model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    with torch.no_grad():
        model.weight.fill_(7.0)
    two = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)]
    with pytest.raises(RuntimeError, match=r"2 optimizers, the snapshot \(step 5\) holds 1") as e:
        snap.restore(model, two)
    assert "\n" not in str(e.value)
    assert bool((model.weight == 7.0).all())  # the model was not overwritten by the refused restore


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"snapshot_every": 0}, "`snapshot_every` must be an integer >= 1, got 0"),
        ({"max_rollbacks": -1}, "`max_rollbacks` must be an integer >= 0, got -1"),
        ({"spike_sigma": 0}, "`spike_sigma` must be a number > 0, got 0"),
        ({"ema_beta": 1.0}, "`ema_beta` must be a number"),
        ({"check_every": 0}, "`check_every` must be an integer >= 1 or None, got 0"),
        ({"arm_after": 1}, "`arm_after` must be an integer >= 2"),
        ({"levers": [object()]}, "`levers` must hold objects with `lever_name`"),
    ],
)
def test_bad_arguments_fail_in_init_with_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match) as e:
        RollbackGuard(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"spike_sigma": math.inf}, ValueError, "`spike_sigma` must be a finite number > 0, got inf. Pass a finite"),
        ({"window_sigma": math.inf}, ValueError, "`window_sigma` must be a finite number > 0, got inf"),
        ({"rel_floor": math.inf}, ValueError, "`rel_floor` must be a finite number >= 0, got inf"),
        ({"spike_sigma": math.nan}, ValueError, "`spike_sigma` must be a number > 0, got nan"),
        ({"rel_floor": -0.1}, ValueError, "`rel_floor` must be a number >= 0, got -0.1"),
        (
            {"spike_sigma": np.float64(6.0)},
            TypeError,
            "`spike_sigma` must be a number > 0, got .*\\(float64\\)\\. Pass a Python value",
        ),
        (
            {"snapshot_every": np.int64(50)},
            TypeError,
            "`snapshot_every` must be an integer >= 1, got .*\\(int64\\)\\. Pass a Python value",
        ),
        ({"max_rollbacks": True}, TypeError, "`max_rollbacks` must be an integer >= 0, got True \\(bool\\)"),
        ({"verbose": 1}, TypeError, "`verbose` must be True or False, got 1 \\(int\\)"),
    ],
    ids=[
        "sigma-inf",
        "window-inf",
        "floor-inf",
        "sigma-nan",
        "floor-negative",
        "np-float",
        "np-int",
        "bool",
        "int-flag",
    ],
)
def test_thresholds_that_are_infinite_numpy_or_bool_are_refused(kwargs: dict, error: type, match: str) -> None:
    # an infinite sigma or floor was taken and switched the spike rule off without a word
    with pytest.raises(error, match=match) as e:
        RollbackGuard(**kwargs)
    assert "\n" not in str(e.value)


class _Toy:
    lever_name = "toy"

    def __init__(self) -> None:
        self.on = True

    @property
    def lever_active(self) -> bool:
        return self.on

    def switch_off(self, reason: str) -> bool:
        was, self.on = self.on, False
        return was


def test_levers_are_found_by_protocol() -> None:
    toy = _Toy()
    assert isinstance(toy, Lever) and not isinstance(object(), Lever)
    assert find_levers([None, toy, object(), toy]) == [toy]
    assert RollbackGuard(levers=[toy]).extra_levers == [toy]


@pytest.mark.parametrize(
    ("levers", "got"),
    [(_Toy(), "got _Toy"), ("ddp_1bit", "got str ('ddp_1bit')"), (3, "got int (3)")],
    ids=["one-lever", "a-name", "a-number"],
)
def test_levers_that_are_no_list_are_refused_in_one_line(levers: Any, got: str) -> None:
    # a lone lever, a number: Python's "'int' object is not iterable" named no argument; a string was taken letter
    # by letter
    with pytest.raises(TypeError, match="`levers` must be a list of lever objects") as e:
        RollbackGuard(levers=levers)
    assert got in str(e.value) and "`levers=[my_lever]`" in str(e.value) and "\n" not in str(e.value)


def test_levers_none_is_no_extra_lever() -> None:
    # `levers: null` in a YAML config: "'NoneType' object is not iterable" from the constructor
    assert RollbackGuard(levers=None).extra_levers == []


def test_a_batch_loss_from_scaled_backward_losses_is_unscaled() -> None:
    from lightning_accel.tune._watch import batch_loss, unscaled_loss

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    losses = [unscaled_loss(scaler.scale(torch.tensor(v)), scaler) for v in (2.0, 0.5)]
    total = batch_loss(losses)
    assert total is not None and float(total) == 2.5  # the sum of the losses as computed, not as scaled
    assert float(unscaled_loss(torch.tensor([1.0, 3.0]))) == 4.0 and batch_loss([]) is None
