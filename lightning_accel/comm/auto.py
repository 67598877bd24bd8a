"""``compression="auto"``: time fp32 and 1-bit averaging of this run, keep the faster.

Compression is extra work (two compressions, three decodes, two collectives instead of one); it pays only when the
link is slow compared with that work. Nothing predicts that well from outside (link speed, CPU or GPU compressor,
overlap with backward, other tenants of the machine), so the run measures it at the end of warm-up (and every
``recheck_every`` steps if asked). Two ways, both collective and decided on rank 0:

**Real steps** (:class:`StepTrial`, what ``OneBitDDPStrategy`` does): the strategy times every optimizer step. At the
end of warm-up it switches to the other mode for ``1 + steps`` steps (the first builds the compression state and is
not timed), then compares the median of those steps with the median of the last ``steps`` steps before the switch
(steps 0, which is DDP's first iteration, excluded). The figures include everything a step does (compression, the
collectives, their overlap with backward, contention for the cores), measured minutes apart on the same job.

**Buffers** (:func:`decide`, for the comm hook used without the strategy, and where there are no step times to
compare):

1. Every rank builds buffers of the sizes the compressed stage will use (the trainable parameters in model order, cut
   into groups of ``group_numel`` elements) on the gradients' device.
2. It times an fp32 allreduce of those buffers and the pipelined compressed allreduce of the same buffers (compression
   included, error state untouched), alternating, ``repeats`` rounds after one untimed round each; medians.

Either way the per-rank figures are reduced with MAX (the slowest rank sets the pace); rank 0 decides ``"1bit"`` only
if ``onebit_s * (1 + margin) < fp32_s`` and broadcasts the decision with both figures, so every rank switches at the
same step. The margin keeps a near tie on fp32 (a fast link must never be slower than plain DDP): ``MARGIN`` (10 %)
for buffers, whose timing misses DDP's overlap of its allreduce with backward, ``STEP_MARGIN`` (3 %) for real steps.
The decision and both times are logged (logger ``lightning_accel.comm``) and appended to ``state.decisions``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from lightning_accel._utils.checks import check_int
from lightning_accel.comm.allreduce import CompressFn, OneBitAllreduce, run_pipelined
from lightning_accel.comm.compress import GroupLayout
from lightning_accel.comm.state import OneBitState

__all__ = ["MARGIN", "STEP_MARGIN", "TRIAL_STEPS", "StepTrial", "decide", "measure"]

log = logging.getLogger("lightning_accel.comm")

#: 1-bit must be at least this much faster (10 %) than fp32 to be chosen: the timing covers communication and
#: compression but not DDP's overlap of its allreduce with backward, which favours fp32 further
MARGIN = 0.1
#: the same for figures from real steps, which include every overlap
STEP_MARGIN = 0.03
#: timed steps per mode in a :class:`StepTrial`
TRIAL_STEPS = 3


def _groups(state: OneBitState, numels: list[int] | None) -> list[list[int]]:
    from lightning_accel.comm.momentum import plan_groups  # plan_groups lives with the step that uses it

    sizes = numels if numels else [n for n in state.param_numels if n > 0]
    keys = plan_groups(list(enumerate(sizes)), state.config.group_numel)
    return [[sizes[i] for i in k] for k in keys]


def measure(
    state: OneBitState, device: torch.device, numels: list[int] | None = None, *, repeats: int = 3
) -> tuple[float, float]:
    """Seconds per fp32 allreduce and per compressed allreduce of the run's buffers on this rank (medians).

    Collective. ``numels``: the element counts to time (default: the trainable parameters ``state`` numbered).
    """
    groups = _groups(state, numels)
    world = state.process_group_size()
    layouts = [GroupLayout(g, world, state.config.block_size, device) for g in groups]
    gen = torch.Generator().manual_seed(0)
    flat = [torch.randn(lay.numel, generator=gen).to(device) for lay in layouts]
    padded = [(torch.randn(lay.padded_numel, generator=gen).to(device) * lay.table.mask) for lay in layouts]
    errors = [
        (torch.zeros(lay.padded_numel, device=device), torch.zeros(lay.chunk_numel, device=device))
        if state.config.error_feedback
        else (None, None)
        for lay in layouts
    ]
    compress: CompressFn = state.compressor(device)  # the same compressor choice as the real step
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def fp32() -> None:
        works = [dist.all_reduce(b, group=state.process_group, async_op=True) for b in flat]
        for w in works:
            w.wait()

    def onebit() -> None:
        ops = (
            OneBitAllreduce(x, lay, e[0], e[1], group=state.process_group, compress=compress)
            for x, lay, e in zip(padded, layouts, errors, strict=True)
        )

        def done(op: OneBitAllreduce) -> None:
            op.finish()

        run_pipelined(ops, done)

    times: dict[str, list[float]] = {"fp32": [], "1bit": []}
    for rnd in range(repeats + 1):
        for name, fn in (("fp32", fp32), ("1bit", onebit)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if rnd:  # the first round warms up (allocations, connections, kernel compilation)
                times[name].append(time.perf_counter() - t0)
    return median(times["fp32"]), median(times["1bit"])


def decide(
    state: OneBitState,
    device: torch.device,
    numels: list[int] | None = None,
    *,
    timings: tuple[float, float] | None = None,
    step: int | None = None,
) -> str:
    """Measure (or call ``state.measure_fn``), decide on rank 0, broadcast, log; sets ``state.decision``.

    Collective: every rank must call it at the same step. ``timings``: this rank's ``(fp32_s, onebit_s)`` per step,
    measured already (a :class:`StepTrial`; decided with ``STEP_MARGIN``); ``step``: the step the figures belong to
    (default: now). Returns the decision, ``"1bit"`` or ``"fp32"``.
    """
    source, margin = "steps", STEP_MARGIN
    if timings is not None:
        t32, t1 = timings
    elif state.measure_fn is not None:
        (t32, t1), source, margin = state.measure_fn(state), "injected", MARGIN
    else:
        (t32, t1), source, margin = measure(state, device, numels), "buffers", MARGIN
    group = state.process_group
    t = torch.tensor([t32, t1], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    verdict = torch.tensor([0.0, float(t[0]), float(t[1])], dtype=torch.float64, device=device)
    if dist.get_rank(group) == 0:
        verdict[0] = 1.0 if float(t[1]) * (1 + margin) < float(t[0]) else 0.0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(verdict, src=src, group=group)
    decision = "1bit" if float(verdict[0]) > 0.5 else "fp32"
    entry: dict[str, Any] = {
        "step": state.step if step is None else step,
        "fp32_s": float(verdict[1]),
        "onebit_s": float(verdict[2]),
        "decision": decision,
        "source": source,
    }
    state.decisions.append(entry)
    state.set_decision(decision)
    if dist.get_rank(group) == 0:
        log.info(
            "ddp_1bit compression='auto' at step %d (%s): fp32 %.2f ms, 1-bit %.2f ms per step -> %s",
            entry["step"],
            source,
            1e3 * entry["fp32_s"],
            1e3 * entry["onebit_s"],
            decision,
        )
    return decision


class StepTrial:
    """``compression="auto"`` from real step times (see the module docstring); driven by the strategy.

    Call :meth:`step_started` at the start of every optimizer step, before its backward, on every rank: it closes the
    previous step's interval, starts a trial where a decision is due, ends one (collective: every rank reaches the same
    step) and opens the next interval. ``clock`` returns seconds (replaceable in tests).
    """

    def __init__(self, steps: int = TRIAL_STEPS, clock: Callable[[], float] = time.perf_counter) -> None:
        self.steps = check_int("steps", steps, low=1, fix="Use e.g. 3.")
        self.clock = clock
        #: ``{step: (mode, seconds)}`` of the recent steps
        self.durations: dict[int, tuple[str, float]] = {}
        self._open: tuple[int, str, float] | None = None

    @staticmethod
    def _mode(state: OneBitState) -> str:
        return "1bit" if state.compressing else "fp32"

    def step_started(self, state: OneBitState, device: torch.device) -> str | None:
        """Book-keeping at the start of step ``state.step``; returns the decision when one was made now."""
        now = self.clock()
        if self._open is not None and self._open[0] == state.step - 1:
            self.durations[self._open[0]] = (self._open[1], now - self._open[2])
        for k in [k for k in self.durations if k < state.step - 4 * self.steps - 4]:  # keep the recent ones
            del self.durations[k]
        decision = None
        if state.trial_until is not None and state.step >= state.trial_until:
            decision = self._finish(state, device)
        elif state.needs_decision:  # (never during a trial)
            if state.measure_fn is not None:  # injected figures: decide now, no trial
                decision = decide(state, device)
            else:  # try the other mode
                state.set_decision("1bit" if state.decision in (None, "fp32") else "fp32")
                state.trial_until = state.step + self.steps + 1
        self._open = (state.step, self._mode(state), now)
        return decision

    def _finish(self, state: OneBitState, device: torch.device) -> str:
        assert state.trial_until is not None and state.decision is not None
        start = state.trial_until - self.steps - 1
        state.trial_until = None
        tried = state.decision
        before = "fp32" if tried == "1bit" else "1bit"
        # the tried mode's steps after its first one (which builds the compression state or the buckets' fp32 path)
        new = [d for k, (m, d) in self.durations.items() if start < k < start + self.steps + 1 and m == tried]
        # the steps before the switch, DDP's first iteration excluded
        old = [d for k, (m, d) in self.durations.items() if max(1, start - self.steps) <= k < start and m == before]
        if not new or not old:  # e.g. a step that did not reach the optimizer: fall back to timing the buffers
            return decide(state, device, step=start)
        t32, t1 = (median(old), median(new)) if before == "fp32" else (median(new), median(old))
        return decide(state, device, timings=(t32, t1), step=start)
