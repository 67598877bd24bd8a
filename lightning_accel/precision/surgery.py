"""Module surgery: find fusable patterns and install fused forwards *in place*, by a ``{pattern: replacement}`` policy.

Functional core of :class:`~lightning_accel.precision.FusedPrecision` (no Lightning import). Use it directly::

    report = apply_fusions(model)                       # all default patterns
    report = apply_fusions(model, fusions=["norm"], optimizers=[opt])

The patterns (keys of :data:`DEFAULT_POLICY`):

``conv_bn_relu``
    ``nn.Sequential`` runs of ``Conv2d -> BatchNorm2d -> ReLU`` (or ``Conv2d -> BatchNorm2d``), and the blocks
    registered as ResNet blocks (torchvision's ``BasicBlock``/``Bottleneck``/``ResNet`` stem, or any class registered
    with :func:`~lightning_accel.precision.modules.register_block`).
``linear_dropout``
    ``nn.Sequential`` runs of ``Linear -> Dropout``, and in registered GPT blocks the attention output projection and
    the MLP's last ``Linear -> Dropout``, each together with the block's residual add.
``qkv``
    Separate ``q_proj``/``k_proj``/``v_proj`` in registered attention classes -> one packed GEMM.
``norm``
    ``nn.LayerNorm`` and ``nn.RMSNorm`` over the last dimension (exact classes, not subclasses).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from lightning_accel._utils import compat
from lightning_accel._utils.triton import Backend, check_backend
from lightning_accel.precision import modules as fm

__all__ = [
    "DEFAULT_POLICY",
    "FusionRecord",
    "FusionReport",
    "Replacement",
    "apply_fusions",
    "replace_optimizer_params",
]

log = logging.getLogger(__name__)

ParamSwap = tuple[list[torch.Tensor], nn.Parameter]


@dataclass
class FusionRecord:
    """One fusion: where (``module`` path), which ``pattern``, and what (``detail``)."""

    module: str
    pattern: str
    detail: str


@dataclass
class FusionReport:
    """What :func:`apply_fusions` did: ``records`` (one per fusion) and ``param_swaps`` (old params -> new param)."""

    records: list[FusionRecord] = field(default_factory=list)
    param_swaps: list[ParamSwap] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """``{pattern: number of fusions}``."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.pattern] = out.get(r.pattern, 0) + 1
        return out

    def table(self) -> str:
        """A markdown table of the fusions (what ``apply_fusions`` logs)."""
        lines = ["| module | pattern | fused |", "|---|---|---|"]
        lines += [f"| {r.module or '(root)'} | {r.pattern} | {r.detail} |" for r in self.records]
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.records)


@dataclass(frozen=True)
class Replacement:
    """A policy entry: ``match(module) -> bool`` and ``apply(module) -> (detail, param swaps)``, applied in place.

    ``apply`` is only called when ``match`` returned True and must leave the module fully usable.
    """

    match: Callable[[nn.Module], bool]
    apply: Callable[[nn.Module], tuple[str, list[ParamSwap]]]


# ------------------------------------------------------------------------------------------------ conv_bn_relu


def _conv_ok(m: nn.Module | None) -> bool:
    return type(m) is nn.Conv2d and m.padding_mode == "zeros"


def _bn_ok(m: nn.Module | None, conv: nn.Conv2d) -> bool:
    return type(m) is nn.BatchNorm2d and m.num_features == conv.out_channels


def _plan_sequential(seq: nn.Module, which: str) -> dict[int, tuple[int, str]]:
    mods = list(compat.child_modules(seq).values())
    plan: dict[int, tuple[int, str]] = {}
    i = 0
    while i < len(mods):
        cur, nxt = mods[i], mods[i + 1] if i + 1 < len(mods) else None
        if which == "conv" and isinstance(cur, nn.Conv2d) and _conv_ok(cur) and _bn_ok(nxt, cur):
            if i + 2 < len(mods) and type(mods[i + 2]) is nn.ReLU:
                plan[i] = (3, "conv_bn_relu")
                i += 3
            else:
                plan[i] = (2, "conv_bn")
                i += 2
            continue
        if which == "linear" and type(cur) is nn.Linear and type(nxt) is nn.Dropout:
            plan[i] = (2, "linear_dropout")
            i += 2
            continue
        i += 1
    return plan


def _seq_match(which: str) -> Callable[[nn.Module], bool]:
    def match(m: nn.Module) -> bool:
        if fm.original_class(m) is not nn.Sequential or getattr(m, "_la_claimed", False):
            return False
        done: dict[int, tuple[int, str]] = getattr(m, "_la_plan", {})
        return any(i not in done for i in _plan_sequential(m, which))

    return match


def _seq_apply(which: str) -> Callable[[nn.Module], tuple[str, list[ParamSwap]]]:
    def apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
        plan: dict[int, tuple[int, str]] = dict(getattr(m, "_la_plan", {}))
        new = {i: v for i, v in _plan_sequential(m, which).items() if i not in plan}
        plan.update(new)
        fm.swap_class(m, fm.FusedSequentialMixin)
        cast(fm.FusedSequentialMixin, m)._la_plan = plan
        return ", ".join(f"[{i}:{i + n}] {kind}" for i, (n, kind) in sorted(new.items())), []

    return apply


def _registered(m: nn.Module, mixin: type) -> bool:
    """``m``'s class (before surgery) was registered for ``mixin``, and ``m`` does not have it yet."""
    return fm.block_mixin(m) is mixin and not fm.is_fused(m, mixin)


