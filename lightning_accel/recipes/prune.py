"""Structured pruning that physically removes channels: smaller weights, fewer FLOPs, not masks.

Functional core (plain torch, no Lightning). The channel groups -- the channels that must be removed together, and
the layers indexed by them -- come from :func:`~lightning_accel.recipes.channel_groups.find_channel_groups` (a
``torch.fx`` trace). This module ranks and removes them:

1. **Score** each group's channels by the ``l1`` or ``l2`` norm of the producing filters (Li et al., 2017, "Pruning
   Filters for Efficient ConvNets"); producers of one group are normalised by their mean score first so a 3x3 conv
   and a 1x1 shortcut conv weigh equally.
2. **Remove** the ``floor(amount * C)`` weakest channels of every group: the producers lose output rows (weight and
   bias), BatchNorm loses affine parameters and running statistics, consumers lose input columns. Sliced
   parameters are new ``nn.Parameter`` objects; optimizers passed in are re-pointed to them and their per-parameter
   state (momentum, Adam moments) is sliced the same way, so an optimizer and its LR schedule keep working
   mid-training. (Anything else holding the old parameters -- a DDP wrapper, an EMA copy -- must be rebuilt.)

Entry point: :func:`apply_structured_pruning`. ``amount`` is the fraction of each group's current channels removed.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accel._utils.checks import check_choice, check_int, check_number, renamed_argument
from lightning_accel.recipes.channel_groups import (
    CONV_TYPES,
    NORM_TYPES,
    ChannelGroup,
    Norm,
    check_module_names,
    find_channel_groups,
)

__all__ = [
    "PruneResult",
    "apply_structured_pruning",
    "batch_norms",
    "channel_importance",
    "check_amount",
    "count_parameters",
    "recalibrate_batchnorm",
    "resize_to_state_dict",
    "schedule_amounts",
]


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
    """Validate a pruning fraction in [0, 1) and return it as a float (through ``_utils.checks.check_number``).

    Raises:
        TypeError: ``amount`` is not a number (a bool or a string neither), naming ``name``.
        ValueError: ``amount`` outside [0, 1), naming ``name``, with the value and the fix.
    """
    checked: float = check_number(
        name,
        amount,
        low=0,
        high=1,
        high_open=True,
        fix="It is the fraction of the channels to remove: 0.5 removes half of each prunable layer's channels; 1.0 "
        "would remove them all.",
    )
    return checked


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def schedule_amounts(amount: float, steps: int, *, removed: float = 0.0) -> list[float]:
    """Per-step fractions for iterative pruning that remove ``amount`` of the original channels in ``steps`` steps.

    Step ``k`` brings the cumulative removed fraction to ``a_k = removed + (amount - removed) * k / steps``; its
    fraction of the *current* channels is ``1 - (1 - a_k) / (1 - a_{k-1})``. ``removed`` is the fraction of the
    original channels earlier steps already took (a resume whose checkpoint pruned with another ``amount``); when it
    is ``amount`` or more, every step is 0: pruned channels do not grow back.

    Raises:
        TypeError: an ``amount``, ``steps`` or ``removed`` of the wrong type, naming it.
        ValueError: ``amount`` or ``removed`` outside [0, 1), ``steps`` below 1, naming it.
    """
    check_amount(amount)
    check_int("steps", steps, low=1)
    check_number(
        "removed", removed, low=0, high=1, high_open=True, fix="It is the fraction of the original channels removed."
    )
    if removed >= amount:
        return [0.0] * steps
    cum = [removed + (amount - removed) * k / steps for k in range(steps + 1)]
    return [1.0 - (1.0 - cum[k]) / (1.0 - cum[k - 1]) for k in range(1, steps + 1)]


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
    check_choice("norm", norm, ("l1", "l2"))
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


def batch_norms(model: nn.Module) -> list[Norm]:
    """The BatchNorm layers of ``model`` that keep running statistics (the ones pruning can leave stale)."""
    return [m for m in model.modules() if isinstance(m, NORM_TYPES) and m.track_running_stats]


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
    ignore_modules: Iterable[str] = (),
    round_to: int = 1,
    fold_bn: bool = False,
    ignore: Iterable[str] | None = None,
) -> PruneResult:
    """Remove the ``amount`` weakest channels of every prunable group of ``model``, in place.

    Args:
        model: the network; its layers are shrunk in place (same module objects, new parameter objects).
        amount: fraction in [0, 1) of each group's current channels to remove (at least one channel is kept).
        example_inputs: inputs for one traced forward pass, on the model's device.
        norm: filter norm used to rank channels, ``"l1"`` or ``"l2"``.
        optimizers: optimizers over ``model``'s parameters whose per-parameter state is sliced to match.
        ignore_modules: module names whose output channels must not be pruned (one name alone: a string); each must
            be in ``model.named_modules()``.
        round_to: keep a multiple of this many channels per group (e.g. 8 for vectorised kernels).
        fold_bn: rank a producer followed by a BatchNorm on its BN-folded filter (see :func:`channel_importance`).
        ignore: deprecated spelling of ``ignore_modules`` (same values).

    Returns:
        A :class:`PruneResult`; a warning is raised when nothing was pruned.

    Raises:
        ValueError: bad ``amount``/``norm``/``round_to``, each named; an ``ignore_modules`` name not in the model.
        TypeError: an ``amount``/``norm``/``round_to`` of the wrong type, each named; a model torch.fx cannot trace.
    """
    amount = check_amount(amount)
    check_choice("norm", norm, ("l1", "l2"))
    check_int("round_to", round_to, low=1)
    before = count_parameters(model)
    ignore_modules = check_module_names("ignore_modules", ignore_modules) or ()
    ignore_modules = renamed_argument(
        "ignore_modules", ignore_modules, "ignore", check_module_names("ignore", ignore), new_given=bool(ignore_modules)
    )
    groups, skipped = find_channel_groups(model, example_inputs, ignore_modules=ignore_modules)
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
        if not isinstance(m, (*CONV_TYPES, nn.Linear, *NORM_TYPES)):
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
        elif isinstance(m, CONV_TYPES):
            m.out_channels, m.in_channels = int(w.shape[0]), int(w.shape[1]) * m.groups
        else:
            m.num_features = int(w.shape[0])
        resized.append(name)
    return resized
