"""Every public name resolves, the namespaces hold every plugin, callback and strategy the rooms define, moved names
warn, and ``import lightning_accel`` registers the strategy aliases."""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import CheckpointIO, Precision
from lightning.pytorch.strategies import Strategy

import lightning_accel

NAMESPACES = ["lightning_accel", "lightning_accel.callbacks", "lightning_accel.plugins", "lightning_accel.strategies"]

#: Callbacks the package adds itself and a user never lists (a strategy's own consistency check).
INTERNAL_CALLBACKS = {"ChoiceCheck"}


@pytest.mark.parametrize("package", NAMESPACES)
def test_every_public_name_resolves(package: str) -> None:
    mod = importlib.import_module(package)
    assert mod.__all__ and sorted(dir(mod)) == sorted(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        mod.NotAThing  # noqa: B018


def _room_exports() -> dict[str, object]:
    """Every name in the ``__all__`` of every module of the rooms (the demo and the namespaces excluded)."""
    found: dict[str, object] = {}
    for info in pkgutil.walk_packages(lightning_accel.__path__, "lightning_accel."):
        parts = info.name.split(".")
        if parts[1] in {"callbacks", "plugins", "strategies", "datasets", "models", "cli"} or parts[1].startswith("_"):
            continue
        if parts[-1] == "__main__":
            continue
        mod = importlib.import_module(info.name)
        for name in getattr(mod, "__all__", ()):
            found.setdefault(name, getattr(mod, name))
    return found


@pytest.mark.parametrize(
    ("namespace", "base"),
    [("callbacks", Callback), ("plugins", (CheckpointIO, Precision)), ("strategies", Strategy)],
)
def test_each_namespace_holds_every_public_class_of_its_kind(namespace: str, base: type | tuple[type, ...]) -> None:
    mod = importlib.import_module(f"lightning_accel.{namespace}")
    defined = {
        name
        for name, obj in _room_exports().items()
        if isinstance(obj, type) and issubclass(obj, base) and name not in INTERNAL_CALLBACKS
    }
    assert defined, f"no {namespace} found in the rooms"
    assert defined <= set(mod.__all__), (
        f"missing from lightning_accel.{namespace}: {sorted(defined - set(mod.__all__))}"
    )
    top = set(lightning_accel.__all__)
    assert defined <= top, f"missing from lightning_accel: {sorted(defined - top)}"


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("DigitsDataModule", "lightning_accel.datasets"),
        ("materialize_digits", "lightning_accel.datasets"),
        ("ImageClassifier", "lightning_accel.models"),
        ("TinyGPT", "lightning_accel.models"),
        ("OneBitState", "lightning_accel.comm"),
        ("onebit_hook", "lightning_accel.comm"),
    ],
)
def test_demo_and_internals_left_the_top_level_but_still_resolve_with_a_warning(name: str, home: str) -> None:
    assert name not in lightning_accel.__all__
    with pytest.warns(DeprecationWarning, match=rf"`lightning_accel\.{name}` is deprecated.*from {home} import {name}"):
        obj = getattr(lightning_accel, name)
    assert obj is getattr(importlib.import_module(home), name)


def test_public_names_resolve_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in lightning_accel.__all__:
            getattr(lightning_accel, name)


def test_strategy_alias_registered_on_import() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert lightning_accel.__version__
    assert dict.get(StrategyRegistry, "ddp_1bit")["strategy"] is lightning_accel.OneBitDDPStrategy
    assert dict.get(StrategyRegistry, "pipeline")["strategy"] is lightning_accel.PipelineStrategy


_REF = re.compile(r":(?:class|func|meth|mod|data|attr|exc):`~?(lightning_accel(?:\.\w+)+)`")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_cross_reference_in_the_docstrings_resolves() -> None:
    root = Path(lightning_accel.__file__).parent
    broken = [
        f"{path.relative_to(root.parent)}: {ref}"
        for path in sorted(root.rglob("*.py"))
        for ref in sorted(set(_REF.findall(path.read_text())))
        if not _resolves(ref)
    ]
    assert not broken, "cross-references to names that do not exist:\n" + "\n".join(broken)
