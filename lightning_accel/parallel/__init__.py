"""Choosing and running the parallelism: memory estimates, ``select_strategy`` (rules, memory, timed trials), the
FSDP2 / tensor-parallel plans (``ShardedStrategy``) and pipeline parallelism (``PipelineStrategy``).

The core (``estimate``, ``select``, ``plans``, ``pipeline``, ``trials``) never imports Lightning; its Lightning
adapters are the strategies in ``strategies/`` (one per module) and ``ChoiceCheck`` in ``callbacks.py``.
"""

from __future__ import annotations

from lightning_accel.parallel.estimate import (
    ActivationProfile,
    MemoryEstimate,
    count_layers,
    estimate_ddp,
    estimate_fsdp,
    estimate_pipeline,
    largest_unit_params,
    measure_activation_bytes,
    pipeline_stage_params,
)
from lightning_accel.parallel.select import StrategyChoice, onebit_break_even_gbps, select_strategy
from lightning_accel.parallel.strategies import AutoStrategy, PipelineStrategy, ShardedStrategy

__all__ = [
    "ActivationProfile",
    "AutoStrategy",
    "MemoryEstimate",
    "PipelineStrategy",
    "ShardedStrategy",
    "StrategyChoice",
    "count_layers",
    "estimate_ddp",
    "estimate_fsdp",
    "estimate_pipeline",
    "largest_unit_params",
    "measure_activation_bytes",
    "onebit_break_even_gbps",
    "pipeline_stage_params",
    "select_strategy",
]
