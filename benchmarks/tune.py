"""``lightning-accel tune`` against the best it could have chosen, and ``RollbackGuard`` against injected faults.

Three jobs, each tuned from its plain configuration (``benchmarks/_tune_jobs.py``): the quickstart CNN, TinyGPT with
AdamW on 2 processes, and the image job read from an ImageFolder. In the same processes, right after the tune, the
exhaustive grid over the same options (each lever's options and "as configured", all combinations) is measured with
the tuner's choice among them, so both are timed under the same conditions (three rounds, alternating direction,
each row's fastest; a tuned job equal to one of the combinations takes that row's times). Ratios:

- ``tuned_over_grid_best_step``: the tuner's choice over the grid's fastest combination whose numerics pass (worst
  job); ``tune_seconds_over_budget``: the tune's wall time over its budget (worst job);
- ``plain_over_tuned_step_<job>``: the plain configuration's step over the tuned one (per job);
- the guard's four (``benchmarks/_tune_guard.py``): recovered fraction, false rollbacks, final metric against the
  clean run, overhead.

    python benchmarks/tune.py --quick --out /tmp/tune.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/tune.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import REPO, parser, ratio, report

JOBS = ("quickstart", "tinygpt", "image")


def run_job(name: str, work: Path, quick: bool) -> dict[str, Any]:
    """Tune one job and measure its grid in a process of its own (Lightning starts a 2-device job's second rank)."""
    out = work / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(REPO / "benchmarks" / "_tune_jobs.py"), name, str(work / name), str(out)]
    proc = subprocess.run([*cmd, *(["--quick"] if quick else [])], env=env, cwd=work, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        return {"job": name, "error": f"exit code {proc.returncode}"}
    return json.loads(out.read_text())


def summarize(res: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """One job's results and ratios from the tune and its grid."""
    name = res["job"]
    if "error" in res:
        return {"error": res["error"]}, {}
    grid = [r for r in res["grid"] if not r.get("extra")]
    tuned = next(r for r in res["grid"] if r.get("extra"))
    valid = [r for r in grid if r["step_s"] is not None and r.get("numerics_ok")]
    best = min(valid, key=lambda r: r["step_s"])
    plain = grid[0]
    results = {
        "tune_s": round(res["tune_s"], 1),
        "budget_s": res["budget_s"],
        "chosen": res["chosen"] or "nothing (the plain configuration)",
        "trials": res["trials"],
        "grid": [
            {
                "names": r["names"] or ["as configured"],
                "step_ms": _ms(r["step_s"]),
                "numerics": r.get("numerics"),
                "error": r["error"],
            }
            for r in res["grid"]
        ],
        "grid_best": best["names"] or ["as configured"],
        "grid_best_step_ms": _ms(best["step_s"]),
        "tuned_step_ms": _ms(tuned["step_s"]),
        "tuned_is_grid_row": tuned.get("same_as"),  # the tuned job equals this combination: its times are that row's
        "plain_step_ms": _ms(plain["step_s"]),
    }
    ratios = {
        "tuned_over_grid_best_step": ratio(tuned["step_s"], best["step_s"]),
        "tune_seconds_over_budget": ratio(res["tune_s"], res["budget_s"]),
        f"plain_over_tuned_step_{name}": ratio(plain["step_s"], tuned["step_s"]),
    }
    return results, ratios


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1000 * s, 2)


def guard_cases(quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """The guard's injected faults and clean runs, from ``benchmarks/_tune_guard.py`` when this checkout has it."""
    try:
        from benchmarks._tune_guard import run_guard_cases
    except ImportError as e:
        return {"skipped": f"the guard cases are not in this checkout ({e})"}, {}
    return run_guard_cases(quick)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    results: dict[str, Any] = {"loadavg_1min_start": round(os.getloadavg()[0], 2)}
    worst: dict[str, float] = {}
    ratios: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="tune-bench-"))
    try:
        for name in JOBS:
            res, rat = summarize(run_job(name, work, args.quick))
            results[name] = res
            for key in ("tuned_over_grid_best_step", "tune_seconds_over_budget"):  # per job in results, worst here
                if key in rat:
                    res[key] = rat[key]
                    worst[key] = max(worst.get(key, 0.0), rat.pop(key))
            ratios.update(rat)
        png = work / "quickstart" / "tuned" / "tune_report.png"
        if not args.quick and png.is_file():  # the docs' picture: the quickstart's report
            shutil.copyfile(png, REPO / "docs" / "img" / "tune_report.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["guard"], guard = guard_cases(args.quick)
    results["loadavg_1min_end"] = round(os.getloadavg()[0], 2)
    config = {"jobs": list(JOBS), "grid_rounds": 3, "trial_steps": 16, "trial_warmup": 3, "margin": 0.03}
    config["torch_threads"] = 1
    report("tune", quick=args.quick, config=config, results=results, ratios={**worst, **ratios, **guard}, out=args.out)


if __name__ == "__main__":
    main()
