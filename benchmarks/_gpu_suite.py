"""The summary of ``benchmarks/gpu_suite.sh``: one JSON and one markdown file from the steps it ran.

``gpu_suite.sh`` writes ``steps.tsv`` (one line per step: name, status, exit code, seconds, limit, report path, log
path, command) and each step's own report: a benchmark's JSON (the harness contract) or pytest's JUnit XML. This
module reads them and writes

- ``summary.json``: ``{"suite", "ok", "wall_s", "budget_s", "machine", "steps": [...]}``, each step with its status,
  exit code, seconds, the ``ratios`` of its report (benchmarks) or the test counts (pytest), and the tail of its log
  when it did not pass;
- ``summary.md``: a table of the steps, then each benchmark's ratios and each failure's log tail;

prints the markdown, and exits 0 when every step passed, 1 otherwise.

    python benchmarks/_gpu_suite.py DIR [--budget SECONDS] [--wall SECONDS]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/_gpu_suite.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["read_steps", "summarize", "to_markdown"]

LOG_TAIL_LINES = 25


def _junit_counts(path: Path) -> dict[str, int]:
    """``{"tests", "passed", "failed", "errors", "skipped"}`` from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
    }


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def read_steps(out_dir: Path) -> list[dict[str, Any]]:
    """The steps recorded in ``out_dir/steps.tsv``, each with what its report and log say."""
    steps: list[dict[str, Any]] = []
    with open(out_dir / "steps.tsv", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            step: dict[str, Any] = {
                "name": row["name"],
                "status": row["status"],
                "rc": int(row["rc"]) if row["rc"] else None,
                "seconds": int(row["seconds"] or 0),
                "limit_s": int(row["limit_s"] or 0),
                "command": row["command"],
            }
            report, log = Path(row["report"]), Path(row["log"])
            if report.is_file():
                try:
                    if report.suffix == ".xml":
                        step["tests"] = _junit_counts(report)
                    else:
                        doc = json.loads(report.read_text())
                        step["ratios"] = doc.get("ratios", {})
                        step["report"] = str(report)
                except (ValueError, ET.ParseError) as e:  # a step killed while writing: say so, keep going
                    step["report_error"] = f"{report.name}: {e}"
            if step["status"] != "passed":
                step["log_tail"] = _tail(log)
            steps.append(step)
    return steps


def _machine() -> dict[str, Any]:
    try:
        from benchmarks._harness import machine_info

        info = machine_info()
        import torch

        info["cuda_devices"] = torch.cuda.device_count()
        return info
    except Exception as e:  # the summary must be written even when torch is in a bad state
        return {"error": repr(e)}


def summarize(out_dir: Path, *, budget_s: int | None = None, wall_s: int | None = None) -> dict[str, Any]:
    """Build the summary of the suite run in ``out_dir`` and write ``summary.json`` and ``summary.md`` there."""
    steps = read_steps(out_dir)
    doc = {
        "suite": "gpu_suite",
        "ok": bool(steps) and all(s["status"] == "passed" for s in steps),
        "wall_s": wall_s,
        "budget_s": budget_s,
        "machine": _machine(),
        "steps": steps,
    }
    tmp = out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, out_dir / "summary.json")
    (out_dir / "summary.md").write_text(to_markdown(doc))
    return doc


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _key_numbers(step: dict[str, Any]) -> str:
    if "tests" in step:
        t = step["tests"]
        return f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
    if step.get("ratios"):
        return f"{len(step['ratios'])} ratios"
    return step.get("report_error", "")


def to_markdown(doc: dict[str, Any]) -> str:
    """The summary as markdown: the step table, each step's ratios, and the log tail of each step that did not pass."""
    m = doc.get("machine", {})
    lines = [
        f"# GPU suite: {'all steps passed' if doc['ok'] else 'NOT all steps passed'}",
        "",
        f"device: {m.get('device', '?')} x {m.get('cuda_devices', '?')}; torch {m.get('torch', '?')}; "
        f"wall {doc.get('wall_s')} s of a {doc.get('budget_s')} s budget",
        "",
        "| step | status | exit | seconds | limit | result |",
        "|---|---|---|---|---|---|",
    ]
    for s in doc["steps"]:
        rc = "" if s["rc"] is None else s["rc"]
        lines.append(f"| {s['name']} | {s['status']} | {rc} | {s['seconds']} | {s['limit_s']} | {_key_numbers(s)} |")
    for s in doc["steps"]:
        if s.get("ratios"):
            lines += ["", f"## {s['name']}", "", "| ratio | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in s["ratios"].items()]
    for s in doc["steps"]:
        if s["status"] != "passed":
            lines += ["", f"## {s['name']}: {s['status']}", "", f"`{s['command']}`", "", "```"]
            lines += s.get("log_tail", []) or ["(no log)"]
            lines.append("```")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="the directory gpu_suite.sh wrote (holds steps.tsv)")
    p.add_argument("--budget", type=int, default=None, help="the suite's time budget in seconds")
    p.add_argument("--wall", type=int, default=None, help="the suite's wall time in seconds")
    args = p.parse_args(argv)
    doc = summarize(args.out_dir, budget_s=args.budget, wall_s=args.wall)
    print(to_markdown(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
