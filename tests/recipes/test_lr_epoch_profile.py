"""Unit tests of ``WarmupCosineLR.bind`` with the steps of each epoch (``GradientAccumulationScheduler`` fits) and
with another accumulation at the same steps per epoch."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.recipes.lr import WarmupCosineLR


def _restored(steps_per_epoch: float | list[float], position: int, total: int = 40) -> WarmupCosineLR:
    """A schedule bound at ``steps_per_epoch`` and restored at ``position``."""
    sched = WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), warmup_steps=1)
    sched.bind(total, steps_per_epoch=steps_per_epoch)
    state = sched.state_dict()
    state["last_epoch"] = position
    sched.load_state_dict(state)
    return sched


@pytest.mark.parametrize(
    ("old", "restored", "new", "epochs_done", "into_epoch", "position"),
    [
        ([8, 4, 4], 8, [4, 2, 2], 1, None, 4),  # an epoch end: 8 steps of epoch 0 are this fit's 4
        ([8, 4, 4], 12, [4, 2, 2], 2, None, 6),  # 8 + 4 whole steps are 4 + 2
        ([8, 4, 4], 10, [4, 2, 2], 1, 1, 5),  # 2 steps into epoch 1, one in this fit's steps
        ([8, 4], 16, [4, 2, 2, 2], 3, None, 8),  # past the old list's end: its last value holds
        (8.0, 16, [4, 2, 2], 2, None, 6),  # a fit without a scheduler resumed with one
    ],
)
def test_a_resume_converts_the_whole_epochs_each_at_its_own_length(
    old: float | list[float], restored: int, new: list[float], epochs_done: int, into_epoch: int | None, position: int
) -> None:
    sched = _restored(old, restored)
    sched.bind(20, steps_per_epoch=new, epochs_done=epochs_done, into_epoch=into_epoch)
    assert sched.last_epoch + sched.step_offset == position


def test_a_position_off_the_epochs_is_converted_by_the_epochs_it_covers() -> None:
    # no epoch count: 10 steps of [8, 4] are epoch 0 and half of epoch 1, this fit's 4 + 1
    sched = _restored([8, 4], 10)
    sched.bind(20, steps_per_epoch=[4, 2])
    assert sched.last_epoch + sched.step_offset == 5


def test_the_same_steps_per_epoch_at_another_accumulation_take_this_fits_steps_into_the_epoch() -> None:
    # 5 batches: accumulation 3 steps after batches 3, 5; accumulation 4 after 4, 5; resumed after batch 3 of epoch 2
    sched = _restored(2.0, 2 * 2 + 1)
    sched.bind(20, steps_per_epoch=2.0, epochs_done=2, into_epoch=0)
    assert sched.last_epoch + sched.step_offset == 4
    # the same accumulation: nothing moves
    same = _restored(2.0, 2 * 2 + 1)
    same.bind(20, steps_per_epoch=2.0, epochs_done=2, into_epoch=1)
    assert (same.last_epoch, same.step_offset) == (5, 0)


def test_an_empty_list_of_epoch_steps_is_refused() -> None:
    sched = _restored(2.0, 0)
    with pytest.raises(ValueError, match="`steps_per_epoch` is an empty sequence"):
        sched.bind(20, steps_per_epoch=[])
