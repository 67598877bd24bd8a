"""What the sharded and pipeline strategies share: optimizer unwrapping, optimizer state placement, precision name,
the batch gathered over a model-parallel group (``batch_split="world"``) and each rank's share of its predictions, and
the check of keyword arguments passed
on to another class."""

from __future__ import annotations

import difflib
import inspect
import math
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_accel._utils.errors import one_line
from lightning_accel.parallel.pipeline import PLAIN_TYPES, batch_tensors, is_per_sample_list, mapping_like
from lightning_accel.parallel.plans import BATCH_SPLITS

__all__ = [
    "BATCH_SPLITS",
    "broadcast_buffers",
    "broadcast_tensors",
    "check_keywords",
    "gather_batch",
    "leading_rows",
    "own_predictions",
    "keyword_defaults",
    "keyword_names",
    "named_optimizer_state",
    "optimizers_to_device",
    "precision_name",
    "raw_optimizer",
]


def gather_batch(batch: Any, group: Any) -> Any:
    """Every tensor of ``batch`` (nested tuples / lists / mappings, each of its type) concatenated along dim 0 over the
    ranks of ``group``, in rank order (rows of unequal counts are padded for the collective and trimmed after), and
    every list of plain values that holds one per sample on every rank
    (:func:`~lightning_accel.parallel.pipeline.is_per_sample_list`: the ids a ``default_collate`` gathers) joined the
    same way; other values are this rank's. Collective: every rank of ``group`` calls it with the same structure."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return batch
    local_rows = leading_rows(batch)
    rank_rows: list[Any] = []  # every rank's rows, read once a list of plain values needs them

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return t
        n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
        counts = [torch.zeros_like(n) for _ in range(size)]
        dist.all_gather(counts, n, group=group)
        rows = [int(c) for c in counts]
        # each row as its bytes: gloo gathers no 16-bit integer, unsigned 32/64-bit or float8 tensor ("Invalid scalar
        # type" for a uint16 token batch), and bytes carry every dtype unchanged
        raw = _as_bytes(t).reshape(t.shape[0], math.prod(t.shape[1:]) * t.element_size())  # the same on every rank
        if t.shape[0] < max(rows):
            raw = torch.cat([raw, raw.new_zeros((max(rows) - t.shape[0], raw.shape[1]))])
        parts = [torch.empty_like(raw) for _ in range(size)]
        dist.all_gather(parts, raw, group=group)
        joined = torch.cat([p[:r] for p, r in zip(parts, rows, strict=True)])
        return _from_bytes(joined, t.dtype).reshape(sum(rows), *t.shape[1:])

    def gather_list(x: list[Any]) -> list[Any]:
        # decided alike on every rank (from every rank's list and rows), so the collectives stay in step
        if not rank_rows:
            rank_rows.extend([None] * size)
            dist.all_gather_object(rank_rows, local_rows, group=group)
        lists: list[Any] = [None] * size
        dist.all_gather_object(lists, x, group=group)
        if all(is_per_sample_list(v, r) for v, r in zip(lists, rank_rows, strict=True)):
            return [v for part in lists for v in part]
        return x

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return gather(x)
        if isinstance(x, list) and all(isinstance(v, PLAIN_TYPES) for v in x):  # ids or texts, one per sample
            return gather_list(x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        if isinstance(x, Mapping):  # a dict, or a tokenizer's `BatchEncoding` (a `UserDict`): every rank's rows
            return mapping_like(x, {k: walk(v) for k, v in x.items()})
        return x

    return walk(batch)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as one flat ``uint8`` tensor (contiguous, row-major): what a collective can carry for any dtype
    (gloo refuses 16-bit integers, unsigned 32/64-bit integers and float8, and reduces no bool)."""
    flat = t.detach().reshape(-1)
    if not flat.numel():  # an empty tensor may keep a stride `view` refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.contiguous().view(torch.uint8)


