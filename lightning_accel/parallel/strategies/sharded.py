"""``ShardedStrategy``: Lightning's ``ModelParallelStrategy`` that parallelises an unchanged LightningModule itself
(FSDP2, tensor parallel, or both on a 2-D mesh)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.checks import check_bool, check_choice, check_int, renamed_argument
from lightning_accel._utils.patching import Patch, patch
from lightning_accel._utils.rank import raise_if_any_rank_failed
from lightning_accel.parallel.plans import (
    apply_tensor_parallel,
    check_plan_styles,
    check_tensor_parallel_plan,
    describe_coverage,
    fsdp_groups,
    fsdp_units,
    is_parallelized,
    mixed_precision_policy,
    pack_rows,
    tensor_parallel_coverage,
    tensor_parallel_plan,
    unpack_rows,
)
from lightning_accel.parallel.strategies._helpers import (
    BATCH_SPLITS,
    _EvaluationBufferSync,
    broadcast_buffers,
    broadcast_tensors,
    gather_batch,
    leading_rows,
    named_optimizer_state,
    optimizers_to_device,
    own_predictions,
    precision_name,
    raw_optimizer,
)

__all__ = ["ShardedStrategy"]

_CLIP_KEY = "lightning_accel.parallel.ShardedStrategy.clip_grad_by_norm"
_CLIP_VALUE_KEY = "lightning_accel.parallel.ShardedStrategy.clip_grad_by_value"


def _clip_mixed_grad_norm(optimizer: Any, clip_val: float) -> float:
    """``clip_grad_norm_`` over the parameters of ``optimizer`` when DTensor and plain gradients mix: the norm of each
    gradient (a DTensor's reduced over its mesh; a replicated plain one counted once), then one scale for all."""
    grads = [p.grad for g in raw_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None]
    total = 0.0
    for g in grads:
        n = torch.linalg.vector_norm(g.detach().float())
        total += float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    norm = total**0.5
    coef = float(clip_val) / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def _clip_mixed_grad_value(optimizer: Any, clip_val: float) -> None:
    """``clip_grad_value_`` over the parameters of ``optimizer`` when DTensor and plain gradients mix: each gradient
    clamped to ``[-clip_val, clip_val]`` on its own (elementwise, so a DTensor's local shard alone), since torch's
    one fused (``foreach``) clamp over the whole list refuses the mix."""
    value = float(clip_val)
    for g in raw_optimizer(optimizer).param_groups:
        for p in g["params"]:
            if p.grad is not None:
                p.grad.clamp_(min=-value, max=value)


def _holds_tensor_state(state: Any) -> bool:
    """Whether the optimizer state ``state`` holds a per-parameter tensor with a dimension (what the shards split)."""
    per_param = state.get("state") if isinstance(state, dict) else None
    return isinstance(per_param, dict) and any(
        isinstance(v, torch.Tensor) and v.ndim > 0
        for entry in per_param.values()
        if isinstance(entry, dict)
        for v in entry.values()
    )


def _load_hyperparameters(optimizer: torch.optim.Optimizer, state: Any) -> bool:
    """Copy the saved param groups' hyper-parameters (``lr``, ``momentum``, ... all but ``params``) of ``state`` into
    ``optimizer``'s groups, in order; False (nothing copied) when the groups differ in number."""
    saved = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        return False
    for group, kept in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in kept.items() if k != "params"})
    return True


