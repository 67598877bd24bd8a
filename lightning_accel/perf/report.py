"""The bottleneck report: share of step time per category, throughput, MFU, and a verdict in plain words."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_accel.perf.timers import CATEGORIES, TimerTotals

__all__ = ["BottleneckReport", "build_report", "mfu", "verdict_text"]


def mfu(flops_per_step: float | None, seconds_per_step: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak, or None when either is unknown."""
    if not flops_per_step or not peak_flops or seconds_per_step <= 0:
        return None
    return flops_per_step / seconds_per_step / peak_flops


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def verdict_text(dominant: str, shares: Mapping[str, float], context: Mapping[str, Any]) -> str:
    """One sentence naming the dominant category, its share, and the fix.

    Args:
        dominant: the category with the largest share.
        shares: category -> fraction of step time.
        context: optional facts that sharpen the advice: ``num_workers``, ``mfu``, ``precision``, ``world_size``,
            ``precision_plugin``, ``strategy`` and ``checkpoint_io`` (their class names with their bases', the
            checkpoint IO's with those of the IOs it wraps: the advice leaves out what is already on), and
            ``checkpoint_async`` (the checkpoint IO already writes in the background without being an
            ``AsyncCheckpointIO``, e.g. ``DeltaCheckpointIO(async_save=True)``), ``datamodule`` (the trainer's data
            module class names with their bases': a ``CachedDataModule`` is not advised to itself), ``device`` (the
            device type: GPU augmentation is not advised to a CPU run) and ``compiled`` (the model already runs
            under ``torch.compile``: not advised again).
    """
    p = _pct(shares.get(dominant, 0.0))
    workers = context.get("num_workers")
    if dominant == "data":
        w = f" (now {workers})" if workers is not None else ""
        if "CachedDataModule" in context.get("datamodule", ()):
            # it already decodes once and augments on the device: what is left is its own knobs
            return (
                f"{p} of step time waits for data, already read through CachedDataModule: raise num_workers{w} for "
                "the cold epochs (they decode every sample once), or give the cache's RAM tier room (ram_bytes) so "
                "that warm epochs read from memory."
            )
        gpu = "" if context.get("device") == "cpu" else "; move per-sample augmentation to the GPU"
        return (
            f"{p} of step time waits for data: use CachedDataModule (decode once, read cached tensors) "
            f"or raise num_workers{w}{gpu}."
        )
    if dominant == "compute":
        m = context.get("mfu")
        mtxt = f" at {_pct(m)} MFU" if isinstance(m, float) else ""
        prec = context.get("precision")
        fixes = ["torch.compile", "a larger batch per device"]
        if context.get("compiled"):  # the model already runs compiled
            fixes.remove("torch.compile")
        # advise what is not already on: a reduced precision first, then the fused kernels
        if not (prec and "16" in str(prec)):
            ptxt = f" (precision now {prec})" if prec else ""
            fixes.insert(0, f"bf16-mixed / FusedPrecision{ptxt}")
        elif "FusedPrecision" not in context.get("precision_plugin", ()):
            fixes.insert(0, f"FusedPrecision (fused Conv+BN+ReLU, attention, norms; precision now {prec})")
        return (
            f"{p} of step time is compute{mtxt}: the input pipeline keeps up. Make the step cheaper: "
            f"{', '.join(fixes)}."
        )
    if dominant == "comm":
        if "OneBitDDPStrategy" in context.get("strategy", ()):
            if not context.get("strategy_lever_active", True):
                return (
                    f"{p} of step time is exposed gradient communication, averaged in fp32 by ddp_1bit when the run "
                    "ended (its warm-up had not ended, or compression='auto' measured fp32 faster on this link): "
                    "accumulate gradients over more batches or use a faster interconnect; if the warm-up never ended, "
                    "a longer run or fewer `warmup_steps`."
                )
            return (
                f"{p} of step time is exposed gradient communication, already 1-bit compressed: on a slow link use "
                "local steps (strategy='diloco'), accumulate gradients over more batches, or a faster interconnect."
            )
        return (
            f"{p} of step time is exposed gradient communication: use strategy='ddp_1bit' (1-bit compressed "
            "allreduce), accumulate gradients over more batches, or a faster interconnect."
        )
    if dominant == "checkpoint":
        io = context.get("checkpoint_io", ())
        delta = "DeltaCheckpointIO" in io
        background = "AsyncCheckpointIO" in io or bool(context.get("checkpoint_async"))
        if delta and background:
            return (
                f"{p} of step time stalls in checkpoint saves, already written as deltas in the background: save "
                "less often (every_n_train_steps); what is left is gathering the state and copying its tensors."
            )
        if delta:
            return (
                f"{p} of step time stalls in checkpoint saves, already written as deltas: save less often "
                "(every_n_train_steps), or write in the background (DeltaCheckpointIO(async_save=True))."
            )
        if background:
            return (
                f"{p} of step time stalls in checkpoint saves, already written in the background: save less often "
                "(every_n_train_steps), or DeltaCheckpointIO to write less."
            )
        return (
            f"{p} of step time stalls in checkpoint saves: save less often (every_n_train_steps), use "
            "AsyncCheckpointIO, or DeltaCheckpointIO to write less."
        )
    if dominant == "eval":
        return (
            f"{p} of fit time is validation: validate less often (val_check_interval, check_val_every_n_epoch) "
            "or on fewer batches (limit_val_batches)."
        )
    return f"{p} of step time is outside data, compute, comm, checkpoint and eval: profile callbacks and logging."