def _from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat ``dtype`` tensor whose bytes :func:`_as_bytes` gave as ``raw`` (copied: a slice of a packed tensor may
    start at an offset the wider dtype cannot view)."""
    return raw.reshape(-1).clone().view(dtype)


def broadcast_buffers(module: torch.nn.Module, src: int, group: Any = None) -> int:
    """Copy every plain-tensor buffer of ``module`` (BatchNorm's running statistics and step counts, registered
    tables) from global rank ``src`` to the other ranks of ``group`` (None: every rank), as ``DistributedDataParallel``
    does before each training forward (``broadcast_buffers=True``). Buffers are packed into one tensor per dtype, so
    a ResNet's hundred BatchNorm buffers cost a few collectives, not a hundred. DTensor buffers are left alone (their
    mesh places them). Collective: every rank of ``group`` calls it with the same module structure.

    Returns:
        The number of buffers broadcast (0 when the group holds one rank).
    """
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return 0
    buffers = [b for b in module.buffers() if not isinstance(b, DTensor)]
    broadcast_tensors(buffers, src, group)
    return len(buffers)


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group: Any = None) -> None:
    """Overwrite every tensor of ``tensors`` (plain tensors, in the same order and shapes on every rank) in place with
    global rank ``src``'s, packed as bytes into one collective per device (what :func:`broadcast_buffers` sends; bytes
    carry every dtype, where gloo refuses an int16 or uint32 buffer and reduces no bool mask). Collective: every rank
    of ``group`` (None: every rank) calls it."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for b in tensors:
        by_device.setdefault(b.device, []).append(b)
    for bufs in by_device.values():
        flat = torch.cat([_as_bytes(b) for b in bufs])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for b in bufs:
            size = b.numel() * b.element_size()
            with torch.no_grad():
                b.copy_(_from_bytes(flat[offset : offset + size], b.dtype).view_as(b))
            offset += size


class _EvaluationBufferSync(Strategy):
    """Strategy mixin: :meth:`_sync_buffers` (the subclass's copy of one rank's buffers to the others, see
    :func:`broadcast_buffers`) at the start of ``validate`` / ``test`` / ``predict``, so every rank evaluates with the
    statistics the checkpoint holds, not those of its own last batch. Put it before the strategy's Lightning base."""

    @abstractmethod
    def _sync_buffers(self) -> None:
        """Copy the buffers of this rank's model from the rank that holds the checkpoint's to the others."""

    @override
    def on_validation_start(self) -> None:
        self._sync_buffers()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._sync_buffers()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._sync_buffers()
        super().on_predict_start()


def leading_rows(batch: Any) -> int:
    """The rows of ``batch``: dim 0 of its first tensor that has one (0 when none has)."""
    return next((int(t.shape[0]) for t in batch_tensors(batch) if t.ndim), 0)


