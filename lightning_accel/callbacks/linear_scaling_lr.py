"""``LinearScalingLR``: the linear scaling rule as a callback (thin adapter over :mod:`lightning_accel.recipes.lr`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_accel.recipes.lr import apply_lr_scale, linear_scaling_factor

__all__ = ["LinearScalingLR"]


def _loader_batch_size(obj: Any) -> int | None:
    if isinstance(obj, DataLoader):
        if obj.batch_size is not None:
            return int(obj.batch_size)
        bs = getattr(obj.batch_sampler, "batch_size", None)
        return int(bs) if bs is not None else None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        for o in obj:
            bs = _loader_batch_size(o)
            if bs is not None:
                return bs
    return None


class LinearScalingLR(Callback):
    """Scale every optimizer's learning rate by ``global_batch / base_batch_size`` once, at the start of training.

    ``global_batch = per-device batch x devices x nodes x accumulate_grad_batches``. The per-device batch is read
    from the training DataLoader (``batch_size``) unless ``batch_size`` is given. Schedulers created in
    ``configure_optimizers`` are scaled along (their base rates), so warm-up and cosine follow the scaled peak.

    Idempotent across resume: the factor applied is stored in each param group (saved with the optimizer state) and in
    this callback's ``state_dict``; resuming with the same setup changes nothing, resuming with a different global
    batch (e.g. more devices) rescales by the ratio of the two factors. The factor is logged as ``lr_scale/factor``
    and ``lr_scale/global_batch_size``.

    Args:
        base_batch_size: the global batch size the configured learning rate was tuned for.
        batch_size: per-device batch size (``None``: read it from the train DataLoader).

    Raises:
        ValueError: a non-positive ``base_batch_size``/``batch_size``, or a per-device batch size that cannot be found.
    """

    def __init__(self, base_batch_size: int, batch_size: int | None = None) -> None:
        linear_scaling_factor(1, base_batch_size)  # validates
        if batch_size is not None:
            linear_scaling_factor(batch_size, 1)
        self.base_batch_size = int(base_batch_size)
        self.batch_size = batch_size
        self.factor: float | None = None
        self.global_batch_size: int | None = None
        self._restored_factor: float | None = None

    def global_batch(self, trainer: Trainer) -> int:
        """``per-device batch x devices x nodes x accumulate_grad_batches`` for ``trainer``'s current fit."""
        per_device = self.batch_size if self.batch_size is not None else _loader_batch_size(trainer.train_dataloader)
        if per_device is None:
            raise ValueError(
                "LinearScalingLR could not read the per-device batch size from the train DataLoader "
                f"({type(trainer.train_dataloader).__name__}). Pass `batch_size=` to LinearScalingLR."
            )
        return int(per_device) * trainer.num_devices * trainer.num_nodes * trainer.accumulate_grad_batches

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.global_batch_size = self.global_batch(trainer)
        self.factor = linear_scaling_factor(self.global_batch_size, self.base_batch_size)
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        for opt in trainer.optimizers:
            apply_lr_scale(opt, self.factor, schedulers, fallback_applied=self._restored_factor or 1.0)
        lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
        rank_zero_info(
            f"LinearScalingLR: global batch {self.global_batch_size} / base {self.base_batch_size} -> learning rates "
            f"x{self.factor:g} (now {[float(f'{lr:.4g}') for lr in lrs]})."
        )
        metrics = {"lr_scale/factor": self.factor, "lr_scale/global_batch_size": float(self.global_batch_size)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "base_batch_size": self.base_batch_size,
            "global_batch_size": self.global_batch_size,
            "factor": self.factor,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_factor = state_dict.get("factor")
        self.factor = self._restored_factor
        self.global_batch_size = state_dict.get("global_batch_size")
