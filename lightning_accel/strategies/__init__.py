"""Lightning adapters of :mod:`lightning_accel.comm`: ``OneBitDDPStrategy`` (``strategy="ddp_1bit"``)."""

from lightning_accel.strategies.onebit import CHECKPOINT_KEY, OneBitDDPStrategy

__all__ = ["CHECKPOINT_KEY", "OneBitDDPStrategy", "register_strategies"]


def register_strategies() -> None:
    """Register ``"ddp_1bit"`` in Lightning's ``StrategyRegistry`` (idempotent; runs on ``import lightning_accel``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "ddp_1bit" not in StrategyRegistry:
        OneBitDDPStrategy.register_strategies(StrategyRegistry)
