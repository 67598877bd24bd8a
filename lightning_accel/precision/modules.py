"""Fused forwards that module surgery installs *in place* by swapping a module's class.

A class swap keeps the module object, its parameters, buffers, hooks and ``state_dict`` keys, so DDP (which ignores
``convert_module``'s return value), optimizers built earlier and existing checkpoints all keep working. Each mixin
here overrides ``forward`` only; the swapped class is ``type("Fused<Name>", (Mixin, OriginalClass), {})``, so
``isinstance(module, OriginalClass)`` stays true. The one surgery that changes parameters is QKV packing
(:func:`pack_qkv`), which keeps the ``state_dict`` compatible through state-dict hooks.

Only exact, known classes get block-level forwards (their forward code is what the mixin reimplements): see
``KNOWN_*`` below. Whole-module pickling (``torch.save(model)``) of a fused model is not supported (the swapped
classes are created at run time); save ``state_dict()`` as Lightning does.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.ops.conv_bn_relu.function import conv_bn_relu
from lightning_accel.ops.linear_dropout.function import linear_dropout
from lightning_accel.ops.norm.function import layer_norm, rms_norm

__all__ = [
    "KNOWN_ATTENTION",
    "KNOWN_BASIC_BLOCKS",
    "KNOWN_BOTTLENECKS",
    "KNOWN_GPT_BLOCKS",
    "KNOWN_RESNETS",
    "FusedAttentionMixin",
    "FusedBasicBlockMixin",
    "FusedBottleneckMixin",
    "FusedGPTBlockMixin",
    "FusedLayerNormMixin",
    "FusedResNetMixin",
    "FusedRMSNormMixin",
    "FusedSequentialMixin",
    "conv_bn_forward",
    "is_fused",
    "original_class",
    "pack_qkv",
    "qualname",
    "swap_class",
]

KNOWN_BASIC_BLOCKS = frozenset({"lightning_accel.models.resnet.BasicBlock", "torchvision.models.resnet.BasicBlock"})
KNOWN_BOTTLENECKS = frozenset({"torchvision.models.resnet.Bottleneck"})
KNOWN_RESNETS = frozenset({"torchvision.models.resnet.ResNet"})
KNOWN_GPT_BLOCKS = frozenset({"lightning_accel.models.transformer.GPTBlock"})
KNOWN_ATTENTION = frozenset({"lightning_accel.models.transformer.CausalSelfAttention"})

_SWAPPED: dict[tuple[type, type], type] = {}


def qualname(obj: Any) -> str:
    """``module.QualName`` of an object's class (how known block classes are matched without importing them)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_fused(module: nn.Module, mixin: type | None = None) -> bool:
    """True when ``module``'s class was swapped by surgery (by ``mixin`` if given)."""
    return isinstance(module, mixin) if mixin is not None else isinstance(module, _FusedMixin)


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before any surgery."""
    return getattr(type(module), "_la_original", type(module))


def swap_class(module: nn.Module, mixin: type) -> bool:
    """Swap ``module``'s class to ``(mixin, its class)`` in place; False if it already has the mixin (idempotent)."""
    cls = type(module)
    if issubclass(cls, mixin):
        return False
    new = _SWAPPED.get((mixin, cls))
    if new is None:
        name = f"Fused{cls.__name__}"
        base = getattr(cls, "_la_original", cls)
        attrs = {"__module__": mixin.__module__, "__qualname__": name, "_la_original": base}
        new = type(name, (mixin, cls), attrs)
        _SWAPPED[(mixin, cls)] = new
    module.__class__ = new
    return True


class _FusedMixin:
    """Marker base of every fused forward; ``_la_backend`` is the ops backend it passes on (see ``apply_fusions``)."""

    _la_backend: str = "auto"


# --------------------------------------------------------------------------------------------------- conv-bn(-relu)


def conv_bn_forward(
    conv: nn.Conv2d, bn: nn.BatchNorm2d, x: torch.Tensor, relu: bool, backend: str = "auto"
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
        backend,  # type: ignore[arg-type]
    )