def _block_match(mixin: type, attrs: Sequence[str]) -> Callable[[nn.Module], bool]:
    def match(m: nn.Module) -> bool:
        return _registered(m, mixin) and all(hasattr(m, a) for a in attrs)

    return match


def _block_apply(mixin: type, detail: str) -> Callable[[nn.Module], tuple[str, list[ParamSwap]]]:
    def apply(m: nn.Module) -> tuple[str, list[ParamSwap]]:
        fm.swap_class(m, mixin)
        return detail, []

    return apply


# ------------------------------------------------------------------------------------------- attention / GPT block


def _attention_ok(m: nn.Module | None) -> bool:
    return m is not None and fm.block_mixin(m) is fm.FusedAttentionMixin


def _qkv_match(m: nn.Module) -> bool:
    if not _attention_ok(m) or "qkv_proj" in compat.child_modules(m):
        return False
    projs = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    linears = [p for p in projs if type(p) is nn.Linear]
    if len(linears) != 3:
        return False
    shapes = {(p.in_features, p.out_features, p.bias is not None, p.weight.dtype, p.weight.device) for p in linears}
    return len(shapes) == 1


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
    return "attn.proj+resid_dropout+residual, mlp[2:4]+residual", []


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
        Replacement(_seq_match("linear"), _seq_apply("linear")),
    ],
    "qkv": [Replacement(_qkv_match, _qkv_apply)],
    "norm": [Replacement(_norm_match, _norm_apply)],
}


def replace_optimizer_params(optimizers: Iterable[torch.optim.Optimizer], swaps: Sequence[ParamSwap]) -> int:
    """Point optimizers at new parameters: each ``(olds, new)`` puts ``new`` where the first old one was.

    Per-parameter state (e.g. Adam's ``exp_avg``) is concatenated along dim 0 when every old parameter has state of
    matching layout (QKV packing concatenates the weights the same way); otherwise the new parameter starts fresh.

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
                states = [s for s in (opt.state.get(o) for o in olds) if s]
                if len(states) == len(olds) and all(s.keys() == states[0].keys() for s in states):
                    merged = {}
                    for key, val in states[0].items():
                        vals = [s[key] for s in states]
                        if torch.is_tensor(val) and val.dim() > 0 and val.shape[1:] == new.shape[1:]:
                            merged[key] = torch.cat(vals, dim=0)
                        else:
                            merged[key] = val  # scalars such as `step` are equal for params stepped together
                    opt.state[new] = merged
                for o in olds:
                    opt.state.pop(o, None)
                params = [p for i, p in enumerate(group["params"]) if i not in ids[1:]]
                params[ids[0]] = new
                group["params"] = params
                changed += 1
    return changed


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
    ignore_modules: Sequence[str | type] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    warn_if_empty: bool = True,
    backend: Backend | None = None,
) -> FusionReport:
    """Fuse the patterns of ``fusions`` found in ``model``, in place, and return what was done.

    Args:
        model: the module tree to modify (the object itself is changed; nothing is returned instead of it).
        fusions: pattern names from :data:`DEFAULT_POLICY` (default: all), or a full policy
            ``{pattern: [Replacement, ...]}`` for custom patterns.
        ignore_modules: qualified module names (``"model.layers.0"``; their sub-modules too) or module classes to
            leave alone.
        optimizers: optimizers already holding ``model``'s parameters; their references (and state) are patched for
            the parameters surgery replaces.
        warn_if_empty: emit a ``UserWarning`` when nothing matched.
        backend: the ops backend every fused module uses: ``"auto"`` (default: Triton kernels on CUDA, plain torch
            ops elsewhere), ``"reference"`` (the fused functions' torch path, e.g. to exercise it on a CPU),
            ``"triton"`` or ``"eager"``. None leaves already-fused modules as they are.

    Raises:
        ValueError: for an unknown pattern name.
    """
    if fusions is None:
        policy: Mapping[str, Sequence[Replacement]] = DEFAULT_POLICY
    elif isinstance(fusions, Mapping):
        policy = fusions
    else:
        if isinstance(fusions, str):
            fusions = [fusions]
        unknown = [f for f in fusions if f not in DEFAULT_POLICY]
        if unknown:
            raise ValueError(
                f"`fusions` has unknown pattern(s) {unknown}; expected names from {sorted(DEFAULT_POLICY)} "
                "(or a `{pattern: [Replacement]}` policy for custom ones)."
            )
        policy = {k: DEFAULT_POLICY[k] for k in DEFAULT_POLICY if k in fusions}
    report = FusionReport()
    # snapshot first: surgery changes the tree while we walk it
    for name, module in list(model.named_modules()):
        if _ignored(name, module, ignore_modules):
            continue
        for pattern, replacements in policy.items():
            for rep in replacements:
                if rep.match(module):
                    detail, swaps = rep.apply(module)
                    report.records.append(FusionRecord(name, pattern, detail))
                    report.param_swaps.extend(swaps)
    if backend is not None:
        check_backend(backend)
        for m in model.modules():
            if fm.is_fused(m):
                m._la_backend = backend
    if report.param_swaps:
        replace_optimizer_params(list(optimizers), report.param_swaps)
    if report.records:
        log.info("Fused %d pattern(s) in %s:\n%s", len(report), type(model).__name__, report.table())
    elif warn_if_empty and not any(fm.is_fused(m) for m in model.modules()):  # a second call is not "nothing"
        warnings.warn(
            f"Module surgery found nothing to fuse in {type(model).__name__} for patterns {list(policy)}. "
            "See docs/fused.md for what is matched; pass `fusions=` / `ignore_modules=` to change the selection.",
            UserWarning,
            stacklevel=2,
        )
    return report
