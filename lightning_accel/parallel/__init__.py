"""Choosing the parallelism: memory estimates (DDP, FSDP/ZeRO-3, pipeline) and ``select_strategy``.

The core (``estimate``, ``select``) never imports Lightning; ``AutoStrategy`` (the Lightning adapter that resolves the
choice when ``fit`` starts, for LightningCLI) is imported lazily.
"""

from __future__ import annotations

from typing import Any

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

__all__ = [
    "ActivationProfile",
    "AutoStrategy",
    "MemoryEstimate",
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


def __getattr__(name: str) -> Any:
    if name == "AutoStrategy":
        from lightning_accel.parallel.strategy import AutoStrategy

        return AutoStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
