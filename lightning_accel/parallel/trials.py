"""Timed trials of the parallel plans: a few real training steps of each candidate on the real model and batch.

:func:`plan_stepper` builds one plan (``"ddp"``, ``"fsdp"``, ``"tp"``, ``"pipeline"``) on a model in the running
process group and returns a :class:`Stepper` whose ``step()`` runs one forward + backward + AdamW step and returns the
loss averaged as single-process training would see it. :func:`time_plan` times ``steps`` steps after a warm-up
(the slowest rank's median, since a data-parallel job runs at its slowest rank's pace). Every rank must call these
with the same arguments (they run collectives). The selector (:func:`~lightning_accel.parallel.select.choose_by_trial`)
and ``benchmarks/parallel.py`` use them.

A trial can run on a process group of its own (``group``): its collectives then never meet another's on the default
group, and a rank whose trial failed alone frees the ranks still waiting in one of them by destroying the trial's
groups (:func:`release_groups`; on gloo the waiting collective fails at once with "Connection closed by peer"), so
every rank leaves the trial and the default group stays sound for what follows.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_accel._utils.checks import check_choice
from lightning_accel._utils.rank import raise_if_any_rank_failed
from lightning_accel.parallel.estimate import default_microbatches, resolve_stages_per_rank
from lightning_accel.parallel.pipeline import (
    PipelineRunner,
    check_no_sync_batchnorm,
    check_stages_train,
    find_pipeline_modules,
    piece_costs,
    pipeline_layout,
    split_batch,
    trainable_pieces,
)
from lightning_accel.parallel.plans import apply_fully_shard, apply_tensor_parallel

__all__ = [
    "PLANS",
    "PeerTrialFailed",
    "Stepper",
    "held_tensor_bytes",
    "plan_stepper",
    "release_groups",
    "time_plan",
    "together",
]

PLANS = ("ddp", "fsdp", "tp", "pipeline")

T = TypeVar("T")


class PeerTrialFailed(RuntimeError):
    """Raised by :func:`together` on the ranks where its step went fine, because it failed on another rank (the
    message names that rank and its error): the trial is over there too, and that rank's own error is the cause."""


def together(step: Callable[[], T], *, device: Any, group: Any = None) -> T:
    """``step()`` on every rank of ``group``, then one flag shared: when it failed on any rank, every rank raises (its
    own error where it failed, :class:`PeerTrialFailed` naming the first failing rank elsewhere).

    For the part of a trial that runs before its plan's collectives and may fail on some ranks only (copying the
    model, or measuring the pipeline's split, out of memory on one rank): a pipeline then makes its process groups
    (``new_group``, which every rank must call, in the same order), and a rank that failed before them would leave
    the others waiting there for the process group's timeout, and every group made later would pair ranks out of step.
    Collective over ``group`` (None: the default group), on ``device`` (NCCL reduces device tensors only)."""

    def what(rank: int, more: str) -> str:
        return f"the trial failed on rank {rank}{more}"

    try:
        out = step()
    except Exception as e:
        raise_if_any_rank_failed(e, what, device=device, group=group)
        raise
    try:
        raise_if_any_rank_failed(None, what, device=device, group=group)
    except RuntimeError as e:
        raise PeerTrialFailed(str(e)) from None
    return out


def _mean_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    return output.float().mean()


@dataclass
class Stepper:
    """One plan, built: ``step()`` trains one step; ``model`` / ``optimizer`` are what this rank holds; ``groups`` the
    process groups the plan made (a pipeline's stage groups), for :func:`release_groups`."""

    plan: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], float]
    groups: tuple[Any, ...] = ()


def release_groups(groups: Sequence[Any]) -> None:
    """Destroy ``groups`` (process groups a trial made; one already destroyed, or that this rank is not in, is
    skipped). Local, no collective: a rank whose trial failed alone calls it while the others may still wait in a
    collective of those groups. The connections close when the last reference to a group goes, so the caller drops
    its own (the :class:`Stepper`, the group) and runs ``gc.collect()``; on gloo a peer's waiting collective then
    fails at once ("Connection closed by peer"); on NCCL it waits for the group's timeout."""
    for g in groups:
        if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        with contextlib.suppress(ValueError):  # destroyed already
            dist.destroy_process_group(g)


