"""Channel-group discovery: which output channels of a network can be removed together, found through ``torch.fx``.

Functional core (plain torch + ``torch.fx``, no Lightning), the first half of structured pruning
(:mod:`~lightning_accel.recipes.prune` does the surgery):

1. **Trace** the model with ``torch.fx`` and propagate the shapes of an example input (``ShapeProp``, in eval mode
   and without gradients, so BatchNorm statistics are untouched).
2. **Find channel groups**: every ``Conv1d/2d/3d`` (``groups == 1``) and ``Linear`` output starts a *channel space*.
   A space flows unchanged through BatchNorm (which indexes it), activations, dropout, pooling over other dims than
   its own (a ``MaxPool1d`` over a ``Linear``'s features mixes them) and flattening of ``C x 1 x 1`` maps; it ends in
   the conv/linear layers that consume it. Element-wise ops between two spaces (a residual ``out + identity``)
   **merge** them into one group, so residual adds stay shape-consistent: the conv2/bn2 of a ResNet block and its
   downsample conv/bn are pruned with the same channel indices. A space that reaches
   anything else -- the graph's output (the logits), an input, ``cat``, a general ``view``, an unknown module, a
   grouped conv, a module called twice, one with tied weights or one whose weight is computed (a parametrization
   such as ``weight_norm`` / ``spectral_norm``) -- is left alone.

Entry point: :func:`find_channel_groups`.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from lightning_accel._utils.checks import renamed_argument
from lightning_accel._utils.errors import one_line

__all__ = [
    "CONV_TYPES",
    "NORM_TYPES",
    "ChannelGroup",
    "Layer",
    "Norm",
    "UntraceableModelError",
    "check_module_names",
    "find_channel_groups",
]

#: the convolutions a channel group can slice (``groups == 1`` only)
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: the norms that index a producer's output channels
NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
# the layers a channel group slices: producers and consumers, and the norms that follow a producer
Layer = nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.Linear
Norm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm
_PASS_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.ELU,
    nn.Mish,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)
_F = torch.nn.functional
_PASS_FUNCTIONS: set[Any] = {
    _F.relu,
    _F.relu6,
    _F.leaky_relu,
    _F.gelu,
    _F.silu,
    _F.elu,
    _F.hardswish,
    _F.dropout,
    _F.max_pool2d,
    _F.avg_pool2d,
    _F.adaptive_avg_pool2d,
    _F.adaptive_max_pool2d,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    torch.relu_,
    operator.neg,
}
#: the trailing dims each pooling op of the pass lists reduces (``MaxPool1d``: the last one, ``*2d``: the last two): a
#: channel dim among them is mixed with its neighbours (a ``MaxPool1d`` over a ``Linear``'s features), not passed
_POOLED_DIMS: dict[Any, int] = {
    **{cls: int(cls.__name__[-2]) for cls in _PASS_MODULES if "Pool" in cls.__name__},  # the digit of `MaxPool2d`
    _F.max_pool2d: 2,
    _F.avg_pool2d: 2,
    _F.adaptive_avg_pool2d: 2,
    _F.adaptive_max_pool2d: 2,
}
_PASS_METHODS = {"relu", "relu_", "sigmoid", "tanh", "contiguous", "clone", "detach", "float", "half", "to", "neg"}
_BINARY_FUNCTIONS: set[Any] = {
    operator.add,
    operator.iadd,
    operator.sub,
    operator.mul,
    operator.imul,
    operator.truediv,
    torch.add,
    torch.sub,
    torch.mul,
}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_"}
_FLATTEN = {torch.flatten}
_RESHAPE_METHODS = {"view", "reshape", "squeeze", "flatten"}
_SHAPE_QUERIES = {"size", "dim", "numel"}
_SHAPE_FUNCTIONS: set[Any] = {getattr, len}


@dataclass
class ChannelGroup:
    """Channels that must be removed together, and the layers indexed by them.

    Attributes:
        size: current number of channels.
        producers: ``(name, module)`` whose output channels (weight dim 0) these are.
        followers: ``(name, BatchNorm)`` whose features these are.
        consumers: ``(name, module)`` whose input channels (weight dim 1) these are.
        normalized: producer name -> the BatchNorm applied directly to its output (used to fold the norm's scale
            into the producer's filters when ranking channels).
    """

    size: int
    producers: list[tuple[str, Layer]] = field(default_factory=list)
    followers: list[tuple[str, Norm]] = field(default_factory=list)
    consumers: list[tuple[str, Layer]] = field(default_factory=list)
    normalized: dict[str, Norm] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Producer names (how a group is identified in reports)."""
        return [n for n, _ in self.producers]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []
        self.blocked: list[str | None] = []

    def new(self, blocked: str | None = None) -> int:
        self.parent.append(len(self.parent))
        self.blocked.append(blocked)
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            if self.blocked[ra] is None:
                self.blocked[ra] = self.blocked[rb]
        return ra

    def block(self, i: int, reason: str) -> None:
        r = self.find(i)
        if self.blocked[r] is None:
            self.blocked[r] = reason


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None


def _squeeze_map(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> int | None:
    """Where channel dim ``dim`` of ``in_shape`` lands in ``out_shape`` if the reshape only adds/drops size-1 dims."""
    if in_shape[dim] == 1:
        return None
    ins = [s for s in in_shape if s != 1]
    outs = [s for s in out_shape if s != 1]
    if ins != outs:
        return None
    rank = sum(1 for s in in_shape[:dim] if s != 1)
    seen = 0
    for i, s in enumerate(out_shape):
        if s != 1:
            if seen == rank:
                return i
            seen += 1
    return None


class UntraceableModelError(TypeError):
    """torch.fx cannot trace the model to prune (data-dependent control flow, ...); ``reason`` is the tracer's error
    in one line."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _trace(model: nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
    try:
        tracer = torch.fx.Tracer()
        graph = tracer.trace(model)
        gm = torch.fx.GraphModule(tracer.root, graph)
    except Exception as e:
        reason = f"{type(e).__name__}: {one_line(e)}"
        children = [name for name, _ in model.named_children()]
        raise UntraceableModelError(
            f"Structured pruning could not trace `{type(model).__name__}` with torch.fx ({reason}). Prune a traceable "
            f"submodule instead (its children: {children}), or keep data-dependent control flow out of its forward.",
            reason=reason,
        ) from e
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
    finally:
        for m, t in modes.items():
            m.train(t)
    return gm


def check_module_names(
    arg: str, names: str | Iterable[str] | None, model: nn.Module | None = None
) -> tuple[str, ...] | None:
    """``names`` (module names such as ``ignore_modules``) as a tuple, checked; None stays None.

    A lone string is one name (``"fc1"``, not ``("f", "c", "1")``). With ``model``, every name must be one of its
    ``named_modules()``: a misspelt name would otherwise protect nothing, silently.

    Args:
        arg: the argument's name, for the error message.
        names: a module name or an iterable of them.
        model: the module the names are relative to (None: not checked against a model yet).

    Raises:
        TypeError: ``names`` neither a string nor an iterable, or an entry that is not a string.
        ValueError: (with ``model``) names that are not modules of ``model``, all of them in one line.
    """
    if names is None:
        return None
    if not isinstance(names, (str, Iterable)):
        raise TypeError(
            f"`{arg}` must be a module name or a list of them (strings), got {names!r} ({type(names).__name__}). "
            "Pass names from `named_modules()`, e.g. ['fc1']."
        )
    out = (names,) if isinstance(names, str) else tuple(names)
    bad_type = [n for n in out if not isinstance(n, str)]
    if bad_type:
        raise TypeError(
            f"`{arg}` must hold module names (strings), got {bad_type[0]!r} ({type(bad_type[0]).__name__}). Pass names "
            "from `named_modules()`, e.g. ['fc1']."
        )
    if "" in out:
        # `named_modules()` names the module itself "": as a name to ignore it means all of the model or none of it
        example = f"e.g. {_some_names(model)}" if model is not None else "e.g. 'model.fc'"
        raise ValueError(
            f"`{arg}` holds '' (got {list(out)!r}), the name of the pruned module itself, not of a layer to keep "
            f"whole. Name its submodules instead ({example}), or drop the callback to prune nothing."
        )
    if model is not None:
        known = [name for name, _ in model.named_modules() if name]
        unknown = [n for n in out if n not in known]
        if unknown:
            close = {n: difflib.get_close_matches(n, known, n=3, cutoff=0.6) for n in unknown}
            hints = "; ".join(f"{n!r}: did you mean {', '.join(map(repr, c))}?" for n, c in close.items() if c)
            raise ValueError(
                f"`{arg}` names modules that {type(model).__name__} does not have: {unknown}"
                f"{f' ({hints})' if hints else ''}. Pass names from its `named_modules()` (e.g. {_some_names(model)})."
            )
    return out


def _some_names(model: nn.Module) -> str:
    """A few submodule names of ``model``, for an error message."""
    return ", ".join(repr(name) for name, _ in list(model.named_modules())[1:7])


def find_channel_groups(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | torch.Tensor,
    *,
    ignore_modules: Iterable[str] = (),
    ignore: Iterable[str] | None = None,
) -> tuple[list[ChannelGroup], list[tuple[str, str]]]:
    """Trace ``model`` and return its prunable channel groups, plus ``(layer, reason)`` for conv/linear layers skipped.

    Args:
        model: the network (any ``nn.Module`` torch.fx can trace; a LightningModule works if its ``forward`` does).
        example_inputs: inputs for one forward pass (a tensor or a tuple of positional args), on the model's device.
        ignore_modules: names of modules whose output channels must not be pruned (one name alone: a string).
        ignore: deprecated spelling of ``ignore_modules`` (same values).

    Raises:
        ValueError: an ``ignore_modules`` name that is not in ``model.named_modules()``.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    ignore_modules = check_module_names("ignore_modules", ignore_modules) or ()
    ignore_modules = renamed_argument(
        "ignore_modules", ignore_modules, "ignore", check_module_names("ignore", ignore), new_given=bool(ignore_modules)
    )
    check_module_names("ignore_modules", ignore_modules, model)  # before tracing: a typo fails fast
    gm = _trace(model, tuple(example_inputs))
    flow = _ChannelFlow(dict(model.named_modules()), set(ignore_modules))
    for node in gm.graph.nodes:
        flow.visit(node)
    flow.block_shared_layers(model)
    return flow.groups()


class _ChannelFlow:
    """One walk over a traced graph: the channel spaces, where each flows, and why some cannot be pruned.

    A *space* is one layer output's channel dimension; ``info`` says which space (and which dim) a node's value
    carries; the union-find merges spaces coupled by element-wise ops and records the first reason one is blocked.
    """

    def __init__(self, modules: dict[str, nn.Module], ignore: set[str]) -> None:
        self.modules = modules
        self.ignore = ignore
        self.uf = _UnionFind()
        self.info: dict[torch.fx.Node, tuple[int, int]] = {}  # node -> (space, channel dim)
        self.space_size: dict[int, int] = {}
        self.producers: dict[int, list[tuple[str, Layer]]] = {}
        self.followers: dict[int, list[tuple[str, Norm]]] = {}
        self.consumers: dict[int, list[tuple[str, Layer]]] = {}
        self.normalized: dict[str, Norm] = {}  # producer name -> the BatchNorm reading its output directly
        self.touched: dict[str, list[int]] = {}  # module name -> spaces it indexes
        self.calls: dict[str, int] = {}
        self.exposed: set[str] = set()  # modules whose parameters are read directly (get_attr): tied or reused

    # ------------------------------------------------------------------------------------------- bookkeeping
    def new_space(self, node: torch.fx.Node, dim: int, blocked: str | None = None) -> None:
        shape = _shape(node)
        if shape is None:
            return
        s = self.uf.new(blocked)
        self.space_size[s] = shape[dim] if 0 <= dim < len(shape) else 0
        self.info[node] = (s, dim)

    def block_args(self, node: torch.fx.Node, reason: str) -> None:
        for a in node.all_input_nodes:
            if a in self.info:
                self.uf.block(self.info[a][0], reason)

    def _touch(self, space: int, name: str) -> None:
        self.touched.setdefault(name, []).append(space)

    # ------------------------------------------------------------------------------------------- the graph walk
    def visit(self, node: torch.fx.Node) -> None:
        """Follow the channel spaces through one node (nodes come in topological order)."""
        shape = _shape(node)
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        x = self.info.get(args[0]) if args else None
        if node.op == "placeholder":
            if shape is not None:
                self.new_space(node, 1 if len(shape) >= 2 else 0, blocked="model input")
        elif node.op == "get_attr":
            self.exposed.add(str(node.target).rpartition(".")[0])
        elif node.op == "output":
            self.block_args(node, "model output")
        elif node.op == "call_module":
            self._call_module(node, shape, args, x)
        else:  # call_function / call_method
            self._call_function(node, shape, args, x)

    def _call_module(
        self, node: torch.fx.Node, shape: tuple[int, ...] | None, args: list[torch.fx.Node], x: tuple[int, int] | None
    ) -> None:
        name = str(node.target)
        m = self.modules.get(name)
        self.calls[name] = self.calls.get(name, 0) + 1
        computed = _computed_tensors(m) if isinstance(m, (*CONV_TYPES, nn.Linear, *NORM_TYPES)) else []
        if computed:
            # slicing `weight` of a weight-normalised layer would slice a copy the next forward recomputes from the
            # unsliced originals (old-style hook: the forward fails), or reset the originals in place behind the
            # optimizer's back (a parametrization: its momentum keeps the old shape and the next step fails)
            reason = f"`{name}` computes its {' and '.join(computed)} (a parametrization or weight_norm)"
            self.block_args(node, reason)
            if shape is not None:
                self.new_space(node, 1 if len(shape) >= 2 else 0, blocked=reason)
            if node in self.info and isinstance(m, (*CONV_TYPES, nn.Linear)):
                # a producer of a blocked space: listed in `skipped` with the reason
                self.producers.setdefault(self.info[node][0], []).append((name, m))
        elif isinstance(m, CONV_TYPES) and type(m) in CONV_TYPES and m.groups == 1 and shape is not None:
            self._layer(node, name, m, x, reads=1, writes=1)
        elif isinstance(m, nn.Linear) and shape is not None:
            in_shape = _shape(args[0]) if args else None
            reads = len(in_shape) - 1 if in_shape is not None else None
            self._layer(node, name, m, x, reads=reads, writes=len(shape) - 1)
        elif isinstance(m, NORM_TYPES) and x is not None and x[1] == 1:
            self.followers.setdefault(x[0], []).append((name, m))
            src = str(args[0].target) if args[0].op == "call_module" else None
            if src is not None and any(n == src for n, _ in self.producers.get(x[0], [])):
                self.normalized[src] = m
            self._touch(x[0], name)
            self.info[node] = x
        elif isinstance(m, _PASS_MODULES) and x is not None:
            _pass(node, x, args[0], self.info, self.uf, pooled=_POOLED_DIMS.get(type(m), 0))
        elif isinstance(m, nn.Flatten) and x is not None:
            _flatten(node, x, args[0], self.info, self.uf)
        else:
            self.block_args(node, f"used by {type(m).__name__} `{name}`")
            if shape is not None:
                self.new_space(node, 1 if len(shape) >= 2 else 0, blocked=f"output of `{name}`")

    def _layer(
        self, node: torch.fx.Node, name: str, m: Layer, x: tuple[int, int] | None, reads: int | None, writes: int
    ) -> None:
        """A conv/linear layer: it consumes its input's space along dim ``reads`` (None: unknown, left as it is)
        and produces a new space along dim ``writes`` of its output."""
        if x is not None and reads is not None:
            if x[1] == reads:
                self.consumers.setdefault(x[0], []).append((name, m))
                self._touch(x[0], name)
            else:
                self.uf.block(x[0], f"{name} reads another dim")
        self.new_space(node, writes, blocked="ignored" if name in self.ignore else None)
        if node in self.info:
            s = self.info[node][0]
            self.producers.setdefault(s, []).append((name, m))
            self._touch(s, name)

    def _call_function(
        self, node: torch.fx.Node, shape: tuple[int, ...] | None, args: list[torch.fx.Node], x: tuple[int, int] | None
    ) -> None:
        fn = node.target
        is_method = node.op == "call_method"
        if (fn in _PASS_METHODS if is_method else fn in _PASS_FUNCTIONS) and x is not None:
            _pass(node, x, args[0], self.info, self.uf, pooled=0 if is_method else _POOLED_DIMS.get(fn, 0))
        elif (fn in _BINARY_METHODS if is_method else fn in _BINARY_FUNCTIONS) and shape is not None:
            _binary(node, shape, self.info, self.uf)
        elif (fn == "flatten" if is_method else fn in _FLATTEN) and x is not None:
            _flatten(node, x, args[0], self.info, self.uf)
        elif is_method and fn in _RESHAPE_METHODS and x is not None:
            in_shape = _shape(args[0])
            d = _squeeze_map(in_shape, shape, x[1]) if in_shape is not None and shape is not None else None
            if d is None:
                self.uf.block(x[0], f"reshaped by {fn}")
            else:
                self.info[node] = (x[0], d)
        elif (fn in _SHAPE_QUERIES) if is_method else (fn in _SHAPE_FUNCTIONS):
            pass  # shape queries read no channel values
        else:
            self.block_args(node, f"used by {getattr(fn, '__name__', fn)}")
            if shape is not None:
                self.new_space(node, 1 if len(shape) >= 2 else 0, blocked="untracked op")

    # ------------------------------------------------------------------------------------------- the result
    def block_shared_layers(self, model: nn.Module) -> None:
        """Block layers that cannot be sliced independently: called twice, parameters read elsewhere, tied."""
        owners: dict[int, list[str]] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), []).append(name)
        tied = {n for names in owners.values() if len(set(names)) > 1 for n in names}
        for name, spaces in self.touched.items():
            reason = None
            if self.calls.get(name, 0) > 1:
                reason = f"`{name}` is called {self.calls[name]} times"
            elif name in self.exposed or name in tied:
                reason = f"`{name}` shares or exposes its parameters"
            if reason:
                for s in spaces:
                    self.uf.block(s, reason)

    def groups(self) -> tuple[list[ChannelGroup], list[tuple[str, str]]]:
        """Merged spaces with at least one producer: the prunable groups, and ``(layer, reason)`` for the others."""
        merged: dict[int, ChannelGroup] = {}
        for s in sorted(self.space_size):
            g = merged.setdefault(self.uf.find(s), ChannelGroup(size=self.space_size[s]))
            g.producers += self.producers.get(s, [])
            g.followers += self.followers.get(s, [])
            g.consumers += self.consumers.get(s, [])
            g.normalized.update({n: self.normalized[n] for n, _ in self.producers.get(s, []) if n in self.normalized})
        groups, skipped = [], []
        for r, g in merged.items():
            if not g.producers:
                continue
            reason = self.uf.blocked[r]
            if reason is None and not _consistent(g):
                reason = "layers disagree on the channel count"
            if reason is not None:
                skipped += [(n, reason) for n in g.names]
                continue
            groups.append(g)
        return groups, skipped


