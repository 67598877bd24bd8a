"""PerformanceMonitor: its own overhead, and whether its verdict names the real bottleneck.

1. **Overhead**: the same CPU training (a small CNN on in-memory 32 px images) with and without the monitor,
   alternated. Step time is the interval between consecutive ``on_train_batch_end`` calls (``StepClock``).
   ``overhead_frac`` alternates *step by step*: in each run the monitor handles every other batch (the parity swaps
   between runs) and ``overhead_frac`` is the median over monitored steps of ``interval / mean(neighbouring
   unmonitored intervals) - 1``, so drift from other jobs on a shared machine cancels (``overhead_frac_arm_medians``
   compares the two arms' medians instead; ``noise_frac_aa`` is the same measurement with a do-nothing callback, the
   noise floor). ``overhead_frac_runs`` alternates whole runs (median
   of adjacent-pair ratios; noisier). The time spent inside the monitor's per-step hooks is also accumulated in
   situ (``hook_us_per_step``, ``hook_overhead_frac``).
2. **Verdicts**: a deliberately data-starved run (every sample "decodes" for ``decode_ms``: a sleep that stands for
   a slow remote read or JPEG decode, in one DataLoader worker; 10 ms x 32 samples is several times the step) and
   a cached run (the same tensors from memory). The report's dominant category is ``verdict_starved`` (target
   ``"data"``) and ``verdict_cached`` (target not ``"data"``).

    python benchmarks/monitor_overhead.py --quick --out /tmp/monitor.json
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/monitor_overhead.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset, TensorDataset

import benchmarks._harness as H
from benchmarks._models import ConvNet
from lightning_accel.callbacks import PerformanceMonitor
from lightning_accel.perf import BottleneckReport


class SlowDecode(Dataset):
    """The same tensors, but every sample costs ``decode_ms`` first (a slow read/decode)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, decode_ms: float) -> None:
        self.x, self.y, self.decode_s = x, y, decode_ms / 1000.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.decode_s)
        return self.x[i], self.y[i]


def fit(loader: DataLoader, steps: int, width: int, monitor: Callback | None, warmup: int = 0) -> H.StepClock:
    """Train ``steps`` steps of ``ConvNet(width)``; the clock (present in both arms, so its tiny cost cancels) timed
    them, ``warmup`` steps skipped."""
    torch.manual_seed(0)
    probe = H.StepClock(skip=warmup)
    callbacks: list[Callback] = [probe] + ([monitor] if monitor is not None else [])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(ConvNet(width), loader)
    return probe


class TimedMonitor(PerformanceMonitor):
    """The real monitor, with the wall time spent inside its per-step hooks accumulated (in situ)."""

    hook_s = 0.0
    hook_calls = 0

    def on_train_batch_start(self, *args: Any) -> None:
        t0 = time.perf_counter()
        super().on_train_batch_start(*args)
        self.hook_s += time.perf_counter() - t0

    def on_train_batch_end(self, *args: Any) -> None:
        t0 = time.perf_counter()
        super().on_train_batch_end(*args)
        self.hook_s += time.perf_counter() - t0
        self.hook_calls += 1


