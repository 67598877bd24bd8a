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
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel._utils import compat, patching
from lightning_accel._utils.triton import Backend
from lightning_accel.ops.conv_bn_relu.function import conv_bn_relu
from lightning_accel.ops.linear_dropout.function import linear_dropout
from lightning_accel.ops.norm.function import layer_norm, rms_norm

__all__ = [
    "BLOCK_MIXINS",
    "FusedAttentionMixin",
    "FusedBasicBlockMixin",
    "FusedBottleneckMixin",
    "FusedGPTBlockMixin",
    "FusedLayerNormMixin",
    "FusedResNetMixin",
    "FusedRMSNormMixin",
    "FusedSequentialMixin",
    "block_mixin",
    "conv_bn_forward",
    "is_fused",
    "original_class",
    "pack_qkv",
    "qualname",
    "register_block",
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
    """Marker base of every fused forward; ``_la_backend`` is the ops backend it passes on (see ``apply_fusions``)."""

    _la_backend: Backend = "auto"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The swapped class cannot be found by name; pickle the original class and the mixins instead, and the
        # module's state as `nn.Module` pickles it.
        cls = type(self)
        return _new_fused, (original_class(self), getattr(cls, "_la_mixins", ())), self.__getstate__()


# --------------------------------------------------------------------------------------------------- conv-bn(-relu)


def conv_bn_forward(
    conv: nn.Conv2d, bn: nn.BatchNorm2d, x: torch.Tensor, relu: bool, backend: Backend = "auto"
) -> torch.Tensor:
    """``relu(bn(conv(x)))`` through :func:`lightning_accel.ops.conv_bn_relu`, with ``nn.BatchNorm2d``'s bookkeeping.

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
        relu,
        backend,
    )


class FusedSequentialMixin(_FusedMixin):
    """``nn.Sequential`` whose forward runs fused groups from ``_la_plan``: ``{start index: (length, kind)}``.

    Kinds: ``"conv_bn_relu"`` (Conv2d, BatchNorm2d, ReLU), ``"conv_bn"`` (Conv2d, BatchNorm2d),
    ``"linear_dropout"`` (Linear, Dropout). The children stay where they were, so ``state_dict`` keys do not change.
    """

    _la_plan: dict[int, tuple[int, str]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the casts hold by construction: surgery plans a group only over children of exactly these classes
        mods = cast(list[nn.Module], list(compat.child_modules(self).values()))
        i = 0
        while i < len(mods):
            length, kind = self._la_plan.get(i, (1, ""))
            if kind in ("conv_bn_relu", "conv_bn"):
                conv, bn = cast(nn.Conv2d, mods[i]), cast(nn.BatchNorm2d, mods[i + 1])
                x = conv_bn_forward(conv, bn, x, relu=kind == "conv_bn_relu", backend=self._la_backend)
            elif kind == "linear_dropout":
                lin, drop = cast(nn.Linear, mods[i]), cast(nn.Dropout, mods[i + 1])
                x = linear_dropout(x, lin.weight, lin.bias, drop.p, drop.training, backend=self._la_backend)
            else:
                x = mods[i](x)
            i += length
        return x


class FusedBasicBlockMixin(_FusedMixin):
    """A torchvision-style ``BasicBlock``: fused conv1-bn1-relu, conv2-bn2 (and downsample conv-bn), add, relu.

    Contract of a registered class: its forward is ``relu(bn2(conv2(relu(bn1(conv1(x))))) + identity)`` with
    ``identity = x if downsample is None else downsample(x)``, for the attributes below.
    """

    conv1: nn.Conv2d
    bn1: nn.BatchNorm2d
    relu: nn.Module
    conv2: nn.Conv2d
    bn2: nn.BatchNorm2d
    downsample: nn.Module | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv2, self.bn2, out, relu=False, backend=self._la_backend)
        return self.relu(out + identity)


class FusedBottleneckMixin(_FusedMixin):
    """A torchvision ``Bottleneck``: three fused conv-bn(-relu) stages, add, relu.

    Contract: forward is ``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + identity)``, identity as in
    :class:`FusedBasicBlockMixin`.
    """

    conv1: nn.Conv2d
    bn1: nn.BatchNorm2d
    conv2: nn.Conv2d
    bn2: nn.BatchNorm2d
    conv3: nn.Conv2d
    bn3: nn.BatchNorm2d
    relu: nn.Module
    downsample: nn.Module | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv2, self.bn2, out, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv3, self.bn3, out, relu=False, backend=self._la_backend)
        return self.relu(out + identity)


class FusedResNetMixin(_FusedMixin):
    """A torchvision ``ResNet``: the stem conv1-bn1-relu fused; the rest as in ``ResNet._forward_impl``.

    Contract: ``_forward_impl`` is ``fc(flatten(avgpool(layer4(layer3(layer2(layer1(maxpool(relu(bn1(conv1(x))))))))),
    1))`` and ``forward`` calls it.
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

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ------------------------------------------------------------------------------------------------------------- norms


class FusedLayerNormMixin(_FusedMixin):
    """``nn.LayerNorm`` over the last dimension through the fused norm op (output keeps the input dtype)."""

    normalized_shape: tuple[int, ...]
    weight: nn.Parameter | None
    bias: nn.Parameter | None
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:  # surgery does not match these; kept for safety
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self._la_backend)


