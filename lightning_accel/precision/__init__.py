"""Mixed precision with fused operators: module surgery by policy (core) and ``FusedPrecision`` (Lightning adapter).

The core (:mod:`.surgery`, :mod:`.modules`) never imports Lightning; :class:`FusedPrecision` is resolved lazily.
"""

from __future__ import annotations

from typing import Any

from lightning_accel.precision.surgery import (
    DEFAULT_POLICY,
    FusionRecord,
    FusionReport,
    Replacement,
    apply_fusions,
    replace_optimizer_params,
)

__all__ = [
    "DEFAULT_POLICY",
    "FusedPrecision",
    "FusionRecord",
    "FusionReport",
    "Replacement",
    "apply_fusions",
    "replace_optimizer_params",
]


def __getattr__(name: str) -> Any:
    if name == "FusedPrecision":
        from lightning_accel.precision.plugin import FusedPrecision

        return FusedPrecision
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
