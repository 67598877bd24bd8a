"""Structured pruning that physically removes channels: smaller weights, fewer FLOPs, not masks.

Functional core (plain torch + ``torch.fx``, no Lightning). The algorithm:

1. **Trace** the model with ``torch.fx`` and propagate the shapes of an example input (``ShapeProp``, in eval mode
   and without gradients, so BatchNorm statistics are untouched).
2. **Find channel groups**: every ``Conv1d/2d/3d`` (``groups == 1``) and ``Linear`` output starts a *channel space*.
   A space flows unchanged through BatchNorm (which indexes it), activations, dropout, pooling and flattening of
   ``C x 1 x 1`` maps; it ends in the conv/linear layers that consume it. Element-wise ops between two spaces
   (a residual ``out + identity``) **merge** them into one group, so residual adds stay shape-consistent: the conv2/bn2
   of a ResNet block and its downsample conv/bn are pruned with the same channel indices. A space that reaches
   anything else -- the graph's output (the logits), an input, ``cat``, a general ``view``, an unknown module, a
   grouped conv, a module called twice or one with tied weights -- is left alone.
3. **Score** each group's channels by the ``l1`` or ``l2`` norm of the producing filters (Li et al., 2017, "Pruning
   Filters for Efficient ConvNets"); producers of one group are normalised by their mean score first so a 3x3 conv
   and a 1x1 shortcut conv weigh equally.
4. **Remove** the ``floor(amount * C)`` weakest channels of every group: the producers lose output rows (weight and
   bias), BatchNorm loses affine parameters and running statistics, consumers lose input columns. Sliced
   parameters are new ``nn.Parameter`` objects; optimizers passed in are re-pointed to them and their per-parameter
   state (momentum, Adam moments) is sliced the same way, so an optimizer and its LR schedule keep working
   mid-training. (Anything else holding the old parameters -- a DDP wrapper, an EMA copy -- must be rebuilt.)

Entry point: :func:`apply_structured_pruning`. ``amount`` is the fraction of each group's current channels removed.
"""

from __future__ import annotations

import itertools
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

