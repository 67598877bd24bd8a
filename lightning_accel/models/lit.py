"""LightningModules around the reference networks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_accel.models.resnet import SmallResNet
from lightning_accel.models.transformer import GPT
from lightning_accel.recipes.callbacks import bind_to_fit
from lightning_accel.recipes.lr import WarmupCosineLR

__all__ = ["ImageClassifier", "TinyGPT"]


def _adamw_cosine(module: LightningModule, lr: float, weight_decay: float) -> Any:
    """AdamW + cosine decay to ``lr / 100`` over the whole fit (per step), the default both reference models use.

    The schedule is a :class:`~lightning_accel.recipes.lr.WarmupCosineLR` without warm-up (the cosine of torch's
    ``CosineAnnealingLR``, in closed form). Its length comes from the current fit, not from a checkpoint:
    ``configure_optimizers`` runs again on resume, and :func:`_bind_default_schedule` re-binds it at
    ``on_train_start``, after Lightning restored the checkpoint's scheduler state -- so an extended run (more
    ``max_epochs``) continues on the longer cosine, and a run resumed at another world size continues from the same
    progress fraction.
    """
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    try:  # `LightningModule.trainer` raises when no Trainer is attached (configure_optimizers called by hand)
        trainer = module.trainer if module.fabric is None else None  # under Fabric: a stand-in without the count
    except RuntimeError:
        trainer = None
    total = max(1, int(trainer.estimated_stepping_batches)) if trainer is not None else 1000
    sched = WarmupCosineLR(opt, total_steps=total, warmup_steps=0, min_lr=lr * 0.01)
    module.__dict__["_default_schedule"] = sched  # not an nn.Module attribute: kept out of state_dict/hparams
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _bind_default_schedule(module: LightningModule) -> None:
    """Re-bind the schedule :func:`_adamw_cosine` built to the current fit (at ``on_train_start``; see there)."""
    sched = module.__dict__.get("_default_schedule")
    if sched is None:
        return  # configure_optimizers replaced (LightningCLI `optimizer:`/`lr_scheduler:` blocks)
    if any(cfg.scheduler is sched for cfg in module.trainer.lr_scheduler_configs):
        bind_to_fit(sched, module.trainer, sched.total_steps_arg)


def _datamodule_image_size(module: LightningModule) -> int | None:
    """The side of the images the attached data module yields (``image_size``, or its decoder's ``size``), or None."""
    try:
        dm = getattr(module.trainer, "datamodule", None)  # set by the data connector, not declared on the class
    except RuntimeError:  # no Trainer attached
        return None
    for value in (getattr(dm, "image_size", None), getattr(getattr(dm, "decode", None), "size", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class ImageClassifier(LightningModule):
    """``SmallResNet`` trained with cross-entropy; logs ``train_loss``, ``val_loss``, ``val_acc``, ``test_acc``.

    Batches are ``(images, labels)`` with float images (N, C, H, W). Uses AdamW with per-step cosine decay unless a
    LightningCLI ``optimizer:``/``lr_scheduler:`` block replaces ``configure_optimizers``.

    Args:
        num_classes: number of classes.
        width: channels of the first stage.
        blocks: blocks per stage.
        lr: peak learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 32,
        blocks: Sequence[int] = (1, 1, 1),
        lr: float = 3e-3,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = SmallResNet(num_classes=num_classes, width=width, blocks=tuple(blocks))
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self.test_acc = MulticlassAccuracy(num_classes=num_classes)
        self.example_input_array = torch.zeros(2, 3, 64, 64)  # until `setup` sees the data's image size

    @override
    def setup(self, stage: str) -> None:
        """Size ``example_input_array`` (the model summary's input, the pruning trace) like the data module's images."""
        size = _datamodule_image_size(self)
        if size is not None:
            self.example_input_array = torch.zeros(2, 3, size, size)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=1)

    @override
    def configure_optimizers(self) -> Any:
        return _adamw_cosine(self, self.hparams["lr"], self.hparams["weight_decay"])

    @override
    def on_train_start(self) -> None:
        _bind_default_schedule(self)


class TinyGPT(LightningModule):
    """``GPT`` trained on next-token prediction; batches are int64 token tensors (B, T) or ``(tokens, ...)`` tuples.

    Logs ``train_loss`` and ``val_loss``. Pairs with :func:`lightning_accel.datasets.digits_tokens`.
    """

    def __init__(
        self,
        vocab_size: int = 27,
        block_size: int = 65,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: Any) -> torch.Tensor:
        tokens = batch[0] if isinstance(batch, (list, tuple)) else batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        return _adamw_cosine(self, self.hparams["lr"], self.hparams["weight_decay"])

    @override
    def on_train_start(self) -> None:
        _bind_default_schedule(self)
