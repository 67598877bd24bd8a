"""PerformanceMonitor inside a real Trainer, timed by a virtual clock that the data and the model advance."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_accel.callbacks import PerformanceMonitor
from lightning_accel.perf import HostClock
from tests.tiny import TimedModule, VirtualTime, loaders


class SlowSave(Callback):
    """Every checkpoint save takes ``s`` virtual seconds."""

    def __init__(self, vt: VirtualTime, s: float) -> None:
        self.vt, self.s, self.saves = vt, s, 0

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        self.vt.advance(self.s)
        self.saves += 1


def fit(
    tmp_path: Path,
    decode_s: float,
    compute_s: float,
    save_s: float = 0.0,
    plugins: list[Any] | None = None,
    **monitor_kw: Any,
):
    torch.manual_seed(0)
    vt = VirtualTime()
    mon = PerformanceMonitor(clock=HostClock(vt), span_clock=HostClock(vt), log_every_n_steps=4, **monitor_kw)
    slow = SlowSave(vt, save_s)
    callbacks: list[Callback] = [mon, slow]
    if save_s:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=12,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=callbacks,
        enable_checkpointing=bool(save_s),
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins,
    )
    train, val = loaders(vt, decode_s)
    trainer.fit(TimedModule(vt, compute_s=compute_s, val_s=0.5), train, val)
    return trainer, mon, slow


def test_starved_run_is_data_bound_with_exact_numbers(tmp_path: Path) -> None:
    trainer, mon, _ = fit(tmp_path, decode_s=0.010, compute_s=0.005)
    r = mon.report
    assert r is not None
    assert r.steps == 10  # 12 batches, 2 warm-up
    # 4 samples x 10 ms decode in every gap before a counted step; 5 ms of compute per step
    assert r.seconds["compute"] == pytest.approx(10 * 0.005)
    assert r.seconds["data"] == pytest.approx(10 * 0.040)
    assert r.seconds["eval"] == pytest.approx(2 * 0.5)  # end-of-epoch validation, 2 batches
    assert r.dominant == "eval"  # validation's 1 s is the biggest share here ...
    assert "limit_val_batches" in r.verdict
    assert r.samples_per_s == pytest.approx(40 / sum(r.seconds.values()))
    assert r.flops_per_step and r.flops_per_step > 0  # counted once, on the CPU too
    assert r.mfu is None  # ... and no peak FLOPs are known for a CPU
    saved = json.loads((Path(trainer.log_dir) / "perf_report.json").read_text())
    assert saved["dominant"] == "eval" and saved["steps"] == 10
    with open(Path(trainer.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    data_s = [float(row["perf/data_s"]) for row in rows if row.get("perf/data_s")]
    assert data_s and all(v == pytest.approx(0.040) for v in data_s)
    assert any(row.get("perf/report/data_frac") for row in rows)
    assert "save_checkpoint" not in trainer.__dict__  # the timing wrapper is removed at teardown
    assert trainer.save_checkpoint.__func__ is pl.Trainer.save_checkpoint  # the original method comes back


def test_verdict_data_vs_compute(tmp_path: Path) -> None:
    trainer, mon, _ = fit(tmp_path / "a", decode_s=0.010, compute_s=0.005, report_path="")
    # without validation in the picture the starved run is data-bound
    assert mon.report is not None
    shares = {k: v for k, v in mon.report.seconds.items() if k != "eval"}
    assert max(shares, key=shares.get) == "data"
    trainer, mon, _ = fit(tmp_path / "b", decode_s=0.0, compute_s=0.005, report_path="")
    assert mon.report is not None and mon.report.seconds["data"] == 0.0
    shares = {k: v for k, v in mon.report.seconds.items() if k != "eval"}
    assert max(shares, key=shares.get) == "compute"


def test_checkpoint_stall_is_attributed(tmp_path: Path) -> None:
    trainer, mon, slow = fit(tmp_path, decode_s=0.001, compute_s=0.005, save_s=0.25, report_path="")
    r = mon.report
    assert r is not None
    assert slow.saves == 2  # steps 5 and 10, both counted
    assert r.seconds["checkpoint"] == pytest.approx(2 * 0.25)
    assert r.seconds["data"] == pytest.approx(10 * 0.004)  # the saves in the gaps are not counted as data wait


def test_checkpoint_advice_leaves_out_the_checkpoint_io_in_use(tmp_path: Path) -> None:
    from lightning_accel.checkpoint import DeltaCheckpointIO

    trainer, mon, _ = fit(tmp_path, decode_s=0.001, compute_s=0.005, save_s=1.0, plugins=[DeltaCheckpointIO()])
    r = mon.report
    assert r is not None and r.dominant == "checkpoint"
    assert "already written as deltas" in r.verdict and "DeltaCheckpointIO to write less" not in r.verdict


def test_too_few_steps_warns_instead_of_crashing(tmp_path: Path) -> None:
    mon = PerformanceMonitor(skip_steps=5, report_path="")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        callbacks=[mon],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    train, _ = loaders(None, 0.0)
    with pytest.warns(UserWarning, match="no step was timed"):
        trainer.fit(TimedModule(), train)
    assert mon.report is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`skip_steps` must be an integer >= 1, got 0. With `count_flops=True`"):
        PerformanceMonitor(skip_steps=0)
    PerformanceMonitor(skip_steps=0, count_flops=False)
    with pytest.raises(TypeError, match="`skip_steps` must be an integer >= 1, got True \\(bool\\)"):
        PerformanceMonitor(skip_steps=True)
    with pytest.raises(ValueError, match="`log_every_n_steps` must be an integer >= 1 or None, got 0"):
        PerformanceMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="`peak_flops` must be a number > 0 or None, got -1.0"):
        PerformanceMonitor(peak_flops=-1.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"count_flops": "false"}, TypeError, "`count_flops` must be True or False, got 'false' \\(str\\)"),
        ({"verbose": "no"}, TypeError, "`verbose` must be True or False"),
        ({"nvml": 0}, TypeError, "`nvml` must be True or False, got 0"),
        ({"samples_fn": 5}, TypeError, "`samples_fn` must be a function `batch -> number of samples` or None, got 5"),
        ({"tokens_fn": "len"}, TypeError, "`tokens_fn` must be a function"),
        ({"report_path": 123}, TypeError, "`report_path` must be a file path or URL \\(a string\\).*got 123 \\(int\\)"),
        # the picture goes to `<report minus suffix>.png`: a .png report would be overwritten by it
        (
            {"report_path": "runs/run.PNG"},
            ValueError,
            r"^`report_path` must name the JSON report, not a \.png, got 'runs/run\.PNG'.*e\.g\. 'runs/run\.json'\.$",
        ),
    ],
)
def test_bad_arguments_fail_before_the_fit(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PerformanceMonitor(**kwargs)


def test_report_path_that_is_a_directory_fails_in_init(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="`report_path` must be a file path, got .*an existing directory. Name the file"
    ):
        PerformanceMonitor(report_path=str(tmp_path))
    assert PerformanceMonitor(report_path=tmp_path / "r.json").report_path == str(tmp_path / "r.json")


def test_report_and_picture_go_to_a_remote_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)  # a URL turned into a local path would land in here, in a folder named `memory:`
    mem = fsspec.filesystem("memory")
    root = f"/perf-{tmp_path.name}"
    try:
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=4, logger=CSVLogger(f"memory://{root}", name="logs"),
            callbacks=[PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False)], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        )  # fmt: skip
        train, _ = loaders(None, 0.0)
        trainer.fit(TimedModule(), train)
        written = {p.rsplit("/", 1)[-1] for p in mem.find(root)}
        assert {"perf_report.json", "perf_report.png"} <= written
        assert list(tmp_path.iterdir()) == []
    finally:
        mem.rm(root, recursive=True)


def test_png_beside_a_report_url_keeps_the_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    url = f"memory://perf-png-{tmp_path.name}/run/report.json"
    try:
        png = PerformanceMonitor._write_png(url, [{"epoch": 0.0, "data": 1.0, "compute": 2.0}])
        assert png == f"memory://perf-png-{tmp_path.name}/run/report.png"
        assert fsspec.filesystem("memory").exists(f"/perf-png-{tmp_path.name}/run/report.png")
        assert list(tmp_path.iterdir()) == []
    finally:
        fsspec.filesystem("memory").rm(f"/perf-png-{tmp_path.name}", recursive=True)


def test_peak_flops_gives_mfu_and_tokens_fn(tmp_path: Path) -> None:
    _, mon, _ = fit(tmp_path, decode_s=0.0, compute_s=0.01, peak_flops=1e9, tokens_fn=lambda b: 10, report_path="")
    r = mon.report
    assert r is not None and r.flops_per_step
    assert r.mfu == pytest.approx(r.flops_per_step / r.step_time_s / 1e9)
    assert r.tokens_per_s == pytest.approx(100 / sum(r.seconds.values()))


@pytest.mark.gpu
def test_real_gpu_run_uses_cuda_events_and_reports_mfu(tmp_path: Path) -> None:
    from lightning_accel.perf import CudaEventClock

    mon = PerformanceMonitor(log_every_n_steps=4, report_path="")
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, max_epochs=1, limit_train_batches=12, limit_val_batches=0,
        logger=CSVLogger(tmp_path, name="logs"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[mon],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    trainer.fit(TimedModule(), train)
    assert mon.timer is not None and isinstance(mon.timer.clock, CudaEventClock)
    r = mon.report
    assert r is not None and r.steps == 10 and r.seconds["compute"] > 0
    assert r.flops_per_step
    if r.mfu is not None:  # None only for a GPU missing from Lightning's peak-FLOPs table
        assert 0 < r.mfu < 1


class Crash(TimedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:  # inside the FLOP-counted step
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_crash_leaves_no_wrapper_and_no_dispatch_mode() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mon = PerformanceMonitor(report_path="")
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=5, logger=False, callbacks=[mon], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Crash(), train)
    assert "save_checkpoint" not in trainer.__dict__
    assert not _get_current_dispatch_mode_stack()


def _quick_fit(mon: PerformanceMonitor, **trainer_kw: Any) -> pl.Trainer:
    kw: dict[str, Any] = dict(
        accelerator="cpu", max_epochs=1, limit_train_batches=6, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[mon],
    )  # fmt: skip
    kw.update(trainer_kw)
    trainer = pl.Trainer(**kw)
    train, _ = loaders(None, 0.0)
    trainer.fit(TimedModule(), train)
    return trainer


@pytest.mark.parametrize(("accumulate", "syncs"), [(1, 10), (4, 3)])
def test_comm_is_charged_once_per_batch_that_synchronises(accumulate: int, syncs: int) -> None:
    """DDP's exposed comm is a per-allreduce figure; with gradient accumulation the micro-batches under `no_sync`
    send nothing, so only the batches that step the optimizer are charged (every batch was, and the verdict turned
    to `comm`). 12 batches, 2 warm-up: with 4 per step the counted ones step at batches 3, 7 and 11."""
    vt = VirtualTime()
    mon = PerformanceMonitor(
        clock=HostClock(vt), span_clock=HostClock(vt), log_every_n_steps=4, report_path="", count_flops=False
    )
    mon._ddp_exposed_comm = lambda trainer: 0.002  # type: ignore[method-assign]  # DDP's figure, without DDP
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=12, limit_val_batches=0, logger=False,
        accumulate_grad_batches=accumulate, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[mon],
    )  # fmt: skip
    train, _ = loaders(vt, 0.0)
    trainer.fit(TimedModule(vt, compute_s=0.01), train)
    r = mon.report
    assert r is not None and r.steps == 10
    assert r.seconds["comm"] == pytest.approx(syncs * 0.002)
    assert r.seconds["compute"] + r.seconds["comm"] == pytest.approx(10 * 0.01)  # moved out of compute, not added
    assert r.dominant == "compute"


def test_a_file_the_monitor_did_not_write_is_never_overwritten(tmp_path: Path) -> None:
    """`report_path="results"` puts the picture at `results.png`: a user's file there (or at the report's own path)
    stays as it was, with one warning naming it; the monitor's own files of an earlier run are replaced."""
    pytest.importorskip("matplotlib")
    users_png = tmp_path / "results.png"
    users_png.write_bytes(b"\x89PNG\r\n\x1a\nthe user's own plot")
    mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path=str(tmp_path / "results"))
    with pytest.warns(UserWarning, match=r"'.*results\.png' exists and is not a picture the monitor wrote"):
        _quick_fit(mon)
    assert users_png.read_bytes() == b"\x89PNG\r\n\x1a\nthe user's own plot"
    assert mon.png_path is None and json.loads((tmp_path / "results").read_text())["steps"] == 5

    users_json = tmp_path / "notes.json"
    users_json.write_text('{"my": "notes"}')
    mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path=str(users_json))
    with pytest.warns(UserWarning, match=r"'.*notes\.json' exists and is not a report the monitor wrote"):
        _quick_fit(mon)
    assert users_json.read_text() == '{"my": "notes"}'
    assert mon.png_path == str(tmp_path / "notes.png")  # nothing was there: the picture is written

    # an earlier run's report and picture (another monitor, another process) are the monitor's own: replaced
    mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path=str(tmp_path / "run.json"))
    _quick_fit(mon)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon2 = PerformanceMonitor(
            skip_steps=1, count_flops=False, verbose=False, report_path=str(tmp_path / "run.json")
        )
        _quick_fit(mon2, limit_train_batches=8)
        _quick_fit(mon2, limit_train_batches=7)  # the same instance again: its own files
    assert not [w for w in caught if "PerformanceMonitor" in str(w.message)]
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 6
    assert mon2.png_path == str(tmp_path / "run.png")
