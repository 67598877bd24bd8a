"""``AutoStrategy``: :func:`select_strategy` for a Trainer whose model is not known when the config is written.

**Chosen before the Trainer is built** (what the ``lightning-accel`` CLI does with a config's ``AutoStrategy``): the
CLI instantiates the model, calls :meth:`AutoStrategy.resolve` with the config's ``accelerator``, ``devices``,
``num_nodes`` and ``plugins``, and builds the Trainer with what it returns: the ``AutoStrategy`` itself when data
parallel is chosen (it is a ``DDPStrategy``), else the chosen strategy (``ddp_1bit``: the registered 1-bit strategy;
``fsdp``: :class:`ShardedStrategy` (FSDP2, CPU and GPU; Lightning's ``FSDPStrategy`` when ``fsdp_kwargs`` are given);
``tp``: :class:`ShardedStrategy` with ``tensor_parallel_size``; ``pipeline``: :class:`PipelineStrategy`), so
Lightning sets that strategy up like any other. ``policy="measure"`` needs the process group for its trial, so it is
decided in ``setup_environment`` (below); resolved early, it uses the memory policy's answer. There is no process
group yet, so every process chooses for itself; :class:`ChoiceCheck` compares the choices once the group is up and
stops the run with an error naming them if they differ (possible across nodes: the ``ddp_1bit`` advice uses a
measured backward time). In Python, call :func:`~lightning_accel.parallel.select_strategy` and pass its name to
``Trainer(strategy=...)``, or pass what :meth:`AutoStrategy.resolve` returns.

**Handed to a Trainer directly**, an ``AutoStrategy`` starts as DDP (its launcher starts the processes exactly like
``strategy="ddp"``); once the process group is up (``setup_environment``, before the model is configured or moved)
rank 0 chooses (with ``policy="measure"``, every rank then times the candidates together), broadcasts the
choice, and every rank swaps the Trainer's strategy for the chosen one, handing over
accelerator, devices, cluster environment, checkpoint IO, precision and launcher. Lightning has no public API for
that swap: it goes through :mod:`lightning_accel._utils.compat`.

Either way the choice and its explanation are logged and kept in :attr:`AutoStrategy.choice`.

YAML::

    trainer:
      devices: 2
      strategy:
        class_path: lightning_accel.parallel.AutoStrategy
        init_args: {policy: memory, device_memory_bytes: 85899345920, example_batch_size: 64}
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.rank import distributed_ready
from lightning_accel.parallel.pipeline import (
    SCHEDULES,
    PipelineRunner,
    find_pipeline_modules,
    piece_costs,
    pipeline_layout,
    split_batch,
)
from lightning_accel.parallel.plans import apply_tensor_parallel, fsdp_units, is_parallelized, mixed_precision_policy
from lightning_accel.parallel.select import (
    POLICIES,
    StrategyChoice,
    TrialCache,
    choose_by_trial,
    select_strategy,
    trial_key,
)
from lightning_accel.parallel.trials import plan_stepper, time_plan

__all__ = [
    "AutoStrategy",
    "ChoiceCheck",
    "PipelineStrategy",
    "ShardedStrategy",
    "resolve_trainer_kwargs",
    "trainer_devices",
]

_CHOICES = ("ddp", "ddp_1bit", "fsdp", "auto", "tp", "pipeline")


def _fsdp_runs_on(device: torch.device) -> bool:
    """torch's FSDP refuses CPU-only processes ("FSDP needs a non-CPU accelerator device", checked with torch 2.14)."""
    return device.type != "cpu"


def _host_memory_bytes() -> int:
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def trainer_devices(
    accelerator: str | Accelerator = "auto", devices: int | str | list[int] = "auto"
) -> list[torch.device]:
    """The devices of one node that ``Trainer(accelerator=accelerator, devices=devices)`` trains on.

    Resolved with the accelerators' public ``parse_devices`` / ``get_parallel_devices``, as the Trainer does:
    ``"auto"`` and ``"gpu"`` mean MPS, else CUDA when available (``"auto"``: else CPU), ``devices="auto"`` all
    devices of that kind (one process on CPU).

    Raises:
        ValueError: an ``accelerator`` name Lightning does not know.
    """
    if isinstance(accelerator, Accelerator):
        cls: Any = type(accelerator)
    else:
        name = str(accelerator).lower()
        if name in ("auto", "gpu"):
            if MPSAccelerator.is_available():
                name = "mps"
            elif CUDAAccelerator.is_available() or name == "gpu":
                name = "cuda"  # "gpu" without one: CUDAAccelerator.parse_devices says what is missing
            else:
                name = "cpu"
        if name not in AcceleratorRegistry:
            raise ValueError(
                f"`accelerator` must be 'auto', 'gpu', one of {sorted(AcceleratorRegistry)} or an `Accelerator`, got "
                f"{accelerator!r}."
            )
        cls = AcceleratorRegistry[name]["accelerator"]
    if devices == "auto":
        devices = cls.auto_device_count()
    return list(cls.get_parallel_devices(cls.parse_devices(devices)))


