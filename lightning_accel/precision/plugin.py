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
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_accel._utils.checks import check_bool, check_choice
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.forksafe import cuda_available
from lightning_accel._utils.triton import Backend, check_backend
from lightning_accel.precision.compile import compile_in_place
from lightning_accel.precision.optim_state import pack_qkv_optimizer_state, unpack_qkv_optimizer_state
from lightning_accel.precision.surgery import (
    FusionReport,
    Replaced,
    Replacement,
    _fusion_policy,
    _ignore_list,
    apply_fusions,
    follow_replaced_parameters,
    unfuse,
)

__all__ = ["FusedPrecision"]

# skipped modules named in `repr(plugin)`: the rest are counted (the full list is `plugin.report.table()`)
_REPR_SKIPPED = 5


def _compile_probe(*args: Any) -> None:
    """A function to check ``torch.compile``'s arguments on (its compilation is lazy: nothing is compiled)."""


def _check_compile_kwargs(compile_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``compile_kwargs`` that ``torch.compile`` itself refuses (an unknown keyword, mode or backend, or
    ``mode`` with ``options``): ``torch.compile`` checks them when called, which the plugin does only at ``setup``,
    after the data and the model are built, so check them now with a lazy ``torch.compile`` of a no-op.

    Raises:
        ValueError: naming ``compile_kwargs``, the value and ``torch.compile``'s reason.
    """
    try:
        torch.compile(_compile_probe, **compile_kwargs)
    except Exception as e:  # TypeError, RuntimeError, torch._dynamo's InvalidBackend: all mean "not accepted"
        raise ValueError(
            f"`compile_kwargs` must be keyword arguments `torch.compile` accepts, got {dict(compile_kwargs)!r}: "
            f"{one_line(e, first=True).rstrip('.')}. Fix or drop the offending key (e.g. {{'mode': 'max-autotune'}})."
        ) from e


class FusedPrecision(MixedPrecision):
    """Mixed precision (``torch.autocast`` + ``GradScaler`` for ``"16-mixed"``) with fused operators.

    ``convert_module`` modifies the model *in place* (DDP ignores its return value): it swaps matched sub-modules to
    fused forwards (Conv+BN+ReLU, Linear+Dropout(+residual), packed QKV, LayerNorm/RMSNorm kernels; see
    :mod:`lightning_accel.precision.surgery`), logs a table of what was fused, and warns when nothing matched. On CUDA
    the Linear+Dropout and norm ops run Triton kernels; elsewhere their torch references. The GradScaler state is part
    of the checkpoint (``state_dict``/``load_state_dict`` inherited from ``MixedPrecision``). Being a
    ``MixedPrecision``, ``ThroughputMonitor`` derives the right peak FLOPs from it.

    Pass it instead of ``Trainer(precision=...)``: ``Trainer(plugins=[FusedPrecision("bf16-mixed")])``.

    Checkpoints look unfused: the model's ``state_dict`` keys through state-dict hooks, the optimizer state through
    :meth:`on_save_checkpoint` (a packed q/k/v parameter's state is saved as its three parts'), so a run with or
    without this plugin, or with other ``fusions``, resumes from it; :meth:`on_load_checkpoint` packs an unfused
    optimizer state for the fused model. An optimizer the LightningModule built before the surgery (in ``__init__``)
    is pointed at the packed parameters when the Trainer connects it (:meth:`connect`).

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"``.
        device: the autocast device type; default: the Trainer's (``"cuda"`` when available, else ``"cpu"``, until
            the Trainer is known). One that is not the Trainer's (``"cuda"`` with ``accelerator="cpu"``) is refused
            when the fit sets up: autocast there would leave the model in full precision.
        scaler: a custom ``torch.amp.GradScaler`` (16-mixed only).
        fusions: pattern names to apply (default: all of ``conv_bn_relu``, ``linear_dropout``, ``qkv``,
            ``attention``, ``norm``, ``block``), or a custom ``{pattern: [Replacement]}`` policy. ``[]`` selects
            none: mixed precision alone (plus ``memory_format`` and ``compile``), the model's modules untouched and
            no nothing-matched warning, e.g. to measure what fusion adds with everything else equal.
        ignore_modules: qualified module names (relative to the LightningModule, e.g. ``"model.blocks.0"``) or classes
            to leave unfused.
        compile: ``torch.compile`` the LightningModule's ``__call__`` after surgery, in place; if compilation fails
            at the first call, a warning says why and training continues eagerly.
        compile_kwargs: keyword arguments for ``torch.compile`` (e.g. ``{"mode": "max-autotune"}``); with
            ``compile=True`` only (with ``compile=False`` a warning says they are not used).
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
        _fusion_policy(fusions)  # raises, naming `fusions`, for anything apply_fusions would refuse
        if fusions is not None and not isinstance(fusions, Mapping):
            fusions = [fusions] if isinstance(fusions, str) else list(fusions)
        if device is not None and not _is_device_type(device):
            raise (TypeError if not isinstance(device, str) else ValueError)(
                f"`device` must be a torch device type such as 'cuda' or 'cpu' (the autocast device, without an "
                f"index) or None to follow the Trainer, got {device!r} ({type(device).__name__}). Use 'cuda' for "
                "GPUs."
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"`scaler` must be a `torch.amp.GradScaler` or None (a default one for '16-mixed'), got {scaler!r} "
                f"({type(scaler).__name__})."
            )
        if scaler is not None and precision == "bf16-mixed":
            # Lightning's own refusal comes later and names no fix
            raise ValueError(
                f"`scaler` is for precision='16-mixed' only, got {scaler!r} with precision='bf16-mixed'. Drop "
                "`scaler` (bfloat16 needs no loss scaling) or use precision='16-mixed'."
            )
        check_bool("compile", compile, fix="`compile=True` compiles the module in place after surgery.")
        if compile_kwargs is not None and (
            not isinstance(compile_kwargs, Mapping) or not all(isinstance(k, str) for k in compile_kwargs)
        ):
            raise TypeError(
                "`compile_kwargs` must be a dict of `torch.compile` keyword arguments (e.g. {'mode': "
                f"'max-autotune'}}) or None, got {compile_kwargs!r} ({type(compile_kwargs).__name__})."
            )
        if compile_kwargs:
            _check_compile_kwargs(compile_kwargs)
            if not compile:
                # kept and never used: said, not refused, so that a config can switch compilation off on the command
                # line (`--...compile=false`, as the tuner's options do) and keep the arguments for when it is on.
                # Every DDP process builds the plugin: rank 0 says it for all (stack: _warn, rank_zero_warn, its
                # rank_zero_only wrapper, this __init__, the caller)
                rank_zero_warn(
                    f"FusedPrecision: `compile_kwargs` {dict(compile_kwargs)!r} are not used with compile=False: the "
                    "model runs eagerly. Pass `compile=True` to compile with them.",
                    category=UserWarning,
                    stacklevel=5,
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
        self._device_given = device is not None
        self.fusions = fusions
        self.ignore_modules = _ignore_list(ignore_modules)
        self.compile = compile
        self.compile_kwargs = dict(compile_kwargs or {})
        self.backend = backend
        self.memory_format = memory_format
        self.report: FusionReport | None = None
        # every parameter surgery replaced, by weak reference, for optimizers built before it (see `connect`)
        self._replaced: list[Replaced] = []
        self._module: weakref.ref[nn.Module] | None = None
        #: why surgery was undone for the rest of the fit (:meth:`switch_off`), or None
        self.switched_off_reason: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # weak references do not pickle (a Trainer is pickled to start `ddp_spawn` processes, a config to be saved),
        # and point at nothing in another process: the copy converts its own model when it sets up
        return {**self.__dict__, "_module": None, "_replaced": []}

    def __repr__(self) -> str:
        """The settings, then (once a model was converted) what surgery fused, what it skipped and why, and whether
        it was switched off: what a user printing the plugin, or a config holding it, needs to know."""
        if self.fusions is None:
            fusions = "all"
        elif isinstance(self.fusions, Mapping):
            fusions = f"policy{sorted(self.fusions)}"
        else:
            fusions = repr(list(self.fusions))
        ignore = "[" + ", ".join(i.__qualname__ if isinstance(i, type) else repr(i) for i in self.ignore_modules) + "]"
        parts = [
            f"precision={self.precision!r}",
            f"device={self.device!r}",
            f"fusions={fusions}",
            f"ignore_modules={ignore}",
            f"backend={self.backend!r}",
            f"memory_format={self.memory_format!r}",
            f"compile={self.compile}",
        ]
        if self.compile_kwargs:
            parts.append(f"compile_kwargs={self.compile_kwargs!r}")
        text = ", ".join(parts)
        if self.report is not None:
            text += f"; report: {self.report.summary()}"
            skipped = self.report.skipped()
            if skipped:
                shown = [f"{c.module or '(root)'} ({c.kind}: {c.reason})" for c in skipped[:_REPR_SKIPPED]]
                more = f" and {len(skipped) - _REPR_SKIPPED} more" if len(skipped) > _REPR_SKIPPED else ""
                text += f"; skipped: {', '.join(shown)}{more}"
        if self.switched_off_reason is not None:
            text += f"; switched off: {self.switched_off_reason}"
        return f"{type(self).__name__}({text})"

    # -- the lever protocol (lightning_accel._utils.levers.Lever) --------------------------------------------------
    lever_name = "fused"

    @property
    def lever_active(self) -> bool:
        """Whether the converted model has fused modules computing through their fused forward: fused by this plugin,
        or already fused when it converted the model (a second fit of the same model, whose surgery changes nothing)."""
        module = self._module() if self._module is not None else None
        if self.switched_off_reason is not None or module is None or self.report is None:
            return False
        return bool(self.report.records) or any(c.fused for c in self.report.candidates)

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
        self._replaced.extend(report.replaced)
        if self.memory_format == "channels_last":
            # in place (`param.data` swapped): optimizers built later, or already holding these parameters, see them
            module.to(memory_format=torch.channels_last)
        if report.records:
            rank_zero_info(f"FusedPrecision (backend={self.backend!r}): {report.summary()}:\n{report.table()}")
        if self.compile:
            compile_in_place(module, **self.compile_kwargs)
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Point the Trainer's optimizers at the parameters surgery replaced (Lightning calls this once they are
        built, after :meth:`convert_module`): an optimizer built in the LightningModule's ``__init__`` still holds
        the q/k/v weights that packing replaced, and would step them outside the model.

        Raises:
            ValueError: when such an optimizer holds the replaced weights in a way one packed parameter cannot follow
                (only some of them, or in different parameter groups); the message names the fix.
        """
        if self._replaced:
            unwrapped = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]
            follow_replaced_parameters(unwrapped, FusionReport(replaced=self._replaced))
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the optimizer state as the unfused model's: a packed q/k/v parameter's per-parameter state (e.g.
        Adam's ``exp_avg``) as its three parts' (:func:`.optim_state.unpack_qkv_optimizer_state`), so a run without
        QKV packing resumes from the checkpoint (the model's keys are unfused already)."""
        self._map_optimizer_states(checkpoint, unpack_qkv_optimizer_state)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before Lightning loads the optimizers (this hook runs first), lay an optimizer state saved unfused out for
        the packed parameters (:func:`~lightning_accel.precision.optim_state.pack_qkv_optimizer_state`).

        Raises:
            ValueError: when a saved optimizer state fits neither layout (the message names the fix).
        """
        module = self._module() if self._module is not None else None
        trainer = _attached_trainer(module) if module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # only a fit restores optimizers
            self._map_optimizer_states(checkpoint, pack_qkv_optimizer_state)

    def _map_optimizer_states(self, checkpoint: dict[str, Any], fn: Any) -> None:
        """``checkpoint["optimizer_states"][i] = fn(state, optimizer i, module)`` for the Trainer's optimizers."""
        module = self._module() if self._module is not None else None
        states = checkpoint.get("optimizer_states")
        if module is None or not isinstance(states, list):
            return
        for i, optimizer in enumerate(_existing_optimizers(module)[: len(states)]):
            if isinstance(states[i], dict):
                states[i] = fn(states[i], optimizer, module)

    def _adopt_trainer_device(self, module: nn.Module) -> None:
        """Autocast (and a default GradScaler) on the device type the Trainer actually uses, e.g. ``cpu`` on a GPU
        machine with ``accelerator="cpu"``."""
        trainer = _attached_trainer(module)
        if trainer is None:
            return
        device_type = trainer.strategy.root_device.type
        if device_type == self.device:
            return
        if not self._follow_trainer_device:
            # autocast on another device type than the one the model computes on changes nothing: the fit would run
            # in full precision without a word
            what = "`device`" if self._device_given else "default device, kept because a `scaler` was given,"
            raise ValueError(
                f"FusedPrecision's {what} sets autocast on {self.device!r}, but the Trainer trains on {device_type!r}: "
                f"the model would run without mixed precision. Leave `device` (and `scaler`) out to follow the "
                f"Trainer, or pass device={device_type!r}."
            )
        self.device = device_type
        if self.scaler is not None:
            self.scaler = torch.amp.GradScaler(device=device_type)


def _is_device_type(device: object) -> bool:
    """``device`` is a device type torch knows (``"cuda"``, ``"cpu"``, ``"mps"``...), without an index."""
    if not isinstance(device, str):
        return False
    try:
        return torch.device(device).type == device
    except RuntimeError:
        return False


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
