"""``OneBitState``: hyper-parameters, per-group error-feedback state and statistics of the 1-bit comm hook."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from lightning_accel._utils.triton import check_backend
from lightning_accel.comm.compress import GroupLayout

__all__ = ["BACKENDS", "CommBackend", "GroupState", "OneBitState", "gather_state_dict", "select_rank_state"]

_FORMAT = 1

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


def _key_str(key: tuple[int, ...]) -> str:
    return ",".join(map(str, key))


def _key_parse(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


class OneBitState:
    """State of :func:`~lightning_accel.comm.hook.onebit_hook`, modelled on PowerSGD's ``PowerSGDState``.

    Tuning guide: keep ``warmup_steps`` long enough for the optimizer's statistics to settle (1-bit Adam warms up for
    ~15 % of training; for short fine-tunes 10-100 steps suffice); ``block_size`` trades scale bytes (32 bits per
    block) for accuracy (smaller blocks follow the gradient's magnitude more closely); ``min_compress_numel`` keeps
    tiny buckets in fp32, where the fixed cost of two collectives outweighs the bytes saved.

    Hyper-parameters:
        process_group: the group to average over (None: the default group).
        warmup_steps: optimizer steps of plain fp32 allreduce before compressing; >= 2 because DDP rebuilds its
            buckets after the first iteration.
        block_size: maximum elements per scale block, a multiple of 8 (default 2048: 1.6 % scale overhead).
        min_compress_numel: buckets with fewer elements stay fp32.
        error_feedback: keep worker/server residuals (False gives plain scaled signSGD, for comparison only).
        backend: the compressor: ``"auto"`` (the fused Triton kernel for CUDA gradients when ``triton`` is
            installed, the torch compressor elsewhere), ``"triton"`` (always; needs CUDA gradients or
            ``TRITON_INTERPRET=1``) or ``"reference"`` (the torch compressor).

    Internal state:
        step: completed synchronising backward passes (== optimizer steps; the hook is not called inside ``no_sync``).
        groups: ``{key: GroupState}``, keyed by the sorted parameter indices of each group.
        param_index: ``{id(parameter): index}`` from :meth:`set_parameters` (first-seen order otherwise).
        loss_scale_fn: returns the AMP loss scale the gradients carry (tensor or float), or None.
        pending: error tensors loaded from a checkpoint, adopted when their group first appears.

    Stats (per rank):
        bytes_sent: bytes put on the wire by this hook since the start.
        fp32_bytes: what an fp32 ring allreduce of the same buckets would have sent.
        last_step_bytes_sent / last_step_fp32_bytes: the same for the last completed step.
        last_step_compressed_bytes / last_step_compressed_fp32_bytes: only the compressed buckets of the last step.
        compressed_calls / uncompressed_calls: buckets sent each way.
        nonfinite_groups: compressed groups whose result held NaN/Inf (their error state was left unchanged);
            counted on CPU only (on CUDA the state is kept by a device-side select, without a host sync).
    """

    __slots__ = (
        # hyper-parameters
        "process_group",
        "warmup_steps",
        "block_size",
        "min_compress_numel",
        "error_feedback",
        "backend",
        # internal state
        "step",
        "groups",
        "param_index",
        "loss_scale_fn",
        "pending",
        "plans",
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
        "_acc",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        warmup_steps: int = 10,
        block_size: int = 2048,
        min_compress_numel: int = 0,
        error_feedback: bool = True,
        backend: CommBackend = "auto",
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
        check_backend(backend, BACKENDS)
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.block_size = block_size
        self.min_compress_numel = min_compress_numel
        self.error_feedback = error_feedback
        self.backend = backend
        self.step = 0
        self.groups: dict[tuple[int, ...], GroupState] = {}
        self.param_index: dict[int, int] = {}
        self.loss_scale_fn = loss_scale_fn
        self.pending: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.plans: dict[Any, Any] = {}
        self.bytes_sent = 0
        self.fp32_bytes = 0
        self.last_step_bytes_sent = 0
        self.last_step_fp32_bytes = 0
        self.last_step_compressed_bytes = 0
        self.last_step_compressed_fp32_bytes = 0
        self.compressed_calls = 0
        self.uncompressed_calls = 0
        self.nonfinite_groups = 0
        self._acc = [0, 0, 0, 0]
        if parameters is not None:
            self.set_parameters(parameters)

    def set_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Number the model's parameters (``model.parameters()`` order) so group keys survive bucket rebuilds."""
        self.param_index = {id(p): i for i, p in enumerate(parameters)}
        self.plans.clear()

    @property
    def compression_ratio(self) -> float:
        """fp32 ring-allreduce bytes over bytes sent, for the compressed buckets of the last step (0 if none)."""
        if not self.last_step_compressed_bytes:
            return 0.0
        return self.last_step_compressed_fp32_bytes / self.last_step_compressed_bytes

    def __getstate__(self) -> dict[str, Any]:
        # the process group, the id()-keyed maps and the callback do not survive pickling; the error state does
        # (call `set_parameters` again after unpickling)
        dropped = ("process_group", "plans", "loss_scale_fn", "param_index")
        return {k: getattr(self, k) for k in self.__slots__ if k not in dropped}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.plans = {}
        self.loss_scale_fn = None
        self.param_index = {}
        for k, v in state.items():
            setattr(self, k, v)

    # ----------------------------------------------------------------- checkpointing (this rank)
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``{"format", "world_size", "step", "hparams", "groups": {"i,j,..": {...}}}``.

        Only tensors, ints, strings and bools, so ``torch.load(weights_only=True)`` reads it back.
        """
        groups = {_key_str(k): {"worker": g.worker_error, "server": g.server_error} for k, g in self.groups.items()}
        for k, (w, s) in self.pending.items():  # loaded but not adopted yet: keep it
            groups.setdefault(_key_str(k), {"worker": w, "server": s})
        return {
            "format": _FORMAT,
            "world_size": dist.get_world_size(self.process_group) if dist.is_initialized() else 1,
            "step": self.step,
            "hparams": {"block_size": self.block_size, "error_feedback": self.error_feedback},
            "groups": dict(sorted(groups.items())),
        }

    def load_state_dict(self, state: dict[str, Any], world_size: int | None = None) -> None:
        """Restore :meth:`state_dict` output; error tensors are adopted when their group first appears.

        With another world size or block size the error state cannot be mapped (chunks change owners): it is reset
        with a warning, and the step count (warm-up progress) is kept.
        """
        if state.get("format") != _FORMAT:
            raise ValueError(f"`state` has format {state.get('format')!r}, expected {_FORMAT}: not a 1-bit state.")
        if world_size is None:
            world_size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        self.step = int(state["step"])
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
