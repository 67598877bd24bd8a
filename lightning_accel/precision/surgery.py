"""Module surgery: find fusable patterns and install fused forwards *in place*, by a ``{pattern: replacement}`` policy.

Functional core of :class:`~lightning_accel.precision.FusedPrecision` (no Lightning import). Use it directly::

    report = apply_fusions(model)                       # all default patterns
    report = apply_fusions(model, fusions=["norm"], optimizers=[opt])

The patterns (keys of :data:`DEFAULT_POLICY`):

``conv_bn_relu``
    Runs of ``Conv2d -> BatchNorm2d (-> ReLU | ReLU6 | Hardswish | SiLU | GELU)`` in any container whose forward is
    ``nn.Sequential.forward`` (``nn.Sequential`` itself and subclasses that keep its forward, such as torchvision's
    ``Conv2dNormActivation``), and the blocks registered as ResNet blocks (torchvision's ``BasicBlock``/
    ``Bottleneck``/``ResNet`` stem, or any class registered with
    :func:`~lightning_accel.precision.modules.register_block`).
``linear_dropout``
    Runs of ``Linear (-> activation) (-> Dropout)`` in such containers (torchvision's ``MLPBlock`` included); in
    registered blocks (``nn.TransformerEncoderLayer``, GPT and GPT-2 style blocks) the attention output projection and
    the MLP's Linears, each with its activation, dropout and the block's residual add.
``qkv``
    Separate ``q_proj``/``k_proj``/``v_proj`` in registered attention classes -> one packed GEMM.
``attention``
    ``nn.MultiheadAttention`` (self-attention through its packed ``in_proj`` and ``scaled_dot_product_attention``) and
    registered packed-QKV attention classes (GPT-2's ``c_attn``).
``norm``
    ``nn.LayerNorm`` and ``nn.RMSNorm`` over the last dimension (exact classes, not subclasses).
``block``
    Classes registered with a block replacement of your own (a :class:`~.modules.FusedBlockMixin` subclass).

Every call also reports the *eligible* modules (:func:`eligible_modules`) it left unfused, each with the reason, and
the share it fused (:meth:`FusionReport.coverage`).

Block-level patterns need a registration because their fused forward reimplements the block's own ``forward``: the
module structure alone cannot tell that a block with ``conv1``/``bn1``/``conv2``/``bn2`` adds its shortcut the same way.
Registration is by exact class (``module.QualName``); the demo models register theirs where they are defined.

Every replacement keeps the module objects (class swap, see :mod:`.modules`), so parameters, ``state_dict`` keys and
optimizer references survive, except QKV packing, whose parameter changes are reported and patched into the given
optimizers. Surgery is idempotent: fused modules no longer match.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from lightning_accel._utils import compat, patching
from lightning_accel._utils.checks import check_bool
from lightning_accel._utils.rank import is_global_zero
from lightning_accel._utils.triton import Backend, check_backend
from lightning_accel.ops.activation import function_activation, module_activation
from lightning_accel.precision import modules as fm

__all__ = [
    "DEFAULT_POLICY",
    "ELIGIBLE_KINDS",
    "Candidate",
    "FusionRecord",
    "FusionReport",
    "Replaced",
    "Replacement",
    "apply_fusions",
    "eligible_modules",
    "follow_replaced_parameters",
    "replace_optimizer_params",
    "unfuse",
]

log = logging.getLogger(__name__)

ParamSwap = tuple[list[torch.Tensor], nn.Parameter]


class Replaced(NamedTuple):
    """Parameters one surgery replaced: the ``module`` path, weak references to the ``olds`` (alive only while
    something outside the model still holds them, such as an optimizer built before surgery) and the ``new`` one."""

    module: str
    olds: tuple[weakref.ReferenceType[torch.Tensor], ...]
    new: nn.Parameter


@dataclass
class FusionRecord:
    """One fusion: where (``module`` path), which ``pattern``, and what (``detail``)."""

    module: str
    pattern: str
    detail: str


@dataclass
class Candidate:
    """An eligible module (see :func:`eligible_modules`): where, which ``kind``, its class, and whether it runs fused;
    ``reason`` says why not (empty when fused)."""

    module: str
    kind: str
    cls: str
    fused: bool
    reason: str = ""


@dataclass
class FusionReport:
    """What :func:`apply_fusions` did: ``records`` (one per fusion), ``param_swaps`` (old params -> new param) and
    ``candidates`` (every eligible module of the model after surgery, fused or not, with the reason when not).

    Once :func:`apply_fusions` returns, each swap's list of old parameters is empty: the report outlives the surgery
    (the precision plugin keeps it), and holding the replaced q/k/v weights would keep a second copy of every packed
    projection alive for the whole fit."""

    records: list[FusionRecord] = field(default_factory=list)
    param_swaps: list[ParamSwap] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    #: the replaced parameters by weak reference (:func:`follow_replaced_parameters`); not pickled
    replaced: list[Replaced] = field(default_factory=list, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # weak references do not pickle, and point at nothing in another process
        return {**self.__dict__, "replaced": []}

    def skipped(self) -> list[Candidate]:
        """The eligible modules left unfused, each with its ``reason``."""
        return [c for c in self.candidates if not c.fused]

    def coverage(self) -> float:
        """Fused eligible modules / eligible modules (1.0 when the model has none)."""
        if not self.candidates:
            return 1.0
        return sum(c.fused for c in self.candidates) / len(self.candidates)

    def coverage_by_kind(self) -> dict[str, tuple[int, int]]:
        """``{kind: (fused, eligible)}``."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.candidates:
            done, total = out.get(c.kind, (0, 0))
            out[c.kind] = (done + c.fused, total + 1)
        return out

    def counts(self) -> dict[str, int]:
        """``{pattern: number of fusions}``."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.pattern] = out.get(r.pattern, 0) + 1
        return out

    def summary(self) -> str:
        """One line: eligible modules fused per kind, and the module rewrites that did it per pattern, e.g.
        ``10/10 eligible modules fused (conv_bn 10/10) by 7 rewrites ({'conv_bn_relu': 7})``: a rewrite (a block,
        a ``Sequential``) may fuse several eligible modules."""
        done = sum(c.fused for c in self.candidates)
        kinds = ", ".join(f"{k} {a}/{b}" for k, (a, b) in self.coverage_by_kind().items())
        head = (
            f"{done}/{len(self.candidates)} eligible modules fused ({kinds})"
            if self.candidates
            else "no eligible modules"
        )
        return f"{head} by {len(self.records)} rewrites ({self.counts()})"

    def table(self) -> str:
        """Markdown: the fusions, the coverage line, and the skipped eligible modules with why (what is logged)."""
        lines = ["| module | pattern | fused |", "|---|---|---|"]
        lines += [f"| {r.module or '(root)'} | {r.pattern} | {r.detail} |" for r in self.records]
        if self.candidates:
            done = sum(c.fused for c in self.candidates)
            kinds = ", ".join(f"{k} {a}/{b}" for k, (a, b) in self.coverage_by_kind().items())
            lines += ["", f"coverage: {done}/{len(self.candidates)} eligible modules fused ({kinds})"]
        skipped = self.skipped()
        if skipped:
            lines += ["", "| skipped | kind | class | why |", "|---|---|---|---|"]
            lines += [f"| {c.module or '(root)'} | {c.kind} | {c.cls} | {c.reason} |" for c in skipped]
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        # the summary and the skipped modules' names: the dataclass default printed every packed parameter's values
        return f"FusionReport({self.summary()}, skipped={[c.module or '(root)' for c in self.skipped()]})"


@dataclass(frozen=True)
class Replacement:
    """A policy entry: ``match(module) -> bool`` and ``apply(module) -> (detail, param swaps)``, applied in place.

    ``apply`` is only called when ``match`` returned True and must leave the module fully usable.
    """

    match: Callable[[nn.Module], bool]
    apply: Callable[[nn.Module], tuple[str, list[ParamSwap]]]


# ------------------------------------------------------------------------------------------------ conv_bn_relu


def _sequential_forward(m: nn.Module) -> bool:
    """``m`` runs its children in order: ``nn.Sequential`` or a subclass that keeps ``nn.Sequential.forward``."""
    cls = fm.original_class(m)
    return issubclass(cls, nn.Sequential) and cls.forward is nn.Sequential.forward


def _act_kind(m: nn.Module | None) -> str | None:
    """The fused kind of an activation module other than ``nn.Identity``, else None."""
    act = module_activation(m) if m is not None else None
    return act if act not in (None, "none") else None


def _plan_sequential(seq: nn.Module, which: str) -> dict[int, tuple[int, str]]:
    mods = list(compat.child_modules(seq).values())
    plan: dict[int, tuple[int, str]] = {}
    i = 0
    while i < len(mods):
        if _marked_ignored(mods[i]):
            i += 1
            continue
        cur, nxt = mods[i], mods[i + 1] if i + 1 < len(mods) else None
        if which == "conv" and isinstance(cur, nn.Conv2d) and fm.conv_bn_problem(cur, nxt) is None:
            if _marked_ignored(nxt):
                i += 1
                continue
            act = _act_kind(mods[i + 2]) if i + 2 < len(mods) and not _marked_ignored(mods[i + 2]) else None
            if act is not None:
                plan[i] = (3, "conv_bn_relu" if act == "relu" else f"conv_bn_{act}")
                i += 3
            else:
                plan[i] = (2, "conv_bn")
                i += 2
            continue
        if which == "linear" and type(cur) is nn.Linear:
            j = i + 1
            act = _act_kind(mods[j]) if j < len(mods) and not _marked_ignored(mods[j]) else None
            j += act is not None
            drop = j < len(mods) and type(mods[j]) is nn.Dropout and cast(nn.Dropout, mods[j]).p < 1
            drop = drop and not _marked_ignored(mods[j])
            if act is not None or drop:
                kind = "linear" + (f"_{act}" if act else "") + ("_dropout" if drop else "")
                plan[i] = (j + drop - i, kind)
                i = j + drop
                continue
        i += 1
    return plan


def _current_plan(m: nn.Module) -> dict[int, tuple[int, str]]:
    """The groups planned in ``m`` earlier that still hold the modules they were planned over."""
    plan: dict[int, tuple[int, str]] = getattr(m, "_la_plan", {})
    mods = list(compat.child_modules(m).values())
    return {i: (n, kind) for i, (n, kind) in plan.items() if fm.holds_planned(m, mods, i, n)}


def _seq_match(which: str) -> Callable[[nn.Module], bool]:
    def match(m: nn.Module) -> bool:
        if not _sequential_forward(m) or getattr(m, "_la_claimed", False):
            return False
        done = _current_plan(m)
        return any(done.get(i) != v for i, v in _plan_sequential(m, which).items())

    return match


def _seq_apply(which: str) -> Callable[[nn.Module], tuple[str, list[ParamSwap]]]:
    def apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
        # groups of the other pattern that still hold their modules stay; this pattern's are planned afresh (a group
        # whose modules changed since is dropped: the container was edited after surgery)
        current = _current_plan(m)
        fresh = _plan_sequential(m, which)
        # `parse_kind`'s op is "conv_bn" or "linear"; `which` is "conv" or "linear"
        plan = {i: v for i, v in current.items() if not fm.parse_kind(v[1])[0].startswith(which)} | fresh
        new = {i: v for i, v in fresh.items() if current.get(i) != v}
        fm.swap_class(m, fm.FusedSequentialMixin)
        mods = cast(list[nn.Module], list(compat.child_modules(m).values()))
        cast(fm.FusedSequentialMixin, m)._la_plan = plan
        # a plain attribute (nn.Module.__setattr__ is typed for tensors and modules), kept by deepcopy and pickle
        m.__dict__["_la_members"] = {i: tuple(mods[i : i + n]) for i, (n, _) in plan.items()}
        return ", ".join(f"[{i}:{i + n}] {kind}" for i, (n, kind) in sorted(new.items())), []

    return apply


def _registered(m: nn.Module, mixin: type) -> bool:
    """``m``'s class (before surgery) was registered for ``mixin``, and ``m`` does not have it yet."""
    return fm.block_mixin(m) is mixin and not fm.is_fused(m, mixin)


