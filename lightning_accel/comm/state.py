"""``OneBitState``: the hook's hyper-parameters (a :class:`~lightning_accel.comm.config.OneBitConfig`), its
per-group error-feedback state and its statistics (:class:`CommStats`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_accel._utils.checks import check_choice
from lightning_accel._utils.deferred import Deferred
from lightning_accel._utils.triton import use_triton
from lightning_accel.comm.allreduce import (
    CompressedAllreduce,
    CompressFn,
    HierarchicalOneBitAllreduce,
    OneBitAllreduce,
    OneBitBuffers,
)
from lightning_accel.comm.compress import GroupLayout, compress_fast, compress_reference
from lightning_accel.comm.config import (
    COMPRESSOR_BACKENDS,
    HOOK_DEFAULTS,
    OneBitConfig,
    config_fields,
    resolve_renamed,
)
from lightning_accel.comm.topology import NodeTopology
from lightning_accel.comm.warmup import AUTO_MIN_WARMUP

__all__ = [
    "CommStats",
    "GroupState",
    "KeptBuffers",
    "OneBitState",
    "StepBytes",
    "check_gathered_state",
    "compressor_for",
    "gather_state_dict",
    "gather_state_dict_async",
    "select_rank_state",
]

_FORMAT = 2
_READABLE = (1, 2)  # format 1 (gradient compression only) loads: no stage, no decision


class GroupState:
    """Error-feedback state of one parameter group (normally one DDP bucket).

    Attributes:
        key: sorted model-parameter indices of the group (stable across DDP's bucket rebuild, unlike bucket indices).
        layout: the canonical layout for this world size.
        worker_error: float32 ``(worker_numel,)``, this rank's residual of what it compressed (unscaled units): its own
            gradients, ``(padded_numel,)``; hierarchical, its node's average of its shard, ``(nodes * chunk_numel,)``.
        server_error: float32 ``(chunk_numel,)``, this rank's residual of the averaged chunk it owns.
    """

    __slots__ = ("key", "layout", "server_error", "worker_error")

    def __init__(self, key: tuple[int, ...], layout: GroupLayout, worker_numel: int | None = None) -> None:
        self.key = key
        self.layout = layout
        numel = layout.padded_numel if worker_numel is None else worker_numel
        self.worker_error = torch.zeros(numel, dtype=torch.float32, device=layout.device)
        self.server_error = torch.zeros(layout.chunk_numel, dtype=torch.float32, device=layout.device)

    def commit(
        self, worker_error: torch.Tensor | None, server_error: torch.Tensor | None, buffers: OneBitBuffers | None
    ) -> None:
        """Adopt a finite step's new errors (nothing without error feedback): by exchanging buffers when they are
        ``buffers``' compressors' own (the old state becomes their scratch: one pass over the group and one over the
        chunk less, ~1.5 ``torch.add`` per group), else by copying."""
        if worker_error is None or server_error is None:
            return
        if (
            buffers is not None
            and worker_error is buffers.worker.error_buffer
            and server_error is buffers.server.error_buffer
        ):
            self.worker_error = buffers.worker.exchange_error(self.worker_error)
            self.server_error = buffers.server.exchange_error(self.server_error)
        else:
            self.worker_error.copy_(worker_error)
            self.server_error.copy_(server_error)


def _signal_str(mode: str, kinds: tuple[str, ...] | None) -> str:
    """``"gradients"``, ``"momentum (adam)"``: what an error state's residuals are in, for messages."""
    return f"{mode} ({', '.join(kinds)})" if mode == "momentum" and kinds else mode


def _key_str(key: tuple[int, ...]) -> str:
    return ",".join(map(str, key))


def _key_parse(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


@dataclass
class StepBytes:
    """Bytes of one step (per rank): all of its averaging, and its compressed part alone.

    Attributes:
        sent: bytes put on the wire.
        fp32: what an fp32 ring allreduce of the same buffers would have sent.
        compressed_sent: ``sent`` of the compressed buckets (or momentum groups) only.
        compressed_fp32: ``fp32`` of the compressed buckets only.
    """

    sent: int = 0
    fp32: int = 0
    compressed_sent: int = 0
    compressed_fp32: int = 0

    def add(self, sent: int, fp32: int, compressed: bool) -> None:
        """Count one bucket."""
        self.sent += sent
        self.fp32 += fp32
        if compressed:
            self.compressed_sent += sent
            self.compressed_fp32 += fp32


@dataclass
class CommStats:
    """Statistics of the 1-bit averaging on this rank.

    Attributes:
        bytes_sent: bytes put on the wire by the hook and the momentum step since the start.
        fp32_bytes: what an fp32 ring allreduce of the same buffers would have sent.
        last_step: the bytes of the last completed step.
        current_step: the bytes of the step in progress (the buckets the hook has seen so far).
        compressed_calls / uncompressed_calls: buckets (or momentum groups) sent each way.
        intra_bytes: hierarchical averaging only: bytes sent to the ranks of this rank's own node (not counted in
            ``bytes_sent``, which is then what crossed between nodes).
        nonfinite_groups: compressed groups whose result held NaN/Inf (their state was left unchanged);
            counted on CPU only (on CUDA the state is kept by a device-side select, without a host sync).
        last_step_comm_s: host seconds the last step spent in compressed averaging (hook and momentum step,
            compression, collectives and waits; 0 for fp32 steps).
    """

    bytes_sent: int = 0
    fp32_bytes: int = 0
    last_step: StepBytes = field(default_factory=StepBytes)
    current_step: StepBytes = field(default_factory=StepBytes)
    compressed_calls: int = 0
    uncompressed_calls: int = 0
    intra_bytes: int = 0
    nonfinite_groups: int = 0
    last_step_comm_s: float = 0.0

    def end_bucket(self, sent: int, fp32: int, compressed: bool, is_last: bool) -> None:
        """Count one bucket of the step in progress; ``is_last`` closes the step (it becomes ``last_step``)."""
        self.bytes_sent += sent
        self.fp32_bytes += fp32
        self.current_step.add(sent, fp32, compressed)
        if is_last:
            self.last_step, self.current_step = self.current_step, StepBytes()

    @property
    def compression_ratio(self) -> float:
        """fp32 ring-allreduce bytes over bytes sent, for the compressed buckets of the last step (0 if none)."""
        if not self.last_step.compressed_sent:
            return 0.0
        return self.last_step.compressed_fp32 / self.last_step.compressed_sent


class KeptBuffers(NamedTuple):
    """What a group's compressed allreduce reuses between steps (:meth:`OneBitState.buffers_for`)."""

    #: the layout the buffers were made for (a new layout makes new buffers)
    layout: GroupLayout
    #: float32 ``(padded_numel,)`` canonical input, zeros on padding
    input: torch.Tensor
    #: the CPU compressor's buffers, or None (made on first use by the CPU compressor)
    buffers: OneBitBuffers | None


class OneBitState:
    """State of :func:`~lightning_accel.comm.hook.onebit_hook` and of the compressed momentum step, modelled on
    PowerSGD's ``PowerSGDState``.

    Tuning guide: keep ``warmup_steps`` long enough for the optimizer's statistics to settle (Adam's variance is
    frozen at the end of warm-up: 1-bit Adam warms up for ~15 % of training; for short fine-tunes 50-200 steps
    suffice); ``block_size`` trades scale bytes (32 bits per block) for accuracy (smaller blocks follow the
    magnitudes more closely); ``min_compress_numel`` keeps tiny gradient buckets in fp32, where the fixed cost of two
    collectives outweighs the bytes saved.

    Args:
        process_group: the group to average over (None: the default group).
        config: the hyper-parameters (default :data:`~lightning_accel.comm.config.HOOK_DEFAULTS`: gradients, always
            compressed after warm-up).
        parameters: the model's parameters, numbered for stable group keys (:meth:`set_parameters`).
        loss_scale_fn: returns the AMP loss scale the gradients carry (tensor or float), or None.
        **hparams: :class:`~lightning_accel.comm.config.OneBitConfig` fields replacing those of ``config``
            (``OneBitState(warmup_steps=100, parameters=...)``); the deprecated ``compress`` / ``backend`` map to
            ``compressed_signal`` / ``compressor_backend`` with a :class:`DeprecationWarning`.

    Raises:
        TypeError: an unknown keyword, or a hyper-parameter of the wrong type.
        ValueError: a hyper-parameter out of range.

    Hyper-parameters:
        config: the :class:`~lightning_accel.comm.config.OneBitConfig` (immutable).
        process_group: the group to average over.

    Internal state:
        step: completed synchronising backward passes (== optimizer steps; the hook is not called inside ``no_sync``).
        mode: ``"gradients"`` or ``"momentum"``, resolved from ``config.compressed_signal`` once the optimizer is
            known.
        decision: ``"1bit"``, ``"fp32"`` or None (not decided yet) for the steps after warm-up.
        compressed_since: the step the current compressed stage began (Adam's variance is frozen there), or None
            (no stage in progress: warm-up, fp32 steps, or a resumed fit that does not compress from its first step).
        stage_token: a fresh object for each compressed stage this process began (:meth:`begin_stage`), None when the
            stage in progress was restored from a checkpoint (or none is). The momentum step drops the Adam freeze
            marks an optimizer held before a stage it began: they belong to an earlier stage, perhaps of a run whose
            1-bit state was not restored, whose stage began at the same step number (not saved).
        kinds: the momentum kinds (``"sgd"``, ``"adam"``) of the optimizers whose momentum is compressed, sorted
            (:meth:`set_signal`; empty for gradients): with ``mode``, what the error feedback's residuals are in.
        loaded_signal: ``(mode, kinds)`` of the state :meth:`load_state_dict` restored (``kinds`` None when it did
            not save them), until :meth:`set_signal` compares it with this fit's; None otherwise (not saved).
        warmup_end: the first step after warm-up, or None while it is being decided: ``config.warmup_steps`` when it
            is an integer; ``"auto"`` starts at :data:`~lightning_accel.comm.warmup.AUTO_MIN_WARMUP` (what it means
            for the gradients the hook alone compresses), and :class:`~lightning_accel.comm.OneBitDDPStrategy`
            resolves it per optimizer during the fit (None while its
            :class:`~lightning_accel.comm.warmup.WarmupWatch` watches Adam's variance).
        refreshing: whether the step now running refreshes Adam's frozen variance (set by the strategy before the
            step's backward, from :attr:`refresh_due`): the hook averages in fp32 and the compressor takes an exact
            Adam step (:meth:`~lightning_accel.comm.momentum.MomentumCompressor.refresh_step`).
        refresh_missed: a refresh step did not step the optimizer (AMP's GradScaler skipped it: Inf/NaN gradients,
            on every rank alike); the next step refreshes instead.
        local_grads: whether the last synchronising backward left each rank's own gradients (compressed-momentum
            stage: the optimizer step must average the momentum) rather than averaged ones.
        decisions: ``[{"step", "fp32_s", "onebit_s", "decision"}]``, every measurement ``compression="auto"`` made.
        measure_fn: optional ``state -> (fp32_seconds, onebit_seconds)`` replacing the timing (tests, custom probes).
        trial_until: while ``compression="auto"`` times real steps of the other mode
            (:class:`~lightning_accel.comm.auto.StepTrial`), the step it decides at; None otherwise.
        decide_from: with ``compression="auto"``, no decision (nor recheck) before this step; None: no such bound.
            A :class:`~lightning_accel.comm.auto.StepTrial` sets it in a process that starts past step 0 (a resumed
            fit), whose step times from before are gone: it first times steps of its own, so that the decision again
            compares real steps (not saved; the hook alone never sets it).
        decision_held: the decision stays as it is for the rest of the fit: no ``compression="auto"`` decision nor
            recheck (the strategy's ``switch_off`` holds it at ``"fp32"``; the strategy saves and restores it).
        groups: ``{key: GroupState}``, keyed by the sorted parameter indices of each group.
        param_index: ``{id(parameter): index}`` from :meth:`set_parameters` (first-seen order otherwise).
        param_numels: element counts of the trainable parameters by index (what ``"auto"`` times).
        loss_scale_fn: returns the AMP loss scale the gradients carry (tensor or float), or None.
        pending: error tensors loaded from a checkpoint, adopted when their group first appears.
        plans: the hook's per-bucket copy plans (not saved).
        kept: ``{key: KeptBuffers}``, what a group's compressed allreduce reuses between steps
            (:meth:`buffers_for`; not saved).
        comm_worker: the :class:`~lightning_accel.comm.hook.CommWorker` thread of the CPU gradient path (started at
            its first compressed bucket; stopped by :meth:`close`).
        bucket_fn: ``(params, grads) -> None`` or None; when set, the hook hands it each bucket's parameters and
            final local gradients in the compressed-momentum stage (the strategy sets it around the backward of a
            step that may start compressing during backward: :meth:`MomentumCompressor.on_bucket`).
        topology: the node layout for hierarchical averaging
            (:class:`~lightning_accel.comm.allreduce.HierarchicalOneBitAllreduce`; made by
            :func:`~lightning_accel.comm.topology.node_topology`), or None: the flat exchange between all ranks.
            Only over the default process group.
        nodes_layout: ``[processes per node, nodes]`` of a hierarchical layout this state names without holding its
            process groups (None: :attr:`topology`'s, or flat): a ``compression="fp32"`` fit averages with plain DDP
            and makes no node groups, yet its checkpoints name the layout a compressing resume averages over
            (:attr:`layout_key`), so that such a resume adopts them as it adopts a compressing fit's.

    Stats:
        stats: the :class:`CommStats` of this rank.
    """

    __slots__ = (
        # hyper-parameters
        "config",
        "process_group",
        # internal state
        "step",
        "mode",
        "decision",
        "compressed_since",
        "stage_token",
        "kinds",
        "loaded_signal",
        "warmup_end",
        "refreshing",
        "refresh_missed",
        "local_grads",
        "decisions",
        "measure_fn",
        "trial_until",
        "decide_from",
        "decision_held",
        "groups",
        "param_index",
        "param_numels",
        "loss_scale_fn",
        "pending",
        "plans",
        "kept",
        "comm_worker",
        "bucket_fn",
        "topology",
        "nodes_layout",
        # stats
        "stats",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        config: OneBitConfig | None = None,
        *,
        parameters: Iterable[torch.nn.Parameter] | None = None,
        loss_scale_fn: Callable[[], torch.Tensor | float | None] | None = None,
        topology: NodeTopology | None = None,
        **hparams: Any,
    ) -> None:
        base = HOOK_DEFAULTS if config is None else config
        hparams = resolve_renamed(hparams, defaults=base)
        unknown = sorted(set(hparams) - set(config_fields()))
        if unknown:
            raise TypeError(
                f"Unknown option(s) {', '.join(f'`{u}`' for u in unknown)} for `OneBitState`. Expected the "
                f"`OneBitConfig` fields: {', '.join(config_fields())}. Check the spelling."
            )
        config = dataclasses.replace(base, **hparams) if hparams else base
        self.config = config
        self.process_group = process_group
        self.step = 0
        self.mode: str = "momentum" if config.compressed_signal == "momentum" else "gradients"
        self.decision: str | None = None if config.compression == "auto" else config.compression
        self.compressed_since: int | None = None
        self.stage_token: object | None = None
        self.kinds: tuple[str, ...] = ()
        self.loaded_signal: tuple[str, tuple[str, ...] | None] | None = None
        self.warmup_end: int | None = AUTO_MIN_WARMUP if config.warmup_steps == "auto" else int(config.warmup_steps)
        self.refreshing = False
        self.refresh_missed = False
        self.local_grads = False
        self.decisions: list[dict[str, Any]] = []
        self.measure_fn: Callable[[OneBitState], tuple[float, float]] | None = None
        self.trial_until: int | None = None
        self.decide_from: int | None = None
        self.decision_held = False
        self.groups: dict[tuple[int, ...], GroupState] = {}
        self.param_index: dict[int, int] = {}
        self.param_numels: list[int] = []
        self.loss_scale_fn = loss_scale_fn
        self.pending: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.plans: dict[Any, Any] = {}
        self.kept: dict[tuple[int, ...], KeptBuffers] = {}
        self.comm_worker: Any = None
        self.bucket_fn: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None
        if topology is not None and process_group is not None and process_group is not dist.group.WORLD:
            raise ValueError(
                "`topology` (hierarchical averaging) works over the default process group only, got another "
                "`process_group`. Pass `topology=None` to average flat over that group."
            )
        self.topology = topology
        self.nodes_layout: list[int] | None = None
        self.stats = CommStats()
        if parameters is not None:
            self.set_parameters(parameters)

    def set_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Number the model's parameters (``model.parameters()`` order) so group keys survive bucket rebuilds."""
        params = list(parameters)
        self.param_index = {id(p): i for i, p in enumerate(params)}
        self.param_numels = [p.numel() if p.requires_grad else 0 for p in params]
        self.plans.clear()

    def replace_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> int:
        """Number a re-wrapped model's parameters (a callback that reshaped them mid-fit, such as structured pruning,
        wraps the model in DDP again) and keep everything else: the step, the warm-up, the decision, the compressed
        stage and the statistics continue.

        The error feedback of a group survives only if every parameter of it kept its number of elements (its
        residuals are laid out by element): the others are dropped, and their groups start again from zero error at
        their next compressed step, exactly as after a resume at another world size. With another number of
        parameters, the indices no longer name the same tensors: every group is dropped. The kept buffers and the
        bucket plans are dropped too (made again for the new layouts).

        Returns:
            The number of groups (with error state, or loaded and not yet adopted) that were dropped.
        """
        old = list(self.param_numels)
        self.set_parameters(parameters)
        new = self.param_numels
        if len(old) != len(new):
            changed: set[int] | None = None  # every index
        else:
            changed = {i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b}

        def stale(key: tuple[int, ...]) -> bool:
            return changed is None or not changed.isdisjoint(key)

        dropped = [k for k in self.groups if stale(k)] + [k for k in self.pending if stale(k)]
        for k in dropped:
            self.groups.pop(k, None)
            self.pending.pop(k, None)
        self.kept.clear()
        return len(dropped)

    def new_group(self, key: tuple[int, ...], numels: list[int], device: torch.device) -> tuple[GroupState, bool]:
        """A fresh group for ``key``, with the error state a checkpoint left for it in ``pending`` when it fits.

        Returns:
            The group and whether pending state for ``key`` was dropped because its shapes no longer fit (the caller
            decides whether that deserves a warning). The group is not registered in ``groups``.
        """
        layout = GroupLayout(numels, self.process_group_size(), self.config.block_size, device)
        g = GroupState(key, layout, self.worker_numel(layout))
        loaded = self.pending.pop(key, None)
        if loaded is None:
            return g, False
        w, s = loaded
        if w.shape != g.worker_error.shape or s.shape != g.server_error.shape:
            return g, True
        g.worker_error.copy_(w)
        g.server_error.copy_(s)
        return g, False

    def compressor(self, device: torch.device) -> CompressFn:
        """The compressor for tensors on ``device`` under ``config.compressor_backend`` (the hook, the momentum step
        and ``auto``'s timing all use this one): the fused Triton kernel where it runs, else the buffer-reusing CPU
        compressor (same bits; its cost is measured by ``benchmarks/onebit.py``), or the readable oracle with
        ``compressor_backend="reference"``.

        Raises:
            RuntimeError: a forced ``"triton"`` that cannot run on ``device`` (no CUDA and no interpreter, or no
                triton package).
        """
        return compressor_for(self.config.compressor_backend, device)

    def buffers_for(self, g: GroupState, fast: bool) -> tuple[torch.Tensor, OneBitBuffers | None]:
        """The group's kept canonical input buffer (zeros on padding, which its users never write) and, with
        ``fast`` (the CPU compressor), its kept :class:`~lightning_accel.comm.allreduce.OneBitBuffers`: a step
        allocates nothing big. A group that replaces others (overlapping keys) drops theirs."""
        kept = self.kept.get(g.key)
        if kept is None or kept.layout is not g.layout:
            for k in [k for k in self.kept if not set(k).isdisjoint(g.key)]:  # groups that no longer exist
                del self.kept[k]
            x = torch.zeros(g.layout.padded_numel, dtype=torch.float32, device=g.layout.device)
            kept = self.kept[g.key] = KeptBuffers(g.layout, x, None)
        if fast and kept.buffers is None:
            buffers = OneBitBuffers(g.layout, dist.get_rank(self.process_group), self.topology)
            kept = self.kept[g.key] = kept._replace(buffers=buffers)
        return kept.input, kept.buffers if fast else None

    def worker_numel(self, layout: GroupLayout) -> int:
        """Elements of a group's worker error: the whole group (flat), or this rank's shard (hierarchical)."""
        worker, _ = self.owned_slices(layout)
        return worker.stop - worker.start

    def allreduce_op(
        self,
        x: torch.Tensor,
        layout: GroupLayout,
        worker_error: torch.Tensor | None,
        server_error: torch.Tensor | None,
        *,
        compress: CompressFn,
        buffers: OneBitBuffers | None = None,
        loss_scale: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        topology: NodeTopology | None = None,
    ) -> CompressedAllreduce:
        """The (not yet started) compressed allreduce of one group in this state's layout: flat over ``group``
        (default: :attr:`process_group`), or hierarchical over ``topology`` (default: :attr:`topology`; a thread
        with groups of its own passes its own)."""
        topo = topology if topology is not None else self.topology
        if topo is not None:
            return HierarchicalOneBitAllreduce(
                x,
                layout,
                worker_error,
                server_error,
                topology=topo,
                loss_scale=loss_scale,
                compress=compress,
                buffers=buffers,
            )
        return OneBitAllreduce(
            x,
            layout,
            worker_error,
            server_error,
            group=self.process_group if group is None else group,
            loss_scale=loss_scale,
            compress=compress,
            buffers=buffers,
        )

    def owned_slices(self, layout: GroupLayout) -> tuple[slice, slice]:
        """The ranges of ``layout``'s canonical buffer that this rank's worker and server errors cover: the whole
        buffer and chunk ``rank`` on the flat path; hierarchical, its shard and the shard's chunk its node serves."""
        c, topo = layout.chunk_numel, self.topology
        if topo is None:
            r = dist.get_rank(self.process_group) if dist.is_initialized() else 0
            return slice(0, layout.padded_numel), slice(r * c, (r + 1) * c)
        shard = layout.node_shard(topo.local_rank, topo.local_size)
        k = shard.first_chunk + topo.node
        return slice(shard.start, shard.start + shard.numel), slice(k * c, (k + 1) * c)

    @property
    def layout_key(self) -> list[int] | None:
        """``[processes per node, nodes]`` when averaging hierarchically (or :attr:`nodes_layout`, when set), else
        None (saved with the error state, whose shapes and owners depend on it)."""
        topo = self.topology
        if topo is None:
            return None if self.nodes_layout is None else list(self.nodes_layout)
        return [topo.local_size, topo.nodes]

    def close(self) -> None:
        """Stop the comm thread of the gradient path, if one was started, and drop the kept buffers (both come
        back when needed)."""
        self.kept.clear()
        worker, self.comm_worker = self.comm_worker, None
        if worker is not None:
            worker.close()

    def process_group_size(self) -> int:
        """Ranks in ``process_group`` (1 without an initialised process group)."""
        return dist.get_world_size(self.process_group) if dist.is_initialized() else 1

    @property
    def compressing(self) -> bool:
        """Whether the step now running (index ``step``) is a compressed one: past warm-up and decided ``"1bit"``."""
        return self.warmup_end is not None and self.step >= self.warmup_end and self.decision == "1bit"

    @property
    def refresh_due(self) -> bool:
        """Whether the step now running is one of ``config.variance_refresh``'s fp32 steps: ``n = step -
        compressed_since`` is ``R * (2**j - 1)`` for some ``j >= 1`` (``R, 3R, 7R, ...``), in a compressed stage,
        outside a ``compression="auto"`` trial; or the step after a refresh that a GradScaler skipped
        (:attr:`refresh_missed`). A function of saved counters, so a resume keeps it."""
        r, since = self.config.variance_refresh, self.compressed_since
        if not r or since is None or not self.compressing or self.trial_until is not None:
            return False
        if self.refresh_missed:
            return True
        n = self.step - since
        if n <= 0 or n % r:
            return False
        q = n // r + 1
        return q & (q - 1) == 0

    @property
    def needs_decision(self) -> bool:
        """Whether ``compression="auto"`` has to measure before the step now running (collective: all ranks agree)."""
        cfg = self.config
        end = self.warmup_end
        if cfg.compression != "auto" or end is None or self.step < end or self.trial_until is not None:
            return False
        if self.decision_held:  # switched off for the rest of the fit: a recheck would switch 1-bit on again
            return False
        if self.decide_from is not None and self.step < self.decide_from:  # a resumed process times its own first
            return False
        if self.decision is None:
            return True
        return (
            bool(cfg.recheck_every)
            and (self.step - end) % cfg.recheck_every == 0
            and (not self.decisions or self.decisions[-1]["step"] != self.step)
        )

    def begin_stage(self, step: int) -> None:
        """Enter a compressed stage at ``step`` unless one is in progress (the momentum step calls it at each of its
        steps): ``compressed_since`` becomes ``step`` and :attr:`stage_token` a fresh object."""
        if self.compressed_since is None:
            self.compressed_since = step
            self.stage_token = object()

    def end_stage(self) -> None:
        """Leave the compressed stage in progress, if any: the next compressed step begins a new one, which freezes
        Adam's variance again (the steps in between updated it)."""
        self.compressed_since = None
        self.stage_token = None
        self.refresh_missed = False

    def set_signal(self, mode: str, kinds: Iterable[str] = (), *, warn: bool = True) -> None:
        """Set what this fit compresses: ``mode`` (``"gradients"`` or ``"momentum"``) and, for momentum, the momentum
        ``kinds`` of its optimizers (:func:`~lightning_accel.comm.momentum.momentum_kind`).

        Error state loaded from a checkpoint that compressed another signal is reset to zero with a warning
        (``warn=False``: silently; every rank resets alike): its residuals are in other units (gradients, SGD
        momentum, or Adam's preconditioned momentum ``m / D``), and the groups of both paths are keyed by the same
        parameter indices, so they would otherwise be adopted as they are. Its compressed stage ends too (the fit
        that saved it updated the optimizer's state in another way).
        """
        check_choice("mode", mode, ("gradients", "momentum"))
        self.mode = mode
        self.kinds = tuple(sorted(set(kinds))) if mode == "momentum" else ()
        loaded, self.loaded_signal = self.loaded_signal, None
        if loaded is None:
            return
        saved_mode, saved_kinds = loaded
        if saved_mode == mode and (saved_kinds is None or saved_kinds == self.kinds):
            return
        had_errors = bool(self.pending or self.groups)
        self._reset_errors()
        if warn and had_errors:
            warnings.warn(
                f"1-bit error-feedback state was saved compressing {_signal_str(saved_mode, saved_kinds)} and is "
                f"loaded into a fit compressing {_signal_str(mode, self.kinds)}: the error state is reset to zero "
                "(training continues compressed).",
                stacklevel=2,
            )

    def set_decision(self, decision: str) -> None:
        """Enter ``decision`` (``"1bit"`` or ``"fp32"``) from the step now running; a change resets the error state."""
        check_choice("decision", decision, ("1bit", "fp32"))
        if decision != self.decision:
            self._reset_errors()
        self.decision = decision

    def _reset_errors(self) -> None:
        """Zero the error state (and the compressed stage with it): it belongs to another way of compressing."""
        self.groups.clear()
        self.pending.clear()
        self.plans.clear()
        self.kept.clear()
        self.end_stage()

    def __getstate__(self) -> dict[str, Any]:
        # the process group, the id()-keyed maps and the callbacks do not survive pickling; the error state does
        # (call `set_parameters` again after unpickling)
        dropped = (
            "process_group",
            "plans",
            "kept",
            "comm_worker",
            "loss_scale_fn",
            "param_index",
            "measure_fn",
            "bucket_fn",
            "topology",
            "refreshing",
            "stage_token",
            "loaded_signal",
        )
        return {k: getattr(self, k) for k in self.__slots__ if k not in dropped}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.plans = {}
        self.kept = {}
        self.comm_worker = None
        self.loss_scale_fn = None
        self.measure_fn = None
        self.bucket_fn = None
        self.topology = None
        self.refreshing = False
        self.param_index = {}
        self.decide_from = None  # absent from states pickled before it existed
        self.decision_held = False  # absent from states pickled before it existed
        self.nodes_layout = None  # absent from states pickled before it existed
        self.stage_token = None  # the stage (if any) continues from a saved state: its freeze marks hold
        self.loaded_signal = None
        self.kinds = ()
        for k, v in state.items():
            setattr(self, k, v)

    # ----------------------------------------------------------------- checkpointing (this rank)
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``{"format", "world_size", "nodes_layout", "step", "mode", "kinds", "decision",
        "trial_until", "compressed_since", "refresh_missed", "warmup_end", "hparams", "groups": {"i,j,..": {"worker",
        "server"}}}`` (``nodes_layout``: :attr:`layout_key`; ``kinds``: :attr:`kinds`, as a list; ``trial_until``: not
        None when saved during a ``compression="auto"`` trial, whose ``decision`` is then the mode being tried, not a
        measured one).

        Only tensors, ints, strings, bools and None, so ``torch.load(weights_only=True)`` reads it back. The momentum
        and the frozen variance live in the optimizer's own state (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``),
        which Lightning checkpoints already.
        """
        groups = {_key_str(k): {"worker": g.worker_error, "server": g.server_error} for k, g in self.groups.items()}
        for k, (w, s) in self.pending.items():  # loaded but not adopted yet: keep it
            groups.setdefault(_key_str(k), {"worker": w, "server": s})
        return {
            "format": _FORMAT,
            "world_size": dist.get_world_size(self.process_group) if dist.is_initialized() else 1,
            "nodes_layout": self.layout_key,
            "step": self.step,
            "mode": self.mode,
            "kinds": list(self.kinds),
            "decision": self.decision,
            "trial_until": self.trial_until,
            "compressed_since": self.compressed_since,
            "refresh_missed": self.refresh_missed,
            "warmup_end": self.warmup_end,
            "hparams": {"block_size": self.config.block_size, "error_feedback": self.config.error_feedback},
            "groups": dict(sorted(groups.items())),
        }

    def load_state_dict(self, state: dict[str, Any], world_size: int | None = None, *, warn: bool = True) -> None:
        """Restore :meth:`state_dict` output; error tensors are adopted when their group first appears.

        With another world size, block size or node layout (flat against hierarchical, other processes per node) the
        error state cannot be mapped (chunks change owners, worker errors change shape): it is reset with a warning
        (``warn=False``: silently; every rank resets alike, so one rank warning is enough), and the step count
        (warm-up progress) and the decision are kept.

        ``compression="auto"``: a decision saved during a trial of real steps (``trial_until`` set) is the mode being
        tried, not a measured one, and the trial's step times are not saved: it loads as undecided, so the trial runs
        again (:class:`~lightning_accel.comm.auto.StepTrial` starts it once the resumed process has timed steps of its
        own). (States saved without ``trial_until`` load their decision as it is.)

        A compressed stage continues only into a fit that compresses from the loaded step on: loaded into one that does
        not (``compression="fp32"``, a warm-up that ends later, ``"auto"`` undecided), ``compressed_since`` is
        cleared, so the stage that fit eventually begins freezes Adam's variance again, and its own checkpoints do not
        carry the old stage on. The saved ``mode`` and ``kinds`` are compared with this fit's by :meth:`set_signal`
        (their error state is in other units when they differ).
        """
        if state.get("format") not in _READABLE:
            raise ValueError(
                f"`state` has format {state.get('format')!r}, expected one of {_READABLE}: not a 1-bit state."
            )
        if world_size is None:
            world_size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        self.step = int(state["step"])
        saved_mode = state.get("mode") or "gradients"  # format 1 compressed gradients only
        self.mode = saved_mode
        kinds = state.get("kinds")  # absent before it was saved: only the mode is compared
        self.loaded_signal = (saved_mode, None if kinds is None else tuple(sorted(set(kinds))))
        self.trial_until = None  # a trial's step times live in the process that took them
        if self.config.compression == "auto" and state.get("decision") is not None:
            # saved mid-trial: undecided, else the tried mode would be kept for good without being measured
            self.decision = None if state.get("trial_until") is not None else state["decision"]
        self.compressed_since = state.get("compressed_since")
        self.stage_token = None  # restored, not begun here: the optimizer's freeze marks of this stage hold
        self.refresh_missed = bool(state.get("refresh_missed", False))  # absent before: none missed
        if self.config.warmup_steps == "auto" and state.get("warmup_end") is not None:
            self.warmup_end = int(state["warmup_end"])  # resolved before the save; an explicit integer wins
        if not self.compressing:
            # this fit does not continue the stage: its first steps update Adam's variance (fp32 or warm-up steps),
            # so the stage it begins later must freeze it again, and its checkpoints must not carry this one on
            self.end_stage()
        self.groups.clear()
        self.plans.clear()
        self.pending.clear()
        block_size = self.config.block_size
        saved_layout = state.get("nodes_layout")  # absent before hierarchical averaging: flat
        if saved_layout != self.layout_key:
            if warn:
                warnings.warn(
                    f"1-bit error-feedback state was saved with node layout {saved_layout!r} ([processes per node, "
                    f"nodes]; None: flat) and is loaded with {self.layout_key!r}: the error state is reset to zero "
                    "(training continues compressed).",
                    stacklevel=2,
                )
            return
        if state["world_size"] != world_size or state["hparams"]["block_size"] != block_size:
            if warn:
                warnings.warn(
                    f"1-bit error-feedback state was saved with world_size={state['world_size']}, "
                    f"block_size={state['hparams']['block_size']} and is loaded with world_size={world_size}, "
                    f"block_size={block_size}: the error state is reset to zero (training continues compressed).",
                    stacklevel=2,
                )
            return
        for k, v in state["groups"].items():
            self.pending[_key_parse(k)] = (v["worker"], v["server"])


def compressor_for(backend: str, device: torch.device) -> CompressFn:
    """The compressor ``compressor_backend=backend`` runs on tensors of ``device`` (see
    :meth:`OneBitState.compressor`). Call it before the first compressed step too (the strategy does when the fit
    sets up), so a forced Triton kernel that cannot run is refused then, not after the warm-up.

    Raises:
        RuntimeError: a forced ``"triton"`` that cannot run on ``device`` (no CUDA and no interpreter, or no triton
            package), in one line naming ``compressor_backend``.
    """
    try:
        triton = use_triton(device, backend, COMPRESSOR_BACKENDS)
    except RuntimeError as err:
        # the shared switch names its callers' `backend=`: here that is the deprecated spelling, and the argument the
        # user set is `compressor_backend` (the process-group backend is another argument altogether)
        raise RuntimeError(str(err).replace("`backend=", "`compressor_backend=")) from None
    if triton:
        from lightning_accel.comm.triton_kernels import compress_triton

        return compress_triton
    return compress_reference if backend == "reference" else compress_fast


def gather_state_dict(state: OneBitState, dst: int | None = None) -> dict[str, Any] | None:
    """Collective: every rank's :meth:`OneBitState.state_dict`, stacked per group (``worker``: ``(N, padded)``).

    All ranks must call it (they hold the same groups: same buckets, same warm-up). The error tensors of every group
    travel as one flat tensor per dtype in one collective (no pickling; a checkpoint save pays one round trip, not two
    per bucket). With ``dst`` (a global rank of the group: the one that writes the checkpoint) that collective is a
    ``gather``: only ``dst`` receives the other ranks' bytes and returns the stacked state, the others return None.
    Without it, an ``all_gather``: every rank returns it.
    """
    local = state.state_dict()
    if local["world_size"] == 1:
        return _stacked_alone(local)
    receive = dst is None or dist.get_rank() == dst
    issued = _issue_gathers(state, local, dst, receive, async_op=False)
    return _assemble(local, issued) if receive else None


def gather_state_dict_async(state: OneBitState, dst: int) -> tuple[Deferred | None, list[Any]]:
    """:func:`gather_state_dict` to ``dst`` with its collectives issued asynchronously, so no rank waits for them here.

    The error tensors are copied when the collectives are issued (the next step may change them meanwhile). Returns
    ``(value, works)``: on ``dst`` a :class:`~lightning_accel._utils.deferred.Deferred` whose result is the stacked
    state (waiting for the collectives first), elsewhere None; on every rank the collectives' work handles, to wait
    for before the process group goes (a failure of the collective surfaces there, or from the result on ``dst``).
    """
    local = state.state_dict()
    if local["world_size"] == 1:  # nothing to gather: copied now, as the snapshot of a value would be
        stacked = _stacked_alone(local)
        stacked["groups"] = {k: {t: x.clone() for t, x in v.items()} for k, v in stacked["groups"].items()}
        return Deferred(lambda: stacked), []
    receive = dist.get_rank() == dst
    issued = _issue_gathers(state, local, dst, receive, async_op=True)
    works = [work for _, _, work in issued if work is not None]
    if not receive:
        return None, works

    def produce() -> dict[str, Any]:
        for work in works:
            work.wait()
        return _assemble(local, issued)

    return Deferred(produce), works


def _stacked_alone(local: dict[str, Any]) -> dict[str, Any]:
    return {**local, "groups": {k: {t: v[t].unsqueeze(0) for t in v} for k, v in local["groups"].items()}}


def _issue_gathers(
    state: OneBitState, local: dict[str, Any], dst: int | None, receive: bool, *, async_op: bool
) -> list[tuple[list[int], list[torch.Tensor] | None, Any]]:
    """One gather (to ``dst``) or all-gather per dtype of the error tensors, in the same order on every rank: per
    dtype, the pieces' indices (into :func:`_pieces`), the received flat tensors (None where nothing is received)
    and the work handle (None when not ``async_op``)."""
    n = local["world_size"]
    pieces = _pieces(local)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, _, x) in enumerate(pieces):
        by_dtype.setdefault(x.dtype, []).append(i)
    issued = []
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        idx = by_dtype[dtype]
        flat = torch.cat([pieces[i][2].reshape(-1) for i in idx])  # a copy: what is sent cannot change any more
        parts: list[torch.Tensor] | None = [torch.empty_like(flat) for _ in range(n)] if receive else None
        if parts is not None and dst is None:
            work = dist.all_gather(parts, flat, group=state.process_group, async_op=async_op)
        else:
            work = dist.gather(flat, parts, dst=dst, group=state.process_group, async_op=async_op)
        issued.append((idx, parts, work))
    return issued


def _pieces(local: dict[str, Any]) -> list[tuple[str, str, torch.Tensor]]:
    return [(k, t, v[t]) for k, v in local["groups"].items() for t in ("worker", "server")]


def _assemble(local: dict[str, Any], issued: list[tuple[list[int], list[torch.Tensor] | None, Any]]) -> dict[str, Any]:
    """The stacked state from the received flat tensors of :func:`_issue_gathers` (collectives finished)."""
    n = local["world_size"]
    pieces = _pieces(local)
    out: dict[str, Any] = {**local, "groups": {k: {} for k in local["groups"]}}
    for idx, parts, _ in issued:
        assert parts is not None
        off = 0
        for i in idx:
            k, t, x = pieces[i]
            m = x.numel()
            out["groups"][k][t] = torch.stack([p[off : off + m] for p in parts]).reshape(n, *x.shape).cpu()
            off += m
    return out


def check_gathered_state(gathered: Mapping[str, Any]) -> None:
    """Refuse :func:`gather_state_dict` output that does not hold every rank's error tensors: each group's ``worker``
    and ``server`` must be tensors with one row per rank of its ``world_size``.

    Every rank reads the whole gathered state, so every rank reaches the same verdict with the same line, without
    communicating; :func:`select_rank_state` would otherwise fail on the ranks whose rows are missing alone.

    Raises:
        ValueError: a group's tensor missing, not a tensor, or with another number of rows, naming the group.
    """
    if not isinstance(gathered, Mapping):
        raise ValueError(
            f"the 1-bit error state is a {type(gathered).__name__}, expected a mapping: the checkpoint is incomplete "
            "or corrupt."
        )
    world = gathered.get("world_size")
    groups = gathered.get("groups")
    if not isinstance(world, int) or world < 1 or not isinstance(groups, Mapping):
        raise ValueError(
            f"the 1-bit error state has world_size {world!r} and groups of type {type(groups).__name__}, expected a "
            "positive integer and a mapping: the checkpoint is incomplete or corrupt."
        )
    for key, tensors in groups.items():
        for t in ("worker", "server"):
            x = tensors.get(t) if isinstance(tensors, Mapping) else None
            rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None
            if rows != world:
                if not isinstance(x, torch.Tensor):
                    found = "no tensor"
                else:
                    found = "a 0-d tensor" if rows is None else f"rows for {rows} of {world} ranks"
                raise ValueError(
                    f"the 1-bit error state of group {key!r} ({t}) holds {found}, expected one row per rank "
                    f"({world}): the checkpoint is incomplete or corrupt."
                )


def select_rank_state(gathered: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's slice of :func:`gather_state_dict` output (a :meth:`OneBitState.state_dict`)."""
    if gathered["world_size"] <= rank:
        return {**gathered, "groups": {}}
    return {**gathered, "groups": {k: {t: v[t][rank] for t in v} for k, v in gathered["groups"].items()}}
