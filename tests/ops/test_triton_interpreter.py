"""Run the Triton kernel tests (``interp_kernels.py``) under ``TRITON_INTERPRET=1`` in a fresh process.

Triton reads ``TRITON_INTERPRET`` once, at import; other test modules in this process may have imported it already,
so the kernels get their own interpreter process (about 10 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel._utils.triton import triton_available

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(REPO / "tests" / "ops" / "interp_kernels.py"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter kernel tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