def _block_match(mixin: type, attrs: Sequence[str]) -> Callable[[nn.Module], bool]:
    """A registered ResNet block with the attributes ``attrs`` whose conv + batch norm pairs fuse exactly as in a
    container (:func:`~.modules.conv_bn_block_problem`: an ``nn.SyncBatchNorm`` or a ``FrozenBatchNorm2d`` keeps the
    block's own forward)."""

    def match(m: nn.Module) -> bool:
        return (
            _registered(m, mixin) and all(hasattr(m, a) for a in attrs) and fm.conv_bn_block_problem(m, mixin) is None
        )

    return match


def _block_apply(mixin: type, detail: str) -> Callable[[nn.Module], tuple[str, list[ParamSwap]]]:
    def apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
        fm.swap_class(m, mixin)
        return detail, []

    return apply


# ------------------------------------------------------------------------------------------- attention / GPT block


def _attention_ok(m: nn.Module | None) -> bool:
    return m is not None and fm.block_mixin(m) is fm.FusedAttentionMixin


def _qkv_problem(m: nn.Module) -> str | None:
    """Why the ``q_proj``/``k_proj``/``v_proj`` of ``m`` cannot be packed into one parameter, judged on ``m`` alone
    (None when they can). :func:`apply_fusions` also refuses parameters shared with other modules, ignored
    projections and projections in different optimizer parameter groups."""
    projs = {n: getattr(m, n, None) for n in fm.QKV_PARTS}
    for n, lin in projs.items():
        if type(lin) is not nn.Linear:
            return f"{n} is {type(lin).__name__}: only nn.Linear projections are packed"
    linears = cast(dict[str, nn.Linear], projs)
    for i, a in enumerate(fm.QKV_PARTS):
        same = [b for b in fm.QKV_PARTS[i + 1 :] if linears[b] is linears[a]]
        if same:
            return f"{same[0]} is the same module as {a}: one module cannot become two parts of a packed parameter"
    hooked = [n for n, lin in linears.items() if fm.needs_eager(lin)]
    if hooked:  # packing removes the three modules, and their hooks
        return f"{hooked[0]} has hooks (a pruning mask, a user's hook) that packing would drop"
    for n, lin in linears.items():
        for kind in ("weight", "bias"):
            # FSDP1 (`FullyShardedDataParallel`) turns a wrapped module's parameters into views of its flat parameter:
            # plain tensors whose storage is freed between forwards (`use_orig_params=False`; reading them crashed the
            # process) or parameters holding this rank's shard only (`use_orig_params=True`)
            if fm.held_by_fsdp1(lin, kind):
                return (
                    f"{n}.{kind} is held by the flat parameter of an FSDP1 `FullyShardedDataParallel` wrapper: packing "
                    "would copy a shard, not the projection"
                )
        for kind, p in lin.named_parameters(recurse=False):
            if type(p.data) is not torch.Tensor:
                # a DTensor sharded by FSDP2's `fully_shard` or tensor parallelism (Lightning's ModelParallelStrategy
                # applies it in `configure_model`, before the precision plugin converts the model): the packed
                # parameter would be a new DTensor the sharding does not manage, never gathered for the forward
                return (
                    f"{n}.{kind} is a {type(p.data).__name__} (sharded by fully_shard or tensor parallelism): a "
                    "packed parameter would not be sharded with the others"
                )
    q = linears["q_proj"]
    for n, lin in linears.items():
        if (lin.in_features, lin.out_features) != (q.in_features, q.out_features):
            return f"{n} maps {lin.in_features}->{lin.out_features}, q_proj {q.in_features}->{q.out_features}"
        if (lin.bias is None) != (q.bias is None):
            return "some of q_proj/k_proj/v_proj have a bias and some not"
        if (lin.weight.dtype, lin.weight.device) != (q.weight.dtype, q.weight.device):
            return f"{n} is {lin.weight.dtype} on {lin.weight.device}, q_proj {q.weight.dtype} on {q.weight.device}"
    # one packed parameter has one requires_grad: projections that train differently stay apart
    for kind in ("weight", "bias"):
        grads = {n: getattr(lin, kind).requires_grad for n, lin in linears.items() if getattr(lin, kind) is not None}
        if len(set(grads.values())) > 1:
            frozen = ", ".join(f"{n}.{kind}" for n, g in grads.items() if not g)
            return f"requires_grad differs ({frozen} frozen, the others not): a packed parameter has one requires_grad"
    return None