@dataclass
class BottleneckReport:
    """What :class:`~lightning_accel.perf.PerformanceMonitor` prints at the end of ``fit``.

    Attributes:
        seconds: category -> seconds over the counted steps (see :data:`~lightning_accel.perf.timers.CATEGORIES`).
        shares: category -> fraction of the total.
        dominant: the category with the largest share (the benchmark's ``verdict_*``).
        verdict: one plain-words sentence with the fix.
        steps: counted training steps (warm-up excluded).
        step_time_s: mean seconds per counted step, all categories included.
        samples_per_s: samples over total seconds (None when batch sizes are unknown).
        tokens_per_s: tokens over total seconds (None unless a token counter was given).
        flops_per_step: FLOPs of one training step (forward + backward + optimizer), measured once.
        mfu: model FLOPs utilisation (None when the device's peak is unknown, e.g. on CPU without ``peak_flops``).
        extras: device facts (GPU utilisation, memory, world size, how comm was measured).
        epochs: per epoch, ``{"epoch": e, <category>: seconds, "steps": n, "samples_per_s": rate}`` (the same
            reductions over ranks as the totals); drawn into ``perf_report.png``.
        context: the facts the verdict was given from (:func:`verdict_text`'s ``context``, ``mfu`` included), so a
            caller that corrects the breakdown can give the verdict again from the same facts; not in the JSON.
    """

    seconds: dict[str, float]
    shares: dict[str, float]
    dominant: str
    verdict: str
    steps: int
    step_time_s: float
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    flops_per_step: float | None = None
    mfu: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    epochs: list[dict[str, float]] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (without :attr:`context`, the verdict's inputs)."""
        d = asdict(self)
        del d["context"]
        return d

    def to_json(self) -> str:
        """Indented JSON."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    def format(self) -> str:
        """A small text table followed by the verdict, for logs and terminals."""
        lines = [f"Bottleneck report ({self.steps} steps, {1000 * self.step_time_s:.1f} ms/step)"]
        lines.append(f"  {'category':<11}{'share':>8}{'seconds':>11}")
        for cat in CATEGORIES:
            s = self.seconds.get(cat, 0.0)
            if s > 0 or cat in ("data", "compute"):
                lines.append(f"  {cat:<11}{_pct(self.shares.get(cat, 0.0)):>8}{s:>11.3f}")
        if self.samples_per_s is not None:
            lines.append(f"  throughput: {self.samples_per_s:,.1f} samples/s")
        if self.tokens_per_s is not None:
            lines.append(f"  throughput: {self.tokens_per_s:,.1f} tokens/s")
        if self.flops_per_step:
            m = f", MFU {100 * self.mfu:.1f} %" if self.mfu is not None else ", MFU n/a (peak FLOPs unknown)"
            lines.append(f"  FLOPs/step: {self.flops_per_step:.3g}{m}")
        for k, v in self.extras.items():
            lines.append(f"  {k}: {v}")
        lines.append(f"Verdict [{self.dominant}]: {self.verdict}")
        return "\n".join(lines)


def build_report(
    totals: TimerTotals,
    *,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
    context: Mapping[str, Any] | None = None,
    extras: Mapping[str, Any] | None = None,
    epochs: Sequence[Mapping[str, float]] = (),
) -> BottleneckReport:
    """Turn accumulated totals into a :class:`BottleneckReport`.

    Args:
        totals: what :class:`~lightning_accel.perf.timers.StepTimer` accumulated (possibly reduced over ranks).
        flops_per_step: FLOPs of one step on one device, or None.
        peak_flops: the device's peak FLOP/s for the active precision, or None.
        context: facts for the verdict (``num_workers``, ``precision``); ``mfu`` is added here.
        extras: lines appended to the report as ``key: value``.
        epochs: per-epoch breakdowns (see :attr:`BottleneckReport.epochs`), kept as given.

    Raises:
        ValueError: when no step was counted (nothing to report).
    """
    if totals.steps <= 0:
        raise ValueError(
            "`totals.steps` is 0: no training step was timed. Run more steps than `skip_steps` "
            "(e.g. raise `limit_train_batches`) to get a report."
        )
    seconds = {c: max(0.0, float(totals.seconds.get(c, 0.0))) for c in CATEGORIES}
    wall = sum(seconds.values())
    shares = {c: (s / wall if wall > 0 else 0.0) for c, s in seconds.items()}
    dominant = max(CATEGORIES, key=lambda c: seconds[c])
    step_time = wall / totals.steps
    m = mfu(flops_per_step, step_time, peak_flops)
    ctx = dict(context or {})
    ctx["mfu"] = m
    return BottleneckReport(
        seconds=seconds,
        shares=shares,
        dominant=dominant,
        verdict=verdict_text(dominant, shares, ctx),
        steps=totals.steps,
        step_time_s=step_time,
        samples_per_s=(totals.samples / wall) if totals.samples and wall > 0 else None,
        tokens_per_s=(totals.tokens / wall) if totals.tokens and wall > 0 else None,
        flops_per_step=flops_per_step,
        mfu=m,
        extras=dict(extras or {}),
        epochs=[dict(e) for e in epochs],
        context=ctx,
    )
