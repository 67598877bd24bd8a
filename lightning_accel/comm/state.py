"""``OneBitState``: hyper-parameters, per-group error-feedback state and statistics of the 1-bit comm hook."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from lightning_accel._utils.triton import check_backend, use_triton
from lightning_accel.comm.allreduce import CompressFn, OneBitBuffers
from lightning_accel.comm.compress import GroupLayout, compress_fast, compress_reference

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "COMPRESS_WHAT",
    "CommBackend",
    "CompressWhat",
    "Compression",
    "GroupState",
    "OneBitState",
    "gather_state_dict",
    "select_rank_state",
]

_FORMAT = 2
_READABLE = (1, 2)  # format 1 (gradient compression only) loads: no stage, no decision

#: what is compressed: the optimizer's momentum (SGD-momentum, Adam, AdamW), the gradients, or chosen per optimizer
CompressWhat = Literal["auto", "momentum", "gradients"]
COMPRESS_WHAT: tuple[CompressWhat, ...] = get_args(CompressWhat)
#: whether to compress after warm-up: measured at the end of warm-up, always, or never
Compression = Literal["auto", "1bit", "fp32"]
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)

# the compressor has a Triton kernel and its torch reference, and no separate "eager" oracle
CommBackend = Literal["auto", "triton", "reference"]
BACKENDS: tuple[CommBackend, ...] = get_args(CommBackend)


class GroupState:
    """Error-feedback state of one parameter group (normally one DDP bucket).

    Attributes:
        key: sorted model-parameter indices of the group (stable across DDP's bucket rebuild, unlike bucket indices).
        layout: the canonical layout for this world size.
        worker_error: float32 ``(padded_numel,)``, this rank's residual of its own gradients (unscaled units).
        server_error: float32 ``(chunk_numel,)``, this rank's residual of the averaged chunk it owns.
    """

    __slots__ = ("key", "layout", "server_error", "worker_error")

    def __init__(self, key: tuple[int, ...], layout: GroupLayout) -> None:
        self.key = key
        self.layout = layout
        self.worker_error = torch.zeros(layout.padded_numel, dtype=torch.float32, device=layout.device)
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


def _key_str(key: tuple[int, ...]) -> str:
    return ",".join(map(str, key))


def _key_parse(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


class OneBitState:
    """State of :func:`~lightning_accel.comm.hook.onebit_hook` and of the compressed momentum step, modelled on
    PowerSGD's ``PowerSGDState``.

    Tuning guide: keep ``warmup_steps`` long enough for the optimizer's statistics to settle (Adam's variance is
    frozen at the end of warm-up: 1-bit Adam warms up for ~15 % of training; for short fine-tunes 50-200 steps
    suffice); ``block_size`` trades scale bytes (32 bits per block) for accuracy (smaller blocks follow the
    magnitudes more closely); ``min_compress_numel`` keeps tiny gradient buckets in fp32, where the fixed cost of two
    collectives outweighs the bytes saved.

    Hyper-parameters:
        process_group: the group to average over (None: the default group).
        warmup_steps: optimizer steps of plain fp32 allreduce (and the unmodified optimizer) before compressing;
            >= 2 because DDP rebuilds its buckets after the first iteration.
        block_size: maximum elements per scale block, a multiple of 8 (default 640: 5 % scale overhead, ~30x
            fewer bytes than fp32; measured on the digits CNN with SGD momentum 0.9, 2048 lost 0.013 val accuracy
            against DDP and 512 lost 0.004).
        min_compress_numel: gradient buckets with fewer elements stay fp32 (gradient compression only).
        error_feedback: keep worker/server residuals (False gives plain scaled signs, for comparison only).
        backend: the compressor: ``"auto"`` (the fused Triton kernel for CUDA tensors when ``triton`` is
            installed, the torch compressor elsewhere), ``"triton"`` (always; needs CUDA tensors or
            ``TRITON_INTERPRET=1``) or ``"reference"`` (the torch compressor).
        compress: what travels compressed: ``"momentum"`` (the optimizer's momentum with a frozen Adam variance,
            :mod:`~lightning_accel.comm.momentum`; SGD with momentum, Adam, AdamW), ``"gradients"`` (the gradient
            buckets, in the comm hook) or ``"auto"`` (momentum where the optimizer supports it, else gradients).
            The hook alone (without an optimizer-side step) can only compress gradients.
        compression: ``"auto"`` (measure fp32 against compressed averaging at the end of warm-up and keep the
            faster: real steps with the strategy, this run's buffer sizes with the hook alone;
            :mod:`~lightning_accel.comm.auto`), ``"1bit"`` (always compress) or ``"fp32"`` (never: plain DDP).
        recheck_every: with ``compression="auto"``, measure again every this many steps after warm-up (0: never).
        group_numel: the momentum path compresses parameters in groups of about this many elements (in model
            order); communication of one group overlaps the compression of the next.

    Internal state:
        step: completed synchronising backward passes (== optimizer steps; the hook is not called inside ``no_sync``).
        mode: ``"gradients"`` or ``"momentum"``, resolved from ``compress`` once the optimizer is known.
        decision: ``"1bit"``, ``"fp32"`` or None (not decided yet) for the steps after warm-up.
        compressed_since: the step the current compressed stage began (Adam's variance is frozen there), or None.
        local_grads: whether the last synchronising backward left each rank's own gradients (compressed-momentum
            stage: the optimizer step must average the momentum) rather than averaged ones.
        decisions: ``[{"step", "fp32_s", "onebit_s", "decision"}]``, every measurement ``compression="auto"`` made.
        measure_fn: optional ``state -> (fp32_seconds, onebit_seconds)`` replacing the timing (tests, custom probes).
        trial_until: while ``compression="auto"`` times real steps of the other mode
            (:class:`~lightning_accel.comm.auto.StepTrial`), the step it decides at; None otherwise.
        groups: ``{key: GroupState}``, keyed by the sorted parameter indices of each group.
        param_index: ``{id(parameter): index}`` from :meth:`set_parameters` (first-seen order otherwise).
        param_numels: element counts of the trainable parameters by index (what ``"auto"`` times).
        loss_scale_fn: returns the AMP loss scale the gradients carry (tensor or float), or None.
        pending: error tensors loaded from a checkpoint, adopted when their group first appears.
        kept: ``{key: (layout, canonical input, OneBitBuffers or None)}``, what a group's compressed allreduce
            reuses between steps (:meth:`buffers_for`; not saved).
        comm_worker: the :class:`~lightning_accel.comm.hook.CommWorker` thread of the CPU gradient path (started at
            its first compressed bucket; stopped by :meth:`close`).
        bucket_fn: ``(params, grads) -> None`` or None; when set, the hook hands it each bucket's parameters and
            final local gradients in the compressed-momentum stage (the strategy sets it around the backward of a
            step that may start compressing during backward: :meth:`MomentumCompressor.on_bucket`).

    Stats (per rank):
        bytes_sent: bytes put on the wire by this hook since the start.
        fp32_bytes: what an fp32 ring allreduce of the same buckets would have sent.
        last_step_bytes_sent / last_step_fp32_bytes: the same for the last completed step.
        last_step_compressed_bytes / last_step_compressed_fp32_bytes: only the compressed buckets of the last step.
        compressed_calls / uncompressed_calls: buckets (or momentum groups) sent each way.
        nonfinite_groups: compressed groups whose result held NaN/Inf (their state was left unchanged);
            counted on CPU only (on CUDA the state is kept by a device-side select, without a host sync).
        last_step_comm_s: host seconds the last step spent in compressed averaging (hook and momentum step,
            compression, collectives and waits; 0 for fp32 steps).
    """

    __slots__ = (
        # hyper-parameters
        "process_group",
        "warmup_steps",
        "block_size",
        "min_compress_numel",
        "error_feedback",
        "backend",
        "compress",
        "compression",
        "recheck_every",
        "group_numel",
        # internal state
        "step",
        "mode",
        "decision",
        "compressed_since",
        "local_grads",
        "decisions",
        "measure_fn",
        "trial_until",
        "groups",
        "param_index",
        "param_numels",
        "loss_scale_fn",
        "pending",
        "plans",
        "kept",
        "comm_worker",
        "bucket_fn",
        # stats
        "bytes_sent",
        "fp32_bytes",
        "last_step_bytes_sent",
        "last_step_fp32_bytes",
        "last_step_compressed_bytes",
        "last_step_compressed_fp32_bytes",
        "compressed_calls",
        "uncompressed_calls",
        "nonfinite_groups",
        "last_step_comm_s",
        "_acc",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        warmup_steps: int = 10,
        block_size: int = 640,
        min_compress_numel: int = 0,
        error_feedback: bool = True,
        backend: CommBackend = "auto",
        compress: CompressWhat = "gradients",
        compression: Compression = "1bit",
        recheck_every: int = 0,
        group_numel: int = 1 << 22,
        parameters: Iterable[torch.nn.Parameter] | None = None,
        loss_scale_fn: Callable[[], torch.Tensor | float | None] | None = None,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
            raise ValueError(
                f"`warmup_steps` must be an integer >= 2, got {warmup_steps!r}. DDP rebuilds its buckets after the "
                "first iteration, so compression state made earlier would be stale; use e.g. `warmup_steps=10`."
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 8 or block_size % 8:
            raise ValueError(
                f"`block_size` must be a positive multiple of 8, got {block_size!r}. Use e.g. `block_size=2048`."
            )
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise ValueError(
                f"`min_compress_numel` must be an integer >= 0, got {min_compress_numel!r}. "
                "Use 0 to compress every bucket."
            )
        if not isinstance(error_feedback, bool):
            raise ValueError(
                f"`error_feedback` must be True or False, got {error_feedback!r}. Keep the default True for training."
            )
        if compress not in COMPRESS_WHAT:
            raise ValueError(
                f"`compress` must be one of {', '.join(map(repr, COMPRESS_WHAT))}, got {compress!r}. "
                "Use 'auto' (momentum for SGD-momentum/Adam/AdamW, gradients otherwise)."
            )
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"`compression` must be one of {', '.join(map(repr, COMPRESSIONS))}, got {compression!r}. "
                "Use 'auto' to measure which is faster at the end of warm-up."
            )
        if isinstance(recheck_every, bool) or not isinstance(recheck_every, int) or recheck_every < 0:
            raise ValueError(f"`recheck_every` must be an integer >= 0, got {recheck_every!r}. Use 0 to decide once.")
        if isinstance(group_numel, bool) or not isinstance(group_numel, int) or group_numel < 8:
            raise ValueError(f"`group_numel` must be an integer >= 8, got {group_numel!r}. Use e.g. `1 << 22`.")
        check_backend(backend, BACKENDS)
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.block_size = block_size
        self.min_compress_numel = min_compress_numel
        self.error_feedback = error_feedback
        self.backend = backend
        self.compress = compress
        self.compression = compression
        self.recheck_every = recheck_every
        self.group_numel = group_numel
        self.step = 0
        self.mode: str = "momentum" if compress == "momentum" else "gradients"
        self.decision: str | None = None if compression == "auto" else compression
        self.compressed_since: int | None = None
        self.local_grads = False
        self.decisions: list[dict[str, Any]] = []
        self.measure_fn: Callable[[OneBitState], tuple[float, float]] | None = None
        self.trial_until: int | None = None
        self.groups: dict[tuple[int, ...], GroupState] = {}
        self.param_index: dict[int, int] = {}
        self.param_numels: list[int] = []
        self.loss_scale_fn = loss_scale_fn
        self.pending: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.plans: dict[Any, Any] = {}
        self.kept: dict[tuple[int, ...], tuple[GroupLayout, torch.Tensor, OneBitBuffers | None]] = {}
        self.comm_worker: Any = None
        self.bucket_fn: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None
        self.bytes_sent = 0
        self.fp32_bytes = 0
        self.last_step_bytes_sent = 0
        self.last_step_fp32_bytes = 0
        self.last_step_compressed_bytes = 0
        self.last_step_compressed_fp32_bytes = 0
        self.compressed_calls = 0
        self.uncompressed_calls = 0
        self.nonfinite_groups = 0
        self.last_step_comm_s = 0.0
        self._acc = [0, 0, 0, 0]
        if parameters is not None:
            self.set_parameters(parameters)

    def set_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Number the model's parameters (``model.parameters()`` order) so group keys survive bucket rebuilds."""
        params = list(parameters)
        self.param_index = {id(p): i for i, p in enumerate(params)}
        self.param_numels = [p.numel() if p.requires_grad else 0 for p in params]
        self.plans.clear()

    def new_group(self, key: tuple[int, ...], numels: list[int], device: torch.device) -> tuple[GroupState, bool]:
        """A fresh group for ``key``, with the error state a checkpoint left for it in ``pending`` when it fits.

        Returns:
            The group and whether pending state for ``key`` was dropped because its shapes no longer fit (the caller
            decides whether that deserves a warning). The group is not registered in ``groups``.
        """
        g = GroupState(key, GroupLayout(numels, self.process_group_size(), self.block_size, device))
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
        """The compressor for tensors on ``device`` under ``backend`` (the hook, the momentum step and ``auto``'s
        timing all use this one): the fused Triton kernel where it runs, else the buffer-reusing CPU compressor
        (same bits, ~6x one add), or the readable oracle with ``backend="reference"``.

        Raises:
            RuntimeError: a forced ``"triton"`` that cannot run on ``device`` (no CUDA and no interpreter, or no
                triton package).
        """
        if use_triton(device, self.backend, BACKENDS):
            from lightning_accel.comm.triton_kernels import compress_triton

            return compress_triton
        return compress_reference if self.backend == "reference" else compress_fast

    def buffers_for(self, g: GroupState, fast: bool) -> tuple[torch.Tensor, OneBitBuffers | None]:
        """The group's kept canonical input buffer (zeros on padding, which its users never write) and, with
        ``fast`` (the CPU compressor), its kept :class:`~lightning_accel.comm.allreduce.OneBitBuffers`: a step
        allocates nothing big. A group that replaces others (overlapping keys) drops theirs."""
        kept = self.kept.get(g.key)
        if kept is None or kept[0] is not g.layout:
            for k in [k for k in self.kept if not set(k).isdisjoint(g.key)]:  # groups that no longer exist
                del self.kept[k]
            x = torch.zeros(g.layout.padded_numel, dtype=torch.float32, device=g.layout.device)
            kept = self.kept[g.key] = (g.layout, x, None)
        if fast and kept[2] is None:
            kept = self.kept[g.key] = (g.layout, kept[1], OneBitBuffers(g.layout, dist.get_rank(self.process_group)))
        return kept[1], kept[2] if fast else None

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
        return self.step >= self.warmup_steps and self.decision == "1bit"

    @property
    def needs_decision(self) -> bool:
        """Whether ``compression="auto"`` has to measure before the step now running (collective: all ranks agree)."""
        if self.compression != "auto" or self.step < self.warmup_steps or self.trial_until is not None:
            return False
        if self.decision is None:
            return True
        return (
            bool(self.recheck_every)
            and (self.step - self.warmup_steps) % self.recheck_every == 0
            and (not self.decisions or self.decisions[-1]["step"] != self.step)
        )

    def set_decision(self, decision: str) -> None:
        """Enter ``decision`` (``"1bit"`` or ``"fp32"``) from the step now running; a change resets the error state."""
        if decision not in ("1bit", "fp32"):
            raise ValueError(f"`decision` must be '1bit' or 'fp32', got {decision!r}.")
        if decision != self.decision:
            self.groups.clear()
            self.pending.clear()
            self.plans.clear()
            self.kept.clear()
            self.compressed_since = None
        self.decision = decision

    @property
    def compression_ratio(self) -> float:
        """fp32 ring-allreduce bytes over bytes sent, for the compressed buckets of the last step (0 if none)."""
        if not self.last_step_compressed_bytes:
            return 0.0
        return self.last_step_compressed_fp32_bytes / self.last_step_compressed_bytes

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
        self.param_index = {}
        for k, v in state.items():
            setattr(self, k, v)

    # ----------------------------------------------------------------- checkpointing (this rank)
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``{"format", "world_size", "step", "mode", "decision", "compressed_since", "hparams",
        "groups": {"i,j,..": {"worker", "server"}}}``.

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
            "step": self.step,
            "mode": self.mode,
            "decision": self.decision,
            "compressed_since": self.compressed_since,
            "hparams": {"block_size": self.block_size, "error_feedback": self.error_feedback},
            "groups": dict(sorted(groups.items())),
        }

    def load_state_dict(self, state: dict[str, Any], world_size: int | None = None) -> None:
        """Restore :meth:`state_dict` output; error tensors are adopted when their group first appears.

        With another world size or block size the error state cannot be mapped (chunks change owners): it is reset
        with a warning, and the step count (warm-up progress) and the decision are kept.
        """
        if state.get("format") not in _READABLE:
            raise ValueError(
                f"`state` has format {state.get('format')!r}, expected one of {_READABLE}: not a 1-bit state."
            )
        if world_size is None:
            world_size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        self.step = int(state["step"])
        if state.get("mode") is not None:
            self.mode = state["mode"]
        if self.compression == "auto" and state.get("decision") is not None:
            self.decision = state["decision"]
        self.compressed_since = state.get("compressed_since")
        self.groups.clear()
        self.plans.clear()
        self.pending.clear()
        if state["world_size"] != world_size or state["hparams"]["block_size"] != self.block_size:
            warnings.warn(
                f"1-bit error-feedback state was saved with world_size={state['world_size']}, "
                f"block_size={state['hparams']['block_size']} and is loaded with world_size={world_size}, "
                f"block_size={self.block_size}: the error state is reset to zero (training continues compressed).",
                stacklevel=2,
            )
            return
        for k, v in state["groups"].items():
            self.pending[_key_parse(k)] = (v["worker"], v["server"])


def gather_state_dict(state: OneBitState) -> dict[str, Any]:
    """Collective: every rank's :meth:`OneBitState.state_dict`, stacked per group (``worker``: ``(N, padded)``).

    All ranks must call it (they hold the same groups: same buckets, same warm-up). Tensors travel through
    ``all_gather`` (no pickling).
    """
    local = state.state_dict()
    n = local["world_size"]
    if n == 1:
        return {**local, "groups": {k: {t: v[t].unsqueeze(0) for t in v} for k, v in local["groups"].items()}}
    out: dict[str, Any] = {**local, "groups": {}}
    for k, v in local["groups"].items():
        entry = {}
        for t in ("worker", "server"):
            parts = [torch.empty_like(v[t]) for _ in range(n)]
            dist.all_gather(parts, v[t].contiguous(), group=state.process_group)
            entry[t] = torch.stack(parts).cpu()
        out["groups"][k] = entry
    return out


def select_rank_state(gathered: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's slice of :func:`gather_state_dict` output (a :meth:`OneBitState.state_dict`)."""
    if gathered["world_size"] <= rank:
        return {**gathered, "groups": {}}
    return {**gathered, "groups": {k: {t: v[t][rank] for t in v} for k, v in gathered["groups"].items()}}
