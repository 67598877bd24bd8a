"""``Trainer(strategy="ddp_1bit", accelerator="cpu", devices=2)`` in two real processes (gloo).

The tests are grouped by concern, one class each: the registered alias and ``compression="auto"`` (injected timings and
real-step trials, other optimizers, the restored ``optimizer.step``); training features (gradient accumulation,
clipping, ``static_graph``, unused, frozen and empty parameters, NaN steps under a GradScaler, ``bf16-mixed``, a
failure in the comm thread); overlap; resume-from-checkpoint against an uninterrupted run (gradient compression,
SGD-momentum and AdamW compressed momentum; a second ``fit`` of the same Trainer; one process resuming two). A
class's ``LAUNCH`` names its pair of processes; training features and overlap share one, because a pair costs the
imports of two processes (seconds each on a loaded 2-core machine).

Each group's pair runs only the scenarios of the tests selected in it (``-k resume_sgdm`` runs one scenario), and a
scenario that raises fails its own tests only (its traceback is the failure message).
"""

from __future__ import annotations

import functools
import math
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import run_in_processes

WARMUP = 2


def _module_cls():
    import lightning as L

    from lightning_accel._utils.compat import ddp_logging_data

    class TinyMLP(L.LightningModule):
        def __init__(
            self,
            unused: bool = False,
            nan_at: int | None = None,
            opt: str = "adamw",
            frozen: bool = False,
            empty: bool = False,
            step_data: bool = False,
            manual: bool = False,
        ) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            torch.manual_seed(0)
            # a parameter with no elements first (a zero-width layer, a pruned head): it trains as with plain DDP
            self.empty = nn.Parameter(torch.zeros(0, 16)) if empty else None
            self.net = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4))
            self.unused = nn.Linear(8, 8) if unused else None
            self.frozen = nn.Linear(16, 16) if frozen else None
            if self.frozen is not None:
                self.frozen.requires_grad_(False)
            self.nan_at = nan_at
            self.opt = opt
            self.step_data = step_data
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.step_data:  # a batch drawn from (step, rank): a fit resumed mid-epoch sees the same batches
                g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
                x, y = torch.randn(x.shape, generator=g), torch.randint(0, 4, y.shape, generator=g)
            if self.frozen is not None:
                x = x + self.frozen(x)
            loss = F.cross_entropy(self.net(x).float(), y)
            if self.empty is not None:
                loss = loss + (x @ self.empty.t()).sum()
            if self.nan_at is not None and self.global_step == self.nan_at and self.global_rank == 1:
                loss = loss * float("nan")
            self.losses.append(float(loss.detach()))
            if not self.automatic_optimization:  # the same zero_grad, backward, step as the automatic loop
                opt = self.optimizers()
                assert not isinstance(opt, list)
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            # while DDP wraps the module (the strategy unwraps it at teardown): which comm hook is registered?
            self.hook_name = (ddp_logging_data(self.trainer.strategy.model) or {}).get("comm_hook")

        def configure_optimizers(self):
            if self.opt == "sgdm":
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if self.opt == "rmsprop":
                return torch.optim.RMSprop(self.parameters(), lr=0.01)
            if self.opt == "sgdm_sched":  # an LR scheduler wraps `optimizer.step` itself
                opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2)}
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return TinyMLP


def _data(n: int = 128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1)).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def _fit(strategy, root: Path | None = None, ckpt: str | None = None, model=None, **trainer_kwargs):
    import lightning as L

    trainer_kwargs.setdefault("max_steps", 6)
    trainer_kwargs.setdefault("devices", 2)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **trainer_kwargs,
    )
    model = model or _module_cls()()
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return trainer, model


