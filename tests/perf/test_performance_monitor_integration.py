"""PerformanceMonitor inside a real Trainer, timed by a virtual clock that the data and the model advance."""

from __future__ import annotations

import csv
import json
import time
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
    assert max(shares, key=shares.__getitem__) == "data"
    trainer, mon, _ = fit(tmp_path / "b", decode_s=0.0, compute_s=0.005, report_path="")
    assert mon.report is not None and mon.report.seconds["data"] == 0.0
    shares = {k: v for k, v in mon.report.seconds.items() if k != "eval"}
    assert max(shares, key=shares.__getitem__) == "compute"


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


class Interrupt(Callback):
    """Stops the fit after ``at`` training batches, as Ctrl+C does (or with ``error``)."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at, self.error = at, error

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx + 1 == self.at:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")])
def test_an_interrupted_fit_still_writes_the_report_of_what_was_measured(tmp_path: Path, error: BaseException) -> None:
    """A long run stopped with Ctrl+C (Lightning then exits) or by an exception wrote no report at all."""
    mon = PerformanceMonitor(log_every_n_steps=4, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=20, limit_val_batches=0, default_root_dir=tmp_path, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[mon, Interrupt(8, error)],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError):
        trainer.fit(TimedModule(), train)
    r = mon.report
    assert r is not None and r.steps == 6  # 8 batches ran, 2 of them warm-up
    assert r.extras["interrupted"] == type(error).__name__ and r.flops_per_step == 256
    assert trainer.log_dir is not None
    written = json.loads((Path(trainer.log_dir) / "perf_report.json").read_text())
    assert written["steps"] == 6 and written["extras"]["interrupted"] == type(error).__name__
    assert "save_checkpoint" not in trainer.__dict__


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
        ({"peak_flops": float("inf")}, ValueError, "^`peak_flops` must be a finite number > 0 or None, got inf"),
        # a plain function or a typo failed only at the first training batch, with an AttributeError
        (
            {"clock": time.perf_counter},
            TypeError,
            r"^`clock` must be a clock with `mark\(\)` and `elapsed\(start, end\)` .*got <built-in function "
            r"perf_counter> \(builtin_function_or_method\)\. Wrap .* `clock=HostClock\(fn\)`\.$",
        ),
        ({"span_clock": "host"}, TypeError, r"^`span_clock` must be a clock .* got 'host' \(str\)\.$"),
        # a directory's spelling: the report landed as a file named like the directory, and the picture beside it
        # (`runs/.png`) failed with FileExistsError after the whole fit
        (
            {"report_path": "runs/"},
            ValueError,
            r"^`report_path` must name a file, got 'runs/', which names a directory\. .*'runs/perf_report\.json'",
        ),
        ({"report_path": "memory://bucket/"}, ValueError, "e\\.g\\. 'memory://bucket/perf_report\\.json'"),
        ({"report_path": "."}, ValueError, "`report_path` must name a file, got '\\.'"),
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


def test_report_url_nothing_can_write_fails_in_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt scheme, or one whose fsspec package is missing, failed only when the report was written, after the
    whole fit."""
    pytest.importorskip("fsspec")
    from fsspec.registry import known_implementations

    with pytest.raises(ValueError, match=r"^`report_path` must be a local path or an fsspec URL, got 'se://b/r\.json'"):
        PerformanceMonitor(report_path="se://b/r.json")
    entry = {"class": "lightning_accel_absent_fs.FS", "err": "Install lightning-accel-absent-fs"}
    monkeypatch.setitem(known_implementations, "absentfs", entry)
    with pytest.raises(
        ImportError, match=r"^`report_path` is 'absentfs://b/r\.json', whose scheme `absentfs://` needs"
    ):
        PerformanceMonitor(report_path="absentfs://b/r.json")
    with pytest.raises(ImportError, match="`absentfs://` needs a package"):
        PerformanceMonitor(report_path="simplecache::absentfs://b/r.json")
    assert (
        PerformanceMonitor(report_path="simplecache::memory://b/r.json").report_path == "simplecache::memory://b/r.json"
    )