def _qkv_match(m: nn.Module) -> bool:
    return _attention_ok(m) and "qkv_proj" not in compat.child_modules(m) and _qkv_problem(m) is None


def _qkv_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    fm.swap_class(m, fm.FusedAttentionMixin)
    swaps = fm.pack_qkv(m)
    return f"q_proj+k_proj+v_proj -> qkv_proj {tuple(swaps[0][1].shape)}", swaps


def _gpt_match(m: nn.Module) -> bool:
    if not _registered(m, fm.FusedGPTBlockMixin):
        return False
    mlp, attn = getattr(m, "mlp", None), getattr(m, "attn", None)
    return (
        isinstance(mlp, nn.Sequential)
        and type(mlp) is nn.Sequential
        and len(mlp) == 4
        and type(mlp[0]) is nn.Linear
        and type(mlp[2]) is nn.Linear
        and type(mlp[3]) is nn.Dropout
        and isinstance(attn, nn.Module)
        and _attention_ok(attn)
        and type(getattr(attn, "resid_dropout", None)) is nn.Dropout
        and type(getattr(attn, "proj", None)) is nn.Linear
    )


def _gpt_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    attn, mlp = m.get_submodule("attn"), m.get_submodule("mlp")
    fm.swap_class(attn, fm.FusedAttentionMixin)
    cast(fm.FusedAttentionMixin, attn)._la_fuse_out = True
    # the fused block forward runs the MLP itself, so the container pattern must leave it alone; a plain instance
    # attribute (nn.Module.__setattr__ is typed for tensors and modules only), kept by deepcopy like the class swap
    mlp.__dict__["_la_claimed"] = True
    fm.swap_class(m, fm.FusedGPTBlockMixin)
    second = cast(nn.Sequential, mlp)[1]
    act = "linear+" + (module_activation(second) or type(second).__name__)
    return f"attn.proj+resid_dropout+residual, mlp[0:2] {act}, mlp[2:4]+residual", []


def _tel_match(m: nn.Module) -> bool:
    return (
        _registered(m, fm.FusedTransformerEncoderLayerMixin)
        and isinstance(m, nn.TransformerEncoderLayer)
        and function_activation(getattr(m, "activation", None)) is not None
        and fm.mha_supported(m.self_attn) is None
        and type(m.linear1) is nn.Linear
        and type(m.linear2) is nn.Linear
        and all(type(getattr(m, d, None)) is nn.Dropout for d in ("dropout", "dropout1", "dropout2"))
    )


def _tel_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    fm.swap_class(m, fm.FusedTransformerEncoderLayerMixin)
    order = "pre-norm" if getattr(m, "norm_first", False) else "post-norm"
    return f"{order}: self_attn (sdpa) + out_proj+dropout1+residual, linear1+act+dropout, linear2+dropout2+residual", []


def _packed_attn_ok(m: nn.Module | None) -> bool:
    if m is None or fm.block_mixin(m) is not fm.FusedPackedAttentionMixin:
        return False
    c_attn, c_proj = getattr(m, "c_attn", None), getattr(m, "c_proj", None)
    return (
        type(c_attn) is nn.Linear
        and type(c_proj) is nn.Linear
        and c_attn.out_features == 3 * c_attn.in_features
        and type(getattr(m, "attn_dropout", None)) is nn.Dropout
        and type(getattr(m, "resid_dropout", None)) is nn.Dropout
        and isinstance(getattr(m, "n_head", None), int)
    )


def _gpt2_match(m: nn.Module) -> bool:
    if not _registered(m, fm.FusedGPT2BlockMixin):
        return False
    mlp = getattr(m, "mlp", None)
    return (
        _packed_attn_ok(getattr(m, "attn", None))
        and isinstance(mlp, nn.Module)
        and type(getattr(mlp, "c_fc", None)) is nn.Linear
        and type(getattr(mlp, "c_proj", None)) is nn.Linear
        and _act_kind(getattr(mlp, "act", None)) is not None
        and type(getattr(mlp, "dropout", None)) is nn.Dropout
    )


def _gpt2_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    fm.swap_class(m.get_submodule("attn"), fm.FusedPackedAttentionMixin)
    fm.swap_class(m, fm.FusedGPT2BlockMixin)
    return "attn (sdpa) + c_proj+resid_dropout+residual, mlp.c_fc+act, mlp.c_proj+dropout+residual", []


def _mha_match(m: nn.Module) -> bool:
    return type(m) is nn.MultiheadAttention and fm.mha_supported(m) is None


def _mha_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    fm.swap_class(m, fm.FusedMultiheadAttentionMixin)
    return f"in_proj (packed) + sdpa, {cast(nn.MultiheadAttention, m).num_heads} heads", []


def _packed_match(m: nn.Module) -> bool:
    return _packed_attn_ok(m) and not fm.is_fused(m)


def _packed_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    fm.swap_class(m, fm.FusedPackedAttentionMixin)
    return "c_attn (packed) + sdpa, c_proj+resid_dropout", []


def _custom_match(m: nn.Module) -> bool:
    mixin = fm.block_mixin(m)
    return mixin is not None and mixin not in fm.BLOCK_MIXINS and not fm.is_fused(m, mixin)


