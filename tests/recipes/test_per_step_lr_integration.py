"""PerStepLR + WarmupCosineLR from LightningCLI's ``lr_scheduler:`` block (optimizer injected, length from the fit)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.callbacks import PerStepLR
from lightning_accel.cli import AccelCLI
from lightning_accel.recipes.lr import WarmupCosineLR, warmup_cosine_value
from tests.tiny import LRProbe, classifier, loader, trainer

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  limit_train_batches: 4
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_accel.callbacks.PerStepLR
    - class_path: tests.tiny.LRProbe
model:
  class_path: lightning_accel.models.ImageClassifier
  init_args: {{width: 4}}
data:
  class_path: tests.tiny.TinyDigits
  init_args: {{batch_size: 32}}
optimizer:
  class_path: torch.optim.SGD
  init_args: {{lr: 0.1}}
lr_scheduler:
  class_path: lightning_accel.WarmupCosineLR
  init_args: {{warmup_fraction: 0.25, min_lr: 0.001}}
"""


def test_cli_lr_scheduler_block_runs_per_step(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(root=tmp_path))
    cli = AccelCLI(args=["fit", "--config", str(cfg)])
    callbacks: list[Any] = cli.trainer.callbacks  # type: ignore[attr-defined]
    probe = next(c for c in callbacks if isinstance(c, LRProbe))
    sched = cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR)
    assert sched.total_steps == 8 and sched.warmup_steps == 2  # 2 epochs x 4 batches, 25 % warm-up
    expected = [0.05, 0.1] + [0.001 + 0.099 * 0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    assert probe.lrs == pytest.approx(expected)  # one value per step, not per epoch


def test_warns_when_there_is_nothing_to_bind() -> None:
    m = classifier()  # its default schedule is a WarmupCosineLR: replace it by a plain optimizer
    m.configure_optimizers = lambda: torch.optim.SGD(m.parameters(), lr=0.1)  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="found no WarmupCosineLR"):
        trainer(callbacks=[PerStepLR()], limit_train_batches=1).fit(m, loader())


def _scheduled(interval: str, frequency: int) -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        config = {"scheduler": WarmupCosineLR(opt), "interval": interval, "frequency": frequency}
        return {"optimizer": opt, "lr_scheduler": config}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


@pytest.mark.parametrize(
    ("accumulate", "batches", "epochs", "max_steps", "steps"), [(1, 8, 1, -1, 4), (2, 7, 2, -1, 2), (1, 8, 3, 10, 5)]
)
def test_step_frequency_is_kept_and_the_schedule_spans_the_fit(
    accumulate: int, batches: int, epochs: int, max_steps: int, steps: int
) -> None:
    probe = LRProbe()
    t = trainer(
        callbacks=[PerStepLR(), probe],
        limit_train_batches=batches,
        max_epochs=epochs,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
    )
    t.fit(_scheduled("step", 2 if accumulate == 1 else 3), loader())
    cfg = t.lr_scheduler_configs[0]
    sched = cfg.scheduler
    assert cfg.interval == "step" and cfg.frequency == (2 if accumulate == 1 else 3)
    assert isinstance(sched, WarmupCosineLR)
    # bound to the steps Lightning takes at this frequency, so the cosine ends at `min_lr` with the fit
    assert sched.total_steps == steps and sched.last_epoch == steps
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0)
    if accumulate == 1:  # the rate changes every second batch
        assert probe.lrs[0::2] == probe.lrs[1::2]
        assert probe.lrs[0::2] == pytest.approx([0.05 * (1 + math.cos(math.pi * k / steps)) for k in range(steps)])


def test_epoch_frequency_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`interval` 'epoch' with `frequency` 2"):
        trainer(callbacks=[PerStepLR()]).fit(_scheduled("epoch", 2), loader())


def test_frequency_that_never_steps_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`frequency` 9 never steps it"):
        trainer(callbacks=[PerStepLR()], limit_train_batches=8).fit(_scheduled("step", 9), loader())
    # 0 divided Lightning's batch count (a ZeroDivisionError at the first step, or in PerStepLR's count before)
    with pytest.raises(ValueError, match=r"`frequency` must be an integer >= 1, got 0\. It is the WarmupCosineLR"):
        trainer(callbacks=[PerStepLR()], limit_train_batches=8).fit(_scheduled("step", 0), loader())


def _explicitly_scheduled(frequency: int) -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = WarmupCosineLR(opt, total_steps=4, warmup_steps=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": frequency}}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


def test_a_frequency_no_optimizer_step_meets_is_refused_with_the_positions() -> None:
    # 5 batches, accumulation 2: the optimizer steps after batches 2, 4 and 5, none a multiple of 3, though 3 <= 5
    t = trainer(callbacks=[PerStepLR()], limit_train_batches=5, accumulate_grad_batches=2)
    with pytest.raises(
        ValueError,
        match=r"`frequency` 3 never steps it: .* with `accumulate_grad_batches` 2 the optimizer steps after batches "
        r"2, 4, 5 of the epoch's 5, none a multiple of 3\. Use a `frequency` that divides one of those positions",
    ):
        t.fit(_scheduled("step", 3), loader())


def test_a_frequency_that_never_steps_is_refused_with_an_explicit_length() -> None:
    # `total_steps` given: the schedule would otherwise train the whole fit at its first warm-up rate
    probe = LRProbe()
    with pytest.raises(ValueError, match=r"`frequency` 9 never steps it: .* batches 1, 2, 3, 4, 5, 6, \.\.\. of"):
        trainer(callbacks=[PerStepLR(), probe], limit_train_batches=8).fit(_explicitly_scheduled(9), loader())
    assert probe.lrs == []


def _warmup_cosine_model() -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": WarmupCosineLR(opt, warmup_steps=2, min_lr=0.001)}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


@pytest.mark.parametrize(
    ("batch_size", "start", "steps"),
    [
        (16, 3, 29),  # 16 batches per epoch now: the 13 left of epoch 0 (Lightning resumes at batch 3), then 16
        (64, 3, 5),  # 4 batches per epoch now: the 1 left of epoch 0, then 4
    ],
)
def test_a_resume_mid_epoch_at_another_batch_size_ends_at_min_lr_with_the_fit(
    tmp_path: Path, batch_size: int, start: int, steps: int
) -> None:
    # 2 epochs of 8 batches of 32; resumed from the checkpoint after 3 steps of epoch 0
    first = trainer(
        callbacks=[PerStepLR(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)],
        enable_checkpointing=True,
        limit_train_batches=None,
        max_epochs=2,
    )
    first.fit(_warmup_cosine_model(), loader(32, 256))
    probe = LRProbe()
    t = trainer(callbacks=[PerStepLR(), probe], limit_train_batches=None, max_epochs=2)
    t.fit(_warmup_cosine_model(), loader(batch_size, 256), ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR)
    total = 2 * 256 // batch_size
    assert sched.total_steps == total and len(probe.lrs) == steps and start + steps == total
    # the 3 steps taken stay 3 steps (not 3 x 8/4 or 3 x 8/16): the cosine ends with the fit, no step at min_lr
    expected = [warmup_cosine_value(start + k, 0.1, total, 2, 0.001) for k in range(steps)]
    assert probe.lrs == pytest.approx(expected, rel=1e-9)
    assert probe.lrs[-1] > 0.001 and t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)