@pytest.mark.parametrize("under", ["runs", "runs/deeper/still"])
def test_report_path_under_a_file_fails_in_init(tmp_path: Path, under: str) -> None:
    """`runs` a file, `runs/perf_report.json` the report: the fit ran to its end and then failed writing it."""
    (tmp_path / "runs").write_text("a file of the user's")
    path = str(tmp_path / under / "r.json")
    with pytest.raises(
        ValueError, match=rf"^`report_path` must be a path under a directory, got '{path}', but '.*runs'"
    ):
        PerformanceMonitor(report_path=path)
    with pytest.raises(ValueError, match="is a file, not a directory"):
        PerformanceMonitor(report_path="file://" + path)
    assert (tmp_path / "runs").read_text() == "a file of the user's"


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


class TwoOptimizers(TimedModule):
    """Manual optimization with two optimizers (SGD with momentum, AdamW): `trainer.global_step` moves by 2 a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(8, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for opt, layer in zip(self.optimizers(), (self.lin, self.other), strict=True):
            loss = torch.nn.functional.cross_entropy(layer(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss)
        return loss.detach()  # under manual optimization Lightning only passes it on to the batch-end hooks

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.lin.parameters(), lr=0.1, momentum=0.9),
            torch.optim.AdamW(self.other.parameters(), lr=1e-2),
        )


def _csv_steps(path: Path, column: str) -> list[int]:
    with open(path, newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get(column)]


def test_perf_and_memory_metrics_share_lightning_step_axis(tmp_path: Path) -> None:
    """`perf/*` and `mem/*` go on the step axis of the run's own `self.log` metrics (Lightning's batches that stepped,
    as LearningRateMonitor uses), not `trainer.global_step`: with two optimizers that counts 2 a batch, and it is one
    ahead at `on_train_batch_end`, so the monitor's lines were drawn at 8, 12, 16 beside a loss at 1, 3, 5, 7."""
    from lightning_accel.callbacks import CudaMemoryManager

    logger = CSVLogger(tmp_path, name="logs")
    mon = PerformanceMonitor(log_every_n_steps=2, skip_steps=1, count_flops=False, report_path="", verbose=False)
    mem = CudaMemoryManager(log_every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=8, log_every_n_steps=2, logger=logger,
        callbacks=[mon, mem], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    trainer.fit(TwoOptimizers(), train)
    assert trainer.global_step == 16
    metrics = Path(logger.log_dir) / "metrics.csv"
    loss = _csv_steps(metrics, "train_loss")
    assert loss == [1, 3, 5, 7]
    assert _csv_steps(metrics, "perf/step_s") == loss  # a window every 2 batches, beside the loss
    if not torch.cuda.is_available():
        assert _csv_steps(metrics, "mem/host_rss_gb") == loss
    assert _csv_steps(metrics, "perf/report/step_s") == [8]  # the summary: after the last of the 8 batches


class LoggedLoss(TimedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_perf_windows_land_on_the_loss_rows_after_a_resume_and_with_accumulation(tmp_path: Path) -> None:
    """Windows were counted in batches from the start of each fit: a fit resumed at step 6 logged at 9 and 13
    beside a loss at 7 and 11, and with 2 batches a step at 1, 3, 5, 7 beside a loss at 3 and 7."""

    def run(max_steps: int, **kw: Any) -> tuple[pl.Trainer, list[int], list[int]]:
        mon = PerformanceMonitor(log_every_n_steps=4, skip_steps=1, count_flops=False, report_path="", verbose=False)
        logger = CSVLogger(tmp_path, name="logs")
        ckpt_path = kw.pop("ckpt_path", None)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=max_steps, limit_val_batches=0, log_every_n_steps=4, logger=logger,
            callbacks=[mon], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw,
        )  # fmt: skip
        train, _ = loaders(None, 0.0)
        trainer.fit(LoggedLoss(), train, ckpt_path=ckpt_path)
        metrics = Path(logger.log_dir) / "metrics.csv"
        return trainer, sorted(set(_csv_steps(metrics, "train_loss"))), sorted(set(_csv_steps(metrics, "perf/step_s")))

    first, loss, perf = run(6)
    assert loss == [3] and perf == [3, 6]  # and the last, shorter window at the end of the fit
    ckpt = tmp_path / "six.ckpt"
    first.save_checkpoint(ckpt)
    _, loss, perf = run(14, ckpt_path=str(ckpt))
    assert loss == [7, 11] and perf == [7, 11, 14]
    _, loss, perf = run(8, accumulate_grad_batches=2)
    assert loss == [3, 7] and perf == [3, 7]


class TwoLayers(TimedModule):
    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.pre(x))


