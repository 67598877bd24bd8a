"""``StructuredPruning``: physically remove channels during ``fit`` (adapter over ``recipes.prune``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_accel.recipes.prune import (
    apply_structured_pruning,
    check_amount,
    count_parameters,
    resize_to_state_dict,
    schedule_amounts,
)

__all__ = ["StructuredPruning"]


class StructuredPruning(Callback):
    """Remove the weakest whole channels/neurons at the start of chosen epochs; fine-tune on the smaller model.

    At the first training batch of each epoch in ``schedule`` the module (or its ``target`` submodule) is traced, its
    channel groups found (residual adds are pruned consistently, BatchNorm and the consuming layers shrink along) and
    ``amount`` of the original channels removed in total over the schedule (evenly split: step ``k`` of ``n`` brings
    the removed fraction to ``amount * k / n``). This is structured pruning with real speed-ups; for unstructured
    masks use Lightning's ``ModelPruning``.

    **Optimizer after pruning.** The sliced parameters are new tensors. The callback re-points every optimizer of the
    trainer to them and slices their per-parameter state (momentum, Adam moments) with the same indices -- the
    equivalent of rebuilding the optimizer with ``trainer.strategy.setup_optimizers(trainer)`` but keeping the kept
    channels' state and the LR schedule's position (``setup_optimizers`` would restart warm-up). Under DDP the model
    is re-wrapped (``DDPStrategy.configure_ddp``) because DDP's gradient buckets are sized for the old parameters.

    **Checkpoints.** A checkpoint saved after pruning holds the smaller weights. While this callback is attached
    (e.g. when resuming with ``ckpt_path``) the module's layers are resized to the checkpoint's shapes before the
    weights load; elsewhere use :func:`lightning_accel.recipes.prune.resize_to_state_dict` before
    ``load_state_dict``. The epochs already pruned are in the callback's state, so resuming never prunes twice.

    Args:
        amount: total fraction in [0, 1) of each prunable group's channels to remove.
        norm: filter norm ranking the channels, ``"l1"`` or ``"l2"``.
        schedule: epoch (or epochs) at whose start to prune; ``0`` prunes before training (prune-then-fine-tune).
        target: dotted name of the submodule to prune (``None``: the LightningModule itself, traced through its
            ``forward``).
        ignore: module names (relative to the pruned module) whose outputs must keep all channels.
        round_to: keep a multiple of this many channels per group.

    Raises:
        ValueError: ``amount`` outside [0, 1), a bad ``norm``, negative or duplicate epochs in ``schedule``.
    """

    def __init__(
        self,
        amount: float = 0.5,
        norm: str = "l1",
        schedule: int | Sequence[int] = 0,
        target: str | None = None,
        ignore: Sequence[str] = (),
        round_to: int = 1,
    ) -> None:
        self.amount = check_amount(amount)
        if norm not in ("l1", "l2"):
            raise ValueError(f"`norm` must be 'l1' or 'l2', got {norm!r}.")
        epochs = [schedule] if isinstance(schedule, int) else list(schedule)
        if not epochs or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in epochs):
            raise ValueError(
                f"`schedule` must be an epoch index >= 0 or a non-empty list of them, got {schedule!r}. "
                "E.g. `schedule=0` prunes before training, `schedule=[1, 2, 3]` prunes in three steps."
            )
        if len(set(epochs)) != len(epochs):
            raise ValueError(f"`schedule` has repeated epochs: {schedule!r}. List each epoch once.")
        if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
            raise ValueError(f"`round_to` must be an integer >= 1, got {round_to!r}.")
        self.norm = norm
        self.schedule = sorted(epochs)
        self.step_amounts = dict(zip(self.schedule, schedule_amounts(self.amount, len(self.schedule)), strict=True))
        self.target = target
        self.ignore = tuple(ignore)
        self.round_to = round_to
        self.done: list[int] = []
        self.history: list[dict[str, Any]] = []
        self._hook: Any = None

    def _module(self, pl_module: LightningModule) -> nn.Module:
        if self.target is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.target)
        except AttributeError as e:
            raise ValueError(
                f"`target` {self.target!r} is not a submodule of {type(pl_module).__name__}. Pass a dotted name from "
                "`named_modules()` (e.g. 'model'), or None to prune the whole module."
            ) from e

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._module(pl_module)  # validates `target` early
        if self._hook is None:
            # Resuming from a pruned checkpoint: give the layers the saved (smaller) shapes before the weights load.
            def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
                resize_to_state_dict(module, state_dict, prefix)

            self._hook = pl_module.register_load_state_dict_pre_hook(pre_hook)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hook()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _example_inputs(self, pl_module: LightningModule, batch: Any) -> tuple[Any, ...]:
        ex = pl_module.example_input_array
        if ex is None:
            ex = batch[0] if isinstance(batch, (list, tuple)) else batch
        if isinstance(ex, torch.Tensor):
            return (ex.to(pl_module.device),)
        if isinstance(ex, tuple):
            return tuple(a.to(pl_module.device) if isinstance(a, torch.Tensor) else a for a in ex)
        raise ValueError(
            "StructuredPruning needs an example input to trace the model: set `example_input_array` on the module "
            f"or use (inputs, targets) batches (got a {type(ex).__name__})."
        )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        epoch = trainer.current_epoch
        if epoch not in self.step_amounts or epoch in self.done:
            return
        module = self._module(pl_module)
        before = count_parameters(module)
        result = apply_structured_pruning(
            module,
            self.step_amounts[epoch],
            self._example_inputs(pl_module, batch),
            norm=self.norm,
            optimizers=trainer.optimizers,
            ignore=self.ignore,
            round_to=self.round_to,
        )
        self._rewrap_ddp(trainer, pl_module)
        self.done.append(epoch)
        record = {
            "epoch": epoch,
            "params_before": before,
            "params_after": result.params_after,
            "groups": [(names, a, b) for names, a, b in result.groups],
        }
        self.history.append(record)
        rank_zero_info(
            f"StructuredPruning (epoch {epoch}): {len(result.groups)} channel groups shrunk, parameters "
            f"{before:,} -> {result.params_after:,} ({result.params_after / max(1, before):.2f}x)."
        )
        for logger in trainer.loggers:
            logger.log_metrics({"pruning/params": float(result.params_after)}, step=trainer.global_step)

    @staticmethod
    def _rewrap_ddp(trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning.pytorch.strategies import DDPStrategy
        from torch.nn.parallel import DistributedDataParallel

        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
            strategy.model = pl_module
            strategy.configure_ddp()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"amount": self.amount, "norm": self.norm, "done": list(self.done), "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = list(state_dict.get("done", []))
        self.history = list(state_dict.get("history", []))
