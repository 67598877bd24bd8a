"""``PipelineStrategy``: pipeline parallelism (``torch.distributed.pipelining``) inside the Trainer's loop."""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_accel._utils.checks import check_choice, check_int
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.patching import Patch, patch
from lightning_accel._utils.rank import raise_if_any_rank_failed
from lightning_accel.parallel.estimate import default_microbatches
from lightning_accel.parallel.pipeline import (
    PipelineLayout,
    PipelineRunner,
    batch_tensors,
    check_microbatches,
    check_no_sync_batchnorm,
    check_stages_train,
    find_pipeline_modules,
    join_outputs,
    piece_costs,
    pipeline_layout,
    resolve_stages_per_rank,
    split_batch,
    trainable_pieces,
)
from lightning_accel.parallel.strategies._helpers import (
    BATCH_SPLITS,
    _EvaluationBufferSync,
    broadcast_buffers,
    check_keywords,
    gather_batch,
    keyword_defaults,
    keyword_names,
    leading_rows,
    named_optimizer_state,
    optimizers_to_device,
    own_predictions,
    precision_name,
    raw_optimizer,
)

__all__ = ["PIPELINE_ARGUMENTS", "PIPELINE_UNLISTED", "PipelineStrategy", "check_pipeline_keywords"]

_CLIP_KEY = "lightning_accel.parallel.PipelineStrategy.clip_grad_by_norm"
_FORWARD_KEY = "lightning_accel.parallel.PipelineStrategy.forward"
_LOG_KEY = "lightning_accel.parallel.PipelineStrategy.log"

#: every module a PipelineStrategy split, with its runner: the split strips the module to this rank's stages, so a
#: later setup on it (another Trainer function, a second `fit`) must run on the same split
_RUNNERS: weakref.WeakKeyDictionary[torch.nn.Module, PipelineRunner] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _step_calls(module: pl.LightningModule, forward: Callable[..., Any], log: Callable[..., Any]) -> Iterator[None]:
    """Run the user's step with ``module.forward`` and ``module.log`` replaced; the originals are back afterwards."""
    patches = [
        patch(module, "forward", lambda p: forward, key=_FORWARD_KEY),
        patch(module, "log", lambda p: log, key=_LOG_KEY),
    ]
    try:
        yield
    finally:
        for p in reversed(patches):
            p.restore()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's CPU RNG state and, on a CUDA ``device``, that device's: what a step draws from."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    """Put back a state :func:`_rng_state` took (on another rank too: the state is plain bytes)."""
    torch.set_rng_state(state[0])
    if state[1] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _detached(data: Any) -> Any:
    """``data`` with every tensor detached and on the CPU: a step's outputs, pickled to the other ranks of the
    pipeline (a tensor that requires grad does not pickle, and a CUDA one would unpickle onto the sender's device)."""
    return apply_to_collection(data, torch.Tensor, lambda t: t.detach().cpu())


def _sendable(outputs: Any) -> Any:
    """``outputs`` when they pickle, else None with a warning: the last stage sends them to the other ranks of the
    pipeline, which would wait forever in the broadcast for a rank that failed to pickle them."""
    try:
        pickle.dumps(outputs)
    except Exception as e:  # noqa: BLE001 -- a lock, a generator, a CUDA stream: any object a step may return
        warnings.warn(
            f"PipelineStrategy: what the step returned beside its loss cannot be sent to the other ranks of the "
            f"pipeline ({type(e).__name__}: {one_line(e, first=True)}); the batch-end hooks get no `outputs` from "
            "it. Return tensors, numbers, strings and containers of them.",
            stacklevel=2,
        )
        return None
    return outputs


#: the error types a rank raises again as they are when another rank of its pipeline failed with one (others become a
#: ``RuntimeError`` naming the type)
_RERAISED: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}


def _raise_from(error: tuple[str, str], where: str) -> None:
    """Raise on this rank ``error`` (``(type name, one-line message)``) that another rank of the pipeline sent, saying
    ``where`` it happened unless the message is already the strategy's own: its type when :data:`_RERAISED` holds
    it, else a ``RuntimeError`` naming it."""
    kind, text = error
    if kind not in _RERAISED:
        kind, text = "RuntimeError", f"{kind}: {text}"
    if not text.startswith("PipelineStrategy:"):
        text = f"PipelineStrategy: {where}: {text}"
    raise _RERAISED[kind](text)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while the first stage's input is captured: the step runs again on the last stage, which logs."""


class _Captured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("forward input captured")
        self.args, self.kwargs = args, kwargs


