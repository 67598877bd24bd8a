"""``FusedPrecision``: Lightning's ``MixedPrecision`` plus in-place module surgery (and optional ``torch.compile``).

The Lightning adapter of this room: the surgery itself is :func:`~lightning_accel.precision.apply_fusions`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_accel._utils.checks import check_choice
from lightning_accel._utils.forksafe import cuda_available
from lightning_accel._utils.triton import Backend, check_backend
from lightning_accel.precision.compile import compile_in_place
from lightning_accel.precision.surgery import (
    DEFAULT_POLICY,
    FusionReport,
    Replacement,
    _ignore_list,
    apply_fusions,
    unfuse,
)

__all__ = ["FusedPrecision"]


class FusedPrecision(MixedPrecision):
    """Mixed precision (``torch.autocast`` + ``GradScaler`` for ``"16-mixed"``) with fused operators.

    ``convert_module`` modifies the model *in place* (DDP ignores its return value): it swaps matched sub-modules to
    fused forwards (Conv+BN+ReLU, Linear+Dropout(+residual), packed QKV, LayerNorm/RMSNorm kernels; see
    :mod:`lightning_accel.precision.surgery`), logs a table of what was fused, and warns when nothing matched. On CUDA
    the Linear+Dropout and norm ops run Triton kernels; elsewhere their torch references. The GradScaler state is part
    of the checkpoint (``state_dict``/``load_state_dict`` inherited from ``MixedPrecision``). Being a
    ``MixedPrecision``, ``ThroughputMonitor`` derives the right peak FLOPs from it.

    Pass it instead of ``Trainer(precision=...)``: ``Trainer(plugins=[FusedPrecision("bf16-mixed")])``.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"``.
        device: the autocast device type; default ``"cuda"`` when available, else ``"cpu"``.
        scaler: a custom ``torch.amp.GradScaler`` (16-mixed only).
        fusions: pattern names to apply (default: all of ``conv_bn_relu``, ``linear_dropout``, ``qkv``,
            ``attention``, ``norm``, ``block``), or a custom ``{pattern: [Replacement]}`` policy.
        ignore_modules: qualified module names (relative to the LightningModule, e.g. ``"model.blocks.0"``) or classes
            to leave unfused.
        compile: ``torch.compile`` the LightningModule's ``__call__`` after surgery, in place; if compilation fails
            at the first call, a warning says why and training continues eagerly.
        compile_kwargs: keyword arguments for ``torch.compile`` (e.g. ``{"mode": "max-autotune"}``).
        backend: how fused modules compute: ``"auto"`` (Triton kernels and the memory-saving functions on CUDA;
            plain torch ops on other devices, where they are faster), ``"reference"`` (the fused functions' torch
            path on any device), ``"triton"`` or ``"eager"``.
        memory_format: ``"preserve"`` (default: the model's layout as built) or ``"channels_last"``: after surgery
            the model's 4-D parameters and buffers are converted to ``torch.channels_last`` in place, and the
            convolutions follow their weights' layout (the inputs may stay NCHW). A CNN's step under bf16 autocast
            is ~30 % faster so on an x86 CPU (oneDNN) and on tensor-core GPUs; checkpoints hold the same values
            either way (state dicts load into either layout).
    """

    def __init__(
        self,
        precision: Literal["bf16-mixed", "16-mixed"] = "bf16-mixed",
        *,
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        fusions: Sequence[str] | Mapping[str, Sequence[Replacement]] | None = None,
        ignore_modules: str | type | Sequence[str | type] = (),
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        backend: Backend = "auto",
        memory_format: Literal["preserve", "channels_last"] = "preserve",
    ) -> None:
        check_choice(
            "precision",
            precision,
            ("bf16-mixed", "16-mixed"),
            fix="FusedPrecision carries the precision mode itself: pass it here and drop `Trainer(precision=...)`.",
        )
        if fusions is not None and not isinstance(fusions, Mapping):
            fusions = [fusions] if isinstance(fusions, str) else list(fusions)
            unknown = [f for f in fusions if f not in DEFAULT_POLICY]
            if unknown:
                raise ValueError(
                    f"`fusions` has unknown pattern(s) {unknown}; expected names from {sorted(DEFAULT_POLICY)}."
                )
        check_backend(backend)
        check_choice(
            "memory_format",
            memory_format,
            ("preserve", "channels_last"),
            fix="`channels_last` stores the model's conv weights NHWC; `preserve` leaves the layout as built.",
        )
        super().__init__(precision, device or ("cuda" if cuda_available() else "cpu"), scaler)
        # without an explicit device, follow the Trainer's accelerator at setup (see `convert_module`)
        self._follow_trainer_device = device is None and scaler is None
        self.fusions = fusions
        self.ignore_modules = _ignore_list(ignore_modules)
        self.compile = compile
        self.compile_kwargs = dict(compile_kwargs or {})
        self.backend = backend
        self.memory_format = memory_format
        self.report: FusionReport | None = None
        self._module: weakref.ref[nn.Module] | None = None
        #: why surgery was undone for the rest of the fit (:meth:`switch_off`), or None
        self.switched_off_reason: str | None = None

    # -- the lever protocol (lightning_accel._utils.levers.Lever) --------------------------------------------------
    lever_name = "fused"

    @property
    def lever_active(self) -> bool:
        """Whether the converted model has fused modules computing through their fused forward."""
        module = self._module() if self._module is not None else None
        return self.switched_off_reason is None and module is not None and bool(self.report and self.report.records)

    def switch_off(self, reason: str) -> bool:
        """Put the converted model back on the reference ops (:func:`~lightning_accel.precision.surgery.unfuse`:
        original module classes; packed QKV on the plain torch path), in place, for the rest of the fit; later
        ``convert_module`` calls fuse nothing. Autocast stays. Returns whether a module changed."""
        module = self._module() if self._module is not None else None
        if self.switched_off_reason is not None or module is None:
            return False
        changed = unfuse(module)
        self.switched_off_reason = reason
        rank_zero_info(f"FusedPrecision: {changed} fused module(s) back on the reference ops ({reason})")
        return changed > 0

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Fuse in place (idempotent), optionally compile in place, and return the same object."""
        self._module = weakref.ref(module)
        if self.switched_off_reason is not None:
            return module
        self._adopt_trainer_device(module)
        report = apply_fusions(
            module,
            self.fusions,
            self.ignore_modules,
            optimizers=_existing_optimizers(module),
            backend=self.backend,
        )
        if self.report is None or len(report):
            self.report = report
        if self.memory_format == "channels_last":
            # in place (`param.data` swapped): optimizers built later, or already holding these parameters, see them
            module.to(memory_format=torch.channels_last)
        if report.records:
            rank_zero_info(f"FusedPrecision (backend={self.backend!r}): {report.summary()}:\n{report.table()}")
        if self.compile:
            compile_in_place(module, **self.compile_kwargs)
        return module

    def _adopt_trainer_device(self, module: nn.Module) -> None:
        """Autocast (and a default GradScaler) on the device type the Trainer actually uses, e.g. ``cpu`` on a GPU
        machine with ``accelerator="cpu"``."""
        trainer = _attached_trainer(module)
        if not self._follow_trainer_device or trainer is None:
            return
        device_type = trainer.strategy.root_device.type
        if device_type == self.device:
            return
        self.device = device_type
        if self.scaler is not None:
            self.scaler = torch.amp.GradScaler(device=device_type)


def _existing_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """Optimizers the attached Trainer already built (none on a first ``fit``: Lightning converts modules first)."""
    trainer = _attached_trainer(module)
    if trainer is None:
        return []
    optimizers = getattr(trainer.strategy, "optimizers", [])
    return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]


def _attached_trainer(module: nn.Module) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None (``LightningModule.trainer`` raises when there is none)."""
    if not isinstance(module, pl.LightningModule):
        return None
    try:
        return module.trainer
    except RuntimeError:
        return None
