"""Public namespace of every strategy (re-exports only), so ``class_path: lightning_accel.strategies.<Name>`` stays
short and stable; each strategy lives in its room (``comm/strategy.py``, ``parallel/strategies/``)."""

from lightning_accel.comm.strategy import CHECKPOINT_KEY, LocalStepsStrategy, OneBitDDPStrategy
from lightning_accel.parallel.strategies import AutoStrategy, PipelineStrategy, ShardedStrategy

__all__ = [
    "CHECKPOINT_KEY",
    "AutoStrategy",
    "LocalStepsStrategy",
    "OneBitDDPStrategy",
    "PipelineStrategy",
    "ShardedStrategy",
]


def __dir__() -> list[str]:
    # tab completion and `dir()` show the public names, not the sub-packages and helpers imported above
    return __all__
