"""``OneBitDDPStrategy`` (``strategy="ddp_1bit"``): DDP whose averaging is 1-bit compressed after a warm-up.

A thin adapter over :mod:`lightning_accel.comm`: it builds the :class:`~lightning_accel.comm.OneBitState`, registers
:func:`~lightning_accel.comm.onebit_hook` on every device type (Lightning's ``DDPStrategy._register_ddp_hooks`` only
registers comm hooks on CUDA, so a ``ddp_comm_hook`` would be silently ignored on CPU/gloo), chooses what to compress
from the optimizers (momentum for SGD-momentum/Adam/AdamW, :class:`~lightning_accel.comm.MomentumCompressor`, run in
place of ``optimizer.step`` in the compressed stage; gradients otherwise), runs ``compression="auto"``'s measurement at
the end of warm-up, feeds the hook the AMP loss scale, logs ``comm/bytes_sent`` and ``comm/compression_ratio``, and
saves/restores every rank's error-feedback state and the stage in checkpoints.

Where the momentum is compressed: the momentum update needs the *final* local gradient of each parameter. With
``overlap`` (the default wherever it is safe) the hook hands each bucket's final local gradients to the compressor as
DDP produces them, and every group of parameters whose gradients are all final is compressed and its phase 1 sent
while backward computes the rest (:meth:`~lightning_accel.comm.MomentumCompressor.on_bucket`); the optimizer step
then finishes the groups and updates the parameters. Gradient clipping (the norm of the whole gradient), a GradScaler
(every bucket on every rank must be finite first), ``find_unused_parameters`` and code that edits gradients after
backward need the whole backward first: then the optimizer step compresses every group after backward, pipelined
(communication of one group overlaps the compression of the next). Both orders compute bit-identical results.

``LocalStepsStrategy`` (``strategy="diloco"``), below: local steps with a compressed outer update.

A thin adapter over :class:`~lightning_accel.comm.localsteps.LocalSteps`: it wraps the model in DDP (the sampler, the
initial broadcast, ``no_sync`` for accumulation stay Lightning's) but installs a comm hook that communicates nothing,
so every rank's optimizer steps on its own gradients; after each optimizer step it hands over to the outer schedule.
The fit ends with a last sync of every fragment that moved since its last one and every rank holding the shared
parameters ``θ_global``: as the step that ends it completes when Lightning's own rules foresee it (``max_steps``, the
last batch of ``max_epochs``), so the callbacks' hooks of that step and of the epoch's end (the checkpoints saved at the
end) see ``θ_global``; else (early stopping, ``max_time``) in ``on_train_end``, after the callbacks' own.

Its checkpoints: Lightning writes rank 0's model, optimizer and precision plugin; between syncs the ranks' parameters,
buffers (BatchNorm statistics), optimizer states and loss scales (each rank's GradScaler skips the steps its own
gradients overflow) differ, so every rank's own, and its outer state (error feedback, exchanges in flight), are
gathered into the checkpoint under :data:`LOCALSTEPS_CHECKPOINT_KEY` (world size x the model and optimizer size) and
each rank takes back its own on resume, bit-exact at the same world size.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from torch.optim import SGD, Optimizer
from typing_extensions import override

import lightning_accel.comm as comm
from lightning_accel._utils.checks import check_bool, check_choice, check_int, check_number
from lightning_accel._utils.clocks import CudaEventClock, HostClock
from lightning_accel._utils.compat import (
    PathType,
    ddp_ignored_names,
    grad_scaler_scale,
    redirect_find_unused_parameters_advice,
)
from lightning_accel._utils.deferred import Deferred, resolves_deferred
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.patching import active_patch, patch
from lightning_accel._utils.rank import distributed_ready, raise_if_any_rank_failed
from lightning_accel._utils.triton import triton_available
from lightning_accel.comm.config import (
    RENAMED,
    CompressedSignal,
    Compression,
    CompressorBackend,
    OneBitConfig,
    config_fields,
    resolve_renamed,
)
from lightning_accel.comm.localsteps import LocalSteps, LocalStepsConfig, OuterCompression
from lightning_accel.comm.state import check_gathered_state, compressor_for
from lightning_accel.comm.topology import HIERARCHICAL_CHOICES, Hierarchical, destroy_group

__all__ = ["CHECKPOINT_KEY", "LOCALSTEPS_CHECKPOINT_KEY", "STEP_PATCH_KEY", "LocalStepsStrategy", "OneBitDDPStrategy"]

CHECKPOINT_KEY = "lightning_accel_onebit"
#: the key of the ``optimizer.step`` replacement of the compressed-momentum stage (lightning_accel._utils.patching)
STEP_PATCH_KEY = "lightning_accel.comm.compressed_step"
_DEFAULTS = OneBitConfig()

# DistributedDataParallel's own keyword arguments (passed through); anything else is a typo worth an error.
_DDP_PARAMS = {
    k: v.default
    for k, v in inspect.signature(DistributedDataParallel.__init__).parameters.items()
    if k not in ("self", "module", "device_ids")
}
_DDP_KWARGS = frozenset(_DDP_PARAMS)
_REJECTED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
# DistributedDataParallel options that make DDP average some parameters itself, with a plain fp32 allreduce outside the
# comm hook (their gradients would travel uncompressed at every step, beside the strategy's own averaging)
_BYPASSING = ("delay_all_reduce_named_params", "param_to_hook_all_reduce")


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # tensors, meshes: never "equal" to a default
        return False


def _ddp_kwargs(
    kwargs: dict[str, Any],
    *,
    alias: str,
    cls: str,
    own: tuple[str, ...],
    why: str,
    refused: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The DDP / DistributedDataParallel keywords a strategy passes on: a competing comm hook, an option that averages
    parameters outside it, one of ``refused`` (name -> why the strategy cannot honour it) or an unknown keyword
    raises (naming it and the accepted ones); values equal to DDP's defaults are dropped (LightningCLI fills every
    argument in)."""
    for name in _REJECTED:
        if kwargs.pop(name, None) is not None:
            raise ValueError(
                f"`{name}` cannot be combined with `strategy='{alias}'`: {why}. Use `DDPStrategy` for a custom hook, "
                "or drop the argument."
            )
    for name in _BYPASSING:
        if kwargs.pop(name, None) is not None:
            raise ValueError(
                f"`{name}` cannot be combined with `strategy='{alias}'`: DDP would average those parameters itself, "
                "with an fp32 allreduce at every step outside the strategy's averaging. Drop the argument (or use "
                "`DDPStrategy`)."
            )
    for name, reason in (refused or {}).items():
        value = kwargs.pop(name, None)
        if value is not None:
            raise ValueError(
                f"`{name}` cannot be combined with `strategy='{alias}'`, got a {type(value).__name__}: {reason}. "
                "Drop the argument."
            )
    unknown = sorted(set(kwargs) - _DDP_KWARGS)
    if unknown:
        raise ValueError(
            f"Unknown option(s) {', '.join(f'`{u}`' for u in unknown)} for `{cls}`. Expected its own arguments "
            f"({', '.join(own)}), DDPStrategy's, or DistributedDataParallel's: {', '.join(sorted(_DDP_KWARGS))}. "
            "Check the spelling."
        )
    for name, value in kwargs.items():
        if name in _DDP_FLAGS and not (value is None and _DDP_PARAMS[name] is None):
            # DistributedDataParallel reads these as truthy: "no" or "false" from a config would turn them on
            check_bool(
                name, value, fix=f"Pass True or False (DistributedDataParallel's default: {_DDP_PARAMS[name]!r})."
            )
    if kwargs.get("bucket_cap_mb") is not None:
        # DDP multiplies it by 1024 * 1024 when it wraps the model: a string would fail only then, after the launch
        check_number(
            "bucket_cap_mb", kwargs["bucket_cap_mb"], low=0.0, allow_none=True, fix="DDP's default is 25 (MB)."
        )
    return {k: v for k, v in kwargs.items() if not _same(v, _DDP_PARAMS[k])}


#: DistributedDataParallel's on/off options (None, where it is their default, leaves DDP's own choice)
_DDP_FLAGS = frozenset(
    k for k, v in _DDP_PARAMS.items() if isinstance(v, bool) or k in ("broadcast_buffers", "forward_sync_buffers")
)
_START_METHODS = ("popen", "spawn", "fork", "forkserver")


def _check_ddp_arguments(timeout: Any, start_method: Any, process_group_backend: Any) -> None:
    """Refuse DDPStrategy's own arguments of the wrong type now, in one line: Lightning keeps them as given, and torch
    refuses them only when the processes have started and the process group is made."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"`timeout` must be a datetime.timedelta or None, got {timeout!r} ({type(timeout).__name__}). Use e.g. "
            "`timeout=datetime.timedelta(minutes=30)` (torch's default)."
        )
    check_choice("start_method", start_method, _START_METHODS, fix="Use 'popen' (Lightning's default).")
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise TypeError(
            f"`process_group_backend` must be a string or None, got {process_group_backend!r} "
            f"({type(process_group_backend).__name__}). Use 'nccl' (CUDA), 'gloo' (CPU), or None to let Lightning "
            "choose."
        )


#: the arguments of ``OneBitDDPStrategy`` that only shape compressed averaging: with ``compression="fp32"`` (plain DDP
#: from the first step) none of them changes anything (``recheck_every`` and ``overlap`` are refused on their own)
_COMPRESSION_ONLY = (
    "warmup_steps",
    "block_size",
    "min_compress_numel",
    "error_feedback",
    "compressor_backend",
    "compressed_signal",
    "group_numel",
    "variance_refresh",
)


def _refuse_inert_with_fp32(config: OneBitConfig, hierarchical: Any, processes_per_node: int | None) -> None:
    """Refuse, in one line naming each of them, the arguments other than their defaults that ``compression="fp32"``
    leaves without effect (a configuration that switches compression off but keeps tuning it would otherwise run
    plain DDP without a word). Defaults pass: LightningCLI fills every argument in."""
    inert = {
        name: getattr(config, name)
        for name in _COMPRESSION_ONLY
        if not _same(getattr(config, name), getattr(_DEFAULTS, name))
    }
    if hierarchical != "auto":
        inert["hierarchical"] = hierarchical
    if processes_per_node is not None:
        inert["processes_per_node"] = processes_per_node
    if not inert:
        return
    verb = "has" if len(inert) == 1 else "have"
    raise ValueError(
        f"{', '.join(f'`{k}={v!r}`' for k, v in inert.items())} {verb} no effect with `compression='fp32'`: plain DDP "
        "averages in fp32 from the first step, so no warm-up, scale block, error feedback, compressor, variance "
        f"refresh or node layout applies. Drop {', '.join(f'`{k}`' for k in inert)}, or use `compression='1bit'` "
        "(or `'auto'`) to compress."
    )


#: an explicit ``compressed_signal`` -> the arguments only the other signal uses, and what each does there
_OTHER_SIGNAL = {
    "gradients": (
        ("variance_refresh", "it refreshes the frozen variance of compressed Adam momentum"),
        ("group_numel", "it sizes the groups of compressed momentum (the gradient path compresses DDP's buckets)"),
    ),
    "momentum": (("min_compress_numel", "it keeps small gradient buckets in fp32 on the gradient path"),),
}


def _refuse_other_signal(config: OneBitConfig) -> None:
    """Refuse, in one line, an argument other than its default that the explicit ``compressed_signal`` leaves without
    effect (with ``"auto"`` the optimizers decide, when the fit sets up)."""
    signal = config.compressed_signal
    for name, what in _OTHER_SIGNAL.get(signal, ()):
        value = getattr(config, name)
        if not _same(value, getattr(_DEFAULTS, name)):
            raise ValueError(
                f"`{name}={value!r}` has no effect with `compressed_signal={signal!r}`: {what}. Drop `{name}`, or use "
                "`compressed_signal='auto'` (momentum for SGD-momentum/Adam/AdamW, gradients otherwise)."
            )


#: the barrier ``Trainer.save_checkpoint`` ends with
SAVE_BARRIER = "Trainer.save_checkpoint"


def _with_extras(gathered: Deferred, extras: dict[str, Any]) -> dict[str, Any]:
    return {**gathered.result(), **extras}


def _weights_only(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` is a weights-only dump (``trainer.save_checkpoint(..., weights_only=True)``,
    ``ModelCheckpoint(save_weights_only=True)``): Lightning leaves out the optimizer states then, and refuses to resume
    training from such a file, so the strategies' resume state has no use in it. Every rank dumps alike, so every rank
    skips the same collective."""
    return "optimizer_states" not in checkpoint


