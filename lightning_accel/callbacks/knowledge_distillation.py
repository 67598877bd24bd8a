"""``KnowledgeDistillation``: distil a frozen teacher into the LightningModule being trained (thin adapter).

**How the student's logits and loss are reached** (the protocol, in order of precedence):

1. *Hard loss*: what ``training_step`` returns -- a tensor, or the ``"loss"`` entry of a dict.
2. *Student logits*: the ``"logits"`` entry if ``training_step`` returns a dict that has one; otherwise the output of
   the module's own ``forward``, captured with a forward hook -- i.e. ``training_step`` must call ``self(x)`` exactly
   once (as ``ImageClassifier`` does).
3. *Teacher inputs*: ``pl_module.distillation_inputs(batch)`` if the module defines it (a tensor or a tuple of
   positional args); otherwise the arguments of that captured ``self(x)`` call; otherwise ``batch[0]`` for
   tuple/list batches, or the batch itself.

The callback wraps ``training_step`` on the module instance for the duration of ``fit`` and returns
``(1 - alpha) * hard + alpha * T^2 * KL`` in place of the hard loss (logged as ``distill/hard_loss`` and
``distill/soft_loss``). The teacher lives on the callback, not on the module: it is not a submodule, so it is not
in the optimizer, not in ``state_dict``/checkpoints and not in the DDP wrapper; it is frozen, in eval mode, and moved
to the module's device at fit start. Under DDP each rank runs its own teacher copy on its own shard of the batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override

from lightning_accel.recipes.distill import (
    check_distillation_args,
    combine_losses,
    distillation_loss,
    freeze_teacher,
    load_teacher,
)

__all__ = ["KnowledgeDistillation"]


class KnowledgeDistillation(Callback):
    """Add ``alpha * T^2 * KL(teacher || student)`` to the student's loss and weight the hard loss by ``1 - alpha``.

    Args:
        teacher: the teacher network (any ``nn.Module`` mapping the student's inputs to logits of the same shape), or
            the path of a Lightning checkpoint of it (then ``teacher_class`` is required; read with
            ``torch.load(weights_only=True)``).
        temperature: softening temperature ``T > 0``.
        alpha: weight of the distillation term in [0, 1].
        teacher_class: the teacher's class (or import path) when ``teacher`` is a checkpoint path.

    Raises:
        ValueError: ``temperature <= 0``, ``alpha`` outside [0, 1], a teacher that is a submodule of the student, or
            (at the first step) teacher logits whose shape differs from the student's -- each naming the argument.
    """

    def __init__(
        self,
        teacher: nn.Module | str,
        temperature: float = 4.0,
        alpha: float = 0.5,
        teacher_class: type[nn.Module] | str | None = None,
    ) -> None:
        check_distillation_args(temperature, alpha)
        if isinstance(teacher, (str, os.PathLike)):
            teacher = load_teacher(teacher, teacher_class)
        self.teacher = freeze_teacher(teacher)
        self.temperature = float(temperature)
        self.alpha = float(alpha)
        self._module: LightningModule | None = None
        self._hook: Any = None
        self._capturing = False
        self._captured: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if any(m is self.teacher for m in pl_module.modules()):
            raise ValueError(
                "`teacher` is a submodule of the student LightningModule, so it would be trained, checkpointed and "
                "wrapped by DDP. Keep the teacher out of the module (pass it only to KnowledgeDistillation)."
            )
        self.teacher.to(pl_module.device)
        freeze_teacher(self.teacher)
        self._install(pl_module)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.teacher.eval()  # in case anything switched it back to train mode

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._uninstall()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._uninstall()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._uninstall()  # a failed fit must not leave the module wrapped

    @override
    def state_dict(self) -> dict[str, Any]:
        # Hyper-parameters only: the teacher's weights never go into the student's checkpoints.
        return {"temperature": self.temperature, "alpha": self.alpha}

    def _install(self, pl_module: LightningModule) -> None:
        if self._module is not None:
            return
        original = pl_module.training_step  # bound method of the class (or a user's instance override)

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._capturing:
                self._captured.append((args, kwargs, output))

        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._captured = []
            self._capturing = True
            try:
                out = original(*args, **kwargs)
            finally:
                self._capturing = False
            batch = args[0] if args else kwargs.get("batch")
            try:
                return self._distil(pl_module, out, batch)
            finally:
                self._captured = []

        self._hook = pl_module.register_forward_hook(hook, with_kwargs=True)
        pl_module.training_step = training_step  # type: ignore[method-assign]
        self._module = pl_module

    def _uninstall(self) -> None:
        if self._module is None:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._module.__dict__.pop("training_step", None)
        self._module = None

    def _student_logits(self, out: Any) -> torch.Tensor:
        if isinstance(out, Mapping) and "logits" in out:
            return out["logits"]
        if len(self._captured) == 1 and isinstance(self._captured[0][2], torch.Tensor):
            return self._captured[0][2]
        raise ValueError(
            f"KnowledgeDistillation cannot find the student's logits: `training_step` returned "
            f"{type(out).__name__} without a 'logits' entry and called the module's forward {len(self._captured)} "
            "time(s). Either return {'loss': loss, 'logits': logits} from `training_step`, or call `self(x)` exactly "
            "once in it (its output is taken as the logits)."
        )

    def _teacher_inputs(self, pl_module: LightningModule, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        fn = getattr(pl_module, "distillation_inputs", None)
        if callable(fn):
            x = fn(batch)
            return (x if isinstance(x, tuple) else (x,)), {}
        if len(self._captured) == 1:
            return self._captured[0][0], self._captured[0][1]
        if isinstance(batch, (list, tuple)) and batch:
            return (batch[0],), {}
        return (batch,), {}

    def _distil(self, pl_module: LightningModule, out: Any, batch: Any) -> Any:
        if out is None:
            return None  # the module skipped this batch
        hard = out["loss"] if isinstance(out, Mapping) else out
        student = self._student_logits(out)
        t_args, t_kwargs = self._teacher_inputs(pl_module, batch)
        with torch.no_grad():
            teacher = self.teacher(*t_args, **t_kwargs)
        if not isinstance(teacher, torch.Tensor):
            raise ValueError(
                f"`teacher` must return a logits tensor, got {type(teacher).__name__}. Wrap it in a module whose "
                "forward returns the logits."
            )
        soft = distillation_loss(student, teacher, self.temperature)
        loss = combine_losses(hard, soft, self.alpha)
        pl_module.log("distill/hard_loss", hard.detach(), on_step=True, on_epoch=True, sync_dist=True)
        pl_module.log("distill/soft_loss", soft.detach(), on_step=True, on_epoch=True, sync_dist=True)
        if isinstance(out, Mapping):
            return {**out, "loss": loss}
        return loss