def test_each_fit_and_each_resume_counts_its_own_flops(tmp_path: Path) -> None:
    """A monitor reused for a second fit reported the first model's FLOPs (and MFU); a fit resumed from a checkpoint
    reported the count of the fit that saved it, although it ran another batch size (its MFU was off by that ratio)."""
    mon = PerformanceMonitor(verbose=False, report_path="")
    _quick_fit(mon)
    assert mon.report is not None and mon.report.flops_per_step == 256  # Linear(8, 2), batch 4: 2 x 2 x 4 x 8 x 2
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=6, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[mon],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    trainer.fit(TwoLayers(), train)
    # + Linear(8, 8): forward 2 x 4 x 8 x 8 = 512, weight grad 512; and the grad of its output through Linear(8, 2)
    assert mon.report is not None and mon.report.flops_per_step == 256 + 128 + 2 * 512
    ckpt = tmp_path / "one.ckpt"
    trainer.save_checkpoint(ckpt)
    older = tmp_path / "older.ckpt"  # what an earlier version wrote: the saving fit's count
    state = torch.load(ckpt, weights_only=False)
    state["callbacks"]["PerformanceMonitor"] = {"flops_per_step": 256 + 128 + 2 * 512}
    torch.save(state, older)
    wide, _ = loaders(None, 0.0, batch_size=8)  # the resumed fit runs twice the batch: twice the FLOPs per step
    for path in (ckpt, older):
        resumed = PerformanceMonitor(verbose=False, report_path="")
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, limit_train_batches=6, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[resumed],
        )  # fmt: skip
        trainer.fit(TwoLayers(), wide, ckpt_path=str(path))
        assert resumed.report is not None and resumed.report.flops_per_step == 2 * (256 + 128 + 2 * 512), path.name


