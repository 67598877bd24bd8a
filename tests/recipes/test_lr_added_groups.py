"""Unit tests of WarmupCosineLR with a param group added after it was built, and of ``bind(into_epoch=...)``."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.recipes.lr import WarmupCosineLR, apply_lr_scale, warmup_cosine_value


def _opt() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_a_group_added_later_keeps_its_rate_through_steps_binds_and_scaling() -> None:
    opt = _opt()
    sched = WarmupCosineLR(opt, total_steps=10, warmup_steps=2, min_lr=0.0)
    opt.step()
    sched.step()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.003})
    for _ in range(3):
        opt.step()
        sched.step()  # torch zips the rates with the groups strictly: one rate per group
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([warmup_cosine_value(4, 0.1, 10, 2, 0.0), 0.003])
    assert sched.get_last_lr() == pytest.approx([warmup_cosine_value(4, 0.1, 10, 2, 0.0), 0.003])
    sched.bind(20)
    apply_lr_scale(opt, 2.0, [sched])  # the added group is scaled as a rate of its own, not rescheduled
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([warmup_cosine_value(4, 0.2, 20, 2, 0.0), 0.006])
    # a resume: the optimizer is built with its first groups, the finetuning callback adds its group, then the
    # schedule's state is loaded
    again = _opt()
    restored = WarmupCosineLR(again, total_steps=20, warmup_steps=2)
    again.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.006})
    restored.load_state_dict(sched.state_dict())
    assert [g["lr"] for g in again.param_groups] == pytest.approx([warmup_cosine_value(4, 0.2, 20, 2, 0.0), 0.006])


@pytest.mark.parametrize(("into_epoch", "position"), [(None, 3 * 4 + 2), (1, 3 * 4 + 1), (4, 3 * 4)])
def test_bind_takes_the_steps_into_the_interrupted_epoch_in_this_fits_units(
    into_epoch: int | None, position: int
) -> None:
    # bound at 8 steps per epoch, resumed after 3 whole epochs and 2 steps into the 4th, now at 4 steps per epoch
    sched = WarmupCosineLR(_opt(), total_steps=80, warmup_steps=2)
    sched.bind(80, steps_per_epoch=8)
    state = sched.state_dict()
    state["last_epoch"] = 3 * 8 + 2
    sched.load_state_dict(state)
    sched.bind(40, steps_per_epoch=4, epochs_done=3, into_epoch=into_epoch)
    # None keeps the 2 steps as they are; a count that fills this fit's epoch restarts it
    assert sched.last_epoch + sched.step_offset == position
