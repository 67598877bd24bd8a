"""Shared helpers for the benchmark contract.

The contract every ``benchmarks/<area>.py`` keeps:

- **Command line.** ``--quick`` (small sizes: under 3 minutes on 2 CPU cores) and ``--out FILE.json`` (write the
  report there), both from :func:`parser`; scripts with a GPU half add ``--device`` (see
  ``benchmarks/gpu_suite.sh``, which runs those halves on a CUDA machine).
- **Same run.** The baseline and the plugin run in the same process run, alternating where timing matters
  (:func:`alternate`): absolute times drift on shared machines, so the numbers that matter are ratios from one run.
- **Report.** :func:`report` writes the JSON ``{"benchmark", "quick", "machine", "config", "results", "ratios"}``
  (``machine`` from :func:`machine_info`; ``ratios`` holds the keys that docs and README quote, so a key, once
  published, is not renamed), prints ``results`` and ``ratios`` as markdown tables on stdout and, for full runs only,
  draws a bar chart ``docs/img/<benchmark>.png`` for the docs.
- **Shape.** ``main()`` reads as its cases: parse the arguments, run named case functions (each returns its own
  results and ratios), hand everything to :func:`report`.
- **Import.** Both ``python benchmarks/<area>.py`` and ``python -m benchmarks.<area>`` work: a script starts with the
  same two lines that put the checkout on ``sys.path`` when run by path, then imports ``from benchmarks._harness``.
- **Measures.** Steps, epochs and checkpoint saves are timed by one :class:`StepClock`; CUDA allocator state per
  step is read by :class:`MemoryProbe` (both defined in ``benchmarks/_measures.py`` and loaded, with Lightning, only
  when a script asks for them: importing this module imports neither torch nor Lightning, so a script still sets
  its environment before they load); the toy models the scripts share live in ``benchmarks/_models.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks._measures import MemoryProbe, StepClock

__all__ = [
    "MemoryProbe",
    "StepClock",
    "Timer",
    "alternate",
    "cpu_trainer",
    "cuda_time",
    "machine_info",
    "median",
    "parser",
    "ratio",
    "report",
    "run_cases",
]

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python benchmarks/x.py` from a checkout
    sys.path.insert(0, str(REPO))


def __getattr__(name: str) -> Any:
    if name in ("StepClock", "MemoryProbe"):
        from benchmarks import _measures

        return getattr(_measures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_trainer(*, plugins: Sequence[Any] = (), callbacks: Sequence[Any] = (), **kw: Any) -> Any:
    """A quiet one-device CPU ``lightning.Trainer`` (no logger, progress bar, model summary or sanity validation);
    ``kw`` adds or overrides Trainer arguments."""
    import lightning as L

    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(plugins=list(plugins), callbacks=list(callbacks), **{**quiet, **kw})


def parser(description: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the contract's ``--quick`` and ``--out``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes: under 3 minutes on 2 CPU cores")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    return p


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    with contextlib.suppress(AttributeError):  # not on macOS
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    # the installed distribution's version: no need to import Lightning for it
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["lightning"] = importlib.metadata.version("lightning")
    return info


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    if not xs:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(xs))


def ratio(num: float, den: float) -> float:
    """``num / den`` rounded to 4 decimals (``inf`` when ``den`` is 0 and ``num`` is not)."""
    if den == 0:
        return float("inf") if num else float("nan")
    return round(num / den, 4)


class Timer:
    """``with Timer() as t: ...``; then ``t.s`` holds the elapsed seconds (``perf_counter``)."""

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0


def alternate(
    cases: Mapping[str, Callable[[], float | None]], *, repeats: int, warmup: int = 0
) -> dict[str, list[float]]:
    """Run each case ``warmup + repeats`` times in A, B, C, A, B, C ... order and collect their timings.

    A case returns the seconds it measured itself, or ``None`` to be timed as a whole. Alternation spreads machine
    noise (other tenants, thermal drift) over every case instead of penalising whichever ran last.
    """
    out: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            got = fn()
            dt = time.perf_counter() - t0 if got is None else float(got)
            if i >= warmup:
                out[name].append(dt)
    return out


def run_cases(
    cases: Mapping[str, Callable[[bool], tuple[dict[str, Any], dict[str, float]]]], quick: bool
) -> tuple[dict[str, Any], dict[str, float]]:
    """Run ``{name: case}`` in order, each ``case(quick) -> (results, ratios)``: results under their names, the
    ratios merged into one dict."""
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for name, case in cases.items():
        res, rat = case(quick)
        results[name] = res
        ratios.update(rat)
    return results, ratios


def cuda_time(step: Callable[[], object], *, iters: int, warmup: int) -> tuple[float, float]:
    """Median seconds of ``step()`` on the GPU timeline (CUDA events) and the peak allocated bytes while timed.

    ``warmup`` untimed calls first (allocator, autotuning, compilation); the peak-memory counter is reset after them.
    """
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times), float(torch.cuda.max_memory_allocated())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:60]
    return str(v)


def _table(title: str, rows: Mapping[str, Any]) -> str:
    lines = [f"| {title} | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows.items()]
    return "\n".join(lines)


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def report(
    benchmark: str,
    *,
    quick: bool,
    config: Mapping[str, Any],
    results: Mapping[str, Any],
    ratios: Mapping[str, float],
    out: Path | None,
    chart: Mapping[str, float] | None = None,
    chart_title: str | None = None,
) -> dict[str, Any]:
    """Write the JSON report, print markdown tables, and (full runs) draw ``docs/img/<benchmark>.png``.

    Args:
        benchmark: the script's name, e.g. ``"quickstart"``.
        quick: whether ``--quick`` was given.
        config: the knobs of this run.
        results: measured values (absolute).
        ratios: the contract's ratios (plugin over baseline, etc.).
        out: JSON path, or None to skip writing.
        chart: ``{bar label: value}`` for the PNG (defaults to ``ratios``).
        chart_title: title of the PNG.
    """
    doc = {
        "benchmark": benchmark,
        "quick": quick,
        "machine": machine_info(),
        "config": dict(config),
        "results": dict(results),
        "ratios": dict(ratios),
    }
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str))
        os.replace(tmp, out)
    print(f"\n## {benchmark} ({'quick' if quick else 'full'})\n")
    print(_table("result", _flat(results)))
    print()
    print(_table("ratio", ratios))
    if not quick:
        _chart(benchmark, chart if chart is not None else ratios, chart_title or f"{benchmark}: ratios")
    return doc


def _chart(benchmark: str, values: Mapping[str, float], title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return None
    path = REPO / "docs" / "img" / f"{benchmark}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(values)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names)), 3.2))
    ax.bar(names, [float(values[n]) for n in names], color="#4c72b0")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    for i, n in enumerate(names):
        ax.annotate(f"{float(values[n]):.3g}", (i, float(values[n])), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path.relative_to(REPO)}")
    return path
