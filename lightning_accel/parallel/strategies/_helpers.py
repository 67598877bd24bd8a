"""What the sharded and pipeline strategies share: optimizer unwrapping, optimizer state placement, precision name,
and the batch gathered over a model-parallel group (``batch_split="world"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor

from lightning_accel.parallel.plans import BATCH_SPLITS

__all__ = ["BATCH_SPLITS", "gather_batch", "optimizers_to_device", "precision_name", "raw_optimizer"]


def gather_batch(batch: Any, group: Any) -> Any:
    """Every tensor of ``batch`` (nested tuples / lists / dicts) concatenated along dim 0 over the ranks of ``group``,
    in rank order (rows of unequal counts are padded for the collective and trimmed after); other values are this
    rank's. Collective: every rank of ``group`` calls it with the same structure."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return batch

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return t
        n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
        counts = [torch.zeros_like(n) for _ in range(size)]
        dist.all_gather(counts, n, group=group)
        rows = [int(c) for c in counts]
        padded = t
        if t.shape[0] < max(rows):
            padded = torch.cat([t, t.new_zeros((max(rows) - t.shape[0], *t.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:r] for p, r in zip(parts, rows, strict=True)])

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return gather(x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        if isinstance(x, dict):
            return type(x)({k: walk(v) for k, v in x.items()})
        return x

    return walk(batch)


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
