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


def _benchmark_mains() -> dict[str, int]:
    """``{script: lines of its main()}`` for every benchmark script."""
    import ast

    out = {}
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        if path.name.startswith("_"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                out[path.name] = node.end_lineno - node.lineno + 1
    return out


def test_every_benchmark_main_reads_as_its_cases() -> None:
    mains = _benchmark_mains()
    assert {"quickstart.py", "fused.py", "onebit.py", "data_cache.py", "cuda_memory.py", "augment.py"} <= set(mains)
    long = {name: n for name, n in mains.items() if n > 50}
    assert not long, f"main() should parse arguments, call named cases and report; too long: {long}"


def test_harness_docstring_states_the_contract_itself() -> None:
    doc = _harness().__doc__
    assert "DESIGN.md" not in doc
    for term in ("--quick", "--out", '"benchmark", "quick", "machine", "config", "results", "ratios"', "docs/img/"):
        assert term in doc


def test_onebit_compressor_case_on_cpu() -> None:
    from benchmarks.onebit import compressor_bandwidth

    results, ratios = compressor_bandwidth(True, "cpu")  # the torch compressor only: Triton needs CUDA here
    assert results["numel"] == 4096 and results["torch_ms"] > 0 and results["torch_GBps"] > 0
    assert "triton_ms" not in results and ratios == {}


def test_link_choice_is_compared_with_the_fixed_configuration_of_the_lower_median() -> None:
    from benchmarks._onebit_link import _best_fixed

    # two equally fast orders: the reference is one order's fastest fit, not the fastest of all four fits
    row = {"a_step_s_runs": [0.30, 0.40], "a_step_s": 0.30, "b_step_s_runs": [0.33, 0.34], "b_step_s": 0.33}
    assert _best_fixed(row, ("a", "b")) == 0.33
    row["b_step_s_runs"] = [0.36, 0.38]
    row["b_step_s"] = 0.36
    assert _best_fixed(row, ("a", "b")) == 0.30
    # a clearly faster configuration wins whatever its single fits did
    row = {"ddp_step_s_runs": [9.1, 9.2], "ddp_step_s": 9.1}
    row.update(onebit_step_s_runs=[0.7, 0.9, 0.8], onebit_step_s=0.7)
    assert _best_fixed(row, ("ddp", "onebit")) == 0.7


def test_cuda_memory_numbers_are_medians_and_ratios_with_over_without() -> None:
    from benchmarks.cuda_memory import memory_numbers

    def run(reserved: float, frag: float, step: float) -> dict:
        return {"peak_reserved_GB": reserved, "mean_fragmentation": frag, "step_ms": step, "alloc_conf": "x:1"}

    runs = {"without": [run(4.0, 0.3, 10.0), run(6.0, 0.5, 12.0)], "with": [run(3.0, 0.1, 11.0), run(3.0, 0.1, 11.0)]}
    results, ratios = memory_numbers(runs)
    assert results["without"] == {"peak_reserved_GB": 5.0, "mean_fragmentation": 0.4, "step_ms": 11.0}
    assert ratios == {
        "peak_reserved_with_over_without": 0.6,
        "fragmentation_with_over_without": 0.25,
        "step_time_with_over_without": 1.0,
    }
    assert results["runs"] is runs and results["alloc_conf_with"] == "x:1"


def test_run_cases_keeps_results_by_name_and_merges_ratios() -> None:
    from benchmarks._harness import run_cases

    seen: list[bool] = []

    def case(name: str, value: float):
        def run(quick: bool) -> tuple[dict, dict]:
            seen.append(quick)
            return {"case": name}, {name: value}

        return run

    results, ratios = run_cases({"a": case("a", 1.0), "b": case("b", 2.0)}, True)
    assert results == {"a": {"case": "a"}, "b": {"case": "b"}}
    assert ratios == {"a": 1.0, "b": 2.0} and seen == [True, True]


BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def _run_help(name: str, style: str) -> None:
    """``python benchmarks/<name>.py --help`` (``style="script"``) or ``python -m benchmarks.<name> --help``, in this
    process: ``sys.path`` as the interpreter sets it for that style, without the checkout for a script (the script
    must add it), and none of the ``benchmarks`` modules imported yet."""
    import runpy

    script = REPO / "benchmarks" / f"{name}.py"
    rest = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    saved_path, saved_argv = sys.path[:], sys.argv[:]
    saved_modules = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] in ("benchmarks", "_harness")}
    try:
        if style == "script":
            sys.path[:] = [str(script.parent), *rest]
            sys.argv[:] = [str(script), "--help"]
            runpy.run_path(str(script), run_name="__main__")
        else:
            sys.path[:] = [str(REPO), *rest]
            sys.argv[:] = [name, "--help"]
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    finally:
        sys.path[:], sys.argv[:] = saved_path, saved_argv
        for m in [m for m in sys.modules if m.split(".")[0] in ("benchmarks", "_harness")]:
            del sys.modules[m]
        sys.modules.update(saved_modules)


