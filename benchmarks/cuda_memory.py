"""Benchmark: the CUDA caching allocator with and without ``CudaMemoryManager`` while shapes keep changing (GPU only).

A GPT-style stack (4 x ``GPTBlock(1024, 16 heads)``, 8 in the full run) trains under bf16 autocast with a sequence
length drawn per step from 64-2048 (the same seeded draws in both arms): the pattern that fragments a caching
allocator, since blocks cached for one shape are the wrong size for the next. Two arms, each in a fresh process (the
allocator reads its settings once, when CUDA initialises), alternated run by run:

- ``without``: PyTorch's allocator defaults (``PYTORCH_ALLOC_CONF`` cleared);
- ``with``: ``CudaMemoryManager()`` built before the Trainer (its defaults: expandable segments,
  ``max_split_size_mb=256``, ``garbage_collection_threshold=0.8``).

After every optimizer step (synchronised) a probe reads ``torch.cuda.memory_stats()``. Per arm, the median over runs
of: peak reserved and peak allocated GB, mean fragmentation (``1 - allocated / reserved``), the largest inactive split
bytes, ``cudaMalloc`` retries and the median step time. ``ratios``: ``peak_reserved_with_over_without``,
``fragmentation_with_over_without``, ``step_time_with_over_without`` (below 1: the manager helps).

    python benchmarks/cuda_memory.py --quick --out /tmp/cuda_memory.json

Without a CUDA device it says so and exits 0 without measuring anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/cuda_memory.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import median, parser, ratio, report

REPO = Path(__file__).resolve().parent.parent
ARMS = ("without", "with")
RESULT = "RESULT "  # prefix of the worker's one line of JSON on stdout


def parse_args() -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--worker", choices=ARMS, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def sizes(quick: bool) -> dict[str, Any]:
    """Model, batch, steps, sequence-length range and runs per arm."""
    return {
        "dim": 1024,
        "heads": 16,
        "layers": 4 if quick else 8,
        "batch": 8,
        "steps": 40 if quick else 100,
        "min_len": 64,
        "max_len": 2048,
        "repeats": 2 if quick else 3,
    }


def run_arm(arm: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One arm in this (fresh) process: train with changing sequence lengths and read the allocator every step."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks._harness import MemoryProbe, StepClock
    from benchmarks._models import VarLenGPT
    from lightning_accel.callbacks import CudaMemoryManager
    from lightning_accel.perf.cuda_memory import fragmentation_stats

    # the manager must exist before the first CUDA allocation, as it does when built before the Trainer
    callbacks: list[Any] = [CudaMemoryManager()] if arm == "with" else []

    clock, probe = StepClock(sync=True), MemoryProbe()  # the clock's synchronisation precedes the reading
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(cfg["min_len"], cfg["max_len"] + 1, (cfg["steps"],), generator=gen)
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        precision="bf16-mixed",
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, clock, probe],
    )
    model = VarLenGPT(cfg["dim"], cfg["heads"], cfg["layers"], cfg["batch"])
    trainer.fit(model, DataLoader(TensorDataset(lengths), batch_size=1))
    final = fragmentation_stats(torch.cuda.memory_stats())
    return {
        "peak_reserved_GB": torch.cuda.max_memory_reserved() / 1e9,
        "peak_allocated_GB": torch.cuda.max_memory_allocated() / 1e9,
        "mean_fragmentation": sum(probe.frag[1:]) / max(1, len(probe.frag) - 1),  # step 1 only fills the pool
        "max_inactive_split_GB": max(probe.inactive_split) / 1e9,
        "alloc_retries": final.alloc_retries,
        "step_ms": 1e3 * median(clock.times[1:] or clock.times),
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
    }


def arm_in_subprocess(arm: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Case: one arm in a fresh interpreter whose allocator starts from PyTorch's defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", arm] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-20:]
        raise RuntimeError(f"the `{arm}` arm failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return json.loads(lines[-1][len(RESULT) :])


def memory_numbers(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, float]]:
    """Per arm the median over runs of every number; ratios ``with`` over ``without``."""
    arms = {
        arm: {k: median([r[k] for r in rs]) for k, v in rs[0].items() if isinstance(v, (int, float))}
        for arm, rs in runs.items()
    }
    w, wo = arms["with"], arms["without"]
    ratios = {
        "peak_reserved_with_over_without": ratio(w["peak_reserved_GB"], wo["peak_reserved_GB"]),
        "fragmentation_with_over_without": ratio(w["mean_fragmentation"], wo["mean_fragmentation"]),
        "step_time_with_over_without": ratio(w["step_ms"], wo["step_ms"]),
    }
    return {**arms, "runs": runs, "alloc_conf_with": runs["with"][0]["alloc_conf"]}, ratios


def main() -> None:
    args = parse_args()
    cfg = sizes(args.quick)
    if args.worker is not None:  # child process of arm_in_subprocess()
        print(RESULT + json.dumps(run_arm(args.worker, cfg)), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        print("cuda_memory: no CUDA device on this machine: nothing measured (this benchmark needs a GPU).")
        return
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(cfg["repeats"]):  # alternate the arms run by run
        for arm in ARMS:
            runs[arm].append(arm_in_subprocess(arm, args.quick, timeout_s=300 if args.quick else 900))
    results, ratios = memory_numbers(runs)
    results["device"] = torch.cuda.get_device_name(0)
    report(
        "cuda_memory",
        quick=args.quick,
        config={**cfg, "model": "GPTBlock stack, bf16-mixed, AdamW", "manager": "CudaMemoryManager() defaults"},
        results=results,
        ratios=ratios,
        out=args.out,
        chart_title="CudaMemoryManager: with / without (below 1 is better)",
    )


if __name__ == "__main__":
    main()
