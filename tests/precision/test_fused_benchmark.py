"""``benchmarks/fused.py``'s CUDA part without a GPU: its arguments, and its code run end to end on the CPU
(``--dry-run``), so the first run on a GPU finds no Python error in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_arguments() -> None:
    from benchmarks.fused import ZOO_MODELS, parse_args

    args = parse_args(["--device", "cuda", "--quick", "--budget-s", "150", "--zoo", "vit,gpt2_blocks"])
    assert args.budget_s == 150.0 and args.zoo == ("vit", "gpt2_blocks") and not args.dry_run
    assert parse_args([]).zoo == ZOO_MODELS and parse_args([]).budget_s is None
    for bad in (["--budget-s", "0"], ["--zoo", "vit,alexnet"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as info:
            parse_args(bad)
        assert info.value.code == 2


def test_budget_skips_instead_of_overrunning() -> None:
    import torch

    from benchmarks.fused import cuda_models

    results, ratios = cuda_models(True, torch.device("cpu"), budget_s=0.001, dry_run=True, zoo=("gpt2_blocks",))
    variants = [v for name, res in results.items() if isinstance(res, dict) for v in res.values()]
    assert variants and all("time budget" in v.get("skipped", "") for v in variants)
    assert ratios == {}


@pytest.mark.slow
def test_dry_run_writes_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "fused_cuda.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/fused.py", "--device", "cuda", "--dry-run", "--zoo", "gpt2_blocks,vit"]
    proc = subprocess.run(
        [*cmd, "--budget-s", "400", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "fused_cuda"
    runs = doc["results"]["cuda_bf16_dry_run"]
    assert set(runs["resnet50"]) == {"eager", "fused", "fused_compile", "compile"}
    assert set(runs["zoo_vit"]) == {"eager", "fused", "compile"}
    for name in ("resnet50", "gpt_blocks", "zoo_gpt2_blocks", "zoo_vit"):
        for variant, res in runs[name].items():
            assert "step_ms" in res, (name, variant, res)  # measured: no error, nothing skipped at this budget
    assert {"dry_run_fused_vs_eager_step", "dry_run_zoo_vit_fused_vs_compile_step"} <= set(doc["ratios"])
    assert not (REPO / "docs" / "img" / "fused_cuda.png").exists() or "fused_cuda.png" not in proc.stdout
