"""Mixed precision with fused operators: module surgery by policy (core) and ``FusedPrecision`` (Lightning adapter).

The core (:mod:`.surgery`, :mod:`.modules`) never imports Lightning; :class:`FusedPrecision` is resolved lazily.
"""

from __future__ import annotations

from lightning_accel._utils.lazy import lazy_getattr
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


# Lightning adapters, imported on first access so the core stays importable without Lightning's import cost
__getattr__ = lazy_getattr(
    __name__,
    {
        "FusedPrecision": "lightning_accel.precision.plugin",
    },
)