def _custom_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    mixin = cast(type, fm.block_mixin(m))
    fm.swap_class(m, mixin)
    return f"{mixin.__name__}", []


# -------------------------------------------------------------------------------------------------------- norms


def _norm_shape(m: nn.Module) -> tuple[int, ...] | None:
    """``normalized_shape`` of an exact ``nn.LayerNorm`` / ``nn.RMSNorm`` (subclasses may have their own forward)."""
    if isinstance(m, nn.LayerNorm) and type(m) is nn.LayerNorm:
        return tuple(m.normalized_shape)
    if hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm) and type(m) is nn.RMSNorm:  # torch >= 2.4
        return tuple(m.normalized_shape)
    return None


def _norm_match(m: nn.Module) -> bool:
    shape = _norm_shape(m)
    return shape is not None and len(shape) == 1


def _norm_apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
    size = _norm_shape(m)
    if type(m) is nn.LayerNorm:
        fm.swap_class(m, fm.FusedLayerNormMixin)
        return f"LayerNorm({size[0] if size else '?'})", []
    fm.swap_class(m, fm.FusedRMSNormMixin)
    return f"RMSNorm({size[0] if size else '?'})", []


# Order matters: block-level patterns run before the container patterns that would otherwise claim their children.
DEFAULT_POLICY: dict[str, list[Replacement]] = {
    "conv_bn_relu": [
        Replacement(
            _block_match(fm.FusedResNetMixin, ("conv1", "bn1", "relu", "maxpool")),
            _block_apply(fm.FusedResNetMixin, "stem conv1+bn1+relu"),
        ),
        Replacement(
            _block_match(fm.FusedBottleneckMixin, ("conv3", "bn3", "downsample")),
            _block_apply(fm.FusedBottleneckMixin, "conv1+bn1+relu, conv2+bn2+relu, conv3+bn3"),
        ),
        Replacement(
            _block_match(fm.FusedBasicBlockMixin, ("conv1", "bn1", "conv2", "bn2")),
            _block_apply(fm.FusedBasicBlockMixin, "conv1+bn1+relu, conv2+bn2"),
        ),
        Replacement(_seq_match("conv"), _seq_apply("conv")),
    ],
    "linear_dropout": [
        Replacement(_gpt_match, _gpt_apply),
        Replacement(_gpt2_match, _gpt2_apply),
        Replacement(_tel_match, _tel_apply),
        Replacement(_seq_match("linear"), _seq_apply("linear")),
    ],
    "qkv": [Replacement(_qkv_match, _qkv_apply)],
    "attention": [Replacement(_mha_match, _mha_apply), Replacement(_packed_match, _packed_apply)],
    "norm": [Replacement(_norm_match, _norm_apply)],
    "block": [Replacement(_custom_match, _custom_apply)],
}


# ------------------------------------------------------------------------------------------- eligibility and reasons

ELIGIBLE_KINDS: dict[str, tuple[str, ...]] = {
    "conv_bn": ("conv_bn_relu", "block"),
    "linear": ("linear_dropout", "block"),
    "attention": ("attention", "qkv", "linear_dropout", "block"),
    "norm": ("norm",),
}
"""The kinds of eligible modules and the patterns that can fuse each (what "not selected" is checked against)."""

_PACKED_NAMES = ("in_proj", "c_attn", "qkv", "qkv_proj")


def _next_sibling(parent: nn.Module | None, name: str) -> nn.Module | None:
    if parent is None:
        return None
    names = [n for n, c in compat.child_modules(parent).items() if c is not None]
    if name not in names:
        return None
    i = names.index(name)
    return compat.child_modules(parent)[names[i + 1]] if i + 1 < len(names) else None


def _packed_linear(m: nn.Module) -> str | None:
    for n in _PACKED_NAMES:
        lin = compat.child_modules(m).get(n)
        if isinstance(lin, nn.Linear) and lin.out_features == 3 * lin.in_features:
            return n
    return None


def _attention_kind(m: nn.Module) -> bool:
    if isinstance(m, nn.MultiheadAttention):
        return True
    children = compat.child_modules(m)
    if all(isinstance(children.get(n), nn.Linear) for n in fm.QKV_PARTS):
        return True
    return _packed_linear(m) is not None


def _batch_norm_like(m: nn.Module | None) -> bool:
    """A batch norm a user expects to fuse with the conv before it: ``nn.BatchNorm2d`` (subclasses included),
    ``nn.SyncBatchNorm`` and classes named ``...BatchNorm2d`` such as torchvision's ``FrozenBatchNorm2d`` (by name: the
    surgery imports no vision library). Only exact ``nn.BatchNorm2d`` is fused; the others are eligible so that the
    report says why they were not."""
    return isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm)) or (
        m is not None and type(m).__name__.endswith("BatchNorm2d")
    )


def _block_conv(parent: nn.Module | None, name: str) -> bool:
    """``name`` is a conv of a registered ResNet block (its ``conv_bn_pairs``), whatever its norm layer is."""
    mixin = fm.block_mixin(parent) if parent is not None else None
    return any(conv == name for conv, _ in getattr(mixin, "conv_bn_pairs", ()))


def _is_activation(m: nn.Module | None) -> bool:
    if m is None or isinstance(m, nn.MultiheadAttention):
        return False
    return type(m).__module__ == "torch.nn.modules.activation" or _act_kind(m) is not None


