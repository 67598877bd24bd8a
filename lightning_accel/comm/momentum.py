"""Compressed momentum: the optimizer step of the compressed stage for SGD with momentum, Adam and AdamW.

Compressing *gradients* with error feedback is proven for plain SGD only: the residual error feedback carries comes
back later, and momentum (a ``1/(1-β)`` gain) or Adam's per-element normalisation amplify its timing noise (SGD
momentum and AdamW lose accuracy that way; ``docs/onebit.md`` gives the figures of ``benchmarks/onebit.py``'s
recipes). DeepSpeed's 1-bit Adam compresses the optimizer's *momentum* instead, with Adam's variance frozen at the
end of warm-up; this module does the same for ``torch.optim.SGD`` (momentum > 0, Nesterov too), ``torch.optim.Adam``
and ``torch.optim.AdamW``.

Algorithm of one compressed step (``t`` counts optimizer steps; the gradients ``g`` are this rank's own: the comm
hook does not average them in the compressed stage, so DDP's gradient allreduce does not run):

1. The local gradient is final: gradient accumulation summed it, the AMP ``GradScaler`` unscaled it (and skipped
   the whole step, before anything below, if any rank's gradient held Inf/NaN: the hook makes that verdict global),
   gradient clipping clipped it (the *local* gradient, by its local norm).
2. Per parameter, the local momentum: SGD ``d = g + wd·p``, ``m_loc = μ·m + (1-dampening)·d`` (``m_loc = d`` for a
   parameter without a momentum buffer yet, as torch does); Adam ``d = g (+ wd·p for Adam's L2 decay)``,
   ``m_loc = β1·m + (1-β1)·d``. ``m`` is the *averaged* momentum of the previous step, identical on every rank.
3. Adam/AdamW only: the variance is frozen at the first compressed step ``T`` (never updated again: ``v`` needs the
   exact gradient, which is never averaged here) and what is compressed is the *preconditioned* momentum
   ``u_loc = m_loc / D`` with ``D = sqrt(v/(1-β2^T)) + eps``. ``D`` is identical on every rank, so averaging ``u`` is
   averaging ``m``; but ``u``'s elements are all O(1), where ``m`` spans the range of ``sqrt(v)``. A block of raw
   ``m`` decodes every element to ``±mean|m|``, and an element with a tiny variance then steps by
   ``lr·mean|m|/eps`` (AdamW on the digits CNN diverges that way; ``benchmarks/onebit.py``'s AdamW recipes train
   with this scheme).
4. The parameters are cut into groups of about ``group_numel`` elements (model order); each group's ``m_loc`` (Adam:
   ``u_loc``) is laid out canonically and averaged by the two-phase 1-bit allreduce with worker and server error
   feedback (:class:`~lightning_accel.comm.allreduce.OneBitAllreduce`; across nodes of several processes,
   :class:`~lightning_accel.comm.allreduce.HierarchicalOneBitAllreduce`). Groups are pipelined: phase 1 of group
   ``k+1`` and phase 2 of group ``k`` are in flight while the next group is compressed and group ``k-1`` is applied.
   With overlap (:meth:`MomentumCompressor.on_bucket`, called by the comm hook for each bucket) steps 2-4 of a group
   run as soon as backward has produced all of its gradients, so its transfers overlap the rest of backward; step 1
   must then hold for each bucket as DDP hands it over (no clipping, no GradScaler, no edits after backward).
   A group whose decoded average is not finite changes nothing (momentum, variance, step count, error state and
   parameters keep their values); the decoded bytes are the same everywhere, so every rank agrees.
5. ``m ← m̄``, the decoded average (Adam: ``m̄ = ū·D``), bit-identical on every rank, and the parameter update:
   SGD ``p -= lr·m̄``, Nesterov ``p -= lr·((1+μ)·m̄ - μ·m_prev)`` (torch's ``d + μ·m̄`` with the averaged ``d``
   written as ``m̄ - μ·m_prev``); Adam ``p -= lr/(1-β1^t) · ū`` (= torch's ``m̄ / D``), AdamW first decaying
   ``p *= 1 - lr·wd``. The bias correction of ``m̄`` continues with ``t`` (it is still an EMA that keeps being
   updated); that of ``v`` stays at ``T`` (``v/(1-β2^T)`` is the bias-corrected estimate at the freeze, frozen as a
   whole). A parameter that no warm-up step reached has no variance to freeze and uses ``D = 1``; the floor
   ``|m̂/D| <= 1`` then caps each of its elements' steps at ``lr`` (where Adam's first steps are about ``lr`` too).

Every quantity stays in the optimizer's own state (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq`` with ``amsgrad``, ``step``), so a checkpoint holds it, and the unmodified optimizer can take over
again (``compression="auto"`` going back to fp32) from consistent values. The freeze step is kept per parameter as
``state["onebit_freeze_step"]``, with the stage that froze it (``state["onebit_stage"]``: the step the stage began).
A stage this process begins drops the marks the optimizer held before (an earlier stage's, perhaps of a run whose
1-bit state was not restored and whose stage began at the same step number), so every new stage freezes the variance
at its own start; a stage restored from a checkpoint keeps them. Each group's hyper-parameters (lr, momentum, betas,
weight decay) are read at every step, so parameter groups and LR schedulers work as with the plain optimizer.

Variance refreshes (Adam/AdamW, ``variance_refresh=R``): a variance frozen once goes stale as the gradients shrink
(every later step too small; on a character GPT at 4 processes that cost most of a +3.2 % loss gap against DDP,
``docs/onebit.md``). At ``R, 3R, 7R, ...`` steps into the compressed stage one step averages the gradients in fp32 and
:meth:`MomentumCompressor.refresh_step` takes the exact Adam step, the variance catching up on the skipped steps, then
freezes it again there and rescales the error-feedback residuals (units of ``m / D``) to the new ``D``. Doubling
intervals keep the fp32 steps to ``log2`` of the stage's length. 0/1 Adam's fully adaptive policy (local steps between
variance updates) changes *when* ranks synchronise and couples to the learning-rate schedule; this schedule is a
function of saved counters, so a resumed run refreshes at the same steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

from lightning_accel.comm.allreduce import CompressedAllreduce, fp32_ring_bytes, run_pipelined
from lightning_accel.comm.compress import compress_fast
from lightning_accel.comm.state import GroupState, OneBitState

__all__ = ["MomentumCompressor", "momentum_kind", "plan_groups"]


def momentum_kind(optimizer: Optimizer) -> str | None:
    """``"sgd"`` (SGD with momentum > 0 in some group), ``"adam"`` (Adam or AdamW), or None (not supported).

    Exact types only: a subclass may override ``step`` with other math.
    """
    t = type(optimizer)
    if t is SGD and any(float(g.get("momentum", 0.0)) > 0 for g in optimizer.param_groups):
        return "sgd"
    if t in (Adam, AdamW):
        return "adam"
    return None


def plan_groups(indexed_numels: Iterable[tuple[int, int]], group_numel: int) -> list[tuple[int, ...]]:
    """Cut ``(index, numel)`` pairs (sorted by index) into consecutive groups of at most ``group_numel`` elements
    (a larger parameter is a group of its own)."""
    out: list[tuple[int, ...]] = []
    cur: list[int] = []
    size = 0
    for i, n in sorted(indexed_numels):
        if cur and size + n > group_numel:
            out.append(tuple(cur))
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(tuple(cur))
    return out


def _foreign(p: torch.Tensor) -> ValueError:
    """The error for a tensor the optimizer trains that is not a parameter of the DDP model."""
    return ValueError(
        f"`optimizer` trains a tensor of shape {tuple(p.shape)} that is not a parameter of the DDP model: compressed "
        "momentum averages and updates only the model's parameters. Register it in the LightningModule (an "
        "`nn.Parameter` attribute), or use `compressed_signal='gradients'` (the optimizer's own step; such a tensor "
        "is not averaged, as with DDP)."
    )


class _Entry:
    """One parameter in a compressed step: where it sits, its hyper-parameters, its optimizer state."""

    __slots__ = ("grad", "hp", "n", "offset", "p", "st")

    def __init__(self, p: torch.Tensor, hp: dict[str, Any], st: dict[str, Any], offset: int) -> None:
        self.p = p
        self.hp = hp
        self.st = st
        self.n = p.numel()
        self.offset = offset
        # the local gradient of this step: ``p.grad``, or the DDP bucket's view of it when the step was started
        # during backward (the same values: DDP copies the bucket into ``p.grad`` unchanged)
        self.grad: torch.Tensor | None = p.grad


class _Started:
    """The groups of one compressed step started during backward (:meth:`MomentumCompressor.on_bucket`)."""

    __slots__ = ("entries_of", "entry_of", "key_of", "missing", "plan", "served", "started", "step")

    def __init__(self, plan: list[tuple[tuple[int, ...], list[_Entry]]], step: int) -> None:
        self.plan = plan
        self.step = step  # the hook's step counter during this backward
        self.key_of = {i: key for key, _ in plan for i in key}
        self.entries_of = dict(plan)
        self.entry_of = {i: e for key, entries in plan for i, e in zip(key, entries, strict=True)}
        self.missing = {key: set(key) for key, _ in plan}
        self.started: list[tuple[CompressedAllreduce, GroupState, list[_Entry]]] = []
        self.served = 0

    @property
    def complete(self) -> bool:
        return len(self.started) == len(self.plan)


class MomentumCompressor:
    """The compressed stage of one optimizer (see the module docstring for the algorithm).

    Args:
        optimizer: a ``torch.optim.SGD`` (with momentum, normally), ``Adam`` or ``AdamW``.
        state: the :class:`~lightning_accel.comm.state.OneBitState` shared with the comm hook (process group, block
            size, error feedback, backend, parameter numbering, error buffers, statistics).

    Raises:
        ValueError: an unsupported optimizer; a trained tensor that is not among the parameters ``state`` numbers
            (the model's) is refused by :meth:`check_parameters` and, at the latest, by the first compressed step.
    """

    def __init__(self, optimizer: Optimizer, state: OneBitState) -> None:
        # plain SGD too when asked for explicitly (compressed_signal="momentum"): its "momentum" is the gradient itself
        kind = momentum_kind(optimizer) or ("sgd" if type(optimizer) is SGD else None)
        if kind is None:
            raise ValueError(
                f"`optimizer` is a {type(optimizer).__name__}: compressed momentum supports torch.optim.SGD with "
                "momentum > 0, Adam and AdamW. Use `compressed_signal='gradients'` for other optimizers."
            )
        self.optimizer = optimizer
        self.kind = kind
        self.state = state
        self._denoms: dict[int, tuple[int, torch.Tensor]] = {}
        self._early: _Started | None = None
        #: the ``state.stage_token`` of the stage whose start dropped this optimizer's older freeze marks
        self._entered: object | None = None

    def check_parameters(self, parameters: Iterable[torch.Tensor]) -> None:
        """Refuse an optimizer that trains a tensor outside ``parameters`` (the DDP model's): the compressed step
        averages and updates only those, and would otherwise find it at its first step, after the whole warm-up.
        Frozen tensors (``requires_grad=False``) never get a gradient, so they are not checked. Call it when the fit
        sets up, with the wrapped model's parameters (``state`` may number them only as its hook first sees them);
        the verdict is the same on every rank (the same model and optimizer everywhere).

        Raises:
            ValueError: a trained tensor of the optimizer is not a parameter of the model (one line, with the fix).
        """
        known = {id(p) for p in parameters}
        for hp in self.optimizer.param_groups:
            for p in hp["params"]:
                if p.requires_grad and p.numel() > 0 and id(p) not in known:
                    raise _foreign(p)

    # ------------------------------------------------------------------ the step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Drop-in for ``optimizer.step`` in the compressed stage: run ``closure`` (if any), then one compressed
        step. Collective: every rank must call it at the same step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.compressed_step()
        return loss

    @torch.no_grad()
    def compressed_step(self) -> None:
        """Steps 2-5 of the algorithm on the gradients now in ``p.grad``; groups that :meth:`on_bucket` started
        during backward are finished instead of started again."""
        st = self.state
        t0 = time.perf_counter()
        self._begin_stage(st.step - 1 if st.step > 0 else 0)  # the hook counted this step's backward
        groups = self._groups()
        early, self._early = self._early, None
        if early is not None and not (early.complete and [k for k, _ in early.plan] == [k for k, _ in groups]):
            # the backward left other gradients than planned (a parameter without one): redo the step from p.grad
            self._discard(early)
            early = None
        sent = [0]
        if early is not None:
            for op, _g, _entries in early.started[early.served :]:
                op.serve()
            for op, g, entries in early.started:
                sent[0] += self._apply(g, entries, op)
        else:
            meta: dict[int, tuple[GroupState, list[_Entry]]] = {}

            def ops() -> Iterator[CompressedAllreduce]:
                for key, entries in groups:
                    op, g = self._start(key, entries)
                    meta[id(op)] = (g, entries)
                    yield op

            def apply(op: CompressedAllreduce) -> None:
                g, entries = meta.pop(id(op))
                sent[0] += self._apply(g, entries, op)

            run_pipelined(ops(), apply)
        fp32 = 0
        for _key, entries in groups:
            fp32 += fp32_ring_bytes(sum(e.n for e in entries), st.process_group_size())
        stats = st.stats
        stats.bytes_sent += sent[0]
        stats.fp32_bytes += fp32
        # the hook sent nothing in this step's backward (beyond the 4-byte finiteness flag under a GradScaler)
        last = stats.last_step
        last.sent += sent[0]
        last.fp32 = fp32
        last.compressed_sent = sent[0]
        last.compressed_fp32 = fp32
        stats.last_step_comm_s += time.perf_counter() - t0

    @torch.no_grad()
    def refresh_step(self) -> None:
        """Adam/AdamW, a variance-refresh step of the compressed stage (``state.refreshing``: the hook averaged this
        step's gradients in fp32): the exact Adam step on the averaged gradient, whose variance catches up on the
        ``k`` steps since it was frozen (``v <- β2^k·v + (1-β2^k)·g²``: the EMA's weight of those steps, given to the
        gradient that stands for them; bias correction ``1-β2^t`` stays exact), then the variance is frozen again
        here. The error-feedback residuals are in units of ``m / D``: each is rescaled by ``D_old / D_new`` so it
        still stands for the same momentum. Collective-free; identical on every rank (same averaged gradients)."""
        if self.kind != "adam":
            raise RuntimeError("refresh_step is for Adam/AdamW: SGD has no variance to refresh.")
        st = self.state
        self._enter_stage()
        for key, entries in self._groups():
            ratios = []
            for e in entries:
                old = self._prepare_adam(e)  # advances the step count, as the compressed step would
                ratios.append((e, old / self._exact_adam(e)))
            g = st.groups.get(key)
            if g is None and key in st.pending:
                # a resumed fit whose first step is a refresh: the checkpoint's error state is not adopted yet (the
                # compressed step adopts it), and left as it is it would not be rescaled as the uninterrupted run's was
                g = self._group_state(key, entries)
            if g is None or not st.config.error_feedback:
                continue
            ratio = torch.ones(g.layout.padded_numel, dtype=torch.float32, device=g.layout.device)
            for e, r in ratios:
                ratio[e.offset : e.offset + e.n] = r.reshape(-1)
            worker, server = st.owned_slices(g.layout)
            g.worker_error.mul_(ratio[worker])
            g.server_error.mul_(ratio[server])

    def _exact_adam(self, e: _Entry) -> torch.Tensor:
        """torch's Adam/AdamW update on ``p.grad`` (averaged), the variance catching up on the frozen steps, which
        freezes the variance again at this step; returns the new denominator (the one the update used)."""
        hp, p, s = e.hp, e.p, e.st
        assert e.grad is not None
        grad = e.grad.float()
        if hp.get("maximize", False):
            grad = -grad
        lr, wd = float(hp["lr"]), float(hp["weight_decay"])
        beta1, beta2 = (float(b) for b in hp["betas"])
        t = int(s["step"])
        k = t - int(s["onebit_freeze_step"])  # the steps the variance skipped, this one included
        keep = beta2**k
        if wd and not self._decoupled(hp):
            grad = grad.add(p, alpha=wd)
        s["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        s["exp_avg_sq"].mul_(keep).addcmul_(grad, grad, value=1 - keep)
        if hp.get("amsgrad", False):
            torch.maximum(s["max_exp_avg_sq"], s["exp_avg_sq"], out=s["max_exp_avg_sq"])
        s["onebit_freeze_step"] = t
        denom = self._prepare_denom(e)  # sqrt(v/(1-β2^t)) + eps: the exact step's denominator, frozen from here
        if wd and self._decoupled(hp):
            p.mul_(1 - lr * wd)
        p.addcdiv_(s["exp_avg"].to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1**t))
        return denom

    @torch.no_grad()
    def on_bucket(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Called by the comm hook with a DDP bucket's parameters and final local gradients during backward (the
        compressed stage, when the strategy allows overlap): every group whose gradients are now all final is
        compressed and its phase 1 issued, and the group started before it is served (its phase 2 issued), so the
        transfers run while backward computes the rest. :meth:`compressed_step` finishes them.

        Buckets arrive in the same order on every rank, so the collectives are issued in the same order everywhere.
        """
        st = self.state
        t0 = time.perf_counter()
        early = self._early
        if early is not None and early.step != st.step:  # an earlier backward whose optimizer step never ran
            self._discard(early)
            early = None
        if early is None:
            self._begin_stage(st.step)  # during the backward of step `st.step`
            early = self._early = _Started(self._groups(planned=True), st.step)
        index = st.param_index
        ready: list[tuple[int, ...]] = []
        for p, grad in zip(params, grads, strict=True):
            i = index.get(id(p))
            key = early.key_of.get(i) if i is not None else None
            if key is None or i is None:  # not in this optimizer
                continue
            early.entry_of[i].grad = grad
            missing = early.missing[key]
            missing.discard(i)
            if not missing:
                ready.append(key)
        for key in ready:
            entries = early.entries_of[key]
            op, g = self._start(key, entries)
            op.start()
            early.started.append((op, g, entries))
            if len(early.started) >= 2:  # pipeline: phase 2 of the previous group while this one's phase 1 flies
                early.started[early.served][0].serve()
                early.served += 1
        st.stats.last_step_comm_s += time.perf_counter() - t0

    def release(self) -> None:
        """Drop the frozen denominators and the state's kept buffers (canonical momentum, compressors, decode
        outputs: several copies of the model's size), e.g. once ``compression="auto"`` went back to fp32; the next
        compressed step makes them again."""
        self.state.kept.clear()
        self._denoms.clear()

    def parameters_replaced(self) -> None:
        """Forget what this compressor keeps per parameter object, after the model's parameters were replaced mid-fit
        (the optimizer re-pointed to new tensors, the state re-numbered by
        :meth:`~lightning_accel.comm.state.OneBitState.replace_parameters`): the frozen denominators (keyed by the old
        tensors' ids, which new tensors may reuse, with other shapes) and the kept buffers are made again from the
        optimizer's state at the next step. The freeze marks live in that state and are kept: the compressed stage and
        its frozen variance continue. A step started during a backward that never reached its optimizer step (not the
        case between two training steps) is completed and dropped first, on every rank alike."""
        early, self._early = self._early, None
        if early is not None:
            self._discard(early)
        self.release()

    def _begin_stage(self, step: int) -> None:
        self.state.begin_stage(step)
        self._enter_stage()

    def _enter_stage(self) -> None:
        """At this optimizer's first step of a stage this process began: drop the freeze marks it holds. They predate
        the stage (an earlier one's, maybe of a run restored without its 1-bit state, whose stage began at the same
        step number and would pass for this one), so each parameter freezes its variance at this stage's start. Every
        rank alike: the stage begins at the same step everywhere."""
        token = self.state.stage_token
        if token is None or token is self._entered:
            return
        self._entered = token
        for s in self.optimizer.state.values():
            s.pop("onebit_stage", None)
            s.pop("onebit_freeze_step", None)
        self._denoms.clear()

    def _start(self, key: tuple[int, ...], entries: list[_Entry]) -> tuple[CompressedAllreduce, GroupState]:
        """Step 2 for one group and its (not yet started) compressed allreduce."""
        st = self.state
        g = self._group_state(key, entries)
        compress = st.compressor(g.layout.device)
        # a group is in flight at most once per step, and applied before the next step starts it: its kept buffers
        # (the same bits as fresh outputs) are free again by then
        x, buffers = st.buffers_for(g, fast=compress is compress_fast)
        self._local_momentum(x, entries)
        op = st.allreduce_op(
            x,
            g.layout,
            g.worker_error if st.config.error_feedback else None,
            g.server_error if st.config.error_feedback else None,
            compress=compress,
            buffers=buffers,
        )
        return op, g

    def _discard(self, early: _Started) -> None:
        """Complete the collectives of groups started during a backward and drop their results (no state changes):
        every rank discards the same groups, because the verdict depends only on which parameters have gradients."""
        for op, _g, _entries in early.started[early.served :]:
            op.serve()
        for op, _g, entries in early.started:
            op.finish()
            if self.kind == "adam":  # undo the step count _prepare_adam advanced
                for e in entries:
                    e.st["step"] -= 1

    def _groups(self, planned: bool = False) -> list[tuple[tuple[int, ...], list[_Entry]]]:
        """The step's groups of the parameters that have a gradient (``planned``: of those that will have one, the
        trainable ones, before backward produced any)."""
        st = self.state
        index = st.param_index
        by_index: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        for hp in self.optimizer.param_groups:
            for p in hp["params"]:
                # frozen, or unused on every rank (DDP's verdict is global): torch skips it too
                if (not p.requires_grad) if planned else (p.grad is None):
                    continue
                if p.numel() == 0:  # nothing to average or update (and a group layout needs elements)
                    continue
                i = index.get(id(p))
                if i is None:
                    raise _foreign(p)
                by_index[i] = (p, hp)
        keys = plan_groups(((i, p.numel()) for i, (p, _) in by_index.items()), st.config.group_numel)
        out = []
        for key in keys:
            entries, pos = [], 0
            for i in key:
                p, hp = by_index[i]
                entries.append(_Entry(p, hp, self.optimizer.state[p], pos))
                pos += -(-p.numel() // 8) * 8
            out.append((key, entries))
        return out

    def _group_state(self, key: tuple[int, ...], entries: list[_Entry]) -> GroupState:
        st = self.state
        g = st.groups.get(key)
        if g is not None:
            return g
        g, _ = st.new_group(key, [e.n for e in entries], entries[0].p.device)  # state that no longer fits: reset
        # a group that no longer exists (a parameter stopped or started receiving gradients) is dropped: its error
        # belonged to another layout. So is one a checkpoint left in `pending` (not adopted yet): the run that saved
        # it drops it here too, and adopted later (when its parameters have gradients again) it would bring back an
        # error the uninterrupted run no longer has
        for k in [k for k in (*st.groups, *st.pending) if not set(k).isdisjoint(key)]:
            st.groups.pop(k, None)
            st.pending.pop(k, None)
        st.groups[key] = g
        return g

    def _local_momentum(self, x: torch.Tensor, entries: list[_Entry]) -> None:
        """Step 2 into the group's canonical buffer ``x`` (kept between steps; zeros on padding)."""
        for e in entries:
            hp, p = e.hp, e.p
            out = x[e.offset : e.offset + e.n].view_as(p)
            assert e.grad is not None  # _groups() kept only parameters with a gradient, on_bucket set the others
            grad = e.grad.float()
            if hp.get("maximize", False):
                grad = -grad
            if self.kind == "sgd":
                mu, damp, wd = float(hp["momentum"]), float(hp.get("dampening", 0.0)), float(hp["weight_decay"])
                d = grad.add(p, alpha=wd) if wd else grad
                buf = e.st.get("momentum_buffer")
                if mu == 0 or buf is None:
                    out.copy_(d)
                else:
                    torch.mul(buf, mu, out=out)
                    out.add_(d, alpha=1 - damp)
            else:
                beta1 = float(hp["betas"][0])
                wd = float(hp["weight_decay"])
                d = grad.add(p, alpha=wd) if wd and not self._decoupled(hp) else grad
                denom = self._prepare_adam(e)
                torch.mul(e.st["exp_avg"], beta1, out=out)
                out.add_(d, alpha=1 - beta1)
                # compress the preconditioned momentum m / denom (denom is frozen and identical on every rank, so
                # averaging it is averaging m): its elements are all O(1), where m itself spans the range of
                # sqrt(v). A block of raw m decodes every element to ±mean|m|, and an element with a tiny variance
                # (a weight whose input is always zero) would then step by lr·mean|m|/eps: AdamW on the digits CNN
                # diverges that way (benchmarks/onebit.py's AdamW recipes train with this scheme)
                out.div_(denom)
                # the frozen variance cannot see a gradient that outgrows it (a ReLU channel dead during warm-up
                # has v = 0, so D = eps): floor D at the momentum's own magnitude, |m̂/D| <= 1 (in bias-corrected
                # units), the step exact Adam takes for a gradient at its RMS. Without the floor, AdamW on the digits
                # CNN takes a step of order 1 at its first compressed step and diverges (benchmarks/onebit.py's
                # AdamW recipes train with the floor)
                bound = 1 - beta1 ** int(e.st["step"])
                out.clamp_(-bound, bound)

    def _decoupled(self, hp: dict[str, Any]) -> bool:
        return type(self.optimizer) is AdamW or bool(hp.get("decoupled_weight_decay", False))

    def _apply(self, g: GroupState, entries: list[_Entry], op: CompressedAllreduce) -> int:
        """Steps 4-5 for one group; returns the bytes it sent."""
        st = self.state
        res = op.finish()
        if not bool(res.finite):  # identical verdict on every rank: the decoded bytes are the same
            st.stats.nonfinite_groups += 1
            if self.kind == "adam":  # undo the step count _prepare_adam advanced: this step did not happen
                for e in entries:
                    e.st["step"] -= 1
            return res.bytes_sent
        g.commit(res.worker_error, res.server_error, op.buffers)
        st.stats.compressed_calls += 1
        st.stats.intra_bytes += res.intra_bytes
        for e in entries:
            avg = res.out[e.offset : e.offset + e.n].view_as(e.p)
            if self.kind == "sgd":
                self._apply_sgd(e, avg)
            else:
                self._apply_adam(e, avg)
        return res.bytes_sent

    def _apply_sgd(self, e: _Entry, avg: torch.Tensor) -> None:
        hp, p = e.hp, e.p
        mu, lr = float(hp["momentum"]), float(hp["lr"])
        if mu == 0:
            p.add_(avg.to(p.dtype), alpha=-lr)
            return
        buf = e.st.get("momentum_buffer")
        if hp.get("nesterov", False):
            # torch: d + μ·m_new, with the averaged d = m_new - μ·m_prev  =>  (1+μ)·m_new - μ·m_prev
            update = avg * (1 + mu)
            if buf is not None:
                update.add_(buf, alpha=-mu)
        else:
            update = avg
        if buf is None:
            e.st["momentum_buffer"] = avg.to(p.dtype).clone()
        else:
            buf.copy_(avg)
        p.add_(update.to(p.dtype), alpha=-lr)

    def _prepare_adam(self, e: _Entry) -> torch.Tensor:
        """Adam state for this step: created if missing, ``step`` advanced, the variance frozen at the first step of
        a compressed stage; returns ``sqrt(v/(1-β2^T)) + eps`` (cached: it never changes within a stage)."""
        hp, p, s = e.hp, e.p, e.st
        if "exp_avg" not in s:  # first seen in the compressed stage: no warm-up statistics
            s["step"] = torch.tensor(0.0)
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if hp.get("amsgrad", False):
                s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        s["step"] += 1
        since = self.state.compressed_since
        if s.get("onebit_stage") != since:  # this compressed stage freezes the variance here
            s["onebit_stage"] = since
            s["onebit_freeze_step"] = int(s["step"]) - 1
            self._denoms.pop(id(p), None)
        return self._prepare_denom(e)

    def _prepare_denom(self, e: _Entry) -> torch.Tensor:
        """``sqrt(v/(1-β2^T)) + eps`` at the parameter's freeze step ``T`` (cached until ``T`` changes)."""
        hp, p, s = e.hp, e.p, e.st
        freeze = int(s["onebit_freeze_step"])
        cached = self._denoms.get(id(p))
        if cached is not None and cached[0] == freeze:
            return cached[1]
        v = s["max_exp_avg_sq"] if hp.get("amsgrad", False) else s["exp_avg_sq"]
        if freeze == 0:
            # no warm-up step ever reached this parameter, so there is no variance to freeze: it steps with its
            # bias-corrected momentum unnormalised (denominator 1) rather than by m / eps
            denom = torch.ones_like(p, dtype=torch.float32)
        else:
            denom = (v.float().sqrt() / math.sqrt(1 - float(hp["betas"][1]) ** freeze)).add_(float(hp["eps"]))
        self._denoms[id(p)] = (freeze, denom)
        return denom

    def _apply_adam(self, e: _Entry, avg: torch.Tensor) -> None:
        """``avg`` is the averaged preconditioned momentum ``m̄ / denom``."""
        hp, p, s = e.hp, e.p, e.st
        lr, wd = float(hp["lr"]), float(hp["weight_decay"])
        beta1 = float(hp["betas"][0])
        t = int(s["step"])
        denom = self._denoms[id(p)][1]
        torch.mul(avg, denom, out=s["exp_avg"])
        if wd and self._decoupled(hp):
            p.mul_(1 - lr * wd)
        # torch's p -= lr/(1-β1^t) · m̄/denom, with m̄/denom = avg exactly
        p.add_(avg.to(p.dtype), alpha=-lr / (1 - beta1**t))