def _precision_plugin(plugins: Any) -> Precision | None:
    """The precision plugin among a Trainer's ``plugins`` argument (one plugin, a list, or None)."""
    items = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    return next((p for p in items if isinstance(p, Precision)), None)


class ChoiceCheck(Callback):
    """Stops a run whose processes chose different strategies (each process runs :meth:`AutoStrategy.resolve`).

    In ``setup`` (the process group is up, the model not yet wrapped) every rank shares its choice; if they differ,
    every rank raises the same error, so none waits forever in a collective the others never join.

    Args:
        strategy: this process's choice (``StrategyChoice.strategy``).
    """

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not distributed_ready():
            return
        names: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(names, self.strategy)
        if len(set(names)) > 1:
            by_rank = ", ".join(f"rank {i}: {n!r}" for i, n in enumerate(names))
            raise ValueError(
                f"AutoStrategy: the processes chose different strategies ({by_rank}), so they cannot train together. "
                f"Pass the strategy explicitly (`trainer.strategy: {names[0]}`), or set `device_memory_bytes` (and "
                "`inter_node_gbps` far from the logged 1-bit break-even) so every process decides the same."
            )


class AutoStrategy(DDPStrategy):
    """DDP until the model is known, then whatever :func:`select_strategy` chooses for it (see the module docstring).

    Args:
        policy: ``"memory"``, ``"rules"`` or ``"measure"`` (the memory estimate's candidates, then a timed trial of
            each on the real model and ``example_input_array``, all ranks together; chosen at setup).
        device_memory_bytes: memory per device (None: the CUDA device's total memory; on CPU the host RAM divided by
            the processes on this node).
        inter_node_gbps: inter-node bandwidth in Gbit/s, for the ``ddp_1bit`` advice.
        headroom: fraction of device memory kept free.
        bytes_per_param: model-state bytes per parameter (16 for Adam).
        use_example_input: measure activations with the LightningModule's ``example_input_array``.
        example_batch_size: the real per-device batch size; activations measured on ``example_input_array`` are
            scaled by ``example_batch_size / len(example_input_array)``.
        fsdp_kwargs: when given, a chosen ``"fsdp"`` runs as Lightning's ``FSDPStrategy(**fsdp_kwargs)`` (FSDP1,
            GPUs only; e.g. ``cpu_offload``) instead of :class:`ShardedStrategy` (FSDP2, CPU and GPU).
        sharded_kwargs: keyword arguments for :class:`ShardedStrategy` (the ``"fsdp"`` and ``"tp"`` plans).
        pipeline_kwargs: keyword arguments for :class:`PipelineStrategy` (``schedule``, ``microbatches``).
        trial_steps: timed steps per candidate for ``policy="measure"`` (after one warm-up step).
        trial_cache: a JSON file keeping measured times per model / world / device (None: this process only).
        allow_unfit: when no plan fits the estimate, run the smallest anyway instead of raising.
        **ddp_kwargs: forwarded to ``DDPStrategy`` (used when DDP is chosen).
    """

    def __init__(
        self,
        policy: str = "memory",
        *,
        device_memory_bytes: int | None = None,
        inter_node_gbps: float | None = None,
        headroom: float = 0.2,
        bytes_per_param: int = 16,
        use_example_input: bool = True,
        example_batch_size: int | None = None,
        fsdp_kwargs: dict[str, Any] | None = None,
        sharded_kwargs: dict[str, Any] | None = None,
        pipeline_kwargs: dict[str, Any] | None = None,
        trial_steps: int = 3,
        trial_cache: str | None = None,
        allow_unfit: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}.")
        if example_batch_size is not None and example_batch_size < 1:
            raise ValueError(f"`example_batch_size` must be >= 1 or None, got {example_batch_size!r}.")
        super().__init__(**ddp_kwargs)
        self.policy = policy
        self.device_memory_bytes = device_memory_bytes
        self.inter_node_gbps = inter_node_gbps
        self.headroom = headroom
        self.bytes_per_param = bytes_per_param
        self.use_example_input = use_example_input
        self.example_batch_size = example_batch_size
        if trial_steps < 1:
            raise ValueError(f"`trial_steps` must be >= 1, got {trial_steps!r}.")
        self.fsdp_kwargs = dict(fsdp_kwargs or {})
        self.sharded_kwargs = dict(sharded_kwargs or {})
        self.pipeline_kwargs = dict(pipeline_kwargs or {})
        self.trial_steps = trial_steps
        self.trial_cache = TrialCache(trial_cache)
        self.allow_unfit = allow_unfit
        self.choice: StrategyChoice | None = None
        self.chosen: Strategy | None = None
        self._resolved = False  # chosen by `resolve` before the Trainer was built: `setup_environment` keeps it

    def resolve(
        self,
        model: pl.LightningModule,
        *,
        accelerator: str | Accelerator = "auto",
        devices: int | str | list[int] = "auto",
        num_nodes: int = 1,
        plugins: Any = None,
    ) -> Strategy:
        """Choose now, before the Trainer exists, for a Trainer built with these arguments.

        Args:
            model: the LightningModule to train (its ``example_input_array`` is measured on the CPU).
            accelerator: the Trainer's ``accelerator``.
            devices: the Trainer's ``devices``.
            num_nodes: the Trainer's ``num_nodes``.
            plugins: the Trainer's ``plugins`` (a precision plugin among them rules FSDP out).

        Returns:
            What to pass as ``Trainer(strategy=...)``: this strategy when data parallel is chosen (``choice`` is
            kept; ``setup`` does not choose again), else the chosen strategy (also kept in :attr:`chosen`). Add
            ``ChoiceCheck(self.choice.strategy)`` to the Trainer's callbacks when several processes each resolve.

        Raises:
            ValueError: FSDP was chosen but cannot run (CPU devices, or a precision plugin FSDP cannot take).
        """
        parallel = trainer_devices(accelerator, devices)
        choice = self._choose(model, parallel[0], len(parallel), num_nodes)
        self._record(choice)
        self._resolved = True
        name = choice.strategy
        built: Strategy | None = None
        if name == "ddp_1bit":
            built = self._onebit()
        elif name == "fsdp" and self.fsdp_kwargs:
            built = self._fsdp(parallel[0], _precision_plugin(plugins), precision=None)
        elif name in ("fsdp", "tp", "pipeline"):
            built = self._runnable(name, len(parallel))
        self.chosen = built or self
        return self.chosen

    def _choose(self, model: pl.LightningModule, device: torch.device, devices: int, num_nodes: int) -> StrategyChoice:
        example = getattr(model, "example_input_array", None) if self.use_example_input else None
        scale = 1.0
        if example is not None and self.example_batch_size is not None:
            first = example[0] if isinstance(example, (tuple, list)) else example
            if isinstance(first, torch.Tensor) and first.ndim:
                scale = self.example_batch_size / first.shape[0]
        mem = self.device_memory_bytes
        if mem is None and device.type == "cuda":
            mem = torch.cuda.get_device_properties(device).total_memory
        elif mem is None:
            mem = _host_memory_bytes() // max(1, devices)
        return select_strategy(
            model,
            devices=devices,
            num_nodes=num_nodes,
            device_memory_bytes=mem,
            example_batch=example,
            inter_node_gbps=self.inter_node_gbps,
            policy="memory" if self.policy == "measure" else self.policy,
            headroom=self.headroom,
            bytes_per_param=self.bytes_per_param,
            activation_scale=scale,
        )

    def _runnable(self, name: str, devices: int) -> Strategy:
        if name == "pipeline":
            return PipelineStrategy(**self.pipeline_kwargs)
        kwargs = dict(self.sharded_kwargs)
        if name == "tp":
            kwargs.setdefault("tensor_parallel_size", devices)
        return ShardedStrategy(**kwargs)

    def _record(self, choice: StrategyChoice | None) -> None:
        self.choice = choice
        if choice is None:  # a rank other than 0 in `setup_environment`: rank 0 chose and logs
            return
        rank_zero_info(f"AutoStrategy ({self.policy}): {choice.strategy}. {choice.explanation}")
        if choice.measured:
            rank_zero_info("AutoStrategy trial:\n" + choice.table())
        if not choice.fits:
            msg = (
                f"AutoStrategy: no plan fits in memory, '{choice.strategy}' is only the smallest. {choice.explanation}"
            )
            if not self.allow_unfit:
                raise ValueError(msg + " Pass `allow_unfit=True` to try it anyway.")
            rank_zero_warn(msg)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # process group is up from here on
        if self._resolved:
            return
        model = self.lightning_module
        assert model is not None, "AutoStrategy.setup_environment runs after Trainer.fit connected the model"
        trainer = model.trainer
        devices = len(self.parallel_devices or [self.root_device])
        choice = self._choose(model, self.root_device, devices, self.num_nodes) if self.global_rank == 0 else None
        if self.policy == "measure" and distributed_ready():
            choice = self._measure(model, choice)
        elif distributed_ready():  # every rank gets rank 0's choice: they swap, or refuse, together
            box: list[Any] = [choice]
            torch.distributed.broadcast_object_list(box, src=0)
            choice = box[0]
        assert choice is not None
        name = choice.strategy
        self._record(choice)
        if name in ("ddp", "auto"):
            self.chosen = self
            return
        new = self._build(name, trainer)
        if new is None:
            self.chosen = self
            return
        self._transplant(new, model, trainer)
        new.setup_environment()  # the process group exists: only devices and ranks are set up
        self.chosen = new

    def _measure(self, model: pl.LightningModule, choice: StrategyChoice | None) -> StrategyChoice:
        """Every rank: time the plans rank 0's estimate lets fit, on copies of ``model`` (collective, same order
        everywhere; the cache is read on rank 0 and its answer shared)."""
        box: list[Any] = [choice]
        torch.distributed.broadcast_object_list(box, src=0)
        memory_choice: StrategyChoice = box[0]
        example = getattr(model, "example_input_array", None)
        if not isinstance(example, torch.Tensor):
            raise ValueError(
                "AutoStrategy(policy='measure') times each plan on `example_input_array`, which "
                f"`{type(model).__name__}` does not set (got {type(example).__name__}). Set it to one real batch of "
                "forward inputs, or use policy='memory'."
            )
        world = torch.distributed.get_world_size()
        key = trial_key(model, world, self.root_device.type, tuple(example.shape), list(memory_choice.estimates))
        cached: list[Any] = [self.trial_cache.get(key) if self.global_rank == 0 else None]
        torch.distributed.broadcast_object_list(cached, src=0)
        shared = TrialCache()
        if cached[0] is not None:
            shared.put(key, cached[0])
        x = example.to(self.root_device)

        def trial(plan: str) -> float:
            try:
                stepper = plan_stepper(plan, copy.deepcopy(model).to(self.root_device), x)
            except (ValueError, TypeError) as e:  # raised alike on every rank: the plan cannot run this model
                rank_zero_info(f"AutoStrategy trial: '{plan}' cannot run ({e}).")
                return float("inf")
            return time_plan(stepper, steps=self.trial_steps)

        out = choose_by_trial(memory_choice, trial, key=key, cache=shared)
        if self.global_rank == 0 and out.measured:
            self.trial_cache.put(key, out.measured)
        return out

    def _build(self, name: str, trainer: pl.Trainer | None) -> Strategy | None:
        """The strategy for ``name`` chosen at setup (``trainer``: the running one, whose precision FSDP takes)."""
        if name == "ddp_1bit":
            return self._onebit()
        if name in ("tp", "pipeline") or (name == "fsdp" and not self.fsdp_kwargs):
            return self._runnable(name, len(self.parallel_devices or [self.root_device]))
        assert trainer is not None, "FSDP is built at setup for a running Trainer"
        prec = self.precision_plugin
        # plain Precision / MixedPrecision are what the Trainer made from `precision=`: FSDP gets its own equivalent
        custom = prec if type(prec) not in (Precision, MixedPrecision) else None
        return self._fsdp(self.root_device, custom, precision=str(trainer.precision))

    def _onebit(self) -> Strategy | None:
        if "ddp_1bit" not in StrategyRegistry:
            rank_zero_warn(
                "AutoStrategy chose 'ddp_1bit' but no strategy of that name is registered (import "
                "`lightning_accel` with the 1-bit plugin installed); continuing with plain DDP."
            )
            return None
        return StrategyRegistry.get("ddp_1bit")

    def _fsdp(self, device: torch.device, custom_precision: Precision | None, precision: str | None) -> FSDPStrategy:
        if not _fsdp_runs_on(device):
            raise ValueError(
                f"AutoStrategy chose FSDP ({self.choice.explanation if self.choice else 'see the log'}), but torch's "
                f"FSDP cannot run on `{device}`. Train on GPUs, give the CPU processes more memory "
                "(`device_memory_bytes`), or shrink the model/batch."
            )
        if custom_precision is not None:
            raise ValueError(
                f"AutoStrategy chose FSDP, which needs its own precision plugin, but the trainer uses "
                f"`{type(custom_precision).__name__}`. Pass `AutoStrategy(policy=..., device_memory_bytes=...)` "
                "without that precision plugin, use `Trainer(precision=...)`, or pass `strategy='fsdp'` explicitly."
            )
        strategy = FSDPStrategy(**self.fsdp_kwargs)
        if precision is not None:
            # At setup the Trainer has made its precision plugin already (for DDP); before it exists (`resolve`) the
            # Trainer makes FSDP's own from `precision=`.
            from lightning.pytorch.plugins.precision import FSDPPrecision

            mode: Any = precision  # a Trainer's `precision` string, which FSDPPrecision types as a Literal
            strategy.precision_plugin = FSDPPrecision(mode)
        return strategy

    def _transplant(self, new: Strategy, model: pl.LightningModule, trainer: pl.Trainer) -> None:
        """Give ``new`` what the accelerator connector gave this strategy, then make it the Trainer's strategy."""
        assert self.accelerator is not None, "the accelerator connector sets it before `setup_environment`"
        new.accelerator = self.accelerator
        if not isinstance(new, FSDPStrategy):
            new.precision_plugin = self.precision_plugin
        new.checkpoint_io = self.checkpoint_io  # the connector's (or the default TorchCheckpointIO, as for `new`)
        if hasattr(new, "cluster_environment"):
            new.cluster_environment = self.cluster_environment
        if hasattr(new, "parallel_devices"):
            new.parallel_devices = self.parallel_devices
        if hasattr(new, "num_nodes"):
            new.num_nodes = self.num_nodes
        compat.set_layer_sync(new, compat.get_layer_sync(self))
        if hasattr(new, "set_world_ranks"):
            new.set_world_ranks()
        compat.set_launcher(new, self.launcher)  # the processes were started by this launcher; it must stop them
        new.connect(model)
        compat.set_trainer_strategy(trainer, new)


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def resolve_trainer_kwargs(trainer_kwargs: dict[str, Any], model: Any) -> dict[str, Any]:
    """``trainer_kwargs`` with an ``AutoStrategy`` under ``"strategy"`` resolved for ``model`` (else unchanged).

    The resolved strategy replaces the ``AutoStrategy`` and a :class:`ChoiceCheck` joins ``"callbacks"``; only the
    keys that change are returned, so the result can be merged over the original (``{**kwargs, **result}``).
    """
    strategy = trainer_kwargs.get("strategy")
    if not isinstance(strategy, AutoStrategy) or not isinstance(model, pl.LightningModule):
        return {}
    resolved = strategy.resolve(
        model,
        accelerator=trainer_kwargs.get("accelerator", "auto"),
        devices=trainer_kwargs.get("devices", "auto"),
        num_nodes=int(trainer_kwargs.get("num_nodes", 1) or 1),
        plugins=trainer_kwargs.get("plugins"),
    )
    assert strategy.choice is not None
    callbacks: Sequence[Any] = _as_list(trainer_kwargs.get("callbacks"))
    return {"strategy": resolved, "callbacks": [*callbacks, ChoiceCheck(strategy.choice.strategy)]}