def eligible_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(path, module, kind)`` of every module surgery counts as a fusion candidate (the coverage denominator).

    Kinds:

    - ``"norm"``: every ``nn.LayerNorm`` / ``nn.RMSNorm`` (subclasses included);
    - ``"attention"``: every ``nn.MultiheadAttention``, and every module with ``q_proj``/``k_proj``/``v_proj``
      Linears or a packed ``Linear(C, 3 * C)`` named ``in_proj``, ``c_attn``, ``qkv`` or ``qkv_proj`` (its own
      sub-modules are not counted again);
    - ``"conv_bn"``: every ``nn.Conv2d`` whose next sibling (in its parent's registration order, which is the
      execution order in a sequential container) is a batch norm (``nn.BatchNorm2d``, ``nn.SyncBatchNorm``,
      torchvision's ``FrozenBatchNorm2d``), and every conv of a registered ResNet block (``conv1``... with ``bn1``...,
      whatever its norm layer is);
    - ``"linear"``: every ``nn.Linear`` whose next sibling is an activation module or an ``nn.Dropout``.

    Linears and convs that are followed by nothing fusable (a classifier head, a patch embedding) are not eligible.
    """
    out: list[tuple[str, nn.Module, str]] = []
    inside: list[str] = []  # attention modules found so far: their sub-modules are theirs
    modules = dict(model.named_modules())
    norms: tuple[type[nn.Module], ...] = (nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
    for path, m in modules.items():
        if any(path.startswith(a + ".") if a else path for a in inside):  # "" is the root: all below are its own
            continue
        parent_path, _, name = path.rpartition(".")
        parent = modules.get(parent_path) if path else None
        if isinstance(m, norms):
            out.append((path, m, "norm"))
        elif _attention_kind(m):
            out.append((path, m, "attention"))
            inside.append(path)
        elif isinstance(m, nn.Conv2d) and (_batch_norm_like(_next_sibling(parent, name)) or _block_conv(parent, name)):
            out.append((path, m, "conv_bn"))
        elif isinstance(m, nn.Linear):
            nxt = _next_sibling(parent, name)
            if _is_activation(nxt) or isinstance(nxt, nn.Dropout):
                out.append((path, m, "linear"))
    return out


_REGISTER_HINT = "register the class with `register_block(cls, mixin)` (docs/fused.md, *Register a block*)"


def _block_hint(parent: nn.Module, kind: str) -> str:
    """Which mixin an unregistered parent would be registered with, by its attributes."""
    names = set(compat.child_modules(parent))
    if kind == "conv_bn":
        if {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3"} <= names:
            return "FusedBottleneckMixin"
        if {"conv1", "bn1", "conv2", "bn2"} <= names:
            return "FusedBasicBlockMixin"
    if kind == "linear" and {"c_fc", "c_proj"} <= names:
        return "FusedGPT2BlockMixin (on the block that holds this MLP)"
    if kind == "attention":
        if set(fm.QKV_PARTS) <= names:
            return "FusedAttentionMixin"
        if "c_attn" in names:
            return "FusedPackedAttentionMixin"
    return "a FusedBlockMixin subclass of your own"


def _mixin_pattern(mixin: type) -> str:
    """The pattern of :data:`DEFAULT_POLICY` that installs a registered block ``mixin``."""
    if mixin in (fm.FusedBasicBlockMixin, fm.FusedBottleneckMixin, fm.FusedResNetMixin):
        return "conv_bn_relu"
    if mixin in (fm.FusedGPTBlockMixin, fm.FusedGPT2BlockMixin, fm.FusedTransformerEncoderLayerMixin):
        return "linear_dropout"
    if mixin is fm.FusedAttentionMixin:
        return "qkv"
    if mixin is fm.FusedPackedAttentionMixin:
        return "attention"
    return "block"


def _next_named(parent: nn.Module, name: str) -> tuple[str, nn.Module | None]:
    """The name and module of the child registered after ``name`` in ``parent`` (``("", None)`` for the last)."""
    children = compat.child_modules(parent)
    names = [n for n, c in children.items() if c is not None]
    i = names.index(name) if name in names else len(names)
    return (names[i + 1], children[names[i + 1]]) if i + 1 < len(names) else ("", None)


def _skip_reason(
    path: str,
    m: nn.Module,
    kind: str,
    parent: nn.Module | None,
    policy: Mapping[str, Sequence[Replacement]],
    ignored: bool,
    ignored_paths: set[str] | frozenset[str] = frozenset(),
) -> str:
    cls = type(m).__name__
    if ignored:
        return "ignored (`ignore_modules`)"
    default = set(policy) <= set(DEFAULT_POLICY)  # names, so "not selected" can be said
    if default and not set(ELIGIBLE_KINDS[kind]) & set(policy):
        return f"pattern `{ELIGIBLE_KINDS[kind][0]}` not selected (`fusions={sorted(policy)}`)"
    if kind == "norm":
        shape = tuple(getattr(m, "normalized_shape", ()))
        if type(m) not in (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm)):
            return f"`{cls}` is a subclass (its forward may differ); add a `Replacement` for it"
        if len(shape) != 1:
            return f"normalized_shape {shape} spans more than the last dimension"
    if kind == "attention":
        if isinstance(m, nn.MultiheadAttention):
            if type(m) is not nn.MultiheadAttention:
                return f"`{cls}` subclasses nn.MultiheadAttention (its forward may differ); add a `Replacement`"
            why = fm.mha_supported(m)
            if why:
                return f"unsupported configuration: {why}"
        packed = _packed_linear(m)
        mixin = fm.block_mixin(m)
        if mixin is None:
            what = f"packed `{packed}`" if packed else "q_proj/k_proj/v_proj"
            return (
                f"unregistered attention class `{fm.qualname(m)}` ({what}; its forward is its own): "
                f"{_REGISTER_HINT} with {_block_hint(m, 'attention')} if its forward is what that mixin states"
            )
        if mixin is fm.FusedAttentionMixin:
            if default and "qkv" not in policy:
                return f"q_proj/k_proj/v_proj not packed: pattern `qkv` not selected (`fusions={sorted(policy)}`)"
            why = _qkv_problem(m)
            if why:
                return why
        elif default and _mixin_pattern(mixin) not in policy:
            return f"registered with {mixin.__name__}, whose pattern `{_mixin_pattern(mixin)}` is not selected"
        return f"registered with {mixin.__name__} but lacks the attributes its contract names"
    if parent is None:
        return "no pattern matched"
    pcls = fm.original_class(parent)
    if kind == "conv_bn":
        if type(m) is not nn.Conv2d:
            return f"`{cls}` is a subclass of nn.Conv2d"
        if m.padding_mode != "zeros":
            return f"padding_mode={m.padding_mode!r} (only 'zeros' is fused)"
    if kind == "linear" and type(m) is not nn.Linear:
        return f"`{cls}` is a subclass of nn.Linear"
    parent_path, _, name = path.rpartition(".")
    nxt_name, nxt = _next_named(parent, name)
    nxt_path = f"{parent_path}.{nxt_name}" if parent_path else nxt_name
    if issubclass(pcls, nn.Sequential):
        if pcls.forward is not nn.Sequential.forward:
            return f"parent `{pcls.__name__}` overrides nn.Sequential.forward: {_REGISTER_HINT} or add a `Replacement`"
        if getattr(parent, "_la_claimed", False):
            return "its container is run by a fused block whose forward handles this module differently"
        if nxt is not None and nxt_path in ignored_paths:
            return f"the module after it, `{nxt_path}`, is in `ignore_modules` (it runs on its own)"
        if kind == "conv_bn":
            return fm.conv_bn_problem(m, nxt, f"`{path}`", f"`{nxt_path}`") or "no pattern matched"
        return (
            f"the module after it, `{nxt_path}` ({type(nxt).__name__}), is not a fused activation or a Dropout with "
            "p < 1"
        )
    mixin = fm.block_mixin(parent)
    if mixin is not None:
        pattern = _mixin_pattern(mixin)
        if default and pattern not in policy:
            return (
                f"its block `{pcls.__name__}` is registered with {mixin.__name__}, whose pattern `{pattern}` is not "
                f"selected (`fusions={sorted(policy)}`)"
            )
        why = fm.conv_bn_block_problem(parent, mixin) if kind == "conv_bn" and _block_conv(parent, name) else None
        if why:
            return f"{why}, so its block `{pcls.__name__}` runs its own forward"
        return f"parent `{pcls.__name__}` is registered with {mixin.__name__} but does not meet its contract"
    return (
        f"inside `{fm.qualname(pcls)}`, whose own forward calls it: {_REGISTER_HINT} with "
        f"{_block_hint(parent, kind)} if its forward is what that mixin states, or add a `Replacement`"
    )


def _candidates(
    model: nn.Module,
    policy: Mapping[str, Sequence[Replacement]],
    ignore: Sequence[str | type],
    refused: Mapping[str, str] | None = None,
    held: Sequence[str] = (),
) -> list[Candidate]:
    """Every eligible module of ``model``, fused or not; ``refused`` (``{module path: reason}``) and ``held`` (blocks
    left as they were because of ``ignore_modules``) are what :func:`apply_fusions` decided beyond the matchers."""
    refused = refused or {}
    modules = dict(model.named_modules())
    covered: set[str] = set()
    eager: dict[str, str] = {}
    for path, m in modules.items():
        covered.update(f"{path}.{c}" if path else c for c in fm.fused_children(m))
        children = fm.eager_children(m)
        if children and fm.is_fused(m):
            eager.update({f"{path}.{c}" if path else c: m._la_eager_reason() for c in children})
    ignored_paths = {p for p, m in modules.items() if _ignored(p, m, ignore)}
    out = []
    for path, m, kind in eligible_modules(model):
        parent_path = path.rpartition(".")[0]
        parent = modules.get(parent_path) if path else None
        cls = fm.original_class(m).__name__
        if path in eager:
            out.append(Candidate(path, kind, cls, False, eager[path]))
            continue
        if (fm.is_fused(m) and m._la_fuses_itself()) or path in covered:
            out.append(Candidate(path, kind, cls, True))
            continue
        ignored = path in ignored_paths or any(a in ignored_paths for a in _ancestors(path))
        if not ignored and path in refused:
            reason = refused[path]
        elif not ignored and (block := next((a for a in reversed(_ancestors(path)) if a in held), None)) is not None:
            reason = f"its block `{block or '(root)'}` holds a module of `ignore_modules` its fused forward skips"
        else:
            reason = _skip_reason(path, m, kind, parent, policy, ignored, ignored_paths)
        out.append(Candidate(path, kind, cls, False, reason))
    return out


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts))]


# Set on the modules of `ignore_modules` for the duration of one `apply_fusions` call (a plain instance attribute):
# a container's plan leaves them out, and no block whose forward would skip their call is swapped.
_IGNORED_MARK = "_la_ignored"


def _marked_ignored(m: nn.Module | None) -> bool:
    return m is not None and m.__dict__.get(_IGNORED_MARK, False)


def _holds_ignored(m: nn.Module) -> bool:
    """A sub-module of ``m`` (not ``m`` itself) is in ``ignore_modules`` (marked by :func:`apply_fusions`)."""
    return any(_marked_ignored(d) for d in m.modules() if d is not m)


_SURGERY_ATTRS = ("_la_fuse_out", "_la_claimed", "_la_plan", "_la_members")


def _class_snapshot(m: nn.Module) -> list[tuple[nn.Module, type, dict[str, object]]]:
    """Each sub-module's class and surgery attributes, to undo a replacement (:func:`_restore_classes`)."""
    return [(d, type(d), {k: d.__dict__[k] for k in _SURGERY_ATTRS if k in d.__dict__}) for d in m.modules()]


