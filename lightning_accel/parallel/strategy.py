"""``AutoStrategy``: strategy selection from LightningCLI (or Python) when the model is not known up front.

A Trainer's strategy is fixed before ``fit`` sees the model, but the choice needs the model. ``AutoStrategy`` starts
as DDP (its launcher starts the processes exactly like ``strategy="ddp"``); once the process group is up
(``setup_environment``, before the model is configured or moved) rank 0 runs :func:`select_strategy` on the model,
broadcasts the choice, and every rank swaps the Trainer's strategy for the chosen one (``ddp``: stays; ``ddp_1bit``:
the registered 1-bit strategy; ``fsdp``: ``FSDPStrategy``), handing over accelerator, devices, cluster environment,
checkpoint IO, precision and launcher. The choice and its explanation are logged and kept in :attr:`choice`.

YAML::

    trainer:
      devices: 2
      strategy:
        class_path: lightning_accel.parallel.AutoStrategy
        init_args: {policy: memory, device_memory_bytes: 85899345920, example_batch_size: 64}
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.parallel.select import POLICIES, StrategyChoice, select_strategy

__all__ = ["AutoStrategy"]

_CHOICES = ("ddp", "ddp_1bit", "fsdp", "auto")


def _fsdp_runs_on(device: torch.device) -> bool:
    """torch's FSDP refuses CPU-only processes ("FSDP needs a non-CPU accelerator device", checked with torch 2.14)."""
    return device.type != "cpu"


def _host_memory_bytes() -> int:
    import os

    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class AutoStrategy(DDPStrategy):
    """DDP until the model is known, then whatever :func:`select_strategy` chooses for it (see the module docstring).

    Args:
        policy: ``"memory"`` or ``"rules"``.
        device_memory_bytes: memory per device (None: the CUDA device's total memory; on CPU the host RAM divided by
            the processes on this node).
        inter_node_gbps: inter-node bandwidth in Gbit/s, for the ``ddp_1bit`` advice.
        headroom: fraction of device memory kept free.
        bytes_per_param: model-state bytes per parameter (16 for Adam).
        use_example_input: measure activations with the LightningModule's ``example_input_array``.
        example_batch_size: the real per-device batch size; activations measured on ``example_input_array`` are
            scaled by ``example_batch_size / len(example_input_array)``.
        fsdp_kwargs: keyword arguments for ``FSDPStrategy`` when it is chosen (e.g. ``auto_wrap_policy``,
            ``activation_checkpointing_policy``, ``cpu_offload``).
        **ddp_kwargs: forwarded to ``DDPStrategy`` (used when DDP is chosen).
    """

    def __init__(
        self,
        policy: str = "memory",
        device_memory_bytes: int | None = None,
        inter_node_gbps: float | None = None,
        headroom: float = 0.2,
        bytes_per_param: int = 16,
        use_example_input: bool = True,
        example_batch_size: int | None = None,
        fsdp_kwargs: dict[str, Any] | None = None,
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
        self.fsdp_kwargs = dict(fsdp_kwargs or {})
        self.choice: StrategyChoice | None = None
        self.chosen: Strategy | None = None

    def _select(self, model: pl.LightningModule) -> StrategyChoice:
        example = getattr(model, "example_input_array", None) if self.use_example_input else None
        scale = 1.0
        if example is not None and self.example_batch_size is not None:
            first = example[0] if isinstance(example, (tuple, list)) else example
            if isinstance(first, torch.Tensor) and first.ndim:
                scale = self.example_batch_size / first.shape[0]
        mem = self.device_memory_bytes
        if mem is None and self.root_device.type == "cuda":
            mem = torch.cuda.get_device_properties(self.root_device).total_memory
        elif mem is None:
            mem = _host_memory_bytes() // max(1, len(self.parallel_devices or [1]))
        return select_strategy(
            model,
            devices=len(self.parallel_devices or [self.root_device]),
            num_nodes=self.num_nodes,
            device_memory_bytes=mem,
            example_batch=example,
            inter_node_gbps=self.inter_node_gbps,
            policy=self.policy,
            headroom=self.headroom,
            bytes_per_param=self.bytes_per_param,
            activation_scale=scale,
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # process group is up from here on
        model = self.lightning_module
        assert model is not None, "AutoStrategy.setup_environment runs after Trainer.fit connected the model"
        trainer = model.trainer
        choice = self._select(model) if self.global_rank == 0 else None
        idx = _CHOICES.index(choice.strategy) if choice is not None else -1
        idx = self._broadcast_index(idx)
        self.choice = choice
        name = _CHOICES[idx]
        if choice is not None:
            rank_zero_info(f"AutoStrategy ({self.policy}): {name}. {choice.explanation}")
            if not choice.fits:
                rank_zero_warn(f"AutoStrategy: the estimate says '{name}' may not fit in memory. {choice.explanation}")
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

    def _broadcast_index(self, idx: int) -> int:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return idx
        t = torch.tensor([idx], dtype=torch.int64, device=self.root_device)
        torch.distributed.broadcast(t, src=0)
        return int(t.item())

    def _build(self, name: str, trainer: pl.Trainer) -> Strategy | None:
        if name == "ddp_1bit":
            if "ddp_1bit" not in StrategyRegistry:
                rank_zero_warn(
                    "AutoStrategy chose 'ddp_1bit' but no strategy of that name is registered (import "
                    "`lightning_accel` with the 1-bit plugin installed); continuing with plain DDP."
                )
                return None
            return StrategyRegistry.get("ddp_1bit")
        if not _fsdp_runs_on(self.root_device):
            raise ValueError(
                f"AutoStrategy chose FSDP ({self.choice.explanation if self.choice else 'see the log'}), but torch's "
                f"FSDP cannot run on `{self.root_device}`. Train on GPUs, give the CPU processes more memory "
                "(`device_memory_bytes`), or shrink the model/batch."
            )
        prec = self.precision_plugin
        if type(prec) not in (Precision, MixedPrecision):
            raise ValueError(
                f"AutoStrategy chose FSDP, which needs its own precision plugin, but the trainer uses "
                f"`{type(prec).__name__}`. Pass `AutoStrategy(policy=..., device_memory_bytes=...)` without that "
                "precision plugin, use `Trainer(precision=...)`, or pass `strategy='fsdp'` explicitly."
            )
        from lightning.pytorch.plugins.precision import FSDPPrecision

        strategy = FSDPStrategy(**self.fsdp_kwargs)
        strategy.precision_plugin = FSDPPrecision(str(trainer.precision))  # type: ignore[arg-type]
        return strategy

    def _transplant(self, new: Strategy, model: pl.LightningModule, trainer: pl.Trainer) -> None:
        """Give ``new`` what the accelerator connector gave this strategy, then make it the Trainer's strategy."""
        new.accelerator = self.accelerator
        if not isinstance(new, FSDPStrategy):
            new.precision_plugin = self.precision_plugin
        if self._checkpoint_io is not None:
            new.checkpoint_io = self._checkpoint_io
        if hasattr(new, "cluster_environment"):
            new.cluster_environment = self.cluster_environment
        if hasattr(new, "parallel_devices"):
            new.parallel_devices = self.parallel_devices
        if hasattr(new, "num_nodes"):
            new.num_nodes = self.num_nodes
        if hasattr(new, "_layer_sync"):
            new._layer_sync = self._layer_sync
        if hasattr(new, "set_world_ranks"):
            new.set_world_ranks()
        new._launcher = self._launcher  # the processes were started by this launcher; it must be able to kill them
        new.connect(model)
        trainer._accelerator_connector.strategy = new
