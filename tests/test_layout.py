"""The package's layout rules, checked on its source (AST, nothing imported).

1. Private Lightning and torch names are reached only in ``lightning_accel/_utils/compat.py``.
2. Only the Lightning adapters (``datamodule.py``, ``strategy.py``, ``plugin.py``, ``callbacks.py``, ``cli.py``), the
   public namespaces (``callbacks/``, ``strategies/``, the package ``__init__``), the demo (``datasets/``,
   ``models/``) and the compat module import Lightning; every other module of a room is plain torch.
3. The rooms never import the demo.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_accel"
COMPAT = Path("_utils/compat.py")

FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
ROOMS = ("data", "precision", "comm", "checkpoint", "perf", "ops", "parallel", "recipes")
DEMO = ("lightning_accel.datasets", "lightning_accel.models")
ADAPTER_FILES = {"datamodule.py", "strategy.py", "plugin.py", "callbacks.py", "cli.py"}
LIGHTNING_FOLDERS = {"callbacks", "strategies", "datasets", "models"}
LIGHTNING_TOP_FILES = {Path("__init__.py"), Path("cli.py"), COMPAT}

#: Private attributes of Lightning and torch objects (reached on instances, so no import shows them). A name here is
#: refused anywhere but compat: as ``x.<name>``, as ``getattr(x, "<name>")`` and friends, and as an overriding method.
PRIVATE_ATTRIBUTES = frozenset(
    {
        # Lightning: Trainer, strategies, LightningModule, LightningOptimizer, LightningCLI
        "_accelerator_connector",
        "_checkpoint_io",
        "_ddp_kwargs",
        "_fabric",
        "_instantiate_trainer",
        "_launcher",
        "_layer_sync",
        "_optimizer",
        "_parse_ckpt_path",
        "_register_ddp_hooks",
        "_trainer",
        # torch: nn.Module, DDP, DataLoader, storages, GradScaler, LR schedulers, CUDA allocator
        "_buffers",
        "_call_impl",
        "_cdata",
        "_compiled_call_impl",
        "_get_closed_form_lr",
        "_get_ddp_logging_data",
        "_iterator",
        "_last_lr",
        "_modules",
        "_new_shared",
        "_parameters",
        "_record_memory_history",
        "_scale",
        "_set_allocator_settings",
        "_set_ddp_runtime_logging_sample_rate",
        "_shutdown_workers",
        "_snapshot",
        "_storage_Use_Count",
        "_typed_storage",
        "_accelerator_setAllocatorSettings",
    }
)

_ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def _modules() -> list[tuple[Path, ast.Module]]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no sources under {PACKAGE}"
    return [(f.relative_to(PACKAGE), ast.parse(f.read_text(), filename=str(f))) for f in files]


def _absolute(rel: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved against ``rel``'s package)."""
    if not node.level:
        return node.module or ""
    package = ["lightning_accel", *rel.parent.parts]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(rel: Path, tree: ast.Module) -> Iterator[tuple[int, str, str | None]]:
    """``(line, module, imported name or None)`` for every import in the file, lazy ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(rel, node)
            for alias in node.names:
                yield node.lineno, module, alias.name


def _framework_names(rel: Path, tree: ast.Module) -> set[str]:
    """Local names bound to torch / Lightning modules or objects by this file's imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_framework(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_framework(node.module or ""):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ``["a", "b", "c"]``; None when the chain does not start at a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(rel: Path, tree: ast.Module) -> list[str]:
    """Every place in one file that reaches a private Lightning / torch name."""
    found: list[str] = []
    for line, module, name in _imports(rel, tree):
        if not _is_framework(module):
            continue
        if any(_private(p) for p in module.split(".")):
            found.append(f"{rel}:{line}: imports the private module `{module}`")
        elif name is not None and _private(name):
            found.append(f"{rel}:{line}: imports the private `{module}.{name}`")
    roots = _framework_names(rel, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{rel}:{node.lineno}: reaches `.{node.attr}`")
                continue
            chain = _chain(node)
            # report each chain once, at its outermost attribute (inner nodes are walked too)
            if chain and chain[0] in roots and _private(chain[-1]) and not any(_private(p) for p in chain[1:-1]):
                found.append(f"{rel}:{node.lineno}: reaches `{'.'.join(chain)}`")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS:
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                continue
            attr = node.args[1].value
            target = _chain(node.args[0])
            on_framework = target is not None and target[0] in roots
            if isinstance(attr, str) and (attr in PRIVATE_ATTRIBUTES or (on_framework and _private(attr))):
                found.append(f"{rel}:{node.lineno}: `{node.func.id}(..., {attr!r})`")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in PRIVATE_ATTRIBUTES:
                    found.append(f"{rel}:{item.lineno}: `{node.name}` overrides the private `{item.name}`")
    return found


def _may_import_lightning(rel: Path) -> bool:
    return rel in LIGHTNING_TOP_FILES or rel.name in ADAPTER_FILES or (rel.parts[0] in LIGHTNING_FOLDERS)


def test_private_framework_names_only_in_compat() -> None:
    found = [f for rel, tree in _modules() if rel != COMPAT for f in private_uses(rel, tree)]
    assert not found, (
        "Private Lightning/torch names outside lightning_accel/_utils/compat.py (use a public API, or add a named "
        "shim there with why and since which version, and a check in tests/_utils/test_compat.py):\n  "
        + "\n  ".join(found)
    )


def test_only_adapters_import_lightning() -> None:
    found = [
        f"{rel}:{line}: imports `{module}`"
        for rel, tree in _modules()
        if not _may_import_lightning(rel)
        for line, module, _ in _imports(rel, tree)
        if module.split(".")[0] in LIGHTNING
    ]
    assert not found, (
        "Only the Lightning adapters (datamodule.py, strategy.py, plugin.py, callbacks.py, cli.py), the public "
        "namespaces, the demo and _utils/compat.py may import Lightning; move the Lightning part into the room's "
        "adapter:\n  " + "\n  ".join(found)
    )


def test_rooms_do_not_import_the_demo() -> None:
    found = []
    for rel, tree in _modules():
        if rel.parts[0] not in ROOMS:
            continue
        for line, module, name in _imports(rel, tree):
            full = f"{module}.{name}" if name else module
            if any(full == d or full.startswith(d + ".") for d in DEMO):
                found.append(f"{rel}:{line}: imports `{full}`")
    assert not found, (
        "The rooms must not depend on the demo (lightning_accel.datasets / lightning_accel.models); move what they "
        "need into the room or _utils:\n  " + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\nx = torch._C", "reaches `torch._C`"),
        ("def f(s):\n    return s._cdata", "reaches `._cdata`"),
        ("import torch\nx = torch.cuda.memory._dump_snapshot", "reaches `torch.cuda.memory._dump_snapshot`"),
        ("from torch.utils.data._utils.collate import default_collate", "private module"),
        ("from lightning.fabric.utilities.types import _PATH", "imports the private `lightning"),
        ("import torch._dynamo", "private module"),
        ("def f(t):\n    return t._accelerator_connector", "reaches `._accelerator_connector`"),
        ("def f(m):\n    return getattr(m, '_trainer', None)", "getattr(..., '_trainer')"),
        ("import torch\ndef f():\n    return getattr(torch.cuda, '_lazy_init')", "getattr(..., '_lazy_init')"),
        ("class S:\n    def _register_ddp_hooks(self):\n        pass", "overrides the private `_register_ddp_hooks`"),
    ],
)
def test_the_private_name_check_catches(source: str, expected: str) -> None:
    found = private_uses(Path("x.py"), ast.parse(source))
    assert len(found) == 1 and expected in found[0], found


def test_the_private_name_check_leaves_our_own_names_alone() -> None:
    source = (
        "import torch\nfrom lightning_accel._utils import compat\n"
        "class A:\n    def _helper(self):\n        return self._state, torch.__version__, compat._x\n"
    )
    assert private_uses(Path("x.py"), ast.parse(source)) == []
