"""PerformanceMonitor: its own overhead, and whether its verdict names the real bottleneck.

1. **Overhead**: the same CPU training (a small CNN on in-memory 32 px images) with and without the monitor,
   alternated run by run. Each run's step time is the median interval between consecutive ``on_train_batch_end``
   calls (a probe callback present in both arms; the first steps are warm-up and skipped), and
   ``overhead_frac`` is the median over adjacent (without, with) pairs of ``step(with) / step(without) - 1``. The
   time spent inside the monitor's per-step hooks is also accumulated in situ (``hook_us_per_step``,
   ``hook_overhead_frac``), because on a shared 2-core machine run-to-run noise is larger than 1 %.
2. **Verdicts**: a deliberately data-starved run (every sample "decodes" for ``decode_ms``: a sleep that stands for
   a slow remote read or JPEG decode, in one DataLoader worker) and a cached run (the same tensors from memory). The
   report's dominant category is ``verdict_starved`` (target ``"data"``) and ``verdict_cached`` (target not
   ``"data"``).

    python benchmarks/monitor_overhead.py --quick --out /tmp/monitor.json
"""

from __future__ import annotations

import time
from typing import Any

import _harness as H  # noqa: I001 - puts the repo on sys.path when run as a script
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_accel.callbacks import PerformanceMonitor


class Net(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SlowDecode(Dataset):
    """The same tensors, but every sample costs ``decode_ms`` first (a slow read/decode)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, decode_ms: float) -> None:
        self.x, self.y, self.decode_s = x, y, decode_ms / 1000.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.decode_s)
        return self.x[i], self.y[i]


class StepProbe(Callback):
    """Timestamps of every ``on_train_batch_end`` (present in both arms, so its tiny cost cancels)."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.t.append(time.perf_counter())

    def median_step(self, skip: int) -> float:
        d = [b - a for a, b in zip(self.t[skip:-1], self.t[skip + 1 :], strict=True)]
        return H.median(d)


def fit(loader: DataLoader, steps: int, width: int, monitor: PerformanceMonitor | None) -> StepProbe:
    torch.manual_seed(0)
    probe = StepProbe()
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
    trainer.fit(Net(width), loader)
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


def main() -> None:
    args = H.parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)  # steadier timings on a shared machine
    q = args.quick
    cfg = {
        "samples": 1024,
        "image": 32,
        "width": 32,
        "batch_size": 32,
        "overhead_steps": 60 if q else 150,
        "overhead_pairs": 7 if q else 15,
        "warmup_skip": 5,
        "decode_ms": 3.0,
        "verdict_steps": 25 if q else 60,
        "torch_threads": 1,
    }
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg["samples"], 3, cfg["image"], cfg["image"], generator=g)
    y = torch.randint(0, 10, (cfg["samples"],), generator=g)
    cached = DataLoader(TensorDataset(x, y), batch_size=cfg["batch_size"], shuffle=True, num_workers=0)

    in_situ: list[float] = []  # seconds inside the monitor's per-step hooks / step, per monitored run

    def run(with_monitor: bool) -> float:
        mon = TimedMonitor(report_path="", verbose=False) if with_monitor else None
        probe = fit(cached, cfg["overhead_steps"], cfg["width"], mon)
        if mon is not None:
            in_situ.append(mon.hook_s / max(1, mon.hook_calls))
        return probe.median_step(cfg["warmup_skip"])

    times = H.alternate({"without": lambda: run(False), "with": lambda: run(True)}, repeats=cfg["overhead_pairs"])
    base, mon_t = H.median(times["without"]), H.median(times["with"])
    # runs next to each other share the machine's load: the median of per-pair ratios cancels slow drift
    pair_ratios = [w / b for w, b in zip(times["with"], times["without"], strict=True)]
    hook_s = H.median(in_situ)

    starved_loader = DataLoader(
        SlowDecode(x, y, cfg["decode_ms"]), batch_size=cfg["batch_size"], shuffle=True, num_workers=1
    )
    reports = {}
    for name, loader in (("starved", starved_loader), ("cached", cached)):
        mon = PerformanceMonitor(report_path="", verbose=False)
        fit(loader, cfg["verdict_steps"], cfg["width"], mon)
        assert mon.report is not None
        reports[name] = mon.report
        print(f"\n### {name}\n```\n{mon.report.format()}\n```")

    results = {
        "step_s_without": base,
        "step_s_with": mon_t,
        "step_s_runs_without": times["without"],
        "step_s_runs_with": times["with"],
        "pair_ratios": [round(r, 4) for r in pair_ratios],
        "hook_us_per_step": round(hook_s * 1e6, 2),
        "verdict_starved": reports["starved"].dominant,
        "verdict_cached": reports["cached"].dominant,
        "data_frac_starved": round(reports["starved"].shares["data"], 4),
        "data_frac_cached": round(reports["cached"].shares["data"], 4),
        "samples_per_s_starved": reports["starved"].samples_per_s,
        "samples_per_s_cached": reports["cached"].samples_per_s,
        "report_starved": reports["starved"].format(),
        "report_cached": reports["cached"].format(),
    }
    ratios = {
        "overhead_frac": round(H.median(pair_ratios) - 1.0, 4),
        "hook_overhead_frac": round(hook_s / base, 5),
        "speedup_cached_vs_starved": H.ratio(
            reports["cached"].samples_per_s or 0, reports["starved"].samples_per_s or 1
        ),
    }
    H.report(
        "monitor_overhead",
        quick=q,
        config=cfg,
        results=results,
        ratios=ratios,
        out=args.out,
        chart={"overhead_frac": ratios["overhead_frac"], "hook_overhead_frac": ratios["hook_overhead_frac"],
               "data_frac_starved": results["data_frac_starved"], "data_frac_cached": results["data_frac_cached"]},
        chart_title="PerformanceMonitor: overhead and data-wait share",
    )  # fmt: skip


if __name__ == "__main__":
    main()
