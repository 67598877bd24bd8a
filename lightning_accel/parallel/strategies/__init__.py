"""The parallel room's Lightning strategies, one per module: :class:`AutoStrategy` (``auto.py``),
:class:`ShardedStrategy` (``sharded.py``), :class:`PipelineStrategy` (``pipeline.py``)."""

from __future__ import annotations

from lightning_accel.parallel.strategies.auto import AutoStrategy, resolve_trainer_kwargs, trainer_devices
from lightning_accel.parallel.strategies.pipeline import PipelineStrategy
from lightning_accel.parallel.strategies.sharded import ShardedStrategy

__all__ = ["AutoStrategy", "PipelineStrategy", "ShardedStrategy", "resolve_trainer_kwargs", "trainer_devices"]
