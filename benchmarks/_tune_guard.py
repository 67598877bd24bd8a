"""RollbackGuard's cases: injected faults it must recover from, clean runs it must leave alone, and its step-time cost.

Two small jobs, one process each: the quickstart-like CNN (``ImageClassifier(width=16)`` on the 8x8 digits, AdamW with
per-step cosine decay; metric: held-out accuracy) and ``TinyGPT`` (AdamW; metric: held-out cross-entropy in nats).

1. **Clean runs**, 4 seeds per job, each with and without the guard, alternated (the order swaps
   between seeds): every rollback there is a false alarm (``guard_false_rollbacks``); the guard must not change
   training (``guard_clean_identical``: the final weights with and without it are bit-identical). Its cost,
   ``guard_overhead_frac``, is measured inside one more fit per job and seed, with the guard's hooks on and off in
   alternating blocks of ``check_every`` steps (:class:`Interleaved`): the mean CPU time of the training thread per
   step with the hooks over without, snapshot steps included, minus 1, the median over the fits (torch runs
   single-threaded here, and CPU time does not count the time other processes held the core).
   ``guard_overhead_frac_runs`` is the same from the whole runs with and without the guard,
   ``guard_overhead_frac_wall`` in wall time (both noisy on a shared machine: whole runs differ by more than the
   guard costs); ``guard_hook_frac`` is the CPU time inside the guard's own hooks over the step's (in situ).
2. **Faults**, every seed, injected at ``fault_step``: a NaN loss (one step); a learning-rate spike (``lr_factor``
   times the learning rate and the schedule's base, from that step on); a deliberately broken fused op (the CNN under
   ``FusedPrecision``: its fused conv-bn-relu forward returns NaN from that step on; reference: the same job fused
   and unbroken). A fault counts as recovered when the guard rolled back on every seed, the final weights are finite
   and the final metric, averaged over the seeds, is within the tolerance of the clean runs
   (``guard_recovered_fraction``); ``guard_final_metric_minus_clean``
   is the worst accuracy difference (CNN), ``guard_final_nats_minus_clean`` the worst loss difference (LM).

    python benchmarks/_tune_guard.py --quick
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as `python benchmarks/_tune_guard.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

import benchmarks._harness as H
from lightning_accel.callbacks import RollbackGuard
from lightning_accel.datasets import digits_tokens, load_digits_arrays
from lightning_accel.models import ImageClassifier, TinyGPT
from lightning_accel.precision import FusedPrecision
from lightning_accel.precision import modules as fused_modules

ACC_TOL = 0.005  # accuracy may drop at most this much against the clean run
NATS_TOL = 0.02  # held-out loss may rise at most this much


def guard_config(quick: bool) -> dict[str, Any]:
    return {
        "cnn_steps": 400 if quick else 800,
        "gpt_steps": 240 if quick else 500,
        "fault_step": 120 if quick else 250,
        "batch_size": 32,
        "lr_factor": 100.0,
        "snapshot_every": 25,
        "check_every": 5,  # the guard's CPU default, and the on/off block of the overhead fits
        "train_samples": 1400,
        "torch_threads": 1,
        # one held-out image is 0.0025 of accuracy and a rollback changes the batches after it: one seed moves the
        # final accuracy by ~0.01, twice the tolerance, so the faults' mean difference needs four
        "seeds": [0, 1, 2, 3],
    }


# -- jobs ------------------------------------------------------------------------------------------------------------
def _cnn_data() -> tuple[TensorDataset, TensorDataset]:
    images, labels = load_digits_arrays()
    x = torch.from_numpy(images).float().div_(16.0).unsqueeze(1).repeat(1, 3, 1, 1)
    y = torch.from_numpy(labels)
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def _gpt_data() -> tuple[TensorDataset, TensorDataset]:
    tokens = torch.from_numpy(digits_tokens()[0])
    return TensorDataset(tokens[:1400]), TensorDataset(tokens[1400:])


def _cnn_model() -> pl.LightningModule:
    m = ImageClassifier(width=16, lr=3e-3)
    m.example_input_array = None
    return m


def _gpt_model() -> pl.LightningModule:
    return TinyGPT(n_layer=2, n_head=2, n_embd=32, dropout=0.0, lr=3e-3)


@torch.no_grad()
def _cnn_metric(model: pl.LightningModule, held: TensorDataset) -> float:
    model.eval()
    x, y = held.tensors
    return float((model(x).argmax(1) == y).float().mean())


@torch.no_grad()
def _gpt_metric(model: pl.LightningModule, held: TensorDataset) -> float:
    model.eval()
    (t,) = held.tensors
    logits = model(t[:, :-1])
    return float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1)))


JOBS: dict[str, dict[str, Any]] = {
    "cnn": {"data": _cnn_data, "model": _cnn_model, "metric": _cnn_metric, "steps": "cnn_steps", "higher": True},
    "gpt": {"data": _gpt_data, "model": _gpt_model, "metric": _gpt_metric, "steps": "gpt_steps", "higher": False},
}


# -- faults ----------------------------------------------------------------------------------------------------------
class NaNLoss(Callback):
    """The loss of one step becomes NaN (so do its gradients and, after the step, the weights), once: a transient
    fault, which the step trained again after the rollback does not repeat."""

    def __init__(self, step: int) -> None:
        self.step, self.fired = step, False

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step and not self.fired:
            self.fired = True
            loss.mul_(math.nan)


class LRSpike(Callback):
    """At ``step``, ``factor`` times the learning rate, the schedule's base included (a mistyped LR change), once."""

    def __init__(self, step: int, factor: float) -> None:
        self.step, self.factor, self.fired = step, factor, False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step or self.fired:  # once: the rollback's restore undoes it
            return
        self.fired = True
        for g in trainer.optimizers[0].param_groups:
            g["lr"] *= self.factor
        for c in trainer.lr_scheduler_configs:
            c.scheduler.base_lrs = [b * self.factor for b in c.scheduler.base_lrs]  # type: ignore[attr-defined]