# ------------------------------------------------------------------------------------------------ the runnable plans


def _optimizers_to_device(optimizers: Sequence[Any], device: torch.device) -> None:
    for opt in optimizers:
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.device != device:
                    state[k] = v.to(device)


def _precision_name(plugin: Precision) -> str:
    return str(getattr(plugin, "precision", "32-true"))


def _raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _clip_mixed_grad_norm(optimizer: Any, clip_val: float) -> float:
    """``clip_grad_norm_`` over the parameters of ``optimizer`` when DTensor and plain gradients mix: the norm of each
    gradient (a DTensor's reduced over its mesh; a replicated plain one counted once), then one scale for all."""
    grads = [p.grad for g in _raw_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None]
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


class ShardedStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with the parallelisation applied for you: an unchanged LightningModule
    (no ``configure_model``) trains sharded (FSDP2), tensor parallel (DTensor), or both on a 2-D mesh.

    At ``setup`` (after ``configure_model``, before the optimizers exist), unless the module is already parallelised:

    1. ``tensor_parallel_size > 1``: :func:`~lightning_accel.parallel.plans.apply_tensor_parallel` splits each block's
       attention and MLP ``Linear`` pairs over the ``"tensor_parallel"`` mesh dimension;
    2. when the data-parallel size is > 1 (or there is no tensor parallelism), ``fully_shard`` each block of the
       network's repeated stack, then each direct child of the LightningModule that holds parameters (the
       LightningModule itself when it holds parameters directly), over the ``"data_parallel"`` dimension, with the
       ``MixedPrecisionPolicy`` of the Trainer's precision (``bf16-mixed``: bf16 compute, fp32 reduction).

    Runs on CPU (gloo) and CUDA (NCCL). **Checkpoints**: by default (``distributed_checkpoint=False``) a *full* state
    dict (model and FQN-keyed optimizer state gathered to rank 0) is written through the Trainer's ``CheckpointIO``
    (so ``DeltaCheckpointIO`` and ``AsyncCheckpointIO`` apply) and read back through it on every rank, each keeping its
    shard; ``distributed_checkpoint=True`` uses Lightning's ``torch.distributed.checkpoint`` folder (one file per
    rank, no ``CheckpointIO``).

    Args:
        tensor_parallel_size: ranks per tensor-parallel group (1: sharding only).
        data_parallel_size: ranks per data-parallel group (``"auto"``: world size / ``tensor_parallel_size``).
        distributed_checkpoint: save a sharded ``torch.distributed.checkpoint`` folder instead of a full file.
        tp_plan: ``{module name: "colwise" | "rowwise"}`` instead of the found pairs.
        reshard_after_forward: ZeRO-3 (True) or keep gathered parameters until backward (False).
        **kwargs: ``process_group_backend``, ``timeout`` for ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        *,
        data_parallel_size: int | str = "auto",
        distributed_checkpoint: bool = False,
        tp_plan: dict[str, str] | None = None,
        reshard_after_forward: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"`tensor_parallel_size` must be an integer >= 1, got {tensor_parallel_size!r}.")
        if data_parallel_size != "auto" and (not isinstance(data_parallel_size, int) or data_parallel_size < 1):
            raise ValueError(f"`data_parallel_size` must be 'auto' or an integer >= 1, got {data_parallel_size!r}.")
        super().__init__(
            data_parallel_size=data_parallel_size,  # type: ignore[arg-type]
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=distributed_checkpoint,
            **kwargs,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.distributed_checkpoint = distributed_checkpoint
        self.tp_plan = tp_plan
        self.reshard_after_forward = reshard_after_forward
        self.applied: dict[str, Any] = {}  # what setup did: {"tp": plan, "fsdp_units": n}

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        tp = self.tensor_parallel_size
        dp = world // tp if self.data_parallel_size == "auto" else int(self.data_parallel_size)
        if world % tp or dp * tp != world:
            raise ValueError(
                f"the world size {world} is not `data_parallel_size` ({dp}) x `tensor_parallel_size` ({tp}). Use a "
                f"`tensor_parallel_size` that divides {world} and leave `data_parallel_size='auto'`."
            )
        compat.set_model_parallel_sizes(self, dp, tp)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, with the plan applied instead of requiring `configure_model`
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not is_parallelized(self.model):
            self.applied = self.apply_plan(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def apply_plan(self, module: torch.nn.Module) -> dict[str, Any]:
        """Tensor parallel on the ``"tensor_parallel"`` mesh dimension, then FSDP2 on ``"data_parallel"``."""
        mesh = self.device_mesh
        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        out: dict[str, Any] = {}
        if tp_mesh.size() > 1:
            out["tp"] = apply_tensor_parallel(module, tp_mesh, self.tp_plan)
            # the parameters are now DTensors and plain (replicated) tensors side by side, which torch's
            # `clip_grad_norm_` refuses to mix: Lightning calls this method of the precision plugin to clip
            self.precision_plugin.clip_grad_by_norm = _clip_mixed_grad_norm  # type: ignore[method-assign,assignment]
            # dropout on the replicated activations must draw the same mask on every rank of a tensor-parallel group
            # (else the ranks compute different models): one seed from rank 0, offset by the data-parallel rank
            seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
            torch.distributed.broadcast(seed, src=0)
            torch.manual_seed(int(seed) + dp_mesh.get_local_rank())
        if dp_mesh.size() > 1 or tp_mesh.size() == 1:
            policy = mixed_precision_policy(_precision_name(self.precision_plugin))
            units = fsdp_units(module)
            roots = (
                [module]
                if any(True for _ in module.parameters(recurse=False))
                else [c for c in module.children() if any(True for _ in c.parameters())]
            )
            from torch.distributed.fsdp import fully_shard

            kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": self.reshard_after_forward}
            if policy is not None:
                kw["mp_policy"] = policy
            for u in units:
                fully_shard(u, **kw)
            for r in roots:
                fully_shard(r, **kw)
            out["fsdp_units"] = len(units)
        return out

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, _raw_optimizer(optimizer), options=options)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        else:  # the full state dict, through the CheckpointIO on rank 0
            Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(checkpoint_path)
        if os.path.isdir(str(path)):  # a torch.distributed.checkpoint folder
            return super().load_checkpoint(path, weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(
            self.model, checkpoint.pop("state_dict"), options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        states = checkpoint.pop("optimizer_states", [])
        for opt, state in zip(self.optimizers, states, strict=False):
            set_optimizer_state_dict(
                self.model, _raw_optimizer(opt), state, options=StateDictOptions(full_state_dict=True)
            )
        return checkpoint


class _Captured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("forward input captured")
        self.args, self.kwargs = args, kwargs


class PipelineStrategy(DDPStrategy):
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
    ``forward`` returning the last stage's output, so your loss and your ``self.log`` calls run there unchanged. The
    values it logged (averaged over micro-batches) are sent to every rank of the pipeline and logged there too, so
    every rank logs the loss (``ModelCheckpoint(monitor=...)`` works on any rank). ``backward`` is then a no-op (the
    schedule did it); gradients of tied parameters are summed between their stages and, with ``world > pipeline
    size``, averaged over the replicas; ``gradient_clip_val`` clips by the norm of the *whole* model's gradient.

    **Checkpoints**: the stages' states are gathered to rank 0 and saved as one full checkpoint through the
    ``CheckpointIO`` (the model ``state_dict`` is the unsplit model's, so the file also loads without a pipeline;
    optimizer state is keyed by parameter name); on resume every rank reads it and keeps its stage's part.

    Args:
        pipeline_size: ranks per pipeline (None: the world size); ``world / pipeline_size`` replicas train data
            parallel.
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleaved1f1b"``.
        microbatches: micro-batches per step (None: ``2 x pipeline_size``); must divide the batch size.
        stages_per_rank: stages per rank (interleaved: default 2).
        **ddp_kwargs: ``process_group_backend``, ``timeout``, ... for ``DDPStrategy``'s process group.

    Not supported: ``16-mixed`` (its GradScaler would unscale after the stage-wise clipping; use ``bf16-mixed``),
    ``predict``, manual optimization.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pipeline_size: int | None = None,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"`schedule` must be one of {SCHEDULES}, got {schedule!r}.")
        if pipeline_size is not None and (not isinstance(pipeline_size, int) or pipeline_size < 1):
            raise ValueError(f"`pipeline_size` must be an integer >= 1 or None, got {pipeline_size!r}.")
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(f"`microbatches` must be an integer >= 1 or None, got {microbatches!r}.")
        spr = stages_per_rank if stages_per_rank is not None else (2 if schedule == "interleaved1f1b" else 1)
        if (schedule == "interleaved1f1b") != (spr > 1):
            raise ValueError(
                f"`stages_per_rank`={spr} with `schedule`={schedule!r}: the interleaved schedule needs >= 2 stages "
                "per rank, '1f1b' and 'gpipe' exactly 1."
            )
        super().__init__(**ddp_kwargs)
        self.pipeline_size = pipeline_size
        self.schedule = schedule
        self.microbatches = microbatches
        self.stages_per_rank = spr
        self.runner: PipelineRunner | None = None
        self._hook: tuple[str, int] = ("training_step", 0)
        self._logged: dict[int, dict[str, tuple[float, dict[str, Any]]]] = {}
        self._mbs: list[Any] = []
        self._grads: list[torch.Tensor | None] = []

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
        # every rank of one pipeline reads the same batch; the replicas read different ones
        return {"num_replicas": max(1, self.world_size // self._pp), "rank": self.global_rank // self._pp}

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
        precision = _precision_name(self.precision_plugin)
        if precision.startswith("16"):
            raise ValueError(
                f"PipelineStrategy does not support `precision={precision!r}` (its GradScaler would unscale the "
                "gradients after the pipeline's whole-model clipping). Use 'bf16-mixed' or '32-true'."
            )
        if not module.automatic_optimization:
            raise ValueError("PipelineStrategy needs automatic optimization (`self.automatic_optimization = True`).")
        pieces = find_pipeline_modules(module)
        example = getattr(module, "example_input_array", None)
        costs = piece_costs(pieces, example if isinstance(example, torch.Tensor) else None)
        layout = pipeline_layout(
            costs, self.world_size, pipeline_size=self.pipeline_size, stages_per_rank=self.stages_per_rank
        )
        self.runner = PipelineRunner(
            module,
            pieces,
            layout,
            rank=self.global_rank,
            device=self.root_device,
            schedule=self.schedule,
            microbatches=self.microbatches or 2 * layout.pp,
            loss_fn=self._loss_fn,
        )
        rank_zero_info(
            f"PipelineStrategy: {len(pieces)} pieces of `{type(module).__name__}` in {layout.num_stages} stages "
            f"{list(layout.bounds)} over {layout.pp} ranks x {layout.dp} replica(s), schedule {self.schedule}, "
            f"{self.runner.microbatches} micro-batches."
        )
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()
        # `gradient_clip_val` clips by the whole model's norm: Lightning calls this method of the precision plugin
        # right before the optimizer step; a stage alone would clip by its own, smaller norm
        runner = self.runner
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: runner.clip_grad_norm_(  # type: ignore[method-assign,assignment]
            float(clip_val)
        )

    # --------------------------------------------------------------------------------------------------- steps
    def _step_hook(self, module: pl.LightningModule, name: str, batch: Any, batch_idx: int) -> Any:
        return getattr(module, name)(batch, batch_idx)

    def _capture(self, module: pl.LightningModule, name: str, batch: Any, batch_idx: int) -> torch.Tensor:
        """The tensor ``name`` passes to ``self(...)`` for ``batch``: run it until it calls forward."""

        def probe(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

        module.forward = probe  # type: ignore[method-assign]
        module.log = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            self._step_hook(module, name, batch, batch_idx)
        except _Captured as c:
            if len(c.args) != 1 or c.kwargs or not isinstance(c.args[0], torch.Tensor):
                raise TypeError(
                    f"PipelineStrategy: `{type(module).__name__}.{name}` called `self(...)` with {len(c.args)} "
                    f"positional and {len(c.kwargs)} keyword argument(s); the first pipeline stage takes exactly one "
                    "tensor. Call `self(x)` with one tensor."
                ) from None
            return c.args[0]
        finally:
            del module.forward
            del module.log
        raise TypeError(
            f"PipelineStrategy: `{type(module).__name__}.{name}` did not call `self(...)`: the pipeline runs the "
            "LightningModule's forward stage by stage, so the step must call `self(x)` (not `self.model(x)`) once."
        )

    def _loss_fn(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The last stage's loss: the user's step on micro-batch ``index`` with ``forward`` returning the pipeline's
        output. (The schedule's first step also calls it once to infer gradient shapes; keyed by index, that
        call's logs are replaced by the real one's.)"""
        module = self.lightning_module
        assert module is not None
        name, batch_idx = self._hook
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

        module.forward = lambda *a, **k: output  # type: ignore[method-assign]
        module.log = log  # type: ignore[method-assign,assignment]
        try:
            out = self._step_hook(module, name, batch, batch_idx)
        finally:
            del module.forward
            del module.log
        self._logged[i] = logged
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, torch.Tensor):
            return loss
        if name == "training_step":
            raise TypeError(
                f"PipelineStrategy: `{type(module).__name__}.training_step` returned {type(out).__name__}; it must "
                "return the loss tensor (or a dict with 'loss')."
            )
        return output.float().sum() * 0.0  # an evaluation step that only logs

    def _run(self, name: str, batch: Any, batch_idx: int, train: bool) -> torch.Tensor:
        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None, "PipelineStrategy.setup builds the pipeline"
        mbs = split_batch(batch, runner.microbatches)
        key = tuple(tuple(t.shape) for t in _tensors(mbs[0]))
        inputs = [self._capture(module, name, mb, batch_idx) for mb in mbs] if runner.has_first else None
        self._hook, self._logged, self._mbs = (name, batch_idx), {}, mbs
        targets = [torch.tensor([i]) for i in range(len(mbs))] if runner.has_last else None
        loss = runner.step(inputs, targets, key) if train else runner.evaluate(inputs, targets, key)
        self._relog(module, runner)
        self._mbs = []
        return loss

    def _relog(self, module: pl.LightningModule, runner: PipelineRunner) -> None:
        """Log on every rank of the pipeline what the step logged on the last stage (mean over micro-batches)."""
        payload: list[Any] = [None]
        if runner.has_last:
            sums: dict[str, list[Any]] = {}
            for rec in self._logged.values():
                for k, (v, kw) in rec.items():
                    sums.setdefault(k, [0.0, 0, kw])
                    sums[k][0] += v
                    sums[k][1] += 1
            payload[0] = {k: (s / n, kw) for k, (s, n, kw) in sums.items()}
        src = runner.layout.rank_of(runner.layout.num_stages - 1, runner.replica)
        torch.distributed.broadcast_object_list(payload, src=src, group=runner.pp_group)
        for k, (v, kw) in (payload[0] or {}).items():
            module.log(k, torch.tensor(v, device=self.root_device), **kw)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        assert self.runner is not None
        params = self.runner.params
        # Lightning zeroes the gradients between `training_step` and `backward` (it expects backward to make them),
        # so the schedule starts from none, its gradients wait aside until `backward`, and what was there before
        # (the previous step's, or those kept by gradient accumulation) is put back for Lightning to zero or keep
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._run("training_step", batch, batch_idx, train=True)
        self._grads = [p.grad for p in params]
        for p, g in zip(params, before, strict=False):
            p.grad = g
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run("validation_step", args[0], args[1] if len(args) > 1 else 0, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run("test_step", args[0], args[1] if len(args) > 1 else 0, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("PipelineStrategy does not run `predict`; load the checkpoint without a pipeline.")

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the schedule already ran every micro-batch's backward in `training_step`: hand its gradients back (added
        # to what gradient accumulation kept), and run the hooks
        module = self.lightning_module
        assert module is not None and self.runner is not None
        for p, g in zip(self.runner.params, self._grads, strict=False):
            if g is not None:
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
                module, _raw_optimizer(optimizer), options=StateDictOptions(cpu_offload=True)
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
        return merged

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
            mine: dict[str, Any] = {
                "state": {k: v for k, v in state["state"].items() if k in own},
                "param_groups": [dict(g, params=[p for p in g["params"] if p in own]) for g in state["param_groups"]],
            }
            set_optimizer_state_dict(module, _raw_optimizer(opt), mine)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []
