"""Optimizer state across QKV packing: one checkpoint layout whether or not the model's q/k/v projections are packed.

QKV packing (:func:`~lightning_accel.precision.modules.pack_qkv`) replaces three parameters by one, so an optimizer
built on a fused model has fewer parameters per group than one built on the same model unfused, and
``Optimizer.load_state_dict`` refuses a state saved by the other ("a parameter group that doesn't match the size of
optimizer's group"). The model's ``state_dict`` already looks unfused (state-dict hooks); these two functions do the
same for the optimizer's:

- :func:`unpack_qkv_optimizer_state` turns the state of an optimizer holding packed parameters into the state the
  same optimizer would have on the unfused model (per-parameter tensors such as Adam's ``exp_avg`` split in three
  along dim 0, scalars such as ``step`` copied), so a run without packing resumes from it;
- :func:`pack_qkv_optimizer_state` is the inverse, for a state saved unfused and loaded into a fused optimizer.

:func:`unpack_qkv_dcp_optimizer_state` and :func:`pack_qkv_dcp_optimizer_state` do the same for the state dicts of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` / ``set_optimizer_state_dict``, which are keyed by
parameter name (``...attn.qkv_proj.weight`` for a packed parameter) instead of by position.

Which saved entries are the q, k and v parts of a packed parameter follows the parameter order: in a group, the
packed parameter stands where ``q_proj``'s was, and a run of consecutive packed parameters (a module's packed weight
and bias) is expanded in the unfused model's ``named_parameters()`` order (``q_proj.weight, q_proj.bias,
k_proj.weight, ...``). That is the order an optimizer built from ``model.parameters()`` or a filter of
``model.named_parameters()`` (weight-decay groups) has, in either model. Plain torch: no Lightning import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_accel._utils import compat
from lightning_accel.precision import modules as fm

__all__ = [
    "pack_qkv_dcp_optimizer_state",
    "pack_qkv_optimizer_state",
    "packed_qkv_parameters",
    "unpack_qkv_dcp_optimizer_state",
    "unpack_qkv_optimizer_state",
]

# (parameter, part): part -1 for a parameter that is not packed, 0/1/2 for the q/k/v rows of a packed one
_Key = tuple[torch.Tensor, int]


def packed_qkv_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """``{id(parameter): parameter}`` of the packed ``qkv_proj`` weights and biases in ``model``."""
    out: dict[int, nn.Parameter] = {}
    for m in model.modules():
        qkv = compat.child_modules(m).get("qkv_proj")
        if fm.is_fused(m, fm.FusedAttentionMixin) and qkv is not None:
            out.update({id(p): p for p in qkv.parameters(recurse=False)})
    return out


def _unfused_rank(model: nn.Module, packed: Mapping[int, nn.Parameter]) -> dict[tuple[int, int], int]:
    """``{(id(parameter), part): position}`` in the unfused model's ``named_parameters()`` order: a packed module's
    ``weight, bias`` become ``q.weight, q.bias, k.weight, k.bias, v.weight, v.bias``."""
    rank: dict[tuple[int, int], int] = {}
    for m in model.modules():
        qkv = compat.child_modules(m).get("qkv_proj")
        own = list(qkv.parameters(recurse=False)) if qkv is not None else []
        if not own or id(own[0]) not in packed:
            continue
        for part in range(len(fm.QKV_PARTS)):
            for p in own:
                rank.setdefault((id(p), part), len(rank))
    # the packed parameters are ordered among themselves; the others keep their group position (see `_expand`)
    return rank


def _expand(params: Sequence[torch.Tensor], packed: Mapping[int, nn.Parameter], rank: Mapping[Any, int]) -> list[_Key]:
    """A fused group's parameters as the unfused group lists them (module docstring)."""
    out: list[_Key] = []
    run: list[torch.Tensor] = []

    def flush() -> None:
        keys = [(p, part) for p in run for part in range(len(fm.QKV_PARTS))]
        out.extend(sorted(keys, key=lambda k: rank.get((id(k[0]), k[1]), len(rank))))
        run.clear()

    for p in params:
        if id(p) in packed:
            run.append(p)
        else:
            flush()
            out.append((p, -1))
    flush()
    return out


def _plain(value: Any) -> bool:
    """A value whose split or concatenation along dim 0 is what the unfused optimizer holds: a plain tensor (not a
    sharded ``DTensor``) or a non-tensor."""
    return not isinstance(value, torch.Tensor) or type(value) is torch.Tensor


