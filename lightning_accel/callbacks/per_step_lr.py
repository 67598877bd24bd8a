"""``PerStepLR``: run ``WarmupCosineLR`` schedules per optimizer step and bind their length to the fit."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel.recipes.lr import WarmupCosineLR

__all__ = ["PerStepLR"]


class PerStepLR(Callback):
    """Make every :class:`~lightning_accel.recipes.lr.WarmupCosineLR` of the fit step per batch, with a known length.

    LightningCLI's ``lr_scheduler:`` block returns the scheduler without an interval, so Lightning would step it once
    per *epoch*; and the YAML cannot know the number of optimizer steps. At ``on_train_start`` this callback sets the
    interval of each ``WarmupCosineLR`` to ``"step"`` and binds those created without ``total_steps`` to
    ``trainer.estimated_stepping_batches`` (``max_epochs`` x batches per epoch / ``accumulate_grad_batches``, or
    ``max_steps``). Resumed schedules keep their restored length. Other schedulers are left alone.
    """

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        found = 0
        for cfg in trainer.lr_scheduler_configs:
            if isinstance(cfg.scheduler, WarmupCosineLR):
                found += 1
                cfg.interval = "step"
                cfg.frequency = 1
                if not cfg.scheduler.bound:
                    cfg.scheduler.bind(trainer.estimated_stepping_batches)
        if not found:
            rank_zero_warn("PerStepLR found no WarmupCosineLR scheduler in this fit; it changed nothing.")