def _restore_classes(snapshot: list[tuple[nn.Module, type, dict[str, object]]]) -> None:
    for d, cls, attrs in snapshot:
        if type(d) is not cls:
            patching.swap_class(d, cls)
        for k in _SURGERY_ATTRS:
            d.__dict__.pop(k, None)
        d.__dict__.update(attrs)


def _skips_ignored(m: nn.Module) -> bool:
    """A fused forward in ``m``'s tree would skip the call of (or compute through fused ops) an ignored module."""
    for d in m.modules():
        if not fm.is_fused(d) or isinstance(d, fm.FusedSequentialMixin):  # containers plan around ignored modules
            continue
        if _marked_ignored(d):  # its class was swapped by the block replacement (a GPT block's attention)
            return True
        skipped = [*d._la_bypassed(), *(d.get_submodule(c) for c in fm.fused_children(d))]
        if any(_marked_ignored(x) for x in skipped):
            return True
    return False


def _ignore_list(ignore_modules: object) -> tuple[str | type, ...]:
    """``ignore_modules`` as a tuple: one name or class, or a sequence of them.

    Raises:
        TypeError: for an item that is neither a name nor an ``nn.Module`` class.
        ValueError: for an empty name: ``''`` is the root module's name in ``named_modules()``, so it would leave the
            root container alone and still fuse everything below it, neither "nothing" nor "everything".
    """
    items: tuple[object, ...] | None = None
    if isinstance(ignore_modules, (str, type)):
        items = (ignore_modules,)
    elif isinstance(ignore_modules, Iterable):
        items = tuple(ignore_modules)
    if items is not None and all(isinstance(i, str) or _module_class(i) for i in items):
        if "" in items:
            raise ValueError(
                f"`ignore_modules` holds an empty module name, got {ignore_modules!r}; expected qualified names as in "
                "`model.named_modules()` (e.g. 'model.blocks.0'). Pass `ignore_modules=[]` to ignore nothing, or "
                "`fusions=[]` to fuse nothing."
            )
        return cast(tuple[str | type, ...], items)
    raise TypeError(
        f"`ignore_modules` must be module names (e.g. 'model.blocks.0') or nn.Module classes, or a list of them; got "
        f"{ignore_modules!r}."
    )


def _module_class(item: object) -> bool:
    return isinstance(item, type) and issubclass(item, nn.Module)


def _param_groups(optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, tuple[int, int]]:
    """``{id(param): (optimizer index, group index)}``."""
    return {
        id(p): (i, j) for i, opt in enumerate(optimizers) for j, g in enumerate(opt.param_groups) for p in g["params"]
    }


