"""Mixed precision with fused operators: module surgery by policy (core) and ``FusedPrecision`` (Lightning adapter).

The core (:mod:`.surgery`, :mod:`.modules`) never imports Lightning; :class:`FusedPrecision` (``plugin.py``) is
the adapter. Block-level fusions apply to classes registered with :func:`register_block` (torchvision's ResNet blocks
are registered already).
"""

from __future__ import annotations

from lightning_accel.precision.modules import register_block
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
    "register_block",
    "replace_optimizer_params",
]
