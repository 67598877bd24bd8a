"""The parallel room's callbacks: :class:`ChoiceCheck` stops a run whose processes chose different strategies."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_accel._utils.rank import distributed_ready

__all__ = ["ChoiceCheck"]


class ChoiceCheck(Callback):
    """Stops a run whose processes chose different strategies (each process runs :meth:`AutoStrategy.resolve`).

    In ``setup`` (the process group is up, the model not yet wrapped) every rank shares its choice; if they differ,
    every rank raises the same error, so none waits forever in a collective the others never join.

    Args:
        strategy: this process's choice (``StrategyChoice.strategy``).
    """

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not distributed_ready():
            return
        names: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(names, self.strategy)
        if len(set(names)) > 1:
            by_rank = ", ".join(f"rank {i}: {n!r}" for i, n in enumerate(names))
            raise ValueError(
                f"AutoStrategy: the processes chose different strategies ({by_rank}), so they cannot train together. "
                f"Pass the strategy explicitly (`trainer.strategy: {names[0]}`), or set `device_memory_bytes` (and "
                "`inter_node_gbps` far from the logged 1-bit break-even) so every process decides the same."
            )