__all__ = [
    "ChannelGroup",
    "PruneResult",
    "apply_structured_pruning",
    "batch_norms",
    "channel_importance",
    "check_amount",
    "count_parameters",
    "find_channel_groups",
    "recalibrate_batchnorm",
    "resize_to_state_dict",
    "schedule_amounts",
]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
# the layers a channel group slices: producers and consumers, and the norms that follow a producer
_Layer = nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.Linear
_Norm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm
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
    producers: list[tuple[str, _Layer]] = field(default_factory=list)
    followers: list[tuple[str, _Norm]] = field(default_factory=list)
    consumers: list[tuple[str, _Layer]] = field(default_factory=list)
    normalized: dict[str, _Norm] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Producer names (how a group is identified in reports)."""
        return [n for n, _ in self.producers]


@dataclass
class PruneResult:
    """What :func:`apply_structured_pruning` did.

    Attributes:
        params_before: parameter count before.
        params_after: parameter count after.
        groups: ``(producer names, channels before, channels after)`` per pruned group.
        skipped: ``(module name, reason)`` for layers found but not prunable.
    """

    params_before: int
    params_after: int
    groups: list[tuple[list[str], int, int]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def params_frac(self) -> float:
        """``params_after / params_before``."""
        return self.params_after / max(1, self.params_before)


def check_amount(amount: float, name: str = "amount") -> float:
    """Validate a pruning fraction in [0, 1) and return it as a float.

    Raises:
        ValueError: naming ``name``, with the value and the fix.
    """
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= amount < 1.0:
        raise ValueError(
            f"`{name}` must be a fraction in [0, 1) of the channels to remove, got {amount!r}. "
            "E.g. 0.5 removes half of each prunable layer's channels; 1.0 would remove them all."
        )
    return float(amount)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def schedule_amounts(amount: float, steps: int) -> list[float]:
    """Per-step fractions for iterative pruning that remove ``amount`` of the original channels in ``steps`` steps.

    Step ``k`` brings the cumulative removed fraction to ``amount * k / steps``; its fraction of the *current*
    channels is ``1 - (1 - a_k) / (1 - a_{k-1})``.
    """
    check_amount(amount)
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps!r}.")
    cum = [amount * k / steps for k in range(steps + 1)]
    return [1.0 - (1.0 - cum[k]) / (1.0 - cum[k - 1]) for k in range(1, steps + 1)]


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


def _trace(model: nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
    try:
        tracer = torch.fx.Tracer()
        graph = tracer.trace(model)
        gm = torch.fx.GraphModule(tracer.root, graph)
    except Exception as e:
        raise TypeError(
            f"Structured pruning could not trace `{type(model).__name__}` with torch.fx ({type(e).__name__}: {e}). "
            "Prune a traceable submodule instead (e.g. `target='model'`), or keep data-dependent control flow out of "
            "its forward."
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


def find_channel_groups(
    model: nn.Module, example_inputs: tuple[Any, ...] | torch.Tensor, *, ignore: Iterable[str] = ()
) -> tuple[list[ChannelGroup], list[tuple[str, str]]]:
    """Trace ``model`` and return its prunable channel groups, plus ``(layer, reason)`` for conv/linear layers skipped.

    Args:
        model: the network (any ``nn.Module`` torch.fx can trace; a LightningModule works if its ``forward`` does).
        example_inputs: inputs for one forward pass (a tensor or a tuple of positional args), on the model's device.
        ignore: names of modules whose output channels must not be pruned.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    gm = _trace(model, tuple(example_inputs))
    flow = _ChannelFlow(dict(model.named_modules()), set(ignore))
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
        self.producers: dict[int, list[tuple[str, _Layer]]] = {}
        self.followers: dict[int, list[tuple[str, _Norm]]] = {}
        self.consumers: dict[int, list[tuple[str, _Layer]]] = {}
        self.normalized: dict[str, _Norm] = {}  # producer name -> the BatchNorm reading its output directly
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
        if isinstance(m, _CONV) and type(m) in _CONV and m.groups == 1 and shape is not None:
            self._layer(node, name, m, x, reads=1, writes=1)
        elif isinstance(m, nn.Linear) and shape is not None:
            in_shape = _shape(args[0]) if args else None
            reads = len(in_shape) - 1 if in_shape is not None else None
            self._layer(node, name, m, x, reads=reads, writes=len(shape) - 1)
        elif isinstance(m, _BN) and x is not None and x[1] == 1:
            self.followers.setdefault(x[0], []).append((name, m))
            src = str(args[0].target) if args[0].op == "call_module" else None
            if src is not None and any(n == src for n, _ in self.producers.get(x[0], [])):
                self.normalized[src] = m
            self._touch(x[0], name)
            self.info[node] = x
        elif isinstance(m, _PASS_MODULES) and x is not None:
            _pass(node, x, args[0], self.info, self.uf)
        elif isinstance(m, nn.Flatten) and x is not None:
            _flatten(node, x, args[0], self.info, self.uf)
        else:
            self.block_args(node, f"used by {type(m).__name__} `{name}`")
            if shape is not None:
                self.new_space(node, 1 if len(shape) >= 2 else 0, blocked=f"output of `{name}`")

    def _layer(
        self, node: torch.fx.Node, name: str, m: _Layer, x: tuple[int, int] | None, reads: int | None, writes: int
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
            _pass(node, x, args[0], self.info, self.uf)
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


def _pass(node: torch.fx.Node, x: tuple[int, int], src: torch.fx.Node, info: dict, uf: _UnionFind) -> None:
    in_shape, out_shape = _shape(src), _shape(node)
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
    tensors = [(a, a_shape) for a in node.args if isinstance(a, torch.fx.Node) and (a_shape := _shape(a)) is not None]
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


def channel_importance(group: ChannelGroup, norm: str = "l1", *, fold_bn: bool = False) -> torch.Tensor:
    """Score per channel: the producers' filter norms (each producer divided by its mean score), summed.

    Args:
        group: a group from :func:`find_channel_groups`.
        norm: ``"l1"`` or ``"l2"``.
        fold_bn: score a producer followed directly by a BatchNorm on the *folded* filter
            ``w_c * |gamma_c| / sqrt(running_var_c + eps)`` -- what the channel actually contributes after the norm.
            A BatchNorm divides its input by the channel's standard deviation, so the raw filter norm alone says
            nothing about a channel's output (scaling ``w_c`` changes nothing after the norm); the folded norm does.
    """
    if norm not in ("l1", "l2"):
        raise ValueError(f"`norm` must be 'l1' or 'l2', got {norm!r}.")
    total = torch.zeros(group.size, dtype=torch.float64)
    for name, m in group.producers:
        w = m.weight.detach().flatten(1).double().cpu()
        score = w.abs().sum(1) if norm == "l1" else w.pow(2).sum(1).sqrt()
        bn = group.normalized.get(name) if fold_bn else None
        if bn is not None and isinstance(bn.running_var, torch.Tensor):
            scale = (bn.running_var.detach().double().cpu() + bn.eps).rsqrt()
            if bn.weight is not None:
                scale = scale * bn.weight.detach().double().abs().cpu()
            score = score * scale
        total += score / score.mean().clamp_min(1e-12)
    return total


def batch_norms(model: nn.Module) -> list[_Norm]:
    """The BatchNorm layers of ``model`` that keep running statistics (the ones pruning can leave stale)."""
    return [m for m in model.modules() if isinstance(m, _BN) and m.track_running_stats]


def recalibrate_batchnorm(
    model: nn.Module, batches: Iterable[Any], *, forward: Callable[[nn.Module, Any], Any] | None = None
) -> int:
    """Re-estimate every BatchNorm's running statistics of ``model`` from ``batches``, in place.

    After channels are removed the layers after a pruned group see fewer input channels, so the running mean and
    variance of the BatchNorms behind them describe the *unpruned* network; in eval mode they mis-normalise. This
    resets the statistics and recomputes them as the plain average over ``batches`` (BatchNorm's ``momentum=None``
    mode) with the BatchNorms in train mode, everything else (dropout) in eval mode and without gradients. Modes and
    momenta are restored afterwards; parameters are untouched. With one batch the result is exactly that batch's
    per-channel mean and unbiased variance of each norm's input.

    Args:
        model: the (pruned) network.
        batches: a few training batches: tensors, or ``(inputs, ...)`` tuples/lists whose first item is the input.
        forward: ``forward(model, batch)`` for other batch layouts (default: ``model(batch)`` or ``model(batch[0])``).

    Returns:
        The number of batches used.

    Raises:
        ValueError: ``batches`` is empty (the statistics are left as they were).
    """
    norms = batch_norms(model)
    it = iter(batches)
    first = next(it, None)
    if first is None:
        raise ValueError("`batches` is empty: BatchNorm recalibration needs at least one batch of inputs.")
    if not norms:
        return 0
    call = forward or _default_forward
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in norms}
    n = 0
    try:
        model.eval()
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the batches, not an EMA that still remembers the old net
            m.train()
        with torch.no_grad():
            for batch in itertools.chain([first], it):
                call(model, batch)
                n += 1
    finally:
        for m, mom in momenta.items():
            m.momentum = mom
        for mod, t in modes.items():
            mod.train(t)
    return n


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return model(batch)