class FusedRMSNormMixin(_FusedMixin):
    """``nn.RMSNorm`` over the last dimension through the fused norm op (``eps=None``: the dtype's epsilon)."""

    normalized_shape: tuple[int, ...]
    weight: nn.Parameter | None
    eps: float | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps, backend=self._la_backend)


# ------------------------------------------------------------------------------------------------- attention and GPT


def _qkv_state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Write the packed projection back as ``q_proj``/``k_proj``/``v_proj`` keys (an unfused model loads it)."""
    for kind in ("weight", "bias"):
        key = f"{prefix}qkv_proj.{kind}"
        if key not in state_dict:
            continue
        packed = state_dict.pop(key)
        # clone: a view would make torch.save write the whole packed storage three times
        for name, part in zip(("q_proj", "k_proj", "v_proj"), packed.detach().chunk(3, dim=0), strict=True):
            state_dict[f"{prefix}{name}.{kind}"] = part.clone()


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
    """Accept unfused checkpoints: concatenate ``q_proj``/``k_proj``/``v_proj`` keys into ``qkv_proj``."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{n}.{kind}" for n in ("q_proj", "k_proj", "v_proj")]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


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
    """
    q, k, v = _linear(attn, "q_proj"), _linear(attn, "k_proj"), _linear(attn, "v_proj")
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        b, s, c = x.shape
        children = compat.child_modules(self)
        if "qkv_proj" in children:
            qkv = cast(nn.Linear, children["qkv_proj"])
            q, k, v = qkv(x).split(qkv.out_features // 3, dim=-1)
        else:
            q, k, v = (cast(nn.Module, children[n])(x) for n in ("q_proj", "k_proj", "v_proj"))
        y = F.scaled_dot_product_attention(
            _split_heads(q, self.n_head),
            _split_heads(k, self.n_head),
            _split_heads(v, self.n_head),
            is_causal=True,
            dropout_p=self.attn_dropout if self.training else 0.0,
        )
        y = y.transpose(1, 2).reshape(b, s, c)
        if self._la_fuse_out:
            drop = self.resid_dropout
            return linear_dropout(
                y, self.proj.weight, self.proj.bias, drop.p, drop.training, residual=residual, backend=self._la_backend
            )
        out = self.resid_dropout(self.proj(y))
        return out if residual is None else residual + out


class FusedGPTBlockMixin(_FusedMixin):
    """Pre-norm GPT block: the attention output projection and the MLP's second Linear + Dropout each fuse with the
    residual add; ``mlp`` must be ``Sequential(Linear, activation, Linear, Dropout)`` and ``attn`` a fused attention.

    Contract of a registered class: its forward is ``x = x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.
    """

    ln_1: nn.Module
    attn: nn.Module
    ln_2: nn.Module
    mlp: nn.Sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x), residual=x)
        fc, act = self.mlp[0], self.mlp[1]
        # exact classes, checked by surgery before the swap
        proj, drop = cast(nn.Linear, self.mlp[2]), cast(nn.Dropout, self.mlp[3])
        h = act(fc(self.ln_2(x)))
        return linear_dropout(h, proj.weight, proj.bias, drop.p, drop.training, residual=x, backend=self._la_backend)


# ---------------------------------------------------------------------------------------------------- the registry

BLOCK_MIXINS: tuple[type[_FusedMixin], ...] = (
    FusedBasicBlockMixin,
    FusedBottleneckMixin,
    FusedResNetMixin,
    FusedAttentionMixin,
    FusedGPTBlockMixin,
)


def register_block(cls: type[nn.Module] | str, mixin: type[_FusedMixin]) -> None:
    """Declare that exactly the class ``cls`` (not its subclasses) computes what ``mixin``'s forward computes.

    Module surgery then installs ``mixin`` on instances of ``cls`` (see each mixin's contract). Call it next to the
    class definition; registering a class again replaces its mixin.

    Args:
        cls: the block class, or its qualified name ``"package.module.QualName"`` (no import needed).
        mixin: one of :data:`BLOCK_MIXINS`.

    Raises:
        ValueError: for a ``mixin`` that is not a block mixin, or a ``cls`` that is neither a class nor a name.
    """
    if mixin not in BLOCK_MIXINS:
        raise ValueError(
            f"`mixin` must be one of {[m.__name__ for m in BLOCK_MIXINS]}, got {mixin!r}. Containers and norms are "
            "matched by their exact torch class; for other patterns add a custom `Replacement`."
        )
    if isinstance(cls, str):
        name = cls
    elif isinstance(cls, type) and issubclass(cls, nn.Module):
        name = qualname(cls)
    else:
        raise ValueError(f"`cls` must be an nn.Module class or its qualified name, got {cls!r}.")
    _BLOCKS[name] = mixin


def block_mixin(module: nn.Module) -> type[_FusedMixin] | None:
    """The block mixin registered for ``module``'s class before surgery, or None."""
    return _BLOCKS.get(qualname(original_class(module)))


register_block("torchvision.models.resnet.BasicBlock", FusedBasicBlockMixin)
register_block("torchvision.models.resnet.Bottleneck", FusedBottleneckMixin)
register_block("torchvision.models.resnet.ResNet", FusedResNetMixin)
