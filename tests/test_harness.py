"""The test and benchmark harnesses themselves: they must fail when they should."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_in_processes

REPO = Path(__file__).resolve().parent.parent


def _allreduce(rank: int, world_size: int, base: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return float(t.item())


def _fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one broke")


def test_run_in_processes_gloo() -> None:
    assert run_in_processes(_allreduce, 2, args=(10.0,)) == [21.0, 21.0]


def test_run_in_processes_reports_a_failing_rank() -> None:
    with pytest.raises(RuntimeError, match="rank one broke"):
        run_in_processes(_fails, 2, init_process_group=False, timeout=60)


def test_s3_fixture_is_a_real_endpoint(s3_bucket: tuple[str, dict]) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    fs.pipe_file(f"{bucket}/k", b"v")
    assert fs.cat_file(f"{bucket}/k") == b"v"
    assert fs.ls(bucket) == [f"{bucket}/k"]


def _harness():
    spec = importlib.util.spec_from_file_location("_bench_harness", REPO / "benchmarks" / "_harness.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_bench_harness"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_report_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h = _harness()
    calls: list[str] = []
    times = h.alternate(
        {"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, repeats=2, warmup=1
    )
    assert calls == ["a", "b", "a", "b", "a", "b"] and times == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert h.median([3.0, 1.0, 2.0]) == 2.0 and h.ratio(1.0, 4.0) == 0.25
    doc = h.report(
        "unit", quick=True, config={"n": 1}, results={"x": {"y": 1.5}}, ratios={"r": 0.5}, out=tmp_path / "o.json"
    )
    on_disk = json.loads((tmp_path / "o.json").read_text())
    assert set(on_disk) == {"benchmark", "quick", "machine", "config", "results", "ratios"} and on_disk == json.loads(
        json.dumps(doc, default=str)
    )
    assert "| r | 0.5 |" in capsys.readouterr().out