def _params(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _opt_state(trainer) -> dict[str, np.ndarray]:
    """Every optimizer state tensor (momentum, exp_avg, exp_avg_sq) and every error buffer, flattened by name."""
    out = {}
    opt = trainer.optimizers[0]
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v.detach().reshape(-1).numpy().copy()
    for k, g in trainer.strategy.onebit_state.groups.items():
        out[f"err.{k}.w"] = g.worker_error.numpy().copy()
        out[f"err.{k}.s"] = g.server_error.numpy().copy()
    return out


def _resume(strategy, tmp: str, name: str, refit: bool = False, **model_kwargs) -> dict:
    """2 epochs of 8 steps uninterrupted, against 1 epoch + checkpoint + resume (well past warm-up); ``refit``: the
    Trainer of the uninterrupted fit resumes the checkpoint in a second ``fit`` as well."""
    Model = _module_cls()
    first, full = _fit(strategy(), max_steps=-1, max_epochs=2, model=Model(**model_kwargs))
    trainer, _ = _fit(strategy(), max_steps=-1, max_epochs=1, model=Model(**model_kwargs))
    ckpt = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, resumed = _fit(strategy(), max_steps=-1, max_epochs=2, ckpt=ckpt, model=Model(**model_kwargs))
    st = trainer.strategy.onebit_state
    out = {
        "full": _params(full),
        "resumed": _params(resumed),
        "step": st.step,
        "groups": len(st.groups),
        "compressed": st.stats.compressed_calls,
        "mode": st.mode,
        "reset_warnings": [str(w.message) for w in caught if "reset" in str(w.message)],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = torch.load(ckpt, weights_only=True)
    out["ckpt_world"] = ck["lightning_accel_onebit"]["world_size"]
    out["ckpt_decision"] = ck["lightning_accel_onebit"]["decision"]
    out["ckpt"] = ckpt
    if refit:
        again = Model(**model_kwargs)
        first.fit(again, _data(), ckpt_path=ckpt)
        out["refit"] = _params(again)
        out["refit_step"] = first.strategy.onebit_state.step
    return out


def _auto_summary(trainer, model) -> dict:
    """What a ``compression="auto"`` fit decided, and what it did."""
    st = trainer.strategy.onebit_state
    return {
        "decisions": st.decisions,
        "decision": st.decision,
        "compressed": st.stats.compressed_calls,
        "groups": len(st.groups),
        "last_compressed": st.local_grads,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")},
        "params": _params(model),
    }


# ----------------------------------------------------------------------------------------------- scenarios
# Each scenario runs in both processes and returns what its tests check; `SCENARIOS` names them.

SCENARIOS: dict[str, Callable[[str], dict]] = {}


def _call_scenario(fn: Callable[..., dict], name: str, tmp: str) -> dict:
    return fn(tmp, name)


def _scenario(*names: str) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Register ``fn(tmp, name)`` under each of ``names``."""

    def register(fn: Callable[..., dict]) -> Callable[..., dict]:
        for name in names:
            SCENARIOS[name] = functools.partial(_call_scenario, fn, name)
        return fn

    return register


def _onebit(**kw):
    from lightning_accel.strategies import OneBitDDPStrategy

    kw.setdefault("compression", "1bit")
    if kw["compression"] != "fp32":  # plain DDP has no warm-up (refused beside it)
        kw.setdefault("warmup_steps", WARMUP)
    return OneBitDDPStrategy(**kw)


@_scenario("alias")
def _alias(tmp: str, name: str) -> dict:
    """The registered alias with every default: AdamW -> compressed momentum, compression="auto" measured here."""
    trainer, model = _fit("ddp_1bit", max_steps=20)
    st = trainer.strategy.onebit_state
    return {
        "cls": type(trainer.strategy).__name__,
        "hook": model.hook_name,
        "mode": st.mode,
        "decisions": st.decisions,
        "compressed": st.stats.compressed_calls,
        "last_compressed": st.local_grads,
        "step": st.step,
        "params": _params(model),
        "losses": model.losses,
    }


@_scenario("auto_1bit", "auto_fp32")
def _auto(tmp: str, name: str) -> dict:
    """compression="auto" on both branches, with injected timings."""
    from lightning_accel.strategies import OneBitDDPStrategy

    timings = (0.010, 0.001) if name == "auto_1bit" else (0.001, 0.010)
    strategy = OneBitDDPStrategy(warmup_steps=WARMUP, compression="auto", recheck_every=3)
    strategy.measure_fn = lambda state, t=timings: t
    return _auto_summary(*_fit(strategy, max_steps=9))


@_scenario("trial_1bit", "trial_fp32")
def _trial(tmp: str, name: str) -> dict:
    """compression="auto" from real steps, with a clock that makes a compressed step cost `cost` and an fp32 one 1."""
    from lightning_accel.strategies import OneBitDDPStrategy

    class Clock:
        def __init__(self, cost: float) -> None:
            self.t, self.cost = 0.0, cost
            self.strategy: Any = None

        def __call__(self) -> float:
            st = self.strategy.onebit_state
            self.t += self.cost if st is not None and st.local_grads else 1.0  # the step that just ended
            return self.t

    strategy = OneBitDDPStrategy(warmup_steps=4, compression="auto")
    clock = Clock(0.5 if name == "trial_1bit" else 2.0)
    clock.strategy = strategy
    strategy.step_clock = clock
    return _auto_summary(*_fit(strategy, max_steps=16))


@_scenario("trial_resume")
def _trial_resume(tmp: str, name: str) -> dict:
    """compression="auto" checkpointed during its trial of 1-bit steps (warm-up 4: the trial runs steps 4-7, fp32
    again 8-11, decides at 12; the fit stops after step 5), then resumed (at step 6: fp32 steps 6-9, the trial 10-13,
    fp32 again 14-17, decided at 18)."""
    trainer, _ = _fit(_onebit(compression="auto", warmup_steps=4), max_steps=6)
    ckpt = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.load(ckpt, weights_only=True)["lightning_accel_onebit"]
    out = {"saved": {k: saved[k] for k in ("step", "decision", "trial_until")}}
    return {**out, **_auto_summary(*_fit(_onebit(compression="auto", warmup_steps=4), max_steps=20, ckpt=ckpt))}


@_scenario("warmup_auto_refresh", "warmup_auto_watch", "warmup_auto_sgdm")
def _warmup_auto(tmp: str, name: str) -> dict:
    """warmup_steps="auto": AdamW with variance refreshes (ends at 10), AdamW with the variance kept frozen (the
    variance watch decides, at the latest 15 % of 120 steps = 18), SGD-momentum (nothing to freeze: 10)."""
    if name == "warmup_auto_refresh":
        # inside overlap="auto"'s trial of the first 8 compressed steps: refreshes take their place untimed
        strategy, steps, opt = _onebit(warmup_steps="auto", variance_refresh=2), 20, "adamw"
    elif name == "warmup_auto_watch":
        strategy, steps, opt = _onebit(warmup_steps="auto", variance_refresh=0), 120, "adamw"
    else:
        strategy, steps, opt = _onebit(warmup_steps="auto"), 14, "sgdm"
    seen: list[tuple[int, bool, bool]] = []

    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            st = trainer.strategy.onebit_state
            seen.append((trainer.global_step, st.local_grads, st.stats.last_step.compressed_sent > 0))

    trainer, model = _fit(strategy, model=_module_cls()(opt=opt), max_steps=steps, callbacks=[Probe()])
    st = trainer.strategy.onebit_state
    return {
        "warmup_end": st.warmup_end,
        "saved_warmup_end": st.state_dict()["warmup_end"],
        "fp32_steps": [step for step, local, _ in seen if not local],
        "params": _params(model),
        "losses": model.losses,
    }


@_scenario("rmsprop")
def _rmsprop(tmp: str, name: str) -> dict:
    """Another optimizer: gradient compression, with a warning naming it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model = _fit(_onebit(), max_steps=4, model=_module_cls()(opt="rmsprop"))
    return {
        "mode": trainer.strategy.onebit_state.mode,
        "warnings": [str(w.message) for w in caught if "RMSprop" in str(w.message)],
        "compressed": trainer.strategy.onebit_state.stats.compressed_calls,
    }


@_scenario("step_patch")
def _step_patch(tmp: str, name: str) -> dict:
    """The compressed stage replaces ``optimizer.step`` during each step only; the original is back after fit."""
    import lightning as L

    from lightning_accel._utils.patching import active_patch
    from lightning_accel.comm.strategy import STEP_PATCH_KEY

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.opt = trainer.optimizers[0]
            self.before = vars(self.opt).get("step")  # the LR scheduler's wrapper, or None (the class's method)
            self.patched: list[bool] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.patched.append(active_patch(self.opt, STEP_PATCH_KEY) is not None)

    watch = Watch()
    trainer, model = _fit(_onebit(), max_steps=5, callbacks=[watch], model=_module_cls()(opt="sgdm_sched"))
    opt = watch.opt
    return {
        "patched": watch.patched,
        "restored": vars(opt).get("step") is watch.before and active_patch(opt, STEP_PATCH_KEY) is None,
        "had_own_step": watch.before is not None,
        "compressed": trainer.strategy.onebit_state.stats.compressed_calls,
    }


@_scenario("accumulate_momentum", "accumulate_gradients")
def _accumulate(tmp: str, name: str) -> dict:
    """Gradient accumulation: one compression per optimizer step (momentum and gradients)."""
    mode = name.removeprefix("accumulate_")
    trainer, model = _fit(_onebit(compressed_signal=mode), max_steps=5, accumulate_grad_batches=2)
    st = trainer.strategy.onebit_state
    return {
        "step": st.step,
        "compressed": st.stats.compressed_calls,
        "groups": len(st.groups),
        "params": _params(model),
    }


@_scenario("clip")
def _clip(tmp: str, name: str) -> dict:
    """Gradient clipping clips the local gradient, before the momentum update."""
    import lightning as L

    from lightning_accel._utils.patching import patch

    class Spy(L.Callback):
        def on_train_start(self, trainer, pl_module):
            comp = next(iter(trainer.strategy._compressors.values()))
            self.norms: list[float] = []

            def spy(p):
                def compressed_step():
                    grads = [g.grad.reshape(-1) for g in pl_module.parameters() if g.grad is not None]
                    self.norms.append(float(torch.cat(grads).norm()))
                    p.original()

                return compressed_step

            patch(comp, "compressed_step", spy)

    spy = Spy()
    model = _module_cls()(opt="sgdm")
    trainer, model = _fit(_onebit(), max_steps=6, gradient_clip_val=0.05, callbacks=[spy], model=model)
    return {"norms": spy.norms, "params": _params(model)}


@_scenario("static")
def _static(tmp: str, name: str) -> dict:
    trainer, model = _fit(_onebit(static_graph=True))
    return {"compressed": trainer.strategy.onebit_state.stats.compressed_calls, "params": _params(model)}


@_scenario("foreign")
def _foreign(tmp: str, name: str) -> dict:
    """An optimizer that also trains a tensor outside the module (so outside DDP's model): refused when the fit sets
    up, before its first step, not at the first compressed step after the warm-up; with ``compression="fp32"`` (no
    compressed step ever) it trains as with DDP."""

    class WithTemperature(_module_cls()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(opt="sgdm")
            self.temperature = torch.ones(1, requires_grad=True)  # a plain tensor: not registered in the module
            self.steps_run = 0

        def training_step(self, batch, batch_idx):
            self.steps_run += 1
            return super().training_step(batch, batch_idx) * self.temperature.sum()

        def configure_optimizers(self):
            return torch.optim.SGD([*self.parameters(), self.temperature], lr=0.05, momentum=0.9)

    refused = WithTemperature()
    try:
        _fit(_onebit(), model=refused, max_steps=2 * WARMUP)
        message = ""
    except ValueError as e:
        message = str(e)
    _, fp32 = _fit(_onebit(compression="fp32"), model=WithTemperature(), max_steps=WARMUP + 1)
    return {
        "message": message,
        "steps_before_error": refused.steps_run,
        "fp32_steps": fp32.steps_run,
        "fp32_moved": bool(fp32.temperature.detach().item() != 1.0),
    }


@_scenario("forced_triton")
def _forced_triton(tmp: str, name: str) -> dict:
    """``compressor_backend="triton"`` on CPU tensors without the interpreter: refused when the fit sets up, naming the
    argument, before its first step (not at the first compressed step after the warm-up)."""
    import os

    model = _module_cls()(opt="sgdm")
    seen: list[int] = []
    model.on_train_batch_start = lambda batch, batch_idx: seen.append(batch_idx)  # type: ignore[method-assign]
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        _fit(_onebit(compressor_backend="triton"), model=model, max_steps=2 * WARMUP)
        message = ""
    except RuntimeError as e:
        message = str(e)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    return {"message": message, "steps_before_error": len(seen)}


@_scenario("unused")
def _unused(tmp: str, name: str) -> dict:
    """Unused and frozen parameters stay untouched (the alias that keeps compression)."""
    model = _module_cls()(unused=True, frozen=True)
    before_unused = model.unused.weight.detach().clone()
    before_frozen = model.frozen.weight.detach().clone()
    trainer, model = _fit(_onebit(find_unused_parameters=True), model=model)
    st = trainer.strategy.onebit_state
    return {
        "grad_none": model.unused.weight.grad is None,
        "unchanged": bool(torch.equal(before_unused, model.unused.weight.detach())),
        "frozen_unchanged": bool(torch.equal(before_frozen, model.frozen.weight.detach())),
        "compressed": st.stats.compressed_calls,
        "mode": st.mode,
        "params": _params(model),
    }


@_scenario("unused_gradients")
def _unused_gradients(tmp: str, name: str) -> dict:
    """The same with gradient compression: the comm thread's collectives run beside DDP's unused-parameter map."""
    model = _module_cls()(unused=True, frozen=True)
    before_unused = model.unused.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "proven only for plain SGD"
        trainer, model = _fit(_onebit(compressed_signal="gradients", find_unused_parameters=True), model=model)
    st = trainer.strategy.onebit_state
    return {
        "grad_none": model.unused.weight.grad is None,
        "unchanged": bool(torch.equal(before_unused, model.unused.weight.detach())),
        "compressed": st.stats.compressed_calls,
        "mode": st.mode,
        "worker_stopped": st.comm_worker is None,
        "params": _params(model),
    }


@_scenario("nan_momentum", "nan_gradients")
def _nan(tmp: str, name: str) -> dict:
    """A NaN step under a GradScaler (rank 1 only): every rank skips it, no state changes, training goes on."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    mode = name.removeprefix("nan_")

    class Snap(L.Callback):
        def __init__(self) -> None:
            self.snaps: dict[int, dict] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.snaps[batch_idx] = _opt_state(trainer)

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    snap = Snap()
    trainer, model = _fit(
        _onebit(compressed_signal=mode),
        model=_module_cls()(nan_at=4),
        plugins=[plugin],
        max_steps=8,
        callbacks=[snap],
    )
    st = trainer.strategy.onebit_state
    return {
        "nonfinite": st.stats.nonfinite_groups,
        "finite_params": bool(all(torch.isfinite(p).all() for p in model.parameters())),
        "scale": float(scaler.get_scale()),
        "errors_finite": bool(all(torch.isfinite(g.worker_error).all() for g in st.groups.values())),
        "compressed": st.stats.compressed_calls,
        "snaps": snap.snaps if mode == "momentum" else {},
        "params": _params(model),
    }


@_scenario("nan_refresh")
def _nan_refresh(tmp: str, name: str) -> dict:
    """AdamW with variance refreshes 2 and 6 steps into the compressed stage (steps 4 and 8, counted from 0); step
    4's gradients are NaN on rank 1, so the GradScaler skips that refresh on every rank: step 5 refreshes instead."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp32: list[int] = []
    steps = [0]

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not trainer.strategy.onebit_state.local_grads:
                fp32.append(steps[0])
            steps[0] += 1

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    trainer, model = _fit(
        _onebit(variance_refresh=2),
        model=_module_cls()(nan_at=4),
        plugins=[MixedPrecision("16-mixed", device="cpu", scaler=scaler)],
        max_steps=10,
        callbacks=[Probe()],
    )
    st = trainer.strategy.onebit_state
    return {
        "fp32_steps": fp32,
        "missed": st.refresh_missed,
        "finite_params": bool(all(torch.isfinite(p).all() for p in model.parameters())),
        "params": _params(model),
    }


@_scenario("refresh_manual")
def _refresh_manual(tmp: str, name: str) -> dict:
    """AdamW with variance refreshes 2 and 6 steps into the compressed stage (steps 4 and 8, counted from 0), under
    automatic and under manual optimization (the same zero_grad, backward and step): the same fp32 steps, the same
    parameters."""
    import lightning as L

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.fp32: list[int] = []
            self.steps = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not trainer.strategy.onebit_state.local_grads:
                self.fp32.append(self.steps)
            self.steps += 1

    out: dict = {}
    for mode in ("automatic", "manual"):
        probe = Probe()
        trainer, model = _fit(
            _onebit(variance_refresh=2, compression="1bit"),
            model=_module_cls()(manual=mode == "manual"),
            max_steps=10,
            callbacks=[probe],
        )
        st = trainer.strategy.onebit_state
        out[mode] = {"fp32_steps": probe.fp32, "missed": st.refresh_missed, "params": _params(model)}
    return out


@_scenario("bf16")
def _bf16(tmp: str, name: str) -> dict:
    trainer, model = _fit(_onebit(), precision="bf16-mixed")
    return {"compressed": trainer.strategy.onebit_state.stats.compressed_calls, "losses": model.losses}


@_scenario("resume", "resume_sgdm", "resume_adamw")
def _resume_scenario(tmp: str, name: str) -> dict:
    """Resume = uninterrupted. Gradient compression with small buckets: DDP's first iteration after the resume uses
    its initial bucket layout (one bucket), not the rebuilt one (several), so the hook must process that bucket as
    the saved groups. Compressed momentum: SGD-momentum and AdamW (momentum, frozen variance, errors, stage)."""
    if name == "resume":
        return _resume(lambda: _onebit(compressed_signal="gradients", bucket_cap_mb=0.0001), tmp, "grads")
    if name == "resume_sgdm":
        return _resume(lambda: _onebit(group_numel=500), tmp, "sgdm", opt="sgdm")
    return _resume(lambda: _onebit(group_numel=500), tmp, "adamw", refit=True)


def _gan_cls():
    import lightning as L

    class TinyGAN(L.LightningModule):
        """Manual optimization, two optimizers: the generator's step backpropagates through the discriminator and
        leaves its gradients there (no ``zero_grad`` of the discriminator until its own step), so DDP hands the next
        backward's buckets those gradients plus the new ones."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
            self.disc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            optimizers = self.optimizers()
            assert isinstance(optimizers, list)
            opt_g, opt_d = optimizers
            # a batch drawn from (step, rank): a fit resumed mid-epoch sees the same batches
            g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            z, real = torch.randn(8, 8, generator=g), torch.randn(8, 16, generator=g)
            fake = self.gen(z)
            opt_g.zero_grad()
            self.manual_backward(F.softplus(-self.disc(fake)).mean())
            opt_g.step()
            opt_d.zero_grad()
            self.manual_backward(F.softplus(-self.disc(real)).mean() + F.softplus(self.disc(fake.detach())).mean())
            opt_d.step()

        def configure_optimizers(self):
            return [torch.optim.RMSprop(self.gen.parameters(), lr=1e-3), torch.optim.RMSprop(self.disc.parameters())]

    return TinyGAN


@_scenario("resume_gan")
def _resume_gan(tmp: str, name: str) -> dict:
    """A manual-optimization GAN on the gradient path (its generator steps leave gradients on the discriminator):
    10 batches (20 optimizer steps) uninterrupted against 5 + checkpoint + resume, compressed from the third batch."""

    def strategy():
        return _onebit(compressed_signal="gradients", find_unused_parameters=True, min_compress_numel=0)

    Model = _gan_cls()
    _, full = _fit(strategy(), max_steps=20, model=Model())
    trainer, _ = _fit(strategy(), max_steps=10, model=Model())
    ckpt = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer, resumed = _fit(strategy(), max_steps=20, ckpt=ckpt, model=Model())
    st = trainer.strategy.onebit_state
    return {
        "full": _params(full),
        "resumed": _params(resumed),
        "mode": st.mode,
        "compressed": st.stats.compressed_calls,
    }


@_scenario("resume_at_refresh")
def _resume_at_refresh(tmp: str, name: str) -> dict:
    """AdamW, compressed from step 2, variance refreshed 8 steps into the stage: a checkpoint saved after step 10
    resumes with the refresh step, before any compressed step has adopted the checkpoint's error state."""
    Model = _module_cls()
    _, full = _fit(_onebit(group_numel=500), max_steps=14, model=Model(step_data=True))
    trainer, _ = _fit(_onebit(group_numel=500), max_steps=10, model=Model(step_data=True))
    ckpt = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(ckpt)
    _, resumed = _fit(_onebit(group_numel=500), max_steps=14, ckpt=ckpt, model=Model(step_data=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.load(ckpt, weights_only=True)["lightning_accel_onebit"]
    return {
        "full": _params(full),
        "resumed": _params(resumed),
        "saved_step": saved["step"],
        "saved_since": saved["compressed_since"],
    }


@_scenario("resume_warmup_watch")
def _resume_warmup_watch(tmp: str, name: str) -> dict:
    """``warmup_steps="auto"`` with the variance kept frozen, checkpointed at step 12 while its watch decides (checks at
    10 and 15; the cap, 15 % of ``max_steps=140``, at 21), then resumed; both fits stop at step 24. Then the checkpoint
    resumed with another block size for one step: the error state is reset, with one warning (rank zero's)."""
    from lightning.pytorch.callbacks import Callback

    ckpt = str(Path(tmp) / f"{name}.ckpt")

    class SaveAndStop(Callback):
        def __init__(self, save: bool) -> None:
            self.save = save

        def on_train_batch_end(self, trainer, *args) -> None:
            if self.save and trainer.global_step == 12:
                trainer.save_checkpoint(ckpt)
            if trainer.global_step >= 24:
                trainer.should_stop = True

    def run(save: bool, path: str | None) -> tuple:
        strategy = _onebit(warmup_steps="auto", variance_refresh=0)
        model = _module_cls()(step_data=True)
        trainer, model = _fit(strategy, model=model, ckpt=path, max_steps=140, callbacks=[SaveAndStop(save)])
        return trainer.strategy, model

    full, full_model = run(True, None)
    resumed, resumed_model = run(False, ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.load(ckpt, weights_only=True)["lightning_accel_onebit"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_onebit(warmup_steps="auto", variance_refresh=0, block_size=256), ckpt=ckpt, max_steps=13)
    return {
        "full_end": full.onebit_state.warmup_end,
        "resumed_end": resumed.onebit_state.warmup_end,
        "saved_end": saved["warmup_end"],
        "saved_last": saved["warmup_watch"]["last"] is not None,
        "full": _params(full_model),
        "resumed": _params(resumed_model),
        "reset_warnings": [str(w.message) for w in caught if "reset" in str(w.message)],
    }


@_scenario("switch_off_refit")
def _switch_off_refit(tmp: str, name: str) -> dict:
    """A second ``fit`` of the same Trainer after ``switch_off`` ended 1-bit averaging in the first: its new state
    compresses after its warm-up until it is switched off again, at its start (as ``RollbackGuard`` does)."""
    from lightning.pytorch.callbacks import Callback

    ckpt = str(Path(tmp) / "switch_off_refit.ckpt")

    class SwitchOff(Callback):
        def __init__(self) -> None:
            self.returned: list[bool] = []

        def on_train_start(self, trainer, pl_module):
            if trainer.global_step > 0:  # the second fit, resumed from step 1
                self.returned.append(trainer.strategy.switch_off("again"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1 and not self.returned:
                trainer.save_checkpoint(ckpt)
            if trainer.global_step == 4 and not self.returned:
                self.returned.append(trainer.strategy.switch_off("first"))

    off = SwitchOff()
    strategy = _onebit(compression="1bit")
    trainer, _ = _fit(strategy, max_steps=8, callbacks=[off])
    first = strategy.onebit_state.stats.compressed_calls
    trainer.fit(_module_cls()(), _data(), ckpt_path=ckpt)
    state = strategy.onebit_state
    return {
        "returned": off.returned,
        "first": first,
        "second": state.stats.compressed_calls,
        "decision": state.decision,
        "reason": strategy.switched_off_reason,
    }


@_scenario("weights_only")
def _weights_only(tmp: str, name: str) -> dict:
    """A weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)`` every 2 steps, and after the fit)
    against a full one: the 1-bit state goes into the full one only."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    dirpath = Path(tmp) / "weights_only"
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_weights_only=True, save_top_k=-1)
    trainer, _ = _fit(_onebit(compression="1bit"), max_steps=4, callbacks=[saver], enable_checkpointing=True)
    trainer.save_checkpoint(dirpath / "after.ckpt", weights_only=True)
    trainer.save_checkpoint(dirpath / "full.ckpt")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in sorted(dirpath.glob("*.ckpt")):
            out[path.name] = "lightning_accel_onebit" in torch.load(path, weights_only=True)
    return {"has_state": out}


@_scenario("resume_delta_async")
def _resume_delta_async(tmp: str, name: str) -> dict:
    """Resume = uninterrupted through ``DeltaCheckpointIO(async_save=True)``, whose writer resolves the error state
    that the strategy gathers asynchronously at each save (the training thread does not wait for the gather)."""
    import threading

    from lightning.pytorch.callbacks import Callback

    from lightning_accel._utils.deferred import Deferred
    from lightning_accel.checkpoint import DeltaCheckpointIO, read_checkpoint

    ckpt = str(Path(tmp) / "delta" / "onebit.ckpt")
    main = threading.get_ident()
    produced_on: list[int] = []
    real = Deferred.result

    def result(self: Deferred) -> object:
        produced_on.append(threading.get_ident())
        return real(self)

    class SaveAfterEpoch0(Callback):  # a save in the middle of the fit, as a checkpoint callback makes one
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(ckpt)

    def strategy():
        return _onebit(group_numel=500, checkpoint_io=DeltaCheckpointIO(async_save=True))

    Model = _module_cls()
    Deferred.result = result  # type: ignore[method-assign]
    try:
        _, full = _fit(strategy(), max_steps=-1, max_epochs=2, model=Model(), callbacks=[SaveAfterEpoch0()])
    finally:
        Deferred.result = real  # type: ignore[method-assign]
    trainer, resumed = _fit(strategy(), max_steps=-1, max_epochs=2, ckpt=ckpt, model=Model())
    saved = read_checkpoint(ckpt)["lightning_accel_onebit"] if trainer.global_rank == 0 else None
    return {
        "full": _params(full),
        "resumed": _params(resumed),
        "step": trainer.strategy.onebit_state.step,
        "deferred_on_writer": bool(produced_on) and main not in produced_on,
        "deferred_calls": len(produced_on),
        "saved_world": None if saved is None else int(saved["world_size"]),
        "saved_worker_rows": None if saved is None else [int(g["worker"].shape[0]) for g in saved["groups"].values()],
    }


@_scenario("empty_momentum", "empty_gradients")
def _empty(tmp: str, name: str) -> dict:
    """A parameter with no elements: in no group (a group layout needs elements), every other one compressed."""
    mode = name.removeprefix("empty_")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "proven only for plain SGD"
        trainer, model = _fit(_onebit(compressed_signal=mode), model=_module_cls()(empty=True))
    st = trainer.strategy.onebit_state
    return {
        "mode": st.mode,
        "compressed": st.stats.compressed_calls,
        "keys": [list(k) for k in st.groups],
        "params": _params(model),
        "finite": bool(np.isfinite(_params(model)).all()),
    }


@_scenario("comm_error")
def _comm_error(tmp: str, name: str) -> dict:
    """A job of the gradient path's comm thread that raises: the fit raises that exception (type and message)."""
    from lightning_accel.comm import hook

    def broken(state, bucket):
        raise KeyError("a failure inside the comm thread")

    original, hook._plan = hook._plan, broken  # the first compressed bucket's job raises (on every rank alike)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _fit(_onebit(compressed_signal="gradients"), max_steps=4)
    except Exception as err:  # noqa: BLE001 - what the user would see
        return {"type": type(err).__name__, "message": str(err)}
    finally:
        hook._plan = original
    return {"type": None, "message": ""}


@_scenario("overlap_sgdm_True", "overlap_sgdm_False", "overlap_adamw_True", "overlap_adamw_False")
def _overlap(tmp: str, name: str) -> dict:
    """Groups started during backward (several buckets, groups that span buckets) give bit-identical parameters,
    momentum, variance and error state to groups started after backward."""
    import lightning as L

    from lightning_accel._utils.patching import patch

    _, opt, overlap = name.split("_")

    class Early(L.Callback):
        def on_train_start(self, trainer, pl_module):
            comp = next(iter(trainer.strategy._compressors.values()))
            self.calls = 0
            self.started: list[int] = []

            def spy(p):
                def on_bucket(params, grads):
                    p.original(params, grads)
                    self.calls += 1
                    self.started.append(len(comp._early.started))

                return on_bucket

            patch(comp, "on_bucket", spy)

    early = Early()
    kw = {"group_numel": 300, "bucket_cap_mb": 0.0005}
    trainer, model = _fit(
        _onebit(overlap=overlap == "True", **kw), max_steps=7, callbacks=[early], model=_module_cls()(opt=opt)
    )
    return {
        "resolved": trainer.strategy.overlap,
        "calls": early.calls,
        "started": early.started,
        "compressed": trainer.strategy.onebit_state.stats.compressed_calls,
        "state": _opt_state(trainer),
        "params": _params(model),
    }


@_scenario("overlap_auto", "overlap_auto_back")
def _overlap_auto(tmp: str, name: str) -> dict:
    """``overlap="auto"`` times both orders in the first compressed steps (a scripted clock: serial steps cost half)
    and keeps the faster; the parameters equal those of a fit that overlapped throughout."""

    class Clock:
        def __init__(self, strategy) -> None:
            self.t, self.strategy = 0.0, strategy

        def __call__(self) -> float:
            serial_wins = name == "overlap_auto"
            self.t += (
                (1.0 if self.strategy.overlap else 0.5) if serial_wins else (0.5 if self.strategy.overlap else 1.0)
            )
            return self.t

    kw = {"group_numel": 300, "bucket_cap_mb": 0.0005}
    auto = _onebit(overlap="auto", **kw)
    auto.step_clock = Clock(auto)
    _, model = _fit(auto, max_steps=12)
    _, always = _fit(_onebit(overlap=True, **kw), max_steps=12)
    return {
        "decision": auto.overlap_decision,
        "final": auto.overlap,
        "params": _params(model),
        "always": _params(always),
    }


@_scenario("overlap_auto_resume")
def _overlap_auto_resume(tmp: str, name: str) -> dict:
    """A fit resumed after ``overlap="auto"`` decided keeps the checkpointed decision: it does not time both orders
    again (its own clock here would now favour overlapping)."""

    class Clock:
        def __init__(self, strategy, serial_wins: bool) -> None:
            self.t, self.strategy, self.serial_wins = 0.0, strategy, serial_wins

        def __call__(self) -> float:
            fast = self.strategy.overlap != self.serial_wins
            self.t += 0.5 if fast else 1.0
            return self.t

    kw = {"group_numel": 300, "bucket_cap_mb": 0.0005}
    first = _onebit(overlap="auto", **kw)
    first.step_clock = Clock(first, serial_wins=True)
    trainer, _ = _fit(first, max_steps=12)
    ckpt = str(Path(tmp) / "overlap_auto.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = _onebit(overlap="auto", **kw)
    resumed.step_clock = Clock(resumed, serial_wins=False)
    _fit(resumed, max_steps=20, ckpt=ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.load(ckpt, weights_only=True)["lightning_accel_onebit"]["overlap_decision"]
    out = {"first": first.overlap_decision, "saved": saved}
    return {**out, "resumed": resumed.overlap_decision, "final": resumed.overlap}


@_scenario("overlap_after_validate")
def _overlap_after_validate(tmp: str, name: str) -> dict:
    """``trainer.validate`` after a fit whose ``overlap="auto"`` decided (a scripted clock: serial steps cost half)
    keeps the decision, and a checkpoint saved after it holds the decision."""

    class WithValidation(_module_cls()):  # type: ignore[misc]
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    class Clock:
        def __init__(self, strategy) -> None:
            self.t, self.strategy = 0.0, strategy

        def __call__(self) -> float:
            self.t += 1.0 if self.strategy.overlap else 0.5
            return self.t

    strategy = _onebit(overlap="auto", group_numel=300, bucket_cap_mb=0.0005)
    strategy.step_clock = Clock(strategy)
    model = WithValidation()
    trainer, _ = _fit(strategy, max_steps=12, model=model)
    fitted = strategy.overlap_decision
    trainer.validate(model, _data(32), verbose=False)
    ckpt = str(Path(tmp) / "after_validate.ckpt")
    trainer.save_checkpoint(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.load(ckpt, weights_only=True)["lightning_accel_onebit"]["overlap_decision"]
    return {"fitted": fitted, "validated": strategy.overlap_decision, "saved": saved, "final": strategy.overlap}


@_scenario("overlap_clip")
def _overlap_clip(tmp: str, name: str) -> dict:
    """ "auto" turns overlap off for what needs the whole gradient; True refuses it with the reason."""
    trainer, _ = _fit(_onebit(), max_steps=3, gradient_clip_val=1.0)
    out: dict = {"auto": trainer.strategy.overlap}
    try:
        _fit(_onebit(overlap=True), max_steps=3, gradient_clip_val=1.0)
        out["true"] = ""
    except ValueError as err:
        out["true"] = str(err)
    return out


def _run_scenarios(rank: int, world: int, tmp: str, names: list[str]) -> dict:
    """Every scenario in ``names``, in order; one that raises records its traceback instead of ending the launch."""
    import lightning_accel  # noqa: F401  (registers "ddp_1bit")

    out: dict = {}
    for name in names:
        try:
            out[name] = SCENARIOS[name](tmp)
        except Exception:  # noqa: BLE001 - reported by the scenario's own tests
            out[name] = {"error": f"rank {rank}, scenario {name!r}:\n{traceback.format_exc()}"}
    return out


# ----------------------------------------------------------------------------------------------- launches


def uses(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The scenarios a test reads; ``{param}`` fields are filled from its parametrization."""

    def mark(fn: Callable[..., None]) -> Callable[..., None]:
        fn.scenarios = names  # type: ignore[attr-defined]
        return fn

    return mark


def _wanted(item: pytest.Item) -> list[str]:
    names = getattr(getattr(item, "function", None), "scenarios", ())
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [n.format(**params) for n in names]


def _launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One pair of processes for the scenarios that the selected tests of the classes sharing this class's
    ``LAUNCH`` read."""
    launch = request.cls.LAUNCH
    names: list[str] = []
    for item in request.session.items:
        if getattr(getattr(item, "cls", None), "LAUNCH", None) == launch:
            names += [n for n in _wanted(item) if n not in names]
    tmp = tmp_path_factory.mktemp(f"onebit-{launch}")
    return run_in_processes(_run_scenarios, 2, args=(str(tmp), names), init_process_group=False, timeout=420)


@pytest.fixture(scope="module")
def launched() -> dict[str, list[dict]]:
    """The launches made so far, by ``LAUNCH`` name (classes that share one run in the same pair of processes)."""
    return {}


@pytest.fixture(scope="class")
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, launched: dict[str, list[dict]]
) -> list[dict]:
    """Per rank, ``{scenario: result}`` for the scenarios the selected tests of the requesting class's launch read."""
    launch = request.cls.LAUNCH
    if launch not in launched:
        launched[launch] = _launch(request, tmp_path_factory)
    return launched[launch]


def _get(results: list[dict], name: str) -> list[dict]:
    """Both ranks' results of scenario ``name``; the scenario's traceback as the failure when it raised."""
    for r in results:
        if name not in r:
            pytest.fail(f"scenario {name!r} did not run (is it listed in the test's @uses?)")
        if "error" in r[name]:
            pytest.fail(r[name]["error"], pytrace=False)
    return [r[name] for r in results]


def _same_on_both_ranks(results: list[dict], name: str) -> None:
    r0, r1 = _get(results, name)
    np.testing.assert_array_equal(r0["params"], r1["params"])


# ----------------------------------------------------------------------------------------------- tests


class TestAliasAndAuto:
    """The registered alias, ``compression="auto"``, other optimizers, the optimizer-step replacement."""

    LAUNCH = "decisions"

    @uses("alias")
    def test_alias_trains_with_the_hook_attached_on_cpu(self, results: list[dict]) -> None:
        r0, r1 = _get(results, "alias")
        assert r0["cls"] == "OneBitDDPStrategy"
        assert "onebit_hook" in r0["hook"], "Lightning skips comm hooks on CPU; the strategy must register its own"
        assert r0["mode"] == "momentum" and r0["step"] == 20
        # compression="auto" decided once, from real steps: 10 fp32 warm-up steps, then 4 compressed ones and 4 fp32
        # ones again, timed against the fp32 steps around them, the same verdict on every rank
        assert len(r0["decisions"]) == 1 and r0["decisions"] == r1["decisions"]
        d = r0["decisions"][0]
        assert d["step"] == 10 and d["source"] == "steps" and d["fp32_s"] > 0 and d["onebit_s"] > 0
        assert r0["compressed"] > 0  # the trial steps
        assert r0["last_compressed"] == (d["decision"] == "1bit")
        np.testing.assert_array_equal(r0["params"], r1["params"])  # replicas bit-identical
        assert math.isfinite(r0["losses"][-1])

    @uses("auto_1bit", "auto_fp32")
    def test_auto_decides_on_both_branches(self, results: list[dict]) -> None:
        one, fp = _get(results, "auto_1bit")[0], _get(results, "auto_fp32")[0]
        assert one["decision"] == "1bit" and one["compressed"] > 0
        assert [d["step"] for d in one["decisions"]] == [WARMUP, WARMUP + 3, WARMUP + 6]  # recheck_every=3
        assert one["metrics"]["comm/compression_ratio"] > 20
        assert fp["decision"] == "fp32" and fp["compressed"] == 0
        assert all(d["decision"] == "fp32" and d["fp32_s"] == 0.001 for d in fp["decisions"])
        assert fp["metrics"]["comm/compression_ratio"] == pytest.approx(1.0)
        _same_on_both_ranks(results, "auto_1bit")
        _same_on_both_ranks(results, "auto_fp32")

    @uses("trial_{branch}")
    @pytest.mark.parametrize("branch", ["1bit", "fp32"])
    def test_auto_trial_of_real_steps_decides_on_both_branches(self, results: list[dict], branch: str) -> None:
        r, other = _get(results, f"trial_{branch}")
        assert [r[k] for k in ("decisions", "decision", "compressed")] == [
            other[k] for k in ("decisions", "decision", "compressed")
        ]  # the same decision and figures everywhere
        (d,) = r["decisions"]
        # steps 1-3 and 9-11 (fp32; step 8 is the first one back) against 5-7 (1-bit; step 4 builds the compression
        # state): 1.0 s against 0.5 s or 2.0 s; decided at step 12
        assert d["step"] == 4 and d["source"] == "steps"
        assert d["fp32_s"] == 1.0 and d["onebit_s"] == (0.5 if branch == "1bit" else 2.0)
        assert r["decision"] == branch and r["last_compressed"] == (branch == "1bit")
        # fp32: the 4 trial steps were compressed, the rest not; 1bit: those and every step from 12 on
        assert r["compressed"] == (4 if branch == "fp32" else 8) * max(1, r["groups"])
        _same_on_both_ranks(results, f"trial_{branch}")

    @uses("trial_resume")
    def test_auto_checkpointed_during_its_trial_decides_again_after_resume(self, results: list[dict]) -> None:
        r, other = _get(results, "trial_resume")
        # the checkpoint holds the mode being tried, flagged as such
        assert r["saved"] == {"step": 6, "decision": "1bit", "trial_until": 8}
        # the resumed fit tried again instead of keeping the tried mode unmeasured, from real steps of its own: its
        # first step (untimed as a reference) and 3 timed fp32 steps, then the trial
        (d,) = r["decisions"]
        assert d["step"] == 6 + 1 + 3 and d["source"] == "steps"
        assert r["decision"] == d["decision"] and r["last_compressed"] == (d["decision"] == "1bit")
        assert r["decisions"] == other["decisions"] and r["decision"] == other["decision"]
        np.testing.assert_array_equal(r["params"], other["params"])

    @uses("warmup_auto_refresh", "warmup_auto_watch", "warmup_auto_sgdm")
    def test_auto_warmup_resolves_per_optimizer_and_refreshes_the_variance(self, results: list[dict]) -> None:
        refresh, watch, sgdm = (
            _get(results, n) for n in ("warmup_auto_refresh", "warmup_auto_watch", "warmup_auto_sgdm")
        )
        for pair in (refresh, watch, sgdm):
            assert pair[0]["warmup_end"] == pair[1]["warmup_end"], "every rank ends the warm-up at the same step"
            assert pair[0]["saved_warmup_end"] == pair[0]["warmup_end"]
            np.testing.assert_array_equal(pair[0]["params"], pair[1]["params"])
            assert math.isfinite(pair[0]["losses"][-1])
        # refreshed variance: 10 fp32 steps, then fp32 refresh steps at 2 and 6 steps into the compressed stage
        # (global_step counts completed steps: step index 12 ends at global_step 13)
        assert refresh[0]["warmup_end"] == 10
        assert refresh[0]["fp32_steps"] == [*range(1, 11), 13, 17]
        assert 15 <= watch[0]["warmup_end"] <= 18  # the first comparison is at step 15, the cap at 18
        assert watch[0]["fp32_steps"] == list(range(1, watch[0]["warmup_end"] + 1)), "no refresh with 0"
        assert sgdm[0]["warmup_end"] == 10 and sgdm[0]["fp32_steps"] == list(range(1, 11))

    @uses("rmsprop")
    def test_other_optimizers_compress_gradients_with_a_warning(self, results: list[dict]) -> None:
        r = _get(results, "rmsprop")[0]
        assert r["mode"] == "gradients" and r["compressed"] > 0
        assert r["warnings"] and "proven only for plain SGD" in r["warnings"][0]

    @uses("step_patch")
    def test_optimizer_step_is_replaced_per_step_and_restored_after_fit(self, results: list[dict]) -> None:
        for r in _get(results, "step_patch"):
            assert r["compressed"] > 0
            assert r["patched"] and all(r["patched"]), "every step runs through the replacement"
            assert r["had_own_step"], "the LR scheduler's own `step` wrapper is the original here"
            assert r["restored"], "the optimizer's original `step` must come back after fit"


class TestTrainingFeatures:
    """Accumulation, clipping, ``static_graph``, unused/frozen parameters, NaN steps, ``bf16-mixed``."""

    LAUNCH = "training"

    @uses("accumulate_{mode}")
    @pytest.mark.parametrize("mode", ["momentum", "gradients"])
    def test_accumulation_compresses_once_per_optimizer_step(self, results: list[dict], mode: str) -> None:
        r = _get(results, f"accumulate_{mode}")[0]
        assert r["step"] == 5
        assert r["compressed"] == (5 - WARMUP) * r["groups"] > 0
        _same_on_both_ranks(results, f"accumulate_{mode}")

    @uses("clip")
    def test_clipping_clips_the_local_gradient_before_the_momentum_update(self, results: list[dict]) -> None:
        r0, r1 = _get(results, "clip")
        n0, n1 = r0["norms"], r1["norms"]
        assert len(n0) == 6 - WARMUP
        assert all(n <= 0.05 * (1 + 1e-5) for n in n0 + n1), "the compressed step saw an unclipped gradient"
        assert n0 != n1, "the compressed step must see each rank's own (local) gradient"
        _same_on_both_ranks(results, "clip")

    @uses("static")
    def test_static_graph(self, results: list[dict]) -> None:
        assert _get(results, "static")[0]["compressed"] > 0
        _same_on_both_ranks(results, "static")

    @uses("foreign")
    def test_a_trained_tensor_outside_the_model_is_refused_before_the_first_step(self, results: list[dict]) -> None:
        for r in _get(results, "foreign"):
            assert r["steps_before_error"] == 0  # not after the whole warm-up
            msg = r["message"]
            assert "\n" not in msg and "`optimizer`" in msg and "(1,)" in msg
            assert "nn.Parameter" in msg and "compressed_signal='gradients'" in msg
            assert r["fp32_steps"] == WARMUP + 1 and r["fp32_moved"]  # never compressed: trained as with DDP

    @uses("forced_triton")
    def test_a_forced_triton_compressor_that_cannot_run_is_refused_before_the_first_step(
        self, results: list[dict]
    ) -> None:
        for r in _get(results, "forced_triton"):
            assert r["steps_before_error"] == 0  # not after the whole warm-up
            msg = r["message"]
            assert "\n" not in msg and "`compressor_backend='triton'` got a tensor on cpu" in msg
            assert "TRITON_INTERPRET=1" in msg and "`compressor_backend='auto'`" in msg

    @uses("unused")
    def test_unused_and_frozen_parameters_untouched(self, results: list[dict]) -> None:
        r = _get(results, "unused")[0]
        assert r["mode"] == "momentum" and r["compressed"] > 0
        assert r["grad_none"] and r["unchanged"] and r["frozen_unchanged"]
        _same_on_both_ranks(results, "unused")

    @uses("unused_gradients")
    def test_unused_parameters_with_gradient_compression_in_the_comm_thread(self, results: list[dict]) -> None:
        r = _get(results, "unused_gradients")[0]
        assert r["mode"] == "gradients" and r["compressed"] > 0
        assert r["grad_none"] and r["unchanged"] and r["worker_stopped"]  # teardown stopped the thread
        _same_on_both_ranks(results, "unused_gradients")

    @uses("nan_{mode}")
    @pytest.mark.parametrize("mode", ["momentum", "gradients"])
    def test_nan_step_is_skipped_and_state_survives(self, results: list[dict], mode: str) -> None:
        both = _get(results, f"nan_{mode}")
        for r in both:
            assert r["finite_params"] and r["errors_finite"]
            assert r["compressed"] > 0
            if mode == "gradients":
                assert r["nonfinite"] >= 1 and r["compressed"] > r["nonfinite"]
            else:
                # the NaN batch (index 4) changed no momentum, variance or error state on either rank
                before, after = r["snaps"][3], r["snaps"][4]
                assert before.keys() == after.keys() and any(k.startswith("err.") for k in before)
                for k in before:
                    if not k.endswith(".step"):
                        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
                # ... while a finite compressed step does change them
                assert any(not np.array_equal(after[k], r["snaps"][5][k]) for k in after if k.startswith("err."))
        assert both[0]["scale"] == both[1]["scale"]
        _same_on_both_ranks(results, f"nan_{mode}")

    @uses("nan_refresh")
    def test_a_variance_refresh_the_grad_scaler_skipped_is_taken_at_the_next_step(self, results: list[dict]) -> None:
        both = _get(results, "nan_refresh")
        for r in both:
            # warm-up (0, 1), the skipped refresh (4, its backward averaged in fp32), its retry (5), the next one (8)
            assert r["fp32_steps"] == [0, 1, 4, 5, 8]
            assert not r["missed"] and r["finite_params"]
        _same_on_both_ranks(results, "nan_refresh")

    @uses("refresh_manual")
    def test_variance_refreshes_under_manual_optimization_match_automatic(self, results: list[dict]) -> None:
        for r in _get(results, "refresh_manual"):
            auto, manual = r["automatic"], r["manual"]
            # warm-up (0, 1), then the refreshes 2 and 6 steps into the compressed stage: fp32 averaging, exact Adam
            assert auto["fp32_steps"] == manual["fp32_steps"] == [0, 1, 4, 8]
            assert not auto["missed"] and not manual["missed"]
            np.testing.assert_array_equal(auto["params"], manual["params"])
        r0, r1 = _get(results, "refresh_manual")
        np.testing.assert_array_equal(r0["manual"]["params"], r1["manual"]["params"])

    @uses("bf16")
    def test_bf16_mixed(self, results: list[dict]) -> None:
        r = _get(results, "bf16")[0]
        assert r["compressed"] > 0 and all(math.isfinite(v) for v in r["losses"])

    @uses("empty_{mode}")
    @pytest.mark.parametrize("mode", ["momentum", "gradients"])
    def test_a_parameter_without_elements_trains_like_ddp(self, results: list[dict], mode: str) -> None:
        r = _get(results, f"empty_{mode}")[0]
        assert r["mode"] == mode and r["compressed"] > 0 and r["finite"]
        assert r["keys"] and all(0 not in k for k in r["keys"])  # parameter 0 is the empty one
        _same_on_both_ranks(results, f"empty_{mode}")

    @uses("comm_error")
    def test_a_failure_in_the_comm_thread_reaches_the_user_as_itself(self, results: list[dict]) -> None:
        for r in _get(results, "comm_error"):
            assert r["type"] == "KeyError" and "a failure inside the comm thread" in r["message"], r


class TestResume:
    """A resumed run continues bit for bit like an uninterrupted one."""

    LAUNCH = "resume"

    @uses("{name}")
    @pytest.mark.parametrize("name", ["resume", "resume_sgdm", "resume_adamw"])
    def test_resume_continues_exactly(self, results: list[dict], name: str) -> None:
        both = _get(results, name)
        for res in both:
            assert res["ckpt_world"] == 2 and res["step"] == 16 and res["ckpt_decision"] == "1bit"
            assert res["groups"] > 1 and not res["reset_warnings"] and res["compressed"] > 0
            assert res["mode"] == ("gradients" if name == "resume" else "momentum")
            np.testing.assert_array_equal(res["full"], res["resumed"])
        np.testing.assert_array_equal(both[0]["resumed"], both[1]["resumed"])

    @uses("resume_at_refresh")
    def test_a_resume_whose_first_step_refreshes_the_variance_continues_exactly(self, results: list[dict]) -> None:
        both = _get(results, "resume_at_refresh")
        for res in both:
            # the refresh is due 8 steps into the stage that began at step 2: the resumed fit's first step
            assert res["saved_step"] == 10 and res["saved_since"] == 2
            np.testing.assert_array_equal(res["full"], res["resumed"])
        np.testing.assert_array_equal(both[0]["resumed"], both[1]["resumed"])

    @uses("resume_gan")
    def test_a_manual_gan_on_the_gradient_path_resumes_exactly(self, results: list[dict]) -> None:
        both = _get(results, "resume_gan")
        for res in both:
            assert res["mode"] == "gradients" and res["compressed"] > 0
            np.testing.assert_array_equal(res["full"], res["resumed"])
        np.testing.assert_array_equal(both[0]["resumed"], both[1]["resumed"])

    @uses("resume_warmup_watch")
    def test_auto_warmup_checkpointed_while_deciding_ends_where_the_uninterrupted_one_does(
        self, results: list[dict]
    ) -> None:
        both = _get(results, "resume_warmup_watch")
        for res in both:
            # undecided at the save, with the means of the check at 10; the uninterrupted fit ends at the next check
            assert res["saved_end"] is None and res["saved_last"]
            assert res["full_end"] == 15 and res["resumed_end"] == res["full_end"]
            np.testing.assert_array_equal(res["full"], res["resumed"])
        np.testing.assert_array_equal(both[0]["resumed"], both[1]["resumed"])

    @uses("resume_warmup_watch")
    def test_a_reset_error_state_warns_once(self, results: list[dict]) -> None:
        r0, r1 = _get(results, "resume_warmup_watch")
        assert len(r0["reset_warnings"]) == 1 and "block_size=256" in r0["reset_warnings"][0]
        assert r1["reset_warnings"] == []  # every rank resets alike: rank zero says so

    @uses("resume_delta_async")
    def test_resume_through_the_async_delta_writer_continues_exactly(self, results: list[dict]) -> None:
        both = _get(results, "resume_delta_async")
        for res in both:
            assert res["step"] == 16
            np.testing.assert_array_equal(res["full"], res["resumed"])
        r0, r1 = both
        # rank 0's writer thread, not its training thread, waited for the gather of every rank's error state
        assert r0["deferred_on_writer"] and r0["deferred_calls"] >= 1 and r1["deferred_calls"] == 0
        assert r0["saved_world"] == 2 and r0["saved_worker_rows"] and set(r0["saved_worker_rows"]) == {2}

    @uses("resume_adamw")
    def test_a_second_fit_of_the_same_trainer_resumes_like_a_fresh_one(self, results: list[dict]) -> None:
        for res in _get(results, "resume_adamw"):
            assert res["refit_step"] == 16
            np.testing.assert_array_equal(res["full"], res["refit"])

    @uses("switch_off_refit")
    def test_a_switch_off_holds_for_its_own_fit_only(self, results: list[dict]) -> None:
        for r in _get(results, "switch_off_refit"):
            assert r["first"] == 4 - WARMUP  # compressed from the warm-up's end to the switch-off at step 4
            # the second fit's switch-off at its start (step 1, in its warm-up: 1-bit not on yet) keeps it off for
            # the rest of that fit, instead of being ignored as "already off"
            assert r["returned"] == [True, False]
            assert r["second"] == 0 and r["decision"] == "fp32" and r["reason"] == "again"

    @uses("weights_only")
    def test_a_weights_only_checkpoint_holds_no_onebit_state(self, results: list[dict]) -> None:
        for r in _get(results, "weights_only"):
            assert r["has_state"] == {
                "after.ckpt": False,
                "epoch=0-step=2.ckpt": False,
                "epoch=0-step=4.ckpt": False,
                "full.ckpt": True,
            }

    @uses("resume_adamw")
    def test_one_process_drops_the_state_of_several(self, results: list[dict], tmp_path: Path) -> None:
        """One process trains as plain DDP: the checkpoint's 1-bit state is dropped with a warning and not handed on
        to its own checkpoints (a later resume with several processes would restore the run before it)."""
        ckpt = _get(results, "resume_adamw")[0]["ckpt"]
        (r,) = run_in_processes(_single, 1, args=(ckpt, str(tmp_path)), init_process_group=False, timeout=180)
        assert any("saved by 2 processes" in w and "dropped" in w for w in r["warnings"]), r["warnings"]
        assert r["step"] == 8 + 16 and not r["payload"]  # epoch 2 unsplit: 16 batches in one process


class TestOverlap:
    """Compressed momentum started during backward."""

    LAUNCH = "training"

    @uses("overlap_{opt}_True", "overlap_{opt}_False")
    @pytest.mark.parametrize("opt", ["sgdm", "adamw"])
    def test_overlap_starts_groups_during_backward_with_identical_results(self, results: list[dict], opt: str) -> None:
        on, off = _get(results, f"overlap_{opt}_True")[0], _get(results, f"overlap_{opt}_False")[0]
        assert on["resolved"] is True and off["resolved"] is False
        assert on["compressed"] == off["compressed"] > 0
        # several buckets per backward, and groups were started inside the hook (before backward finished)
        assert on["calls"] >= 2 * (7 - WARMUP) and max(on["started"]) > 0 and off["calls"] == 0
        np.testing.assert_array_equal(on["params"], off["params"])
        assert on["state"].keys() == off["state"].keys()
        for k in on["state"]:
            np.testing.assert_array_equal(on["state"][k], off["state"][k], err_msg=k)
        _same_on_both_ranks(results, f"overlap_{opt}_True")

    @uses("overlap_auto", "overlap_auto_back")
    def test_overlap_auto_keeps_the_order_measured_faster(self, results: list[dict]) -> None:
        for r in _get(results, "overlap_auto_back"):  # overlapped, serial, overlapped again: the same parameters
            assert r["decision"]["overlap"] is True and r["final"] is True
            np.testing.assert_array_equal(r["params"], r["always"])
        for r in _get(results, "overlap_auto"):
            d = r["decision"]
            assert d is not None and d["overlap"] is False and r["final"] is False
            assert d["step"] == WARMUP + 8  # 4 overlapped + 4 serial compressed steps, the first of each untimed
            assert d["serial_s"] < d["overlap_s"]
            np.testing.assert_array_equal(r["params"], r["always"])  # the order never changes the result
        _same_on_both_ranks(results, "overlap_auto")

    @uses("overlap_auto_resume")
    def test_a_resumed_fit_keeps_the_checkpointed_overlap_decision(self, results: list[dict]) -> None:
        for r in _get(results, "overlap_auto_resume"):
            assert r["first"] is not None and r["first"]["overlap"] is False
            assert r["saved"] == r["first"] and r["resumed"] == r["first"]
            assert r["final"] is False  # not timed again: its clock would have chosen to overlap
        r0, r1 = _get(results, "overlap_auto_resume")
        assert r0["resumed"] == r1["resumed"]

    @uses("overlap_after_validate")
    def test_validate_after_the_fit_keeps_its_overlap_decision(self, results: list[dict]) -> None:
        for r in _get(results, "overlap_after_validate"):
            assert r["fitted"] is not None and r["fitted"]["overlap"] is False
            # not replaced by an undecided trial: the checkpoint saved after validate holds the fit's decision
            assert r["validated"] == r["fitted"] and r["saved"] == r["fitted"]
            assert r["final"] is False

    @uses("overlap_clip")
    def test_overlap_is_refused_or_turned_off_with_clipping(self, results: list[dict]) -> None:
        r = _get(results, "overlap_clip")[0]
        assert r["auto"] is False
        msg = r["true"]
        assert "`overlap=True`" in msg and "gradient_clip_val=1.0" in msg and "overlap='auto'" in msg


def _single(rank: int, world: int, ckpt: str, tmp: str) -> dict:
    """Resume a 2-process checkpoint with 1 process to the end of epoch 2 and save: the warnings and what was saved."""
    import lightning_accel  # noqa: F401

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = _fit(_onebit(group_numel=500), ckpt=ckpt, max_steps=-1, max_epochs=2, devices=1)
        path = str(Path(tmp) / "single.ckpt")
        trainer.save_checkpoint(path)
    ck = torch.load(path, weights_only=True)
    return {
        "warnings": [str(w.message) for w in caught],
        "step": ck["global_step"],
        "payload": "lightning_accel_onebit" in ck,
    }


def test_a_scenario_that_raises_fails_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """In-process: the launch goes on past a raising scenario, and only that scenario's tests fail."""
    monkeypatch.setitem(SCENARIOS, "boom", lambda tmp: {"x": 1 // 0})
    monkeypatch.setitem(SCENARIOS, "fine", lambda tmp: {"params": np.zeros(2)})
    out = _run_scenarios(0, 2, str(tmp_path), ["boom", "fine"])
    assert "ZeroDivisionError" in out["boom"]["error"] and "scenario 'boom'" in out["boom"]["error"]
    with pytest.raises(pytest.fail.Exception, match="ZeroDivisionError"):
        _get([out, out], "boom")
    _same_on_both_ranks([out, out], "fine")
    with pytest.raises(pytest.fail.Exception, match="did not run"):
        _get([out, out], "missing")
