"""``benchmarks/gpu_suite.sh`` without a GPU: its syntax, its clean no-GPU exit, and its step machinery (time budget,
per-step timeouts, failures recorded, summary) driven by a stand-in interpreter that plays the steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "benchmarks" / "gpu_suite.sh"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
def test_syntax() -> None:
    proc = subprocess.run(["bash", "-n", str(SUITE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite would run for real")
def test_without_a_gpu_it_exits_cleanly_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SUITE), "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "nothing ran" in lines[0]
    assert not out.exists()


@needs_bash
def test_bad_arguments_name_the_fix() -> None:
    proc = subprocess.run(["bash", str(SUITE), "--budget", "soon"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--budget must be whole seconds" in proc.stderr
    proc = subprocess.run(["bash", str(SUITE), "--only", "fused,nccl"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown step 'nccl'" in proc.stderr and "gpu_tests, fused" in proc.stderr


# A stand-in for `python`: says CUDA is there, plays every step (tests pass, fused and end_to_end write their reports,
# onebit fails, cuda_memory hangs), and runs the real summary.
_STUB = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    out=""
    prev=""
    for a in "$@"; do
        [[ "$prev" == "--out" ]] && out="$a"
        [[ "$a" == --junitxml=* ]] && out="${a#--junitxml=}"
        prev="$a"
    done
    case "$*" in
        *torch.cuda.is_available*) exit 0 ;;
        *_gpu_suite.py*) exec "REAL_PYTHON" "$@" ;;
        *"-m pytest"*)
            echo '<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/></testsuites>' >"$out"
            exit 0 ;;
        *fused.py*)
            echo '{"benchmark": "fused_cuda", "ratios": {"fused_vs_eager_step": 1.37}}' >"$out"
            exit 0 ;;
        *end_to_end.py*)
            echo '{"benchmark": "end_to_end_cuda", "ratios": {"epoch_time_plain_over_accel": 2.5}}' >"$out"
            exit 0 ;;
        *onebit.py*) echo "RuntimeError: NCCL error in the stand-in" >&2; exit 1 ;;
        *cuda_memory.py*) exec sleep 120 ;;
        *) echo "unexpected: $*" >&2; exit 9 ;;
    esac
    """
)


def _stub(tmp_path: Path) -> Path:
    stub = tmp_path / "python"
    stub.write_text(_STUB.replace("REAL_PYTHON", sys.executable))
    stub.chmod(0o755)
    return stub


@needs_bash
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_steps_fail_time_out_and_skip_independently_and_are_summarised(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": str(_stub(tmp_path))}
    # budget 7 s: the first three steps return at once, cuda_memory hangs and is killed when the budget is spent,
    # augment and end_to_end no longer fit
    proc = subprocess.run(
        ["bash", str(SUITE), "--out", str(out), "--budget", "7"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    status = {s["name"]: (s["status"], s["rc"]) for s in doc["steps"]}
    assert status == {
        "gpu_tests": ("passed", 0),
        "fused": ("passed", 0),
        "onebit": ("failed", 1),
        "cuda_memory": ("timed_out", 124),
        "augment": ("skipped", None),
        "end_to_end": ("skipped", None),
    }
    assert doc["ok"] is False and doc["budget_s"] == 7
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["gpu_tests"]["tests"] == {"tests": 5, "passed": 4, "failed": 0, "errors": 0, "skipped": 1}
    assert steps["fused"]["ratios"] == {"fused_vs_eager_step": 1.37}
    assert any("NCCL error in the stand-in" in line for line in steps["onebit"]["log_tail"])
    md = (out / "summary.md").read_text()
    assert "NOT all steps passed" in md and "| onebit | failed | 1 |" in md and "| fused_vs_eager_step | 1.37 |" in md
    assert "4 passed, 0 failed, 0 errors, 1 skipped" in md and "NCCL error in the stand-in" in md
    assert md in proc.stdout  # the summary is also printed


@needs_bash
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_only_reruns_the_named_steps(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": str(_stub(tmp_path))}
    proc = subprocess.run(
        ["bash", str(SUITE), "--out", str(out), "--only", "fused,gpu_tests"], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in doc["steps"]] == ["gpu_tests", "fused"] and doc["ok"] is True
    # the fused step's arguments parse, and its own budget ends well before the step's limit
    from benchmarks.fused import parse_args

    fused = doc["steps"][1]
    args = parse_args(fused["command"].split()[2:])
    assert args.device == "cuda" and args.quick and args.budget_s is not None
    assert args.budget_s + 60 <= fused["limit_s"]


@needs_bash
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_end_to_end_step_runs_the_cuda_comparison_within_its_limit(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": str(_stub(tmp_path))}
    proc = subprocess.run(
        ["bash", str(SUITE), "--out", str(out), "--only", "end_to_end"], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (step,) = json.loads((out / "summary.json").read_text())["steps"]
    assert step["name"] == "end_to_end" and step["ratios"] == {"epoch_time_plain_over_accel": 2.5}
    assert step["limit_s"] <= 180  # the case's share of the suite's budget
    from benchmarks.end_to_end import parse_args

    args = parse_args(step["command"].split()[2:])
    assert args.device == "cuda" and not args.dry_run and args.out == out / "end_to_end.json"


def test_end_to_end_cuda_path_dry_runs_on_the_cpu(tmp_path: Path) -> None:
    """The GPU case's set-up without a GPU: photos rendered, decode costs measured, both arms' Trainers built."""
    env = {**os.environ, "E2E_ROOT": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "end_to_end.py"), "--device", "cuda", "--dry-run"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    import ast

    doc = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert doc["plain"]["checkpoint_io"] == "TorchCheckpointIO" and doc["plain"]["data"] == "PlainPhotos"
    assert doc["accel"]["precision"] == "FusedPrecision" and doc["accel"]["checkpoint_io"] == "DeltaCheckpointIO"
    assert "device='cuda'" in doc["accel"]["decode"] and "size=160" in doc["accel"]["augment"]
    assert doc["job"]["photo_384px_kb"] >= 30 and doc["job"]["photo_384px_decode_ms"] > 0
    assert not any(tmp_path.glob("plain*/ckpt/*")) and not any(tmp_path.glob("accel*/ckpt/*"))  # nothing trained
