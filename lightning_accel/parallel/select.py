"""Choose the parallelism: ``select_strategy`` returns a Lightning strategy name and an explanation a person can read.

Policy ``"memory"`` (default) estimates bytes per device for DDP, FSDP (ZeRO-3) and pipeline parallelism with the
formulas of :mod:`lightning_accel.parallel.estimate` and picks the cheapest that fits under
``device_memory_bytes · (1 - headroom)``, in the order data parallel < sharded < pipeline (each step adds
communication or idle time). Among data-parallel runs across nodes it recommends ``"ddp_1bit"`` (1-bit compressed
gradients) when the inter-node bandwidth is below the break-even at which an fp32 ring allreduce stops hiding behind
the backward pass.

Policy ``"rules"`` is the common rule of thumb: more than 1 B parameters -> model parallel (FSDP), more than 50
layers -> pipeline, else data parallel. Its limits: it ignores the batch, the activations and the device (a 1.2 B
model needs ~19 GB of Adam state and trains with plain DDP on an 80 GB GPU; a 300 M model with long sequences may
not fit at all), and "layers" says nothing about memory.

Every plan runs in a Trainer: ``"fsdp"`` and ``"tp"`` through ``ShardedStrategy`` (FSDP2 / DTensor on Lightning's
``ModelParallelStrategy``), ``"pipeline"`` through ``PipelineStrategy`` (``torch.distributed.pipelining``). Tensor
parallelism is the plan for one layer too large to gather: FSDP must materialise its largest unit in full, tensor
parallel splits it.

Policy ``"measure"`` keeps the candidates the memory estimate says fit and lets a short timed trial decide
(:func:`choose_by_trial`, run by ``AutoStrategy`` on every rank once the processes are connected); the trial's
times are cached per model / world / device so repeated runs do not measure again. A plan that cannot run the model
at all (a pipeline on a network it cannot split, tensor parallel with nothing to split) carries the reason as its
estimate's ``blocker`` and never fits; a candidate whose trial fails at any point is dropped with its error
(:attr:`StrategyChoice.dropped`, shown by :meth:`StrategyChoice.table`), never the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accel._utils.atomic import atomic_write_text
from lightning_accel._utils.checks import check_callable, check_choice, check_int, check_number
from lightning_accel._utils.errors import one_line
from lightning_accel.parallel.estimate import (
    ADAM_MIXED_BYTES_PER_PARAM,
    MemoryEstimate,
    block_stack,
    buffer_bytes,
    count_layers,
    default_microbatches,
    estimate_activation_bytes,
    estimate_ddp,
    estimate_fsdp,
    estimate_pipeline,
    estimate_tensor_parallel,
    largest_unit_params,
    measure_activation_bytes,
    pipeline_stage_buffer_bytes,
    pipeline_stage_parameters,
    resolve_stages_per_rank,
    trainable_and_frozen,
    transformer_shape,
)
from lightning_accel.parallel.pipeline import (
    balance_stages,
    batch_tensors,
    check_microbatches,
    check_no_sync_batchnorm,
    check_stages_train,
    find_pipeline_modules,
    piece_costs,
    trainable_pieces,
)
from lightning_accel.parallel.plans import BATCH_SPLITS, tensor_parallel_plan

__all__ = [
    "DEFAULT_ONEBIT_BREAK_EVEN_GBPS",
    "POLICIES",
    "StrategyChoice",
    "TrialCache",
    "TrialFailed",
    "choose_by_trial",
    "onebit_break_even_gbps",
    "select_strategy",
    "trial_key",
]

POLICIES = ("memory", "rules", "measure")

#: plan -> the strategy name a Trainer runs it with
PLAN_STRATEGY = {
    "single": "auto",
    "ddp": "ddp",
    "ddp_1bit": "ddp_1bit",
    "fsdp": "fsdp",
    "tp": "tp",
    "pipeline": "pipeline",
}

#: Used when no example batch was measured: below ~25 Gbit/s (10/25 GbE) an fp32 allreduce of a mid-size model
#: is longer than its backward pass on a modern GPU; InfiniBand (100-400 Gbit/s) hides it. Pass ``example_batch``
#: for a break-even measured on your model instead.
DEFAULT_ONEBIT_BREAK_EVEN_GBPS = 25.0

_RULE_PARAMS = 1_000_000_000
_RULE_LAYERS = 50


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def onebit_break_even_gbps(params: int, world: int, backward_s: float, *, grad_bytes: int = 4) -> float:
    """Bandwidth (Gbit/s) below which a ring allreduce of the gradients takes longer than the backward pass.

    A ring allreduce moves ``2·(N-1)/N · grad_bytes · P`` bytes per device; DDP overlaps it with backward, so it is
    hidden while it takes less than ``backward_s``. Below this bandwidth the rest is exposed, and 1-bit compression
    (32x fewer bytes) pays for its pack/unpack.
    """
    if world < 2 or backward_s <= 0:
        return 0.0
    wire_bytes = 2 * (world - 1) / world * grad_bytes * params
    return wire_bytes * 8 / backward_s / 1e9


@dataclass
class StrategyChoice:
    """The result of :func:`select_strategy`; unpacks as ``strategy, explanation = select_strategy(...)``.

    Attributes:
        strategy: the strategy's name: ``"auto"``, ``"ddp"``, ``"ddp_1bit"``, ``"fsdp"`` / ``"tp"`` (both
            ``ShardedStrategy``) or ``"pipeline"`` (``PipelineStrategy``, registered under that name).
        plan: the parallelism chosen: ``"single"``, ``"ddp"``, ``"ddp_1bit"``, ``"fsdp"``, ``"tp"`` or
            ``"pipeline"``.
        fits: whether ``strategy`` is expected to fit in memory (always True for ``"rules"``, which does not check).
        explanation: plain words: the numbers, the decision and what to do if it does not fit.
        policy: ``"memory"``, ``"rules"`` or ``"measure"``.
        estimates: plan -> :class:`~lightning_accel.parallel.estimate.MemoryEstimate` (not for ``"rules"``).
        facts: parameters, layers, activation bytes, world size, capacity, break-even bandwidth.
        measured: plan -> measured seconds per step (``"measure"``, after the trial).
        dropped: plan -> why its trial was dropped (the error, one line; ``"measure"``).
    """

    strategy: str
    plan: str
    fits: bool
    explanation: str
    policy: str
    estimates: dict[str, MemoryEstimate] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """A markdown table: every plan's estimate per device, whether it fits (``no`` with the reason when it cannot
        run the model), its measured step time, the pick, and why a trial was dropped."""
        cap = self.facts.get("capacity")
        rows = ["| plan | estimate per device | fits | measured step | chosen | note |", "|---|---|---|---|---|---|"]
        for plan in dict.fromkeys([*self.estimates, *self.measured, *self.dropped]):
            est = self.estimates.get(plan)
            fits = "" if est is None or cap is None else ("yes" if _fits(est, cap) else "no")
            note = est.blocker if est is not None and est.blocker else ""
            if plan in self.dropped:
                note = f"trial dropped: {self.dropped[plan]}"
            t = self.measured.get(plan)
            rows.append(
                f"| {plan} | {_gb(est.total) if est else '-'} | {fits} | {f'{t * 1e3:.1f} ms' if t else '-'} | "
                f"{'**yes**' if plan == self.plan else ''} | {note.replace('|', '/')} |"
            )
        return "\n".join(rows)

    def __iter__(self) -> Iterator[str]:
        yield self.strategy
        yield self.explanation

    def __str__(self) -> str:
        return self.explanation


def _fits(est: MemoryEstimate, capacity: int) -> bool:
    """A plan fits when it can run the model at all and its estimate is within ``capacity``."""
    return not est.blocker and est.total <= capacity


def _device_memory(device_memory_bytes: int | None) -> int:
    if device_memory_bytes is not None:
        return int(check_number("device_memory_bytes", device_memory_bytes, low=0, low_open=True))
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    raise ValueError(
        "`device_memory_bytes` is None and no CUDA device is visible, so the memory per device is unknown. "
        "Pass it, e.g. `device_memory_bytes=80 * 2**30` for an 80 GiB GPU."
    )


def select_strategy(
    model: nn.Module,
    *,
    devices: int,
    num_nodes: int = 1,
    device_memory_bytes: int | None = None,
    example_batch: Any = None,
    inter_node_gbps: float | None = None,
    policy: str = "memory",
    headroom: float = 0.2,
    bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM,
    microbatches: int | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    onebit_break_even: float | None = None,
    activation_scale: float = 1.0,
    batch_split: str = "data_parallel",
    pipeline_size: int | None = None,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
) -> StrategyChoice:
    """Choose data, sharded or pipeline parallelism for ``model`` on ``devices × num_nodes`` devices.

    Args:
        model: the network (an ``nn.Module`` or LightningModule, on the device you will train on for timing).
        devices: devices per node (``>= 1``).
        num_nodes: nodes.
        device_memory_bytes: memory of one device (None: the current CUDA device's total memory).
        example_batch: one per-device batch of forward inputs; when given, activations and the backward time are
            measured with one forward/backward (otherwise activations count as 0 and the explanation says so). With
            the model or the batch on the meta device nothing can run: activations are *estimated* from the
            model's hidden size, heads and layers and the batch's shape (see
            :mod:`~lightning_accel.parallel.estimate`), and the explanation says "estimated".
        inter_node_gbps: network bandwidth between nodes in Gbit/s (None: unknown, no ``ddp_1bit`` advice).
        policy: ``"memory"`` (estimate and fit) or ``"rules"`` (the rule-of-thumb thresholds; the estimate's
            arguments, from ``device_memory_bytes`` on, are then unused, and a warning names those given).
        headroom: fraction of device memory kept free for the CUDA context, allocator caching and workspaces.
        bytes_per_param: model-state bytes per parameter (16: Adam, mixed precision or fp32).
        microbatches: pipeline micro-batches (None: ``2 × stages``,
            :func:`~lightning_accel.parallel.estimate.default_microbatches`, what ``PipelineStrategy`` runs).
        loss_fn: ``output -> scalar`` for the measurement (default: sum of the output).
        onebit_break_even: override the break-even bandwidth in Gbit/s (None: measured from ``example_batch``'s
            backward time, else :data:`DEFAULT_ONEBIT_BREAK_EVEN_GBPS`).
        activation_scale: multiply measured activations (and backward time) by this, e.g. ``per-device batch /
            example batch`` when the example batch is smaller than the real one (activations grow linearly with it).
        batch_split: the batch a chosen model-parallel plan runs, as ``PipelineStrategy`` / ``ShardedStrategy``
            ``(batch_split=...)`` read it: ``"data_parallel"`` (their default: the per-device batch) or ``"world"``
            (the batches of a pipeline's or tensor-parallel group's devices gathered into one: ``world ×`` the
            per-device batch for a pipeline over every device, ``devices ×`` for a tensor-parallel group, which spans
            one node; what ``AutoStrategy`` runs). The pipeline's and tensor parallelism's activations are estimated
            for that batch.
        pipeline_size: ranks per pipeline, as ``PipelineStrategy(pipeline_size=...)`` (None: every device; a
            divisor of the world size, the rest pipeline replicas): the pipeline's stages, micro-batches and batch
            are estimated for it.
        schedule: the pipeline schedule (``"1f1b"``, ``"gpipe"``, ``"interleaved1f1b"``): GPipe keeps every
            micro-batch's activations until its backward, 1F1B at most one per pipeline rank.
        stages_per_rank: pipeline stages per rank (None: 2 for the interleaved schedule, else 1).

    Returns:
        A :class:`StrategyChoice`; ``strategy, why = select_strategy(...)`` also works.

    Raises:
        ValueError: for a bad argument (named, with the value and the fix; ``TypeError`` for a wrong type).
    """
    _check_arguments(
        policy=policy,
        devices=devices,
        num_nodes=num_nodes,
        headroom=headroom,
        activation_scale=activation_scale,
        inter_node_gbps=inter_node_gbps,
        device_memory_bytes=device_memory_bytes,
        bytes_per_param=bytes_per_param,
        microbatches=microbatches,
        onebit_break_even=onebit_break_even,
        batch_split=batch_split,
        pipeline_size=pipeline_size,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        world=devices * num_nodes,
    )
    # a bad one would fail inside the measurement, which falls back to a lower bound with a warning
    check_callable("loss_fn", loss_fn, "a function `output -> scalar loss`")
    if not isinstance(model, nn.Module):
        # every estimate reads its parameters: anything else failed with "'str' object has no attribute 'parameters'"
        raise TypeError(
            f"`model` must be an `nn.Module` (or a LightningModule), got {one_line(repr(model))[:60]} "
            f"({type(model).__name__}). Pass the network to train."
        )
    _check_example_batch("example_batch", example_batch)
    if policy == "rules":
        unused = _non_default(
            device_memory_bytes=(device_memory_bytes, None),
            example_batch=(example_batch, None),
            inter_node_gbps=(inter_node_gbps, None),
            headroom=(headroom, 0.2),
            bytes_per_param=(bytes_per_param, ADAM_MIXED_BYTES_PER_PARAM),
            microbatches=(microbatches, None),
            loss_fn=(loss_fn, None),
            onebit_break_even=(onebit_break_even, None),
            activation_scale=(activation_scale, 1.0),
            batch_split=(batch_split, "data_parallel"),
            pipeline_size=(pipeline_size, None),
            schedule=(schedule, "1f1b"),
            stages_per_rank=(stages_per_rank, None),
        )
        if unused:
            warnings.warn(_rules_unused_message(unused), UserWarning, stacklevel=2)
    if policy == "measure":  # the estimates decide what is a candidate; `choose_by_trial` then measures them
        policy = "memory"
    world = devices * num_nodes
    params = sum(p.numel() for p in model.parameters())
    layers = count_layers(model)
    facts: dict[str, Any] = {"params": params, "layers": layers, "world": world}
    if policy == "rules":
        return _by_rules(params, layers, world, facts)

    capacity_total = _device_memory(device_memory_bytes)
    capacity = int(capacity_total * (1.0 - headroom))
    facts["capacity"] = capacity
    act = _activations(model, example_batch, loss_fn, activation_scale)
    facts["activations"] = act.bytes
    facts["activations_source"] = "measured" if act.measured else ("estimated" if act.bytes else "none")
    if act.measured:
        facts["backward_s"] = act.backward_s
    # a frozen parameter (`requires_grad=False`) keeps its weight only: no gradient, no optimizer state
    trainable, frozen_bytes = trainable_and_frozen(model.parameters())
    facts["trainable_params"], facts["frozen_bytes"] = trainable, frozen_bytes
    # buffers (BatchNorm's running statistics, registered tables) sit whole on every device that runs their module
    facts["buffer_bytes"] = buffer_bytes([model])
    # the pipeline runs its own batch (the gathered one with `batch_split="world"`) cut into its micro-batches
    pp = pipeline_size or world
    facts["pipeline_size"], facts["pipeline_schedule"] = pp, schedule
    facts["stages_per_rank"] = resolve_stages_per_rank(schedule, stages_per_rank)
    facts["pipeline_microbatches"] = microbatches or default_microbatches(pp)
    facts["pipeline_activations"] = act.bytes * (pp if batch_split == "world" else 1)
    # tensor parallelism splits over the devices of one node (a group across nodes would put its per-layer
    # collectives on the slow link), and with `batch_split="world"` each group runs its ranks' batches gathered
    facts["tp_size"] = devices
    facts["tp_activations"] = act.bytes * (devices if batch_split == "world" else 1)
    ests = _estimates(model, act.bytes, world, bytes_per_param, facts)
    table = "; ".join(f"{k} {_gb(e.total)} ({e.formula})" for k, e in ests.items())
    head = (
        f"{params / 1e6:.1f} M parameters, {world} device(s) with {_gb(capacity_total)} each "
        f"({_gb(capacity)} usable at {headroom:.0%} headroom); {act.note}. Per device: {table}."
    )
    be, be_src = _break_even(onebit_break_even, act, trainable, world)  # only trainable parameters have gradients
    facts["onebit_break_even_gbps"] = be
    case = _Case(num_nodes, world, capacity, act.bytes, ests, head, be, be_src, inter_node_gbps, policy, facts)
    if case.fits("ddp"):
        return _data_parallel(case)
    return _beyond_data_parallel(case)


def _check_arguments(
    *,
    policy: str = "memory",
    devices: int = 1,
    num_nodes: int = 1,
    headroom: float = 0.2,
    activation_scale: float = 1.0,
    inter_node_gbps: float | None = None,
    device_memory_bytes: int | None = None,
    bytes_per_param: float = ADAM_MIXED_BYTES_PER_PARAM,
    microbatches: int | None = None,
    onebit_break_even: float | None = None,
    batch_split: str = "data_parallel",
    pipeline_size: int | None = None,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    world: int | None = None,
) -> None:
    """Raise ``ValueError`` (``TypeError`` for a wrong type) for a bad :func:`select_strategy` argument (named, with
    the value and the fix). ``AutoStrategy.__init__`` calls it too, so a bad value fails where it is written, on
    every rank, not later on the rank that chooses. ``world``: the device count, where known (``pipeline_size``
    must divide it)."""
    check_choice("policy", policy, POLICIES)
    check_int("devices", devices, low=1, fix="It counts the devices per node.")
    check_int("num_nodes", num_nodes, low=1)
    check_number("headroom", headroom, low=0.0, high=1.0, high_open=True, fix="E.g. 0.2 keeps 20 % free.")
    check_number("activation_scale", activation_scale, low=0, low_open=True)
    check_number("inter_node_gbps", inter_node_gbps, low=0, low_open=True, allow_none=True, fix="It is in Gbit/s.")
    check_int("device_memory_bytes", device_memory_bytes, low=1, allow_none=True, fix="It is one device's bytes.")
    check_number("bytes_per_param", bytes_per_param, low=0, low_open=True, fix="E.g. 16 for Adam.")
    check_int("microbatches", microbatches, low=1, allow_none=True)
    check_number("onebit_break_even", onebit_break_even, low=0, low_open=True, allow_none=True, fix="In Gbit/s.")
    check_choice("batch_split", batch_split, BATCH_SPLITS)
    check_int("pipeline_size", pipeline_size, low=1, allow_none=True)
    resolve_stages_per_rank(schedule, stages_per_rank)
    if world is not None and pipeline_size is not None and world % pipeline_size:
        raise ValueError(
            f"`pipeline_size`={pipeline_size} does not divide the {world} device(s): every pipeline replica needs all "
            f"its stages. Use a divisor of {world}."
        )
    if pipeline_size is not None and microbatches is not None:
        # what `PipelineStrategy` refuses when it is built: `AutoStrategy` builds it at setup, after every process
        # has started, and the estimate would describe a pipeline that cannot run
        check_microbatches(microbatches, pipeline_size, schedule)


def _check_example_batch(name: str, example_batch: Any, *, fix: str = "") -> None:
    """Raise ``TypeError`` naming ``name`` when ``example_batch`` is set but holds no tensor (a string, a number, a
    list of numbers): its forward could only fail, and the estimate would fall back to model state alone, a lower
    bound the run may not fit in, for what is a mistake in the argument, not in the model."""
    if example_batch is None or batch_tensors(example_batch):
        return
    raise TypeError(
        f"`{name}` must be one per-device batch of forward inputs holding a tensor (a tensor, a tuple/list of "
        f"positional arguments or a dict of keyword arguments), got {one_line(repr(example_batch))[:60]} "
        f"({type(example_batch).__name__}). {fix or 'Pass e.g. `example_batch=torch.randn(batch, features)`, or None.'}"
    )


def _non_default(**given: tuple[Any, Any]) -> list[str]:
    """The names among ``given`` (``name=(value, default)``) set to other than their default (e.g. the arguments of
    the memory estimate, which policy ``"rules"`` does not read)."""
    return [
        name
        for name, (value, default) in given.items()
        if value is not default and (default is None or value != default)
    ]


def _rules_unused_message(names: list[str]) -> str:
    """One line saying that ``names`` are not used by policy ``"rules"``, and the fix."""
    listed = ", ".join(f"`{n}`" for n in names)
    one = len(names) == 1
    return (
        f"{listed} {'is' if one else 'are'} used only by policy='memory' and 'measure'; policy='rules' decides by "
        f"the parameter and layer counts alone, so {'it is' if one else 'they are'} ignored. Drop "
        f"{'it' if one else 'them'} or pass policy='memory'."
    )


def _by_rules(params: int, layers: int, world: int, facts: dict[str, Any]) -> StrategyChoice:
    """Policy ``"rules"``: the parameter and layer thresholds, nothing measured."""
    if world > 1 and params > _RULE_PARAMS:
        plan, why = "fsdp", f"{params / 1e9:.2f} B parameters > 1 B: model parallel (FSDP shards the model)."
    elif world > 1 and layers > _RULE_LAYERS:
        plan, why = "pipeline", f"{layers} layers > 50: pipeline parallel."
    else:
        plan = "ddp" if world > 1 else "single"
        why = f"{params / 1e6:.1f} M parameters and {layers} layers: data parallel."
    strategy = PLAN_STRATEGY[plan]
    why = "Rule of thumb (>1 B params -> model parallel, >50 layers -> pipeline, else data parallel): " + why
    why += " The rule ignores batch size, activations and device memory; policy='memory' checks them."
    return StrategyChoice(strategy, plan, True, why, "rules", facts=facts)


@dataclass
class _Activations:
    """Activation bytes per device and the backward time, measured from the example batch (or zero without one)."""

    bytes: int
    backward_s: float
    measured: bool
    note: str


def _on_meta(model: nn.Module, batch: Any) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(t.is_meta for t in batch_tensors(batch))


def _estimated_activations(model: nn.Module, batch: Any, scale: float) -> _Activations:
    """The formula's activations for a meta-device model / batch (the batch's first tensor gives batch, sequence)."""
    first = next(iter(batch_tensors(batch)), None)
    shape = transformer_shape(model)
    if first is None or first.ndim == 0 or not shape["hidden"]:
        note = "activations not estimated (meta device, no batch shape or hidden size): a lower bound"
        return _Activations(0, 0.0, False, note)
    b, s = int(first.shape[0]), int(first.shape[1]) if first.ndim >= 2 else 1  # (batch, sequence, ...)
    autocast = torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    per_value = 2 if autocast else max(2, next((p.element_size() for p in model.parameters()), 4))
    acts = int(
        estimate_activation_bytes(
            layers=shape["layers"], hidden=shape["hidden"], seq=s, batch=b, heads=shape["heads"],
            bytes_per_value=per_value,
        ) * scale
    )  # fmt: skip
    note = (
        f"activations {_gb(acts)} estimated (meta device: {shape['layers']} layers x s·b·h·(34 + 5·a·s/h) at "
        f"h={shape['hidden']}, a={shape['heads']}, s={s}, b={b}, {per_value}-byte values)"
    )
    return _Activations(acts, 0.0, False, note)


def _activations(
    model: nn.Module, example_batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None, scale: float
) -> _Activations:
    if example_batch is None:
        note = "activations not measured (no `example_batch`): estimates are model state only, a lower bound"
        return _Activations(0, 0.0, False, note)
    if _on_meta(model, example_batch):
        return _estimated_activations(model, example_batch, scale)
    try:
        prof = measure_activation_bytes(model, example_batch, loss_fn=loss_fn)
    except Exception as e:  # noqa: BLE001 - reported in the note and a warning; the plan falls back to a lower bound
        # e.g. a model that sizes a layer in `setup()` from the data module (`num_classes="auto"`), which has not run
        # when a strategy is chosen before the Trainer exists (the CLI chooses then)
        why = one_line(e, first=True).rstrip(".")
        note = (
            f"activations not measured (the example batch's forward/backward failed: {why}): estimates are model "
            "state only, a lower bound"
        )
        warnings.warn(f"AutoStrategy: {note}.", RuntimeWarning, stacklevel=2)
        return _Activations(0, 0.0, False, note)
    acts = int(prof.activation_bytes * scale)
    note = f"activations {_gb(acts)} measured from one forward/backward of the example batch"
    return _Activations(acts, prof.backward_s * scale, True, note)


def _estimates(
    model: nn.Module, acts: int, world: int, bytes_per_param: int, facts: dict[str, Any]
) -> dict[str, MemoryEstimate]:
    """Bytes per device of each plan, in the order of preference (data parallel < sharded < tensor parallel <
    pipeline: each adds communication on the critical path or idle time). Trainable parameters cost
    ``bytes_per_param``, frozen ones their weight bytes (``facts``' ``trainable_params`` / ``frozen_bytes``), the
    module buffers their bytes on every device that runs them (``facts``' ``buffer_bytes``); the
    pipeline's ranks, schedule, stages per rank, activations and micro-batches are ``facts``' ``pipeline_size`` /
    ``pipeline_schedule`` / ``stages_per_rank`` / ``pipeline_activations`` / ``pipeline_microbatches``,
    tensor parallelism's group size and activations ``facts``' ``tp_size`` / ``tp_activations``."""
    trainable, frozen, buffers = facts["trainable_params"], facts["frozen_bytes"], facts["buffer_bytes"]
    largest = largest_unit_params(model)
    # the tensor-parallel plan wraps no FSDP unit: its `4·L/N` term is a slice of one block, the largest
    blocks = block_stack(model)
    largest_block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=largest)
    tp_size = facts["tp_size"]
    tp_split, tp_blocker = _tensor_parallel_params(model, tp_size)
    spr = facts["stages_per_rank"]
    stages, stage_buffers, pp_blocker = _pipeline_stages(model, facts["pipeline_size"] * spr, bytes_per_param)
    if not pp_blocker:
        # `microbatches` given without `pipeline_size`: the pipeline over every device is refused when it is built
        # (fewer micro-batches than its ranks), so it must never be the plan that fits
        try:
            check_microbatches(facts["pipeline_microbatches"], facts["pipeline_size"], facts["pipeline_schedule"])
        except ValueError as e:
            pp_blocker = f"cannot run: {one_line(str(e))}"
    per_stage = [trainable_and_frozen(ps) for ps in stages]
    pipeline = estimate_pipeline(
        [p for p, _ in per_stage],
        facts["pipeline_activations"],
        microbatches=facts["pipeline_microbatches"],
        bytes_per_param=bytes_per_param,
        stage_frozen_bytes=[w for _, w in per_stage],
        schedule=facts["pipeline_schedule"],
        stages_per_rank=spr,
        stage_buffer_bytes=stage_buffers,
    )
    tp = estimate_tensor_parallel(
        trainable,
        tp_split[0],
        facts["tp_activations"],
        tp_size,
        largest_block,
        bytes_per_param=bytes_per_param,
        frozen_bytes=frozen,
        split_frozen_bytes=tp_split[1],
        buffer_bytes=buffers,
    )
    state = {"bytes_per_param": bytes_per_param, "frozen_bytes": frozen, "buffer_bytes": buffers}
    return {
        "ddp": estimate_ddp(trainable, acts, **state),
        "fsdp": estimate_fsdp(trainable, acts, world, largest, **state),
        "tp": dataclasses.replace(tp, blocker=tp_blocker),
        "pipeline": dataclasses.replace(pipeline, blocker=pp_blocker),
    }


def _tensor_parallel_params(model: nn.Module, world: int) -> tuple[tuple[int, int], str]:
    """The ``Linear`` layers the tensor-parallel plan splits over ``world``: their trainable parameters and frozen
    weight bytes (:func:`~lightning_accel.parallel.estimate.trainable_and_frozen`), and why it cannot run ("" when
    it can)."""
    try:
        plan = tensor_parallel_plan(model, max(1, world))
    except ValueError as e:
        return (0, 0), f"cannot split: {one_line(str(e))}"
    mods = dict(model.named_modules())
    return trainable_and_frozen(p for name in plan for p in mods[name].parameters()), ""


def _pipeline_stages(
    model: nn.Module, world: int, bytes_per_param: int
) -> tuple[list[list[nn.Parameter]], list[int], str]:
    """The parameters each of ``world`` pipeline stages (every rank's stages, in loop order) holds, the bytes of its
    pieces' buffers, and why a pipeline cannot split ``model`` ("" when it can). The stages are
    ``PipelineStrategy``'s: its pieces, balanced by :func:`piece_costs` (on model state: the strategy also weighs the
    activations of ``example_input_array``, which this does not run) with a trainable piece in every stage where it
    can, each stage holding every parameter its pieces use, so a weight tied between stages (embedding and head)
    counts in each. A model the pipeline cannot split gets the block-stack split of
    :func:`pipeline_stage_parameters` (and :func:`pipeline_stage_buffer_bytes`) for the table; one whose stages
    cannot all train (more stages than trainable pieces: the strategy refuses to fit it) gets its split and that
    blocker."""
    try:
        pieces = find_pipeline_modules(model)
    except TypeError as e:
        blocker = f"cannot split: {one_line(str(e))}"
        return pipeline_stage_parameters(model, world), pipeline_stage_buffer_bytes(model, world), blocker
    if len(pieces) < world:
        blocker = f"cannot split: {len(pieces)} pipeline piece(s) for {world} stages"
        return pipeline_stage_parameters(model, world), pipeline_stage_buffer_bytes(model, world), blocker
    trainable = trainable_pieces(pieces)
    bounds = balance_stages(piece_costs(pieces, bytes_per_param=bytes_per_param), world, trainable=trainable)
    stages = [list({id(p): p for piece in pieces[a:b] for p in piece.parameters()}.values()) for a, b in bounds]
    buffers = [buffer_bytes(pieces[a:b]) for a, b in bounds]
    try:
        check_stages_train(bounds, trainable, model=f"`{type(model).__name__}`")
        check_no_sync_batchnorm(model, model=f"`{type(model).__name__}`")
    except ValueError as e:
        return stages, buffers, f"cannot split: {one_line(str(e))}"
    return stages, buffers, ""


def _break_even(given: float | None, act: _Activations, params: int, world: int) -> tuple[float, str]:
    """The inter-node bandwidth below which 1-bit compression pays, and where the number comes from."""
    if given is not None:
        return float(given), "given"
    if act.measured and world > 1:
        return onebit_break_even_gbps(params, world, act.backward_s), "measured from the example backward pass"
    return DEFAULT_ONEBIT_BREAK_EVEN_GBPS, "default, no example batch"


@dataclass
class _Case:
    """What the memory policy decides on: the machine, the estimates and the explanation's opening sentence."""

    num_nodes: int
    world: int
    capacity: int
    acts: int
    estimates: dict[str, MemoryEstimate]
    head: str
    break_even: float
    break_even_source: str
    inter_node_gbps: float | None
    policy: str
    facts: dict[str, Any]

    def fits(self, plan: str) -> bool:
        return _fits(self.estimates[plan], self.capacity)

    def choice(self, strategy: str, plan: str, fits: bool, why: str) -> StrategyChoice:
        return StrategyChoice(strategy, plan, fits, self.head + why, self.policy, self.estimates, self.facts)


def _data_parallel(c: _Case) -> StrategyChoice:
    """DDP fits: no parallelism on one device, ``ddp_1bit`` across slow links, plain DDP otherwise."""
    if c.world == 1:
        return c.choice("auto", "single", True, " One device and it fits: no parallelism needed.")
    be, be_src, gbps = c.break_even, c.break_even_source, c.inter_node_gbps
    if c.num_nodes > 1 and gbps is not None and gbps < be:
        why = (
            f" DDP fits. Across {c.num_nodes} nodes at {gbps:g} Gbit/s, below the {be:.1f} Gbit/s "
            f"break-even ({be_src}) where the fp32 allreduce stops hiding behind backward: use 'ddp_1bit' "
            "(1-bit compressed gradients, 32x fewer bytes on the wire)."
        )
        return c.choice("ddp_1bit", "ddp_1bit", True, why)
    bw = ""
    if c.num_nodes > 1:
        bw = (
            f" Inter-node bandwidth {'unknown' if gbps is None else f'{gbps:g} Gbit/s'}"
            f" (1-bit break-even {be:.1f} Gbit/s, {be_src}): plain DDP."
        )
    return c.choice("ddp", "ddp", True, " DDP fits: data parallel, the cheapest in communication." + bw)


def _beyond_data_parallel(c: _Case) -> StrategyChoice:
    """DDP does not fit: FSDP if it fits, else say what a pipeline would need, else the smallest option and fixes."""
    ests, world = c.estimates, c.world
    if world > 1 and c.fits("fsdp"):
        why = (
            f" DDP needs {_gb(ests['ddp'].total)} > {_gb(c.capacity)}; FSDP (ZeRO-3) shards parameters, gradients and "
            f"optimizer state over {world} devices and fits: use 'fsdp'."
        )
        return c.choice("fsdp", "fsdp", True, why)
    fixes = (
        "activation checkpointing (activations are "
        f"{_gb(c.acts)} per device), a smaller per-device batch, more devices, or FSDP with CPU offload."
    )
    for plan, what in (
        ("tp", "tensor parallel splits each block's attention and MLP matrices over the devices (a unit too large "
               "to gather whole)"),
        ("pipeline", f"a {c.facts['pipeline_size']}-rank pipeline holds its stages' layers per device"),
    ):  # fmt: skip
        if world > 1 and c.fits(plan):
            why = (
                f" Neither DDP ({_gb(ests['ddp'].total)}) nor FSDP ({_gb(ests['fsdp'].total)}) fits in "
                f"{_gb(c.capacity)}; {what} and fits ({_gb(ests[plan].total)}): use '{plan}'."
            )
            return c.choice(PLAN_STRATEGY[plan], plan, True, why)
    runnable = [k for k in ("ddp", "fsdp", "tp", "pipeline") if not ests[k].blocker] if world > 1 else ["ddp"]
    best = min(runnable, key=lambda k: ests[k].total)
    strategy = PLAN_STRATEGY[best] if world > 1 else "auto"
    why = (
        f" Nothing fits in {_gb(c.capacity)}: per device "
        + ", ".join(f"{k} {_gb(e.total)}" for k, e in ests.items())
        + f"; the smallest is {best} at {_gb(ests[best].total)}. Try "
        + fixes
    )
    return c.choice(strategy, best if world > 1 else "single", False, why)


# ------------------------------------------------------------------------------------------- measured selection


class TrialFailed(RuntimeError):
    """Raised by a trial whose plan failed (on some rank); its message is the error, already one line."""


def trial_key(
    model: nn.Module,
    world: int,
    device: str,
    batch_shape: tuple[int, ...],
    candidates: list[str],
    pipeline: str = "",
) -> str:
    """What a trial's result depends on: the model's class, size and depth, the world, the device, the batch, and
    ``pipeline``, how a timed pipeline runs (its schedule, micro-batches, stages per rank; "" adds nothing)."""
    params = sum(p.numel() for p in model.parameters())
    shape = "x".join(map(str, batch_shape))
    key = f"{type(model).__name__}|P={params}|L={count_layers(model)}|world={world}|{device}|batch={shape}|" + ",".join(
        candidates
    )
    return f"{key}|pipeline={pipeline}" if pipeline else key


#: how long :meth:`TrialCache.put` waits for another process's write of the same file (each holds it for one small
#: read and write): past it, a holder that is stuck does not stop the run, the write goes ahead unlocked
_CACHE_LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def _folder_lock(folder: str, timeout_s: float = _CACHE_LOCK_WAIT_S) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` (made when missing) for the block, so the read-modify-write of a file
    in it by several processes (two ranks, two jobs sharing a cache) runs one at a time. The folder, not a file beside
    the cache, is locked: the cache's file is replaced by a rename (a lock on it would be on the old file), and no
    lock file is left in the user's folder. Waits at most ``timeout_s``; where ``flock`` is missing (Windows) or
    refused (some network filesystems), or the wait runs out, the block runs unlocked (as before: a concurrent
    write may then drop the other's entry, never tear the file).

    Raises:
        OSError: the folder cannot be made (the caller warns and keeps the times in memory).
    """
    import os
    import time

    os.makedirs(folder, exist_ok=True)
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        locked = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:  # another process writes its entry: a few milliseconds
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            except OSError:  # a filesystem that does not lock
                break
        try:
            yield
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class TrialCache:
    """Measured step times by :func:`trial_key`, in a JSON file (None: in memory only), so repeated runs of the
    same model on the same world and device choose without measuring again.

    Several processes may share one file (two jobs, or ranks that each keep a cache): :meth:`put` reads the file,
    adds its entry and writes it back under an exclusive lock on the file's folder, so no process's entry is lost
    to another's write.

    Args:
        path: the JSON file (created on the first ``put``; written atomically).
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._mem: dict[str, dict[str, float]] = {}

    def _read(self) -> Any:
        """The file's JSON (None: no file, an empty one, or one that is not JSON or cannot be read)."""
        return self._read_why()[0]

    def _read_why(self) -> tuple[Any, str]:
        """The file's JSON and, when the file exists but holds no JSON, why (``(None, "")``: no file, or an empty
        one, which holds nothing to keep)."""
        import json
        import os

        if self.path is None or not os.path.exists(self.path):
            return None, ""
        try:
            with open(self.path) as f:
                text = f.read()
        except (OSError, ValueError) as e:  # a folder, no permission, not text
            return None, f"cannot be read ({type(e).__name__}: {one_line(e, first=True)})"
        if not text.strip():
            return None, ""
        try:
            return json.loads(text), ""
        except ValueError:  # not JSON (this cache writes atomically, so never a torn file of its own): measure again
            return None, "does not hold JSON"

    @staticmethod
    def _times(value: Any) -> dict[str, float] | None:
        """``value`` as ``{plan: seconds}``, or None when it is not one (such an entry is measured again)."""
        if not isinstance(value, dict):
            return None
        out: dict[str, float] = {}
        for plan, t in value.items():
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                return None
            out[str(plan)] = float(t)
        return out

    def _load(self) -> dict[str, dict[str, float]]:
        data = self._read()
        if data is None:
            return dict(self._mem)
        if not isinstance(data, dict):  # valid JSON but not a cache (a list, a number): measure again
            return {}
        return {k: t for k, v in data.items() if (t := self._times(v)) is not None}

    def get(self, key: str) -> dict[str, float] | None:
        return self._load().get(key)

    def put(self, key: str, times: dict[str, float]) -> None:
        """Keep ``times`` for ``key``, in the file too; the file's other entries, even those this cache cannot
        read, are written back unchanged. Never raises: a file that is not a cache (not JSON, JSON that is not an
        object, or unreadable) is left as it is, and a path that cannot be written is skipped, each with a warning
        (the times stay in memory): the file is not this cache's to overwrite, and this runs on one rank after the
        trial, where raising would fail the run on that rank alone."""
        import os

        self._mem[key] = dict(times)
        if self.path is None:
            return
        try:
            # read, add and write back as one step: two processes that both read the file before either wrote would
            # each write it back with its own entry only, and the first one's entry would be lost
            with _folder_lock(os.path.dirname(os.path.abspath(self.path))):
                self._put_locked(key, times)
        except OSError as e:  # the folder cannot be made: the times are kept for this run only
            self._unwritable(e)

    def _put_locked(self, key: str, times: dict[str, float]) -> None:
        """The read-modify-write of :meth:`put`, run under the folder's lock."""
        import json
        import warnings

        data, why = self._read_why()
        if why:
            warnings.warn(
                f"`trial_cache` file `{self.path}` {why}, so it is not a trial cache; it is left as it is and "
                "nothing is kept. Pass another path or remove the file.",
                stacklevel=3,
            )
            return
        if data is None:
            data = {}
        elif not isinstance(data, dict):
            warnings.warn(
                f"`trial_cache` file `{self.path}` holds JSON that is not a trial cache (a {type(data).__name__}, "
                "expected an object of measured times); it is left as it is and nothing is kept. Pass another path "
                "or remove the file.",
                stacklevel=3,
            )
            return
        data[key] = dict(times)
        assert self.path is not None
        try:
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True))
        except OSError as e:  # a folder that cannot be written: the times are kept for this run only
            self._unwritable(e)

    def _unwritable(self, e: OSError) -> None:
        import warnings

        warnings.warn(
            f"`trial_cache` file `{self.path}` cannot be written ({type(e).__name__}: {one_line(e, first=True)}); "
            "the measured times are kept for this run only. Pass a path in a writable folder.",
            stacklevel=3,
        )


def choose_by_trial(
    choice: StrategyChoice,
    trial: Callable[[str], float],
    *,
    key: str | None = None,
    cache: TrialCache | None = None,
    candidates: list[str] | None = None,
) -> StrategyChoice:
    """Time every candidate plan that fits (``trial(plan) -> seconds per step``) and pick the fastest.

    ``choice`` is the memory policy's answer (its estimates say what fits); with nothing that fits it is returned
    unchanged (``fits=False``: no trial can make a plan fit). Call it on every rank with the same arguments: the
    trial runs the same plans in the same order everywhere (they are collective), and ``trial`` itself returns the
    slowest rank's time (:func:`~lightning_accel.parallel.trials.time_plan`), so every rank decides the same.

    A trial that raises is dropped: its plan is not chosen, and the error (one line) is kept in
    :attr:`StrategyChoice.dropped` and shown by :meth:`StrategyChoice.table`. ``trial`` must raise alike on every
    rank (``AutoStrategy``'s trial shares a failure flag between the ranks after each plan). When every candidate is
    dropped, the memory policy's choice is returned with the drops recorded.

    Args:
        choice: from :func:`select_strategy` (``policy="memory"``).
        trial: runs a few steps of one plan and returns seconds per step.
        key: the cache key (:func:`trial_key`); None: no cache.
        cache: where measured times are kept (dropped plans are not: they are tried again next time).
        candidates: the plans to consider (default: every estimated plan that fits; a plan that cannot run the
            model, per its estimate's ``blocker``, is never tried).

    Returns:
        A new :class:`StrategyChoice` with ``policy="measure"``, ``measured`` and ``dropped`` filled and the fastest
        plan chosen.
    """
    cap = choice.facts.get("capacity")
    ests = choice.estimates
    fitting = [
        p
        for p in (candidates or list(ests))
        if p not in ests or (not ests[p].blocker and (cap is None or ests[p].total <= cap or candidates))
    ]
    if not fitting or not choice.fits:
        return choice
    times = cache.get(key) if (cache is not None and key is not None) else None
    dropped: dict[str, str] = {}
    source = "cached trial" if times is not None and all(p in times for p in fitting) else "trial"
    if source == "trial":
        times = {}
        for p in fitting:
            try:
                times[p] = float(trial(p))
            except Exception as e:  # noqa: BLE001  (any failure drops the plan, never the run)
                dropped[p] = one_line(e, expected=(TrialFailed,))[:300]
        if cache is not None and key is not None and times:
            cache.put(key, times)
    assert times is not None
    ran = [p for p in fitting if p in times]
    drops = "".join(f" Dropped '{p}' ({why})." for p, why in dropped.items())
    if not ran:
        why = f"{choice.explanation} Every trial failed, keeping the memory policy's '{choice.plan}'.{drops}"
        return dataclasses.replace(choice, explanation=why, policy="measure", dropped=dropped)
    best = min(ran, key=lambda p: times[p])
    listed = ", ".join(f"{p} {times[p] * 1e3:.1f} ms" for p in ran)
    why = (
        f"{choice.explanation} Measured ({source}, seconds per training step on the real model at the global batch "
        f"the Trainer runs): {listed}; the fastest is '{best}'.{drops}"
    )
    return StrategyChoice(
        PLAN_STRATEGY[best],
        best,
        True,
        why,
        "measure",
        choice.estimates,
        dict(choice.facts),
        measured={p: times[p] for p in ran},
        dropped=dropped,
    )