def _trainable(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of ``module`` that DDP puts in its gradient buckets when it wraps it: those that require
    gradients, less the ones named in ``_ddp_params_and_buffers_to_ignore`` (shared ones once)."""
    ignored = ddp_ignored_names(module)
    return [p for name, p in module.named_parameters() if p.requires_grad and name not in ignored]


def _layout_blocker(params: Sequence[torch.Tensor]) -> str | None:
    """Why the momentum of ``params`` (those DDP averages) cannot be compressed during backward because of their
    memory layout (None: it can).

    DDP hands the hook contiguous views of the gradients of a channels_last parameter whose elements are not the
    gradient's (measured: up to 0.085 apart from ``p.grad`` for SmallResNet's convs under
    ``FusedPrecision(memory_format="channels_last")``); after backward, ``p.grad`` is right."""
    strided = [tuple(p.shape) for p in params if not p.is_contiguous()]
    if not strided:
        return None
    return (
        f"{len(strided)} parameters in a non-contiguous layout such as channels_last (e.g. shape {strided[0]}): DDP's "
        "bucket views of their gradients do not follow that layout"
    )


def _same_tensors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` hold the same tensor objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _on_cpu(state: comm.OneBitState) -> bool:
    """Whether the error-feedback tensors of ``state`` live on the CPU."""
    return all(x.device.type == "cpu" for g in state.groups.values() for x in (g.worker_error, g.server_error))


def _writes_behind(io: CheckpointIO | None) -> bool:
    """Whether ``io`` returns from a save before the file exists (a background writer: Lightning's
    ``AsyncCheckpointIO``, or an IO with ``async_save=True`` such as ``DeltaCheckpointIO``)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    return isinstance(io, AsyncCheckpointIO) or getattr(io, "async_save", False) is True


class _BackgroundSavesDDP(DDPStrategy):
    """``DDPStrategy`` whose barrier after a save is skipped when the checkpoint IO writes in the background (the base
    of this module's strategies)."""

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """DDP's barrier, except the one that ends ``Trainer.save_checkpoint`` when the checkpoint IO writes in the
        background.

        Lightning ends a save with that barrier so that every rank sees the file once it returns; a background writer
        never gives that (the file lands later, on rank 0's writer thread), so the barrier would only cost every save
        a round trip between the ranks. Every rank holds the same IO, so all skip it or none does.
        """
        name = args[0] if args else kwargs.get("name")
        if name == SAVE_BARRIER and _writes_behind(self.checkpoint_io):
            return
        super().barrier(*args, **kwargs)


