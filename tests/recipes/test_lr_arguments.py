"""Arguments of the LR recipes' functional core given in the other shapes a user writes them in."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.recipes import WarmupCosineLR, apply_lr_scale


def test_apply_lr_scale_takes_one_scheduler_as_well_as_a_list() -> None:
    """``apply_lr_scale(opt, 2.0, sched)`` stopped with ``'WarmupCosineLR' object is not iterable``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = WarmupCosineLR(opt, 10, warmup_steps=2)
    assert apply_lr_scale(opt, 2.0, sched) == pytest.approx(2.0)
    assert sched.base_lrs == pytest.approx([0.2])
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)  # the warm-up reaches the scaled peak


def test_apply_lr_scale_refuses_schedulers_that_are_no_schedulers_in_one_line() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match=r"^`schedulers` must be an LR scheduler or a list of them, got 3 \(int\)\."):
        apply_lr_scale(opt, 2.0, 3)  # type: ignore[arg-type]
    assert opt.param_groups[0]["lr"] == 0.1
