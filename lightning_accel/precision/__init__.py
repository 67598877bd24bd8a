"""Mixed precision with fused operators: module surgery by policy (core) and ``FusedPrecision`` (Lightning adapter).

The core (:mod:`.surgery`, :mod:`.modules`) never imports Lightning; :class:`FusedPrecision` (``plugin.py``) is
the adapter.
"""

from __future__ import annotations

from lightning_accel.precision.plugin import FusedPrecision
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