class BrokenFusedOp(Callback):
    """A deliberately broken fused op (benchmark-only): from ``step`` on, the fused conv-bn-relu forward returns NaN.
    The reference ops (what ``FusedPrecision.switch_off`` puts back) do not go through it."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.broken = False
        self.original = fused_modules.conv_bn_forward

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.original(*args, **kwargs)
        return out * math.nan if self.broken else out

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.broken = trainer.global_step >= self.step


class HookTimer(RollbackGuard):
    """The real guard, with the CPU time of this thread spent inside its per-step hooks accumulated (in situ), and
    the thread's CPU time per step beside it: thread CPU time does not count the time other processes held the core,
    so the fraction holds on a loaded machine (torch runs single-threaded here, so all compute is this thread's)."""

    hook_s = 0.0
    step_cpu_s = 0.0
    _mark: float | None = None

    def on_before_optimizer_step(self, *args: Any) -> None:
        t0 = time.thread_time()
        super().on_before_optimizer_step(*args)
        self.hook_s += time.thread_time() - t0

    def on_train_batch_end(self, *args: Any) -> None:
        t0 = time.thread_time()
        super().on_train_batch_end(*args)
        t1 = time.thread_time()
        self.hook_s += t1 - t0
        if self._mark is not None:
            self.step_cpu_s += t1 - self._mark
        self._mark = t1


class CpuClock(Callback):
    """This thread's CPU seconds per training step (end of one batch to the end of the next), in both arms: CPU time
    does not count the time other processes held the core, which wall time on a loaded machine does."""

    def __init__(self, skip: int) -> None:
        self.skip, self.marks = skip, []  # type: ignore[var-annotated]

    def on_train_batch_end(self, *args: Any) -> None:
        self.marks.append(time.thread_time())

    def mean(self) -> float:
        m = self.marks[self.skip :]
        return (m[-1] - m[0]) / max(1, len(m) - 1)


class Interleaved(RollbackGuard):
    """The real guard with its per-step hooks on for ``block`` steps, then off for ``block``, and so on (benchmark
    only), and this thread's CPU time per step recorded after its hooks. Steps with and without the guard alternate
    every few steps inside one fit, so a drift of the machine's speed (whole runs with the same settings differed by
    up to 20 % here, and so did 25-step blocks) falls on both alike. Build it with twice the guard's real
    ``snapshot_every``: snapshots fall due by global step but are taken in on-steps, which are half of them, so the
    on-steps see the guard's real snapshot rate; its checks (every ``check_every`` = ``block`` recorded steps) and
    gradient-norm samples count on-steps only, so they keep their rate by themselves."""

    def __init__(self, block: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block, self.on, self.step = block, True, 0
        self.marks: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step = trainer.global_step
        self.on = (self.step // self.block) % 2 == 0

    def on_before_backward(self, *args: Any) -> None:
        if self.on:
            super().on_before_backward(*args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        if self.on:
            super().on_before_optimizer_step(*args)

    def on_train_batch_end(self, *args: Any) -> None:
        if self.on:
            super().on_train_batch_end(*args)
        self.marks.append((self.step, time.thread_time()))

    def ratio(self, skip: int) -> float:
        """Mean CPU time of the steps with the guard over those without, after ``skip`` warm-up steps (a step's time
        runs from the previous step's end mark to its own)."""
        on: list[float] = []
        off: list[float] = []
        for (_, a), (step, b) in zip(self.marks, self.marks[1:], strict=False):
            if step >= skip:
                (on if (step // self.block) % 2 == 0 else off).append(b - a)
        return (sum(on) / len(on)) / (sum(off) / len(off))


# -- one fit ---------------------------------------------------------------------------------------------------------
def fit(
    cfg: dict[str, Any], job: str, seed: int, *, guard: bool, fault: str | None = None, fused: bool = False
) -> dict:
    spec = JOBS[job]
    gc.collect()  # the previous fit's Trainer and model go now, not during this one's steps
    train, held = spec["data"]()
    torch.manual_seed(seed)
    model = spec["model"]()
    g = HookTimer(snapshot_every=cfg["snapshot_every"], verbose=False) if guard else None
    clock, cpu = H.StepClock(skip=3), CpuClock(skip=3)
    callbacks: list[Callback] = [clock, cpu] + ([g] if g is not None else [])
    step = cfg["fault_step"]
    with ExitStack() as stack:
        if fault == "nan":
            callbacks.append(NaNLoss(step))
        elif fault == "lr_spike":
            callbacks.append(LRSpike(step, cfg["lr_factor"]))
        elif fault == "broken_fused":
            broken = BrokenFusedOp(step)
            callbacks.append(broken)
            stack.enter_context(mock.patch.object(fused_modules, "conv_bn_forward", broken.forward))
        plugins = [FusedPrecision("bf16-mixed", device="cpu")] if fused else []
        trainer = H.cpu_trainer(
            plugins=plugins,
            callbacks=callbacks,
            max_steps=cfg[spec["steps"]],
            limit_val_batches=0,
            enable_checkpointing=False,
        )
        gen = torch.Generator().manual_seed(seed)
        trainer.fit(model, DataLoader(train, batch_size=cfg["batch_size"], shuffle=True, generator=gen))
    weights = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    step_s = sum(clock.times) / max(1, len(clock.times))
    return {
        "metric": spec["metric"](model, held),
        "finite": bool(torch.isfinite(weights).all()),
        "weights": weights,
        "rollbacks": g.rollbacks if g is not None else 0,
        "events": [dict(e) for e in g.events] if g is not None else [],
        "step_s": step_s,
        "step_cpu_s": cpu.mean(),
        "hook_frac": g.hook_s / g.step_cpu_s if g is not None and g.step_cpu_s else None,
    }


# -- the cases -------------------------------------------------------------------------------------------------------
def clean_cases(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, int], dict]]:
    """Per job and seed: without and with the guard, alternated."""
    runs: dict[tuple[str, int], dict] = {}
    out: dict[str, Any] = {}
    for job in JOBS:
        for seed in cfg["seeds"]:
            # the order swaps between seeds: a run that follows another in the same process can be slower
            if seed % 2:
                on = fit(cfg, job, seed, guard=True)
                off = fit(cfg, job, seed, guard=False)
            else:
                off = fit(cfg, job, seed, guard=False)
                on = fit(cfg, job, seed, guard=True)
            runs[(job, seed)] = on
            out[f"{job}_seed{seed}"] = {
                "metric": round(on["metric"], 4),
                "rollbacks": on["rollbacks"],
                "identical": bool(torch.equal(on["weights"], off["weights"])),
                "step_ms_without": round(1e3 * off["step_s"], 3),
                "step_ms_with": round(1e3 * on["step_s"], 3),
                "step_cpu_ms_without": round(1e3 * off["step_cpu_s"], 3),
                "step_cpu_ms_with": round(1e3 * on["step_cpu_s"], 3),
                "overhead_frac": round(on["step_cpu_s"] / off["step_cpu_s"] - 1.0, 4),
                "overhead_frac_wall": round(on["step_s"] / off["step_s"] - 1.0, 4),
                "hook_frac": round(on["hook_frac"], 4),
            }
    return out, runs


def overhead_cases(cfg: dict[str, Any]) -> dict[str, Any]:
    """Per job and seed, one clean fit with the guard's hooks on and off in alternating blocks (:class:`Interleaved`):
    the pairs' step-time ratios."""
    out: dict[str, Any] = {}
    for job, spec in JOBS.items():
        for seed in cfg["seeds"]:
            gc.collect()
            train, _ = spec["data"]()
            torch.manual_seed(seed)
            model = spec["model"]()
            every = cfg["check_every"]
            g = Interleaved(every, snapshot_every=2 * cfg["snapshot_every"], check_every=every, verbose=False)
            trainer = H.cpu_trainer(
                callbacks=[g], max_steps=cfg[spec["steps"]], limit_val_batches=0, enable_checkpointing=False
            )
            gen = torch.Generator().manual_seed(seed)
            trainer.fit(model, DataLoader(train, batch_size=cfg["batch_size"], shuffle=True, generator=gen))
            out[f"{job}_seed{seed}"] = {"on_over_off": round(g.ratio(skip=2 * every), 4), "rollbacks": g.rollbacks}
    return out


def fault_cases(cfg: dict[str, Any], clean: dict[tuple[str, int], dict]) -> dict[str, Any]:
    """Each job with each fault, on every seed (the final metric's difference to the clean run of the same seed is
    averaged over them: one rollback changes which batches the rest of the run sees, and on a 397-image held-out set
    that alone moves the accuracy by a few images); the broken fused op against the same job fused and unbroken."""
    out: dict[str, Any] = {}
    seeds = cfg["seeds"]
    fused_ref = {seed: fit(cfg, "cnn", seed, guard=True, fused=True) for seed in seeds}
    out["cnn_fused_clean"] = {
        "metric": [round(r["metric"], 4) for r in fused_ref.values()],
        "rollbacks": sum(r["rollbacks"] for r in fused_ref.values()),
    }
    plan: list[tuple[str, str, bool]] = [(j, f, False) for j in JOBS for f in ("nan", "lr_spike")]
    plan.append(("cnn", "broken_fused", True))
    for job, fault, fused in plan:
        runs = {seed: fit(cfg, job, seed, guard=True, fault=fault, fused=fused) for seed in seeds}
        deltas = [r["metric"] - (fused_ref[s] if fused else clean[(job, s)])["metric"] for s, r in runs.items()]
        delta = sum(deltas) / len(deltas)
        ok = delta >= -ACC_TOL - 1e-9 if JOBS[job]["higher"] else delta <= NATS_TOL + 1e-9  # the bound counts
        out[f"{job}_{fault}"] = {
            "metric": [round(r["metric"], 4) for r in runs.values()],
            "minus_clean": round(delta, 4),
            "minus_clean_per_seed": [round(d, 4) for d in deltas],
            "rollbacks": [r["rollbacks"] for r in runs.values()],
            "switched_off": sorted({str(e["switched_off"]) for r in runs.values() for e in r["events"]}),
            "reasons": [e["reason"] for e in runs[0]["events"]],
            "finite": all(r["finite"] for r in runs.values()),
            "recovered": bool(
                all(r["rollbacks"] >= 1 for r in runs.values()) and all(r["finite"] for r in runs.values()) and ok
            ),
        }
    return out


def run_guard_cases(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """All guard cases: ``(results, ratios)``, ratios ``guard_recovered_fraction``, ``guard_false_rollbacks``,
    ``guard_final_metric_minus_clean`` (accuracy), ``guard_final_nats_minus_clean``, ``guard_overhead_frac``,
    ``guard_hook_frac``, ``guard_clean_identical``."""
    cfg = guard_config(quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["torch_threads"])
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        clean, runs = clean_cases(cfg)
        interleaved = overhead_cases(cfg)
        faults = fault_cases(cfg, runs)
    finally:
        torch.set_num_threads(threads)
    cnn = [v["minus_clean"] for k, v in faults.items() if k.startswith("cnn_") and "minus_clean" in v]
    gpt = [v["minus_clean"] for k, v in faults.items() if k.startswith("gpt_")]
    injected = [v for v in faults.values() if "recovered" in v]
    ratios = {
        "guard_recovered_fraction": round(sum(v["recovered"] for v in injected) / len(injected), 4),
        "guard_false_rollbacks": float(
            sum(v["rollbacks"] for v in clean.values()) + faults["cnn_fused_clean"]["rollbacks"]
        ),
        "guard_final_metric_minus_clean": min(cnn),
        "guard_final_nats_minus_clean": max(gpt),
        "guard_overhead_frac": round(H.median([v["on_over_off"] for v in interleaved.values()]) - 1.0, 4),
        "guard_overhead_frac_runs": H.median([v["overhead_frac"] for v in clean.values()]),
        "guard_overhead_frac_wall": H.median([v["overhead_frac_wall"] for v in clean.values()]),
        "guard_hook_frac": H.median([v["hook_frac"] for v in clean.values()]),
        "guard_clean_identical": float(all(v["identical"] for v in clean.values())),
    }
    results = {
        "config": cfg,
        "clean": clean,
        "interleaved": interleaved,
        "faults": faults,
        "seconds": round(time.perf_counter() - t0, 1),
        "load_1min_start": load0,
        "load_1min_end": os.getloadavg()[0],
    }
    return results, ratios


def main() -> None:
    args = H.parser("RollbackGuard: injected faults, false alarms, overhead").parse_args()
    results, ratios = run_guard_cases(args.quick)
    config = results.pop("config")
    H.report("tune_guard", quick=args.quick, config=config, results=results, ratios=ratios, out=args.out)


if __name__ == "__main__":
    main()
