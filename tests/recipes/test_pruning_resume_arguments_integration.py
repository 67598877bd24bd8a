"""StructuredPruning resumed with other arguments than its checkpoint's, and schedules given as a string."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.callbacks import StructuredPruning
from lightning_accel.recipes import schedule_amounts
from tests.tiny import classifier, loader, trainer


def _pruned_once(tmp_path: Path) -> Path:
    """A 1-epoch fit that prunes a quarter of the channels at epoch 0 of ``schedule=[0, 1]``; its last checkpoint."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = classifier(width=8)
    cb = StructuredPruning(0.5, schedule=[0, 1])
    trainer(callbacks=[cb, ckpt], enable_checkpointing=True, default_root_dir=tmp_path, limit_train_batches=2).fit(
        model, loader()
    )
    assert model.model.layers[0].conv1.out_channels == 6  # 8 -> 6: a quarter removed
    return tmp_path / "last.ckpt"


@pytest.mark.parametrize(("amount", "channels"), [(0.75, 2), (0.5, 4), (0.25, 6)])
def test_a_resume_with_another_amount_reaches_that_amount_and_says_so(
    tmp_path: Path, amount: float, channels: int
) -> None:
    """The remaining steps were planned as if the epochs already pruned had removed the new amount's share: 0.75
    after a step of 0.5's plan stopped at 5/8 removed, neither amount, without a word."""
    last = _pruned_once(tmp_path)
    model = classifier(width=8)
    cb = StructuredPruning(amount, schedule=[0, 1])
    fit = trainer(callbacks=[cb], max_epochs=2, limit_train_batches=2)
    if amount == 0.5:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fit.fit(model, loader(), ckpt_path=last)  # the same amount: the plan and the result as without the resume
        assert not [w for w in seen if "StructuredPruning: the checkpoint" in str(w.message)]
    else:
        with pytest.warns(UserWarning, match=r"StructuredPruning: the checkpoint pruned epochs \[0\].*`amount` 0\.5"):
            fit.fit(model, loader(), ckpt_path=last)
    assert cb.done == [0, 1]
    assert model.model.layers[0].conv1.out_channels == channels  # of 8: 75 %, 50 % removed; 25 % was already reached
    assert model.model.layers[1].conv1.out_channels == 2 * channels


def test_schedule_amounts_from_a_fraction_already_removed() -> None:
    assert schedule_amounts(0.75, 1, removed=0.25) == pytest.approx([2 / 3])  # 0.75 of 4 left -> 1 left of 4
    assert schedule_amounts(0.5, 2, removed=0.25) == pytest.approx([1 - 0.625 / 0.75, 1 - 0.5 / 0.625])
    assert schedule_amounts(0.25, 2, removed=0.5) == [0.0, 0.0]  # nothing grows back
    assert schedule_amounts(0.5, 3, removed=0.0) == pytest.approx(schedule_amounts(0.5, 3))
    with pytest.raises(ValueError, match=r"^`removed` must be a number >= 0 and < 1, got 1.0"):
        schedule_amounts(0.5, 2, removed=1.0)


@pytest.mark.parametrize("schedule", ["12", "1"])
def test_a_schedule_given_as_a_string_is_refused_quoting_it(schedule: str) -> None:
    """``"12"`` was read character by character: the error quoted ``'1'``, a value the caller never gave."""
    with pytest.raises(
        TypeError, match=rf"^`schedule` must be an epoch index >= 0 or a list of them, got '{schedule}'"
    ):
        StructuredPruning(0.5, schedule=schedule)  # type: ignore[arg-type]