def _computed_tensors(m: nn.Module) -> list[str]:
    """The tensors among ``weight``, ``bias`` and the running statistics that ``m`` computes instead of holding them
    as its own parameters or buffers: a parametrization (``torch.nn.utils.parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``) or the older ``torch.nn.utils.weight_norm`` hook. Pruning can slice only what a
    layer holds."""
    held = {n for n, _ in m.named_parameters(recurse=False)} | {n for n, _ in m.named_buffers(recurse=False)}
    names = ("weight", "bias", "running_mean", "running_var")
    return [n for n in names if isinstance(getattr(m, n, None), torch.Tensor) and n not in held]


def _pass(
    node: torch.fx.Node, x: tuple[int, int], src: torch.fx.Node, info: dict, uf: _UnionFind, *, pooled: int = 0
) -> None:
    """An op that keeps each channel apart: the output carries the input's channel space along the same dim, if the
    op keeps that dim's size and (a pooling op, ``pooled`` > 0) does not pool over it."""
    in_shape, out_shape = _shape(src), _shape(node)
    if in_shape is not None and pooled and x[1] >= len(in_shape) - pooled:
        # pooling reduces the last `pooled` dims: a channel dim among them is mixed across channels, even where the
        # size stays (stride 1, padding), so removing a channel would change its neighbours' values
        uf.block(x[0], f"pooled along the channel dim by `{getattr(node.target, '__name__', node.target)}`")
        return
    if (
        in_shape is not None
        and out_shape is not None
        and len(in_shape) == len(out_shape)
        and in_shape[x[1]] == out_shape[x[1]]
    ):
        info[node] = x
        return
    uf.block(x[0], f"changed by {node.target}")


