"""``AutoStrategy``: :func:`select_strategy` for a Trainer whose model is not known when the config is written.

**Chosen before the Trainer is built** (what the ``lightning-accel`` CLI does with a config's ``AutoStrategy``): the
CLI instantiates the model, calls :meth:`AutoStrategy.resolve` with the config's ``accelerator``, ``devices``,
``num_nodes`` and ``plugins``, and builds the Trainer with what it returns: the ``AutoStrategy`` itself when data
parallel is chosen (it is a ``DDPStrategy``), else the chosen strategy (``ddp_1bit``: the registered 1-bit strategy;
``fsdp``: :class:`ShardedStrategy` (FSDP2, CPU and GPU; Lightning's ``FSDPStrategy`` when ``fsdp_kwargs`` are given);
``tp``: :class:`ShardedStrategy` with ``tensor_parallel_size``; ``pipeline``: :class:`PipelineStrategy`), so
Lightning sets that strategy up like any other. ``policy="measure"`` needs the process group for its trial, so
``resolve`` returns the ``AutoStrategy`` itself, unresolved, and the choice is made in ``setup_environment`` (below),
trial included. Otherwise there is no process group yet, so every process chooses for itself; :class:`ChoiceCheck`
compares the choices once the group is up and stops the run with an error naming them if they differ (possible across
nodes: the ``ddp_1bit`` advice uses a measured backward time). In Python, call
:func:`~lightning_accel.parallel.select_strategy` and pass its name to ``Trainer(strategy=...)``, or pass what
:meth:`AutoStrategy.resolve` returns.

**Handed to a Trainer directly**, an ``AutoStrategy`` starts as DDP (its launcher starts the processes exactly like
``strategy="ddp"``); once the process group is up (``setup_environment``, before the model is configured or moved)
every rank runs the estimate (it runs the model on ``example_input_array``, so a collective in its forward is joined
by every rank), rank 0's choice is broadcast (with ``policy="measure"``, every rank then times the candidates
together), and every rank swaps the Trainer's strategy for the chosen one, handing over
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
import gc
import os
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel._utils import compat
from lightning_accel._utils.checks import check_bool, check_choice, check_int
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.rank import describe_error, distributed_ready, rebuild_error
from lightning_accel.parallel.callbacks import ChoiceCheck
from lightning_accel.parallel.estimate import preserved_state
from lightning_accel.parallel.select import (
    POLICIES,
    StrategyChoice,
    TrialCache,
    TrialFailed,
    _check_arguments,
    _check_example_batch,
    _non_default,
    _rules_unused_message,
    choose_by_trial,
    select_strategy,
    trial_key,
)
from lightning_accel.parallel.strategies._helpers import check_keywords, keyword_names
from lightning_accel.parallel.strategies.pipeline import (
    PIPELINE_UNLISTED,
    PipelineStrategy,
    check_pipeline_keywords,
)
from lightning_accel.parallel.strategies.sharded import ShardedStrategy
from lightning_accel.parallel.trials import PLANS, PeerTrialFailed, plan_stepper, release_groups, time_plan, together

__all__ = ["AutoStrategy", "resolve_trainer_kwargs", "trainer_devices"]

#: every keyword ``ShardedStrategy(...)`` takes (``sharded_kwargs``): its own and ``ModelParallelStrategy``'s
_SHARDED_ARGUMENTS = keyword_names(ShardedStrategy.__init__, ModelParallelStrategy.__init__)

#: what ``FSDPStrategy`` passes to ``FullyShardedDataParallel`` itself: the same name in ``fsdp_kwargs`` would reach
#: it twice ("got multiple values for keyword argument") when the model is wrapped
_FSDP_SET_BY_STRATEGY = ("module", "device_id")


def _fsdp_arguments() -> tuple[str, ...]:
    """Every keyword ``FSDPStrategy(**fsdp_kwargs)`` takes: its own, then those of ``FullyShardedDataParallel``, where
    its ``**kwargs`` go, less the ones the strategy sets (read from the signatures of the installed versions)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    names = keyword_names(FSDPStrategy.__init__, FullyShardedDataParallel.__init__)
    return tuple(n for n in names if n not in _FSDP_SET_BY_STRATEGY)


