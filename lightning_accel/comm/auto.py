"""``compression="auto"``: time fp32 and 1-bit averaging of this run, keep the faster.

Compression is extra work (two compressions, three decodes, two collectives instead of one); it pays only when the
link is slow compared with that work. Nothing predicts that well from outside (link speed, CPU or GPU compressor,
overlap with backward, other tenants of the machine), so the run measures it at the end of warm-up (and every
``recheck_every`` steps if asked). Two ways, both collective and decided on rank 0:

**Real steps** (:class:`StepTrial`, what ``OneBitDDPStrategy`` does): the strategy times every training step with a
:class:`StepTiming`, from the start of its forward to the end of its optimizer step. At the end of warm-up it switches
to the other mode for ``1 + steps`` steps (the first builds the compression state and is not timed), then back to the
mode before for ``1 + steps`` more (the first untimed again), and compares the median of the tried mode's ``steps``
with the median of the mode before's ``2 · steps``: the last ``steps`` before the switch (the process's first step
excluded: step 0, DDP's first iteration, or a resumed process's first; a resumed process times ``steps`` steps of its
own before it tries) and the ``steps`` after the switch back. Timing the mode before on both sides of the tried one
cancels a load that drifts during the trial (a cold cache's loader workers decoding on the same cores: on the
end-to-end photo job, 2 CPU processes, one fit timed fp32 at 98 ms before the switch against 66 ms for the 1-bit steps
right after it, where other fits of the job timed fp32 faster than 1-bit). The figures include everything a step does
(compression, the collectives, their overlap with backward, contention for the cores), measured seconds apart on the
same job. What runs between two steps is left out: the wait for the next batch, callbacks, validation and checkpoint
saves do not depend on the mode, and a trial that fell in a data-bound stretch (a cold cache's first epoch) would
otherwise compare the loader's waits.

**Buffers** (:func:`decide`, for the comm hook used without the strategy, and where there are no step times to
compare):

1. Every rank builds buffers of the sizes the compressed stage will use (the trainable parameters in model order, cut
   into groups of ``group_numel`` elements) on the gradients' device.
2. It times an fp32 allreduce of those buffers and the pipelined compressed allreduce of the same buffers (compression
   included, error state untouched; flat or hierarchical, as the state averages), alternating, ``repeats`` rounds
   after one untimed round each; medians.

Either way the per-rank figures are reduced with MAX (the slowest rank sets the pace); rank 0 decides ``"1bit"`` only
if ``onebit_s * (1 + margin) < fp32_s`` and broadcasts the decision with both figures, so every rank switches at the
same step. The margin keeps a near tie on fp32 (a fast link must never be slower than plain DDP): ``MARGIN`` (10 %)
for buffers, whose timing misses DDP's overlap of its allreduce with backward, ``STEP_MARGIN`` (5 %) for real steps.
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
from lightning_accel._utils.clocks import Clock, HostClock
from lightning_accel.comm.allreduce import CompressedAllreduce, CompressFn, run_pipelined
from lightning_accel.comm.compress import GroupLayout
from lightning_accel.comm.state import OneBitState

__all__ = [
    "MARGIN",
    "OVERLAP_MARGIN",
    "STEP_MARGIN",
    "TRIAL_STEPS",
    "Duration",
    "OverlapTrial",
    "StepTiming",
    "StepTrial",
    "decide",
    "measure",
]

log = logging.getLogger("lightning_accel.comm")

#: 1-bit must be at least this much faster (10 %) than fp32 to be chosen: the timing covers communication and
#: compression but not DDP's overlap of its allreduce with backward, which favours fp32 further
MARGIN = 0.1
#: the same for figures from real steps, which include every overlap. 5 %, not less: a trial of a few steps varies by
#: a few percent from fit to fit, and 1-bit is not free in accuracy. Measured on the end-to-end CPU job (2 processes,
#: loopback): one fit in six timed 1-bit 3.8 % faster by chance and took it, then ran its warm epochs 4 % slower than
#: the fp32 fits and reached the target accuracy one epoch later (0.862 against 0.927 after epoch 3, same seed)
STEP_MARGIN = 0.05
#: the serial order must be this much faster than the overlapped one to be kept (:class:`OverlapTrial`): both give
#: bit-identical results, so only the speed decides
OVERLAP_MARGIN = 0.03
#: timed steps per mode in a :class:`StepTrial`
TRIAL_STEPS = 3

#: one step's seconds, or a function that returns them (a CUDA event pair resolves when a decision reads it)
Duration = float | Callable[[], float]


def _seconds(d: Duration) -> float:
    return float(d()) if callable(d) else float(d)


class StepTiming:
    """Times training steps for the trials: from the start of a step's forward to the end of its optimizer step.

    Call :meth:`begin` where a step's work starts and :meth:`end` where it ends, in a ``finally``. Pairs nest and only
    the outermost counts: under automatic optimization the optimizer step runs the training step (forward, backward)
    inside it, under manual optimization the training step runs the optimizer steps. What runs between two steps (the
    wait for the next batch, callbacks, validation, checkpoint saves) is not in any span.

    Args:
        clock: marks the spans' ends (a :class:`~lightning_accel._utils.clocks.HostClock` on the CPU; a
            :class:`~lightning_accel._utils.clocks.CudaEventClock` on CUDA, where a host clock read at the end of a
            step would miss its queued kernels: the span then resolves, waiting for its end event, when read).
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else HostClock()
        self._depth = 0
        self._start: Any = None

    def begin(self) -> None:
        """A step's work starts (marks the clock only when no span is open)."""
        self._depth += 1
        if self._depth == 1:
            self._start = self.clock.mark()

    def end(self) -> Duration | None:
        """The work begun by the matching :meth:`begin` ends: the outermost span's duration, else None."""
        if self._depth == 0:
            return None
        self._depth -= 1
        if self._depth:
            return None
        start, end, clock = self._start, self.clock.mark(), self.clock
        self._start = None
        if isinstance(clock, HostClock):
            return clock.elapsed(start, end)
        return lambda: clock.elapsed(start, end)


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
        (torch.zeros(state.worker_numel(lay), device=device), torch.zeros(lay.chunk_numel, device=device))
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
            state.allreduce_op(x, lay, e[0], e[1], compress=compress)
            for x, lay, e in zip(padded, layouts, errors, strict=True)
        )

        def done(op: CompressedAllreduce) -> None:
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

    Call :meth:`step_started` at the start of every optimizer step, before its backward, on every rank: it starts a
    trial where a decision is due (the other mode for ``1 + steps`` steps, then the mode before for ``1 + steps``:
    ``state.trial_until`` marks the end of each), ends one (collective: every rank reaches the same step) and opens
    the step. Call :meth:`step_ended` with the step's duration (a :class:`StepTiming` span) when it has ended; a step
    that never ends (it raised) is not timed.

    The first step it sees is never a reference step (step 0 is DDP's first iteration; a resumed process's first step
    rebuilds DDP's buckets and warms its caches too). A process that starts past step 0 (a resumed fit) has no step
    times from before: it takes no decision (nor recheck) until it has timed ``steps`` steps of its own after its
    first (``state.decide_from``), so that an undecided trial saved in the checkpoint is run again from real steps of
    this process, not decided on timed buffers; a decided fit keeps its decision meanwhile.
    """

    def __init__(self, steps: int = TRIAL_STEPS) -> None:
        self.steps = check_int("steps", steps, low=1, fix="Use e.g. 3.")
        #: ``{step: (mode, duration)}`` of the recent steps
        self.durations: dict[int, tuple[str, Duration]] = {}
        self._open: tuple[int, str] | None = None
        #: the running trial's first step and the mode it tries; the step it went back to the mode before (or None)
        self._trial: tuple[int, str] | None = None
        self._back: int | None = None
        #: the first step this trial saw (0, or the first step of a resumed process); None before
        self.first: int | None = None

    @staticmethod
    def _mode(state: OneBitState) -> str:
        return "1bit" if state.compressing else "fp32"

    def step_started(self, state: OneBitState, device: torch.device) -> str | None:
        """Book-keeping at the start of step ``state.step``; returns the decision when one was made now."""
        if self.first is None:
            self.first = state.step
            if state.step > 0:  # resumed: the steps before the checkpoint were timed by another process
                state.decide_from = state.step + 1 + self.steps
        for k in [k for k in self.durations if k < state.step - 4 * self.steps - 4]:  # the last trial's 3 phases
            del self.durations[k]
        decision = None
        if state.trial_until is not None and state.step >= state.trial_until:
            if self._trial is not None and self._back is None:  # the tried steps are done: the mode before, again
                self._back = state.step
                state.set_decision("fp32" if self._trial[1] == "1bit" else "1bit")
                state.trial_until = state.step + self.steps + 1
            else:
                decision = self._finish(state, device)
        elif state.needs_decision:  # (never during a trial)
            if state.measure_fn is not None:  # injected figures: decide now, no trial
                decision = decide(state, device)
            else:  # try the other mode
                tried = "1bit" if state.decision in (None, "fp32") else "fp32"
                state.set_decision(tried)
                state.trial_until = state.step + self.steps + 1
                self._trial, self._back = (state.step, tried), None
        self._open = (state.step, self._mode(state))
        return decision

    def step_ended(self, duration: Duration) -> None:
        """The step opened by the last :meth:`step_started` ended after ``duration`` (seconds, or a function of none
        that returns them)."""
        if self._open is not None:
            step, mode = self._open
            self.durations[step] = (mode, duration)
        self._open = None

    def _finish(self, state: OneBitState, device: torch.device) -> str:
        assert state.trial_until is not None and state.decision is not None
        if self._trial is not None:
            start, tried = self._trial
        else:  # a trial this object did not start (a state handed over mid-trial): the tried steps only
            start, tried = state.trial_until - self.steps - 1, state.decision
        back, self._trial, self._back = self._back, None, None
        state.trial_until = None
        before = "fp32" if tried == "1bit" else "1bit"

        def timed(low: int, high: int, mode: str) -> list[Duration]:  # steps low..high in ``mode``
            return [d for k, (m, d) in self.durations.items() if low <= k <= high and m == mode]

        # the tried mode's steps after its first one (which builds the compression state or the buckets' fp32 path)
        new = timed(start + 1, start + self.steps, tried)
        # the mode before: the steps before the switch (this process's first one excluded: DDP's first iteration, or
        # a resumed one's) and, after the tried steps, those after the first one back; a load that drifts during
        # the trial (a cold cache's loader workers on the same cores) then weighs on both modes alike
        old = timed(max((self.first or 0) + 1, start - self.steps), start - 1, before)
        if back is not None:
            old += timed(back + 1, back + self.steps, before)
        if not new or not old:  # e.g. a step that did not reach the optimizer: fall back to timing the buffers
            return decide(state, device, step=start)
        new_s, old_s = median(_seconds(d) for d in new), median(_seconds(d) for d in old)
        t32, t1 = (old_s, new_s) if before == "fp32" else (new_s, old_s)
        return decide(state, device, timings=(t32, t1), step=start)


class OverlapTrial:
    """``overlap="auto"`` by measurement: time compressed steps started during backward against ones started after
    it, keep the faster (driven by the strategy, once per fit, where overlapping is safe).

    Starting each group's compressed momentum during backward hides its transfer behind the rest of backward, but on
    a core that also runs backward the compression competes with it (measured: the overlapping step 1.25x the serial
    one on a 1 Gbit/s link), so neither order wins everywhere. Both compute bit-identical results, so the order may
    change between any two steps. From the first compressed step on: that step (it builds the compression state) and
    ``steps`` more run overlapped, then one step and ``steps`` more serial; the medians of the timed ``steps`` of each
    (the first of each block untimed) are reduced with MAX over the group (identical figures on every rank, so every
    rank takes the same decision without a broadcast) and the serial order is kept only when faster by
    ``OVERLAP_MARGIN`` (3 %).

    Call :meth:`step_started` at the start of every optimizer step on every rank (it returns whether that step
    overlaps) and :meth:`step_ended` with its duration (a :class:`StepTiming` span) once it has ended.

    Attributes:
        decision: ``{"step", "overlap_s", "serial_s", "overlap"}`` once decided, else None.
    """

    def __init__(self, steps: int = TRIAL_STEPS) -> None:
        self.steps = check_int("steps", steps, low=1, fix="Use e.g. 3.")
        self.decision: dict[str, Any] | None = None
        self._first: int | None = None  # the first compressed step
        self._times: dict[bool, list[Duration]] = {True: [], False: []}
        self._open: bool | None = None  # the order of the step being timed

    def step_started(
        self,
        step: int,
        compressing: bool,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timed: bool = True,
    ) -> bool:
        """Book-keeping at the start of optimizer step ``step``; returns whether it overlaps. Collective at the step
        that decides (every rank reaches the same step). ``timed=False``: a compressed-stage step that is not a
        compressed one (a variance refresh) takes its place in the blocks but is not timed."""
        self._open = None
        if self.decision is not None:
            return bool(self.decision["overlap"])
        if not compressing:  # fp32 steps (warm-up, a compression trial, fp32 decided): nothing to time yet
            self._first = None
            self._times = {True: [], False: []}
            return True
        if self._first is None:
            self._first = step
        age = step - self._first
        if age >= 2 * (self.steps + 1):
            return self._decide(step, group, device)
        overlapped = age <= self.steps
        if timed and age not in (0, self.steps + 1):  # the blocks' first steps are not timed
            self._open = overlapped
        return overlapped

    def step_ended(self, duration: Duration) -> None:
        """The step opened by the last :meth:`step_started` ended after ``duration`` (seconds, or a function of none
        that returns them)."""
        if self._open is not None:
            self._times[self._open].append(duration)
        self._open = None

    def _decide(self, step: int, group: dist.ProcessGroup | None, device: torch.device) -> bool:
        t = torch.tensor(
            [median(_seconds(d) for d in self._times[flag]) if self._times[flag] else 0.0 for flag in (True, False)],
            dtype=torch.float64,
            device=device,
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        over, serial = float(t[0]), float(t[1])
        keep_overlap = not (serial > 0 and serial * (1 + OVERLAP_MARGIN) < over)
        self.decision = {"step": step, "overlap_s": over, "serial_s": serial, "overlap": keep_overlap}
        return keep_overlap