def _flatten(node: torch.fx.Node, x: tuple[int, int], src: torch.fx.Node, info: dict, uf: _UnionFind) -> None:
    in_shape, out_shape = _shape(src), _shape(node)
    d = _squeeze_map(in_shape, out_shape, x[1]) if in_shape is not None and out_shape is not None else None
    if d is None or in_shape is None or out_shape is None or len(out_shape) > len(in_shape):
        uf.block(x[0], "flattened with other dims")
    else:
        info[node] = (x[0], d)


def _binary(node: torch.fx.Node, shape: tuple[int, ...], info: dict, uf: _UnionFind) -> None:
    """Element-wise op: operands that carry channels along the same output dim are merged (residual adds)."""
    # the operands, positional or keyword (`torch.add(out, other=identity)`): a residual given by keyword must merge too
    operands = [*node.args, *node.kwargs.values()]
    tensors = [(a, a_shape) for a in operands if isinstance(a, torch.fx.Node) and (a_shape := _shape(a)) is not None]
    out_dim: int | None = None
    for a, a_shape in tensors:
        if a in info:
            _, d = info[a]
            if a_shape[d] > 1:
                out_dim = d + len(shape) - len(a_shape)
                break
    if out_dim is None:
        for a, _ in tensors:
            if a in info:
                uf.block(info[a][0], "element-wise op without a channel dim")
        return
    space: int | None = None
    for a, a_shape in tensors:
        k = out_dim - (len(shape) - len(a_shape))
        size = a_shape[k] if 0 <= k < len(a_shape) else 1
        if size == 1:
            continue  # broadcast along the channels: not coupled
        if a in info and info[a][1] == k:
            space = info[a][0] if space is None else uf.union(space, info[a][0])
        else:
            for b, _ in tensors:
                if b in info:
                    uf.block(info[b][0], "element-wise op with an untracked tensor")
            return
    if space is not None:
        info[node] = (uf.find(space), out_dim)


def _consistent(g: ChannelGroup) -> bool:
    sizes = {g.size}
    sizes |= {int(m.weight.shape[0]) for _, m in g.producers}
    sizes |= {m.num_features for _, m in g.followers}
    sizes |= {int(m.weight.shape[1]) for _, m in g.consumers}
    return len(sizes) == 1