class PipelineStrategy(_EvaluationBufferSync, DDPStrategy):
    """Pipeline parallelism (``torch.distributed.pipelining``) inside the Trainer's loop; registered as
    ``"pipeline"``.

    **What the LightningModule must provide**: (1) its network as pieces in forward order -- a ``pipeline_modules()``
    method on the LightningModule or on the network it holds (``TinyGPT``'s ``GPT`` has one), or the network as an
    ``nn.Sequential``; (2) a ``training_step`` (and ``validation_step`` / ``test_step``) that calls ``self(x)`` (its
    ``forward``, the composition of the pieces) exactly once with one tensor and computes its loss from the result;
    (3) an optimizer over ``self.parameters()`` (built after the split, so it holds only this rank's stages).

    **One step**: the batch is cut into ``microbatches``; on the first stage the step is run with ``forward``
    replaced by a probe that records its input (the stage-0 input of each micro-batch); the schedule runs forward
    and backward of all micro-batches; on the last stage the loss function *is* your ``training_step``, with
    ``forward`` returning the last stage's output, so your loss and your ``self.log`` calls run there unchanged (from
    the RNG state the first stage ran it from: noise the step draws before ``self(x)`` and predicts is the same noise
    on both stages). The values it logged (averaged over micro-batches) are sent to every rank of the pipeline and
    logged there too, so every rank logs the loss (``ModelCheckpoint(monitor=...)`` works on any rank). ``backward``
    is then a no-op (the schedule did it); gradients of tied parameters are summed between their stages and, with
    ``world > pipeline size``, averaged over the replicas (whose buffers, BatchNorm's running statistics, are copied
    from replica 0 before each training step and each evaluation, as ``DistributedDataParallel`` does);
    ``gradient_clip_val`` clips by the norm of the *whole* model's gradient. What the step returns beside its loss (a
    ``training_step``'s other dict keys, an evaluation step's return value) is joined over the micro-batches and
    handed to the batch-end hooks (``outputs``) on every rank of the pipeline, as without one: per-sample tensors
    concatenated, floating-point scalars averaged (:func:`~lightning_accel.parallel.pipeline.join_outputs`). A batch
    may be a tensor, or tuples, namedtuples, lists and mappings of them (a tokenizer's ``BatchEncoding`` too): each
    micro-batch is of the batch's type, and a list of plain values with one per sample (the names ``default_collate``
    gathers) is split with the rows (:func:`~lightning_accel.parallel.pipeline.split_batch`).
    The schedule averages the micro-batches' gradients (torch's pipelining rule) and the logged values are their
    mean: that is one process's step for a loss that is a *mean* over the batch's samples (``F.cross_entropy``'s
    default). A loss *summed* over the samples (``reduction="sum"``) trains with ``1 / microbatches`` of one
    process's gradient and logs ``1 / microbatches`` of its value (checked: 0.25 with 4 micro-batches): divide it by
    the batch size, or use a mean. **BatchNorm** normalises each micro-batch with that micro-batch's statistics and
    updates its running statistics once per micro-batch (torch's schedules run each micro-batch's forward on its own):
    a model with BatchNorm does not train exactly as in one process or under DDP (whose ranks normalise their whole
    per-device batch); ``microbatches`` sets the rows each statistic sees (``batch / microbatches``).

    **Checkpoints**: the stages' states are gathered to rank 0 and saved as one full checkpoint through the
    ``CheckpointIO`` (the model ``state_dict`` is the unsplit model's, so the file also loads without a pipeline;
    optimizer state is keyed by parameter name, its parameters listed in the unsplit model's order, so a one-process
    ``optimizer.load_state_dict`` matches them); on resume every rank reads it and keeps its stage's part. A
    checkpoint saved by DDP or one process (its optimizer state lists the parameters by position) resumes too: the
    positions are named in the unsplit model's order first.

    **Failures**: a setup that fails on one rank before the pipeline's process groups are made (its
    ``pipeline_modules()`` raises there) fails on every rank, naming that rank and its error; a step that fails on the
    first or the last stage's rank (one that calls ``self.net(x)`` instead of ``self(x)`` is refused, naming
    ``self.net``) fails on every rank of the pipeline with that error, instead of leaving the others waiting for the
    process group's timeout. The groups are destroyed at teardown and made again by a later setup on the split module.

    **Frozen parameters**: the split gives every stage a trainable parameter when it can (a frozen backbone shares a
    stage with a piece that trains), since a stage without one would leave its rank's optimizer empty; a ``fit``
    whose pipeline has more stages than trainable pieces is refused at setup, on every rank, naming the stages.

    Args:
        pipeline_size: ranks per pipeline (None: the world size); ``world / pipeline_size`` replicas train data
            parallel.
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleaved1f1b"``.
        microbatches: micro-batches per step (None: ``2 x pipeline_size``,
            :func:`~lightning_accel.parallel.estimate.default_microbatches`); must divide the training batch size.
            An evaluation or prediction batch they do not divide (a loader's last, smaller batch) runs in the largest
            count below that does (:meth:`~lightning_accel.parallel.pipeline.PipelineRunner.eval_microbatches`).
        stages_per_rank: stages per rank (interleaved: default 2).
        batch_split: ``"data_parallel"`` (the ranks of one pipeline read the same batch: the global batch is
            ``replicas x batch_size``) or ``"world"`` (the sampler splits over every rank, as DDP's, and each pipeline
            gathers its ranks' batches into the one it runs: the global batch and the steps per epoch are those of
            DDP on the same Trainer; what ``AutoStrategy`` uses).
        **ddp_kwargs: ``process_group_backend``, ``timeout``, ...: ``DDPStrategy``'s own arguments
            (:data:`PIPELINE_ARGUMENTS`). ``DistributedDataParallel``'s keywords are accepted, since LightningCLI
            fills them all in, but the pipeline is not wrapped in it, so one set to another value than its default
            only draws a warning; any other name is refused (``TypeError``, naming the closest accepted one).

    ``predict`` runs the batch through the pipeline like an evaluation step; the last stage calls ``predict_step``
    on each micro-batch's output, the micro-batches' predictions are joined
    (:func:`~lightning_accel.parallel.pipeline.join_outputs`), moved to the CPU and returned on every rank of the
    pipeline (with ``batch_split="data_parallel"``: every rank of a pipeline read the same batch; with
    ``batch_split="world"`` each rank gets the predictions of the rows it read, as under DDP); a ``predict_step``
    that returns nothing (it writes its predictions away) predicts ``None`` per batch, as without a pipeline.

    Not supported: ``16-mixed`` (its GradScaler would unscale after the stage-wise clipping; use ``bf16-mixed``),
    manual optimization, ``nn.SyncBatchNorm`` in a ``fit`` (it syncs over every rank in each training forward while a
    stage runs on one rank: refused at setup, on every rank) and any other module that runs a collective over every
    rank in its forward (nothing can detect one before it waits).
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pipeline_size: int | None = None,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        batch_split: str = "data_parallel",
        **ddp_kwargs: Any,
    ) -> None:
        # a misspelled `micro_batches=8` would go on to DDPStrategy, which keeps it for a DDP wrapper never built here.
        # DistributedDataParallel's own keywords pass (LightningCLI fills every one in, at its default), with a warning
        # when one is set: no DDP wrapper is built, so it changes nothing
        check_pipeline_keywords("PipelineStrategy", ddp_kwargs, kind=TypeError)
        unused = [
            k for k, v in ddp_kwargs.items() if k in _DDP_WRAPPER_DEFAULTS and not _is(v, _DDP_WRAPPER_DEFAULTS[k])
        ]
        if unused:
            rank_zero_warn(
                f"PipelineStrategy ignores {', '.join(f'`{k}`' for k in unused)}: the pipeline's stages are not "
                "wrapped in DistributedDataParallel (the pipeline syncs their gradients itself). Drop the argument(s)."
            )
        check_choice("batch_split", batch_split, BATCH_SPLITS)
        check_int("pipeline_size", pipeline_size, low=1, allow_none=True)
        check_int("microbatches", microbatches, low=1, allow_none=True)
        spr = resolve_stages_per_rank(schedule, stages_per_rank)
        if pipeline_size is not None and microbatches is not None:
            # what the runner refuses at setup, after every process has started: both are known here
            check_microbatches(microbatches, pipeline_size, schedule)
        super().__init__(**ddp_kwargs)
        self.pipeline_size = pipeline_size
        self.schedule = schedule
        self.microbatches = microbatches
        self.stages_per_rank = spr
        self.batch_split = batch_split
        self.runner: PipelineRunner | None = None
        # the step running and what Lightning passed it after the batch (`batch_idx` when the step takes it,
        # `dataloader_idx` with several loaders): the step runs again on every micro-batch with the same ones
        self._hook: tuple[str, tuple[Any, ...], dict[str, Any]] = ("training_step", (), {})
        self._logged: dict[int, dict[str, tuple[float, dict[str, Any]]]] = {}
        self._mbs: list[Any] = []
        # per micro-batch, torch's RNG state on the first stage's rank before its step ran to `self(x)`: the last
        # stage runs the step again from the same state, so what it draws (noise added to the input, and predicted
        # as the target) is what the first stage's input was made with
        self._rngs: list[Any] = []
        self._predicted: dict[int, Any] = {}  # predict: each micro-batch's `predict_step` output (last stage)
        # training / evaluation: each micro-batch's step output beside the loss (last stage), for the batch-end hooks
        self._outputs: dict[int, Any] = {}
        self._failure: Exception | None = None  # the step's failure on the last stage, raised after the schedule
        # the runner, and the submodules a step must not call on the first stage (`_no_direct_calls`)
        self._direct: tuple[PipelineRunner, list[tuple[str, torch.nn.Module]]] | None = None
        self._grads: list[torch.Tensor | None] = []
        self._clip_patch: Patch | None = None
        self._local_rows = 0  # `batch_split="world"`: the rows this rank read of the batch its pipeline gathered

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "pipeline", cls, description="Pipeline parallel (torch.distributed.pipelining, 1F1B) (lightning-accel)"
        )

    # ----------------------------------------------------------------------------------------------- layout
    @property
    def _pp(self) -> int:
        world = self.num_nodes * len(self.parallel_devices or [self.root_device])
        return self.pipeline_size or world

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.batch_split == "world":  # every rank reads its own part; `batch_to_device` gathers the pipeline's
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        # every rank of one pipeline reads the same batch; the replicas read different ones
        return {"num_replicas": max(1, self.world_size // self._pp), "rank": self.global_rank // self._pp}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.batch_split == "world" and self.runner is not None:
            # this rank's rows: `predict_step` hands back its own share of the gathered batch's predictions
            self._local_rows = leading_rows(batch)
            batch = gather_batch(batch, self.runner.pp_group)
        return batch

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the split module: each rank keeps its stage's part

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        precision = precision_name(self.precision_plugin)
        if precision.startswith("16"):
            raise ValueError(
                f"PipelineStrategy does not support `precision={precision!r}` (its GradScaler would unscale the "
                "gradients after the pipeline's whole-model clipping). Use 'bf16-mixed' or '32-true'."
            )
        if not module.automatic_optimization:
            raise ValueError("PipelineStrategy needs automatic optimization (`self.automatic_optimization = True`).")
        fitting = trainer.state.fn == TrainerFn.FITTING
        runner = _RUNNERS.get(module)
        plan: tuple[list[torch.nn.Module], PipelineLayout] | None = None
        # the split makes process groups (`new_group`, collective): a rank that fails before it alone would leave the
        # others waiting there for the process group's timeout (30 minutes by default), so every rank first learns
        # whether every other one got this far, and all raise at once
        try:
            if fitting:
                # before any forward (the split measures one): a stage's `SyncBatchNorm` syncs in training only, and
                # the rank running it would wait forever for the ranks running other stages
                try:
                    check_no_sync_batchnorm(module, model=f"`{type(module).__name__}`")
                except ValueError as e:
                    raise ValueError(f"PipelineStrategy: {e}") from None
            if runner is None:
                plan = self._plan(module, fitting)
            else:  # `validate`/`test`/`predict` after `fit`, a second `fit`: the module holds only this rank's stages
                self._check_reuse(module, runner)
                if fitting:
                    self._check_stages_train(module, runner.layout.bounds, runner.trainable)
        except Exception as e:
            self._agree(module, e)
            raise
        self._agree(module, None)
        if plan is not None:
            self.runner = _RUNNERS[module] = self._split(module, *plan)
        else:
            assert runner is not None
            self._reuse(runner)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()
        # `gradient_clip_val` clips by the whole model's norm: Lightning calls this method of the precision plugin
        # right before the optimizer step; a stage alone would clip by its own, smaller norm
        self._clip_patch = patch(
            self.precision_plugin, "clip_grad_by_norm", lambda p: self._clip_whole_model, key=_CLIP_KEY
        )

    def _agree(self, module: pl.LightningModule, error: BaseException | None) -> None:
        """Learn from every rank whether its setup got to the split (``error``: this rank's failure, None if it did);
        raise on every rank when one failed: its own error there (the caller re-raises it), elsewhere one line naming
        the rank and its error. A collective reached on every rank
        (:func:`~lightning_accel._utils.rank.raise_if_any_rank_failed`)."""
        raise_if_any_rank_failed(
            error,
            lambda rank, more: (
                f"PipelineStrategy: rank {rank} could not split `{type(module).__name__}` into "
                f"pipeline stages{more}, so no rank can"
            ),
            device=self.root_device,
        )

    def _plan(self, module: pl.LightningModule, fitting: bool) -> tuple[list[torch.nn.Module], PipelineLayout]:
        """The pieces of ``module`` and their split into stages (no collective, the module unchanged); every stage
        gets a trainable piece when it can, and a ``fit`` whose split leaves a stage without one is refused
        (:meth:`_check_stages_train`)."""
        pieces = find_pipeline_modules(module)
        example = getattr(module, "example_input_array", None)
        costs = piece_costs(pieces, example if isinstance(example, torch.Tensor) else None)
        trainable = trainable_pieces(pieces)
        layout = pipeline_layout(
            costs,
            self.world_size,
            pipeline_size=self.pipeline_size,
            stages_per_rank=self.stages_per_rank,
            trainable=trainable,
        )
        if fitting:
            self._check_stages_train(module, layout.bounds, trainable)
        return pieces, layout

    def _split(
        self, module: pl.LightningModule, pieces: list[torch.nn.Module], layout: PipelineLayout
    ) -> PipelineRunner:
        """Split ``module`` into the stages of ``layout`` and keep only this rank's (see :class:`PipelineRunner`).
        Collective: it makes the pipeline's process groups."""
        runner = PipelineRunner(
            module,
            pieces,
            layout,
            rank=self.global_rank,
            device=self.root_device,
            schedule=self.schedule,
            microbatches=self.microbatches or default_microbatches(layout.pp),
            loss_fn=self._loss_fn,
        )
        rank_zero_info(
            f"PipelineStrategy: {len(pieces)} pieces of `{type(module).__name__}` in {layout.num_stages} stages "
            f"{list(layout.bounds)} over {layout.pp} ranks x {layout.dp} replica(s), schedule {self.schedule}, "
            f"{runner.microbatches} micro-batches."
        )
        return runner

    @staticmethod
    def _check_stages_train(
        module: pl.LightningModule, bounds: tuple[tuple[int, int], ...], trainable: Sequence[bool]
    ) -> None:
        """Refuse a fit in which a stage holds no trainable parameter: that rank's ``configure_optimizers`` would
        get an empty parameter list and raise alone, leaving the other ranks waiting. Every rank splits the same
        model the same way, so every rank raises here, alike."""
        try:
            check_stages_train(bounds, trainable, model=f"`{type(module).__name__}`")
        except ValueError as e:
            raise ValueError(f"PipelineStrategy: {e}") from None

    def _check_reuse(self, module: pl.LightningModule, runner: PipelineRunner) -> None:
        """Refuse to run on the split an earlier setup made of ``module`` with other pipeline settings: splitting it
        again would balance the pieces this rank kept (the others' parameters are gone), so the ranks would disagree
        on the stages.

        Raises:
            ValueError: this strategy asks for another split than the one ``module`` has (both, and the fix).
        """
        lay = runner.layout
        have = (lay.dp * lay.pp, lay.pp, lay.stages_per_rank, runner.schedule_name, runner.microbatches, runner.rank)
        want = (
            self.world_size,
            self._pp,
            self.stages_per_rank,
            self.schedule,
            self.microbatches or default_microbatches(self._pp),
            self.global_rank,
        )
        if have != want:
            names = ("world_size", "pipeline_size", "stages_per_rank", "schedule", "microbatches", "global_rank")
            diff = ", ".join(f"`{n}` {h!r} (now {w!r})" for n, h, w in zip(names, have, want, strict=True) if h != w)
            raise ValueError(
                f"PipelineStrategy: `{type(module).__name__}` was already split into pipeline stages with {diff}; "
                "each rank holds only its stages, so it cannot be split again. Use the same pipeline settings, or "
                "a fresh module (load the saved checkpoint into it)."
            )

    def _reuse(self, runner: PipelineRunner) -> None:
        """Run on ``runner``, the split an earlier setup made (:meth:`_check_reuse`): its process groups, destroyed
        at that run's teardown, are made again (collective)."""
        runner.reopen()
        if getattr(runner.loss_fn, "__self__", None) is not self:
            runner.set_loss_fn(self._loss_fn)
        self.runner = runner

    def _clip_whole_model(self, optimizer: Any, clip_val: float) -> Any:
        """``Precision.clip_grad_by_norm`` while this strategy runs: the norm over every stage's gradients."""
        assert self.runner is not None, "PipelineStrategy.setup builds the pipeline"
        return self.runner.clip_grad_norm_(float(clip_val))

    # --------------------------------------------------------------------------------------------------- steps
    def _step_hook(
        self, module: pl.LightningModule, name: str, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The LightningModule's step ``name`` on ``batch`` (one micro-batch) with the other arguments Lightning
        passed the strategy's step (``args`` / ``kwargs``, as given: a step without ``batch_idx`` gets none, one with
        ``dataloader_idx`` gets it with several loaders)."""
        return getattr(module, name)(batch, *args, **kwargs)

    def _capture(
        self, module: pl.LightningModule, name: str, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """The tensor ``name`` passes to ``self(...)`` for ``batch``: run it until it calls forward."""

        def probe(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

        try:
            with _step_calls(module, probe, _no_log), self._no_direct_calls(module, name):
                self._step_hook(module, name, batch, args, kwargs)
        except _Captured as c:
            if len(c.args) != 1 or c.kwargs or not isinstance(c.args[0], torch.Tensor):
                raise TypeError(
                    f"PipelineStrategy: `{type(module).__name__}.{name}` called `self(...)` with {len(c.args)} "
                    f"positional and {len(c.kwargs)} keyword argument(s); the first pipeline stage takes exactly one "
                    "tensor. Call `self(x)` with one tensor."
                ) from None
            return c.args[0]
        raise TypeError(
            f"PipelineStrategy: `{type(module).__name__}.{name}` did not call `self(...)`: the pipeline runs the "
            "LightningModule's forward stage by stage, so the step must call `self(x)` (not `self.model(x)`) once."
        )

    @contextlib.contextmanager
    def _no_direct_calls(self, module: pl.LightningModule, name: str) -> Iterator[None]:
        """Refuse, while the step runs on the first stage, a call to a submodule that runs pieces of other ranks'
        stages (``self.net(x)`` instead of ``self(x)``): their parameters are gone from this rank, and torch would
        fail deep inside with ``weight ... must be Tensor, not NoneType``. Raises a ``TypeError`` naming the
        submodule's path and the fix."""
        runner = self.runner
        assert runner is not None
        if self._direct is None or self._direct[0] is not runner:
            own = {id(m) for stage in runner.stage_modules for m in stage.modules()}
            foreign = {
                id(m) for piece in runner.pieces if id(piece) not in own for m in piece.modules() if id(m) not in own
            }
            # the outermost module called (`self.net`) is named: an ancestor of a piece on another rank, or that piece
            found = [
                (path, m)
                for path, m in module.named_modules()
                if path and id(m) not in own and any(id(sub) in foreign for sub in m.modules())
            ]
            self._direct = (runner, found)
        handles = []

        def refuse(path: str) -> Callable[..., None]:
            def hook(m: torch.nn.Module, args: Any) -> None:
                raise TypeError(
                    f"PipelineStrategy: `{type(module).__name__}.{name}` called `self.{path}` directly, which runs "
                    "pipeline stages held by other ranks (their parameters are not on this one): the pipeline runs "
                    "the LightningModule's forward stage by stage, so the step must call `self(x)` (with `forward` "
                    f"calling `self.{path}(x)`)."
                )

            return hook

        for path, m in self._direct[1]:
            handles.append(m.register_forward_pre_hook(refuse(path)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _loss_fn(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The last stage's loss (:meth:`_step_loss`). The step failing here fails on this rank alone, inside the
        schedule, where the other ranks of the pipeline would wait for its gradients until the process group's
        timeout: the failure is kept instead, the schedule finishes on a zero loss (later micro-batches skip the
        step), and :meth:`_share_last_stage` raises it on every rank of the pipeline."""
        if self._failure is None:
            try:
                return self._step_loss(output, index)
            except Exception as e:  # noqa: BLE001 -- raised on every rank after the schedule
                self._failure = e
        return output.float().sum() * 0.0

    def _step_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The user's step on micro-batch ``index`` with ``forward`` returning the pipeline's output. (The schedule's
        first step also calls it once to infer gradient shapes; keyed by index, that call's logs are replaced by the
        real one's.)"""
        module = self.lightning_module
        assert module is not None
        name, args, kwargs = self._hook
        i = int(index.reshape(-1)[0])
        batch = self._mbs[i]
        logged: dict[str, tuple[float, dict[str, Any]]] = {}

        def log(key: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                logged[key] = (float(value.detach()), kwargs)
            elif isinstance(value, (int, float)):
                logged[key] = (float(value), kwargs)
            else:
                rank_zero_warn(f"PipelineStrategy logs scalars only; `{key}` ({type(value).__name__}) is dropped.")

        def forward(*args: Any, **kwargs: Any) -> Any:
            return output

        own = _rng_state(self.root_device)
        _set_rng_state(self._rngs[i], self.root_device)  # the first stage's draws, where the step made its input
        try:
            with _step_calls(module, forward, log):
                out = self._step_hook(module, name, batch, args, kwargs)
        finally:  # this rank's own stream goes on (its stages' dropout)
            _set_rng_state(own, self.root_device)
        self._logged[i] = logged
        if name == "predict_step":
            self._predicted[i] = out
            return output.float().sum() * 0.0
        # what Lightning hands `on_*_batch_end` as `outputs`: a training step's keys beside "loss", an evaluation
        # step's return value (detached: they go to the other ranks of the pipeline)
        if name != "training_step":
            self._outputs[i] = _detached(out)
        elif isinstance(out, Mapping):
            self._outputs[i] = _detached({k: v for k, v in out.items() if k != "loss"})
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, torch.Tensor):
            return loss
        if name == "training_step":
            raise TypeError(
                f"PipelineStrategy: `{type(module).__name__}.training_step` returned {type(out).__name__}; it must "
                "return the loss tensor (or a dict with 'loss')."
            )
        return output.float().sum() * 0.0  # an evaluation step that only logs

    def _run(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> tuple[torch.Tensor, Any]:
        """One pipelined step of the LightningModule's ``name`` on ``args[0]`` (the batch), each micro-batch's step
        called with the rest of ``args`` and ``kwargs``, what Lightning passed the strategy's step. Returns the mean
        micro-batch loss and the step's outputs beside it (:meth:`_share_last_stage`), on every rank of the
        pipeline."""
        module, runner = self.lightning_module, self.runner
        batch, rest = args[0], tuple(args[1:])
        assert module is not None and runner is not None, "PipelineStrategy.setup builds the pipeline"
        n = runner.microbatches
        if not train:  # every rank of the pipeline holds the same batch: they choose the same count
            rows = next((t.shape[0] for t in batch_tensors(batch) if t.ndim), 0)
            n = runner.eval_microbatches(int(rows))
        mbs = split_batch(batch, n)
        key = tuple(tuple(t.shape) for t in batch_tensors(mbs[0]))
        inputs: list[torch.Tensor] | None = None
        rngs: list[Any] = []
        failure: Exception | None = None
        if runner.has_first:
            inputs = []
            try:
                for mb in mbs:
                    rngs.append(_rng_state(self.root_device))
                    inputs.append(self._capture(module, name, mb, rest, kwargs))
            except Exception as e:  # noqa: BLE001 -- sent to the other ranks below, then raised
                failure = e
        # the first stage's RNG states to the last stage (another rank, whose own RNG has drawn other numbers), or
        # the first stage's failure: the other ranks would otherwise wait for its activations until the timeout
        src = runner.layout.rank_of(0, runner.replica)
        payload: list[Any] = [rngs, None if failure is None else (type(failure).__name__, one_line(failure))]
        torch.distributed.broadcast_object_list(payload, src=src, group=runner.pp_group)
        if failure is not None:
            raise failure
        if payload[1] is not None:
            _raise_from(payload[1], f"`{type(module).__name__}.{name}` failed on rank {src} (the first stage)")
        self._hook, self._logged, self._mbs, self._rngs = (name, rest, kwargs), {}, mbs, payload[0]
        self._outputs, self._failure = {}, None
        targets = [torch.tensor([i]) for i in range(len(mbs))] if runner.has_last else None
        loss = runner.step(inputs, targets, key) if train else runner.evaluate(inputs, targets, key, n)
        outputs = self._share_last_stage(module, runner)
        self._mbs, self._rngs, self._outputs = [], [], {}
        if self.batch_split == "world" and outputs is not None:  # alike on every rank: the outputs were broadcast
            # the pipeline ran its ranks' batches gathered: this rank's rows of them, as under DDP
            outputs = own_predictions(outputs, self._local_rows, runner.pp_group)
        return loss, outputs

    def _share_last_stage(self, module: pl.LightningModule, runner: PipelineRunner) -> Any:
        """Log on every rank of the pipeline what the step logged on the last stage (mean over micro-batches), and
        return there the step's outputs beside the loss: a training step's other keys (a dict; None when it returned
        the loss alone), an evaluation step's return value, joined over the micro-batches
        (:func:`~lightning_accel.parallel.pipeline.join_outputs` with ``average_scalars``: a per-sample tensor
        concatenated, a scalar averaged as the loss and the logged values are)."""
        payload: list[Any] = [None]
        failure: Exception | None = None
        if runner.has_last:
            sums: dict[str, list[Any]] = {}
            for rec in self._logged.values():
                for k, (v, kw) in rec.items():
                    sums.setdefault(k, [0.0, 0, kw])
                    sums[k][0] += v
                    sums[k][1] += 1
            parts = [self._outputs[i] for i in sorted(self._outputs)]
            failure, self._failure = self._failure, None
            if failure is not None:  # the step failed on this rank (:meth:`_loss_fn`): every rank raises
                payload[0] = ({}, None, (type(failure).__name__, one_line(failure)))
            else:
                outputs = _sendable(join_outputs(parts, average_scalars=True) if parts else None)
                payload[0] = ({k: (s / n, kw) for k, (s, n, kw) in sums.items()}, outputs, None)
        src = runner.layout.rank_of(runner.layout.num_stages - 1, runner.replica)
        torch.distributed.broadcast_object_list(payload, src=src, group=runner.pp_group)
        if failure is not None:
            raise failure
        logged, outputs, error = payload[0]
        if error is not None:
            _raise_from(error, f"`{type(module).__name__}.{self._hook[0]}` failed on rank {src} (the last stage)")
        for k, (v, kw) in logged.items():
            module.log(k, torch.tensor(v, device=self.root_device), **kw)
        return move_data_to_device(outputs, self.root_device)

    @override
    def _sync_buffers(self) -> None:
        # each replica's stages update their own buffers (BatchNorm's running statistics from the replica's batches):
        # without this the replicas' statistics drift apart for good, replica 0's alone reach the checkpoint, and each
        # replica evaluates with its own. Replica 0's are copied to the others, as DistributedDataParallel does
        runner, module = self.runner, self.lightning_module
        if runner is not None and module is not None and runner.layout.dp > 1:
            broadcast_buffers(module, src=runner.layout.rank_of(runner.pp_rank, 0), group=runner.dp_group)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One pipelined step (see the class notes), after every buffer of this rank's stages (BatchNorm's running
        statistics) is copied from replica 0 to the other replicas, as ``DistributedDataParallel`` does before each
        training forward."""
        assert self.runner is not None
        self._sync_buffers()
        params = self.runner.params
        # Lightning zeroes the gradients between `training_step` and `backward` (it expects backward to make them),
        # so the schedule starts from none, its gradients wait aside until `backward`, and what was there before
        # (the previous step's, or those kept by gradient accumulation) is put back for Lightning to zero or keep
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss, extra = self._run("training_step", args, kwargs, train=True)
        self._grads = [p.grad for p in params]
        for p, g in zip(params, before, strict=False):
            p.grad = g
        # a step that returned a dict: its other keys reach `on_train_batch_end` (its `outputs`), as without a pipeline
        return {"loss": loss, **extra} if extra else loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """What the LightningModule's ``validation_step`` returned, joined over the micro-batches (the ``outputs``
        of ``on_validation_batch_end``, as without a pipeline), on every rank of the pipeline."""
        with self.precision_plugin.val_step_context():
            return self._run("validation_step", args, kwargs, train=False)[1]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """What the LightningModule's ``test_step`` returned, joined over the micro-batches (see
        :meth:`validation_step`)."""
        with self.precision_plugin.test_step_context():
            return self._run("test_step", args, kwargs, train=False)[1]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions on every rank of this pipeline (see the class notes), on the CPU; with
        ``batch_split="world"`` each rank's share of them, the rows of the batch it read (as under DDP)."""
        runner = self.runner
        assert runner is not None, "PipelineStrategy.setup builds the pipeline"
        self._predicted = {}
        with self.precision_plugin.predict_step_context():
            self._run("predict_step", args, kwargs, train=False)
        payload: list[Any] = [None]
        if runner.has_last:
            parts = [self._predicted[i] for i in sorted(self._predicted)]
            payload[0] = move_data_to_device(join_outputs(parts), torch.device("cpu"))
        self._predicted = {}
        src = runner.layout.rank_of(runner.layout.num_stages - 1, runner.replica)
        torch.distributed.broadcast_object_list(payload, src=src, group=runner.pp_group)
        if self.batch_split == "world":  # the pipeline ran its ranks' batches gathered: keep this rank's rows
            return own_predictions(payload[0], self._local_rows, runner.pp_group)
        return payload[0]

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the schedule already ran every micro-batch's backward in `training_step`: hand its gradients back (added
        # to what gradient accumulation kept), and run the hooks. Lightning divides the loss it would backpropagate
        # by `accumulate_grad_batches`; the schedule backpropagated the undivided one, so its gradients are divided
        # here (the accumulated gradient is then the mean over the batches, as in one process)
        module = self.lightning_module
        assert module is not None and self.runner is not None
        try:
            accumulate = module.trainer.accumulate_grad_batches
        except RuntimeError:  # not attached to a Trainer (the strategy driven by hand): nothing accumulates
            accumulate = 1
        for p, g in zip(self.runner.params, self._grads, strict=False):
            if g is not None:
                if accumulate > 1:
                    g = g / accumulate
                p.grad = g if p.grad is None else p.grad + g
        self._grads = []
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    # --------------------------------------------------------------------------------------------- checkpoints
    def _gather_to_zero(self, local: Any) -> list[Any]:
        out: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        torch.distributed.gather_object(local, out, dst=0)
        return out or []

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None
        local = {k: v.detach().cpu() for k, v in module.state_dict().items()} if runner.replica == 0 else {}
        merged: dict[str, Any] = {}
        for part in self._gather_to_zero(local):
            merged.update(part)
        return merged

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None
        local = None
        if runner.replica == 0:
            local = get_optimizer_state_dict(
                module, raw_optimizer(optimizer), options=StateDictOptions(cpu_offload=True)
            )
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for part in self._gather_to_zero(local):
            if not part:
                continue
            merged["state"].update(part["state"])
            if not merged["param_groups"]:
                merged["param_groups"] = [dict(g, params=list(g["params"])) for g in part["param_groups"]]
            else:
                for g, h in zip(merged["param_groups"], part["param_groups"], strict=False):
                    g["params"] += [p for p in h["params"] if p not in g["params"]]
        # the ranks' parts come rank by rank (an interleaved rank holds stages 0 and 2): put every group's parameters,
        # and the state, in the unsplit model's order, the order a one-process optimizer built over
        # `self.parameters()` has; `Optimizer.load_state_dict` matches them by position (a checkpoint loaded
        # without the pipeline), the pipeline's own load by name
        order = runner.param_order

        def place(name: Any) -> int:
            return order.get(name, len(order))

        for g in merged["param_groups"]:
            g["params"].sort(key=place)  # stable: a name the model does not list keeps its place after the others
        merged["state"] = {k: merged["state"][k] for k in sorted(merged["state"], key=place)}
        return merged

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The full checkpoint at ``checkpoint_path``, read on every rank (each keeps its stage's part on load).

        Raises:
            ValueError: ``checkpoint_path`` is a folder (a sharded ``torch.distributed.checkpoint``, as
                ``ShardedStrategy(save_distributed_checkpoint=True)`` saves), which the pipeline cannot read; every
                rank raises alike.
            RuntimeError: another rank could not read the file (one line naming it and its error; that rank raises
                its own error). Collective: every rank learns whether every other one read it.
        """

        def failed(rank: int, more: str) -> str:
            return (
                f"PipelineStrategy: rank {rank} could not read the checkpoint `{checkpoint_path}`{more}, so no rank can"
            )

        # every rank reads the file itself: one that cannot (a node-local path, a file not yet visible on another
        # node) would raise alone, and the others would train on into their first collective and wait there for the
        # process group's timeout
        try:
            if os.path.isdir(os.fspath(checkpoint_path)):
                # the CheckpointIO would fail with "Is a directory", naming neither the format nor the way out
                raise ValueError(
                    f"PipelineStrategy cannot resume from `{checkpoint_path}`: it is a folder (a sharded "
                    "torch.distributed.checkpoint, as `ShardedStrategy(save_distributed_checkpoint=True)` saves), and "
                    "the pipeline reads full checkpoint files. Resume it with `ShardedStrategy`, or save with "
                    "`save_distributed_checkpoint=False` (the default) for a file any plan resumes from."
                )
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except Exception as e:
            raise_if_any_rank_failed(e, failed, device=self.root_device)
            raise
        raise_if_any_rank_failed(None, failed, device=self.root_device)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        own = module.state_dict()
        state = {k: v for k, v in checkpoint["state_dict"].items() if k in own}
        missing = sorted(set(own) - set(state))
        if strict and missing:
            raise KeyError(f"PipelineStrategy: the checkpoint lacks this stage's keys {missing[:5]}.")
        module.load_state_dict(state, strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        module = self.lightning_module
        assert module is not None
        own = {n for n, _ in module.named_parameters()}
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            if _positional(state):  # a DDP or one-process checkpoint: name its parameters first (every rank alike)
                state = named_optimizer_state(state, self._group_names(raw_optimizer(opt)), "PipelineStrategy")
            mine: dict[str, Any] = {
                "state": {k: v for k, v in state["state"].items() if k in own},
                "param_groups": [dict(g, params=[p for p in g["params"] if p in own]) for g in state["param_groups"]],
            }
            set_optimizer_state_dict(module, raw_optimizer(opt), mine)

    def _group_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        """Per parameter group of ``optimizer``, the names of the unsplit model's parameters in it, in the unsplit
        model's order (what a one-process optimizer over ``self.parameters()`` lists by position), each under the
        name this rank knows it by where it holds it. Collective over the ranks of this pipeline, which hold every
        stage between them."""
        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None
        order = runner.param_order
        names = {id(p): n for n, p in module.named_parameters()}
        local = [[(order[names[id(p)]], names[id(p)]) for p in g["params"]] for g in optimizer.param_groups]
        parts: list[Any] = [None] * torch.distributed.get_world_size(runner.pp_group)
        torch.distributed.all_gather_object(parts, local, group=runner.pp_group)
        out: list[list[str]] = []
        for i, mine in enumerate(local):
            by_place = {place: name for part in parts if i < len(part) for place, name in part[i]}
            by_place.update(dict(mine))  # a tied parameter under this rank's name for it
            out.append([by_place[place] for place in sorted(by_place)])
        return out

    @override
    def teardown(self) -> None:
        """Restore the precision plugin's clipping and destroy the pipeline's process groups (NCCL warns about groups
        left at exit); the split stays with the module, and a later setup on it makes its groups again."""
        if self._clip_patch is not None:  # the precision plugin clips the torch way again
            self._clip_patch.restore()
            self._clip_patch = None
        if self.runner is not None:
            self.runner.release()
        super().teardown()


def _positional(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state lists its parameters by position (ints), as ``DDPStrategy`` and one process save."""
    return any(isinstance(p, int) for g in state.get("param_groups", []) for p in g["params"])


#: the keywords ``PipelineStrategy(...)`` takes: its own and ``DDPStrategy``'s named arguments (plus, passing with a
#: warning when set, DistributedDataParallel's: ``_DDP_WRAPPER_DEFAULTS``)
PIPELINE_ARGUMENTS = keyword_names(PipelineStrategy.__init__, DDPStrategy.__init__)
#: DistributedDataParallel's keywords and their defaults, where DDPStrategy's ``**kwargs`` go (the wrapped module is
#: no keyword)
_DDP_WRAPPER_DEFAULTS = {
    k: v
    for k, v in keyword_defaults(torch.nn.parallel.DistributedDataParallel.__init__).items()
    if k != "module" and k not in PIPELINE_ARGUMENTS
}
#: the names of ``_DDP_WRAPPER_DEFAULTS``: accepted, too many to list in an error
PIPELINE_UNLISTED = tuple(_DDP_WRAPPER_DEFAULTS)


def check_pipeline_keywords(name: str, kwargs: Mapping[str, Any], *, kind: type[Exception] = ValueError) -> None:
    """Refuse keywords of ``kwargs`` that ``PipelineStrategy(...)`` does not take (one line, ``kind``, naming
    ``name`` and the closest accepted name); ``DistributedDataParallel``'s keywords pass."""
    check_keywords(
        name,
        kwargs,
        PIPELINE_ARGUMENTS,
        unlisted=PIPELINE_UNLISTED,
        unlisted_as="DistributedDataParallel's keywords",
        kind=kind,
    )


def _is(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default`` (as LightningCLI fills it in); a value that cannot compare is not."""
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except Exception:  # noqa: BLE001 -- a tensor, a mesh: never "equal" to a default
        return False