def _part_name(name: str, part: int) -> str:
    head, sep, tail = name.rpartition("qkv_proj")
    return f"{head}{fm.QKV_PARTS[part]}{tail}" if sep else f"{name}.{fm.QKV_PARTS[part]}"


def unpack_qkv_optimizer_state(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """``optimizer.state_dict()`` (``state_dict``) laid out as if ``model``'s packed q/k/v projections were apart.

    Args:
        state_dict: the optimizer's own state dict (same groups, same order), e.g. in a checkpoint being saved.
        optimizer: the optimizer that produced it (its groups tell which saved entries are packed parameters).
        model: the fused model holding those parameters.

    Returns:
        a new state dict (tensors of packed parameters split into copies), or ``state_dict`` itself when there is
        nothing to unpack or its layout is not one this function can convert (a sharded state, a per-parameter tensor
        of another shape): then it stays in the packed layout, which a run with the same fusions loads.
    """
    packed = packed_qkv_parameters(model)
    groups, saved = optimizer.param_groups, state_dict.get("param_groups")
    if not packed or not isinstance(saved, list) or len(saved) != len(groups):
        return state_dict
    if not any(id(p) in packed for g in groups for p in g["params"]):
        return state_dict
    if any(len(s.get("params", ())) != len(g["params"]) for s, g in zip(saved, groups, strict=True)):
        return state_dict
    rank = _unfused_rank(model, packed)
    old_state: dict[Any, Any] = state_dict.get("state", {})
    new_state: dict[int, Any] = {}
    new_groups: list[dict[str, Any]] = []
    numbered = 0
    for s, g in zip(saved, groups, strict=True):
        index = {id(p): i for p, i in zip(g["params"], s["params"], strict=True)}
        names = dict(zip((id(p) for p in g["params"]), s.get("param_names", ()), strict=False))
        params: list[int] = []
        param_names: list[str] = []
        for p, part in _expand(g["params"], packed, rank):
            new, numbered = numbered, numbered + 1  # parameters numbered across the groups, in order
            entry = old_state.get(index[id(p)])
            if entry is not None:
                if part < 0:
                    new_state[new] = entry
                else:
                    split = _split(entry, p, part)
                    if split is None:
                        return state_dict
                    new_state[new] = split
            params.append(new)
            if id(p) in names:
                param_names.append(names[id(p)] if part < 0 else _part_name(names[id(p)], part))
        group = {k: v for k, v in s.items() if k not in ("params", "param_names")}
        group["params"] = params
        if "param_names" in s:
            group["param_names"] = param_names
        new_groups.append(group)
    return {**state_dict, "state": new_state, "param_groups": new_groups}


def _split(entry: Mapping[str, Any], p: torch.Tensor, part: int) -> dict[str, Any] | None:
    """The ``part`` rows of a packed parameter's state (None when a tensor of it cannot be split by rows)."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if not _plain(value):
            return None
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != p.shape:
                return None
            # clone: a view would keep (and a save would write) the whole packed tensor for each part
            out[key] = value.chunk(len(fm.QKV_PARTS), dim=0)[part].clone()
        else:  # `step` and other scalars: the three parts were stepped together; each gets its own (stepped in place)
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def pack_qkv_optimizer_state(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """A state dict saved by ``optimizer``'s counterpart on the unfused model, laid out for ``optimizer``, which holds
    ``model``'s packed q/k/v parameters (the inverse of :func:`unpack_qkv_optimizer_state`).

    A group saved with as many parameters as ``optimizer``'s (a state saved packed, or a group without packed
    parameters) is kept as it is. The q/k/v parts' tensors are concatenated along dim 0; a packed parameter whose
    parts have no state, or not all the same keys, starts without state (as a new parameter does).

    Returns:
        a new state dict, or ``state_dict`` itself when there is nothing to pack.

    Raises:
        ValueError: when a group matches neither layout, or a part's state cannot be concatenated (one line, with the
            counts and the fix: resume with the fusions the checkpoint was saved with).
    """
    packed = packed_qkv_parameters(model)
    groups, saved = optimizer.param_groups, state_dict.get("param_groups")
    if not packed or not isinstance(saved, list) or len(saved) != len(groups):
        return state_dict  # no packing here, or a layout Optimizer.load_state_dict reports itself
    if all(len(s.get("params", ())) == len(g["params"]) for s, g in zip(saved, groups, strict=True)):
        return state_dict
    rank = _unfused_rank(model, packed)
    old_state: dict[Any, Any] = state_dict.get("state", {})
    new_state: dict[int, Any] = {}
    new_groups: list[dict[str, Any]] = []
    numbered = 0
    for j, (s, g) in enumerate(zip(saved, groups, strict=True)):
        keys = _expand(g["params"], packed, rank)
        n_saved = len(s.get("params", ()))
        group = {k: v for k, v in s.items() if k not in ("params", "param_names")}
        if "param_names" in g:  # torch keeps saved names over the optimizer's own: give it the packed ones
            group["param_names"] = list(g["param_names"])
        params: list[int] = []
        if n_saved == len(g["params"]):
            for i in s["params"]:
                new, numbered = numbered, numbered + 1  # parameters numbered across the groups, in order
                if i in old_state:
                    new_state[new] = old_state[i]
                params.append(new)
        elif n_saved == len(keys):
            index = {(id(p), part): i for (p, part), i in zip(keys, s["params"], strict=True)}
            for p in g["params"]:
                new, numbered = numbered, numbered + 1  # parameters numbered across the groups, in order
                if id(p) in packed:
                    merged = _concat([old_state.get(index[(id(p), k)]) for k in range(len(fm.QKV_PARTS))], p, j)
                    if merged is not None:
                        new_state[new] = merged
                elif index[(id(p), -1)] in old_state:
                    new_state[new] = old_state[index[(id(p), -1)]]
                params.append(new)
        else:
            raise ValueError(
                f"The optimizer state being loaded does not fit this model's packed QKV parameters (parameter group "
                f"{j}: {n_saved} parameters saved, {len(g['params'])} here, {len(keys)} with q_proj/k_proj/v_proj "
                "apart): resume with the `FusedPrecision(fusions=...)` the checkpoint was saved with, or leave 'qkv' "
                "out of `fusions`."
            )
        group["params"] = params
        new_groups.append(group)
    return {**state_dict, "state": new_state, "param_groups": new_groups}


def _concat(entries: Sequence[Any], p: torch.Tensor, group: int) -> dict[str, Any] | None:
    """The packed parameter ``p``'s state from its q/k/v parts' (None: start without state)."""
    if any(not e for e in entries) or any(e.keys() != entries[0].keys() for e in entries):
        return None
    part_shape = (p.shape[0] // len(fm.QKV_PARTS), *p.shape[1:])
    out: dict[str, Any] = {}
    for key, value in entries[0].items():
        values = [e[key] for e in entries]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if any(not _plain(v) or tuple(v.shape) != part_shape for v in values):
                raise ValueError(
                    f"The optimizer state being loaded has `{key}` of shape {tuple(value.shape)} for a q/k/v part of "
                    f"shape {part_shape} (parameter group {group}), which cannot be packed: resume with the "
                    "`FusedPrecision(fusions=...)` the checkpoint was saved with, or leave 'qkv' out of `fusions`."
                )
            out[key] = torch.cat(values, dim=0)
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


# the modules that wrap a model without a name of their own in `torch.distributed.checkpoint`'s parameter names
_DCP_WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _dcp_packed_names(model: nn.Module) -> dict[str, tuple[nn.Parameter, list[str]]]:
    """``{packed name: (parameter, [q name, k name, v name])}`` for ``model``'s packed q/k/v parameters, named as
    ``torch.distributed.checkpoint.state_dict`` names them (a ``DistributedDataParallel`` wrapper's ``module.``, a
    compiled module's ``_orig_mod.`` and activation-checkpoint wrappers left out)."""
    from torch.nn.parallel import DistributedDataParallel

    root = model.module if isinstance(model, DistributedDataParallel) else model
    out: dict[str, tuple[nn.Parameter, list[str]]] = {}
    for name, m in root.named_modules():
        qkv = compat.child_modules(m).get("qkv_proj")
        if qkv is None or not fm.is_fused(m, fm.FusedAttentionMixin):
            continue
        prefix = "".join(f"{part}." for part in name.split(".") if part and part not in _DCP_WRAPPER_NAMES)
        for attr, p in qkv.named_parameters(recurse=False):
            out[f"{prefix}qkv_proj.{attr}"] = (p, [f"{prefix}{part}.{attr}" for part in fm.QKV_PARTS])
    return out


def _replace_in_groups(groups: Any, replace: Mapping[str, list[str]]) -> Any:
    """The ``param_groups`` of a name-keyed optimizer state dict with each name in ``replace`` put where the first of
    the names it replaces stood (the others dropped)."""
    if not isinstance(groups, list):
        return groups
    out = []
    for g in groups:
        names = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(names, list):
            out.append(g)
            continue
        new: list[Any] = []
        for n in names:
            for m in replace.get(n, [n]) if isinstance(n, str) else [n]:
                if m not in new:
                    new.append(m)
        out.append({**g, "params": new})
    return out


def unpack_qkv_dcp_optimizer_state(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """A name-keyed optimizer state dict of ``model`` (``get_optimizer_state_dict(model, optimizer)``) with each
    packed ``qkv_proj`` parameter's state split into its ``q_proj``/``k_proj``/``v_proj`` parts' (tensors split in
    three along dim 0, scalars such as ``step`` copied), as the unfused model's optimizer has it: save that, and
    ``set_optimizer_state_dict`` loads it into the unfused model.

    Args:
        state_dict: ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``'s output on ``model``
            (full, not sharded: packing is not done under FSDP).
        model: the fused model (or its ``DistributedDataParallel`` wrapper) whose parameters it names.

    Returns:
        a new state dict, or ``state_dict`` itself when it names no packed parameter of ``model``.

    Raises:
        ValueError: for a per-parameter tensor whose shape is not its packed parameter's (it cannot be split by rows).
    """
    packed = {k: v for k, v in _dcp_packed_names(model).items() if k in state_dict.get("state", {})}
    if not packed:
        return state_dict
    state: dict[str, Any] = {}
    for name, entry in state_dict["state"].items():
        if name not in packed:
            state[name] = entry
            continue
        p, parts = packed[name]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and (not _plain(value) or value.shape != p.shape):
                raise ValueError(
                    f"The optimizer state has `{key}` of shape {tuple(value.shape)} for {name} of shape "
                    f"{tuple(p.shape)}, which cannot be split into q/k/v rows: pass the full (not sharded) "
                    "`get_optimizer_state_dict` of this model."
                )
        for i, part in enumerate(parts):
            state[part] = {
                # clone: a view would keep (and a save would write) the whole packed tensor for each part
                key: value.chunk(len(parts), dim=0)[i].clone()
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value.clone()
                if isinstance(value, torch.Tensor)
                else value
                for key, value in entry.items()
            }
    groups = _replace_in_groups(state_dict.get("param_groups"), {k: parts for k, (_, parts) in packed.items()})
    return {**state_dict, "state": state, "param_groups": groups}


def pack_qkv_dcp_optimizer_state(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """A name-keyed optimizer state dict saved on the unfused model (``get_optimizer_state_dict``) laid out for
    ``model``, whose q/k/v projections are packed: the inverse of :func:`unpack_qkv_dcp_optimizer_state`, for
    ``set_optimizer_state_dict(model, optimizer, ...)``. A packed parameter whose parts have no state, or not all the
    same keys, gets none (as a new parameter has).

    Returns:
        a new state dict, or ``state_dict`` itself when it names no q/k/v part of a packed parameter of ``model``.

    Raises:
        ValueError: for a part's per-parameter tensor whose shape is not a third of the packed parameter's rows.
    """
    saved = state_dict.get("state", {})
    packed = {k: v for k, v in _dcp_packed_names(model).items() if any(part in saved for part in v[1])}
    if not packed:
        return state_dict
    merged: dict[str, Any] = {}
    for name, (p, parts) in packed.items():
        entries = [saved.get(part) for part in parts]
        if not all(entries) or any(e.keys() != entries[0].keys() for e in entries):
            continue
        part_shape = (p.shape[0] // len(parts), *p.shape[1:])
        for part, entry in zip(parts, entries, strict=True):
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != part_shape:
                    raise ValueError(
                        f"The optimizer state has `{key}` of shape {tuple(value.shape)} for {part}, a q/k/v part of "
                        f"{name} of shape {part_shape} each, which cannot be packed: pass the full (not sharded) "
                        "`get_optimizer_state_dict` of a model with the same projection sizes."
                    )
        merged[name] = _concat(entries, p, 0)
    state: dict[str, Any] = {}
    owner = {part: name for name, (_, parts) in packed.items() for part in parts}
    for key, entry in saved.items():
        if key not in owner:
            state[key] = entry
        elif owner[key] in merged and owner[key] not in state:
            state[owner[key]] = merged[owner[key]]
    replace = {part: [name] for name, (_, parts) in packed.items() for part in parts}
    return {**state_dict, "state": state, "param_groups": _replace_in_groups(state_dict.get("param_groups"), replace)}