def held_tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (distinct storages; a DTensor's local
    shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return int(sum(seen.values()))


def plan_stepper(
    plan: str,
    model: nn.Module,
    inputs: torch.Tensor,
    target: Any = None,
    *,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    lr: float = 1e-3,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    split_example: torch.Tensor | None = None,
    group: Any = None,
) -> Stepper:
    """Apply ``plan`` to ``model`` (changed in place: pass a copy) over ``group`` (None: the default process group).

    FSDP keeps tied parameters in one group (:func:`~lightning_accel.parallel.plans.fsdp_groups`); tensor
    parallel splits packed q/k/v projections per head.

    Args:
        plan: one of :data:`PLANS`.
        model: the network; its forward takes ``inputs``.
        inputs: the global batch of forward inputs: data-parallel plans take this rank's ``1/world`` of it,
            tensor-parallel and pipeline plans the whole, so every plan steps on the same global batch.
        target: what ``loss_fn`` compares the output with (sliced like ``inputs``); None with the default loss.
        loss_fn: ``(output, target) -> scalar`` (default: the output's mean).
        lr: AdamW learning rate.
        microbatches: pipeline micro-batches (default ``2 x world``:
            :func:`~lightning_accel.parallel.estimate.default_microbatches`).
        schedule: pipeline schedule.
        stages_per_rank: pipeline stages per rank (None: 2 for the interleaved schedule, else 1).
        split_example: the batch the pipeline's stage split measures activations on (None: ``inputs``, the whole
            batch). Pass what ``PipelineStrategy`` splits on, the LightningModule's ``example_input_array``, to time
            the stages it will build (``AutoStrategy`` does); the forward leaves the model as it was
            (:func:`~lightning_accel.parallel.pipeline.piece_costs`).
        group: a process group over every rank for the plan's collectives (DDP's, the sharded plans' mesh, the loss
            average; a pipeline makes its stage groups itself, listed in :attr:`Stepper.groups`); None: the default
            group. :func:`time_plan` takes the same one.

    Raises:
        ValueError: a pipeline stage would hold no trainable parameter (on every rank alike:
            :func:`~lightning_accel.parallel.pipeline.check_stages_train`) or an ``nn.SyncBatchNorm``
            (:func:`~lightning_accel.parallel.pipeline.check_no_sync_batchnorm`), a batch the plan cannot split.
        PeerTrialFailed: the pipeline's split failed on another rank (that rank raises its own error): every rank
            raises before the split's process groups are made (:func:`together`).
    """
    check_choice("plan", plan, PLANS)
    loss = loss_fn or _mean_loss
    world, rank = dist.get_world_size(), dist.get_rank()
    if group is not None and dist.get_world_size(group) != world:
        raise ValueError(
            f"`group` holds {dist.get_world_size(group)} of the {world} ranks; a trial runs over every rank. Pass a "
            "group over every rank (`dist.new_group()`), or None for the default group."
        )
    device = inputs.device
    if plan == "pipeline":

        def split() -> tuple[list[nn.Module], Any]:
            pieces = find_pipeline_modules(model)
            # before any forward: a stage running a `SyncBatchNorm` alone would wait forever for the other ranks
            check_no_sync_batchnorm(model, model=f"`{type(model).__name__}`")
            spr = resolve_stages_per_rank(schedule, stages_per_rank)
            # the split `PipelineStrategy` makes: its example (a batch BatchNorm can run in training mode, not one
            # sample) and its rule that every stage trains
            example = (inputs if split_example is None else split_example).to(device)
            trainable = trainable_pieces(pieces)
            layout = pipeline_layout(piece_costs(pieces, example), world, stages_per_rank=spr, trainable=trainable)
            check_stages_train(layout.bounds, trainable, model=f"`{type(model).__name__}`")
            return pieces, layout

        # the split runs a forward, which may fail on one rank alone (out of memory there): every rank learns of it
        # before the runner makes its process groups, which every rank must make
        pieces, layout = together(split, device=device, group=group)
        m = microbatches or default_microbatches(world)
        runner = PipelineRunner(
            model, pieces, layout, rank=rank, device=device, schedule=schedule, microbatches=m, loss_fn=loss
        )
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        xs = split_batch(inputs, m)
        ts = split_batch(target, m) if target is not None else [torch.zeros(1)] * m

        def step_pp() -> float:
            opt.zero_grad(set_to_none=True)
            out = runner.step(xs, ts, key=tuple(xs[0].shape))
            opt.step()
            return float(out)

        return Stepper(plan, model, opt, step_pp, groups=tuple(runner.groups))

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    shard = plan in ("ddp", "fsdp")
    if shard and inputs.shape[0] % world:
        raise ValueError(f"the batch of {inputs.shape[0]} cannot be split over {world} data-parallel ranks.")
    x = inputs.chunk(world)[rank] if shard else inputs
    y = target.chunk(world)[rank] if (shard and isinstance(target, torch.Tensor)) else target
    net: nn.Module = model
    if plan == "ddp":
        net = nn.parallel.DistributedDataParallel(model, process_group=group)
    else:
        mesh = init_device_mesh(device.type, (world,)) if group is None else DeviceMesh.from_group(group, device.type)
        if plan == "fsdp":
            apply_fully_shard(model, mesh)
        else:
            apply_tensor_parallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        value = loss(net(x), y)
        value.backward()
        opt.step()
        v = value.detach().float().reshape(1)
        if shard:
            dist.all_reduce(v, group=group)
            v /= world
        return float(v)

    return Stepper(plan, model, opt, step)


def time_plan(stepper: Stepper, *, steps: int = 3, warmup: int = 1, group: Any = None) -> float:
    """Median seconds per step over ``steps`` timed steps after ``warmup`` untimed ones, the slowest rank's (reduced
    over ``group``, the one the stepper was built on; None: the default group)."""
    for _ in range(warmup):
        stepper.step()
    times = []
    for _ in range(steps):
        if torch.cuda.is_available() and next(stepper.model.parameters(), torch.empty(0)).is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stepper.step()
        if torch.cuda.is_available() and next(stepper.model.parameters(), torch.empty(0)).is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # on the model's device: NCCL, the GPU backend, reduces device tensors only
    device = next(stepper.model.parameters(), torch.empty(0)).device
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)
