"""Fused forwards that module surgery installs *in place* by swapping a module's class.

A class swap keeps the module object, its parameters, buffers, hooks and ``state_dict`` keys, so DDP (which ignores
``convert_module``'s return value), optimizers built earlier and existing checkpoints all keep working. Each mixin
here overrides ``forward`` only; the swapped class is ``type("Fused<Name>", (Mixin, OriginalClass), {})``, so
``isinstance(module, OriginalClass)`` stays true. The one surgery that changes parameters is QKV packing
(:func:`pack_qkv`), which keeps the ``state_dict`` compatible through state-dict hooks.

Block-level forwards (a ResNet block, an attention layer, a transformer block) reimplement their block's own
``forward``, so they apply only to exact classes that declared theirs equal to a mixin's, with :func:`register_block`.
torchvision's ``BasicBlock``, ``Bottleneck`` and ``ResNet`` are registered here (by name: torchvision is not imported);
any other model registers its own classes next to their definition. Each mixin's docstring is the contract a
registered class must meet. A fused module pickles (``torch.save(model)``, ``pickle``, ``copy.deepcopy``) although its
class is made at run time: it pickles as "the original class with these mixins", and unpickling makes (or reuses)
the same swapped class; the original class must itself be importable, as for any pickled module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel._utils import compat, patching
from lightning_accel._utils.triton import Backend
from lightning_accel.ops.activation import Activation, function_activation, module_activation
from lightning_accel.ops.conv_bn_relu.function import conv_bn_relu
from lightning_accel.ops.linear_dropout.function import linear_dropout
from lightning_accel.ops.norm.function import layer_norm, rms_norm

__all__ = [
    "BLOCK_MIXINS",
    "FusedAttentionMixin",
    "FusedBasicBlockMixin",
    "FusedBlockMixin",
    "FusedBottleneckMixin",
    "FusedGPT2BlockMixin",
    "FusedGPTBlockMixin",
    "FusedLayerNormMixin",
    "FusedMultiheadAttentionMixin",
    "FusedPackedAttentionMixin",
    "FusedResNetMixin",
    "FusedRMSNormMixin",
    "FusedSequentialMixin",
    "FusedTransformerEncoderLayerMixin",
    "QKV_PARTS",
    "block_mixin",
    "conv_bn_block_problem",
    "conv_bn_forward",
    "conv_bn_problem",
    "eager_children",
    "fused_children",
    "held_by_fsdp1",
    "holds_planned",
    "is_fused",
    "mha_supported",
    "needs_eager",
    "original_class",
    "pack_qkv",
    "parse_kind",
    "qualname",
    "register_block",
    "registered_blocks",
    "swap_class",
]

_SWAPPED: dict[tuple[type, type], type] = {}

# `{qualified class name: block mixin}`, filled by `register_block`; names, so that a class is matched without
# importing its package
_BLOCKS: dict[str, type[_FusedMixin]] = {}


def qualname(obj: Any) -> str:
    """``module.QualName`` of an object's class (how registered block classes are matched without importing them)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_fused(module: nn.Module, mixin: type | None = None) -> TypeGuard[_FusedMixin]:
    """True when ``module``'s class was swapped by surgery (by ``mixin`` if given)."""
    return isinstance(module, mixin) if mixin is not None else isinstance(module, _FusedMixin)


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before any surgery."""
    cls: type = getattr(type(module), "_la_original", type(module))
    return cls


def swap_class(module: nn.Module, mixin: type) -> bool:
    """Swap ``module``'s class to ``(mixin, its class)`` in place; False if it already has the mixin (idempotent).

    The swap goes through :func:`lightning_accel._utils.patching.swap_class`; ``original_class(module)`` is the class
    to swap back to.
    """
    cls = type(module)
    if issubclass(cls, mixin):
        return False
    patching.swap_class(module, _fused_class(mixin, cls))
    return True


def _fused_class(mixin: type, cls: type) -> type:
    """The class ``(mixin, cls)``, made once per pair (so every module swapped alike shares one class)."""
    new = _SWAPPED.get((mixin, cls))
    if new is None:
        name = f"Fused{cls.__name__}"
        attrs = {
            "__module__": mixin.__module__,
            "__qualname__": name,
            "_la_original": getattr(cls, "_la_original", cls),
            "_la_mixins": (*getattr(cls, "_la_mixins", ()), mixin),
        }
        new = type(name, (mixin, cls), attrs)
        _SWAPPED[(mixin, cls)] = new
    return new


def _new_fused(original: type, mixins: tuple[type, ...]) -> Any:
    """An empty instance of ``original`` swapped by ``mixins`` in order (how a pickled fused module is rebuilt)."""
    cls = original
    for mixin in mixins:
        cls = _fused_class(mixin, cls)
    return object.__new__(cls)


# The mixins are combined with nn.Module subclasses at run time (`swap_class`); for the type checker they are modules,
# so `self.training`, `self._modules` and submodule attributes (declared per mixin) are typed.
if TYPE_CHECKING:
    _ModuleBase = nn.Module
else:
    _ModuleBase = object


class _FusedMixin(_ModuleBase):
    """Marker base of every fused forward; ``_la_backend`` is the ops backend it passes on (see ``apply_fusions``).

    ``fused_children`` names the sub-modules (paths relative to the module, e.g. ``"mlp.c_fc"``) whose computation the
    fused forward runs through a fused op instead of calling them: the fusion report counts them as fused.
    """

    _la_backend: Backend = "auto"
    fused_children: tuple[str, ...] = ()

    def _la_fused_children(self) -> tuple[str, ...]:
        return self.fused_children

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        """The sub-modules whose own call the fused forward skips (it reads their parameters instead)."""
        return ()

    def _la_fuses_itself(self) -> bool:
        """Whether the module itself counts as fused in the fusion report when it is an eligible module (see
        :meth:`FusedAttentionMixin._la_fuses_itself` for one that may not)."""
        return True

    def _la_eager_children(self) -> tuple[str, ...]:
        """The fused children that run unfused now (see :func:`needs_eager`); the fusion report counts them so."""
        return self._la_fused_children() if needs_eager(*self._la_bypassed()) else ()

    def _la_eager_reason(self) -> str:
        """Why :meth:`_la_eager_children` run unfused (the fusion report's reason)."""
        return (
            "has hooks (a pruning mask, a user's hook), a Dropout with p >= 1, or a sibling replaced since surgery: "
            "its block runs it unfused"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The swapped class cannot be found by name; pickle the original class and the mixins instead, and the
        # module's state as `nn.Module` pickles it.
        cls = type(self)
        return _new_fused, (original_class(self), getattr(cls, "_la_mixins", ())), self.__getstate__()


def needs_eager(*modules: nn.Module | None) -> bool:
    """True when a fused forward must call ``modules`` one by one, as the unfused model does.

    That is when one of them has forward or backward hooks (``torch.nn.utils.prune``'s mask, FSDP's unsharding, a
    user's hook: a fused forward reads the parameters and would skip them) or is a training ``nn.Dropout`` with
    ``p >= 1`` (it zeroes its input: the eager modules do that at no cost, with nothing to fuse). Checked at every
    call, so hooks registered after surgery count too.
    """
    for m in modules:
        if m is None:
            continue
        if compat.module_has_hooks(m):
            return True
        if isinstance(m, nn.Dropout) and m.training and m.p >= 1:
            return True
    return False


def replaced(*expected: tuple[object, type]) -> bool:
    """True when a module a fused forward reads instead of calling (its ``weight``, its ``p``) is no longer exactly of
    the class surgery fused: replaced after surgery, by a wrapper around a Linear (a LoRA adapter) or an
    ``nn.Identity`` for a Dropout. The fused forward then runs the unfused one, which calls the module as it is now.
    """
    return any(type(m) is not cls for m, cls in expected)


# --------------------------------------------------------------------------------------------------- conv-bn(-relu)


def conv_bn_problem(
    conv: nn.Module | None, bn: nn.Module | None, conv_name: str = "conv", bn_name: str = "bn"
) -> str | None:
    """Why ``bn(conv(x))`` cannot run as one :func:`conv_bn_forward` (None when it can); ``conv_name``/``bn_name``
    name the two modules in the reason.

    Only exact classes fuse: an ``nn.Conv2d`` with ``padding_mode="zeros"`` (its forward pads with zeros, as the op
    does) and an ``nn.BatchNorm2d`` over the conv's output channels. A subclass or look-alike has a forward of its own
    that the fused op would skip: ``nn.SyncBatchNorm`` all-reduces its batch statistics across processes (what
    ``Trainer(sync_batchnorm=True)`` converts to), torchvision's ``FrozenBatchNorm2d`` has fixed statistics and no
    ``momentum``.
    """
    if type(conv) is not nn.Conv2d:
        return f"{conv_name} is {type(conv).__name__}: only nn.Conv2d is fused"
    if conv.padding_mode != "zeros":
        return f"{conv_name} has padding_mode={conv.padding_mode!r}: only 'zeros' is fused"
    if type(bn) is not nn.BatchNorm2d:
        return f"{bn_name} is {type(bn).__name__}: only nn.BatchNorm2d is fused"
    if bn.num_features != conv.out_channels:
        return f"{bn_name} has {bn.num_features} features for the {conv.out_channels} output channels of {conv_name}"
    return None


def conv_bn_forward(
    conv: nn.Conv2d,
    bn: nn.BatchNorm2d,
    x: torch.Tensor,
    relu: bool | Activation,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``act(bn(conv(x)))`` through :func:`lightning_accel.ops.conv_bn_relu`, with ``nn.BatchNorm2d``'s bookkeeping.

    ``relu``: True/False (ReLU or none) or an activation name (:data:`lightning_accel.ops.activation.ACTIVATIONS`).

    Reproduces ``_BatchNorm.forward``: ``num_batches_tracked`` is incremented in training, ``momentum=None`` means a
    cumulative average, and modules without running statistics always use batch statistics.
    """
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    return conv_bn_relu(
        x,
        conv.weight,
        conv.bias,
        bn.weight,
        bn.bias,
        bn.running_mean if track else None,
        bn.running_var if track else None,
        use_batch_stats,
        factor,
        bn.eps,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        relu is True or relu == "relu",
        backend,
        activation=relu if isinstance(relu, str) else None,
    )


def parse_kind(kind: str) -> tuple[str, Activation, bool]:
    """``(op, activation, dropout)`` of a planned group's kind.

    Kinds: ``"conv_bn_<act>"`` / ``"conv_bn"`` (Conv2d, BatchNorm2d[, act]) and ``"linear_<act>_dropout"`` /
    ``"linear_<act>"`` / ``"linear_dropout"`` (Linear[, act][, Dropout]), ``<act>`` one of
    :data:`lightning_accel.ops.activation.ACTIVATIONS`.
    """
    if kind.startswith("conv_bn"):
        act = kind[len("conv_bn_") :] if kind != "conv_bn" else "none"
        return "conv_bn", cast(Activation, act), False
    body = kind[len("linear_") :]
    dropout = body == "dropout" or body.endswith("_dropout")
    act = body[: -len("_dropout")] if body.endswith("_dropout") else "none" if body == "dropout" else body
    return "linear", cast(Activation, act), dropout


def holds_planned(seq: nn.Module, mods: Sequence[nn.Module | None], i: int, length: int) -> bool:
    """Whether ``mods[i : i + length]`` (``seq``'s children) are still the modules surgery planned a group over at
    ``i`` (``seq``'s ``_la_members``); True for a container fused, and pickled, before the members were recorded."""
    if "_la_members" not in seq.__dict__:
        return True
    group, members = mods[i : i + length], seq.__dict__["_la_members"].get(i, ())
    return len(group) == len(members) and all(a is b for a, b in zip(group, members, strict=True))


class FusedSequentialMixin(_FusedMixin):
    """``nn.Sequential`` (or a subclass that keeps ``nn.Sequential.forward``, such as torchvision's
    ``Conv2dNormActivation`` and ``MLPBlock``) whose forward runs fused groups from ``_la_plan``:
    ``{start index: (length, kind)}``, kinds as in :func:`parse_kind`.

    The children stay where they were, so ``state_dict`` keys do not change. ``_la_members`` holds the modules each
    group was planned over: a group whose children were replaced, inserted or removed since (``seq[1] = nn.ReLU()``),
    or that :func:`needs_eager`, runs its children one by one.
    """

    # empty by default: an instance of the swapped class that surgery did not plan (made by `type(seq)(...)`) runs
    # its children one by one; surgery sets the instance's own plan
    _la_plan: dict[int, tuple[int, str]] = {}  # never mutated: surgery assigns a new dict
    _la_members: dict[int, tuple[nn.Module, ...]]

    def __getitem__(self, idx: Any) -> Any:
        """``nn.Sequential``'s indexing; a slice (``seq[2:]``, made as ``self.__class__(...)``) keeps the fused groups
        that lie wholly inside it, at their new positions, with this container's backend."""
        out = cast(Any, super()).__getitem__(idx)
        if not isinstance(idx, slice) or not isinstance(out, FusedSequentialMixin) or out is self:
            return out
        start, stop, step = idx.indices(len(compat.child_modules(self)))
        plan: dict[int, tuple[int, str]] = {}
        if step == 1:
            plan = {i - start: (n, kind) for i, (n, kind) in self._la_plan.items() if start <= i and i + n <= stop}
        out._la_plan = plan
        if "_la_members" in self.__dict__:
            members = self.__dict__["_la_members"]
            out.__dict__["_la_members"] = {i: members[i + start] for i in plan if i + start in members}
        if "_la_backend" in self.__dict__:
            out._la_backend = self._la_backend
        return out

    def _la_fused_children(self) -> tuple[str, ...]:
        names = list(compat.child_modules(self))
        return tuple(names[i] for i in self._la_plan if i < len(names))

    def _la_eager_children(self) -> tuple[str, ...]:
        names, mods = list(compat.child_modules(self)), list(compat.child_modules(self).values())
        plan = self._la_plan.items()
        return tuple(names[i] for i, (n, _) in plan if i < len(names) and not self._la_runs(mods, i, n))

    def _la_eager_reason(self) -> str:
        return (
            "has hooks (a pruning mask, a user's hook), a Dropout with p >= 1, or its container's children changed "
            "since surgery: runs unfused"
        )

    def _la_runs(self, mods: list[nn.Module | None], i: int, length: int) -> bool:
        """The group planned at ``i`` still holds the modules it was planned over and may run fused."""
        return holds_planned(self, mods, i, length) and not needs_eager(*mods[i : i + length])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # `input`, as nn.Sequential.forward names it: a call `seq(input=x)` keeps working after surgery
        x = input
        # the casts hold by construction: surgery plans a group only over children of exactly these classes
        mods = cast(list[nn.Module], list(compat.child_modules(self).values()))
        i = 0
        while i < len(mods):
            length, kind = self._la_plan.get(i, (1, ""))
            if kind and not self._la_runs(cast(list[nn.Module | None], mods), i, length):
                kind, length = "", 1  # changed or hooked since surgery: this module runs as it is
            if not kind:
                x = mods[i](x)
                i += 1
                continue
            op, act, dropout = parse_kind(kind)
            if op == "conv_bn":
                conv, bn = cast(nn.Conv2d, mods[i]), cast(nn.BatchNorm2d, mods[i + 1])
                x = conv_bn_forward(conv, bn, x, relu=act, backend=self._la_backend)
            else:
                lin = cast(nn.Linear, mods[i])
                drop = cast(nn.Dropout, mods[i + length - 1]) if dropout else None
                p, training = (drop.p, drop.training) if drop is not None else (0.0, False)
                x = linear_dropout(x, lin.weight, lin.bias, p, training, activation=act, backend=self._la_backend)
            i += length
        return x


class _ConvBnBlockMixin(_FusedMixin):
    """Base of the ResNet block forwards: ``conv_bn_pairs`` are the ``(conv, batch norm)`` attributes the fused forward
    runs through :func:`conv_bn_forward`, with the block's ``relu`` fused into some of them.

    The fused forward runs only while :func:`conv_bn_block_problem` finds nothing (checked at every call, so a batch
    norm replaced after surgery, such as by ``nn.SyncBatchNorm.convert_sync_batchnorm`` for a later fit, runs as the
    block's own forward, with its synchronisation) and no bypassed module :func:`needs_eager`.
    """

    conv_bn_pairs: tuple[tuple[str, str], ...] = ()

    def _la_problem(self) -> str | None:
        """Why the fused forward does not run now (None when it does)."""
        if needs_eager(*self._la_bypassed()):
            return "has hooks (a pruning mask, a user's hook): its block runs it unfused"
        return conv_bn_block_problem(cast(nn.Module, self), type(self))

    def _la_eager_children(self) -> tuple[str, ...]:
        return self._la_fused_children() if self._la_problem() is not None else ()

    def _la_eager_reason(self) -> str:
        return self._la_problem() or super()._la_eager_reason()


def conv_bn_block_problem(block: nn.Module, mixin: type) -> str | None:
    """Why ``mixin`` (:class:`FusedBasicBlockMixin`, :class:`FusedBottleneckMixin` or :class:`FusedResNetMixin`) cannot
    run ``block`` fused (None when it can): each of its conv + batch norm pairs must pass :func:`conv_bn_problem`, and
    ``relu``, which the fused forward folds into the convolutions, must be an ``nn.ReLU``."""
    for conv, bn in getattr(mixin, "conv_bn_pairs", ()):
        why = conv_bn_problem(getattr(block, conv, None), getattr(block, bn, None), conv, bn)
        if why is not None:
            return why
    relu = getattr(block, "relu", None)
    if type(relu) is not nn.ReLU:
        return f"relu is {type(relu).__name__}: only nn.ReLU is fused after a batch norm"
    return None


class FusedBasicBlockMixin(_ConvBnBlockMixin):
    """A torchvision-style ``BasicBlock``: fused conv1-bn1-relu, conv2-bn2 (and downsample conv-bn), add, relu.

    Contract of a registered class: its forward is ``relu(bn2(conv2(relu(bn1(conv1(x))))) + identity)`` with
    ``identity = x if downsample is None else downsample(x)``, for the attributes below. Surgery swaps only blocks whose
    pairs pass :func:`conv_bn_block_problem` (exact ``nn.Conv2d``, ``nn.BatchNorm2d`` and ``nn.ReLU``).
    """

    conv1: nn.Conv2d
    bn1: nn.BatchNorm2d
    relu: nn.Module
    conv2: nn.Conv2d
    bn2: nn.BatchNorm2d
    downsample: nn.Module | None
    fused_children = ("conv1", "conv2")
    conv_bn_pairs = (("conv1", "bn1"), ("conv2", "bn2"))

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        return self.conv1, self.bn1, self.relu, self.conv2, self.bn2  # relu: called once here, twice unfused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._la_problem() is not None:
            return cast(Any, original_class(self)).forward(self, x)
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv2, self.bn2, out, relu=False, backend=self._la_backend)
        return self.relu(out + identity)


class FusedBottleneckMixin(_ConvBnBlockMixin):
    """A torchvision ``Bottleneck``: three fused conv-bn(-relu) stages, add, relu.

    Contract: forward is ``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + identity)``, identity as in
    :class:`FusedBasicBlockMixin`; the same checks apply.
    """

    conv1: nn.Conv2d
    bn1: nn.BatchNorm2d
    conv2: nn.Conv2d
    bn2: nn.BatchNorm2d
    conv3: nn.Conv2d
    bn3: nn.BatchNorm2d
    relu: nn.Module
    downsample: nn.Module | None
    fused_children = ("conv1", "conv2", "conv3")
    conv_bn_pairs = (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"))

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        return self.conv1, self.bn1, self.conv2, self.bn2, self.conv3, self.bn3, self.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._la_problem() is not None:
            return cast(Any, original_class(self)).forward(self, x)
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv2, self.bn2, out, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv3, self.bn3, out, relu=False, backend=self._la_backend)
        return self.relu(out + identity)


class FusedResNetMixin(_ConvBnBlockMixin):
    """A torchvision ``ResNet``: the stem conv1-bn1-relu fused; the rest as in ``ResNet._forward_impl``.

    Contract: ``_forward_impl`` is ``fc(flatten(avgpool(layer4(layer3(layer2(layer1(maxpool(relu(bn1(conv1(x))))))))),
    1))`` and ``forward`` calls it; the stem passes the checks of :func:`conv_bn_block_problem`.
    """

    conv1: nn.Conv2d
    bn1: nn.BatchNorm2d
    maxpool: nn.Module
    layer1: nn.Module
    layer2: nn.Module
    layer3: nn.Module
    layer4: nn.Module
    avgpool: nn.Module
    fc: nn.Module
    relu: nn.Module
    fused_children = ("conv1",)
    conv_bn_pairs = (("conv1", "bn1"),)

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        return self.conv1, self.bn1, self.relu

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        if self._la_problem() is not None:
            return cast(Any, original_class(self))._forward_impl(self, x)
        x = self.maxpool(conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ------------------------------------------------------------------------------------------------------------- norms


class FusedLayerNormMixin(_FusedMixin):
    """``nn.LayerNorm`` over the last dimension through the fused norm op (output keeps the input dtype).

    An input whose last dimension is not ``normalized_shape`` runs ``nn.LayerNorm``'s own forward, which raises.
    """

    normalized_shape: tuple[int, ...]
    weight: nn.Parameter | None
    bias: nn.Parameter | None
    eps: float

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # `input`, as nn.LayerNorm.forward names it
        # an input whose last dimension is not `normalized_shape` goes to nn.LayerNorm, which raises as unfused: the
        # fused op normalises over whatever the last dimension is, and without a weight nothing else would check it
        if len(self.normalized_shape) != 1 or input.shape[-1:] != self.normalized_shape:
            return super().forward(input)
        return layer_norm(input, self.weight, self.bias, self.eps, backend=self._la_backend)


class FusedRMSNormMixin(_FusedMixin):
    """``nn.RMSNorm`` over the last dimension through the fused norm op.

    ``eps=None`` means, as in ``torch.rms_norm``, the epsilon of the dtype the statistics are computed in: float32's
    for float16 / bfloat16 inputs (not the half type's own, 64000x larger for bfloat16), the input's otherwise. An
    input whose last dimension is not ``normalized_shape`` runs ``nn.RMSNorm``'s own forward, which raises.
    """

    normalized_shape: tuple[int, ...]
    weight: nn.Parameter | None
    eps: float | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as FusedLayerNormMixin: a last dimension other than `normalized_shape` raises nn.RMSNorm's own error
        if len(self.normalized_shape) != 1 or x.shape[-1:] != self.normalized_shape:
            return super().forward(x)
        eps = self.eps if self.eps is not None else _default_rms_eps(x.dtype)
        return rms_norm(x, self.weight, eps, backend=self._la_backend)


def _default_rms_eps(dtype: torch.dtype) -> float:
    """``nn.RMSNorm(eps=None)``'s epsilon for an input of ``dtype``: that of its accumulation type (``at::opmath_type``:
    float32 for the half types), which the fused op also accumulates in."""
    return torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps


# ------------------------------------------------------------------------------------------------- attention and GPT


#: The three projections QKV packing joins, in their packed order (rows of ``qkv_proj``).
QKV_PARTS = ("q_proj", "k_proj", "v_proj")


def _qkv_state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Write the packed projection back as ``q_proj``/``k_proj``/``v_proj`` keys (an unfused model loads it), in the
    unfused model's key order (``q_proj.weight, q_proj.bias, k_proj.weight, ...`` where ``qkv_proj``'s keys were).
    The values are views of the packed parameter's rows, as every other entry is a reference to its parameter.

    Under ``state_dict(keep_vars=True)`` (the packed entries are then the ``nn.Parameter`` objects themselves) each
    part is an ``nn.Parameter`` too, as in the unfused model: it shares the packed parameter's storage, has its
    ``requires_grad`` and, when the packed parameter has a gradient, the rows of that gradient as ``.grad`` (at the
    time of the call)."""
    packed = {kind: f"{prefix}qkv_proj.{kind}" for kind in ("weight", "bias")}
    if not any(key in state_dict for key in packed.values()):
        return
    # this module's keys were written last (the hook runs at the end of its own state_dict call): take them out and
    # put them back in order, with the parts in the packed keys' place
    own = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for key, value in own.items():
        if key not in packed.values():
            state_dict[key] = value
        elif key == next(k for k in packed.values() if k in own):  # the first packed key: write every part here
            # views, not copies: like every other entry of a state dict they share the parameter's storage, so an
            # in-place update through them (an EMA model updated through `state_dict().values()`) reaches the model;
            # `torch.save` writes the shared storage once
            parts = {kind: own[k].detach().chunk(3, dim=0) for kind, k in packed.items() if k in own}
            for i, name in enumerate(QKV_PARTS):
                for kind, chunks in parts.items():
                    state_dict[f"{prefix}{name}.{kind}"] = _qkv_part(own[packed[kind]], chunks[i], i)


def held_by_fsdp1(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is a view of an FSDP1 (``FullyShardedDataParallel``) flat parameter: a plain tensor
    in the place of the parameter (``use_orig_params=False``) or a parameter FSDP1 flattened (``use_orig_params=True``).
    """
    t = getattr(module, name, None)
    own = dict(module.named_parameters(recurse=False))
    return t is not None and (name not in own or compat.fsdp1_flattened(t))


def _qkv_part(packed: torch.Tensor, rows: torch.Tensor, i: int) -> torch.Tensor:
    """The state-dict entry of part ``i`` (``rows``, a detached view of ``packed``'s rows) of a packed q/k/v entry.

    ``state_dict(keep_vars=True)`` puts the parameters themselves in the dict (``packed`` is then an
    ``nn.Parameter``): the part must be one as well, with the packed parameter's ``requires_grad``. A detached view
    would read as a frozen plain tensor, so code that keeps the trainable entries (``v.requires_grad``: saving only
    what a fine-tune trains) or the parameters (``isinstance(v, nn.Parameter)``) would drop the q/k/v weights.
    """
    if not isinstance(packed, nn.Parameter):
        return rows
    part = nn.Parameter(rows, requires_grad=packed.requires_grad)  # shares the storage: in-place updates reach it
    if packed.grad is not None:
        part.grad = packed.grad.detach().chunk(3, dim=0)[i]
    return part


def _qkv_load_state_dict_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Accept unfused checkpoints: concatenate ``q_proj``/``k_proj``/``v_proj`` keys into ``qkv_proj``, loading
    what the unfused model would load and reporting what it would report.

    Some parts may be absent (``load_state_dict(partial, strict=False)``, a checkpoint that holds only ``q_proj``):
    the parts given are loaded into their rows, the others keep their values and are reported missing under their
    own names (``k_proj.weight``, not ``qkv_proj.weight``), as unfused; left as they were, the given parts would not
    load at all and only show as unexpected keys, which ``strict=False`` lets pass. A part of another shape is the
    unfused model's ``size mismatch for q_proj.weight`` error, not a concatenation that fails or fits by chance.
    """
    children = compat.child_modules(module)
    packed = children.get("qkv_proj")
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{n}.{kind}" for n in QKV_PARTS]
        current = getattr(packed, kind, None) if packed is not None else None
        given = [k in state_dict for k in keys]
        packed_key = f"{prefix}qkv_proj.{kind}"
        if not isinstance(current, torch.Tensor):
            continue  # no packed parameter for these keys: they stay unexpected, as unfused
        if packed_key in state_dict:
            if state_dict[packed_key] is not current or not any(given):
                continue  # a packed checkpoint
            # torch.distributed.checkpoint's full-state-dict load puts the model's own parameter under its packed name
            # beside the given parts: the parts are what is loaded
            del state_dict[packed_key]
        if not any(given):
            # reported as the unfused model reports them, not as `qkv_proj`, a name the user's model does not have;
            # the parameter itself as its value loads nothing (and `assign=True` keeps the same object)
            missing_keys.extend(keys)
            state_dict[packed_key] = current
            continue
        rows = current.detach().chunk(len(QKV_PARTS), dim=0)
        values: list[torch.Tensor | None] = []
        for key, present, row in zip(keys, given, rows, strict=True):
            value = state_dict.pop(key) if present else None
            if value is None:
                missing_keys.append(key)
            elif not isinstance(value, torch.Tensor) or value.shape != row.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                # torch's own wording for the same mismatch on an unfused Linear
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, the shape in "
                    f"current model is {row.shape}."
                )
                value = None
            values.append(value)
        # the given parts as they come (a CPU checkpoint for a meta-initialised model loaded with `assign=True` must
        # not go to the meta device); the model's own rows, on their device, only where a part is not given
        device = next((v.device for v in values if v is not None), current.device)
        parts = [v if v is not None else row.to(device) for v, row in zip(values, rows, strict=True)]
        state_dict[packed_key] = torch.cat(parts, dim=0)


def _linear(module: nn.Module, name: str) -> nn.Linear:
    lin = getattr(module, name, None)
    if type(lin) is not nn.Linear:
        raise TypeError(
            f"`{name}` of {type(module).__name__} must be an `nn.Linear` to be packed, got {type(lin).__name__}. "
            "Leave this module out of the `qkv` fusion (`ignore_modules=`)."
        )
    return lin


def pack_qkv(attn: nn.Module) -> list[tuple[list[torch.Tensor], nn.Parameter]]:
    """Replace ``attn.q_proj``/``k_proj``/``v_proj`` (same-shaped ``nn.Linear``) by one ``attn.qkv_proj`` in place.

    The packed weight is ``cat([Wq, Wk, Wv])`` copied exactly; ``qkv_proj`` takes ``q_proj``'s place in the module
    order. State-dict hooks keep checkpoints compatible both ways (``state_dict()`` writes the three unfused keys,
    ``load_state_dict`` accepts unfused or packed keys).

    Returns:
        ``[(old parameters, new parameter)]`` so callers can fix optimizer references.

    Raises:
        TypeError: when a projection is not an ``nn.Linear``.
        ValueError: when two projections share a parameter (tied weights, or the same module twice): the packed copy
            would untie them.
    """
    q, k, v = _linear(attn, "q_proj"), _linear(attn, "k_proj"), _linear(attn, "v_proj")
    params = [t for lin in (q, k, v) for t in lin.parameters(recurse=False)]
    if len({id(t) for t in params}) != len(params):
        raise ValueError(
            f"`q_proj`/`k_proj`/`v_proj` of {type(attn).__name__} share a parameter; packing copies them into one, "
            "which would untie them. Leave this module out of the `qkv` fusion (`ignore_modules=`)."
        )
    with torch.no_grad():
        packed = nn.Linear(q.in_features, 3 * q.out_features, bias=q.bias is not None)
        packed.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]), requires_grad=q.weight.requires_grad)
        swaps: list[tuple[list[torch.Tensor], nn.Parameter]] = [([q.weight, k.weight, v.weight], packed.weight)]
        biases = [q.bias, k.bias, v.bias]
        if all(b is not None for b in biases):
            olds = cast(list[torch.Tensor], biases)
            packed.bias = nn.Parameter(torch.cat(olds), requires_grad=olds[0].requires_grad)
            swaps.append((olds, packed.bias))
    modules: OrderedDict[str, nn.Module | None] = OrderedDict()
    for name, mod in compat.child_modules(attn).items():
        if name == "q_proj":
            modules["qkv_proj"] = packed
        elif name not in ("k_proj", "v_proj"):
            modules[name] = mod
    compat.set_child_modules(attn, modules)  # qkv_proj in q_proj's place: named_modules/state_dict order kept
    attn.register_state_dict_post_hook(_qkv_state_dict_post_hook)
    attn.register_load_state_dict_pre_hook(_qkv_load_state_dict_pre_hook)
    return swaps


def _split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """``(B, S, C) -> (B, n_head, S, C // n_head)``."""
    b, s, c = t.shape
    return t.view(b, s, n_head, c // n_head).transpose(1, 2)


def _attention_residual(attn: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x + attn(h)`` for a block's fused attention: the residual add rides in ``attn``'s output epilogue, unless
    ``attn`` has hooks of its own, which must see (and may replace) ``attn(h)`` alone, as in the unfused block."""
    if needs_eager(attn) or not isinstance(attn, (FusedAttentionMixin, FusedPackedAttentionMixin)):
        return x + attn(h)  # hooked, or replaced after surgery by a module that takes no `residual`
    return cast(torch.Tensor, attn(h, residual=x))


class FusedAttentionMixin(_FusedMixin):
    """Causal self-attention with packed QKV (after :func:`pack_qkv`) and the output ``proj`` + ``resid_dropout``
    (+ the block's residual) fused into one :func:`~lightning_accel.ops.linear_dropout` call.

    ``forward(x, residual=None)`` returns ``residual + attention(x)`` when ``residual`` is given.
    ``_la_fuse_out`` says whether the output projection is fused (the ``linear_dropout`` fusion).

    Contract of a registered class: ``n_head`` heads split from ``(B, S, C)`` projections ``q_proj``/``k_proj``/
    ``v_proj``; its forward is ``resid_dropout(proj(y))`` with ``y`` the causal ``scaled_dot_product_attention`` of
    the heads (``dropout_p=attn_dropout`` in training), merged back to ``(B, S, C)``.
    """

    n_head: int
    attn_dropout: float
    proj: nn.Linear
    resid_dropout: nn.Dropout
    _la_fuse_out: bool = False

    def _la_fused_children(self) -> tuple[str, ...]:
        packed = ("qkv_proj",) if "qkv_proj" in compat.child_modules(self) else ()
        return (*packed, "proj") if self._la_fuse_out else packed

    def _la_fuses_itself(self) -> bool:
        # a GPT block swaps its attention in for the output projection's epilogue even when the q/k/v projections
        # stay apart (frozen alone, tied, split across optimizer groups): the attention itself is fused only packed
        return "qkv_proj" in compat.child_modules(self)

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        return (self.proj, self.resid_dropout) if self._la_fuse_out else ()

    def _la_out_eager(self) -> bool:
        """The output projection runs as modules: hooked, or ``proj``/``resid_dropout`` replaced after surgery."""
        return needs_eager(*self._la_bypassed()) or replaced((self.proj, nn.Linear), (self.resid_dropout, nn.Dropout))

    def _la_eager_children(self) -> tuple[str, ...]:
        return ("proj",) if self._la_fuse_out and self._la_out_eager() else ()  # the packed GEMM is a module call

    def _la_fqn_modifiers(self) -> dict[str, str]:
        """Where ``torch.distributed.checkpoint.state_dict`` finds the modules of this module's ``state_dict`` keys
        (installed for DCP by :func:`~lightning_accel._utils.compat.set_dcp_fqn_modifiers`).

        ``get_model_state_dict`` (and the optimizer variants) resolve every key of ``state_dict()`` as an attribute
        path. Packed, the keys are still ``q_proj.weight``... (:func:`_qkv_state_dict_post_hook`) but the modules are
        gone: the path of ``q_proj`` goes through :attr:`_la_qkv_parts`, which holds the three parts' row views.
        Unpacked, the projections are modules of their own and nothing is redirected."""
        if "qkv_proj" not in compat.child_modules(self):
            return {}
        return dict.fromkeys(QKV_PARTS, "_la_qkv_parts")

    @property
    def _la_qkv_parts(self) -> SimpleNamespace:
        """``q_proj``/``k_proj``/``v_proj`` of the packed projection, each with the ``weight`` and ``bias`` (None
        without bias) rows its ``state_dict`` entries hold, detached: for code that walks state-dict keys as
        attribute paths, not a module to call or train."""
        qkv = compat.child_modules(self).get("qkv_proj")
        if not isinstance(qkv, nn.Linear):
            raise AttributeError(f"{type(self).__name__} has no packed `qkv_proj`")
        rows = {
            k: t.detach().chunk(len(QKV_PARTS), dim=0) for k in ("weight", "bias") if (t := getattr(qkv, k)) is not None
        }
        return SimpleNamespace(
            **{
                name: SimpleNamespace(weight=rows["weight"][i], bias=rows["bias"][i] if "bias" in rows else None)
                for i, name in enumerate(QKV_PARTS)
            }
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        b, s, c = x.shape
        children = compat.child_modules(self)
        if "qkv_proj" in children:
            qkv = cast(nn.Linear, children["qkv_proj"])
            q, k, v = qkv(x).split(qkv.out_features // 3, dim=-1)
        else:
            q, k, v = (cast(nn.Module, children[n])(x) for n in QKV_PARTS)
        y = F.scaled_dot_product_attention(
            _split_heads(q, self.n_head),
            _split_heads(k, self.n_head),
            _split_heads(v, self.n_head),
            is_causal=True,
            dropout_p=self.attn_dropout if self.training else 0.0,
        )
        y = y.transpose(1, 2).reshape(b, s, c)
        if self._la_fuse_out and not self._la_out_eager():
            drop = self.resid_dropout
            return linear_dropout(
                y, self.proj.weight, self.proj.bias, drop.p, drop.training, residual=residual, backend=self._la_backend
            )
        out = self.resid_dropout(self.proj(y))
        return out if residual is None else residual + out


compat.set_dcp_fqn_modifiers(FusedAttentionMixin, FusedAttentionMixin._la_fqn_modifiers)


class FusedGPTBlockMixin(_FusedMixin):
    """Pre-norm GPT block: the MLP's first Linear + activation fuse into one op, the attention output projection and
    the MLP's second Linear + Dropout each fuse with the residual add; ``mlp`` must be
    ``Sequential(Linear, activation, Linear, Dropout)`` and ``attn`` a fused attention.

    Contract of a registered class: its forward is ``x = x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.
    """

    ln_1: nn.Module
    attn: nn.Module
    ln_2: nn.Module
    mlp: nn.Sequential

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        return (self.mlp, *self.mlp)

    def _la_mlp_eager(self) -> bool:
        """The MLP runs as the block's own forward: hooked, or its layout changed after surgery (a child replaced, one
        appended or removed), which the fused forward, reading ``mlp[0]``...``mlp[3]``, would compute wrongly."""
        mlp = self.mlp
        if type(mlp) is not nn.Sequential or len(mlp) != 4:
            return True
        return replaced((mlp[0], nn.Linear), (mlp[2], nn.Linear), (mlp[3], nn.Dropout)) or needs_eager(
            *self._la_bypassed()
        )

    def _la_eager_children(self) -> tuple[str, ...]:
        if not self._la_mlp_eager():
            return ()  # the attention is called as a module
        return tuple(c for c in self._la_fused_children() if c.startswith("mlp."))

    def _la_fused_children(self) -> tuple[str, ...]:
        if type(self.mlp) is not nn.Sequential or len(self.mlp) != 4:
            return ()
        # not "attn": the attention module is counted by itself (fused when its q/k/v projections were packed)
        first = ("mlp.0",) if type(self.mlp[0]) is nn.Linear and module_activation(self.mlp[1]) is not None else ()
        return (*first, "mlp.2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._la_mlp_eager():
            return cast(Any, original_class(self)).forward(self, x)
        x = _attention_residual(self.attn, self.ln_1(x), x)
        fc, act = self.mlp[0], self.mlp[1]
        # exact classes, checked by surgery before the swap
        proj, drop = cast(nn.Linear, self.mlp[2]), cast(nn.Dropout, self.mlp[3])
        kind = module_activation(act)
        h = self.ln_2(x)
        if kind is not None and type(fc) is nn.Linear:
            h = linear_dropout(h, fc.weight, fc.bias, 0.0, False, activation=kind, backend=self._la_backend)
        else:
            h = act(fc(h))
        return linear_dropout(h, proj.weight, proj.bias, drop.p, drop.training, residual=x, backend=self._la_backend)


# ------------------------------------------------------------------------- nn.MultiheadAttention and its encoder layer


def mha_supported(mha: nn.Module) -> str | None:
    """Why an ``nn.MultiheadAttention`` cannot take the fused path (None when it can): the configurations whose
    arithmetic the fused path does not reimplement (separate key/value sizes, ``add_bias_kv``, ``add_zero_attn``)."""
    if not isinstance(mha, nn.MultiheadAttention):
        return f"`{type(mha).__name__}` is not an nn.MultiheadAttention"
    if mha.kdim != mha.embed_dim or mha.vdim != mha.embed_dim or mha.in_proj_weight is None:
        return "separate key/value sizes (`kdim`/`vdim` differ from `embed_dim`)"
    if mha.bias_k is not None or mha.bias_v is not None:
        return "`add_bias_kv=True`"
    if mha.add_zero_attn:
        return "`add_zero_attn=True`"
    return None


def _sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype, b: int, h: int) -> torch.Tensor | None:
    """An ``nn.MultiheadAttention`` ``attn_mask`` (bool: True = masked out, or additive float; (L, S) or
    (B * heads, L, S)) as ``scaled_dot_product_attention``'s additive mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    else:
        mask = mask.to(dtype)
    if mask.dim() == 3:
        mask = mask.view(b, h, mask.shape[-2], mask.shape[-1])
    return mask


def _mha_heads(mha: nn.MultiheadAttention, x: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> Any:
    """Self-attention of ``mha`` on ``x`` up to, not including, ``out_proj``: one packed GEMM,
    ``scaled_dot_product_attention`` over the heads (dropout ``mha.dropout`` in training), heads merged back.

    ``x`` is in ``mha``'s own layout, ``(B, L, E)`` with ``batch_first`` and ``(L, B, E)`` without, and so is the
    result, contiguous: the unfused modules return a contiguous ``(L, B, E)`` there (``out.view(-1, E)`` works on
    it), which a transpose to batch-first and back would not be (and each fused Linear after it would copy it first).

    ``is_causal`` follows ``nn.MultiheadAttention``: with no key padding mask and no weights asked, the causal hint
    replaces ``attn_mask``.
    """
    h, e = mha.num_heads, x.shape[-1]
    qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    if mha.batch_first:
        b, length = x.shape[0], x.shape[1]
        q, k, v = qkv.reshape(b, length, 3, h, e // h).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        length, b = x.shape[0], x.shape[1]
        q, k, v = qkv.reshape(length, b, 3, h, e // h).permute(2, 1, 3, 0, 4).unbind(0)
    mask = None if is_causal else _sdpa_mask(attn_mask, q.dtype, b, h)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=mha.dropout if mha.training else 0.0, is_causal=is_causal
    )  # (B, heads, L, E / heads)
    if mha.batch_first:
        return y.transpose(1, 2).reshape(b, length, e)
    return y.permute(2, 0, 1, 3).reshape(length, b, e)


class FusedMultiheadAttentionMixin(_FusedMixin):
    """``nn.MultiheadAttention`` self-attention through one packed ``in_proj`` GEMM and
    ``scaled_dot_product_attention``, then ``out_proj``.

    The fused path runs when ``query is key is value`` (self-attention) on a batched 3-D input, ``need_weights=False``
    and no ``key_padding_mask``; any other call (weights asked, cross-attention, padding masks, nested tensors) runs
    ``nn.MultiheadAttention``'s own forward, so every call keeps eager semantics. Surgery only swaps modules for which
    :func:`mha_supported` is None.
    """

    num_heads: int
    batch_first: bool
    dropout: float
    out_proj: nn.Linear

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        fast = (
            not need_weights
            and key_padding_mask is None
            and query is key
            and key is value
            and query.dim() == 3
            and not query.is_nested
            and not (is_causal and attn_mask is None)  # eager raises for that: let it
        )
        if not fast:
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        y = _mha_heads(cast(nn.MultiheadAttention, self), query, attn_mask, is_causal)  # in the input's layout
        return F.linear(y, self.out_proj.weight, self.out_proj.bias), None


class FusedTransformerEncoderLayerMixin(_FusedMixin):
    """``nn.TransformerEncoderLayer`` (``norm_first`` True or False): the self-attention's ``out_proj`` + ``dropout1``
    + residual, ``linear1`` + activation + ``dropout`` and ``linear2`` + ``dropout2`` + residual each run as one
    :func:`~lightning_accel.ops.linear_dropout`; attention as in :class:`FusedMultiheadAttentionMixin`.

    Calls the fused path does not cover (a ``src_key_padding_mask``, nested tensors, an unbatched input) run the
    layer's own forward. Surgery swaps only layers whose activation is one of the fused kinds (ReLU, GELU, SiLU...)
    and whose ``self_attn`` passes :func:`mha_supported`.
    """

    self_attn: nn.MultiheadAttention
    linear1: nn.Linear
    dropout: nn.Dropout
    linear2: nn.Linear
    norm_first: bool
    norm1: nn.Module
    norm2: nn.Module
    dropout1: nn.Dropout
    dropout2: nn.Dropout
    activation: Any
    fused_children = ("self_attn", "linear1", "linear2")

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        act = self.activation if isinstance(self.activation, nn.Module) else None
        return self.self_attn, self.linear1, self.dropout, self.linear2, self.dropout1, self.dropout2, act

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        act = function_activation(self.activation)
        linears = ((self.linear1, nn.Linear), (self.linear2, nn.Linear))
        dropouts = ((d, nn.Dropout) for d in (self.dropout, self.dropout1, self.dropout2))
        if (
            act is None
            or needs_eager(*self._la_bypassed())
            or replaced(*linears, *dropouts)
            or src_key_padding_mask is not None
            or src.is_nested
            or src.dim() != 3
            or (is_causal and src_mask is None)
        ):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        # in the input's own layout, (B, S, E) or (S, B, E) (see `_mha_heads`): contiguous out, as from the unfused
        x, backend = src, self._la_backend

        def attention(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            y = _mha_heads(self.self_attn, h, src_mask, is_causal)
            out, drop = self.self_attn.out_proj, self.dropout1
            return linear_dropout(y, out.weight, out.bias, drop.p, drop.training, residual=residual, backend=backend)

        def feed_forward(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            l1, l2, d, d2 = self.linear1, self.linear2, self.dropout, self.dropout2
            u = linear_dropout(h, l1.weight, l1.bias, d.p, d.training, activation=act, backend=backend)
            return linear_dropout(u, l2.weight, l2.bias, d2.p, d2.training, residual=residual, backend=backend)

        if self.norm_first:
            x = attention(self.norm1(x), x)
            x = feed_forward(self.norm2(x), x)
        else:
            x = self.norm1(attention(x, x))
            x = self.norm2(feed_forward(x, x))
        return x


# ------------------------------------------------------------------------------------- GPT-2 style (packed c_attn)


class FusedPackedAttentionMixin(_FusedMixin):
    """GPT-2 style causal self-attention with a packed ``c_attn`` (``Linear(C, 3 * C)``): split, causal
    ``scaled_dot_product_attention`` over ``n_head`` heads, then ``c_proj`` + ``resid_dropout`` (+ the block's
    residual) as one :func:`~lightning_accel.ops.linear_dropout`.

    ``forward(x, residual=None)`` returns ``residual + attention(x)`` when ``residual`` is given.

    Contract of a registered class: attributes ``c_attn``, ``c_proj`` (``nn.Linear``), ``attn_dropout``,
    ``resid_dropout`` (``nn.Dropout``), ``n_head``; its forward is ``resid_dropout(c_proj(y))`` with ``y`` the causal
    ``scaled_dot_product_attention`` (``dropout_p=attn_dropout.p`` in training) of ``q, k, v = c_attn(x).split(C)``
    split into ``n_head`` heads, merged back to ``(B, S, C)``.
    """

    n_head: int
    c_attn: nn.Linear
    c_proj: nn.Linear
    attn_dropout: nn.Dropout
    resid_dropout: nn.Dropout
    fused_children = ("c_attn", "c_proj")

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        return self.c_proj, self.resid_dropout

    def _la_out_eager(self) -> bool:
        """``c_proj`` + ``resid_dropout`` run as modules: hooked, or replaced after surgery."""
        return needs_eager(*self._la_bypassed()) or replaced((self.c_proj, nn.Linear), (self.resid_dropout, nn.Dropout))

    def _la_eager_children(self) -> tuple[str, ...]:
        return ("c_proj",) if self._la_out_eager() else ()  # c_attn is called as a module

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=-1)
        y = F.scaled_dot_product_attention(
            _split_heads(q, self.n_head),
            _split_heads(k, self.n_head),
            _split_heads(v, self.n_head),
            is_causal=True,
            dropout_p=self.attn_dropout.p if self.training else 0.0,
        )
        y = y.transpose(1, 2).reshape(b, s, c)
        if self._la_out_eager():
            out = self.resid_dropout(self.c_proj(y))
            return out if residual is None else residual + out
        drop = self.resid_dropout
        return linear_dropout(
            y, self.c_proj.weight, self.c_proj.bias, drop.p, drop.training, residual=residual, backend=self._la_backend
        )


class FusedGPT2BlockMixin(_FusedMixin):
    """GPT-2 style pre-norm block: ``attn`` (a registered :class:`FusedPackedAttentionMixin` class) with its residual,
    ``mlp.c_fc`` + ``mlp.act`` as one op, ``mlp.c_proj`` + ``mlp.dropout`` + residual as one op.

    Contract of a registered class: attributes ``ln_1``, ``attn``, ``ln_2``, ``mlp`` with ``mlp.c_fc``, ``mlp.c_proj``
    (``nn.Linear``), ``mlp.act`` (an activation module of a fused kind) and ``mlp.dropout`` (``nn.Dropout``); its
    forward is ``x = x + attn(ln_1(x))`` then ``x + dropout(c_proj(act(c_fc(ln_2(x)))))``.
    """

    ln_1: nn.Module
    attn: nn.Module
    ln_2: nn.Module
    mlp: nn.Module
    fused_children = ("attn", "mlp.c_fc", "mlp.c_proj")

    def _la_bypassed(self) -> tuple[nn.Module | None, ...]:
        mlp = self.mlp
        return tuple(cast(nn.Module, getattr(mlp, n)) for n in ("c_fc", "act", "c_proj", "dropout")) + (mlp,)

    def _la_mlp_eager(self) -> bool:
        """The MLP runs as the block's own forward: hooked, or a child replaced after surgery (an activation of a kind
        the fused op does not compute, a wrapper around a Linear, a Dropout swapped out)."""
        mlp = self.mlp
        if module_activation(getattr(mlp, "act", None)) is None:
            return True
        expected = ((getattr(mlp, "c_fc", None), nn.Linear), (getattr(mlp, "c_proj", None), nn.Linear))
        return replaced(*expected, (getattr(mlp, "dropout", None), nn.Dropout)) or needs_eager(*self._la_bypassed())

    def _la_eager_children(self) -> tuple[str, ...]:
        return ("mlp.c_fc", "mlp.c_proj") if self._la_mlp_eager() else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._la_mlp_eager():
            return cast(Any, original_class(self)).forward(self, x)
        x = _attention_residual(self.attn, self.ln_1(x), x)
        mlp, backend = self.mlp, self._la_backend
        fc, proj, drop = cast(nn.Linear, mlp.c_fc), cast(nn.Linear, mlp.c_proj), cast(nn.Dropout, mlp.dropout)
        act = module_activation(mlp.act) or "none"  # `_la_mlp_eager` checked it is a fused kind
        h = linear_dropout(self.ln_2(x), fc.weight, fc.bias, 0.0, False, activation=act, backend=backend)
        return linear_dropout(h, proj.weight, proj.bias, drop.p, drop.training, residual=x, backend=backend)


# ---------------------------------------------------------------------------------------------------- the registry


class FusedBlockMixin(_FusedMixin):
    """Base of a block replacement of your own: subclass it, write ``forward`` with the fused ops
    (:mod:`lightning_accel.ops`) on the block's own attributes, list in ``fused_children`` the sub-modules it runs
    fused, and :func:`register_block` the block class with it. Surgery swaps it in under the ``block`` pattern.
    """


BLOCK_MIXINS: tuple[type[_FusedMixin], ...] = (
    FusedBasicBlockMixin,
    FusedBottleneckMixin,
    FusedResNetMixin,
    FusedAttentionMixin,
    FusedGPTBlockMixin,
    FusedTransformerEncoderLayerMixin,
    FusedPackedAttentionMixin,
    FusedGPT2BlockMixin,
)


def register_block(cls: type[nn.Module] | str, mixin: type[_FusedMixin]) -> None:
    """Declare that exactly the class ``cls`` (not its subclasses) computes what ``mixin``'s forward computes.

    Module surgery then installs ``mixin`` on instances of ``cls`` (see each mixin's contract). Call it next to the
    class definition; registering a class again replaces its mixin.

    Args:
        cls: the block class, or its qualified name ``"package.module.QualName"`` (no import needed).
        mixin: one of :data:`BLOCK_MIXINS`, or a subclass of :class:`FusedBlockMixin` (a replacement of your own).

    Raises:
        ValueError: for a ``mixin`` that is neither, or a ``cls`` that is neither a class nor a name.
    """
    if mixin not in BLOCK_MIXINS and not (
        isinstance(mixin, type) and issubclass(mixin, FusedBlockMixin) and mixin is not FusedBlockMixin
    ):
        raise ValueError(
            f"`mixin` must be one of {[m.__name__ for m in BLOCK_MIXINS]} or a subclass of FusedBlockMixin, got "
            f"{mixin!r}. Containers and norms are matched by their structure; for other patterns add a custom "
            "`Replacement`."
        )
    if isinstance(cls, str):
        name = cls
    elif isinstance(cls, type) and issubclass(cls, nn.Module):
        name = qualname(cls)
    else:
        raise ValueError(f"`cls` must be an nn.Module class or its qualified name, got {cls!r}.")
    _BLOCKS[name] = mixin


def registered_blocks() -> dict[str, type[_FusedMixin]]:
    """A copy of the registry: ``{qualified class name: mixin}``."""
    return dict(_BLOCKS)


def block_mixin(module: nn.Module) -> type[_FusedMixin] | None:
    """The block mixin registered for ``module``'s class before surgery, or None."""
    return _BLOCKS.get(qualname(original_class(module)))


def fused_children(module: nn.Module) -> tuple[str, ...]:
    """The sub-module paths (relative to ``module``) that ``module``'s fused forward runs through fused ops."""
    return module._la_fused_children() if is_fused(module) else ()


def eager_children(module: nn.Module) -> tuple[str, ...]:
    """The :func:`fused_children` of ``module`` that run unfused at its next call (hooks, a changed container)."""
    return module._la_eager_children() if is_fused(module) else ()


register_block("torchvision.models.resnet.BasicBlock", FusedBasicBlockMixin)
register_block("torchvision.models.resnet.Bottleneck", FusedBottleneckMixin)
register_block("torchvision.models.resnet.ResNet", FusedResNetMixin)
register_block("torch.nn.modules.transformer.TransformerEncoderLayer", FusedTransformerEncoderLayerMixin)