class OneBitDDPStrategy(_BackgroundSavesDDP):
    """DDP with 1-bit compressed averaging and error feedback (``Trainer(strategy="ddp_1bit")``).

    After ``warmup_steps`` steps of plain DDP (fp32 allreduce, the unmodified optimizer), what the ranks average
    travels through the two-phase compressed allreduce (signs packed 8 per byte + one fp32 ``mean |x|`` scale per
    block): about 30x fewer bytes than an fp32 ring allreduce, at any number of processes. For SGD with momentum,
    Adam and AdamW that is the optimizer's momentum (Adam's variance frozen at the end of warm-up, as in DeepSpeed's
    1-bit Adam; the algorithm is in :mod:`lightning_accel.comm.momentum`), and DDP's own gradient allreduce does not
    run; for other optimizers it is the gradient buckets (with a warning). ``compression="auto"`` times real steps
    both ways at the end of warm-up and keeps plain DDP when compression does not pay. See ``docs/onebit.md``.

    Args:
        warmup_steps: steps of plain DDP first (>= 2: DDP rebuilds its buckets after step 1; Adam's variance is frozen
            at its end), or ``"auto"``: 10 for SGD, the gradient path and Adam/AdamW with
            ``variance_refresh > 0``; with ``variance_refresh=0``, until Adam's variance has settled (per-tensor means
            moved < 10 % over 5 steps), from step 10 and at the latest 15 % of the fit's steps
            (:mod:`lightning_accel.comm.warmup`). The resolved value is logged and saved in checkpoints (and, while
            ``"auto"`` is still deciding, what its next check compares with). A step here (and in ``variance_refresh``
            and ``recheck_every``) is an averaging step, a backward pass whose gradients DDP synchronises: one per
            optimizer step under automatic optimization; under manual optimization one per ``manual_backward``
            (two optimizers stepped after one backward count one).
        block_size: maximum elements per scale block (multiple of 8).
        min_compress_numel: gradient buckets smaller than this stay fp32 (the gradient path only; another value than
            the default is refused with ``compressed_signal="momentum"``, and warned about at setup when ``"auto"``
            compresses momentum).
        error_feedback: keep the compression residuals (turn off only to measure what they buy).
        compressor_backend: the compressor's kernel: ``"auto"`` (the fused Triton kernel for CUDA gradients, torch
            elsewhere), ``"triton"`` (always; needs CUDA or ``TRITON_INTERPRET=1``) or ``"reference"`` (the torch
            compressor). Not the process-group backend (``process_group_backend``).
        compressed_signal: what is compressed: ``"auto"`` (momentum for ``torch.optim.SGD`` with momentum,
            ``Adam``, ``AdamW``; gradients for other optimizers, with a warning naming them), ``"momentum"`` (raise if
            an optimizer is not supported) or ``"gradients"``.
        compression: whether to compress: ``"auto"`` (at the end of warm-up, time a few real steps with 1-bit
            averaging against the fp32 steps before them and keep the faster; logged with both figures), ``"1bit"``
            (always compress) or ``"fp32"`` (plain DDP: the arguments that only shape compression are refused beside
            it unless left at their defaults).
        recheck_every: with ``compression="auto"``, try the other mode again every this many steps (0: once);
            refused with another ``compression``.
        group_numel: the momentum path compresses in groups of about this many elements (pipelined; another value
            than the default is refused with ``compressed_signal="gradients"``, and warned about at setup when
            ``"auto"`` compresses gradients).
        variance_refresh: Adam/AdamW: steps after the freeze at which one fp32 step (an exact Adam step whose variance
            catches up) refreshes the frozen variance; the intervals then double (``R, 3R, 7R, ...`` steps into the
            compressed stage). 0 keeps it frozen, as 1-bit Adam does. Another value than the default is refused
            with ``compressed_signal="gradients"``; in a fit where no Adam/AdamW momentum is compressed
            (SGD-momentum, or ``"auto"`` choosing gradients) it does nothing, and a warning says so at setup.
        overlap: start compressing and sending each group's momentum during backward, as soon as DDP hands over the
            buckets that complete it (``True``), only after backward (``False``), or ``"auto"``: after backward when
            something needs the whole gradient first or may change it after backward (gradient clipping, a
            GradScaler, ``find_unused_parameters``, manual optimization, a LightningModule that overrides
            ``on_after_backward``, ``on_before_optimizer_step`` or ``configure_gradient_clipping``), else whichever
            order was faster over the first compressed steps (:class:`~lightning_accel.comm.OverlapTrial`: a few
            steps each way, the slowest rank's medians; logged, and in :attr:`overlap_decision`). Both give
            bit-identical results; a callback that edits gradients after backward needs ``overlap=False``. Only
            compressed momentum overlaps: ``True`` is refused with ``compression="fp32"`` or
            ``compressed_signal="gradients"``, and warned about when ``"auto"`` resolves to the gradient path.
        hierarchical: average in three steps across nodes of several processes (fp32 reduce-scatter inside each node,
            the 1-bit exchange between the ranks of different nodes that hold the same shard, all-gather inside the
            node: each *node*, not each rank, sends its compressed share over the slow link;
            :class:`~lightning_accel.comm.HierarchicalOneBitAllreduce`): ``"auto"`` (when there are several nodes
            and several processes per node), ``True`` (whenever the layout splits into several nodes; a job on one
            node raises) or ``False`` (the flat exchange between all ranks). The same averaging up to the
            compression error; the error state saved in checkpoints is per shard, so a resume keeps the layout it
            was saved with (another layout resets it, with a warning). With ``compression="fp32"`` no node groups are
            made (plain DDP averages), but the checkpoints still name the layout.
        processes_per_node: the processes each node runs, when it is not Lightning's ``devices`` (the number of
            processes this strategy launches or joins per node; ``LOCAL_WORLD_SIZE`` under torchrun). Ranks are
            numbered node-major, as every launcher does. Refused with ``hierarchical=False``, where it has no use,
            and when the fit sets up if it does not divide the number of processes.
        log_stats: log ``comm/bytes_sent`` (bytes this rank sent in the last step; hierarchical: between nodes) and
            ``comm/compression_ratio`` (fp32 ring-allreduce bytes over bytes sent) every training step.
        compress: deprecated name of ``compressed_signal`` (same values; a :class:`DeprecationWarning`).
        backend: deprecated name of ``compressor_backend`` (same values; a :class:`DeprecationWarning`).
        **kwargs: the :class:`~lightning.pytorch.strategies.DDPStrategy` arguments (accelerator, parallel_devices,
            cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout, start_method)
            and :class:`~torch.nn.parallel.DistributedDataParallel` options (``find_unused_parameters``,
            ``static_graph``, ``bucket_cap_mb``, ...).

    The hyper-parameters are checked at construction and kept as a :class:`~lightning_accel.comm.OneBitConfig`
    (:attr:`onebit_config`).

    Raises:
        TypeError: a hyper-parameter of the wrong type, a DDP on/off option that is not a bool, a ``bucket_cap_mb``
            that is not a number, a ``timeout`` that is not a ``timedelta`` or a ``process_group_backend`` that is
            not a string.
        ValueError: a bad hyper-parameter, an unknown keyword, a deprecated name beside its new one, a competing
            ``ddp_comm_hook``, a DDP option that averages parameters outside the 1-bit hook
            (``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``), ``overlap=True`` with
            ``find_unused_parameters=True``, ``overlap=True`` with ``compression="fp32"`` or
            ``compressed_signal="gradients"`` (nothing compresses momentum: it would do nothing),
            ``processes_per_node`` with ``hierarchical=False``,
            ``recheck_every`` with a ``compression`` other than ``"auto"``, or ``compression="fp32"`` beside another
            value than the default of ``warmup_steps``, ``block_size``, ``min_compress_numel``, ``error_feedback``,
            ``compressor_backend``, ``compressed_signal``, ``group_numel``, ``variance_refresh``, ``hierarchical``
            or ``processes_per_node`` (plain DDP compresses nothing: each would do nothing), or another value than
            the default of ``variance_refresh`` or ``group_numel`` with ``compressed_signal="gradients"`` or of
            ``min_compress_numel`` with ``compressed_signal="momentum"``.
        RuntimeError: ``compressor_backend="triton"`` without the ``triton`` package (here), or on a device it cannot
            run on (when the fit sets up: CPU tensors without ``TRITON_INTERPRET=1``).
    """

    strategy_name = "ddp_1bit"

    def __init__(
        self,
        *,
        warmup_steps: int | Literal["auto"] = _DEFAULTS.warmup_steps,
        block_size: int = _DEFAULTS.block_size,
        min_compress_numel: int = _DEFAULTS.min_compress_numel,
        error_feedback: bool = _DEFAULTS.error_feedback,
        compressor_backend: CompressorBackend = _DEFAULTS.compressor_backend,
        compressed_signal: CompressedSignal = _DEFAULTS.compressed_signal,
        compression: Compression = _DEFAULTS.compression,
        recheck_every: int = _DEFAULTS.recheck_every,
        group_numel: int = _DEFAULTS.group_numel,
        variance_refresh: int = _DEFAULTS.variance_refresh,
        overlap: bool | Literal["auto"] = "auto",
        hierarchical: Hierarchical = "auto",
        processes_per_node: int | None = None,
        log_stats: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        compress: CompressedSignal | None = None,
        backend: CompressorBackend | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = locals()  # the hyper-parameters by name: the config is built from its own field list below
        kwargs = _ddp_kwargs(
            kwargs,
            alias="ddp_1bit",
            cls="OneBitDDPStrategy",
            own=(*config_fields(), "overlap", "hierarchical", "processes_per_node", "log_stats"),
            why="the strategy installs its own 1-bit comm hook",
        )
        _check_ddp_arguments(timeout, start_method, process_group_backend)
        given = {name: arguments[name] for name in (*config_fields(), *RENAMED)}
        # validated now (clear errors at construction); the state is built once the process group exists
        self._config = OneBitConfig(**resolve_renamed(given, defaults=_DEFAULTS))
        check_choice("overlap", overlap, (True, False, "auto"), fix="Use 'auto' to overlap whenever it is safe.")
        check_choice(
            "hierarchical", hierarchical, HIERARCHICAL_CHOICES, fix="Use 'auto' (hierarchical across several nodes)."
        )
        if processes_per_node is not None:
            check_int("processes_per_node", processes_per_node, low=1, fix="Give the processes each node runs.")
            if hierarchical is False:
                # it only splits the ranks into nodes for the hierarchical exchange: kept, it would change nothing
                raise ValueError(
                    f"`processes_per_node={processes_per_node}` has no effect with `hierarchical=False` (the flat "
                    "exchange between all ranks): it only lays out the nodes of hierarchical averaging. Drop "
                    "`processes_per_node`, or use `hierarchical='auto'` or `True`."
                )
        check_bool("log_stats", log_stats, fix="Use False to stop logging.")
        if self._config.compression == "fp32":
            _refuse_inert_with_fp32(self._config, hierarchical, processes_per_node)
        _refuse_other_signal(self._config)
        if self._config.compressor_backend == "triton" and not triton_available():
            # no device can run the kernel without the package: refused now (the fit's device is checked at setup)
            raise RuntimeError(
                "`compressor_backend='triton'` needs the `triton` package: `pip install triton` (Linux x86_64), or "
                "use `compressor_backend='auto'` to fall back to torch."
            )
        find_unused = bool(kwargs.get("find_unused_parameters", False))
        momentum = self._config.compressed_signal != "gradients" and self._config.compression != "fp32"
        if overlap is True and not momentum:
            # nothing compresses momentum then (plain DDP, or gradient buckets the hook compresses as they come): an
            # explicit request to overlap would be dropped without a word
            plain = self._config.compression == "fp32"
            what = "compression='fp32'" if plain else "compressed_signal='gradients'"
            raise ValueError(
                f"`overlap=True` has no effect with `{what}`: it starts compressing momentum during backward, and this "
                "strategy compresses no momentum. Drop `overlap` (or use `overlap='auto'`), or compress momentum "
                "(`compressed_signal='auto'` with `compression='1bit'` or `'auto'`)."
            )
        if overlap is True and find_unused and momentum:
            # both known now: refused here, not when the fit sets up (after the processes started and the model was
            # wrapped); the gradient path and fp32 never compress momentum, so `overlap` does not apply to them
            raise ValueError(
                f"`overlap=True` cannot start compressing during backward with `find_unused_parameters=True`, got "
                f"overlap={overlap!r} and find_unused_parameters={kwargs['find_unused_parameters']!r}: which "
                "parameters get a gradient is known only after backward. Use `overlap='auto'` (it compresses after "
                "backward then) or drop `find_unused_parameters`."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._log_stats = log_stats
        self._overlap_arg: bool | Literal["auto"] = overlap
        self._hierarchical_arg: Hierarchical = hierarchical
        self._processes_per_node = processes_per_node
        #: the node layout when this fit averages hierarchically (resolved when the model is wrapped), else None; its
        #: process groups are destroyed at teardown (its numbers stay readable)
        self.node_topology: comm.NodeTopology | None = None
        self._find_unused = find_unused
        #: whether the compressed momentum of this fit starts during backward (resolved at setup)
        self.overlap = False
        self._onebit_state: comm.OneBitState | None = None
        #: whether ``_onebit_state`` is the hook's state of the model DDP wraps in this fit (it stays inspectable
        #: after the fit; a later fit makes a new one)
        self._onebit_live = False
        self._onebit_loaded: dict[str, Any] | None = None
        #: the work handles of the last save's asynchronous gather of the error state (see `save_checkpoint`)
        self._state_gathers: list[Any] = []
        self._compressors: dict[int, comm.MomentumCompressor] = {}
        #: ``compression="auto"``'s timing, replaceable: ``state -> (fp32_seconds, onebit_seconds)`` (tests, probes);
        #: when set, it replaces the trial of real steps
        self.measure_fn: Callable[[comm.OneBitState], tuple[float, float]] | None = None
        #: the host clock that times the steps of the ``"auto"`` trials on the CPU (seconds; replaceable in tests; on
        #: CUDA, unless replaced, the steps are timed with CUDA events instead)
        self.step_clock: Callable[[], float] = time.perf_counter
        #: times each step from its forward to the end of its optimizer step, for the trials (made with the hook)
        self._step_timing: comm.StepTiming | None = None
        self._auto_trial: comm.StepTrial | None = None  # made with the hook (there is nothing to time without one)
        #: ``overlap="auto"``'s timing of overlapped against serial compressed steps (made at setup where overlapping
        #: is safe; None otherwise)
        self._overlap_trial: comm.OverlapTrial | None = None
        #: the overlap decision read from a checkpoint (adopted at setup: a resumed fit does not time both orders again)
        self._overlap_loaded: dict[str, Any] | None = None
        #: the gradients a manual-optimization fit on the gradient path left at the save it resumes from
        #: (:meth:`_leftover_grads`), given back at the start of training
        self._grads_loaded: dict[str, torch.Tensor] | None = None
        #: ``warmup_steps="auto"``'s watch of the variance until the warm-up ends (None otherwise)
        self._warmup_watch: comm.WarmupWatch | None = None
        #: the watch's state read from a checkpoint saved while it was deciding (adopted when it is made at setup)
        self._warmup_loaded: dict[str, Any] | None = None
        #: why 1-bit averaging was switched off for the rest of the fit (:meth:`switch_off`), or None
        self.switched_off_reason: str | None = None
        #: the switch-off reason read from a checkpoint (adopted with its 1-bit state: a resumed fit stays in fp32)
        self._switched_off_loaded: str | None = None
        #: the reason of a :meth:`switch_off` called while no fit was running (applied when the next fit sets up)
        self._switch_off_pending: str | None = None
        #: manual optimization: whether the training step now running is a variance refresh (decided before its
        #: backward, see :meth:`training_step`)
        self._manual_refresh = False
        #: the parameters that required gradients when DDP last wrapped the model (the ones its buckets carry)
        self._wrapped_trainable: list[torch.Tensor] = []
        #: whether the re-wrap under way follows a change of ``requires_grad`` alone (the same tensors, same shapes)
        self._same_tensors_rewrap = False

    # -- the lever protocol (lightning_accel._utils.levers.Lever) --------------------------------------------------
    lever_name = "ddp_1bit"

    @property
    def lever_active(self) -> bool:
        """Whether the step now running averages 1-bit compressed (past warm-up, decided ``"1bit"``)."""
        return self._onebit_state is not None and self._onebit_state.compressing

    def switch_off(self, reason: str) -> bool:
        """Average in fp32 (plain DDP allreduce, the optimizer's own step) from the next step on, for the rest of
        the fit; ``compression="auto"`` stops re-measuring. Call it on every rank at the same step (it does not
        communicate). Returns whether 1-bit averaging was on. The switch-off and its reason are saved in the
        checkpoints that follow it, so a fit resumed from one of them stays in fp32 averaging. A later ``fit`` of the
        same Trainer that resumes no such checkpoint starts again with its own warm-up and 1-bit averaging after it
        (:attr:`switched_off_reason` is cleared); call it again there to keep it off.

        Called while no fit is running (before ``fit``, or between two fits), it holds for the next fit from its
        first step, with its checkpoints as above, and returns False (1-bit averaging was not on)."""
        if not self._onebit_live:
            # no fit's state to switch yet: the next fit's setup applies it (the state of an earlier fit, still
            # inspectable, is left as it ended)
            if self._switch_off_pending is None:
                self._switch_off_pending = reason
            return False
        state = self._onebit_state
        if state is None or self.switched_off_reason is not None:
            return False
        was_on = state.compressing
        self._stay_off(state, reason)
        rank_zero_info(f"ddp_1bit: switched to fp32 averaging at step {state.step} ({reason})")
        return was_on

    def _stay_off(self, state: comm.OneBitState, reason: str) -> None:
        state.trial_until = None
        state.set_decision("fp32")  # drops the error-feedback state: it belongs to the compressed stage
        state.decision_held = True  # `compression="auto"`: no recheck measures its way back to 1-bit
        for c in self._compressors.values():
            c.release()
        self.switched_off_reason = reason

    def _adopt_switch_off(self, state: comm.OneBitState) -> None:
        """Keep the switch-off of the checkpoint being resumed (every rank reads the same one), if it holds one."""
        reason, self._switched_off_loaded = self._switched_off_loaded, None
        if reason is None or self.switched_off_reason is not None:
            return
        self._stay_off(state, reason)
        rank_zero_info(
            f"ddp_1bit: fp32 averaging continues from step {state.step} (switched off before the checkpoint: {reason})"
        )

    @property
    def onebit_config(self) -> OneBitConfig:
        """The hyper-parameters this strategy was built with (immutable)."""
        return self._config

    @property
    def onebit_state(self) -> comm.OneBitState | None:
        """The hook's state (None before ``fit`` sets up DDP, or with a single process)."""
        return self._onebit_state

    def _loss_scale_fn(self) -> Any:
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None
        if scaler is None:
            return None

        def loss_scale() -> torch.Tensor | None:
            # the scale the current backward used, as a device tensor (no host sync), created lazily
            return grad_scaler_scale(scaler) if scaler.is_enabled() else None

        return loss_scale

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DDP and register the 1-bit hook, on every device type. Called again during the fit (a
        callback that replaced the parameters wraps the model again: ``StructuredPruning``), the same state and
        schedule continue on the new parameters (no second warm-up; see :meth:`_rewrapped`)."""
        super().configure_ddp()  # wraps the model; DDPStrategy registers comm hooks only on CUDA, and has none here
        self._register_onebit_hook()

    def _register_onebit_hook(self) -> None:
        if self.world_size == 1:
            rank_zero_warn(
                "`strategy='ddp_1bit'` runs with a single process: there is nothing to compress, "
                "so training proceeds as plain (uncompressed) DDP.",
                category=UserWarning,
            )
            loaded, self._onebit_loaded = self._onebit_loaded, None
            self._switch_off_pending = None  # nothing compresses with a single process
            # nothing here uses it, and carrying it into this fit's checkpoints would hand a later multi-process
            # resume the state of the run before this one (its error feedback, step and decision)
            if loaded is not None:
                rank_zero_warn(
                    f"The checkpoint's 1-bit state was saved by {loaded.get('world_size')} processes and this fit runs "
                    "one process: it is dropped (its checkpoints hold none), so a resume with several processes "
                    "starts with a fresh warm-up. Resume with the same number of processes to keep it.",
                    category=UserWarning,
                )
            return
        assert isinstance(self.model, DistributedDataParallel)
        if self._onebit_live and self._onebit_state is not None:
            self._rewrapped(self._onebit_state)
            return
        # a new fit (a second `fit` of the same Trainer) builds a new state that compresses after its warm-up: a
        # switch-off of an earlier fit no longer holds, and left set it would make `switch_off` report "already off"
        # (a guard that turns 1-bit off again at the fit's start then leaves it on) and skip the "auto" trials
        self.switched_off_reason = None
        local = self._processes_per_node or self.num_processes
        if self._processes_per_node is not None and self.world_size % self._processes_per_node:
            # the ranks are not laid out that way: "auto" would take the flat exchange without a word (every rank
            # sees the same numbers, so every rank raises here, before any collective)
            raise ValueError(
                f"`processes_per_node={self._processes_per_node}` does not divide the job's {self.world_size} "
                "processes into nodes of that size. Give the processes each node runs (LOCAL_WORLD_SIZE under "
                "torchrun), or drop `processes_per_node` to use Lightning's `devices`."
            )
        self.node_topology = None
        hierarchical = comm.resolve_hierarchical(self._hierarchical_arg, self.world_size, local)
        if hierarchical and self._config.compression != "fp32":
            self.node_topology = comm.node_topology(local)  # collective: every rank is here
            topo = self.node_topology
            rank_zero_info(
                f"ddp_1bit: hierarchical averaging over {topo.nodes} nodes x {topo.local_size} processes (fp32 inside "
                "a node, 1-bit between nodes)"
            )
        if self._config.compression != "fp32":
            # a forced Triton compressor that cannot run on this fit's device: refused now, on every rank, instead of
            # at the first compressed step after the whole warm-up
            compressor_for(self._config.compressor_backend, self.root_device)
        state = comm.OneBitState(
            self.model.process_group,  # average over the group DDP uses (the one it was given, else the default)
            self._config,
            parameters=self.model.module.parameters(),
            loss_scale_fn=self._loss_scale_fn(),
            topology=self.node_topology,
        )
        if hierarchical and self.node_topology is None:
            # plain DDP never uses the node groups (two `new_group` collectives and their connections per fit), but
            # its checkpoints still name the layout, so a resume into a compressing fit of that layout adopts them
            # as before
            state.nodes_layout = [local, self.world_size // local]
        if self._config.warmup_steps == "auto":
            state.warmup_end = None  # resolved at setup (_resolve_warmup), unless the checkpoint below holds it
        if self._onebit_loaded is not None:
            # every rank resets alike when the error state cannot be mapped: one warning, from rank zero
            state.load_state_dict(
                comm.select_rank_state(self._onebit_loaded, self.global_rank), self.world_size, warn=self.is_global_zero
            )
            self._onebit_loaded = None
            self._adopt_switch_off(state)
        pending, self._switch_off_pending = self._switch_off_pending, None
        if pending is not None and self.switched_off_reason is None:
            self._stay_off(state, pending)
            rank_zero_info(f"ddp_1bit: fp32 averaging from step {state.step} (switched off before the fit: {pending})")
        state.measure_fn = self.measure_fn
        self._auto_trial = comm.StepTrial()
        cuda = self.root_device.type == "cuda" and self.step_clock is time.perf_counter
        self._step_timing = comm.StepTiming(CudaEventClock(self.root_device) if cuda else HostClock(self.step_clock))
        self._onebit_state = state
        self.model.register_comm_hook(state, comm.onebit_hook)
        self._onebit_live = True
        self._wrapped_trainable = _trainable(self.model.module)

    def _rewrapped(self, state: comm.OneBitState) -> None:
        """The model was wrapped in DDP again during this fit (``configure_ddp`` called after ``setup``: a callback
        that reshaped parameters, such as :class:`~lightning_accel.recipes.StructuredPruning`): the same state and
        schedule continue on the new parameters.

        The step count, the warm-up (resolved or still watched), ``compression="auto"``'s decision and trial, the
        overlap decision, the compressed stage (Adam's frozen variance: the optimizer's own state, which the caller
        re-pointed and reshaped with the parameters) and the statistics are kept; no second warm-up runs. The error
        feedback of groups whose parameters changed size restarts from zero (one line says how many); DDP rebuilding
        the new wrapper's buckets after its first step is handled as after a resume. Every rank re-wraps at the same
        step (the caller's collective re-wrap), so every rank keeps and drops the same state.
        """
        assert isinstance(self.model, DistributedDataParallel)
        state.close()  # the gradient path's comm thread and the kept buffers belong to the old layouts
        state.process_group = self.model.process_group
        if self._same_tensors_rewrap:
            # the same tensors with the same shapes (only which of them require gradients changed): every group's
            # layout still holds, and a resumed fit, wrapped before its callbacks unfroze them again, keeps the error
            # state its checkpoint holds for them, as the uninterrupted fit kept it
            state.set_parameters(self.model.module.parameters())
            state.kept.clear()
            dropped = 0
        else:
            dropped = state.replace_parameters(self.model.module.parameters())
        for c in self._compressors.values():
            c.parameters_replaced()
        self.model.register_comm_hook(state, comm.onebit_hook)
        self._wrapped_trainable = _trainable(self.model.module)
        stage = "compressed" if state.compressing else "fp32"
        rank_zero_info(
            f"ddp_1bit: the model was wrapped in DDP again at step {state.step}; the {stage} schedule continues "
            f"({state.mode}, no second warm-up), the error feedback of {dropped} group(s) whose parameters changed "
            "size restarts from zero"
        )

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # wraps the model (configure_ddp registers the hook), then sets up the optimizers
        if trainer.state.fn != TrainerFn.FITTING:
            # validate / test / predict wrap nothing and step nothing, but the strategy still holds the last fit's
            # optimizers: resolving again would replace that fit's decisions (the measured overlap order) with
            # undecided ones, and a checkpoint saved afterwards would lose them
            return
        self._resolve_compress()
        self._resolve_overlap(trainer)
        self._resolve_warmup(trainer)

    def _resolve_warmup(self, trainer: Any) -> None:
        """``warmup_steps="auto"``: watch Adam's variance (:class:`~lightning_accel.comm.WarmupWatch`) until it
        settles, at the latest 15 % of the fit; an integer, or a warm-up already resolved before a resume, wins."""
        state = self._onebit_state
        self._warmup_watch = None
        if state is None or state.warmup_end is not None or not list(self.optimizers):
            return
        if self._config.compression == "fp32":
            # plain DDP compresses nothing, so no variance is frozen: nothing to watch (no collective at the checks),
            # nothing to announce; the checkpoints hold the shortest warm-up, as they always have
            state.warmup_end = comm.AUTO_MIN_WARMUP
            return
        adams = [o for o in self.optimizers if comm.momentum_kind(o) == "adam" and state.mode == "momentum"]
        watch = comm.WarmupWatch(
            adams,
            comm.warmup_cap(float(trainer.estimated_stepping_batches)),
            refreshed=bool(state.config.variance_refresh),
            group=state.process_group,
            device=self.root_device,
        )
        if watch.watching:
            loaded, self._warmup_loaded = self._warmup_loaded, None
            if loaded is not None:  # saved between two checks: the next one compares with the check before the save
                watch.load_state_dict(loaded)
            self._warmup_watch = watch
        else:  # nothing to watch: decided now (no collective at the checks)
            state.warmup_end = comm.AUTO_MIN_WARMUP
            rank_zero_info(f"ddp_1bit warmup_steps='auto': {state.warmup_end} fp32 steps ({watch.reason})")

    def _overlap_blockers(self, trainer: Any) -> list[str]:
        """Why the momentum cannot be compressed during backward in this fit (empty: it can)."""
        out = []
        if trainer.gradient_clip_val:
            out.append(f"gradient clipping (`gradient_clip_val={trainer.gradient_clip_val}` needs the whole gradient)")
        if self._loss_scale_fn() is not None:
            out.append("a GradScaler (every bucket must be checked for Inf/NaN first)")
        if self._find_unused:
            out.append("`find_unused_parameters=True` (which parameters get a gradient is known only after backward)")
        module = self.lightning_module
        if module is not None:
            # checked again before every batch (`_check_overlap_layout`): a callback may unfreeze or convert some
            layout = _layout_blocker([p for p in module.parameters() if p.requires_grad])
            if layout is not None:
                out.append(layout)
            if not module.automatic_optimization:
                out.append("manual optimization")
            for hook in ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"):
                if is_overridden(hook, module):
                    out.append(f"the LightningModule's `{hook}` (it may change the gradients after backward)")
        if len(self._compressors) != 1:
            out.append(f"{len(self._compressors)} optimizers")
        return out

    def _resolve_overlap(self, trainer: Any) -> None:
        self.overlap = False
        self._overlap_trial = None
        if self._onebit_state is None or not self._compressors or self._overlap_arg is False:
            return
        if self._config.compression == "fp32":
            # plain DDP compresses no momentum: there is no order to choose, nor one to announce
            return
        blockers = self._overlap_blockers(trainer)
        if blockers and self._overlap_arg is True:
            raise ValueError(
                f"`overlap=True` cannot start compressing during backward with {'; '.join(blockers)}. "
                "Use `overlap='auto'` (it falls back to compressing after backward) or remove the blocker."
            )
        self.overlap = not blockers
        if self._overlap_arg == "auto":
            if self.overlap:  # safe: which order is faster is measured at the first compressed steps
                self._overlap_trial = comm.OverlapTrial()
                if self._adopt_overlap_decision():
                    return
            rank_zero_info(
                "ddp_1bit: compressed momentum during backward (overlap) or after it, whichever is faster in the "
                "first compressed steps"
                if self.overlap
                else f"ddp_1bit: compressed momentum starts after backward (no overlap: {'; '.join(blockers)})"
            )

    def _adopt_overlap_decision(self) -> bool:
        """Adopt the overlap decision of the checkpoint being resumed (every rank reads the same one), if any."""
        loaded, trial = self._overlap_loaded, self._overlap_trial
        if loaded is None or trial is None:
            return False
        trial.decision = dict(loaded)
        self.overlap = bool(loaded["overlap"])
        rank_zero_info(
            f"ddp_1bit overlap='auto': {'overlap' if self.overlap else 'serial'}, as decided at step {loaded['step']} "
            "of the checkpointed run"
        )
        return True

    @property
    def overlap_decision(self) -> dict[str, Any] | None:
        """``overlap="auto"``'s measurement once made: ``{"step", "overlap_s", "serial_s", "overlap"}`` (seconds per
        step, the slowest rank's median), else None."""
        return None if self._overlap_trial is None else self._overlap_trial.decision

    def _resolve_compress(self) -> None:
        """Momentum compression for supported optimizers, gradient compression otherwise (see ``compressed_signal``).

        Error feedback restored from a checkpoint that compressed another signal is reset here, with a warning
        (:meth:`~lightning_accel.comm.OneBitState.set_signal`): its residuals are in other units."""
        state = self._onebit_state
        self._compressors = {}
        if state is None:
            return
        want = self._config.compressed_signal
        optimizers: list[Optimizer] = list(self.optimizers)
        if not optimizers:  # validate / test / predict: nothing steps
            return
        kinds = {id(o): comm.momentum_kind(o) for o in optimizers}
        if want == "momentum":
            bad = [type(o).__name__ for o in optimizers if kinds[id(o)] is None and type(o) is not SGD]
            if bad:
                raise ValueError(
                    f"`compressed_signal='momentum'` needs torch.optim.SGD, Adam or AdamW, got {', '.join(bad)}. "
                    "Use `compressed_signal='auto'` (gradient compression for other optimizers) or "
                    "`compressed_signal='gradients'`."
                )
        elif want == "auto":
            unsupported = [o for o in optimizers if kinds[id(o)] is None]
            if unsupported:
                names = sorted({type(o).__name__ for o in unsupported if type(o) is not SGD})
                if names:
                    rank_zero_warn(
                        f"`strategy='ddp_1bit'` compresses the gradients for {', '.join(names)}: error-fed gradient "
                        "compression is proven only for plain SGD. Compressed momentum (which trains like DDP) "
                        "supports torch.optim.SGD with momentum, Adam and AdamW.",
                        category=UserWarning,
                    )
                want = "gradients"
                if self._overlap_arg is True:
                    # known only now (the optimizers' types): the fit runs, but the explicit request does nothing
                    rank_zero_warn(
                        f"`overlap=True` has no effect for {', '.join(sorted({type(o).__name__ for o in unsupported}))}"
                        ": `compressed_signal='auto'` compresses their gradients, and only compressed momentum "
                        "overlaps backward. Drop `overlap`, or use torch.optim.SGD with momentum, Adam or AdamW.",
                        category=UserWarning,
                    )
            else:
                want = "momentum"
        if want == "momentum":
            self._compressors = {id(o): comm.MomentumCompressor(o, state) for o in optimizers}
            if self._config.compression != "fp32" and self.model is not None:
                # a tensor the compressed step cannot average: refused now, not at the first compressed step (after
                # the whole warm-up); with "fp32" no compressed step ever runs, and the plain step trains it as DDP does
                params = list(self.model.parameters())
                for c in self._compressors.values():
                    c.check_parameters(params)
        # every rank compares the same saved signal with the same resolved one: all reset alike, rank zero warns
        state.set_signal(want, [c.kind for c in self._compressors.values()], warn=self.is_global_zero)
        self._warn_unused(optimizers)

    def _warn_unused(self, optimizers: list[Optimizer]) -> None:
        """Say, once per fit on rank zero, which arguments asked for (other than their defaults) do nothing with the
        signal this fit compresses: known only now, as the optimizers' types come with the fit (an explicit
        ``compressed_signal`` refuses them at construction already).

        - ``variance_refresh`` refreshes Adam's frozen variance: nothing when no optimizer has its Adam momentum
          compressed (SGD-momentum has no variance, the gradient path freezes none);
        - ``group_numel`` sizes the groups of compressed momentum: nothing on the gradient path (its groups are DDP's
          buckets);
        - ``min_compress_numel`` keeps small gradient buckets in fp32: nothing on the momentum path (no gradient
          bucket is compressed).
        """
        names = ", ".join(sorted({type(o).__name__ for o in optimizers}))
        unused: list[tuple[str, str, str]] = []  # (argument, what it does, why it does nothing here)
        refresh = self._config.variance_refresh
        if not _same(refresh, _DEFAULTS.variance_refresh) and not any(
            c.kind == "adam" for c in self._compressors.values()
        ):
            why = (
                f"{names} keeps no variance to freeze"
                if self._compressors
                else f"the gradients of {names} are compressed, and the gradient path freezes no variance"
            )
            unused.append(
                ("variance_refresh", "it refreshes the frozen variance of compressed Adam/AdamW momentum", why)
            )
        if not self._compressors and not _same(self._config.group_numel, _DEFAULTS.group_numel):
            unused.append(
                (
                    "group_numel",
                    "it sizes the groups of compressed momentum",
                    f"the gradients of {names} are compressed, in DDP's buckets",
                )
            )
        if self._compressors and not _same(self._config.min_compress_numel, _DEFAULTS.min_compress_numel):
            unused.append(
                (
                    "min_compress_numel",
                    "it keeps small gradient buckets in fp32",
                    f"the momentum of {names} is compressed, and no gradient bucket is",
                )
            )
        for name, what, why in unused:
            value = getattr(self._config, name)
            fix = (
                "train with torch.optim.Adam or AdamW"
                if name == "variance_refresh"
                else "set `compressed_signal` to the signal it applies to"
            )
            rank_zero_warn(
                f"`{name}={value}` has no effect in this fit: {what}, and {why}. Drop `{name}`, or {fix}.",
                category=UserWarning,
            )

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        with self._timed_step():
            return self._optimizer_step(optimizer, closure, model, **kwargs)

    @contextmanager
    def _timed_step(self) -> Iterator[None]:
        """One step's span for the ``"auto"`` trials (the outermost of the optimizer and training steps counts: see
        :class:`~lightning_accel.comm.auto.StepTiming`); a step that raises is not timed."""
        timing = self._step_timing
        if timing is None:
            yield
            return
        timing.begin()
        done = False
        try:
            yield
            done = True
        finally:
            span = timing.end()
            if done and span is not None:
                for trial in (self._auto_trial, self._overlap_trial):
                    if trial is not None:
                        trial.step_ended(span)

    def _optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        state, trial = self._onebit_state, self._auto_trial
        # warmup_steps="auto" ends before this step: first, so that compression="auto"'s trial starts at it
        watch = self._warmup_watch
        if state is not None and watch is not None and state.warmup_end is None and watch.end_at(state.step):
            state.warmup_end = state.step
            self._warmup_watch = None
            rank_zero_info(f"ddp_1bit warmup_steps='auto': {state.step} fp32 steps ({watch.reason})")
        if (
            state is not None
            and trial is not None
            and state.config.compression == "auto"
            and self.switched_off_reason is None
        ):
            # every rank reaches the optimizer step of the same step: time it, and start or end a trial of the other
            # mode before this step's backward runs
            trying = state.trial_until
            decision = trial.step_started(state, self.root_device)
            if decision == "fp32":
                for c in self._compressors.values():
                    c.release()
            if decision is not None:
                last = state.decisions[-1]
                rank_zero_info(
                    f"ddp_1bit compression='auto' at step {last['step']} ({last['source']}): fp32 "
                    f"{1e3 * last['fp32_s']:.2f} ms, 1-bit {1e3 * last['onebit_s']:.2f} ms per step -> {decision}"
                )
            elif trying is None and state.trial_until is not None:
                tried, before = ("1-bit", "fp32") if state.compressing else ("fp32", "1-bit")
                rank_zero_info(
                    f"ddp_1bit compression='auto' at step {state.step}: timing {trial.steps + 1} steps with {tried} "
                    f"averaging, then {trial.steps + 1} with {before} again, against the {before} steps around them"
                )
        comp = self._compressors.get(id(optimizer))
        if state is None or comp is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # a variance refresh (Adam, compressed stage): this step averages in fp32 and takes the exact Adam step (a
        # function of saved counters only, so a resumed fit refreshes at the same steps). Under manual optimization
        # the backward ran already (and counted its step): the training step decided it before that backward
        module = self.lightning_module
        manual = module is not None and not module.automatic_optimization
        if manual:
            # unless a `compression="auto"` trial began at this step (no refresh runs in a trial): then the plain step
            # takes the gradients the hook averaged in fp32
            refreshing = (
                comp.kind == "adam" and self._manual_refresh and state.compressing and state.trial_until is None
            )
        else:
            refreshing = comp.kind == "adam" and state.refresh_due
        otrial = self._overlap_trial
        if otrial is not None and self.switched_off_reason is None:
            known = otrial.decision is not None
            self.overlap = otrial.step_started(
                state.step, state.compressing, state.process_group, self.root_device, timed=not refreshing
            )
            if not known and otrial.decision is not None:
                d = otrial.decision
                rank_zero_info(
                    f"ddp_1bit overlap='auto' at step {d['step']}: overlapped {1e3 * d['overlap_s']:.2f} ms, serial "
                    f"{1e3 * d['serial_s']:.2f} ms per step -> {'overlap' if d['overlap'] else 'serial'}"
                )

        state.refreshing = refreshing
        refreshed = False

        # the optimizer's step becomes "run the closure, then the compressed step if the backward left local
        # gradients (the refresh step if it averaged them for one), else the optimizer's own step" (its own: an LR
        # scheduler's wrapper, else the class's method): precision plugins, GradScaler skips and clipping are unchanged
        def compressed_or_plain(plain: Callable[..., Any]) -> Callable[..., Any]:
            def step(closure: Callable[[], Any] | None = None, **step_kwargs: Any) -> Any:
                nonlocal refreshed
                loss = None
                if closure is not None:
                    # the hook hands this backward's buckets to the compressor (compressed stage only)
                    state.bucket_fn = comp.on_bucket if self.overlap and not state.refreshing else None
                    try:
                        with torch.enable_grad():
                            loss = closure()
                    finally:
                        state.bucket_fn = None
                if state.local_grads:
                    comp.compressed_step()
                elif state.refreshing:
                    comp.refresh_step()
                    refreshed = True
                else:
                    plain(**step_kwargs)
                return loss

            return step

        installed = patch(optimizer, "step", lambda p: compressed_or_plain(p.original), key=STEP_PATCH_KEY)
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            installed.restore()
            if state.refreshing:
                # a GradScaler that found Inf/NaN gradients never called the step: refresh at the next one instead
                # of leaving the variance stale until the next scheduled refresh (twice as far each time)
                state.refresh_missed = not refreshed
            # manual optimization: a later backward of the same refresh step averages in fp32 too
            state.refreshing = self._manual_refresh

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except RuntimeError as err:
            # DDP raises a failure of the gradient path's comm thread as a RuntimeError quoting it: raise the
            # thread's own exception (its type, message and traceback) instead
            state = self._onebit_state
            worker = state.comm_worker if state is not None else None
            if worker is None or worker.error is None or worker.error is err:
                raise
            failure, worker.error = worker.error, None  # raised once
            raise failure from err

    @override
    def teardown(self) -> None:
        # scratch buffers (several copies of the model's size) go now, not when the cyclic GC finds the trainer; the
        # error state stays (it is state, and inspectable after fit)
        for c in self._compressors.values():
            c.release()
            live = active_patch(c.optimizer, STEP_PATCH_KEY)  # a step that raised before its own restore
            if live is not None:
                live.restore()
        if self._onebit_state is not None:
            self._onebit_state.close()  # and the gradient path's comm thread, if it ran
        self._wait_state_gathers(raise_errors=False)
        if self.node_topology is not None:
            # the intra- and cross-node groups were made for this fit (a later fit makes its own): left alive, every
            # fit of a tuning loop or a notebook would add two; every rank tears down, so every rank destroys them
            self.node_topology.destroy()
        # a later fit on this Trainer builds a new state: a checkpoint it resumes must wait for that one
        self._onebit_live = False
        self._wrapped_trainable = []
        self._onebit_loaded = self._overlap_loaded = self._warmup_loaded = self._grads_loaded = None
        self._switched_off_loaded = None
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning suggests `strategy='ddp_find_unused_parameters_true'`, which would drop compression
        redirect_find_unused_parameters_advice(
            exception, "ddp_1bit_find_unused_parameters_true", "OneBitDDPStrategy(find_unused_parameters=True)"
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Wrap the model in DDP again when the parameters that require gradients are no longer the ones DDP wrapped
        (a callback unfroze or froze some: ``BaseFinetuning`` unfreezing a backbone); the schedule and the 1-bit
        state continue (:meth:`_rewrapped`).

        DDP builds its buckets from the parameters that require gradients when it wraps the model. A parameter
        unfrozen later would never travel in them: each rank would train it on its own gradients in every step that
        DDP averages (the fp32 warm-up, a variance refresh, the gradient path, ``compression="auto"`` back in fp32),
        and the ranks' copies would drift apart without a word. One frozen later would leave DDP waiting for its
        gradient and fail the next step. The parameters unfrozen now have not moved since DDP broadcast them, and
        the others are identical on every rank (averaged), so the new wrapper's broadcast changes nothing.

        Here, after the callbacks' and the LightningModule's ``on_train_batch_start`` and before the batch's forward:
        ``toggle_optimizer`` inside a manual training step (the GAN recipe) is not a change. Every rank runs the same
        callbacks, so every rank re-wraps at the same batch (DDP's wrap is a collective).
        """
        super().on_train_batch_start(batch, batch_idx)
        model = self.model
        if not self._onebit_live or self._onebit_state is None or not isinstance(model, DistributedDataParallel):
            return
        now, before = _trainable(model.module), self._wrapped_trainable
        self._check_overlap_layout(now)
        if _same_tensors(now, before):
            return
        rank_zero_info(
            f"ddp_1bit: the parameters that require gradients changed at step {self._onebit_state.step} "
            f"({len(before)} -> {len(now)} tensors): the model is wrapped in DDP again so that all of them are averaged"
        )
        self.model = model.module
        self._same_tensors_rewrap = True
        try:
            self.configure_ddp()
        finally:
            self._same_tensors_rewrap = False

    def _check_overlap_layout(self, trainable: Sequence[torch.Tensor]) -> None:
        """Stop compressing during backward once a parameter DDP averages is in a layout its bucket views do not
        follow (:func:`_layout_blocker`): a frozen channels_last backbone unfrozen by a callback, a module converted
        to channels_last after setup. ``overlap="auto"`` compresses after backward from this step on (bit-identical
        results; one line says so); ``overlap=True`` raises, as it does when setup finds such a parameter.

        Checked before every batch while overlapping is possible, on every rank alike (the same callbacks change the
        same parameters everywhere), so the ranks keep taking the same order.

        Raises:
            ValueError: ``overlap=True`` and such a parameter.
        """
        trial = self._overlap_trial
        if not self.overlap and (trial is None or trial.decision is not None):  # serial for good already
            return
        blocker = _layout_blocker(trainable)
        if blocker is None:
            return
        state = self._onebit_state
        step = state.step if state is not None else 0
        if self._overlap_arg is True:
            raise ValueError(
                f"`overlap=True` cannot start compressing during backward with {blocker} (since step {step}). Use "
                "`overlap='auto'` (it falls back to compressing after backward) or keep the trained parameters "
                "contiguous."
            )
        self.overlap = False
        self._overlap_trial = None
        rank_zero_info(
            f"ddp_1bit: compressed momentum starts after backward from step {step} on (no overlap: {blocker})"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        state, module = self._onebit_state, self.lightning_module
        manual = state is not None and module is not None and not module.automatic_optimization
        if manual:
            assert state is not None
            # manual optimization runs the step's backward here, before any optimizer step: a variance refresh must be
            # decided now, so the hook averages this step's gradients in fp32 for the exact Adam step (automatic
            # optimization decides it in the optimizer step, whose closure runs the backward)
            self._manual_refresh = state.refresh_due and any(c.kind == "adam" for c in self._compressors.values())
            state.refreshing = self._manual_refresh
        try:
            with self._timed_step():  # the step's span under manual optimization (nested in the optimizer step else)
                out = super().training_step(*args, **kwargs)
        finally:
            if manual:
                assert state is not None
                self._manual_refresh = state.refreshing = False
        last = state.stats.last_step if state is not None else None
        if self._log_stats and last is not None and module is not None and last.sent:
            # the hook has finished the previous step's buckets; this logs that step's traffic
            module.log_dict(
                {"comm/bytes_sent": float(last.sent), "comm/compression_ratio": last.fp32 / last.sent},
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
        return out

    def _wait_state_gathers(self, *, raise_errors: bool = True) -> None:
        """Wait for the last save's asynchronous gather of the error state (on every rank: the senders' buffers and
        errors), before the next one or the process group's end. ``raise_errors=False`` (teardown, possibly after
        another error) warns instead of raising, so the error that ended the fit is the one reported."""
        works, self._state_gathers = self._state_gathers, []
        for work in works:
            try:
                work.wait()
            except Exception as e:
                if raise_errors:
                    raise
                # on the rank that saw it (rank 0 may not have)
                warnings.warn(
                    f"ddp_1bit: the last save's gather of the error state failed on rank {self.global_rank}: "
                    f"{one_line(e)}",
                    stacklevel=2,
                )

    def _raise_if_any_rank_failed(self, error: BaseException | None, group: dist.ProcessGroup | None) -> None:
        """Learn from every rank of ``group`` whether it got its error state ready for the checkpoint's gather
        (``error``: this rank's failure, None if it did), and raise on every rank when one failed: its own error where
        it happened (the caller re-raises it), elsewhere one line naming the rank and its error (a collective:
        :func:`~lightning_accel._utils.rank.raise_if_any_rank_failed`)."""
        raise_if_any_rank_failed(
            error,
            lambda rank, more: (
                f"ddp_1bit: rank {rank} could not prepare its error state for the checkpoint{more}, so no rank saves it"
            ),
            device=self.root_device,
            group=group,
        )

    def _leftover_grads(self, state: comm.OneBitState) -> dict[str, torch.Tensor] | None:
        """The ``.grad`` of every parameter that holds one, by name (copies on the CPU), when the next step's
        averaging reads them: under manual optimization on the gradient path. Else None.

        DDP copies a parameter's whole ``.grad`` into its bucket, including what an earlier backward left there and
        no ``zero_grad`` cleared (a GAN's generator step leaves gradients on the discriminator; a parameter unused in
        a backward keeps its last ones), and the compressed gradient path folds that into the error feedback. A
        resumed fit must start from the same gradients to continue bit-exactly. The automatic loop clears the
        gradients before every backward, so its checkpoints need none (and carry none).
        """
        module = self.lightning_module
        if state.mode != "gradients" or module is None or module.automatic_optimization:
            return None
        return {
            name: p.grad.detach().to("cpu", copy=True) for name, p in module.named_parameters() if p.grad is not None
        }

    @override
    def on_train_start(self) -> None:
        """Give the parameters back the gradients :meth:`_leftover_grads` saved in the checkpoint this fit resumes (a
        parameter the checkpoint holds none for keeps none): every rank, the same ones, as DDP left them at the save.
        Here, not at the restore: ``Trainer`` clears every gradient when the fit's stage begins."""
        super().on_train_start()
        saved, self._grads_loaded = self._grads_loaded, None
        module = self.lightning_module
        if saved is None or module is None:
            return
        for name, p in module.named_parameters():
            g = saved.get(name)
            if g is None or g.shape != p.shape:
                p.grad = None
            else:
                p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathType, storage_options: Any | None = None
    ) -> None:
        # Called on every rank: gather each rank's error state (a collective) so rank 0 writes all of them; only
        # global rank 0 writes (DDPStrategy.save_checkpoint), so only it receives the others' bytes
        state = self._onebit_state
        # the weights alone carry no rank's error state (world size x the model's size): nothing is gathered
        gathers = state is not None and not _weights_only(checkpoint) and distributed_ready()
        world = state is None or state.process_group is None or state.process_group is dist.group.WORLD
        deferred_gather = (
            state is not None and gathers and world and resolves_deferred(self.checkpoint_io) and _on_cpu(state)
        )
        extras: dict[str, Any] = {}
        try:
            self._wait_state_gathers()  # the previous save's, long done: their errors surface here
            if gathers:
                assert state is not None
                watch = self._warmup_watch
                extras = {
                    # overlap="auto"'s decision, the same on every rank (None while it is being measured)
                    "overlap_decision": self.overlap_decision,
                    # switch_off's reason, the same on every rank: a fit resumed from this save stays in fp32
                    "switched_off_reason": self.switched_off_reason,
                    # warmup_steps="auto" still deciding: the last check's per-tensor means. Rank 0's, as its
                    # optimizer states are the ones Lightning saves (and they are every rank's: the warm-up averages
                    # in fp32)
                    "warmup_watch": None if watch is None else watch.state_dict(),
                    # manual optimization on the gradient path: the gradients a step leaves behind (rank 0's; DDP
                    # hands every rank the same averaged ones), which the next step's buckets carry into the error
                    # feedback
                    "leftover_grads": self._leftover_grads(state),
                }
        except Exception as e:
            if gathers and not deferred_gather:
                assert state is not None
                self._raise_if_any_rank_failed(e, state.process_group)
            raise
        if gathers and not deferred_gather:
            # a rank that failed above alone would leave the others in the gather below until the process group's
            # timeout, or worse, matched with its next save's gather; the blocking gather waits for the slowest rank
            # anyway, so the one-integer agreement costs a round trip, not a stall (the deferred gather skips it:
            # no rank waits there)
            assert state is not None
            self._raise_if_any_rank_failed(None, state.process_group)
        if gathers:
            assert state is not None
            if deferred_gather:
                # A background writer encodes the checkpoint later anyway: the gather runs meanwhile instead of
                # making rank 0 wait here for the slowest rank and the round trip (the whole of the stall a 1-bit
                # fit's save added over an fp32 fit's). On CPU tensors (gloo) only: not yet run on a GPU.
                deferred, self._state_gathers = comm.gather_state_dict_async(state, dst=0)
                if deferred is not None:
                    checkpoint[CHECKPOINT_KEY] = Deferred(functools.partial(_with_extras, deferred, extras))
            else:
                gathered = comm.gather_state_dict(state, dst=0 if world else None)
                if gathered is not None:
                    checkpoint[CHECKPOINT_KEY] = {**gathered, **extras}
        elif not _weights_only(checkpoint) and self._onebit_loaded is not None:
            checkpoint[CHECKPOINT_KEY] = self._onebit_loaded
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: PathType, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        payload = checkpoint.get(CHECKPOINT_KEY)
        if payload is not None:
            try:
                # every rank reads the whole payload: the same verdict everywhere, before any rank takes its slice
                # (a slice missing on some ranks alone would fail those and leave the others in the first collective)
                check_gathered_state(payload)
            except ValueError as err:
                raise ValueError(
                    f"`ckpt_path` {str(checkpoint_path)!r}: {err} Resume from another checkpoint (or load the weights "
                    "alone with a fresh strategy)."
                ) from err
            grads = payload.get("leftover_grads")  # absent from checkpoints saved before it was kept
            self._grads_loaded = dict(grads) if isinstance(grads, Mapping) else None
            decision = payload.get("overlap_decision")
            self._overlap_loaded = dict(decision) if isinstance(decision, dict) else None
            reason = payload.get("switched_off_reason")  # absent from checkpoints saved before it was kept
            self._switched_off_loaded = reason if isinstance(reason, str) else None
            watch = payload.get("warmup_watch")  # absent from checkpoints saved before it was kept
            self._warmup_loaded = dict(watch) if isinstance(watch, dict) else None
            state = self._onebit_state
            if state is not None and self._onebit_live:  # set up in this fit: apply now
                mode, kinds = state.mode, state.kinds
                state.load_state_dict(
                    comm.select_rank_state(payload, self.global_rank), self.world_size, warn=self.is_global_zero
                )
                if list(self.optimizers):  # this fit's signal is resolved already: compare the loaded one with it
                    state.set_signal(mode, kinds, warn=self.is_global_zero)
                self._adopt_overlap_decision()
                self._adopt_switch_off(state)
                if self._warmup_watch is not None and self._warmup_loaded is not None:
                    self._warmup_watch.load_state_dict(self._warmup_loaded)
                self._warmup_loaded = None
            else:  # DDP restores before wrapping the model: apply when the hook is registered
                self._onebit_loaded = payload
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "ddp_1bit",
            cls,
            description="DDP with 1-bit compressed momentum/gradient averaging and error feedback (lightning-accel)",
        )
        strategy_registry.register(
            "ddp_1bit_find_unused_parameters_true",
            cls,
            description="`ddp_1bit` with `find_unused_parameters=True` (lightning-accel)",
            find_unused_parameters=True,
        )


# --------------------------------------------------------------------------------------- local steps (diloco)

LOCALSTEPS_CHECKPOINT_KEY = "lightning_accel_localsteps"
#: what a rank gathers at a save in place of its local-steps state when preparing it failed (the error's one line)
_SAVE_FAILED = "save_failed"
_LOCAL_DEFAULTS = LocalStepsConfig()
_LOCAL_OWN = (
    "sync_every",
    "fragments",
    "outer_lr",
    "outer_momentum",
    "nesterov",
    "compression",
    "overlap_steps",
    "sync_start",
)


def _check_buffers(module: torch.nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``saved`` (a rank's buffers by name, from its checkpoint) unless it names ``module``'s buffers, with
    their shapes (the same verdict on every rank: the ranks' buffers share names and shapes)."""
    own = dict(module.named_buffers())
    missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    reshaped = sorted(n for n in own.keys() & saved.keys() if own[n].shape != saved[n].shape)
    if missing or extra or reshaped:
        found = {"missing": missing, "unexpected": extra, "of other shapes": reshaped}
        raise ValueError(
            "the checkpoint's local-steps state holds other buffers than the model: "
            f"{', '.join(f'{what} {names}' for what, names in found.items() if names)}. Resume with the model the "
            "checkpoint was saved from."
        )


def _load_buffers(module: torch.nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Copy ``saved`` (checked by :func:`_check_buffers`) into ``module``'s buffers, in place (the outer state holds
    references to them)."""
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(saved[name])


def _local_hook(state, bucket):  # no annotations: DDP rejects the string ones this module postpones
    """DDP comm hook that communicates nothing: the bucket's local gradients, as a completed future."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class LocalStepsStrategy(_BackgroundSavesDDP):
    """Local steps with a compressed outer update, DiLoCo-style (``Trainer(strategy="diloco")``).

    Each rank's optimizer (the inner optimizer: the user's, with its scheduler, clipping, accumulation, precision)
    steps on its own gradients; every ``sync_every`` optimizer steps each fragment of the model averages its
    pseudo-gradient (1-bit with error feedback by default) and takes an outer SGD step that every rank adopts (by
    default with ``outer_lr=1`` and no momentum: the ranks' average; DiLoCo's Nesterov momentum is an option).
    About ``sync_every`` x 32 fewer bytes than DDP. The algorithm and the choice against ``ddp_1bit`` and DDP are in
    ``docs/onebit.md``; :mod:`lightning_accel.comm.localsteps` states the maths.

    Args:
        sync_every: inner optimizer steps between two syncs of each fragment (``H``).
        fragments: parameter groups (model order) synced in turn, spreading the traffic over the ``H`` steps.
        outer_lr: outer learning rate (1: the average; DiLoCo: 0.7).
        outer_momentum: outer momentum (0; DiLoCo: 0.9).
        nesterov: Nesterov outer momentum (DiLoCo: True); ``False`` is refused with ``outer_momentum=0`` (no momentum:
            both steps are the same).
        compression: ``"1bit"`` or ``"fp32"`` averaging of the pseudo-gradients.
        overlap_steps: inner steps an exchange has to travel before it is applied (0: the step waits for it; below
            ``sync_every // fragments``). None: 1, or 0 when a fragment is due every step
            (``sync_every // fragments == 1``).
        block_size: elements per 1-bit scale block; refused with ``compression="fp32"`` (no scale blocks there)
            unless it is the default.
        sync_buffers: average the floating-point buffers that some rank changed (BatchNorm statistics) at every sync
            of fragment 0, in their own precision; constant and integer buffers do not travel.
        sync_start: optimizer steps at the start that each average the parameters in fp32 (a synchronous start,
            DDP's bytes per step) before the local steps begin (0: none).
        log_stats: log ``comm/bytes_sent`` (this rank, last step) every training step.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy` and
            :class:`~torch.nn.parallel.DistributedDataParallel` arguments; ``forward_sync_buffers`` defaults to
            False (DDP's per-forward buffer broadcast would be a collective every step; ``sync_buffers`` averages
            them at the syncs instead).

    Raises:
        TypeError: a hyper-parameter of the wrong type, a DDP on/off option that is not a bool, a ``bucket_cap_mb``
            that is not a number, a ``timeout`` that is not a ``timedelta`` or a ``process_group_backend`` that is
            not a string.
        ValueError: a bad hyper-parameter, an unknown keyword, a competing ``ddp_comm_hook``, a DDP option that
            averages parameters outside the local steps (``delay_all_reduce_named_params``,
            ``param_to_hook_all_reduce``), a DDP ``process_group`` / ``device_mesh`` (the local steps average over
            every process), a ``block_size`` other than the default with ``compression="fp32"``, or
            ``nesterov=False`` with ``outer_momentum=0``.
    """

    strategy_name = "diloco"

    def __init__(
        self,
        *,
        sync_every: int = _LOCAL_DEFAULTS.sync_every,
        fragments: int = _LOCAL_DEFAULTS.fragments,
        outer_lr: float = _LOCAL_DEFAULTS.outer_lr,
        outer_momentum: float = _LOCAL_DEFAULTS.outer_momentum,
        nesterov: bool = _LOCAL_DEFAULTS.nesterov,
        compression: OuterCompression = _LOCAL_DEFAULTS.compression,
        overlap_steps: int | None = None,
        block_size: int = _LOCAL_DEFAULTS.block_size,
        sync_buffers: bool = _LOCAL_DEFAULTS.sync_buffers,
        sync_start: int = _LOCAL_DEFAULTS.sync_start,
        log_stats: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        kwargs = _ddp_kwargs(
            kwargs,
            alias="diloco",
            cls="LocalStepsStrategy",
            own=(*_LOCAL_OWN, "block_size", "sync_buffers", "log_stats"),
            why="local steps replace DDP's averaging",
            refused={
                name: "the local steps average over every process of the job, in a group of their own"
                for name in ("process_group", "device_mesh")
            },
        )
        _check_ddp_arguments(timeout, start_method, process_group_backend)
        if "broadcast_buffers" not in kwargs and "forward_sync_buffers" in _DDP_KWARGS:
            kwargs.setdefault("forward_sync_buffers", False)  # no per-forward collective; the buffers are averaged
        elif "forward_sync_buffers" not in _DDP_KWARGS:
            kwargs.setdefault("broadcast_buffers", False)
        self._config = LocalStepsConfig(
            sync_every=sync_every,
            fragments=fragments,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            compression=compression,
            overlap_steps=overlap_steps,
            block_size=block_size,
            sync_buffers=sync_buffers,
            sync_start=sync_start,
        )
        check_bool("log_stats", log_stats, fix="Use False to stop logging.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._log_stats = log_stats
        self._local: LocalSteps | None = None
        #: whether ``_local`` belongs to the model DDP wraps in this fit (it stays inspectable after the fit; a later
        #: fit makes a new one)
        self._local_live = False
        self._loaded: dict[str, Any] | None = None
        self._loaded_from = ""  # the last checkpoint read that held local-steps state (for messages)
        self._outer_group: dist.ProcessGroup | None = None
        #: the inner step at which this fit's final sync ran (None: not yet)
        self._final_synced_at: int | None = None

    @property
    def local_steps_config(self) -> LocalStepsConfig:
        """The hyper-parameters this strategy was built with (immutable)."""
        return self._config

    @property
    def local_steps(self) -> LocalSteps | None:
        """The outer state (None before ``fit`` sets up DDP, or with a single process)."""
        return self._local

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DDP with a hook that communicates nothing, and build the outer state. Called again during
        the fit (a callback that replaced the parameters wraps the model again: ``StructuredPruning``), it is a sync
        point: the exchanges in flight complete and are dropped, every rank takes rank 0's parameters (DDP's
        broadcast), and a new outer state for the new shapes continues the old one's schedule
        (:meth:`_continue_schedule`)."""
        if self.world_size == 1 and self._loaded is not None:
            # the checkpoint holds several ranks' own parameters and optimizer states; one process can continue none
            # of them as local steps (and its own checkpoints would carry the stale payload into a later resume)
            ranks = len(self._loaded["ranks"])
            self._loaded = None
            raise ValueError(
                f"`ckpt_path` {self._loaded_from!r} holds the local-steps state of {ranks} ranks and this fit runs 1 "
                f"process: it cannot continue their local steps. Resume with {ranks} processes (or load the weights "
                "alone with a fresh strategy)."
            )
        # wrapped again during this fit (a callback that reshaped the parameters, such as StructuredPruning): the
        # exchanges in flight were issued for the old parameters; they complete (matched on every rank) and are dropped
        previous = self._local if self._local_live else None
        if previous is not None:
            previous.abandon()
        super().configure_ddp()  # wraps the model and broadcasts rank 0's parameters
        if self.world_size == 1:
            rank_zero_warn(
                "`strategy='diloco'` runs with a single process: there is nothing to average, so it trains as one "
                "process would.",
                category=UserWarning,
            )
            return
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(None, _local_hook)
        module = self.model.module
        # a group of its own: an exchange in flight may overlap Lightning's collectives on the default group
        if self._outer_group is None:
            group = dist.new_group(ranks=list(range(self.world_size)))
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self._outer_group = group
        self._local = LocalSteps(
            [p for p in module.parameters() if p.requires_grad],
            self._config,
            group=self._outer_group,
            buffers=list(module.buffers()),
        )
        self._local_live = True
        self._final_synced_at = None
        if previous is not None:
            self._continue_schedule(previous)
        if self._loaded is not None:
            self._restore_local(self._loaded, self._loaded_from)
            self._loaded = None

    def _follow_trainable(self) -> None:
        """At the start of a training step (before its forward): when the parameters that require gradients are no
        longer the ones the outer state syncs (a callback unfroze or froze some mid-fit: ``BaseFinetuning`` unfreezing
        a backbone), sync every fragment (every rank then holds ``θ_global``) and continue with a new outer state over
        the parameters trained now.

        Not at each optimizer step: under manual optimization ``LightningModule.toggle_optimizer`` (the GAN recipe)
        turns off ``requires_grad`` of every parameter outside the optimizer about to step, inside the training step,
        and ``untoggle_optimizer`` turns it back on before the step ends. Read at the optimizer step, that would pass
        for a change at every step: a sync of the whole model and a reset of the outer momentum and error feedback at
        every step, with a line logged each time.

        The model is wrapped in DDP again after the sync, so that DDP's buckets follow the parameters trained now.
        Without it a parameter unfrozen mid-fit would train on each rank alone, never averaged, and the fit would end
        with ranks that disagree; a parameter frozen mid-fit would keep travelling, a 1-bit block it shares with
        trained ones would move it, and DDP would fail the next backward waiting for its gradient. The parameters
        unfrozen here have not moved since DDP broadcast them (frozen until this step), so after the sync every rank
        holds the same model. The outer momentum and the error feedback, laid out for the old fragments, restart from
        zero; the step count keeps the sync schedule's phase. Every rank runs the same callbacks, so every rank
        rebuilds at the same step (the sync and the wrap are collectives).
        """
        local = self._local
        assert local is not None and isinstance(self.model, DistributedDataParallel)
        trained = [p for p in self.model.module.parameters() if p.requires_grad and p.numel() > 0]
        if _same_tensors(trained, local.params):
            return
        local.final_sync()
        # DDP waits for a gradient of every parameter that required one when it wrapped the model: one frozen now
        # would fail the next backward. Wrapped again (its broadcast hands every rank rank 0's parameters, which every
        # rank holds after the sync), its buckets follow the parameters trained now
        self.model = self.model.module
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(None, _local_hook)
        self._local = LocalSteps(
            trained, self._config, group=self._outer_group, buffers=list(self.model.module.buffers())
        )
        self._local.step_count, self._local.bytes_sent = local.step_count, local.bytes_sent
        self._local.syncs = local.syncs
        for frag in self._local.fragments:  # built from the parameters every rank holds now: they are θ_global
            frag.adopted_at = local.step_count
        rank_zero_info(
            f"diloco: the trained parameters changed at inner step {local.step_count} ({len(local.params)} -> "
            f"{len(trained)} tensors): every fragment was synced, the model wrapped in DDP again, and a new outer "
            "state (momentum and error feedback from zero) continues on the same sync schedule"
        )

    def _continue_schedule(self, previous: LocalSteps) -> None:
        """After a re-wrap during the fit: the new outer state (made for the new parameters, from the ones DDP just
        broadcast: rank 0's, a sync point where every rank holds the same model) takes over the step count and the
        totals of ``previous``, so the sync schedule keeps its phase and the synchronous start does not run again. The
        outer momentum and the error feedback, laid out for the old shapes, restart from zero; the other ranks' local
        progress since the last sync is dropped (their parameters were pruned on their own values, so only one rank's
        are known to match its structure)."""
        local = self._local
        assert local is not None
        local.step_count, local.bytes_sent, local.syncs = previous.step_count, previous.bytes_sent, previous.syncs
        for frag in local.fragments:  # built from the parameters every rank holds now: they are θ_global
            frag.adopted_at = local.step_count
        rank_zero_info(
            f"diloco: the model was wrapped in DDP again at inner step {local.step_count}; every "
            "rank continues from rank 0's parameters with a new outer state (momentum and error feedback from zero), "
            "on the same sync schedule"
        )

    def _restore_local(self, payload: Mapping[str, Any], source: str) -> None:
        """This rank's parameters, buffers and outer state from the checkpoint ``source`` (after DDP's broadcast
        overwrote them with rank 0's).

        Each rank checks its own part, and the ranks then agree (one small collective:
        :func:`~lightning_accel._utils.rank.raise_if_any_rank_failed`) before any of them restores anything: a part
        unusable on some ranks only (another layout, a missing entry) fails the resume on every rank, instead of
        leaving the others in their first collective of the fit until the process group's timeout.

        Raises:
            ValueError: the checkpoint holds the state of another number of ranks, or this rank's part is of another
                layout or incomplete (naming ``source``); nothing is restored, on any rank.
            RuntimeError: another rank's part is unusable (naming that rank and quoting its error).
        """
        assert self._local is not None
        ranks = payload["ranks"]
        if len(ranks) != self.world_size:
            raise ValueError(
                f"`ckpt_path` {source!r} holds the local-steps state of {len(ranks)} ranks and this fit runs "
                f"{self.world_size} processes: it cannot continue their local steps. Resume with {len(ranks)} "
                "processes (or load the weights alone with a fresh strategy)."
            )
        # every check before the first copy: a refused resume leaves the model as it was, on every rank
        module = self.lightning_module
        failure: ValueError | None = None
        try:
            own = ranks[self.global_rank]
            buffers = own.get("buffers")  # absent from checkpoints of format 1
            self._local.check_state(own["outer"])
            self._local.check_local_flats(own["local"])
            if buffers is not None and module is not None:
                _check_buffers(module, buffers)
        except ValueError as err:
            failure = ValueError(f"`ckpt_path` {source!r}: {err}")
            failure.__cause__ = err
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            failure = ValueError(
                f"`ckpt_path` {source!r}: rank {self.global_rank}'s part of the local-steps state is incomplete or "
                f"corrupt ({type(err).__name__}: {one_line(err)}). Resume from another checkpoint (or load the "
                "weights alone with a fresh strategy)."
            )
            failure.__cause__ = err
        self._raise_restore_failure_on_every_rank(failure, "local-steps state", source)
        self._local.load_local_flats(own["local"])
        if buffers is not None and module is not None:
            _load_buffers(module, buffers)
        self._local.load_state_dict(own["outer"])

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """This rank's own optimizer states (saved under :data:`LOCALSTEPS_CHECKPOINT_KEY`), not rank 0's.

        The ranks then agree (one small collective) before the fit goes on, so a part that only some ranks cannot
        load fails the resume on every rank.

        Raises:
            ValueError: this rank's optimizer states do not fit this fit's optimizers (naming the checkpoint).
            RuntimeError: another rank's did not (naming that rank and quoting its error).
        """
        payload = checkpoint.get(LOCALSTEPS_CHECKPOINT_KEY)
        if payload is None or self._local is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        source = self._loaded_from
        failure: Exception | None = None
        try:
            own = payload["ranks"][self.global_rank]
            super().load_optimizer_state_dict({**checkpoint, "optimizer_states": own["optimizers"]})
        except (ValueError, KeyError, IndexError, TypeError) as err:
            failure = ValueError(
                f"`ckpt_path` {source!r}: rank {self.global_rank}'s optimizer state cannot be loaded into this fit's "
                f"optimizers ({type(err).__name__}: {one_line(err)}). Resume with the optimizers and trainable "
                "parameters the checkpoint was saved with."
            )
            failure.__cause__ = err
        except Exception as err:
            failure = err
        # each rank loads its own optimizer states: one that cannot (its part of another shape, or missing) must not
        # leave the others in the fit's first collective until the process group's timeout
        self._raise_restore_failure_on_every_rank(failure, "optimizer state", source)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        local, module = self._local, self.lightning_module
        if local is not None:
            local.step()
            # automatic optimization: this is the batch's only step, not yet counted in `global_step`
            if module is not None and module.automatic_optimization and self._fit_ends_after(1):
                self._final_sync()
        return out

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._local is not None and self._local_live:
            # before the forward, with every `requires_grad` as the callbacks left it (see `_follow_trainable`); under
            # automatic optimization this runs inside the optimizer step's closure, still before the inner step
            self._follow_trainable()
        out = super().training_step(*args, **kwargs)
        local, module = self._local, self.lightning_module
        # manual optimization: the batch's optimizer steps ran inside the training step, and are counted
        if local is not None and module is not None and not module.automatic_optimization and self._fit_ends_after(0):
            self._final_sync()
        if self._log_stats and local is not None and module is not None:
            module.log("comm/bytes_sent", float(local.last_bytes), on_step=True, on_epoch=False, batch_size=1)
        return out

    def _fit_ends_after(self, uncounted_steps: int) -> bool:
        """Whether the fit ends with the batch now running (Lightning's own stop rules: ``max_steps`` reached, or the
        last batch of the last of ``max_epochs``), ``uncounted_steps`` optimizer steps of it not yet in
        ``global_step``. The same on every rank: the counters are. A stop decided elsewhere (early stopping,
        ``max_time``) is not foreseen here; :meth:`on_train_end` syncs then."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return False
        if trainer.max_steps != -1 and trainer.global_step + uncounted_steps >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        if max_epochs is None or max_epochs == -1 or trainer.current_epoch + 1 < max_epochs:
            return False
        progress = trainer.fit_loop.epoch_loop.batch_progress  # this batch is counted as ready before it runs
        return bool(progress.is_last_batch) or progress.current.ready == trainer.num_training_batches

    def _final_sync(self) -> None:
        """The exchanges in flight, then one last sync of every fragment that moved since its last one: every rank
        holds θ_global (a collective)."""
        local = self._local
        assert local is not None
        local.final_sync()
        self._final_synced_at = local.step_count

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        local = self._local
        if local is not None:
            # synced already when the last step was foreseen (before the callbacks' hooks of that step, so the
            # checkpoints saved at the end hold θ_global); a fit stopped otherwise syncs now
            if self._final_synced_at != local.step_count:
                self._final_sync()
            rank_zero_info(
                f"diloco: {local.syncs} outer updates over {local.step_count} inner steps, "
                f"{local.bytes_sent / 1e6:.2f} MB sent by rank {self.global_rank}"
            )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathType, storage_options: Any | None = None
    ) -> None:
        # called on every rank: gather each rank's own parameters, buffers, optimizer states, precision plugin state
        # (a GradScaler's scale: each rank skips the steps its own gradients overflow) and outer state (a collective)
        local, module = self._local, self.lightning_module
        if _weights_only(checkpoint):
            pass  # the weights alone: no rank's parameters and outer state (world size x the model's size) go in
        elif local is not None and module is not None and distributed_ready():
            failure: Exception | None = None
            try:
                own: dict[str, Any] = {
                    "local": local.local_flats(),
                    "buffers": {name: b.detach().to("cpu", copy=True) for name, b in module.named_buffers()},
                    "optimizers": checkpoint.get("optimizer_states", []),
                    "precision": checkpoint.get(type(self.precision_plugin).__qualname__),
                    "outer": local.state_dict(),
                }
                # pickled here, not inside the gather: an object of this rank's part that does not pickle (one in an
                # optimizer's param group, a precision plugin's state) or a host out of memory for the copy would
                # fail this rank alone before the gather's first collective, and leave the others waiting in it. The
                # gather then carries bytes (a copy, no extra collective)
                part = pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)
                del own  # its copies (flats, buffers) are in the bytes now: one copy of this rank's part at a time
            except Exception as e:
                # still reach the gather, with the error in place of the state: every rank learns of it there
                # instead of waiting in the gather for the process group's timeout
                failure = e
                part = pickle.dumps({_SAVE_FAILED: f"{type(e).__name__}: {one_line(e)}"})
            parts: list[Any] = [None] * self.world_size
            # our own processes' objects; after teardown (no exchange in flight any more) on the default group
            dist.all_gather_object(parts, part, group=self._outer_group)
            del part
            if failure is not None:
                raise failure
            gathered = [pickle.loads(x) for x in parts]  # our own processes' bytes, pickled just above
            del parts
            failed = [(r, x[_SAVE_FAILED]) for r, x in enumerate(gathered) if _SAVE_FAILED in x]
            if failed:
                rank, text = failed[0]
                more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
                raise RuntimeError(
                    f"diloco: rank {rank} could not prepare its local-steps state for the checkpoint{more}, so no "
                    f"rank saves it: {text}"
                )
            checkpoint[LOCALSTEPS_CHECKPOINT_KEY] = {"format": 2, "ranks": gathered}
        elif self._loaded is not None:
            checkpoint[LOCALSTEPS_CHECKPOINT_KEY] = self._loaded
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: PathType, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        payload = checkpoint.get(LOCALSTEPS_CHECKPOINT_KEY)
        if payload is not None:
            ranks = payload.get("ranks") if isinstance(payload, Mapping) else None
            if not isinstance(ranks, (list, tuple)):
                # every rank reads the same file: every rank refuses alike here, with no collective
                if not isinstance(payload, Mapping):
                    found = f"is a {type(payload).__name__}, expected a mapping"
                else:
                    held = "no `ranks`" if ranks is None else f"`ranks` of type {type(ranks).__name__}"
                    found = f"holds {held}, expected a list of the ranks' parts"
                raise ValueError(
                    f"`ckpt_path` {str(checkpoint_path)!r}: its local-steps state ({LOCALSTEPS_CHECKPOINT_KEY!r}) "
                    f"{found}: the checkpoint is incomplete or corrupt. Resume from another checkpoint (or load the "
                    "weights alone with a fresh strategy)."
                )
            self._loaded_from = str(checkpoint_path)  # named by the restores' messages (optimizer states: later)
            key = type(self.precision_plugin).__qualname__
            if key in checkpoint and len(ranks) == self.world_size:
                own = ranks[self.global_rank]
                # a part that is not a mapping is refused with the other checks, on every rank together
                # (_restore_local)
                mine = own.get("precision") if isinstance(own, Mapping) else None
                if mine is not None:
                    # Lightning restores the precision plugin from the checkpoint this returns (rank 0's state): this
                    # rank's own instead
                    checkpoint[key] = mine
                # on every rank (the condition above reads what every rank reads): a collective
                self._check_precision_state(checkpoint[key], str(checkpoint_path))
            if self._local is not None and self._local_live:  # set up in this fit: apply now
                self._restore_local(payload, str(checkpoint_path))
            else:  # DDP broadcasts rank 0's parameters when it wraps the model: apply after that
                self._loaded, self._loaded_from = payload, str(checkpoint_path)
        return checkpoint

    def _raise_restore_failure_on_every_rank(self, failure: BaseException | None, what: str, source: str) -> None:
        """Every rank, after restoring its own part of ``what`` from ``source``: raise ``failure`` (this rank's) or,
        when another rank failed, one line naming that rank
        (:func:`~lightning_accel._utils.rank.raise_if_any_rank_failed`; one small collective under several processes),
        so that no rank goes on alone into the fit's collectives."""
        if self.world_size > 1 and distributed_ready():
            raise_if_any_rank_failed(
                failure,
                lambda rank, more: (
                    f"diloco: rank {rank} could not restore its {what} from `ckpt_path` {source!r}{more}, so no rank "
                    "resumes"
                ),
                device=self.root_device,
            )
        if failure is not None:
            raise failure

    def _check_precision_state(self, state: Any, source: str) -> None:
        """Load this rank's own precision plugin state (its GradScaler's scale and counters) now, and agree with the
        other ranks (one small collective) that every rank could, before Lightning restores it.

        Lightning loads the precision plugin from the checkpoint :meth:`load_checkpoint` returns on every rank, then
        meets the other ranks in the next collective of the resume: a rank whose own state cannot be loaded would
        raise alone there and leave the others waiting until the process group's timeout. Lightning's own load that
        follows loads the same state again (loading is idempotent).

        Raises:
            ValueError: this rank's state cannot be loaded into this fit's precision plugin (naming ``source``).
            RuntimeError: another rank's could not (naming that rank and quoting its error).
        """
        plugin = self.precision_plugin
        failure: Exception | None = None
        try:
            plugin.load_state_dict(state)
        except Exception as err:
            failure = ValueError(
                f"`ckpt_path` {source!r}: rank {self.global_rank}'s {type(plugin).__name__} state cannot be loaded "
                f"({type(err).__name__}: {one_line(err)}). Resume with the precision plugin the checkpoint was saved "
                "with, or from another checkpoint."
            )
            failure.__cause__ = err
        self._raise_restore_failure_on_every_rank(failure, "precision plugin state", source)

    @override
    def teardown(self) -> None:
        # a later fit on this Trainer builds a new outer state: a checkpoint it resumes must wait for that one
        self._local_live = False
        self._loaded = None
        if self._outer_group is not None:
            # made for this fit's exchanges (a later fit makes its own): left alive, every fit of a loop that builds
            # a strategy per fit would add one; every rank tears down, so every rank destroys it
            destroy_group(self._outer_group)
            self._outer_group = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "diloco",
            cls,
            description=(
                "local steps with a 1-bit compressed outer update (outer SGD, optional Nesterov momentum), "
                "DiLoCo-style (lightning-accel)"
            ),
        )