def own_predictions(predictions: Any, local_rows: int, group: Any) -> Any:
    """This rank's share of ``predictions`` made for a batch :func:`gather_batch` gathered over ``group``: the rows
    this rank read (``local_rows``) of every tensor with the gathered batch's rows and of every list with one entry
    per sample, through mappings and tuples (namedtuples too); anything else (a per-batch value) as it is. Collective:
    every rank of ``group`` calls it (the ranks' row counts are shared)."""
    import torch.distributed as dist

    counts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, local_rows, group=group)
    start, total = sum(counts[: dist.get_rank(group)]), sum(counts)

    def rows(out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out[start : start + local_rows] if out.ndim and out.shape[0] == total else out
        if isinstance(out, Mapping):
            return mapping_like(out, {k: rows(v) for k, v in out.items()})
        if isinstance(out, tuple):
            parts = [rows(v) for v in out]
            return type(out)(*parts) if hasattr(out, "_fields") else tuple(parts)
        if isinstance(out, list):
            return out[start : start + local_rows] if len(out) == total else out
        return out

    return rows(predictions)


def named_optimizer_state(state: Mapping[str, Any], group_names: Sequence[Sequence[str]], who: str) -> dict[str, Any]:
    """``state`` (an ``Optimizer.state_dict()``) with its parameters named: a state that lists them by position (what
    ``DDPStrategy`` and one process save) gets ``group_names[i][j]`` for the ``j``-th parameter of group ``i``, its
    per-parameter state keyed the same way; a state already keyed by name (what the sharded and pipeline strategies
    save) is returned as it is. ``group_names`` lists, per group, the names of the unsplit model's parameters in the
    order a one-process optimizer holds them.

    Raises:
        ValueError: the groups differ in number or size from ``group_names`` (``who`` names the strategy).
    """
    groups = list(state.get("param_groups", []))
    ids = [p for g in groups for p in g["params"]]
    if not ids or not all(isinstance(p, int) and not isinstance(p, bool) for p in ids):
        return dict(state)
    sizes = [len(g["params"]) for g in groups]
    want = [len(n) for n in group_names]
    if sizes != want:
        raise ValueError(
            f"{who} cannot resume the optimizer state of this checkpoint: it lists its parameters by position in "
            f"groups of {sizes} parameters, the optimizer of this model has groups of {want}. Resume with the "
            "`configure_optimizers` that saved it."
        )
    name = {p: n for g, names in zip(groups, group_names, strict=True) for p, n in zip(g["params"], names, strict=True)}
    per_param = state.get("state", {})
    return {
        **state,
        "state": {name[k]: v for k, v in per_param.items() if k in name},
        "param_groups": [dict(g, params=[name[p] for p in g["params"]]) for g in groups],
    }


def optimizers_to_device(optimizers: Sequence[Any], device: torch.device) -> None:
    """Move every plain-tensor optimizer state to ``device`` (DTensor state stays where its mesh put it)."""
    for opt in optimizers:
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.device != device:
                    state[k] = v.to(device)


def precision_name(plugin: Precision) -> str:
    """The precision plugin's mode string (``"32-true"`` for a plugin that has none)."""
    return str(getattr(plugin, "precision", "32-true"))


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def keyword_defaults(*functions: Callable[..., Any]) -> dict[str, Any]:
    """``{name: default}`` of the named parameters of ``functions`` (typically ``__init__`` methods: a class's own
    and those of the bases its ``**kwargs`` go to), in order, each once (the first function's default wins);
    ``self`` and ``*args`` / ``**kwargs`` are left out, a parameter without a default maps to
    ``inspect.Parameter.empty``."""
    out: dict[str, Any] = {}
    for fn in functions:
        for p in inspect.signature(fn).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                out.setdefault(p.name, p.default)
    return out


def keyword_names(*functions: Callable[..., Any]) -> tuple[str, ...]:
    """The names of :func:`keyword_defaults`, in order."""
    return tuple(keyword_defaults(*functions))


def check_keywords(
    name: str,
    given: Mapping[str, Any],
    accepted: Sequence[str],
    *,
    unlisted: Sequence[str] = (),
    unlisted_as: str = "",
    kind: type[Exception] = ValueError,
) -> None:
    """Raise ``kind`` (one line: ``name``, the unknown keys with their values, the accepted names, the closest
    ones) when ``given`` holds a key outside ``accepted`` and ``unlisted``: a misspelled keyword would otherwise be
    passed on to a base class that ignores it, or fail only when a plan is built, after every process has started.

    Args:
        name: who got the keywords, as the message starts (``"PipelineStrategy"``).
        given: the keywords received.
        accepted: the names accepted, listed in the message.
        unlisted: more names accepted, too many to list: the message names them as ``unlisted_as``.
        unlisted_as: those names in words (``"DistributedDataParallel's keywords"``).
        kind: the exception type (``TypeError`` for a function's own ``**kwargs``, as Python raises).

    Raises:
        ValueError: (or ``kind``) an unknown key.
    """
    names = [*accepted, *unlisted]
    unknown = [k for k in given if k not in names]
    if not unknown:
        return
    got = ", ".join(f"`{k}`={one_line(repr(given[k]))[:40]}" for k in unknown)
    hints = [f"`{k}` -> `{close[0]}`" for k in unknown if (close := difflib.get_close_matches(k, names, n=1))]
    guess = f" ({'; '.join(hints)}?)" if hints else ""
    listed = ", ".join(f"`{a}`" for a in accepted) + (f", or {unlisted_as}" if unlisted else "")
    raise kind(f"{name} got unknown keyword argument(s) {got}; expected one of {listed}. Fix the spelling{guess}.")