@pytest.mark.parametrize("style", ["script", "module"])
@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_as_a_script_and_as_a_module(
    name: str, style: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        _run_help(name, style)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--out" in out, out


def test_a_benchmark_runs_both_ways_in_a_fresh_interpreter(tmp_path: Path) -> None:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    by_path = [sys.executable, str(REPO / "benchmarks" / "parallel.py"), "--help"]
    as_module = [sys.executable, "-m", "benchmarks.parallel", "--help"]
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd, cwd in ((by_path, tmp_path), (as_module, REPO))
    ]  # both at once: each pays the interpreter's imports
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "--quick" in out, err[-2000:]


class _Clock:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_step_clock_times_steps_after_warmup_and_leaves_out_what_is_rebased(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks._harness import StepClock

    vt = _Clock()
    monkeypatch.setattr("benchmarks._harness.time.perf_counter", vt)
    clock = StepClock(skip=1, sync=False, count=len)
    clock.on_train_start(None, None)  # type: ignore[arg-type]
    for i, step_s in enumerate((5.0, 1.0, 2.0, 3.0)):
        clock.on_train_batch_start(None, None, [0] * 4, i)  # type: ignore[arg-type]
        vt.t += step_s
        clock.on_train_batch_end(None, None, None, [0] * 4, i)  # type: ignore[arg-type]
        if i == 1:
            vt.t += 50.0  # a wait outside any step
            clock.rebase()
    assert clock.started == 100.0
    assert clock.times == [1.0, 2.0, 3.0] and clock.samples == [4, 4, 4]
    assert clock.marks == [105.0, 156.0, 158.0, 161.0]
    clock.record(0.5)
    assert clock.times[-1] == 0.5


def test_step_clock_per_epoch_and_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks._harness import StepClock

    vt = _Clock()
    monkeypatch.setattr("benchmarks._harness.time.perf_counter", vt)
    clock = StepClock(per="epoch", count=lambda b: len(b[1]))
    for epoch_s in (3.0, 2.0):
        clock.on_train_epoch_start(None, None)  # type: ignore[arg-type]
        for i in range(2):
            clock.on_train_batch_start(None, None, (None, [1, 2]), i)  # type: ignore[arg-type]
            clock.on_train_batch_end(None, None, None, (None, [1, 2]), i)  # type: ignore[arg-type]
        vt.t += epoch_s
        clock.on_train_epoch_end(None, None)  # type: ignore[arg-type]
    assert clock.times == [3.0, 2.0] and clock.samples == [4, 4] and clock.marks == [103.0, 105.0]
    with pytest.raises(ValueError, match="`per` must be"):
        StepClock(per="batch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`skip` must be"):
        StepClock(skip=True)


def test_step_clock_in_a_fit_and_the_shared_toy_models() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks._harness import StepClock
    from benchmarks._models import MLP, ConvNet, mlp
    from tests.tiny import trainer

    assert [type(m).__name__ for m in mlp(4, 8, 8, 2)] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    steps, epochs = StepClock(skip=1), StepClock(per="epoch")
    x = torch.randn(16, 4)
    trainer(max_epochs=2, callbacks=[steps, epochs]).fit(
        MLP(4, 8, 2, seed=0), DataLoader(TensorDataset(x, x[:, :2].argmax(1)), batch_size=4)
    )
    assert len(steps.marks) == 8 and len(steps.times) == 7 and all(t > 0 for t in steps.times)
    assert len(epochs.times) == 2 and sum(epochs.times) <= epochs.marks[-1] - epochs.started  # type: ignore[operator]
    first, again = (MLP(4, 8, 2, seed=0).state_dict()["net.0.weight"] for _ in range(2))
    assert torch.equal(first, again)
    assert ConvNet(4)(torch.zeros(2, 3, 8, 8)).shape == (2, 10)