def _n_keep(size: int, amount: float, round_to: int) -> int:
    keep = size - math.floor(amount * size + 1e-9)
    if round_to > 1:
        keep = min(size, int(math.ceil(keep / round_to) * round_to))
    return max(1, keep)


def _slice_param(
    module: nn.Module, name: str, dim: int, keep: torch.Tensor, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Replace ``module.<name>`` by its ``keep`` slice along ``dim``; re-point optimizers to the new parameter.

    A *new* ``nn.Parameter`` is created (rather than assigning ``param.data``) because autograd caches the old shape
    in the parameter's gradient accumulator while any graph that used it is alive; optimizers are re-pointed to the
    new object and their per-parameter state (same shape as the parameter) is sliced the same way.
    """
    p = getattr(module, name, None)
    if p is None:
        return
    idx = keep.to(p.device)
    if not isinstance(p, nn.Parameter):  # buffer (BatchNorm running statistics)
        setattr(module, name, p.index_select(dim, idx).contiguous())  # a registered buffer stays a buffer
        return
    new = nn.Parameter(p.detach().index_select(dim, idx).contiguous(), requires_grad=p.requires_grad)
    if p.grad is not None:
        new.grad = p.grad.index_select(dim, idx).contiguous()
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new if q is p else q for q in group["params"]]
        st = opt.state.pop(p, None)
        if not st:
            continue
        sliced: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.shape != p.shape:
                    warnings.warn(
                        f"Optimizer state `{k}` of `{name}` has shape {tuple(v.shape)}, not the parameter's "
                        f"{tuple(p.shape)}; resetting this parameter's optimizer state.",
                        stacklevel=4,
                    )
                    sliced = {}
                    break
                v = v.index_select(dim, idx.to(v.device)).contiguous()
            sliced[k] = v
        if sliced:
            opt.state[new] = sliced
    setattr(module, name, new)


def _shrink(group: ChannelGroup, keep: torch.Tensor, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    n = int(keep.numel())
    for _, m in group.producers:
        _slice_param(m, "weight", 0, keep, optimizers)
        _slice_param(m, "bias", 0, keep, optimizers)
        if isinstance(m, nn.Linear):
            m.out_features = n
        else:
            m.out_channels = n
    for _, bn in group.followers:
        for name in ("weight", "bias", "running_mean", "running_var"):
            _slice_param(bn, name, 0, keep, optimizers)
        bn.num_features = n
    for _, m in group.consumers:
        _slice_param(m, "weight", 1, keep, optimizers)
        if isinstance(m, nn.Linear):
            m.in_features = n
        else:
            m.in_channels = n
    group.size = n


def apply_structured_pruning(
    model: nn.Module,
    amount: float,
    example_inputs: tuple[Any, ...] | torch.Tensor,
    *,
    norm: str = "l1",
    optimizers: Sequence[torch.optim.Optimizer] = (),
    ignore: Iterable[str] = (),
    round_to: int = 1,
    fold_bn: bool = False,
) -> PruneResult:
    """Remove the ``amount`` weakest channels of every prunable group of ``model``, in place.

    Args:
        model: the network; its layers are shrunk in place (same module objects, new parameter objects).
        amount: fraction in [0, 1) of each group's current channels to remove (at least one channel is kept).
        example_inputs: inputs for one traced forward pass, on the model's device.
        norm: filter norm used to rank channels, ``"l1"`` or ``"l2"``.
        optimizers: optimizers over ``model``'s parameters whose per-parameter state is sliced to match.
        ignore: module names whose output channels must not be pruned.
        round_to: keep a multiple of this many channels per group (e.g. 8 for vectorised kernels).
        fold_bn: rank a producer followed by a BatchNorm on its BN-folded filter (see :func:`channel_importance`).

    Returns:
        A :class:`PruneResult`; a warning is raised when nothing was pruned.

    Raises:
        ValueError: bad ``amount``/``norm``/``round_to``, each named.
        TypeError: a model torch.fx cannot trace.
    """
    amount = check_amount(amount)
    if norm not in ("l1", "l2"):
        raise ValueError(f"`norm` must be 'l1' or 'l2', got {norm!r}.")
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise ValueError(f"`round_to` must be an integer >= 1, got {round_to!r}.")
    before = count_parameters(model)
    groups, skipped = find_channel_groups(model, example_inputs, ignore=ignore)
    plans = []
    for g in groups:
        n_keep = _n_keep(g.size, amount, round_to)
        if n_keep >= g.size:
            continue
        keep = torch.topk(channel_importance(g, norm, fold_bn=fold_bn), n_keep).indices.sort().values
        plans.append((g, keep))
    result = PruneResult(params_before=before, params_after=before, skipped=skipped)
    for g, keep in plans:
        old = g.size
        _shrink(g, keep, optimizers)
        result.groups.append((g.names, old, g.size))
    result.params_after = count_parameters(model)
    if not result.groups and amount > 0:
        warnings.warn(
            f"Structured pruning with amount={amount} changed nothing ({len(groups)} prunable groups; skipped: "
            f"{skipped[:4]}). Increase `amount` or check that the model has prunable conv/linear layers.",
            stacklevel=2,
        )
    return result


def resize_to_state_dict(model: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> list[str]:
    """Give ``model``'s conv/linear/BatchNorm layers the shapes found in ``state_dict`` (e.g. a pruned checkpoint).

    The values are not copied -- call ``model.load_state_dict(state_dict)`` afterwards (this is also usable as a
    ``load_state_dict`` pre-hook). Layers whose shapes already match are untouched.

    Args:
        model: a freshly built (unpruned) model.
        state_dict: the pruned weights.
        prefix: key prefix of ``model`` inside ``state_dict``.

    Returns:
        Names of the resized layers.
    """
    resized = []
    for name, m in model.named_modules():
        if not isinstance(m, (*_CONV, nn.Linear, *_BN)):
            continue
        key = f"{prefix}{name}." if name else prefix
        changed = False
        for pname in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(m, pname, None)
            src = state_dict.get(key + pname)
            if t is None or not isinstance(src, torch.Tensor) or src.shape == t.shape or src.dim() != t.dim():
                continue
            new = torch.empty(src.shape, dtype=t.dtype, device=t.device)
            if isinstance(t, nn.Parameter):
                setattr(m, pname, nn.Parameter(new, requires_grad=t.requires_grad))
            else:
                setattr(m, pname, new)  # a registered buffer stays a buffer
            changed = True
        if not changed:
            continue
        w = getattr(m, "weight", None)
        if w is None:  # BatchNorm without affine parameters: its statistics carry the size
            w = getattr(m, "running_mean", None)
        if not isinstance(w, torch.Tensor):  # unreachable: something above was resized
            continue
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = int(w.shape[0]), int(w.shape[1])
        elif isinstance(m, _CONV):
            m.out_channels, m.in_channels = int(w.shape[0]), int(w.shape[1]) * m.groups
        else:
            m.num_features = int(w.shape[0])
        resized.append(name)
    return resized
