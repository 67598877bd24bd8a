"""What the sharded and pipeline strategies share: optimizer unwrapping, optimizer state placement, precision name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor

__all__ = ["optimizers_to_device", "precision_name", "raw_optimizer"]


def optimizers_to_device(optimizers: Sequence[Any], device: torch.device) -> None:
    """Move every plain-tensor optimizer state to ``device`` (DTensor state stays where its mesh put it)."""
    for opt in optimizers:
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.device != device:
                    state[k] = v.to(device)


def precision_name(plugin: Precision) -> str:
    """The precision plugin's mode string (``"32-true"`` for a plugin that has none)."""
    return str(getattr(plugin, "precision", "32-true"))


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