class FusedSequentialMixin(_FusedMixin):
    """``nn.Sequential`` whose forward runs fused groups from ``_la_plan``: ``{start index: (length, kind)}``.

    Kinds: ``"conv_bn_relu"`` (Conv2d, BatchNorm2d, ReLU), ``"conv_bn"`` (Conv2d, BatchNorm2d),
    ``"linear_dropout"`` (Linear, Dropout). The children stay where they were, so ``state_dict`` keys do not change.
    """

    _la_plan: dict[int, tuple[int, str]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods = list(self._modules.values())
        i = 0
        while i < len(mods):
            length, kind = self._la_plan.get(i, (1, ""))
            if kind in ("conv_bn_relu", "conv_bn"):
                x = conv_bn_forward(mods[i], mods[i + 1], x, relu=kind == "conv_bn_relu", backend=self._la_backend)
            elif kind == "linear_dropout":
                lin, drop = mods[i], mods[i + 1]
                x = linear_dropout(x, lin.weight, lin.bias, drop.p, drop.training, backend=self._la_backend)
            else:
                x = mods[i](x)
            i += length
        return x


class FusedBasicBlockMixin(_FusedMixin):
    """torchvision-style ``BasicBlock``: fused conv1-bn1-relu, conv2-bn2 (and downsample conv-bn), add, relu."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv2, self.bn2, out, relu=False, backend=self._la_backend)
        return self.relu(out + identity)


class FusedBottleneckMixin(_FusedMixin):
    """torchvision ``Bottleneck``: three fused conv-bn(-relu) stages, add, relu."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv2, self.bn2, out, relu=True, backend=self._la_backend)
        out = conv_bn_forward(self.conv3, self.bn3, out, relu=False, backend=self._la_backend)
        return self.relu(out + identity)


class FusedResNetMixin(_FusedMixin):
    """torchvision ``ResNet``: the stem conv1-bn1-relu fused; the rest as in ``ResNet._forward_impl``."""

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(conv_bn_forward(self.conv1, self.bn1, x, relu=True, backend=self._la_backend))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ------------------------------------------------------------------------------------------------------------- norms


class FusedLayerNormMixin(_FusedMixin):
    """``nn.LayerNorm`` over the last dimension through the fused norm op (output keeps the input dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:  # surgery does not match these; kept for safety
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self._la_backend)


class FusedRMSNormMixin(_FusedMixin):
    """``nn.RMSNorm`` over the last dimension through the fused norm op (``eps=None``: the dtype's epsilon)."""

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


def pack_qkv(attn: nn.Module) -> list[tuple[list[nn.Parameter], nn.Parameter]]:
    """Replace ``attn.q_proj``/``k_proj``/``v_proj`` (same-shaped ``nn.Linear``) by one ``attn.qkv_proj`` in place.

    The packed weight is ``cat([Wq, Wk, Wv])`` copied exactly; ``qkv_proj`` takes ``q_proj``'s place in the module
    order. State-dict hooks keep checkpoints compatible both ways (``state_dict()`` writes the three unfused keys,
    ``load_state_dict`` accepts unfused or packed keys).

    Returns:
        ``[(old parameters, new parameter)]`` so callers can fix optimizer references.
    """
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    with torch.no_grad():
        packed = nn.Linear(q.in_features, 3 * q.out_features, bias=q.bias is not None)
        packed.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]), requires_grad=q.weight.requires_grad)
        swaps = [([q.weight, k.weight, v.weight], packed.weight)]
        if q.bias is not None:
            packed.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]), requires_grad=q.bias.requires_grad)
            swaps.append(([q.bias, k.bias, v.bias], packed.bias))
    modules: OrderedDict[str, nn.Module | None] = OrderedDict()
    for name, mod in attn._modules.items():
        if name == "q_proj":
            modules["qkv_proj"] = packed
        elif name not in ("k_proj", "v_proj"):
            modules[name] = mod
    attn._modules = modules
    attn.register_state_dict_post_hook(_qkv_state_dict_post_hook)
    attn.register_load_state_dict_pre_hook(_qkv_load_state_dict_pre_hook)
    return swaps


class FusedAttentionMixin(_FusedMixin):
    """``CausalSelfAttention`` with packed QKV (after :func:`pack_qkv`) and the output ``proj`` + ``resid_dropout``
    (+ the block's residual) fused into one :func:`~lightning_accel.ops.linear_dropout` call.

    ``forward(x, residual=None)`` returns ``residual + attention(x)`` when ``residual`` is given.
    ``_la_fuse_out`` says whether the output projection is fused (the ``linear_dropout`` fusion).
    """

    _la_fuse_out: bool = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        b, s, c = x.shape
        if "qkv_proj" in self._modules:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_features // 3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        y = F.scaled_dot_product_attention(
            self._heads(q),
            self._heads(k),
            self._heads(v),
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
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x), residual=x)
        fc, act, proj, drop = self.mlp[0], self.mlp[1], self.mlp[2], self.mlp[3]
        h = act(fc(self.ln_2(x)))
        return linear_dropout(h, proj.weight, proj.bias, drop.p, drop.training, residual=x, backend=self._la_backend)
