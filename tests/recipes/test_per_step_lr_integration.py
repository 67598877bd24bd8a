"""PerStepLR + WarmupCosineLR from LightningCLI's ``lr_scheduler:`` block (optimizer injected, length from the fit)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_accel.callbacks import PerStepLR
from lightning_accel.cli import AccelCLI
from lightning_accel.recipes.lr import WarmupCosineLR
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
    probe = next(c for c in cli.trainer.callbacks if isinstance(c, LRProbe))
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
