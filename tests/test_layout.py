"""The package's layout rules, checked on its source (AST; nothing of the package is imported).

1. Private Lightning and torch names are reached only in ``lightning_accel/_utils/compat.py``. A private name is the
   project's own when the package defines it somewhere (``self._x = ...``, ``def _x``, a class-level or module-level
   ``_x``, a ``__slots__`` entry, a ``_module``); any other ``x._name`` (or ``getattr(x, "_name")``) belongs to
   someone else, and so does a private method a class overrides from its Lightning / torch base.
2. Only the Lightning adapters (``datamodule.py``, ``strategy.py``, ``plugin.py``, ``callbacks.py``, ``cli.py``, or any
   module of a room's adapter package ``strategies/``, ``callbacks/``, ``plugins/``), the public namespaces
   (``callbacks/``, ``strategies/``, the package ``__init__``), the demo (``datasets/``, ``models/``) and the compat
   module import Lightning; every other module of a room is plain torch.
3. The rooms never import the demo, and a room imports no other room, with the two exceptions ``docs/architecture.md``
   states: ``precision/`` builds on ``ops/`` (the kernels its surgery installs), and any room may load a checkpoint
   through ``lightning_accel.checkpoint.read_checkpoint``.
4. Methods are replaced on live objects only through ``lightning_accel/_utils/patching.py``: elsewhere no attribute is
   assigned a lambda, a function of the enclosing scope or a bound method, no ``__class__`` is assigned, and no
   ``# type: ignore[method-assign]`` is needed.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_accel"
COMPAT = Path("_utils/compat.py")

FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
ROOMS = ("data", "precision", "comm", "checkpoint", "perf", "ops", "parallel", "recipes")
DEMO = ("lightning_accel.datasets", "lightning_accel.models")
#: the arrows between rooms that ``docs/architecture.md`` states: room -> rooms it may import whole
ROOM_ARROWS = {"precision": frozenset({"ops"})}
#: what any room may import from another: the one checkpoint loader (a delta manifest or a ``torch.save`` file, loaded
#: ``weights_only``-safe), from the room's namespace or the module that defines it
SHARED_ENTRY_POINTS = frozenset(
    {("lightning_accel.checkpoint", "read_checkpoint"), ("lightning_accel.checkpoint.reader", "read_checkpoint")}
)
ADAPTER_FILES = {"datamodule.py", "strategy.py", "plugin.py", "callbacks.py", "cli.py"}
LIGHTNING_FOLDERS = {"callbacks", "strategies", "datasets", "models", "tune"}
LIGHTNING_TOP_FILES = {Path("__init__.py"), Path("cli.py"), COMPAT}

PATCHING = Path("_utils/patching.py")
#: a room's sub-package that holds Lightning adapters (one per module), beside the fixed adapter file names
ADAPTER_PACKAGES = {"strategies", "callbacks", "plugins"}
#: underscore names that are documented public API of the standard library (namedtuple methods, ``os._exit``)
PUBLIC_UNDERSCORE = frozenset({"_asdict", "_replace", "_fields", "_field_defaults", "_make", "_exit"})

_ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def _sources() -> list[tuple[Path, str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no sources under {PACKAGE}"
    return [(f.relative_to(PACKAGE), f.read_text()) for f in files]


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(rel, ast.parse(text, filename=str(PACKAGE / rel))) for rel, text in _sources()]


def own_names(modules: Iterable[tuple[Path, ast.Module]]) -> set[str]:
    """Every private name the package itself defines: functions, methods and classes; module- and class-level names;
    attributes it sets on ``self`` / ``cls`` (``self._x = ...``, ``setattr(self, "_x", ...)``); ``__slots__``
    entries; its own ``_modules`` and ``_packages``."""
    names: set[str] = set()
    for rel, tree in modules:
        names.update(p.removesuffix(".py") for p in rel.parts if _private(p.removesuffix(".py")))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        names.update(_bound_names(item))
                        names.update(_slots(item))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and _on_self(sub.value):
                            names.add(sub.attr)
                    # `obj.__dict__["_x"] = ...`: an attribute the package stores on an object
                    if (
                        isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Attribute)
                        and t.value.attr == "__dict__"
                    ):
                        names.update(_strings(t.slice))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "setattr" and len(node.args) >= 2 and _on_self(node.args[0]):
                    names.update(_strings(node.args[1]))
                elif node.func.id == "type" and len(node.args) == 3:
                    names.update(_class_dict_keys(tree, node.args[2]))  # the attributes of a class made at runtime
        for item in tree.body:
            names.update(_bound_names(item))
    return {n for n in names if _private(n)}


def _class_dict_keys(tree: ast.Module, namespace: ast.expr) -> set[str]:
    """The string keys of ``type(name, bases, namespace)``'s namespace: a dict literal, or a name bound to one."""
    dicts = [namespace] if isinstance(namespace, ast.Dict) else []
    if isinstance(namespace, ast.Name):
        dicts = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == namespace.id for t in n.targets)
        ]
    return {s for d in dicts if isinstance(d, ast.Dict) for k in d.keys if k is not None for s in _strings(k)}


