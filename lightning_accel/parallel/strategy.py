"""Compatibility path: the parallel room's strategies live one per module in :mod:`lightning_accel.parallel.strategies`
and its callback in :mod:`lightning_accel.parallel.callbacks`; this module re-exports them under the names the package
namespaces, the CLI and existing ``class_path:`` strings use."""

from __future__ import annotations

from lightning_accel.parallel.callbacks import ChoiceCheck
from lightning_accel.parallel.strategies import (
    AutoStrategy,
    PipelineStrategy,
    ShardedStrategy,
    resolve_trainer_kwargs,
    trainer_devices,
)

__all__ = [
    "AutoStrategy",
    "ChoiceCheck",
    "PipelineStrategy",
    "ShardedStrategy",
    "resolve_trainer_kwargs",
    "trainer_devices",
]