def test_a_crash_inside_the_counted_step_keeps_no_partial_count(tmp_path: Path) -> None:
    """An exception inside the FLOP-counted step (an OOM in backward) left the forward's FLOPs as the step's count,
    and `OnExceptionCheckpoint` saved that half count into the checkpoint; no count goes into a checkpoint now."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    mon = PerformanceMonitor(report_path="", verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=5, logger=False, limit_val_batches=0, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[mon, OnExceptionCheckpoint(tmp_path, "crash")],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(CrashAfterForward(), train)
    assert mon._flops.flops is None and not mon._flops.active
    assert "PerformanceMonitor" not in torch.load(tmp_path / "crash.ckpt", weights_only=False)["callbacks"]


class CrashAfterForward(TimedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1:  # the FLOP-counted step, after its forward
            raise RuntimeError("boom")
        return loss


class Starve(Callback):
    """Every gap before a batch takes ``s`` virtual seconds (listed before the monitor: its clock reads after)."""

    def __init__(self, vt: VirtualTime, s: float) -> None:
        self.vt, self.s = vt, s

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.vt.advance(self.s)


def _verdict(tmp_path: Path, model: pl.LightningModule, vt: VirtualTime, starve_s: float, **fit_kw: Any) -> str:
    mon = PerformanceMonitor(
        clock=HostClock(vt), span_clock=HostClock(vt), count_flops=False, report_path="", verbose=False
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=5, limit_val_batches=0, logger=False,
        default_root_dir=tmp_path, callbacks=[Starve(vt, starve_s), mon], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, **fit_kw)
    assert mon.report is not None
    return mon.report.verdict


def test_data_advice_leaves_out_the_cached_data_module_in_use_and_gpu_work_on_a_cpu_run(tmp_path: Path) -> None:
    """A data-bound CPU run reading through CachedDataModule was told to use CachedDataModule and to move its
    augmentation to the GPU (it already augments on the device, and there is no GPU); a plain loader on the CPU is
    still pointed at CachedDataModule and num_workers, without the GPU."""
    from lightning_accel.datasets import DigitsCachedDataModule

    vt = VirtualTime()
    dm = DigitsCachedDataModule(
        str(tmp_path / "digits"), digits_size=8, num_images=40, image_size=8, batch_size=8, num_workers=0,
        cache_dir=str(tmp_path / "cache"), ram_bytes=0, val_fraction=0.2, mean=(0.5,) * 3, std=(0.5,) * 3,
    )  # fmt: skip

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3 * 8 * 8, 10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            vt.advance(0.01)
            return torch.nn.functional.cross_entropy(self.lin(x.flatten(1)), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cached = _verdict(tmp_path, Digits(), vt, 0.1, datamodule=dm)
    assert "already read through CachedDataModule" in cached and "num_workers (now 0)" in cached
    assert "use CachedDataModule" not in cached and "GPU" not in cached
    vt = VirtualTime()
    train, _ = loaders(vt, 0.0)
    plain = _verdict(tmp_path, TimedModule(vt, compute_s=0.01), vt, 0.1, train_dataloaders=train)
    assert "use CachedDataModule" in plain and "raise num_workers (now 0)" in plain and "GPU" not in plain


def test_compute_advice_leaves_out_torch_compile_for_a_compiled_model(tmp_path: Path) -> None:
    """`trainer.fit(torch.compile(model))` was still advised torch.compile; so were a compiled submodule and
    `nn.Module.compile()` (the eager backend: compiled, without a C++ toolchain)."""
    vt = VirtualTime()
    train, _ = loaders(vt, 0.0)
    plain = _verdict(tmp_path, TimedModule(vt, compute_s=0.05), vt, 0.0, train_dataloaders=train)
    assert "torch.compile" in plain
    compiled = torch.compile(TimedModule(vt, compute_s=0.05), backend="eager")
    verdict = _verdict(tmp_path, compiled, vt, 0.0, train_dataloaders=train)  # type: ignore[arg-type]
    assert "of step time is compute" in verdict and "torch.compile" not in verdict
    assert "a larger batch per device" in verdict

    from lightning_accel.perf.callbacks import _is_compiled

    inner = TimedModule()
    inner.lin = torch.compile(inner.lin, backend="eager")  # type: ignore[assignment]
    in_place = TimedModule()
    in_place.compile(backend="eager")
    assert _is_compiled(inner) and _is_compiled(in_place) and not _is_compiled(TimedModule())


def test_ddp_timing_is_asked_of_each_fits_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request that DDP time its allreduce went to the first fit's module only: a later fit of the same monitor
    (or a model wrapped again) kept DDP's default sampling, and a later single-device fit still reported its comm
    as measured by DDP's runtime stats."""
    from lightning_accel._utils import compat

    asked: list[int] = []
    real = compat.set_ddp_runtime_logging_sample_rate

    def pretend_ddp(model: Any, rate: int) -> bool:  # every model answers as a DDP module would
        asked.append(id(model))
        return True

    mon = PerformanceMonitor(skip_steps=1, count_flops=False, report_path="", verbose=False)
    monkeypatch.setattr(compat, "set_ddp_runtime_logging_sample_rate", pretend_ddp)
    first = _quick_fit(mon)
    second = _quick_fit(mon)
    assert asked and set(asked) == {id(first.strategy.model), id(second.strategy.model)}
    assert len(asked) == 2  # once per module, not at every flush
    assert mon.report is not None and "comm_source" in mon.report.extras
    monkeypatch.setattr(compat, "set_ddp_runtime_logging_sample_rate", real)
    _quick_fit(mon)  # a single-device model: not DDP
    assert mon.report is not None and "comm_source" not in mon.report.extras


def test_a_leading_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`report_path="~/runs/r.json"` (a YAML config does not expand it) wrote into a folder named `~` in the working
    directory; it is the home directory, as for Lightning's checkpoint `dirpath`. The same for OOM snapshots."""
    from lightning_accel.callbacks import CudaMemoryManager

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path="~/runs/r.json")
    assert mon.report_path == str(tmp_path / "home" / "runs" / "r.json")
    _quick_fit(mon)
    assert json.loads((tmp_path / "home" / "runs" / "r.json").read_text())["steps"] == 5
    assert not (tmp_path / "~").exists()
    assert CudaMemoryManager(snapshot_dir="~/snaps").snapshot_dir == str(tmp_path / "home" / "snaps")
    assert CudaMemoryManager(snapshot_dir="s3://b/snaps").snapshot_dir == "s3://b/snaps"