class InterleavedMonitor(TimedMonitor):
    """The monitor on every other step only (``batch_idx % 2 == parity``): "with" and "without" steps interleave in
    one run, so machine drift hits both arms alike. (Its own timings are meaningless: it only sees half the steps.)"""

    def __init__(self, parity: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.parity = parity

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % 2 == self.parity:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % 2 == self.parity:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def interleaved_intervals(probe: H.StepClock, parity: int, skip: int) -> tuple[list[float], list[float], list[float]]:
    """Split step intervals (end of batch i-1 to end of batch i: the gap and step of batch i, and the monitor's hooks
    for batch i when it was on) into (with, without), plus each "with" interval over the mean of its two "without"
    neighbours (a local ratio: drift slower than a step cancels)."""
    d = {i: probe.marks[i] - probe.marks[i - 1] for i in range(max(1, skip), len(probe.marks))}
    on = [v for i, v in d.items() if i % 2 == parity]
    off = [v for i, v in d.items() if i % 2 != parity]
    local = [d[i] / ((d[i - 1] + d[i + 1]) / 2) for i in d if i % 2 == parity and i - 1 in d and i + 1 in d]
    return on, off, local


def overhead_config(quick: bool) -> dict[str, Any]:
    """Data, model, steps and runs per case (the JSON's ``config``)."""
    return {
        "samples": 1024,
        "image": 32,
        "width": 32,
        "batch_size": 32,
        "overhead_steps": 80 if quick else 150,
        "overhead_pairs": 3 if quick else 8,
        "interleaved_runs": 6 if quick else 12,
        "aa_runs": 3 if quick else 6,
        "warmup_skip": 5,
        "decode_ms": 10.0,
        "verdict_steps": 25 if quick else 60,
        "torch_threads": 1,
    }


@dataclass
class Interleaved:
    """Step intervals of the step-interleaved runs: monitored, unmonitored, and each monitored one over its
    unmonitored neighbours."""

    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    local: list[float] = field(default_factory=list)


def interleaved_overhead(cfg: dict[str, Any], loader: DataLoader, in_situ: list[float]) -> Interleaved:
    """Case (a): steps with and without the monitor interleaved inside each run, the parity swapped run to run."""
    out = Interleaved()
    for r in range(cfg["interleaved_runs"]):
        mon = InterleavedMonitor(r % 2, report_path="", verbose=False)
        probe = fit(loader, cfg["overhead_steps"], cfg["width"], mon)
        on, off, loc = interleaved_intervals(probe, r % 2, cfg["warmup_skip"])
        out.local += loc
        out.on += on
        out.off += off
        in_situ.append(mon.hook_s / max(1, mon.hook_calls))
    return out


def aa_control(cfg: dict[str, Any], loader: DataLoader) -> list[float]:
    """Case (a'): the interleaved measurement with a do-nothing callback: the noise floor of (a) on this machine."""
    aa: list[float] = []
    for r in range(cfg["aa_runs"]):
        probe = fit(loader, cfg["overhead_steps"], cfg["width"], Callback())
        aa += interleaved_intervals(probe, r % 2, cfg["warmup_skip"])[2]
    return aa


def whole_runs(cfg: dict[str, Any], loader: DataLoader, in_situ: list[float]) -> dict[str, list[float]]:
    """Case (b): whole runs with and without the monitor, alternated; median step time of each run."""

    def run(with_monitor: bool) -> float:
        mon = TimedMonitor(report_path="", verbose=False) if with_monitor else None
        # step i's interval runs from the end of step i - 1: skipping warmup_skip + 1 steps leaves the intervals
        # that start at the end of step warmup_skip
        probe = fit(loader, cfg["overhead_steps"], cfg["width"], mon, warmup=cfg["warmup_skip"] + 1)
        if mon is not None:
            in_situ.append(mon.hook_s / max(1, mon.hook_calls))
        return H.median(probe.times)

    return H.alternate({"without": lambda: run(False), "with": lambda: run(True)}, repeats=cfg["overhead_pairs"])


def verdicts(cfg: dict[str, Any], x: torch.Tensor, y: torch.Tensor, cached: DataLoader) -> dict[str, BottleneckReport]:
    """Case 2: the monitor's report on a data-starved run and on a cached run."""
    starved = DataLoader(SlowDecode(x, y, cfg["decode_ms"]), batch_size=cfg["batch_size"], shuffle=True, num_workers=1)
    reports = {}
    for name, loader in (("starved", starved), ("cached", cached)):
        mon = PerformanceMonitor(report_path="", verbose=False)
        fit(loader, cfg["verdict_steps"], cfg["width"], mon)
        assert mon.report is not None
        reports[name] = mon.report
        print(f"\n### {name}\n```\n{mon.report.format()}\n```")
    return reports


def overhead_numbers(
    inter: Interleaved,
    aa: list[float],
    runs: dict[str, list[float]],
    in_situ: list[float],
    reports: dict[str, BottleneckReport],
) -> tuple[dict[str, Any], dict[str, float]]:
    """``results`` and ``ratios`` of all cases."""
    base, mon_t = H.median(runs["without"]), H.median(runs["with"])
    pair_ratios = [w / b for w, b in zip(runs["with"], runs["without"], strict=True)]
    hook_s = H.median(in_situ)
    starved, cached = reports["starved"], reports["cached"]
    results = {
        "step_s_interleaved_with": H.median(inter.on),
        "step_s_interleaved_without": H.median(inter.off),
        "interleaved_steps_per_arm": len(inter.on),
        "step_s_without": base,
        "step_s_with": mon_t,
        "step_s_runs_without": runs["without"],
        "step_s_runs_with": runs["with"],
        "pair_ratios": [round(r, 4) for r in pair_ratios],
        "hook_us_per_step": round(hook_s * 1e6, 2),
        "verdict_starved": starved.dominant,
        "verdict_cached": cached.dominant,
        "data_frac_starved": round(starved.shares["data"], 4),
        "data_frac_cached": round(cached.shares["data"], 4),
        "samples_per_s_starved": starved.samples_per_s,
        "samples_per_s_cached": cached.samples_per_s,
        "report_starved": starved.format(),
        "report_cached": cached.format(),
    }
    ratios = {
        "overhead_frac": round(H.median(inter.local) - 1.0, 4),
        "noise_frac_aa": round(H.median(aa) - 1.0, 4),
        "overhead_frac_arm_medians": round(H.median(inter.on) / H.median(inter.off) - 1.0, 4),
        "overhead_frac_runs": round(H.median(pair_ratios) - 1.0, 4),
        "hook_overhead_frac": round(hook_s / base, 5),
        "speedup_cached_vs_starved": H.ratio(cached.samples_per_s or 0, starved.samples_per_s or 1),
    }
    return results, ratios


def main() -> None:
    args = H.parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)  # steadier timings on a shared machine
    cfg = overhead_config(args.quick)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg["samples"], 3, cfg["image"], cfg["image"], generator=g)
    y = torch.randint(0, 10, (cfg["samples"],), generator=g)
    cached = DataLoader(TensorDataset(x, y), batch_size=cfg["batch_size"], shuffle=True, num_workers=0)
    in_situ: list[float] = []  # seconds inside the monitor's per-step hooks / step, per monitored run
    inter = interleaved_overhead(cfg, cached, in_situ)
    aa = aa_control(cfg, cached)
    runs = whole_runs(cfg, cached, in_situ)
    reports = verdicts(cfg, x, y, cached)
    results, ratios = overhead_numbers(inter, aa, runs, in_situ, reports)
    H.report(
        "monitor_overhead",
        quick=args.quick,
        config=cfg,
        results=results,
        ratios=ratios,
        out=args.out,
        chart={
            "overhead_frac": ratios["overhead_frac"],
            "hook_overhead_frac": ratios["hook_overhead_frac"],
            "data_frac_starved": results["data_frac_starved"],
            "data_frac_cached": results["data_frac_cached"],
        },
        chart_title="PerformanceMonitor: overhead and data-wait share",
    )


if __name__ == "__main__":
    main()