def _param_owners(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): [qualified names]}`` of the parameters registered in more than one place of ``model``
    (tied weights; a module reachable under two paths counts once: its parameter has one owner)."""
    owners: dict[int, dict[tuple[int, str], str]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        path, _, attr = name.rpartition(".")
        owners.setdefault(id(p), {}).setdefault((id(modules[path]), attr), name)
    return {i: list(names.values()) for i, names in owners.items() if len(names) > 1}


def _qkv_refusal(
    name: str,
    m: nn.Module,
    where: Mapping[int, tuple[int, int]],
    shared: Mapping[int, list[str]],
) -> str | None:
    """Why :func:`apply_fusions` does not pack ``m`` (at ``name``) although :func:`_qkv_match` accepts it, from what the
    module alone cannot tell: an ignored projection, a parameter shared with another module (packing copies it, which
    would untie the two), projections in different optimizer parameter groups (one packed parameter cannot be)."""
    for n in fm.QKV_PARTS:
        if _marked_ignored(getattr(m, n)):
            return f"{n} is in `ignore_modules` (packing would replace it)"
    prefix = f"{name}." if name else ""
    for n in fm.QKV_PARTS:
        for kind, p in getattr(m, n).named_parameters(recurse=False):
            others = [o for o in shared.get(id(p), []) if o != f"{prefix}{n}.{kind}"]
            if others:
                return (
                    f"{n}.{kind} is shared with `{others[0]}` (tied weights): packing copies it, which would untie them"
                )
    params = [p for n in fm.QKV_PARTS for p in getattr(m, n).parameters()]
    if len({where.get(id(p)) for p in params}) > 1:
        return "q_proj/k_proj/v_proj sit in different optimizer parameter groups (one packed parameter cannot)"
    return None


def _merged_state(states: Sequence[Mapping[str, object] | None], olds: Sequence[torch.Tensor]) -> dict | None:
    """The optimizer state of a parameter packed from ``olds`` (concatenated along dim 0), given theirs (``states``),
    or None for a fresh start.

    Only state that is element-wise (each tensor shaped as its own parameter: Adam's ``exp_avg``, SGD's
    ``momentum_buffer``) or scalar (``step``, equal for parameters stepped together) is merged; a factored state (an
    ``Adafactor``'s ``(rows, 1)`` / ``(1, cols)`` second moments) or parts with different keys start fresh:
    concatenating a factored state along dim 0 gives a shape the optimizer's next step fails on (or, worse, a wrong
    statistic).
    """
    full = [s for s in states if s]
    if len(full) != len(states) or any(s.keys() != full[0].keys() for s in full):
        return None
    merged: dict[str, object] = {}
    for key, val in full[0].items():
        vals = [s[key] for s in full]
        if torch.is_tensor(val) and val.dim() > 0:
            if not all(torch.is_tensor(v) and v.shape == o.shape for v, o in zip(vals, olds, strict=True)):
                return None
            merged[key] = torch.cat(cast(list[torch.Tensor], vals), dim=0)
        else:
            merged[key] = val  # scalars such as `step` are equal for params stepped together
    return merged


def replace_optimizer_params(optimizers: Iterable[torch.optim.Optimizer], swaps: Sequence[ParamSwap]) -> int:
    """Point optimizers at new parameters: each ``(olds, new)`` puts ``new`` where the first old one was.

    Per-parameter state (e.g. Adam's ``exp_avg``) is concatenated along dim 0 when every old parameter has state of
    matching layout (QKV packing concatenates the weights the same way); otherwise the new parameter starts fresh
    (see :func:`_merged_state`).

    Returns:
        the number of parameter groups changed.
    """
    changed = 0
    for opt in optimizers:
        for olds, new in swaps:
            for group in opt.param_groups:
                ids = [i for i, p in enumerate(group["params"]) if any(p is o for o in olds)]
                if not ids:
                    continue
                merged = _merged_state([opt.state.get(o) for o in olds], olds)
                if merged is not None:
                    opt.state[new] = merged
                for o in olds:
                    opt.state.pop(o, None)
                params = [p for i, p in enumerate(group["params"]) if i not in ids[1:]]
                params[ids[0]] = new
                group["params"] = params
                changed += 1
    return changed


def follow_replaced_parameters(optimizers: Iterable[torch.optim.Optimizer], report: FusionReport) -> int:
    """Point optimizers built before surgery, and not passed to :func:`apply_fusions`, at the parameters that replaced
    the ones they hold (QKV packing): otherwise they step parameters that are no longer in the model, and the packed
    projection never trains. An optimizer that holds none of the replaced parameters is left as it is.

    Returns:
        the number of parameter groups changed.

    Raises:
        ValueError: when an optimizer holds only some of the parameters one new parameter replaced, or holds them in
            different parameter groups: one packed parameter cannot follow them.
    """
    changed = 0
    for opt in optimizers:
        for rep in report.replaced:
            olds = [ref() for ref in rep.olds]
            alive = [o for o in olds if o is not None]
            groups = {j for j, g in enumerate(opt.param_groups) for p in g["params"] if any(p is o for o in alive)}
            if not groups:
                continue
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            if len(alive) < len(olds) or any(id(o) not in held for o in alive) or len(groups) > 1:
                what = "in different parameter groups" if len(groups) > 1 else "only in part"
                raise ValueError(
                    f"An optimizer ({type(opt).__name__}) built before the surgery holds the parameters that surgery "
                    f"packed into one in `{rep.module}` (q_proj/k_proj/v_proj) {what}, which the packed parameter "
                    "cannot follow. Build the optimizer in `configure_optimizers`, which runs after the surgery, or "
                    f"leave `qkv` out of `fusions` (or pass `ignore_modules=['{rep.module}']`)."
                )
            changed += replace_optimizer_params([opt], [(alive, rep.new)])
    return changed


def _fusion_policy(fusions: object) -> Mapping[str, Sequence[Replacement]]:
    """The policy ``fusions`` selects: None (all of :data:`DEFAULT_POLICY`), one pattern name or a sequence of them,
    or a custom ``{pattern: [Replacement, ...]}`` policy, returned as it is.

    Raises:
        TypeError: for anything else, a name that is not a string, or a policy value that is not a list of
            ``Replacement``.
        ValueError: for an unknown pattern name.
    """
    names = sorted(DEFAULT_POLICY)
    if fusions is None:
        return DEFAULT_POLICY
    if isinstance(fusions, Mapping):
        for key, reps in fusions.items():
            if (
                not isinstance(key, str)
                or isinstance(reps, (str, bytes))
                or not isinstance(reps, Sequence)
                or not all(isinstance(r, Replacement) for r in reps)
            ):
                raise TypeError(
                    f"`fusions` as a policy must map pattern names to lists of `Replacement`, got {key!r}: {reps!r}. "
                    f"Pass pattern names from {names} to select built-in patterns."
                )
        return cast(Mapping[str, Sequence[Replacement]], fusions)
    items = [fusions] if isinstance(fusions, str) else fusions
    if isinstance(items, (bytes, Mapping)) or not isinstance(items, Iterable):
        raise TypeError(
            f"`fusions` must be pattern names from {names} (one or a list), a `{{pattern: [Replacement]}}` policy or "
            f"None for all, got {fusions!r} ({type(fusions).__name__})."
        )
    items = list(items)
    if not all(isinstance(f, str) for f in items):
        raise TypeError(f"`fusions` must hold pattern names (strings) from {names}, got {items!r}.")
    unknown = [f for f in items if f not in DEFAULT_POLICY]
    if unknown:
        raise ValueError(
            f"`fusions` has unknown pattern(s) {unknown}; expected names from {names} "
            "(or a `{pattern: [Replacement]}` policy for custom ones)."
        )
    return {k: DEFAULT_POLICY[k] for k in DEFAULT_POLICY if k in items}


def _optimizer_list(optimizers: object) -> list[torch.optim.Optimizer]:
    """``optimizers`` as a list: one ``torch.optim.Optimizer`` or an iterable of them.

    Raises:
        TypeError: naming ``optimizers`` for anything else (before surgery changes the model).
    """
    if isinstance(optimizers, torch.optim.Optimizer) or hasattr(optimizers, "param_groups"):
        return [cast(torch.optim.Optimizer, optimizers)]
    items = list(optimizers) if isinstance(optimizers, Iterable) and not isinstance(optimizers, (str, bytes)) else None
    # duck-typed: a wrapper that shares its optimizer's `param_groups` and `state` (Lightning's LightningOptimizer)
    if items is None or not all(hasattr(o, "param_groups") and hasattr(o, "state") for o in items):
        raise TypeError(
            f"`optimizers` must be a `torch.optim.Optimizer` or a list of them (those already holding the model's "
            f"parameters), got {optimizers!r} ({type(optimizers).__name__}). Pass `optimizers=[opt]`, or nothing "
            "when no optimizer exists yet."
        )
    return cast(list[torch.optim.Optimizer], items)


def _ignored(name: str, module: nn.Module, ignore: Sequence[str | type]) -> bool:
    for item in ignore:
        if isinstance(item, type):
            if isinstance(module, item):
                return True
        elif name == item or name.startswith(item + "."):
            return True
    return False


def apply_fusions(
    model: nn.Module,
    fusions: Sequence[str] | Mapping[str, Sequence[Replacement]] | None = None,
    ignore_modules: str | type | Sequence[str | type] = (),
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
    warn_if_empty: bool = True,
    backend: Backend | None = None,
) -> FusionReport:
    """Fuse the patterns of ``fusions`` found in ``model``, in place, and return what was done.

    Args:
        model: the module tree to modify (the object itself is changed; nothing is returned instead of it).
        fusions: pattern names from :data:`DEFAULT_POLICY` (default: all), or a full policy
            ``{pattern: [Replacement, ...]}`` for custom patterns. An empty selection (``[]`` or ``{}``) fuses
            nothing, on purpose: the model is left as it is, without the nothing-matched warning.
        ignore_modules: qualified module names (``"model.layers.0"``; their sub-modules too) or module classes to
            leave alone (one name or class, or a sequence): no fused forward skips their call (a container fuses
            around them, a block that holds one is not swapped).
        optimizers: optimizers already holding ``model``'s parameters (one or a list); their references (and state)
            are patched for the parameters surgery replaces.
        warn_if_empty: emit a ``UserWarning`` when the selected patterns matched nothing (never for an empty
            selection, which asks for nothing). Under ``torch.distributed`` (or a launcher's ``RANK``), this warning,
            the one for unknown ``ignore_modules`` names and the log of what was fused come from global rank 0 only:
            every rank does the same surgery.
        backend: the ops backend every fused module uses: ``"auto"`` (default: Triton kernels on CUDA, plain torch
            ops elsewhere), ``"reference"`` (the fused functions' torch path, e.g. to exercise it on a CPU),
            ``"triton"`` or ``"eager"``. None leaves already-fused modules as they are.

    Raises:
        ValueError: for an unknown pattern name, or an empty name in ``ignore_modules``.
        TypeError: for ``fusions`` of another type, ``ignore_modules`` that are not names or ``nn.Module`` classes,
            ``optimizers`` that are not optimizers, or a ``warn_if_empty`` that is not True or False.
    """
    warn_if_empty = check_bool("warn_if_empty", warn_if_empty)
    ignore_modules = _ignore_list(ignore_modules)
    optimizers = _optimizer_list(optimizers)
    policy = _fusion_policy(fusions)
    report = FusionReport()
    # snapshot first: surgery changes the tree while we walk it
    named = list(model.named_modules())
    marked = [m for name, m in named if _ignored(name, m, ignore_modules)]
    unknown_names = [
        i for i in ignore_modules if isinstance(i, str) and not any(_ignored(n, m, (i,)) for n, m in named)
    ]
    # every rank does the same surgery and would say the same thing: global rank 0 speaks for them
    speak = is_global_zero()
    if unknown_names and speak:
        warnings.warn(
            f"`ignore_modules` names {unknown_names}, which are not modules of {type(model).__name__}; module names "
            "are qualified as in `model.named_modules()` (e.g. 'blocks.0.mlp').",
            UserWarning,
            stacklevel=2,
        )
    where = _param_groups(optimizers)
    shared = _param_owners(model)
    refused: dict[str, str] = {}  # attention modules whose q/k/v projections stay apart, with the reason
    held: list[str] = []  # blocks left as they were: their fused forward would skip an ignored module
    for m in marked:
        m.__dict__[_IGNORED_MARK] = True
    try:
        for name, module in named:
            if _marked_ignored(module):
                continue
            for pattern, replacements in policy.items():
                for rep in replacements:
                    if not rep.match(module):
                        continue
                    if rep.apply is _qkv_apply and (why := _qkv_refusal(name, module, where, shared)) is not None:
                        refused[name] = why
                        continue
                    # a block whose fused forward would skip an ignored module's call is put back as it was
                    undo = _class_snapshot(module) if _holds_ignored(module) else None
                    detail, swaps = rep.apply(module)
                    if undo is not None and not swaps and _skips_ignored(module):
                        _restore_classes(undo)
                        held.append(name)
                        continue
                    report.records.append(FusionRecord(name, pattern, detail))
                    report.param_swaps.extend(swaps)
                    report.replaced.extend(
                        Replaced(name, tuple(weakref.ref(o) for o in olds), new) for olds, new in swaps
                    )
    finally:
        for m in marked:
            m.__dict__.pop(_IGNORED_MARK, None)
    report.candidates = _candidates(model, policy, ignore_modules, refused, held)
    if backend is not None:
        check_backend(backend)
        for m in model.modules():
            if fm.is_fused(m):
                m._la_backend = backend
    if report.param_swaps:
        replace_optimizer_params(optimizers, report.param_swaps)
        for olds, _ in report.param_swaps:
            olds.clear()  # the optimizers hold the new parameters now: release the replaced ones
    if report.records:
        if speak:
            log.info("%s: %s:\n%s", type(model).__name__, report.summary(), report.table())
    elif speak and warn_if_empty and policy and not any(fm.is_fused(m) for m in model.modules()):
        # an empty policy asked for nothing, and a second call (all fused already) is not "nothing"
        warnings.warn(
            f"Module surgery found nothing to fuse in {type(model).__name__} for patterns {list(policy)}"
            f"{_skipped_note(report)}. See docs/fused.md for what is matched; pass `fusions=` / `ignore_modules=` to "
            "change the selection.",
            UserWarning,
            stacklevel=2,
        )
    return report


# skipped modules the nothing-fused warning names: the rest are counted (the report's table lists them all)
_WARN_SKIPPED = 3


def _skipped_note(report: FusionReport) -> str:
    """``": 2 eligible module(s) left unfused: 'a' (kind: why), ..."``, or ``""`` when the model has none: the
    reasons say what to change, where "nothing to fuse" alone does not."""
    skipped = report.skipped()
    if not skipped:
        return ""
    shown = ", ".join(f"{c.module or '(root)'!r} ({c.kind}: {c.reason})" for c in skipped[:_WARN_SKIPPED])
    more = (
        f" and {len(skipped) - _WARN_SKIPPED} more (`report.table()` lists them all)"
        if len(skipped) > _WARN_SKIPPED
        else ""
    )
    return f": {len(skipped)} eligible module(s) left unfused: {shown}{more}"


def unfuse(model: nn.Module) -> int:
    """Undo surgery in place: every fused module computes through the reference ops again, i.e. its original class's
    own ``forward`` (the class swap is reverted; parameters, buffers and ``state_dict`` keys never changed). Modules
    whose parameters surgery repacked (packed QKV) cannot get their original parameters back: they stay packed and
    compute on the plain torch path (``backend="eager"``, the ops' oracles).

    The modules come back as surgery found them, so a later :func:`apply_fusions` fuses them again: the plan a
    container kept and the claim a block put on its MLP container go with the class swap (left behind, they would
    make the container look fused already, and the next surgery fuse nothing).

    Returns:
        the number of modules changed.
    """
    changed = 0
    for m in list(model.modules()):
        if not fm.is_fused(m):
            continue
        if any(issubclass(mixin, fm.FusedAttentionMixin) for mixin in getattr(type(m), "_la_mixins", ())):
            m._la_backend = "eager"
        else:
            patching.swap_class(m, fm.original_class(m))
            for attr in ("_la_plan", "_la_members", "_la_backend"):
                m.__dict__.pop(attr, None)
        changed += 1
    # every block that claimed a container is back on its own forward now (only attention modules stay fused)
    for m in model.modules():
        m.__dict__.pop("_la_claimed", None)
    return changed