def test_a_report_that_cannot_be_written_does_not_fail_the_finished_fit(tmp_path: Path) -> None:
    """The report folder was replaced by a file during the run: writing the report raised after the whole fit, so
    `trainer.fit` failed (and the trainer ended INTERRUPTED) although training had finished."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "runs"
    out.mkdir()

    class ReplaceFolder(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            out.rmdir()
            out.write_text("a file of the user's")

    mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path=str(out / "r.json"))
    with pytest.warns(UserWarning) as record:
        trainer = _quick_fit(mon, callbacks=[mon, ReplaceFolder()])
    assert trainer.state.status == "finished"
    assert mon.report is not None and mon.report.steps == 5
    lines = [str(w.message) for w in record if "could not be written" in str(w.message)]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith(f"PerformanceMonitor: the report could not be written to {str(out / 'r.json')!r} (")
    assert lines[1].startswith(f"PerformanceMonitor: the picture could not be written to {str(out / 'r.png')!r} (")
    assert out.read_text() == "a file of the user's"


class BatchCount(Callback):
    """Counts the training batches that reached the end of ``on_train_batch_end`` after the monitor's."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"samples_fn": lambda b: None}, TypeError, r"`samples_fn` must return .* got None \(NoneType\)"),
        ({"samples_fn": lambda b: b[1]}, TypeError, r"`samples_fn` must return .* got a tensor of shape \(4,\)"),
        ({"samples_fn": lambda b: -4}, ValueError, r"`samples_fn` must return .* integer >= 0, got -4"),
        ({"tokens_fn": lambda b: 2.5}, ValueError, r"`tokens_fn` must return the number of tokens .* got 2.5"),
    ],
)
def test_a_count_function_that_returns_no_count_fails_at_the_first_batch_naming_it(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """`int(None)` failed without naming the function; a negative count gave a throughput below zero, a fraction was
    truncated, both silently."""
    mon = PerformanceMonitor(report_path="", verbose=False, **kwargs)
    probe = BatchCount()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[mon, probe],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    with pytest.raises(error, match=match):
        trainer.fit(TimedModule(), train)
    assert probe.batches == 0  # the first batch stops the fit: the monitor's hook runs before this one's


def test_count_functions_may_return_numpy_tensor_and_integral_float_counts(tmp_path: Path) -> None:
    """What `int()` took before still counts: a one-element tensor, a numpy integer, a float mask's sum."""
    _, mon, _ = fit(
        tmp_path, decode_s=0.0, compute_s=0.01, report_path="",
        samples_fn=lambda b: torch.tensor(len(b[0])), tokens_fn=lambda b: float(b[0].shape[0] * 2),
    )  # fmt: skip
    r = mon.report
    assert r is not None and r.samples_per_s and r.tokens_per_s
    assert r.tokens_per_s == pytest.approx(2 * r.samples_per_s)


def test_copies_in_the_same_process_keep_a_lambda_and_only_pickling_refuses_it() -> None:
    """Pickling (what ``ddp_spawn`` does to callbacks) names the argument that cannot be pickled; ``copy.copy`` and
    ``copy.deepcopy`` in the same process keep working with a lambda, as they did."""
    import copy
    import pickle

    mon = PerformanceMonitor(report_path="", samples_fn=lambda b: 4)
    for dup in (copy.copy(mon), copy.deepcopy(mon)):
        assert dup is not mon and dup.samples_fn is mon.samples_fn and dup.report_path == ""
    with pytest.raises(pickle.PicklingError, match=r"PerformanceMonitor's `samples_fn` must be picklable, got "):
        pickle.dumps(mon)
    plain = pickle.loads(pickle.dumps(PerformanceMonitor(report_path="", log_every_n_steps=7)))
    assert plain.log_every_n_steps == 7


def test_trainer_that_logs_no_steps_gets_no_perf_or_memory_windows(tmp_path: Path) -> None:
    """`Trainer(log_every_n_steps=0)` is Lightning's "log no steps" (its own `self.log` step metrics and
    LearningRateMonitor log nothing then); the monitors read 0 as unset and logged a window every 50 steps."""
    from lightning_accel.callbacks import CudaMemoryManager

    logger = CSVLogger(tmp_path, name="logs")
    mon = PerformanceMonitor(skip_steps=1, count_flops=False, report_path="", verbose=False)
    mem = CudaMemoryManager()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=56, limit_val_batches=0, log_every_n_steps=0, logger=logger,
        callbacks=[mon, mem], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    trainer.fit(LoggedLoss(), train)
    metrics = Path(logger.log_dir) / "metrics.csv"
    assert _csv_steps(metrics, "train_loss") == []  # Lightning logged no step
    assert _csv_steps(metrics, "perf/step_s") == []
    assert _csv_steps(metrics, "mem/host_rss_gb") == [] and _csv_steps(metrics, "mem/allocated_gb") == []
    assert _csv_steps(metrics, "perf/report/step_s") == [56]  # the fit's summary, as Lightning logs epoch metrics
    r = mon.report
    assert r is not None and r.steps == 55 and [e["steps"] for e in r.epochs] == [15, 16, 16, 8]


def test_a_fit_resumed_mid_epoch_keeps_that_epochs_rest_in_its_own_row(tmp_path: Path) -> None:
    """Lightning goes on with the checkpoint's epoch without `on_train_epoch_start`: the rest of epoch 1 was put in
    epoch 2's row (27 steps), and epoch 1 was missing from the JSON and the picture."""
    train, _ = loaders(None, 0.0)  # 16 batches an epoch

    def trainer(callbacks: list[Callback], **kw: Any) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, **kw,
        )  # fmt: skip

    mon = PerformanceMonitor(skip_steps=1, count_flops=False, report_path="", verbose=False)
    # saved during the fit, after batch 4 of epoch 1 (a checkpoint saved after the fit ended resumes at epoch 2)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="mid_epoch_1", every_n_train_steps=20, save_top_k=-1)
    trainer([mon, saver], max_steps=20).fit(TimedModule(), train)
    ckpt = tmp_path / "mid_epoch_1.ckpt"
    trainer([mon], max_epochs=3, enable_checkpointing=False).fit(TimedModule(), train, ckpt_path=str(ckpt))
    r = mon.report
    assert r is not None and r.steps == 27  # epoch 1's last 12 batches and epoch 2's 16, the first one warm-up
    assert [(e["epoch"], e["steps"]) for e in r.epochs] == [(1.0, 11.0), (2.0, 16.0)]


