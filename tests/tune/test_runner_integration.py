"""The trial probe in a Trainer: what it records per optimizer step (gradient accumulation included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accel.tune.runner import TrialProbe
from tests import tiny


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_probe_records_and_saves_once_per_optimizer_step(tmp_path: Path, accumulate: int) -> None:
    probe = TrialProbe(warmup=2, steps=4, ckpt_dir=str(tmp_path))
    trainer = tiny.trainer(
        max_epochs=-1, max_steps=7, limit_train_batches=8, accumulate_grad_batches=accumulate, callbacks=[probe]
    )
    saves: list[str] = []
    save = trainer.save_checkpoint

    def spy(path: Any, *args: Any, **kwargs: Any) -> None:
        saves.append(Path(path).name)
        save(path, *args, **kwargs)

    trainer.save_checkpoint = spy  # type: ignore[method-assign]
    trainer.fit(tiny.classifier(), tiny.loader())
    # the starts of steps 2..6 (one per optimizer step, not one per batch of its window); one warm-up and one timed save
    assert len(probe.starts) == 5 and saves == ["warm.ckpt", "step4.ckpt"]
    assert probe.save_step == 1 and probe.steps_per_epoch == 8 // accumulate  # the epoch's saves amortise over steps
    assert len(probe.losses) == 7 * accumulate  # every batch's loss
