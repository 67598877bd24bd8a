"""``onebit_hook``: a DDP communication hook that averages gradients with the 1-bit two-phase allreduce.

Use it without Lightning as ``ddp_model.register_comm_hook(OneBitState(parameters=model.parameters()), onebit_hook)``.

Algorithm, per DDP bucket and step:

0. ``compression="auto"`` and the first bucket of the first step after warm-up (or of a re-check step): time fp32
   against compressed averaging of buffers of the run's sizes and decide, on every rank
   (:func:`~lightning_accel.comm.auto.decide`), unless the strategy decides (it times real steps).
1. Warm-up steps, steps decided ``"fp32"``, and buckets below ``config.min_compress_numel``: plain fp32 allreduce
   (asynchronous).
2. Compressed stage with ``state.mode == "momentum"``: the bucket's local gradients are handed back unaveraged (the
   optimizer step, :class:`~lightning_accel.comm.momentum.MomentumCompressor`, averages the momentum instead); when
   ``state.bucket_fn`` is set, the bucket's parameters and gradients go to it first, so the momentum of the groups
   this bucket completes is compressed and sent while backward continues; under a GradScaler a 1-element MAX
   allreduce makes a non-finite bucket non-finite on every rank, so all skip the step.
3. Compressed stage with ``state.mode == "gradients"``: the bucket's parameters are split into *groups* (normally the
   bucket itself), each laid out canonically (parameters by model index, padded to multiples of 8) and averaged by
   :func:`~lightning_accel.comm.allreduce.onebit_allreduce` (worker compression with error feedback, ``all_to_all``,
   server average + recompression with error feedback, all-gather, decode), or, with ``state.topology`` set, by the
   hierarchical version (:class:`~lightning_accel.comm.allreduce.HierarchicalOneBitAllreduce`: fp32 inside each
   node, the same exchange between nodes).
4. The error state is committed only when the decoded result is finite: a NaN/Inf bucket decodes to NaN/Inf (so
   AMP's GradScaler skips the step) and leaves the state as it was.

Groups are keyed by parameter indices, not bucket indices: after a resume, DDP's first iteration uses its initial
buckets again (one big bucket for small models) before rebuilding them; a bucket that is a union of saved groups is
processed group by group, so a resumed run computes exactly what the uninterrupted run computed.

The compressed gradient path on CPU runs in a comm thread (:class:`CommWorker`): the hook queues the bucket and
returns a future that the thread completes, so the compression and both phases of one bucket run while backward
computes the next ones (DDP waits for every future at the end of backward). The thread issues every collective of the
step, in bucket order (the same on every rank), on a gloo process group of its own, so collectives that other threads
issue meanwhile (DDP's unused-parameter map) cannot interleave with them. A ``then``-chained version would issue
phase 2 from gloo's callback thread, racing the next bucket's phase 1 on the same group. On CUDA the hook runs the
bucket itself: NCCL collectives and the Triton kernel are stream-ordered, so the host only launches them.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime (they must be
# `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` objects, not strings).
import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_accel.comm.allreduce import fp32_ring_bytes
from lightning_accel.comm.auto import decide
from lightning_accel.comm.compress import compress_fast
from lightning_accel.comm.state import GroupState, OneBitState
from lightning_accel.comm.topology import NodeTopology

__all__ = ["CommWorker", "onebit_hook"]

# (group, runs) with runs = [(bucket_offset, canonical_offset, numel)]
_Plan = list[tuple[GroupState, list[tuple[int, int, int]]]]


def _param_indices(state: OneBitState, params: list[torch.Tensor]) -> list[int]:
    out = []
    for p in params:
        i = state.param_index.get(id(p))
        if i is None:  # no set_parameters(): number in first-seen order (same on every rank)
            i = state.param_index[id(p)] = len(state.param_index)
        out.append(i)
    return out


def _split_into_groups(state: OneBitState, idx: set[int]) -> list[tuple[int, ...]]:
    """Group keys covering ``idx``: one existing key, a disjoint union of known keys, or a new key."""
    whole = tuple(sorted(idx))
    if whole in state.groups or whole in state.pending:
        return [whole]
    known = [k for k in (*state.groups, *state.pending) if set(k) <= idx]
    covered: set[int] = set()
    parts = []
    for k in sorted(known):
        if covered.isdisjoint(k):
            parts.append(k)
            covered.update(k)
    if parts and covered == idx:
        return parts
    stale = [k for k in (*state.groups, *state.pending) if not idx.isdisjoint(k)]
    if stale:
        warnings.warn(
            f"DDP bucket layout changed for {len(idx)} parameters: their 1-bit error-feedback state is reset.",
            stacklevel=3,
        )
        for k in stale:
            state.groups.pop(k, None)
            state.pending.pop(k, None)
    return [whole]


def _group(state: OneBitState, key: tuple[int, ...], numel_of: dict[int, int], device: torch.device) -> GroupState:
    g = state.groups.get(key)
    if g is not None:
        return g
    g, dropped = state.new_group(key, [numel_of[i] for i in key], device)
    if dropped:
        warnings.warn(f"1-bit error state for a group of {len(key)} parameters does not fit: reset.", stacklevel=3)
    state.groups[key] = g
    return g


class _Bucket:
    """What the hook needs of a ``dist.GradBucket`` after it returns (for the comm thread)."""

    __slots__ = ("buffer", "index", "is_last", "params")

    def __init__(self, index: int, params: list[torch.Tensor], buffer: torch.Tensor, is_last: bool) -> None:
        self.index, self.params, self.buffer, self.is_last = index, params, buffer, is_last


def _plan(state: OneBitState, bucket: _Bucket) -> _Plan:
    params = bucket.params
    idx = _param_indices(state, params)
    cache_key = (bucket.index, tuple(idx))
    plan = state.plans.get(cache_key)
    if plan is not None and all(state.groups.get(g.key) is g for g, _ in plan):
        return plan
    offsets, pos = {}, 0
    numel_of = {}
    for i, p in zip(idx, params, strict=True):
        offsets[i] = pos
        numel_of[i] = p.numel()
        pos += p.numel()
    if pos != bucket.buffer.numel():
        raise RuntimeError(f"DDP bucket holds {bucket.buffer.numel()} elements but its parameters {pos}.")
    plan = []
    # a parameter with no elements holds nothing to average (and a group layout needs elements): in no group
    nonempty = {i for i in idx if numel_of[i] > 0}
    for key in _split_into_groups(state, nonempty) if nonempty else []:
        g = _group(state, key, numel_of, bucket.buffer.device)
        runs: list[tuple[int, int, int]] = []
        for i, co in zip(key, g.layout.offsets, strict=True):
            bo, n = offsets[i], numel_of[i]
            if runs and runs[-1][0] + runs[-1][2] == bo and runs[-1][1] + runs[-1][2] == co:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)  # contiguous in both layouts: one copy
            else:
                runs.append((bo, co, n))
        plan.append((g, runs))
    state.plans[cache_key] = plan
    return plan


def _loss_scale(state: OneBitState, device: torch.device) -> torch.Tensor | None:
    if state.loss_scale_fn is None:
        return None
    s = state.loss_scale_fn()
    if s is None:
        return None
    return torch.as_tensor(s, dtype=torch.float32, device=device).reshape(())


def _end_bucket(state: OneBitState, is_last: bool, sent: int, fp32: int, compressed: bool) -> None:
    state.stats.end_bucket(sent, fp32, compressed, is_last)
    if is_last:
        state.step += 1


def _fp32_bucket(
    state: OneBitState, is_last: bool, buf: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> Any:
    """Step 1: average ``buf`` with a plain fp32 allreduce on ``group`` (the work handle with ``async_op``)."""
    world = dist.get_world_size(group)
    fp32 = fp32_ring_bytes(buf.numel(), world)
    state.stats.uncompressed_calls += 1
    _end_bucket(state, is_last, fp32 * buf.element_size() // 4, fp32, compressed=False)
    buf.div_(world)
    return dist.all_reduce(buf, group=group, async_op=async_op)


def _done(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
    fut.set_result(buf)
    return fut


def _local_only(state: OneBitState, bucket: dist.GradBucket, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Compressed-momentum stage: hand back this rank's own gradients (the optimizer step averages the momentum).

    Under a GradScaler the ranks must still agree on skipping a step: a 1-element MAX allreduce of "this bucket is
    not finite" poisons the bucket on every rank when any rank's is, so every scaler sees Inf and skips the step.
    """
    state.local_grads = True
    scale = _loss_scale(state, buf.device)
    if scale is None:
        if state.bucket_fn is not None:  # start compressing the momentum of what this bucket completes
            state.bucket_fn(list(bucket.parameters()), bucket.gradients())
        _end_bucket(state, bucket.is_last(), 0, 0, compressed=False)
        return _done(buf)
    flag = (~torch.isfinite(buf).all()).to(torch.float32).reshape(1)
    flag_bytes = fp32_ring_bytes(1, dist.get_world_size(state.process_group))
    _end_bucket(state, bucket.is_last(), flag_bytes, 0, compressed=False)
    fut = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.process_group, async_op=True).get_future()

    def poison(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        if f.value()[0].item() > 0:
            buf.fill_(float("nan"))
        return buf

    return fut.then(poison)


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket``'s gradients across ranks, 1-bit compressed after warm-up.

    Args:
        state: the hook's :class:`~lightning_accel.comm.state.OneBitState`.
        bucket: the DDP bucket (the parameter must be named ``bucket``: DDP checks the signature).

    Returns:
        A future holding the averaged flat gradients (the bucket's own buffer, overwritten).
    """
    buf = bucket.buffer()
    group = state.process_group
    world = dist.get_world_size(group)
    if world == 1:
        _end_bucket(state, bucket.is_last(), 0, 0, compressed=False)
        return _done(buf)
    if bucket.index() == 0:
        state.stats.last_step_comm_s = 0.0
        if state.needs_decision:  # compression="auto": measure once, on every rank, first
            decide(state, buf.device)
    if state.compressing and state.mode == "momentum" and not state.refreshing:
        return _local_only(state, bucket, buf)
    state.local_grads = False
    # a compressed CPU step sends every bucket through the comm thread (small ones in fp32 there), so that one thread
    # issues all of the step's collectives in bucket order; a variance-refresh step averages in fp32
    if not state.compressing or state.refreshing or (buf.is_cuda and buf.numel() < state.config.min_compress_numel):
        fut = _fp32_bucket(state, bucket.is_last(), buf, group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    b = _Bucket(bucket.index(), list(bucket.parameters()), buf, bucket.is_last())
    loss_scale = _loss_scale(state, buf.device)
    if buf.is_cuda:  # stream-ordered collectives: the host only launches, so the hook runs them itself
        _compressed_bucket(state, b, group, loss_scale)
        return _done(buf)
    # CPU: the comm thread runs the bucket while backward computes the next ones
    return _worker(state).submit(lambda: _compressed_bucket(state, b, None, loss_scale))


def _compressed_bucket(
    state: OneBitState, bucket: _Bucket, group: dist.ProcessGroup | None, loss_scale: torch.Tensor | None
) -> torch.Tensor:
    """Average one bucket of a compressed step in place (steps 3-4); ``group`` None: the comm thread's own group.

    A bucket below ``min_compress_numel`` gets an fp32 allreduce here (on the same group as the compressed ones, so
    the comm thread issues every collective of the step, in bucket order)."""
    buf = bucket.buffer
    topology = state.topology
    if group is None:
        assert state.comm_worker is not None
        group, topology = state.comm_worker.group, state.comm_worker.topology
    t0 = time.perf_counter()
    if buf.numel() < state.config.min_compress_numel:
        _fp32_bucket(state, bucket.is_last, buf, group, async_op=False)
        state.stats.last_step_comm_s += time.perf_counter() - t0
        return buf
    world = dist.get_world_size(group)
    fp32 = fp32_ring_bytes(buf.numel(), world)
    compress = state.compressor(buf.device)
    ef = state.config.error_feedback
    sent = 0
    for g, runs in _plan(state, bucket):
        x, bufs = state.buffers_for(g, fast=compress is compress_fast)
        for bo, co, n in runs:
            x[co : co + n] = buf[bo : bo + n]
        op = state.allreduce_op(
            x,
            g.layout,
            g.worker_error if ef else None,
            g.server_error if ef else None,
            group=group,
            topology=topology,
            loss_scale=loss_scale,
            compress=compress,
            buffers=bufs,
        )
        res = op.start().serve().finish()
        w, s = res.worker_error, res.server_error  # None without error feedback
        if buf.is_cuda:  # no host sync: select on the device
            if w is not None and s is not None:
                g.worker_error.copy_(torch.where(res.finite, w, g.worker_error))
                g.server_error.copy_(torch.where(res.finite, s, g.server_error))
        elif bool(res.finite):
            g.commit(w, s, bufs)
        else:
            state.stats.nonfinite_groups += 1
        for bo, co, n in runs:
            buf[bo : bo + n] = res.out[co : co + n]
        sent += res.bytes_sent
        state.stats.intra_bytes += res.intra_bytes
        state.stats.compressed_calls += 1
    _end_bucket(state, bucket.is_last, sent, fp32, compressed=True)
    state.stats.last_step_comm_s += time.perf_counter() - t0
    return buf


class CommWorker:
    """The thread that runs the CPU gradient path's compressed averaging while backward goes on.

    One per :class:`~lightning_accel.comm.state.OneBitState`, started at the first compressed CPU bucket. Jobs run
    one at a time in the order the hook submits them (bucket order, the same on every rank), and every collective they
    issue goes to a process group of the worker's own (the same ranks as the state's group, gloo): collectives other
    code issues meanwhile from other threads (DDP's unused-parameter map, a metric sync) go to other groups, so the
    order of each group's collectives is the same on every rank, which gloo requires.

    Args:
        ranks: the global ranks of the state's process group.
        topology: the state's node layout when it averages hierarchically (the worker makes its own copy of its
            groups), else None.
    """

    def __init__(self, ranks: list[int], topology: NodeTopology | None = None) -> None:
        # every member creates it at the same bucket of the same step; only members synchronise
        self.group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        #: the node layout over the worker's own groups (hierarchical averaging), else None
        self.topology = None if topology is None else topology.duplicate(backend="gloo")
        self._jobs: queue.SimpleQueue[tuple[Callable[[], torch.Tensor], torch.futures.Future[torch.Tensor]] | None]
        self._jobs = queue.SimpleQueue()
        #: the first exception a job raised (the thread goes on with the next job), else None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lightning-accel-1bit", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """Queue ``job``; the future holds its result, or fails with its exception's type and message.

        The job's exception itself is kept in :attr:`error` (the first one), for a caller that wants to raise it again.
        """
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._jobs.put((job, fut))
        # DDP reads a future's value in C++: an exception set from Python would reach it as a value ("Unable to cast
        # ... to Tensor"); re-raised in a `then` callback it becomes the future's error, which DDP raises in backward
        return fut.then(_value)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            try:
                fut.set_result(job())
            except BaseException as err:  # noqa: BLE001 - handed to DDP, which raises it in backward
                if self.error is None:
                    self.error = err
                fut.set_exception(err)  # type: ignore[arg-type]  # torch's stub types it as the result

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread after the queued jobs (bounded wait) and destroy the worker's process groups (its own, and
        its copy of the node layout's)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # already destroyed with the default group
                dist.destroy_process_group(self.group)
        if self.topology is not None:
            self.topology.destroy()


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.wait()  # raises the job's exception inside `then`: the chained future fails with it


def _worker(state: OneBitState) -> CommWorker:
    if state.comm_worker is None:
        pg = state.process_group if state.process_group is not None else dist.group.WORLD
        state.comm_worker = CommWorker(dist.get_process_group_ranks(pg), state.topology)
    return state.comm_worker
