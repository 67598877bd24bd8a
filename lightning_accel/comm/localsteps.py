"""Local steps with a compressed outer update (DiLoCo, Streaming DiLoCo): the plain-torch core.

Every rank runs the user's optimizer on its own gradients (nothing is averaged per step). Every ``sync_every`` (``H``)
inner steps each *fragment* (a contiguous group of parameters in model order) is synchronised:

1. pseudo-gradient ``Δ_r = θ_global − θ_local,r`` (``θ_global``: the fragment's shared parameters after the last
   outer step, identical on every rank);
2. ``Δ = mean_r Δ_r`` through the comm room's two-phase 1-bit allreduce with worker and server error feedback
   (:class:`~lightning_accel.comm.OneBitAllreduce`; ``compression="fp32"``: a plain allreduce);
3. outer step, SGD with Nesterov momentum: ``m ← μ m + Δ``, ``θ_global ← θ_global − lr (Δ + μ m)`` (``m`` without
   Nesterov). DiLoCo's values are ``lr=0.7``, ``μ=0.9``; the defaults ``lr=1``, ``μ=0`` average the ranks'
   parameters (local SGD), which held the loss better in the short fits measured here;
4. every rank adopts ``θ_global``. With ``overlap_steps = τ > 0`` the exchange is issued at step ``t`` and applied at
   step ``t + τ``: the inner steps in between keep their progress, ``θ_local ← θ_local + (θ_global,new − θ_sent)``
   (``θ_sent``: the local parameters the pseudo-gradient was taken from), so no step waits for the wire.

Fragments sync in turn (Streaming DiLoCo): fragment ``f`` of ``F`` is sent at the steps ``t`` with
``t − S ≡ ⌊(f+1) H / F⌋ (mod H)`` (``S``: the ``sync_start`` steps of a synchronous start, 0 by default), so each
exchange carries ``1/F`` of the model and the exchanges spread over the ``H`` steps. With ``F = 1`` and ``τ = 0`` this
is DiLoCo.

Bytes per rank and sync of a fragment of ``d`` elements: ``2 (N-1)/N · d/8`` (+ scales) with 1-bit, ``2 (N-1)/N · 4d``
with fp32; per inner step that is divided by ``H``: DDP sends ``2 (N-1)/N · 4 d_model`` every step.

All ranks must call :meth:`LocalSteps.step` the same number of times (collectives are issued in the same order
everywhere). The state (outer parameters, outer momentum, error feedback, the fragment phase and any exchange in
flight) round-trips through :meth:`LocalSteps.state_dict` / :meth:`LocalSteps.load_state_dict`; an exchange in flight
at save time is issued again after a load from the same inputs, so a resumed run computes bit-identical values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from lightning_accel._utils.checks import check_bool, check_choice, check_int, check_number
from lightning_accel.comm.allreduce import OneBitAllreduce, OneBitBuffers, fp32_ring_bytes
from lightning_accel.comm.compress import GroupLayout
from lightning_accel.comm.state import GroupState

__all__ = ["OUTER_COMPRESSIONS", "Fragment", "LocalSteps", "LocalStepsConfig", "OuterCompression", "split_fragments"]

OuterCompression = Literal["1bit", "fp32"]
OUTER_COMPRESSIONS: tuple[OuterCompression, ...] = get_args(OuterCompression)
_FORMAT = 1


@dataclass(frozen=True)
class LocalStepsConfig:
    """Hyper-parameters of local steps with an outer update (immutable; checked at construction).

    Attributes:
        sync_every: ``H``, inner steps between two syncs of each fragment (DiLoCo uses 500 on large jobs; 16–64 on
            the small ones of ``benchmarks/localsteps.py``).
        fragments: ``F``, groups of parameters synced in turn (1: the whole model at once).
        outer_lr: the outer SGD learning rate. DiLoCo uses 0.7 with ``outer_momentum=0.9`` (Nesterov) at ``H = 500``;
            the default 1.0 with no momentum (the average of the ranks' parameters, local SGD) held the loss best in
            every short fit ``benchmarks/localsteps.py`` tried (``docs/onebit.md``).
        outer_momentum: the outer momentum (DiLoCo: 0.9; default 0).
        nesterov: Nesterov momentum for the outer step when ``outer_momentum > 0`` (DiLoCo: True); ``False`` is
            refused with ``outer_momentum=0``, where both steps are the same.
        compression: how pseudo-gradients are averaged: ``"1bit"`` (signs + block scales, error feedback on both
            sides) or ``"fp32"``.
        overlap_steps: ``τ``, inner steps between issuing a fragment's exchange and applying it (0: wait at once);
            must be below ``sync_every // fragments``, so one exchange per fragment is in flight at most. None (the
            default) resolves at construction to ``min(1, sync_every // fragments - 1)``: one step of overlap, or
            none when a fragment is due every step (e.g. ``sync_every=1``, or ``fragments == sync_every``).
        block_size: elements per 1-bit scale block (a multiple of 8); refused with ``compression="fp32"`` unless it
            is the default (fp32 averaging has no scale blocks).
        sync_buffers: average the floating-point buffers (BatchNorm statistics) that some rank changed since the last
            average, in their own precision (float64 in float64, the others in fp32), when fragment 0 is applied.
            Buffers no rank changed (registered constants) and integer ones (``num_batches_tracked``) do not travel.
        sync_start: optimizer steps at the start of training that each average the parameters over the ranks in fp32
            (a synchronous start, DDP's bytes per step: DiLoCo starts its local steps from a model trained
            synchronously); the ``H``-step schedule begins after them (it counts inner steps from the end
            of the synchronous start: with ``F = 1`` the first sync is ``H`` steps after it). 0: local steps from the
            first step.
    """

    sync_every: int = 64
    fragments: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    compression: OuterCompression = "1bit"
    overlap_steps: int | None = None
    block_size: int = 640
    sync_buffers: bool = True
    sync_start: int = 0

    def __post_init__(self) -> None:
        check_int("sync_every", self.sync_every, low=1, fix="Use e.g. `sync_every=64` (DiLoCo: 500).")
        check_int("fragments", self.fragments, low=1, fix="Use 1 to sync the whole model at once.")
        if self.fragments > self.sync_every:
            raise ValueError(
                f"`fragments` must be <= `sync_every` ({self.sync_every}), got {self.fragments}: each fragment needs "
                "its own step. Use fewer fragments or a larger `sync_every`."
            )
        check_number(
            "outer_lr",
            self.outer_lr,
            low=0.0,
            high=math.inf,
            low_open=True,
            high_open=True,
            fix="Use 1.0 (or DiLoCo's 0.7).",
        )
        check_number(
            "outer_momentum", self.outer_momentum, low=0.0, high=1.0, high_open=True, fix="Use 0 (or DiLoCo's 0.9)."
        )
        check_bool("nesterov", self.nesterov, fix="Use True (DiLoCo's outer step).")
        if self.nesterov is False and self.outer_momentum == 0:
            # without momentum both steps are `outer_lr` times the average: a choice asked for would change nothing
            raise ValueError(
                f"`nesterov=False` has no effect with `outer_momentum={self.outer_momentum!r}`: it chooses between "
                "two momentum steps, and without momentum both are the average. Drop `nesterov`, or set "
                "`outer_momentum` (DiLoCo: 0.9)."
            )
        check_choice("compression", self.compression, OUTER_COMPRESSIONS, fix="Use '1bit' (or 'fp32' to compare).")
        gap = self.sync_every // self.fragments
        if self.overlap_steps is None:
            # one step of overlap hides each exchange behind a step; a schedule with a fragment due every step
            # (gap 1) has no step to give it, so it waits
            object.__setattr__(self, "overlap_steps", min(1, gap - 1))
        check_int(
            "overlap_steps",
            self.overlap_steps,
            low=0,
            high=gap - 1,
            fix=f"It must leave each exchange done before its fragment's next one (< sync_every // fragments = {gap}).",
        )
        check_int("block_size", self.block_size, low=8, fix="Use e.g. `block_size=640`.")
        if self.block_size % 8:
            raise ValueError(f"`block_size` must be a multiple of 8, got {self.block_size!r}. Use e.g. 640.")
        default_block = type(self).__dataclass_fields__["block_size"].default
        if self.compression == "fp32" and self.block_size != default_block:
            # the fp32 exchange has no scale blocks: a block size asked for beside it would be dropped without a word
            raise ValueError(
                f"`block_size={self.block_size}` has no effect with `compression='fp32'`: it sizes the scale blocks "
                "of the 1-bit exchange, and fp32 averaging sends no scales. Drop `block_size`, or use "
                "`compression='1bit'`."
            )
        check_bool("sync_buffers", self.sync_buffers, fix="Use True to average BatchNorm statistics.")
        check_int(
            "sync_start",
            self.sync_start,
            low=0,
            fix="Use 0 for local steps from the start, or e.g. 15 % of the fit's steps for a synchronous start.",
        )

    def send_phase(self, fragment: int) -> int:
        """The step residue ``(t - sync_start) mod H`` at which ``fragment`` is sent."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every


def split_fragments(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """Contiguous groups of parameter indices (model order) of near-equal element counts; at most ``fragments``
    groups, none empty (fewer when there are fewer parameters)."""
    total = sum(numels)
    out: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for i, n in enumerate(numels):
        cur.append(i)
        acc += n
        remaining = len(numels) - i - 1
        need = fragments - len(out) - 1  # groups still to fill after this one
        if need > 0 and (acc >= total * (len(out) + 1) / fragments or remaining == need):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


class Fragment:
    """One fragment's outer state and its exchange in flight.

    Attributes:
        index: the fragment's position.
        params: indices into the parameter list.
        layout: canonical flat layout (1-bit groups, padding, chunks) for this world size.
        outer: float32 ``(padded_numel,)``, ``θ_global`` (zeros on padding).
        momentum: float32 ``(padded_numel,)``, the outer momentum.
        errors: the 1-bit worker and server error feedback, as the comm hook keeps it (None with fp32).
        sent: float32 copy of the local parameters the exchange in flight was taken from (None when idle).
        sent_at: the inner step it was issued at (None when idle).
        adopted_at: the inner step at which every rank last adopted ``θ_global`` exactly (no inner step since: the
            parameters *are* ``θ_global``; None when they have moved on, or it is not known).
    """

    __slots__ = (
        "_buffers",
        "_delta",
        "_op",
        "_work",
        "adopted_at",
        "errors",
        "index",
        "layout",
        "momentum",
        "outer",
        "params",
        "sent",
        "sent_at",
        "served",
    )

    def __init__(self, index: int, params: list[int], layout: GroupLayout, onebit: bool) -> None:
        self.index = index
        self.params = params
        self.layout = layout
        dev = layout.device
        self.outer = torch.zeros(layout.padded_numel, dtype=torch.float32, device=dev)
        self.momentum = torch.zeros_like(self.outer)
        self.errors = GroupState(tuple(params), layout) if onebit else None
        self.sent: torch.Tensor | None = None
        self.sent_at: int | None = None
        self.adopted_at: int | None = 0  # built from the parameters, before any inner step
        self.served = False
        self._op: OneBitAllreduce | None = None
        self._work: Any = None
        self._delta: torch.Tensor | None = None
        self._buffers: OneBitBuffers | None = None


class LocalSteps:
    """Outer state and synchronisation of local-step training over one process group (see the module docstring).

    Args:
        params: the trained parameters (those with ``requires_grad``; frozen ones never change, so never travel).
            Parameters with no elements are left out (there is nothing to average; the flat layouts need at least
            one element per parameter).
        config: the hyper-parameters.
        group: the process group to average over (None: the default group). Use a group of its own when other
            collectives may run while an exchange is in flight.
        buffers: the buffers whose floating-point ones are averaged when fragment 0 is applied, if some rank changed
            them since the last average (``config.sync_buffers``; a copy of each is kept to tell). Every rank must
            hold the same values when this is built (DDP's broadcast).

    Attributes:
        step_count: inner steps taken so far.
        bytes_sent: bytes this rank put on the wire, in total.
        last_bytes: bytes sent at the last step.
        last_synced: whether the last step issued, served or applied an exchange.
        syncs: outer updates applied.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        config: LocalStepsConfig,
        *,
        group: dist.ProcessGroup | None = None,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self.params = [p for p in params if p.numel() > 0]
        if not self.params:
            raise ValueError(
                f"`params` holds no parameter with elements ({len(params)} given): local steps need at least one "
                "trained parameter. Pass the model's trainable parameters."
            )
        self.config = config
        self.group = group
        self.buffers = [b for b in buffers if b.is_floating_point() and b.numel() > 0] if config.sync_buffers else []
        # each buffer as every rank held it after the last average (DDP broadcast them before this): one that no rank
        # changed since (a registered constant) is identical everywhere and stays out of the exchange, where averaging
        # would cost its bytes at every sync and move it (``(a + a + a) / 3`` is not always ``a`` in floating point)
        self._buffers_seen = [b.detach().clone() for b in self.buffers]
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        device = self.params[0].device
        numels = [p.numel() for p in self.params]
        onebit = config.compression == "1bit"
        self.fragments = [
            Fragment(f, idx, GroupLayout([numels[i] for i in idx], self.world_size, config.block_size, device), onebit)
            for f, idx in enumerate(split_fragments(numels, config.fragments))
        ]
        for frag in self.fragments:
            self._flatten(frag, out=frag.outer)  # every rank starts from the same parameters (DDP broadcast them)
        self.step_count = 0
        self.bytes_sent = 0
        self.last_bytes = 0
        self.last_synced = False
        self.syncs = 0

    # -- flat views --------------------------------------------------------------------------------------------------
    def _flatten(self, frag: Fragment, out: torch.Tensor) -> torch.Tensor:
        for i, off in zip(frag.params, frag.layout.offsets, strict=True):
            p = self.params[i]
            out[off : off + p.numel()].copy_(p.detach().reshape(-1))
        return out

    def _unflatten_add(self, frag: Fragment, flat: torch.Tensor) -> None:
        """``param += flat`` for every parameter of ``frag``."""
        with torch.no_grad():
            for i, off in zip(frag.params, frag.layout.offsets, strict=True):
                p = self.params[i]
                p.add_(flat[off : off + p.numel()].view_as(p).to(p.dtype))

    def _unflatten_copy(self, frag: Fragment, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for i, off in zip(frag.params, frag.layout.offsets, strict=True):
                p = self.params[i]
                p.copy_(flat[off : off + p.numel()].view_as(p))

    # -- the schedule --------------------------------------------------------------------------------------------------
    def step(self) -> int:
        """Call after every inner optimizer step (on every rank): applies the exchanges due, issues the ones due.
        Returns the bytes this rank sent at this step."""
        self.step_count += 1
        t, cfg = self.step_count, self.config
        before = self.bytes_sent
        if t <= cfg.sync_start:  # the synchronous start: every rank adopts the average of the parameters
            self._average_params()
            self.last_bytes = self.bytes_sent - before
            self.last_synced = True
            return self.last_bytes
        tau = cfg.overlap_steps
        assert tau is not None  # resolved by the config
        synced = False
        for frag in self.fragments:
            if frag.sent_at is not None:
                age = t - frag.sent_at
                if not frag.served and age >= 1:
                    self._serve(frag)
                    synced = True
                if age >= tau:
                    self._apply(frag)
                    synced = True
        # the schedule starts when the synchronous start ends (the step count itself is saved and restored, so a
        # resumed run keeps the same phase)
        phase = (t - cfg.sync_start) % cfg.sync_every
        for frag in self.fragments:
            if phase == cfg.send_phase(frag.index) and frag.sent_at is None:
                synced = True
                if tau == 0:
                    self._sync_now(frag)
                else:
                    self._send(frag, t)
        self.last_bytes = self.bytes_sent - before
        self.last_synced = synced
        return self.last_bytes

    def finish(self) -> None:
        """Apply every exchange in flight now (end of training: the final parameters include every sync issued)."""
        for frag in self.fragments:
            if frag.sent_at is not None:
                if not frag.served:
                    self._serve(frag)
                self._apply(frag)

    def final_sync(self) -> None:
        """End of training: apply the exchanges in flight, then sync once more every fragment that moved since its
        last sync and copy ``θ_global`` into the parameters, so every rank ends with the same model (a collective).

        A fragment whose parameters are ``θ_global`` already (synced at this very step: the fit ended on a step of the
        schedule, or a resume ran no step) is left alone: an outer step on its zero pseudo-gradient would still move
        ``θ_global`` by the outer momentum (``lr μ² m`` with Nesterov) or by the 1-bit residual, a step the algorithm
        never takes. The verdict is a function of the step counts, the same on every rank."""
        self.finish()
        for frag in self.fragments:
            if frag.adopted_at != self.step_count:
                self._sync_now(frag)  # no step between send and apply: the parameters become θ_global exactly

    def local_flats(self) -> list[torch.Tensor]:
        """CPU copies of this rank's parameters, one canonical flat tensor per fragment (for checkpoints)."""
        return [self._flatten(f, torch.zeros_like(f.outer)).cpu() for f in self.fragments]

    def check_local_flats(self, flats: Sequence[torch.Tensor]) -> None:
        """Refuse :meth:`local_flats` output of another layout (other fragment sizes), before anything is loaded.

        Raises:
            ValueError: other fragment sizes than this layout's, naming both.
        """
        sizes = [f.outer.numel() for f in self.fragments]
        if [flat.numel() for flat in flats] != sizes:
            raise ValueError(
                f"expected {len(sizes)} fragment tensors of {sizes} elements, got {[flat.numel() for flat in flats]}."
            )

    def load_local_flats(self, flats: Sequence[torch.Tensor]) -> None:
        """Set this rank's parameters from :meth:`local_flats` output (of the same layout: check the state saved with
        them first, :meth:`check_state`; these sizes are checked here too, before anything is copied:
        :meth:`check_local_flats`).

        Raises:
            ValueError: other fragment sizes than this layout's.
        """
        self.check_local_flats(flats)
        for frag, flat in zip(self.fragments, flats, strict=True):
            self._unflatten_copy(frag, flat.to(frag.outer.device))

    def abandon(self) -> None:
        """Complete every exchange in flight and drop its result: nothing changes (parameters, outer state, error
        feedback), but the process group's collectives stay matched. For an outer state about to be replaced (the
        model's parameters were replaced mid-fit). A collective: call it on every rank at the same step."""
        for frag in self.fragments:
            if frag.sent_at is None:
                continue
            if frag._op is not None:
                if not frag.served:
                    frag._op.serve()
                frag._op.finish()
            elif frag._work is not None:
                frag._work.wait()
            frag.sent, frag.sent_at, frag.served = None, None, False
            frag._op, frag._work, frag._delta = None, None, None

    @property
    def in_flight(self) -> bool:
        """Whether an exchange has been issued and not yet applied."""
        return any(f.sent_at is not None for f in self.fragments)

    def _sync_now(self, frag: Fragment) -> None:
        """Send, serve and apply ``frag``'s exchange at the current step (nothing overlaps it)."""
        self._send(frag, self.step_count)
        self._serve(frag)
        self._apply(frag)

    def _send(self, frag: Fragment, t: int) -> None:
        sent = self._flatten(frag, out=torch.zeros_like(frag.outer))
        frag.sent, frag.sent_at, frag.served = sent, t, False
        self._issue(frag)

    def _issue(self, frag: Fragment) -> None:
        assert frag.sent is not None
        delta = frag.outer - frag.sent  # zeros on padding: both are
        if self.config.compression == "fp32":
            frag._delta = delta  # reduced in place
            frag._work = dist.all_reduce(delta, group=self.group, async_op=True)
            frag._op = None
            return
        if frag._buffers is None:
            frag._buffers = OneBitBuffers(frag.layout, self.rank)
        errors = frag.errors
        assert errors is not None
        frag._op = OneBitAllreduce(
            delta, frag.layout, errors.worker_error, errors.server_error, group=self.group, buffers=frag._buffers
        ).start()

    def _serve(self, frag: Fragment) -> None:
        if frag._op is not None:
            frag._op.serve()
        frag.served = True

    def _apply(self, frag: Fragment) -> None:
        cfg = self.config
        res = None
        if frag._op is not None:
            res = frag._op.finish()
            self.bytes_sent += res.bytes_sent
            avg = torch.where(frag.layout.table.mask, res.out, 0.0)  # padding decodes to garbage
            finite = bool(res.finite)  # from the block scales: the verdict of a pass over `avg`
        else:
            frag._work.wait()
            self.bytes_sent += fp32_ring_bytes(frag.layout.padded_numel, self.world_size)  # when done, like 1-bit
            assert frag._delta is not None
            avg = frag._delta.div_(self.world_size)  # zeros on padding
            finite = bool(torch.isfinite(avg).all())
        if not finite:  # raised before the errors are committed: a NaN would poison the error feedback for good
            raise FloatingPointError(
                f"local steps: the averaged pseudo-gradient of fragment {frag.index} at inner step {frag.sent_at} is "
                "not finite; a rank diverged during its local steps. Lower the inner learning rate or `sync_every`."
            )
        if res is not None and frag.errors is not None:
            frag.errors.commit(res.worker_error, res.server_error, frag._buffers)
        m = frag.momentum.mul_(cfg.outer_momentum).add_(avg)
        update = avg.add(m, alpha=cfg.outer_momentum) if cfg.nesterov else m
        new_outer = frag.outer - cfg.outer_lr * update
        assert frag.sent is not None
        if frag.sent_at == self.step_count:  # no inner step since the send: adopt θ_global exactly (every rank alike)
            self._unflatten_copy(frag, new_outer)
            frag.adopted_at = self.step_count
        else:  # keep the progress made while the exchange travelled: θ_local += θ_global,new − θ_sent
            self._unflatten_add(frag, new_outer - frag.sent)
            frag.adopted_at = None
        frag.outer.copy_(new_outer)
        frag.sent, frag.sent_at, frag.served, frag._op, frag._work, frag._delta = None, None, False, None, None, None
        if frag.index == 0 and self.buffers:
            self._average_buffers()
        self.syncs += 1

    def _average_params(self) -> None:
        """One step of the synchronous start: the parameters (and the floating-point buffers) become their average
        over the ranks, in fp32, and so does each fragment's ``θ_global``, from which the first local phase starts."""
        for frag in self.fragments:
            flat = self._flatten(frag, out=frag.outer)  # zeros on padding
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world_size)
            self.bytes_sent += fp32_ring_bytes(frag.layout.padded_numel, self.world_size)
            self._unflatten_copy(frag, flat)
            frag.adopted_at = self.step_count
        if self.buffers:
            self._average_buffers()
        self.syncs += 1

    def _average_buffers(self) -> None:
        """Average the floating-point buffers that some rank changed since the last average, each in its own
        precision (float64 in float64, the others in fp32: a float64 buffer averaged in fp32 would lose its low bits at
        every sync). Two collectives: one flag per buffer (did any rank change it?), then the values of the changed
        ones, so every rank averages the same buffers."""
        device = self.buffers[0].device
        changed = torch.tensor(
            [int(not torch.equal(b, seen)) for b, seen in zip(self.buffers, self._buffers_seen, strict=True)],
            dtype=torch.int32,
            device=device,
        )
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        self.bytes_sent += fp32_ring_bytes(changed.numel(), self.world_size)  # 4-byte flags
        due = [i for i, flag in enumerate(changed.tolist()) if flag]
        for dtype in (torch.float32, torch.float64):
            idx = [i for i in due if (self.buffers[i].dtype == torch.float64) == (dtype == torch.float64)]
            if not idx:
                continue
            flat = torch.cat([self.buffers[i].detach().reshape(-1).to(dtype) for i in idx])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world_size)
            self.bytes_sent += fp32_ring_bytes(flat.numel(), self.world_size) * flat.element_size() // 4
            pos = 0
            with torch.no_grad():
                for i in idx:
                    b = self.buffers[i]
                    b.copy_(flat[pos : pos + b.numel()].view_as(b))
                    self._buffers_seen[i].copy_(b)
                    pos += b.numel()

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the config, the step, and per fragment the outer parameters, the outer momentum, the
        error feedback and the exchange in flight (its input and age). Tensors are CPU copies."""

        def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to("cpu", copy=True)

        return {
            "format": _FORMAT,
            "config": asdict(self.config),
            "world_size": self.world_size,
            "step": self.step_count,
            "bytes_sent": self.bytes_sent,
            "syncs": self.syncs,
            "fragments": [
                {
                    "params": list(f.params),
                    "outer": cpu(f.outer),
                    "momentum": cpu(f.momentum),
                    "worker_error": cpu(f.errors.worker_error) if f.errors is not None else None,
                    "server_error": cpu(f.errors.server_error) if f.errors is not None else None,
                    "sent": cpu(f.sent),
                    "sent_at": f.sent_at,
                    "served": f.served,
                    "adopted_at": f.adopted_at,
                }
                for f in self.fragments
            ],
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a :meth:`state_dict` of another layout, or one whose tensors and counters :meth:`load_state_dict`
        could not load, before anything is loaded: call it before restoring any part of a checkpoint saved with it
        (:meth:`load_local_flats` too), so a refused resume overwrites nothing. The layout's verdict and its message
        depend only on what every rank shares (the layout, the world size, the config): every rank refuses alike,
        with the same line. A damaged part (a fragment's momentum, error feedback or exchange in flight of another
        shape or missing, a counter that is not an integer) may be one rank's alone: a caller restoring every rank's
        own part agrees with the other ranks on the verdict before loading.

        Raises:
            ValueError: the state was made for another world size, parameter split (``fragments``, or other
                trainable parameters) or compression, or by another version; or a tensor or counter of it is
                missing or of another shape (naming the fragment and the entry).
        """
        if state.get("format") != _FORMAT:
            raise ValueError(f"local-steps state of format {state.get('format')!r}; this version reads {_FORMAT}.")
        mine = [list(f.params) for f in self.fragments]
        theirs = [list(f["params"]) for f in state["fragments"]]
        my_numels = [f.outer.numel() for f in self.fragments]
        their_numels = [f["outer"].numel() for f in state["fragments"]]
        saved_cfg = state.get("config", {})
        if (
            state["world_size"] != self.world_size
            or mine != theirs
            or my_numels != their_numels
            or saved_cfg.get("compression") != (self.config.compression)
        ):
            raise ValueError(
                f"the checkpoint's local-steps state was made for world size {state['world_size']}, fragments of "
                f"{[len(p) for p in theirs]} parameters ({their_numels} elements) and compression "
                f"{saved_cfg.get('compression')!r}; this run has {self.world_size}, {[len(p) for p in mine]} "
                f"({my_numels}) and {self.config.compression!r}. Resume with the same `fragments`, `compression`, "
                "trainable parameters and number of processes."
            )
        # this rank's own tensors and counters: loaded only after every check, so a damaged part (a rank's alone) is
        # refused here, before any copy, and never halfway through the load (or in the exchange it issues again)
        for key in ("step", "bytes_sent", "syncs"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"the checkpoint's local-steps `{key}` is {value!r}, expected an integer: the checkpoint is "
                    "incomplete or corrupt. Resume from another checkpoint."
                )
        for f, saved in zip(self.fragments, state["fragments"], strict=True):
            expected = {"momentum": f.momentum}
            if f.errors is not None:
                expected.update(worker_error=f.errors.worker_error, server_error=f.errors.server_error)
            sent_at = saved.get("sent_at")
            if saved.get("sent") is not None or sent_at is not None:  # an exchange in flight: its input and its step
                expected["sent"] = f.outer
                if isinstance(sent_at, bool) or not isinstance(sent_at, int):
                    raise ValueError(
                        f"fragment {f.index}'s `sent_at` in the checkpoint's local-steps state is {sent_at!r}, "
                        "expected the integer step of its exchange in flight: the checkpoint is incomplete or "
                        "corrupt. Resume from another checkpoint."
                    )
            for name, want in expected.items():
                theirs = saved.get(name)
                if not isinstance(theirs, torch.Tensor):
                    found = "no tensor" if theirs is None else f"a {type(theirs).__name__}"
                elif theirs.shape != want.shape:
                    found = f"a tensor of shape {list(theirs.shape)}"
                else:
                    continue
                raise ValueError(
                    f"fragment {f.index}'s `{name}` in the checkpoint's local-steps state holds {found}, expected a "
                    f"tensor of shape {list(want.shape)}: the checkpoint is incomplete or corrupt. Resume from "
                    "another checkpoint."
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a :meth:`state_dict` of the same layout (same parameters, fragments and world size) and issue again
        the exchanges that were in flight (a collective: call it on every rank at the same point).

        Raises:
            ValueError: the state was made for another layout, or a tensor or counter of it is missing or of another
                shape (:meth:`check_state`); nothing is loaded then.
        """
        self.check_state(state)
        self.step_count = int(state["step"])
        self.bytes_sent = int(state["bytes_sent"])
        self.syncs = int(state["syncs"])
        for f, s in zip(self.fragments, state["fragments"], strict=True):
            dev = f.outer.device
            f.outer.copy_(s["outer"])
            f.momentum.copy_(s["momentum"])
            if f.errors is not None:
                f.errors.worker_error.copy_(s["worker_error"])
                f.errors.server_error.copy_(s["server_error"])
            f.sent = None if s["sent"] is None else s["sent"].to(dev)
            f.sent_at = s["sent_at"]
            f.adopted_at = s.get("adopted_at")  # absent from older states: not known, the final sync runs
            f.served = False
            f._op = f._work = None
        for f, s in zip(self.fragments, state["fragments"], strict=True):
            if f.sent is not None:
                # the same inputs (outer, sent, pre-exchange errors) give the same bytes: bit-identical results
                self._issue(f)
                if s["served"]:
                    self._serve(f)