def _strings(node: ast.expr) -> set[str]:
    return {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()


def _on_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _bound_names(stmt: ast.stmt) -> set[str]:
    """Names a module- or class-level statement binds (``_x = ...``, ``_x: int``, ``_a, _b = ...``)."""
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    return {sub.id for t in targets for sub in ast.walk(t) if isinstance(sub, ast.Name)}


def _slots(stmt: ast.stmt) -> set[str]:
    if not (
        isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets)
    ):
        return set()
    return {c.value for c in ast.walk(stmt.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


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


def private_uses(rel: Path, tree: ast.Module, own: set[str]) -> list[str]:
    """Every place in one file that reaches a private name that is not the package's own (``own``, see
    :func:`own_names`): a Lightning / torch module or object's, or an attribute of an object it did not make."""
    found: list[str] = []
    for line, module, name in _imports(rel, tree):
        if not _is_framework(module):
            continue
        if any(_private(p) for p in module.split(".")):
            found.append(f"{rel}:{line}: imports the private module `{module}`")
        elif name is not None and _private(name):
            found.append(f"{rel}:{line}: imports the private `{module}.{name}`")
    roots = _framework_names(rel, tree)

    def foreign(attr: str) -> bool:
        return _private(attr) and attr not in own and attr not in PUBLIC_UNDERSCORE

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in roots:
                # a chain from a framework import: report it once, at its outermost attribute (inner nodes are walked
                # too); private there even when the package has a name of its own that reads the same
                if _private(chain[-1]) and not any(_private(p) for p in chain[1:-1]):
                    found.append(f"{rel}:{node.lineno}: reaches `{'.'.join(chain)}`")
            elif foreign(node.attr):
                found.append(f"{rel}:{node.lineno}: reaches `.{node.attr}`, which lightning_accel does not define")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS:
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                continue
            attr = node.args[1].value
            target = _chain(node.args[0])
            on_framework = target is not None and target[0] in roots
            if isinstance(attr, str) and ((on_framework and _private(attr)) or foreign(attr)):
                found.append(f"{rel}:{node.lineno}: `{node.func.id}(..., {attr!r})`")
        elif isinstance(node, ast.ClassDef):
            bases = [b for b in (_framework_class(rel, tree, base) for base in node.bases) if b is not None]
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or not _private(item.name):
                    continue
                owner = next((b for b in bases if hasattr(b, item.name)), None)
                if owner is not None:
                    found.append(
                        f"{rel}:{item.lineno}: `{node.name}` overrides the private `{owner.__name__}.{item.name}`"
                    )
    return found


def _framework_class(rel: Path, tree: ast.Module, base: ast.expr) -> Any:
    """The Lightning / torch class a base-class expression names through this file's imports (imported to ask it
    what it defines), or None."""
    chain = _chain(base)
    if chain is None:
        return None
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    if chain[0] not in bound or not _is_framework(bound[chain[0]]):
        return None
    parts = [*bound[chain[0]].split("."), *chain[1:]]
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) else None
    return None


def _may_import_lightning(rel: Path) -> bool:
    adapter_package = len(rel.parts) > 2 and rel.parts[0] in ROOMS and rel.parts[1] in ADAPTER_PACKAGES
    return (
        rel in LIGHTNING_TOP_FILES or rel.name in ADAPTER_FILES or rel.parts[0] in LIGHTNING_FOLDERS or adapter_package
    )


def _is_setattr(node: ast.AST) -> bool:
    """``setattr(obj, "<constant>", value)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
    )


_IGNORE_METHOD_ASSIGN = re.compile(r"#\s*type:\s*ignore\[[^\]]*method-assign")


def method_assignments(rel: Path, tree: ast.Module, source: str) -> list[str]:
    """Every place in one file that replaces a method on a live object by hand: an attribute assigned (or
    ``setattr``) a lambda, a function of an enclosing scope or a bound method (``self.<method>``,
    ``types.MethodType(...)``); an assignment to ``.__class__``; a ``# type: ignore[method-assign]``."""
    found = [
        f"{rel}:{i}: `# type: ignore[method-assign]`"
        for i, text in enumerate(source.splitlines(), 1)
        if _IGNORE_METHOD_ASSIGN.search(text)
    ]
    module_functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def why(value: ast.expr, functions: set[str], methods: set[str]) -> str | None:
        if isinstance(value, ast.Lambda):
            return "a lambda"
        if isinstance(value, ast.Name) and value.id in functions:
            return f"the function `{value.id}`"
        target = value.value if isinstance(value, ast.Attribute) else None
        if (
            isinstance(value, ast.Attribute)
            and isinstance(target, ast.Name)
            and _on_self(target)
            and value.attr in methods
        ):
            return f"the bound method `{target.id}.{value.attr}`"
        if isinstance(value, ast.Call) and (_chain(value.func) or [""])[-1] == "MethodType":
            return "a bound method"
        return None

    def visit(node: ast.AST, functions: set[str], methods: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = {n.name for n in ast.walk(child) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                visit(child, functions | (inner - {child.name}), methods)
                continue
            if isinstance(child, ast.ClassDef):
                own = {n.name for n in child.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                visit(child, functions, own)
                continue
            pairs: list[tuple[ast.expr, ast.expr | None]] = []
            if isinstance(child, ast.Assign):
                pairs = [(t, child.value) for t in child.targets]
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                pairs = [(child.target, child.value)]
            elif _is_setattr(child):
                assert isinstance(child, ast.Call) and isinstance(child.args[1], ast.Constant)
                name = str(child.args[1].value)
                if name == "__class__":
                    found.append(f"{rel}:{child.lineno}: `setattr(..., '__class__', ...)`")
                elif (reason := why(child.args[2], functions, methods)) is not None:
                    found.append(f"{rel}:{child.lineno}: `setattr(..., {name!r}, ...)` with {reason}")
            for target, value in pairs:
                if not isinstance(target, ast.Attribute):
                    continue
                if target.attr == "__class__":
                    found.append(f"{rel}:{target.lineno}: assigns `.__class__`")
                elif value is not None and (reason := why(value, functions, methods)) is not None:
                    found.append(f"{rel}:{target.lineno}: assigns `.{target.attr}` {reason}")
            visit(child, functions, methods)

    visit(tree, module_functions, set())
    return found


def test_private_framework_names_only_in_compat() -> None:
    modules = _modules()
    own = own_names(modules)
    found = [f for rel, tree in modules if rel != COMPAT for f in private_uses(rel, tree, own)]
    assert not found, (
        "Private Lightning/torch names outside lightning_accel/_utils/compat.py (use a public API, or add a named "
        "shim there with why and since which version, and a check in tests/_utils/test_compat.py):\n  "
        + "\n  ".join(found)
    )


def test_methods_are_replaced_only_through_patching() -> None:
    found = [
        f
        for rel, text in _sources()
        if rel != PATCHING
        for f in method_assignments(rel, ast.parse(text, filename=str(PACKAGE / rel)), text)
    ]
    assert not found, (
        "Methods replaced on live objects outside lightning_accel/_utils/patching.py (use `patch(obj, name, ...)`, "
        "restore it where the fit ends, and test that the original comes back; `swap_class` for `__class__`):\n  "
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
        "Only the Lightning adapters (datamodule.py, strategy.py, plugin.py, callbacks.py, cli.py, a room's "
        "strategies/, callbacks/ or plugins/ package), the public namespaces, the demo and _utils/compat.py may "
        "import Lightning; move the Lightning part into the room's adapter:\n  " + "\n  ".join(found)
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


def cross_room_imports(modules: Iterable[tuple[Path, ast.Module]]) -> list[str]:
    """Every import by a room of another room (or of the package's top level, which imports every room) that is not
    a stated arrow (:data:`ROOM_ARROWS`) or a shared entry point (:data:`SHARED_ENTRY_POINTS`)."""
    found = []
    for rel, tree in modules:
        room = rel.parts[0]
        if room not in ROOMS:
            continue
        for line, module, name in _imports(rel, tree):
            parts = module.split(".")
            if parts[0] != "lightning_accel":
                continue
            target = parts[1] if len(parts) > 1 else None
            if target is None and name in ROOMS:  # `from lightning_accel import ops`
                target, module, name = name, f"lightning_accel.{name}", None
            if target == room or target == "_utils":
                continue
            if target in ROOM_ARROWS.get(room, frozenset()) or (module, name) in SHARED_ENTRY_POINTS:
                continue
            full = f"{module}.{name}" if name else module
            found.append(f"{rel}:{line}: the `{room}` room imports `{full}`")
    return found


def test_rooms_do_not_import_each_other() -> None:
    found = cross_room_imports(_modules())
    assert not found, (
        "A room imports no other room (docs/architecture.md, 'Rooms are islands'); move what both need into "
        "_utils, or state the arrow there and in ROOM_ARROWS:\n  " + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "name", "refused"),
    [
        ("from lightning_accel.checkpoint.store import DeltaStore\n", "recipes/x.py", True),
        ("from lightning_accel.checkpoint import read_checkpoint\n", "recipes/x.py", False),
        ("from lightning_accel.checkpoint.reader import read_checkpoint\n", "data/x.py", False),
        ("from lightning_accel import data\n", "comm/x.py", True),
        ("from lightning_accel import CachedDataModule\n", "comm/x.py", True),
        ("import lightning_accel.perf.timers\n", "data/x.py", True),
        ("from ..comm import packing\n", "data/sub/x.py", False),  # lightning_accel.data.comm: its own sub-package
        ("from ...comm import packing\n", "data/sub/x.py", True),
        ("from lightning_accel.ops.norm.function import layer_norm\n", "precision/x.py", False),
        ("from lightning_accel.ops.norm.function import layer_norm\n", "recipes/x.py", True),
        ("from lightning_accel._utils.fs import open_store\n", "data/x.py", False),
        ("from lightning_accel.data import cache\n", "data/x.py", False),
        ("from lightning_accel.data import CachedDataModule\n", "tune/x.py", False),  # not a room: a composer
    ],
)
def test_cross_room_rule(source: str, name: str, refused: bool) -> None:
    assert bool(cross_room_imports([_snippet(source, name)])) is refused


def _snippet(source: str, name: str = "x.py") -> tuple[Path, ast.Module]:
    return Path(name), ast.parse(source)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\nx = torch._C", "reaches `torch._C`"),
        ("def f(s):\n    return s._cdata", "reaches `._cdata`, which lightning_accel does not define"),
        ("import torch\nx = torch.cuda.memory._dump_snapshot", "reaches `torch.cuda.memory._dump_snapshot`"),
        ("from torch.utils.data._utils.collate import default_collate", "private module"),
        ("from lightning.fabric.utilities.types import _PATH", "imports the private `lightning"),
        ("import torch._dynamo", "private module"),
        ("def f(t):\n    return t._accelerator_connector", "reaches `._accelerator_connector`"),
        ("def f(trainer):\n    return trainer._results", "reaches `._results`"),  # on no list: nobody defines it
        ("def f(m):\n    return getattr(m, '_trainer', None)", "getattr(..., '_trainer')"),
        ("import torch\ndef f():\n    return getattr(torch.cuda, '_lazy_init')", "getattr(..., '_lazy_init')"),
        (
            "from lightning.pytorch.strategies import DDPStrategy\n"
            "class S(DDPStrategy):\n    def _register_ddp_hooks(self):\n        pass",
            "`S` overrides the private `DDPStrategy._register_ddp_hooks`",
        ),
        (
            "from torch import nn\nclass M(nn.Module):\n    def _call_impl(self, *args):\n        pass",
            "`M` overrides the private `Module._call_impl`",
        ),
    ],
)
def test_the_private_name_check_catches(source: str, expected: str) -> None:
    rel, tree = _snippet(source)
    found = private_uses(rel, tree, own_names([(rel, tree)]))
    assert len(found) == 1 and expected in found[0], found


def test_the_private_name_check_leaves_our_own_names_alone() -> None:
    helpers = _snippet("def _shared():\n    pass\n_TABLE = {}\n", "room/_helpers.py")
    source = (
        "import torch\nfrom room import _helpers\n"
        "class A:\n    __slots__ = ('_slot',)\n    _level = 1\n"
        "    def __init__(self):\n        self._state = 0\n        setattr(self, '_late', 1)\n"
        "    def _helper(self, other):\n"
        "        return self._state, other._slot, A._level, other._helper(), getattr(other, '_late')\n"
        "    def version(self):\n        return torch.__version__\n"
        "class B(A):\n    def _helper(self, other):\n"
        "        return _helpers._shared(), _helpers._TABLE, other._asdict()\n"
        "def mark(m, cls):\n    m.__dict__['_claimed'] = True\n    attrs = {'_origin': cls}\n"
        "    return type('X', (cls,), attrs), getattr(m, '_claimed'), getattr(cls, '_origin')\n"
    )
    user = _snippet(source)
    assert private_uses(*user, own_names([helpers, user])) == []


def test_the_package_owns_its_names_and_not_lightnings() -> None:
    own = own_names(_modules())
    assert {"_clip_patch", "_helpers", "_utils", "_resolved", "_step_calls"} <= own
    assert not {"_accelerator_connector", "_register_ddp_hooks", "_data_parallel_size", "_materialize"} & own


@pytest.mark.parametrize(
    ("rel", "allowed"),
    [
        ("parallel/strategies/sharded.py", True),  # a room's adapter package
        ("comm/plugins/onebit.py", True),
        ("perf/callbacks/monitor.py", True),
        ("parallel/strategy.py", True),
        ("strategies/__init__.py", True),
        ("parallel/select.py", False),
        ("parallel/core/select.py", False),
        ("parallel/strategies.py", False),
        ("_utils/strategies/x.py", False),  # not a room
    ],
)
def test_adapter_files_and_packages_may_import_lightning(rel: str, allowed: bool) -> None:
    assert _may_import_lightning(Path(rel)) is allowed


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(m):\n    m.forward = lambda x: x", "assigns `.forward` a lambda"),
        ("def f(m):\n    def probe(x):\n        return x\n    m.forward = probe", "`.forward` the function `probe`"),
        (
            "def _clip(o, v):\n    pass\nclass S:\n    def setup(self):\n        self.plugin.clip_grad_by_norm = _clip",
            "assigns `.clip_grad_by_norm` the function `_clip`",
        ),
        (
            "class S:\n    def step(self):\n        pass\n    def setup(self, opt):\n        opt.step = self.step",
            "assigns `.step` the bound method `self.step`",
        ),
        ("import types\ndef f(o, g):\n    o.step = types.MethodType(g, o)", "assigns `.step` a bound method"),
        ("def f(m, cls):\n    m.__class__ = cls", "assigns `.__class__`"),
        ("def f(m, cls):\n    setattr(m, '__class__', cls)", "setattr(..., '__class__', ...)"),
        ("def f(m):\n    setattr(m, 'log', lambda *a: None)", "`setattr(..., 'log', ...)` with a lambda"),
        ("def f(m, g):\n    m.forward = g  # type: ignore[method-assign]", "`# type: ignore[method-assign]`"),
    ],
)
def test_the_method_assignment_check_catches(source: str, expected: str) -> None:
    found = method_assignments(Path("x.py"), ast.parse(source), source)
    assert len(found) == 1 and expected in found[0], found


def test_the_method_assignment_check_leaves_plain_assignments_alone() -> None:
    source = (
        "def helper():\n    pass\n"
        "class S:\n    def step(self):\n        pass\n"
        "    def setup(self, m, fn):\n        m.hook = fn\n        self.model = m.model\n        self.n = 3\n"
        "        self.result = helper()\n        self.other = m.step\n        m.fn = fn  # type: ignore[assignment]\n"
    )
    assert method_assignments(Path("x.py"), ast.parse(source), source) == []
