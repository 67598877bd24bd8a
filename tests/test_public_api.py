"""Every public name resolves, and ``import lightning_accel`` registers the strategy alias."""

from __future__ import annotations

import importlib

import pytest

import lightning_accel


@pytest.mark.parametrize("package", ["lightning_accel", "lightning_accel.callbacks"])
def test_every_public_name_resolves(package: str) -> None:
    mod = importlib.import_module(package)
    assert mod.__all__ and sorted(dir(mod)) == sorted(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        mod.NotAThing  # noqa: B018


def test_strategy_alias_registered_on_import() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert lightning_accel.__version__
    assert dict.get(StrategyRegistry, "ddp_1bit")["strategy"] is lightning_accel.OneBitDDPStrategy