class ShardedStrategy(_EvaluationBufferSync, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with the parallelisation applied for you: an unchanged LightningModule
    (no ``configure_model``) trains sharded (FSDP2), tensor parallel (DTensor), or both on a 2-D mesh.

    At ``setup`` (after ``configure_model``, before the optimizers exist), unless the module is already parallelised:

    1. ``tensor_parallel_size > 1``: :func:`~lightning_accel.parallel.plans.apply_tensor_parallel` splits each block's
       attention and MLP ``Linear`` pairs over the ``"tensor_parallel"`` mesh dimension (a packed ``c_attn`` / ``qkv``
       per head); the plan's coverage (which ``Linear`` modules split, which stay replicated and why) is logged and
       kept in ``applied["tp_coverage"]``;
    2. when the data-parallel size is > 1 (or there is no tensor parallelism), ``fully_shard`` each block of the
       network's repeated stack, then each direct child of the LightningModule that holds parameters (the
       LightningModule itself when it holds parameters directly), over the ``"data_parallel"`` dimension, with the
       ``MixedPrecisionPolicy`` of the Trainer's precision (``bf16-mixed``: bf16 compute, fp32 reduction). Units that
       share tied parameters (an embedding tied to the head in one ``nn.Sequential``) are sharded as one group
       (:func:`~lightning_accel.parallel.plans.fsdp_groups`);
    3. a model created on the meta device (``Trainer.init_module(empty_init=True)``) is materialised on the device
       afterwards, as ``ModelParallelStrategy`` does: ``to_empty`` then each module's ``reset_parameters``, so only
       this rank's shard is ever allocated.

    **Buffers** (BatchNorm's running statistics) are not sharded: each rank holds them whole and updates them from its
    own batches, so rank 0's are copied to every rank before each training step (``DistributedDataParallel``'s
    ``broadcast_buffers=True``) and at the start of ``validate`` / ``test`` / ``predict``.

    Runs on CPU (gloo) and CUDA (NCCL). **Checkpoints**: by default (``save_distributed_checkpoint=False``, unlike
    ``ModelParallelStrategy``'s ``True``) a *full* state dict (model and FQN-keyed optimizer state gathered to rank 0)
    is written through the Trainer's ``CheckpointIO`` (so ``DeltaCheckpointIO`` and ``AsyncCheckpointIO`` apply) and
    read back through it on every rank, each keeping its shard (a DDP or one-process checkpoint too: its optimizer
    state, which lists the parameters by position, is named first); ``save_distributed_checkpoint=True`` uses
    Lightning's ``torch.distributed.checkpoint`` folder (one file per rank, no ``CheckpointIO``).

    **Mesh sizes**: the arguments mean what they mean for ``ModelParallelStrategy`` (``"auto"`` data-parallel size:
    the number of nodes; ``"auto"`` tensor-parallel size: the devices of one node), and the defaults shard over every
    rank: ``tensor_parallel_size=1`` and ``data_parallel_size=None``, the world size divided by the tensor-parallel
    size.

    Args:
        tensor_parallel_size: ranks per tensor-parallel group (1: sharding only; ``"auto"``: the devices per node).
        data_parallel_size: ranks per data-parallel group (None: world size / ``tensor_parallel_size``; ``"auto"``:
            the number of nodes).
        save_distributed_checkpoint: save a sharded ``torch.distributed.checkpoint`` folder instead of a full file
            (None: False).
        tp_plan: ``{module name: "colwise" | "rowwise" | "colwise_packed"}`` instead of the found pairs (checked
            here; used only when ``tensor_parallel_size`` > 1, a warning says so otherwise).
        reshard_after_forward: ZeRO-3 (True) or keep gathered parameters until backward (False).
        batch_split: ``"data_parallel"`` (Lightning's rule: the ranks of a tensor-parallel group read the same batch,
            so the global batch is ``data_parallel_size x batch_size``) or ``"world"`` (the sampler splits over every
            rank, as DDP's, and each tensor-parallel group gathers its ranks' batches: the global batch and the steps
            per epoch are those of DDP on the same Trainer; what ``AutoStrategy`` uses; ``predict`` returns each
            rank the predictions of the rows it read).
        distributed_checkpoint: deprecated name of ``save_distributed_checkpoint`` (same values).
        **kwargs: ``process_group_backend``, ``timeout`` for ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        tensor_parallel_size: int | Literal["auto"] = 1,
        *,
        data_parallel_size: int | Literal["auto"] | None = None,
        save_distributed_checkpoint: bool | None = None,
        tp_plan: dict[str, str] | None = None,
        reshard_after_forward: bool = True,
        batch_split: str = "data_parallel",
        distributed_checkpoint: bool | None = None,
        **kwargs: Any,
    ) -> None:
        check_choice("batch_split", batch_split, BATCH_SPLITS)
        if tensor_parallel_size != "auto":
            check_int(
                "tensor_parallel_size",
                tensor_parallel_size,
                low=1,
                fix="Or 'auto' for the devices of one node, as in ModelParallelStrategy.",
            )
        if data_parallel_size is not None and data_parallel_size != "auto":
            check_int(
                "data_parallel_size",
                data_parallel_size,
                low=1,
                fix="Or None for world size / `tensor_parallel_size`, or 'auto' for the number of nodes.",
            )
        save = renamed_argument(
            "save_distributed_checkpoint",
            save_distributed_checkpoint,
            "distributed_checkpoint",
            distributed_checkpoint,
            new_given=save_distributed_checkpoint is not None,
        )
        save = False if save is None else check_bool("save_distributed_checkpoint", save)
        # `fully_shard` refuses anything else only at setup, after every process has started
        check_bool(
            "reshard_after_forward",
            reshard_after_forward,
            fix="True frees the gathered parameters after forward (ZeRO-3), False keeps them until backward.",
        )
        if tp_plan is not None:
            # a bad plan would otherwise surface only in `apply_plan`, after every process has launched
            check_plan_styles(tp_plan, "tp_plan")
            if tensor_parallel_size == 1:
                warnings.warn(
                    "`tp_plan` is unused with `tensor_parallel_size=1`: no module is split tensor-parallel. Pass "
                    "`tensor_parallel_size` > 1 (or 'auto') to apply it, or drop `tp_plan`.",
                    UserWarning,
                    stacklevel=2,
                )
        super().__init__(
            data_parallel_size="auto" if data_parallel_size is None else data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save,
            **kwargs,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.save_distributed_checkpoint = save
        self.tp_plan = tp_plan
        self.reshard_after_forward = reshard_after_forward
        self.batch_split = batch_split
        self.applied: dict[str, Any] = {}  # what setup did: {"tp": plan, "tp_coverage": ..., "fsdp_units": n}
        self._local_rows = 0  # `batch_split="world"`: the rows this rank read of the batch its group gathered
        self._clip_patch: Patch | None = None
        self._clip_value_patch: Patch | None = None

    @override
    def setup_environment(self) -> None:
        dp, tp = self.mesh_sizes()
        compat.set_model_parallel_sizes(self, dp, tp)
        super().setup_environment()

    def mesh_sizes(self) -> tuple[int, int]:
        """``(data_parallel, tensor_parallel)`` for this world (``num_nodes`` x ``parallel_devices``).

        Raises:
            ValueError: the sizes do not multiply to the world size.
        """
        procs = self.num_processes
        world = self.num_nodes * procs
        tp = procs if self.tensor_parallel_size == "auto" else int(self.tensor_parallel_size)
        if self.data_parallel_size is None:
            dp = world // tp
        elif self.data_parallel_size == "auto":
            dp = self.num_nodes
            if dp * tp != world and world % tp == 0:
                # before the sizes meant what ModelParallelStrategy's mean, 'auto' was the rest of the world
                warnings.warn(
                    f"`data_parallel_size='auto'` means the number of nodes ({dp}), as in ModelParallelStrategy, which "
                    f"does not fill the world of {world} with `tensor_parallel_size` {tp}; using {world // tp} for "
                    "now. Pass `data_parallel_size=None` (world size / `tensor_parallel_size`) instead.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                dp = world // tp
        else:
            dp = int(self.data_parallel_size)
        if world % tp or dp * tp != world:
            raise ValueError(
                f"the world size {world} is not `data_parallel_size` ({dp}) x `tensor_parallel_size` ({tp}). Use a "
                f"`tensor_parallel_size` that divides {world} and leave `data_parallel_size=None`."
            )
        return dp, tp

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.batch_split == "world":
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return super().distributed_sampler_kwargs

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.batch_split == "world" and self.device_mesh is not None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            if tp_mesh.size() > 1:
                # this rank's rows: `predict_step` hands back its own share of the gathered batch's predictions
                self._local_rows = leading_rows(batch)
                batch = gather_batch(batch, tp_mesh.get_group())
        return batch

    @override
    def _sync_buffers(self) -> None:
        # FSDP2 and tensor parallelism shard parameters only: each rank updates its own whole copy of every buffer
        # (BatchNorm's running statistics from its own batches), so without this the ranks' statistics drift apart
        # for good, rank 0's alone reach the checkpoint, and each rank evaluates with its own. Rank 0's are copied
        # to all, as DistributedDataParallel does (`broadcast_buffers=True`)
        if self.model is not None and self.world_size > 1:
            broadcast_buffers(self.model, src=0)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step``, after every buffer (BatchNorm's running statistics) is copied
        from rank 0 to every rank, as ``DistributedDataParallel`` does before each training forward."""
        self._sync_buffers()
        return super().training_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step``; with ``batch_split="world"`` and tensor parallelism, this rank's
        share of its predictions: the rows of the batch it read of the batch its group gathered (as under DDP), so
        no sample is predicted twice (see :func:`~lightning_accel.parallel.strategies._helpers.own_predictions`)."""
        out = super().predict_step(*args, **kwargs)
        if self.batch_split == "world" and self.device_mesh is not None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            if tp_mesh.size() > 1:
                out = own_predictions(out, self._local_rows, tp_mesh.get_group())
        return out

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, with the plan applied instead of requiring `configure_model`
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        # a rank failing here alone (out of memory while sharding or materialising, a module that differs on one node)
        # would leave the others waiting in the next collective for the process group's timeout: every rank learns
        # whether every other one got through, and all raise at once
        try:
            if not is_parallelized(self.model):
                self.applied = self.apply_plan(self.model)
            compat.materialize_distributed_module(self.model, self.root_device)
        except Exception as e:
            self._raise_if_any_rank_failed(e)
            raise
        self._raise_if_any_rank_failed(None)
        if "tp" in self.applied:
            # the parameters are now DTensors and plain (replicated) tensors side by side, which torch's
            # `clip_grad_norm_` and `clip_grad_value_` refuse to mix: Lightning calls these methods of the precision
            # plugin to clip (`gradient_clip_algorithm` "norm" / "value")
            self._clip_patch = patch(
                self.precision_plugin, "clip_grad_by_norm", lambda p: _clip_mixed_grad_norm, key=_CLIP_KEY
            )
            self._clip_value_patch = patch(
                self.precision_plugin, "clip_grad_by_value", lambda p: _clip_mixed_grad_value, key=_CLIP_VALUE_KEY
            )
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _raise_if_any_rank_failed(self, error: BaseException | None) -> None:
        """Raise on every rank when applying the plan failed on one (see
        :func:`~lightning_accel._utils.rank.raise_if_any_rank_failed`). Collective."""
        name = type(self.lightning_module).__name__ if self.lightning_module is not None else "the model"
        raise_if_any_rank_failed(
            error,
            lambda rank, more: (
                f"ShardedStrategy: rank {rank} could not apply its parallel plan to `{name}`{more}, so no rank can"
            ),
            device=self.root_device,
        )

    def apply_plan(self, module: torch.nn.Module) -> dict[str, Any]:
        """Tensor parallel on the ``"tensor_parallel"`` mesh dimension, then FSDP2 on ``"data_parallel"``.

        Collective: splitting tensor parallel scatters the weights from rank 0, so the tensor-parallel plan is first
        checked on every rank and a failure anywhere raises on every rank (one line naming the rank) before any
        weight moves."""
        mesh = self.device_mesh
        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        out: dict[str, Any] = {}
        if tp_mesh.size() > 1:
            try:
                plan = tensor_parallel_plan(module, tp_mesh.size()) if self.tp_plan is None else dict(self.tp_plan)
                check_tensor_parallel_plan(module, plan, tp_mesh.size())
            except Exception as e:
                self._raise_if_any_rank_failed(e)
                raise
            self._raise_if_any_rank_failed(None)
            out["tp"] = apply_tensor_parallel(module, tp_mesh, plan)
            out["tp_coverage"] = tensor_parallel_coverage(module, out["tp"])
            out["tp_size"] = tp_mesh.size()
            rank_zero_info(f"ShardedStrategy: {describe_coverage(out['tp_coverage'], tp_mesh.size())}")
            # dropout on the replicated activations must draw the same mask on every rank of a tensor-parallel group
            # (else the ranks compute different models): one seed from rank 0, offset by the data-parallel rank
            seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
            torch.distributed.broadcast(seed, src=0)
            torch.manual_seed(int(seed) + dp_mesh.get_local_rank())
        if dp_mesh.size() > 1 or tp_mesh.size() == 1:
            policy = mixed_precision_policy(precision_name(self.precision_plugin))
            units = fsdp_units(module)
            from torch.distributed.fsdp import fully_shard

            kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": self.reshard_after_forward}
            if policy is not None:
                kw["mp_policy"] = policy
            groups, notes = fsdp_groups(units, module)
            if any(True for _ in module.parameters(recurse=False)):
                roots: list[list[torch.nn.Module]] = [[module]]
            else:  # each direct child holding parameters; children that share tied parameters as one group
                children = [c for c in module.children() if any(True for _ in c.parameters())]
                roots, more = fsdp_groups(children, module)
                notes += more
            for g in [*groups, *roots]:
                fully_shard(g[0] if len(g) == 1 else g, **kw)
            for note in notes:
                rank_zero_info(f"ShardedStrategy: {note}.")
            out["fsdp_units"] = len(units)
        return out

    def _packed(self) -> dict[str, int]:
        """``{module name: tensor-parallel size}`` of the packed projections split per head (rows reordered)."""
        plan = self.applied.get("tp") or {}
        return {n: int(self.applied["tp_size"]) for n, s in plan.items() if s == "colwise_packed"}

    def _reorder(self, state: dict[str, Any], fn: Any) -> dict[str, Any]:
        """``state`` (FQN-keyed full tensors, or per-parameter optimizer state) with ``fn(rows, tp)`` applied to the
        packed projections' weights and biases (and their state tensors of the same shape)."""
        packed = self._packed()
        if not packed:
            return state
        out = dict(state)
        for name, tp in packed.items():
            for key in (f"{name}.weight", f"{name}.bias"):
                v = out.get(key)
                if isinstance(v, torch.Tensor) and v.ndim >= 1:
                    out[key] = fn(v, tp)
                elif isinstance(v, dict):  # optimizer state of that parameter
                    out[key] = {
                        k: fn(t, tp) if isinstance(t, torch.Tensor) and t.ndim >= 1 else t for k, t in v.items()
                    }
        return out

    def _rank_zero_buffers(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (this rank's sharded state dict) with every plain-tensor buffer replaced by a copy of rank 0's
        (the module's own are left as they are). Collective: every rank calls it with the same keys.

        Buffers are plain tensors, which ``torch.distributed.checkpoint`` takes for replicated and writes once, from
        whichever rank its planner picks: each rank's BatchNorm statistics include its own last batches, so without
        this the folder held some other rank's (or a mix of ranks') statistics, not rank 0's as the full file and
        DistributedDataParallel keep, and a resumed run's statistics differed from those of the run it continues."""
        module = self.lightning_module
        if module is None or self.world_size == 1:
            return state
        names = {n for n, _ in module.named_buffers(remove_duplicate=False)}
        keys = [k for k, v in state.items() if k in names and type(v) is torch.Tensor]  # a DTensor is placed already
        copies = [state[k].detach().clone() for k in keys]
        broadcast_tensors(copies, src=0)
        return {**state, **dict(zip(keys, copies, strict=True))}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self.save_distributed_checkpoint:  # sharded: loads back into the same plan only
            return self._rank_zero_buffers(state)
        return self._reorder(state, unpack_rows)  # packed q/k/v in the unsplit layout: loads without the plan

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = dict(get_optimizer_state_dict(self.model, raw_optimizer(optimizer), options=options))
        if self._packed() and isinstance(state.get("state"), dict):
            state["state"] = self._reorder(dict(state["state"]), unpack_rows)
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        else:  # the full state dict, through the CheckpointIO on rank 0
            Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Rank 0's ``checkpoint_path``, read on every rank: a ``torch.distributed.checkpoint`` folder as
        ``ModelParallelStrategy`` reads it, a full file through the ``CheckpointIO`` (each rank keeping its shard).

        Raises:
            RuntimeError: another rank could not read the file, or does not see rank 0's folder (one line naming it
                and its error; that rank raises its own error), before any rank loads a shard.
            FileNotFoundError: rank 0's ``checkpoint_path`` is a folder that this rank does not see (a node-local
                path): every rank raises, none reads it.
        """
        path = self.broadcast(checkpoint_path)

        # loading the state into the shards is collective: a rank that cannot read the file (a node-local path, a
        # file not yet visible on another node) would leave the others there until the process group's timeout
        def failed(rank: int, more: str) -> str:
            return f"ShardedStrategy: rank {rank} could not read the checkpoint `{path}`{more}, so no rank can"

        # rank 0's kind of checkpoint decides for every rank: a rank that does not see the folder there would read
        # it as a file while the others run the folder's collectives, and both would wait for the timeout
        here = os.path.isdir(str(path))
        folder = bool(self.broadcast(here))
        unseen = None
        if folder and not here:
            unseen = FileNotFoundError(
                f"`{path}` is a checkpoint folder on rank 0 but not on rank {self.global_rank}. Resume from a path "
                "that every node sees (shared storage)."
            )
        raise_if_any_rank_failed(unseen, failed, device=self.root_device)
        if unseen is not None:
            raise unseen
        if folder:  # a torch.distributed.checkpoint folder
            return super().load_checkpoint(path, weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None

        try:
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        except Exception as e:
            raise_if_any_rank_failed(e, failed, device=self.root_device)
            raise
        raise_if_any_rank_failed(None, failed, device=self.root_device)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(
            self.model,
            self._reorder(checkpoint.pop("state_dict"), pack_rows),
            options=StateDictOptions(full_state_dict=True, strict=strict),
        )
        states = checkpoint.pop("optimizer_states", [])
        names = {id(p): n for n, p in self.model.named_parameters()}
        for opt, state in zip(self.optimizers, states, strict=False):
            # a DDP or one-process checkpoint lists the parameters by position: `set_optimizer_state_dict` wants
            # names (given positions, it kept the full tensors beside the shards and trained on wrong state)
            groups = [[names[id(p)] for p in g["params"]] for g in raw_optimizer(opt).param_groups]
            state = named_optimizer_state(state, groups, "ShardedStrategy")
            if self._packed() and isinstance(state.get("state"), dict):
                state = dict(state, state=self._reorder(dict(state["state"]), pack_rows))
            if not _holds_tensor_state(state) and _load_hyperparameters(raw_optimizer(opt), state):
                # a stateless optimizer (SGD without momentum): nothing to place on the shards, and torch's loader
                # refuses it ("Expected device to be set"); the groups' hyper-parameters are all there is
                continue
            set_optimizer_state_dict(
                self.model, raw_optimizer(opt), state, options=StateDictOptions(full_state_dict=True)
            )
        return checkpoint

    @override
    def teardown(self) -> None:
        for clip in (self._clip_value_patch, self._clip_patch):  # the precision plugin clips the torch way again
            if clip is not None:
                clip.restore()
        self._clip_patch = self._clip_value_patch = None
        super().teardown()