class SlowHook(Callback):
    """A callback after the monitor whose ``on_train_batch_end`` takes ``s`` virtual seconds (e.g. a logger that
    uploads, a metric that syncs): the loop's own work, not a wait for data."""

    def __init__(self, vt: VirtualTime, s: float) -> None:
        self.vt, self.s = vt, s

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.vt.advance(self.s)


def test_a_slow_callback_after_the_monitor_is_other_not_data(tmp_path: Path) -> None:
    torch.manual_seed(0)
    vt = VirtualTime()
    mon = PerformanceMonitor(
        clock=HostClock(vt), span_clock=HostClock(vt), count_flops=False, report_path="", verbose=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=6,
        limit_val_batches=0,
        logger=False,
        callbacks=[mon, SlowHook(vt, 0.3)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train, _ = loaders(vt, decode_s=0.01)
    trainer.fit(TimedModule(vt, compute_s=0.005), train)
    r = mon.report
    assert r is not None and r.steps == 10  # 12 batches, 2 warm-up
    # every counted step's gap: 0.3 s in the slow hook, then 4 samples x 10 ms of decoding (also across the epoch
    # boundary, where the second epoch's iterator starts before its first fetch)
    assert r.seconds["other"] == pytest.approx(10 * 0.3)
    assert r.seconds["data"] == pytest.approx(10 * 0.04)
    assert r.seconds["compute"] == pytest.approx(10 * 0.005)
    assert r.dominant == "other" and "callbacks and logging" in r.verdict
    # the profiler Lightning calls is back to its own method after the fit
    assert "start" not in vars(trainer.profiler)
