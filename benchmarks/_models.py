"""The toy models the benchmark scripts share: small enough for 2 CPU cores, each shaped for what it measures.

- :func:`mlp` / :class:`MLP`: fully connected layers with ReLU between them (checkpoint saves, DDP communication).
- :class:`ConvNet`: two 3x3 convolutions and a linear head (per-step overhead of a callback).
- :class:`SmallCNN`: strided convolutions behind a 4x average pool, SGD + per-step cosine decay (data-bound epochs).
- :class:`VarLenGPT`: GPT blocks on random inputs of the length each batch names (CUDA allocator fragmentation).
- :class:`GPT2LM`: :func:`lightning_accel.models.gpt2.gpt2_lm` (a GPT-2-style LM as an ``nn.Sequential``: embedding,
  blocks with a packed ``attn.c_attn`` q/k/v projection, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``, a head tied to
  the embedding) trained on next-token cross entropy.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_accel.models.gpt2 import gpt2_lm

__all__ = ["GPT2LM", "MLP", "ConvNet", "SmallCNN", "VarLenGPT", "mlp"]


def mlp(*widths: int) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), ReLU, ..., Linear(widths[-2], widths[-1])`` (no activation after the last)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


class MLP(pl.LightningModule):
    """:func:`mlp` on ``(x, y)`` batches, trained by ``loss`` with Adam or SGD.

    Args:
        widths: the layer widths, input first.
        loss: ``"cross_entropy"`` (``y``: class indices) or ``"mse"`` (``y``: targets shaped like the output).
        optimizer: ``"adam"`` or ``"sgd"``.
        lr: the learning rate.
        momentum: SGD's momentum.
        seed: ``torch.manual_seed(seed)`` right before the layers are built (``None``: the current generator).
    """

    def __init__(
        self,
        *widths: int,
        loss: Literal["cross_entropy", "mse"] = "cross_entropy",
        optimizer: Literal["adam", "sgd"] = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.net = mlp(*widths)
        self.loss, self.optimizer, self.lr, self.momentum = loss, optimizer, lr, momentum

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        return F.cross_entropy(out, y) if self.loss == "cross_entropy" else F.mse_loss(out, y)

    @override
    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class _Classifier(pl.LightningModule):
    """``self.net`` (set by the subclass) trained on ``(x, y)`` batches with cross entropy."""

    net: nn.Module

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


class ConvNet(_Classifier):
    """Two ``width``-channel 3x3 convolutions, global average pool, a 10-way linear head; AdamW."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 10),
        )

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SmallCNN(_Classifier):
    """A few strided convolutions: cheap enough per sample that JPEG decoding, not compute, sets the pace.

    Logs ``val_acc`` (synchronised across processes); SGD with momentum and a per-step cosine decay to 0.
    """

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        # 4x average pooling first: the digits are smooth, and the cheap step is what lets decoding set the pace
        self.net = nn.Sequential(
            nn.AvgPool2d(4),
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, batch_size=len(y))

    @override
    def configure_optimizers(self) -> Any:
        # the ResNet recipe users run (SGD with momentum): ddp_1bit compresses the momentum itself
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        # cosine decay to 0 over the fit, per step (the usual recipe): with a constant lr the final val_acc swings
        # between epochs in both arms, so "final accuracy" would measure the swing, not the arm
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class VarLenGPT(pl.LightningModule):
    """``layers`` GPT blocks on ``randn(batch, length, dim)``, ``length`` read from each (one-number) batch; AdamW."""

    def __init__(self, dim: int, heads: int, layers: int, batch: int) -> None:
        super().__init__()
        from lightning_accel.models import GPTBlock

        self.batch, self.dim = batch, dim
        self.blocks = nn.Sequential(*[GPTBlock(dim, heads) for _ in range(layers)])

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        length = int(batch[0])
        x = torch.randn(self.batch, length, self.dim, device=self.device)
        return self.blocks(x).float().square().mean()

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class GPT2LM(pl.LightningModule):
    """:func:`gpt2_lm` trained on next-token cross entropy with AdamW at a constant learning rate.

    Batches are ``(tokens, index)``: ``tokens`` of shape ``(batch, seq + 1)``, ``index`` the samples' dataset
    indices (so a callback can count which samples one step trained on). Logs ``train_loss``.
    """

    def __init__(
        self, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4, width: int = 32, lr: float = 1e-2
    ) -> None:
        super().__init__()
        self.net = gpt2_lm(vocab, seq, layers, heads, width)
        self.lr, self.seq = lr, seq
        self.example_input_array = torch.zeros(2, seq, dtype=torch.long)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        out = self(tokens[:, :-1])
        loss = F.cross_entropy(out.reshape(-1, out.size(-1)).float(), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
