"""``lightning-accel tune``: measure each lever on the user's own job, one at a time, keep what pays, write the config.

A composer like the CLI (it imports the rooms). The functional core (:mod:`lightning_accel.tune.core`: the decision
rule, the numerics check, the fingerprint cache, the budget) is plain Python; :mod:`lightning_accel.tune.levers` edits
job configs; :mod:`lightning_accel.tune.runner` runs a Lightning trial; :mod:`lightning_accel.tune.tuner` is the loop.
See ``docs/tune.md``.
"""

from lightning_accel.tune.core import (
    DEFAULT_MARGIN,
    TOLERANCES,
    Budget,
    Decision,
    Numerics,
    TrialResult,
    TuneCache,
    check_numerics,
    decide,
    fingerprint,
    lever_order,
    parse_duration,
    tolerance,
)
from lightning_accel.tune.tuner import GUARD_CLASS_PATH, TuneResult, exhaustive, load_job, tune, tune_job

__all__ = [
    "DEFAULT_MARGIN",
    "GUARD_CLASS_PATH",
    "TOLERANCES",
    "Budget",
    "Decision",
    "Numerics",
    "TrialResult",
    "TuneCache",
    "TuneResult",
    "check_numerics",
    "decide",
    "exhaustive",
    "fingerprint",
    "lever_order",
    "load_job",
    "parse_duration",
    "tolerance",
    "tune",
    "tune_job",
]