def _pipeline_arguments(pipeline_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``PipelineStrategy``'s arguments for a chosen pipeline: ``pipeline_kwargs`` over ``batch_split="world"`` (the
    chosen plan trains on DDP's global batch and steps per epoch) and the strategy's own defaults of what the
    estimate and the trial read (one place for them, so the estimate, the trial and the built plan agree)."""
    return {
        "batch_split": "world",
        "microbatches": None,
        "pipeline_size": None,
        "schedule": "1f1b",
        "stages_per_rank": None,
        **(pipeline_kwargs or {}),
    }


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


class AutoStrategy(DDPStrategy):
    """DDP until the model is known, then whatever :func:`select_strategy` chooses for it (see the module docstring).

    Args:
        policy: ``"memory"``, ``"rules"`` or ``"measure"`` (the memory estimate's candidates, then a timed trial of
            each on the real model and ``example_input_array``, all ranks together; chosen at setup). ``"rules"``
            reads the parameter and layer counts only: ``device_memory_bytes``, ``inter_node_gbps``, ``headroom``,
            ``bytes_per_param``, ``example_batch_size`` and ``allow_unfit`` given with it are named in a warning.
        device_memory_bytes: memory per device (None: the CUDA device's total memory; on CPU the host RAM divided by
            the processes on this node).
        inter_node_gbps: inter-node bandwidth in Gbit/s, for the ``ddp_1bit`` advice.
        headroom: fraction of device memory kept free.
        bytes_per_param: model-state bytes per parameter (16 for Adam).
        use_example_input: measure activations with the LightningModule's ``example_input_array``.
        example_batch_size: the real per-device batch size; activations measured on ``example_input_array`` are
            scaled by ``example_batch_size / len(example_input_array)``.
        fsdp_kwargs: when given, a chosen ``"fsdp"`` runs as Lightning's ``FSDPStrategy(**fsdp_kwargs)`` (FSDP1,
            GPUs only; e.g. ``cpu_offload``) instead of :class:`ShardedStrategy` (FSDP2, CPU and GPU). Its keys are
            ``FSDPStrategy``'s keywords and ``FullyShardedDataParallel``'s (but ``module`` and ``device_id``, which
            the strategy sets); an unknown key is refused here.
        sharded_kwargs: keyword arguments for :class:`ShardedStrategy` (the ``"fsdp"`` and ``"tp"`` plans; the mesh
            sizes ``tensor_parallel_size`` / ``data_parallel_size`` and ``tp_plan`` apply to ``"tp"`` only, ``"fsdp"``
            shards over every rank); an unknown key is refused here.
        pipeline_kwargs: keyword arguments for :class:`PipelineStrategy` (``schedule``, ``microbatches``,
            ``pipeline_size``, ``stages_per_rank``); the pipeline's memory estimate is made for them; an unknown key
            is refused here.
        trial_steps: timed steps per candidate for ``policy="measure"`` (after one warm-up step; with another
            policy a value given is named in a warning, as ``trial_cache``).
        trial_cache: a JSON file keeping measured times per model / world / device (None: this process only);
            ``policy="measure"`` only.
        candidates: the plans ``policy="measure"`` times, a non-empty list (None: every plan the memory estimate
            lets fit; a plan that cannot run the model is never tried). Every plan is timed at the global batch the
            Trainer will run (``world x`` the per-device batch), and a chosen tensor-parallel or pipeline plan trains
            on it too (``batch_split="world"``); a trial that fails is dropped with its error (``choice.dropped``).
            A plan named twice is refused.
        allow_unfit: when no plan fits the estimate, run the smallest anyway instead of raising.
        **ddp_kwargs: forwarded to ``DDPStrategy`` (used when DDP is chosen): its own keywords and
            ``DistributedDataParallel``'s; any other name (a misspelled argument of this class) is refused here
            (``TypeError``, naming the closest accepted one).
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
        trial_cache: str | os.PathLike[str] | None = None,
        candidates: list[str] | None = None,
        allow_unfit: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        check_choice("policy", policy, POLICIES)
        if candidates is not None and not isinstance(candidates, (list, tuple)):
            # a string would be checked letter by letter ("got 'd'" for candidates="ddp")
            raise TypeError(
                f"`candidates` must be a list of plan names (of {', '.join(map(repr, PLANS))}) or None, got "
                f"{candidates!r} ({type(candidates).__name__}). Pass e.g. `candidates=['ddp', 'fsdp']`."
            )
        if candidates is not None and len(candidates) == 0:
            # an empty list would read as "no restriction" (like None), not "time nothing": say which was meant
            raise ValueError(
                f"`candidates` must be a non-empty list of plan names (of {', '.join(map(repr, PLANS))}) or None, "
                f"got {candidates!r}. Use None to time every plan the memory estimate lets fit."
            )
        for c in candidates or []:
            check_choice("candidates", c, PLANS, fix="Name plans a trial can time.")
        twice = sorted({c for c in candidates or [] if list(candidates or []).count(c) > 1})
        if twice:
            # each listing is timed again (a few real training steps each) and shown twice in the trial's table
            raise ValueError(
                f"`candidates` must name each plan once, got {list(candidates or [])!r} ({', '.join(map(repr, twice))} "
                f"more than once). Pass {list(dict.fromkeys(candidates or []))!r}."
            )
        if candidates is not None and policy != "measure":
            # kept and never read: only the measuring policy times plans (said, not refused, so that a config can
            # switch the policy on the command line and keep its list)
            warnings.warn(
                f"AutoStrategy: `candidates` {list(candidates)!r} are timed only with policy='measure'; with "
                f"policy={policy!r} the plan comes from the memory estimate and they are not used.",
                UserWarning,
                stacklevel=2,
            )
        check_bool("use_example_input", use_example_input)
        for arg, kw in (
            ("fsdp_kwargs", fsdp_kwargs),
            ("sharded_kwargs", sharded_kwargs),
            ("pipeline_kwargs", pipeline_kwargs),
        ):
            if kw is not None and not isinstance(kw, Mapping):
                # a list or a string would fail deep in `dict()` or be read key by key, letter by letter
                raise TypeError(
                    f"`{arg}` must be a dict of keyword arguments or None, got {one_line(repr(kw))[:60]} "
                    f"({type(kw).__name__}). Pass e.g. `{arg}={{'name': value}}`."
                )
        check_bool("allow_unfit", allow_unfit)
        if trial_cache is not None and not isinstance(trial_cache, (str, os.PathLike)):
            # an int is a file descriptor to `os.path.exists` / `open`: the cache would read (and close) it
            raise TypeError(
                f"`trial_cache` must be a path to a JSON file or None, got {trial_cache!r} "
                f"({type(trial_cache).__name__}). Pass e.g. `trial_cache='trials.json'`."
            )
        if trial_cache is not None and (not os.fspath(trial_cache).strip() or os.path.isdir(trial_cache)):
            # neither can hold the file: the trial would run, then keep nothing, with only a warning after it
            raise ValueError(
                f"`trial_cache` must be a path to a JSON file or None, got {os.fspath(trial_cache)!r} "
                f"({'an existing folder' if os.fspath(trial_cache).strip() else 'an empty path'}). Pass a file path, "
                "e.g. `trial_cache='trials.json'`."
            )
        # an argument of this class misspelled (`device_memory=`) would go on to DistributedDataParallel, which
        # refuses it only when DDP wraps the model, after every process has started (or never, if another plan wins)
        check_keywords(
            "AutoStrategy",
            ddp_kwargs,
            _AUTO_ARGUMENTS,
            unlisted=PIPELINE_UNLISTED,
            unlisted_as="DistributedDataParallel's keywords",
            kind=TypeError,
        )
        check_int("example_batch_size", example_batch_size, low=1, allow_none=True)
        check_int("trial_steps", trial_steps, low=1)
        # the choice is made at setup on rank 0 only: a bad value must fail here, on every rank (a misspelled key
        # would otherwise surface only when the chosen plan is built, or never: `PipelineStrategy` took any keyword)
        check_pipeline_keywords("AutoStrategy `pipeline_kwargs`", pipeline_kwargs or {})
        check_keywords("AutoStrategy `sharded_kwargs`", sharded_kwargs or {}, _SHARDED_ARGUMENTS)
        # `FSDPStrategy` keeps any key for `FullyShardedDataParallel`, which refuses a misspelled one only when it
        # wraps the model: at setup, on GPUs only, after every process has started
        check_keywords("AutoStrategy `fsdp_kwargs`", fsdp_kwargs or {}, _fsdp_arguments())
        if sharded_kwargs:  # their values too (`tensor_parallel_size=0`), here rather than once a plan is chosen
            with warnings.catch_warnings():  # `tp_plan` without a size: the chosen "tp" plan gets the devices'
                warnings.simplefilter("ignore")
                ShardedStrategy(**{"batch_split": "world", **sharded_kwargs})
        pk = _pipeline_arguments(pipeline_kwargs)
        _check_arguments(
            headroom=headroom,
            inter_node_gbps=inter_node_gbps,
            device_memory_bytes=device_memory_bytes,
            bytes_per_param=bytes_per_param,
            microbatches=pk["microbatches"],
            batch_split=pk["batch_split"],
            pipeline_size=pk["pipeline_size"],
            schedule=pk["schedule"],
            stages_per_rank=pk["stages_per_rank"],
        )
        trial = _non_default(trial_steps=(trial_steps, 3), trial_cache=(trial_cache, None))
        if trial and policy != "measure":
            # kept and never read, as `candidates` above: only the measuring policy runs a trial
            source = "the rule of thumb" if policy == "rules" else "the memory estimate"
            rank_zero_warn(
                f"AutoStrategy: {', '.join(f'`{n}`' for n in trial)} {'is' if len(trial) == 1 else 'are'} used only "
                f"by policy='measure' (the timed trial); with policy={policy!r} the plan comes from {source} and "
                f"{'it is' if len(trial) == 1 else 'they are'} not used. Drop {'it' if len(trial) == 1 else 'them'} or "
                "pass policy='measure'."
            )
        if policy == "rules":
            # kept and never read by the rule of thumb (said, not refused, as `candidates` above: a config keeps them
            # when the policy is switched on the command line)
            unused = _non_default(
                device_memory_bytes=(device_memory_bytes, None),
                inter_node_gbps=(inter_node_gbps, None),
                headroom=(headroom, 0.2),
                bytes_per_param=(bytes_per_param, 16),
                example_batch_size=(example_batch_size, None),
                allow_unfit=(allow_unfit, False),
            )
            if unused:
                rank_zero_warn(f"AutoStrategy: {_rules_unused_message(unused)}")
        super().__init__(**ddp_kwargs)
        self.policy = policy
        self.device_memory_bytes = device_memory_bytes
        self.inter_node_gbps = inter_node_gbps
        self.headroom = headroom
        self.bytes_per_param = bytes_per_param
        self.use_example_input = use_example_input
        self.example_batch_size = example_batch_size
        self.fsdp_kwargs = dict(fsdp_kwargs or {})
        self.sharded_kwargs = dict(sharded_kwargs or {})
        self.pipeline_kwargs = dict(pipeline_kwargs or {})
        self.trial_steps = trial_steps
        self.trial_cache = TrialCache(None if trial_cache is None else os.fspath(trial_cache))
        self.candidates = list(candidates) if candidates else None
        self.allow_unfit = allow_unfit
        self.choice: StrategyChoice | None = None
        self.chosen: Strategy | None = None
        self._resolved = False  # chosen by `resolve` before the Trainer was built: `setup_environment` keeps it
        # the module `setup_environment` chose for: a later Trainer function on it keeps that choice
        self._chosen_for: weakref.ReferenceType[pl.LightningModule] | None = None

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

        With ``policy="measure"`` nothing is chosen here: the trial times the plans on the running processes,
        which do not exist yet. This strategy is returned unresolved (``choice`` stays None) and chooses in
        ``setup_environment``, as when handed to a Trainer directly: rank 0's estimate, the trial on every rank, the
        swap to the fastest plan.

        Returns:
            What to pass as ``Trainer(strategy=...)``: this strategy when data parallel is chosen (``choice`` is
            kept; ``setup`` does not choose again) or the policy is ``"measure"`` (it chooses at setup), else the
            chosen strategy (also kept in :attr:`chosen`). Add ``ChoiceCheck(self.choice.strategy)`` to the Trainer's
            callbacks when several processes each resolve (and ``choice`` is set).

        Raises:
            ValueError: FSDP was chosen but cannot run (CPU devices, or a precision plugin FSDP cannot take).
        """
        parallel = trainer_devices(accelerator, devices)
        if self.policy == "measure":
            # the trial needs the process group: leave the whole choice to `setup_environment`, where rank 0
            # estimates, every rank times the candidates and all swap alike (choosing by memory here would make
            # the trial never run)
            self.choice, self.chosen, self._resolved = None, self, False
            rank_zero_info(
                "AutoStrategy (measure): the plans are timed once the processes are connected; the choice is made "
                "at setup."
            )
            return self
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
        if self.policy == "rules":
            # the rule of thumb reads the parameter and layer counts only: no example to measure, no memory to look up
            return select_strategy(model, devices=devices, num_nodes=num_nodes, policy="rules")
        example = getattr(model, "example_input_array", None) if self.use_example_input else None
        _check_example_batch(
            f"{type(model).__name__}.example_input_array",
            example,
            fix="Set it to one batch of forward inputs, or pass `AutoStrategy(use_example_input=False)`.",
        )
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
        pk = self._pipeline_kwargs
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
            # the pipeline's estimate describes the one `_runnable` builds: its ranks, schedule, stages, batch and
            # micro-batches
            microbatches=pk["microbatches"],
            batch_split=self._model_parallel_batch_split,
            pipeline_size=pk["pipeline_size"],
            schedule=pk["schedule"],
            stages_per_rank=pk["stages_per_rank"],
        )

    @property
    def _model_parallel_batch_split(self) -> str:
        """The batch the estimates give the model-parallel plans: ``"world"`` (gathered, the larger) when either the
        pipeline or the tensor-parallel plan runs it, so neither estimate is optimistic."""
        splits = {self._pipeline_kwargs["batch_split"], self.sharded_kwargs.get("batch_split", "world")}
        return "world" if "world" in splits else "data_parallel"

    @property
    def _pipeline_kwargs(self) -> dict[str, Any]:
        """``PipelineStrategy``'s arguments for a chosen pipeline (see :func:`_pipeline_arguments`)."""
        return _pipeline_arguments(self.pipeline_kwargs)

    def _runnable(self, name: str, devices: int) -> Strategy:
        # `batch_split="world"`: the chosen plan trains on DDP's global batch and steps per epoch
        if name == "pipeline":
            return PipelineStrategy(**self._pipeline_kwargs)
        kwargs = {"batch_split": "world", **self.sharded_kwargs}
        if name == "tp":
            kwargs.setdefault("tensor_parallel_size", devices)
        else:
            # "fsdp" shards over every rank, the plan its estimate and its trial describe: the mesh sizes and
            # `tp_plan` in `sharded_kwargs` are the "tp" plan's (they made a chosen "fsdp" run tensor parallel)
            kwargs.update(tensor_parallel_size=1, data_parallel_size=None)
            kwargs.pop("tp_plan", None)
        return ShardedStrategy(**kwargs)

    def _record(self, choice: StrategyChoice | None) -> None:
        self.choice = choice
        if choice is None:  # a rank other than 0 in `setup_environment`: rank 0 chose and logs
            return
        rank_zero_info(f"AutoStrategy ({self.policy}): {choice.strategy}. {choice.explanation}")
        if choice.measured or choice.dropped:
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
        if self.choice is not None and self._chosen_for is not None and self._chosen_for() is model:
            # `validate` / `test` / `predict` after `fit` (or a second `fit`) on the same module: it keeps the plan it
            # was trained with. Choosing again would re-run the estimate and the whole trial, and a re-timed trial
            # may pick another plan for the trained module. Every rank holds the same choice: all take this alike
            self._use(self.choice, model, trainer)
            return
        devices = len(self.parallel_devices or [self.root_device])
        choice: StrategyChoice | None = None
        if not distributed_ready():
            choice = self._choose(model, self.root_device, devices, self.num_nodes)
        else:
            # Every rank runs the estimate, though only rank 0's answer is used: it runs the model's forward and
            # backward on `example_input_array`, and a module that runs a collective there (`nn.SyncBatchNorm` on
            # GPUs, any layer that all-reduces statistics) would leave a rank 0 that ran it alone waiting for ranks
            # that sit in the broadcast below. Every rank gets rank 0's choice, or its error: they swap, or raise,
            # together (a rank 0 that raised alone would leave the others waiting in this broadcast).
            error: BaseException | None = None
            try:
                choice = self._choose(model, self.root_device, devices, self.num_nodes)
            except Exception as e:  # noqa: BLE001 -- rank 0's is re-raised below, after the other ranks have it
                error = e
            box: list[Any] = [(choice, None if error is None else describe_error(error))]
            torch.distributed.broadcast_object_list(box, src=0)
            choice, failed = box[0]
            if failed is not None:  # rank 0's error, on every rank; another rank's own error yields to rank 0's choice
                if error is not None and self.global_rank == 0:
                    raise error
                raise rebuild_error(failed, where="AutoStrategy on rank 0: ")
            if self.policy == "measure":
                choice = self._measure(model, choice)
        assert choice is not None
        self._record(choice)
        self._chosen_for = weakref.ref(model)
        self._use(choice, model, trainer)

    @override
    def __getstate__(self) -> dict[str, Any]:
        # a weak reference cannot be pickled (a spawning launcher pickles the strategy): a copy chooses afresh
        state = super().__getstate__()
        state["_chosen_for"] = None
        return state

    def _use(self, choice: StrategyChoice, model: pl.LightningModule, trainer: pl.Trainer) -> None:
        """Keep this strategy (data parallel chosen) or swap the Trainer's for the one ``choice`` names."""
        name = choice.strategy
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

    def _measure(self, model: pl.LightningModule, memory_choice: StrategyChoice) -> StrategyChoice:
        """Every rank: time the plans rank 0's estimate (``memory_choice``, the same on every rank) lets fit, on
        copies of ``model`` (collective, same order everywhere; the cache is read on rank 0 and its answer shared).
        torch's RNG is as before afterwards, so the run trains as the same seed's run under the chosen plan would."""
        example = getattr(model, "example_input_array", None)
        if not isinstance(example, torch.Tensor):
            raise ValueError(
                "AutoStrategy(policy='measure') times each plan on `example_input_array`, which "
                f"`{type(model).__name__}` does not set (got {type(example).__name__}). Set it to one real batch of "
                "forward inputs, or use policy='memory'."
            )
        world = torch.distributed.get_world_size()
        per_rank = example
        if self.example_batch_size is not None and example.ndim and example.shape[0] != self.example_batch_size:
            reps = -(-self.example_batch_size // example.shape[0])
            per_rank = example.repeat(reps, *([1] * (example.ndim - 1)))[: self.example_batch_size]
        # the global batch the Trainer runs: every rank's per-device batch, whatever the plan (data-parallel plans
        # take this rank's share of it, tensor-parallel and pipeline plans the whole, as `batch_split="world"` does)
        x = torch.cat([per_rank] * world).to(self.root_device)
        plans = list(self.candidates or memory_choice.estimates)
        pk = self._pipeline_kwargs
        # a timed pipeline's schedule and cuts change its time: a cached figure holds for the same ones only
        how = f"{pk['schedule']},m={pk['microbatches']},v={pk['stages_per_rank']}"
        key = trial_key(model, world, self.root_device.type, tuple(x.shape), plans, how if "pipeline" in plans else "")
        cached: list[Any] = [self.trial_cache.get(key) if self.global_rank == 0 else None]
        torch.distributed.broadcast_object_list(cached, src=0)
        shared = TrialCache()
        if cached[0] is not None:
            shared.put(key, cached[0])

        def trial(plan: str) -> float:
            seconds, error, failed_at, echo = float("inf"), "", float("inf"), False
            # the trial's collectives run on a group of its own: a rank whose trial fails alone (an out-of-memory
            # on that rank, a step its data breaks) leaves the others in one of them, and would meet them out of
            # step on the default group, where they waited for its timeout (30 minutes) and the fit then failed
            group: Any = torch.distributed.new_group()
            made: list[Any] = [group]
            stepper: Any = None
            copied: Any = None
            try:  # any failure, building the plan or in any step, drops the plan (never the run)
                # the copy may fail on one rank alone (out of memory there): every rank learns of it before the
                # plan's collectives, a pipeline's `new_group` among them, which every rank must reach
                copied = together(
                    lambda: copy.deepcopy(model).to(self.root_device), device=self.root_device, group=group
                )
                stepper = plan_stepper(
                    plan,
                    copied,
                    x,
                    microbatches=pk["microbatches"],
                    schedule=pk["schedule"],
                    stages_per_rank=pk["stages_per_rank"],
                    split_example=example,  # what the built PipelineStrategy splits on
                    group=group,
                )
                made.extend(stepper.groups)
                seconds = time_plan(stepper, steps=self.trial_steps, group=group)
            except Exception as e:  # noqa: BLE001
                error, failed_at = f"{type(e).__name__}: {one_line(e)}", time.time()
                echo = isinstance(e, PeerTrialFailed)  # another rank's failure, said here: that rank's own is named
            stepper = copied = group = None
            if error:
                # before the flag below: destroying this trial's groups (and dropping every reference to them) ends
                # the collective another rank may wait in for this one ("Connection closed by peer" on gloo)
                release_groups(made)
                made = []
                gc.collect()
            # every rank decides alike: a plan that failed on any rank is dropped on all, with the error of the rank
            # that failed first (the others' may only say that it left), named by the lowest rank that had that error
            # (a plan that fails alike everywhere fails on every rank at about the same time)
            failed = torch.tensor([1.0 if error else 0.0], device=self.root_device)  # NCCL reduces device tensors
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
            release_groups(made)  # after a trial every rank finished: its groups are not needed any more
            if float(failed):
                errors: list[Any] = [None] * world
                torch.distributed.all_gather_object(errors, (failed_at, error, echo))
                # a rank's own error before another's report of it (`PeerTrialFailed`), whatever their times
                first = min((r for r, (_, e, _) in enumerate(errors) if e), key=lambda r: (errors[r][2], errors[r][0]))
                why = errors[first][1]
                rank = next(r for r, (_, e, _) in enumerate(errors) if e == why)
                rank_zero_info(f"AutoStrategy trial: '{plan}' dropped (rank {rank}: {why}).")
                raise TrialFailed(f"rank {rank}: {why}")
            return seconds

        # the trial's training steps draw from torch's RNG (dropout masks): without restoring it the run after the
        # trial, whatever it chooses, trained differently from the same seed's run under that strategy, where the
        # estimate before it measures without changing anything (`preserved_state`)
        with preserved_state(()):
            out = choose_by_trial(memory_choice, trial, key=key, cache=shared, candidates=self.candidates)
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


#: the keywords ``AutoStrategy(...)`` takes by name: its own and ``DDPStrategy``'s (plus DistributedDataParallel's,
#: :data:`~lightning_accel.parallel.strategies.pipeline.PIPELINE_UNLISTED`, passed on to the DDP wrapper)
_AUTO_ARGUMENTS = keyword_names(AutoStrategy.__init__, DDPStrategy.__init__)


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def resolve_trainer_kwargs(trainer_kwargs: dict[str, Any], model: Any) -> dict[str, Any]:
    """``trainer_kwargs`` with an ``AutoStrategy`` under ``"strategy"`` resolved for ``model`` (else unchanged).

    The resolved strategy replaces the ``AutoStrategy`` and a :class:`ChoiceCheck` joins ``"callbacks"`` (not with
    ``policy="measure"``, which chooses at setup: rank 0's choice goes to every rank); only the keys that change are
    returned, so the result can be merged over the original (``{**kwargs, **result}``).
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
    if strategy.choice is None:  # policy "measure": rank 0's choice is shared at setup, there is nothing to compare
        return {"strategy": resolved}
    callbacks: Sequence[Any] = _as_list(trainer_kwargs.get("callbacks"))
    return {"strategy": resolved, "callbacks": [*callbacks, ChoiceCheck(strategy.choice.strategy)]}
