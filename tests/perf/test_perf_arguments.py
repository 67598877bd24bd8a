"""Arguments of the perf callbacks: refused when the callback is built, naming the argument, the value and the fix; and
the report file published whole."""

from __future__ import annotations

import pytest

from lightning_accel.perf.callbacks import CudaMemoryManager, PerformanceMonitor


@pytest.mark.parametrize("callback", [PerformanceMonitor, CudaMemoryManager])
def test_a_logging_window_of_zero_says_how_to_log_no_windows(callback: type) -> None:
    # the Trainer's own `log_every_n_steps=0` means "log no steps": the callback's 0 is refused, so the message says
    # where that setting lives
    with pytest.raises(
        ValueError,
        match=r"^`log_every_n_steps` must be an integer >= 1 or None, got 0\. Use None to follow the Trainer's "
        r"`log_every_n_steps` \(`Trainer\(log_every_n_steps=0\)` logs no windows\)",
    ):
        callback(log_every_n_steps=0)


@pytest.mark.parametrize("value", [" ", "  \t", "\n"])
def test_a_blank_report_path_is_refused(value: str) -> None:
    # a name of blanks only is a slip (an unset variable in a shell line, a YAML value cut short): the report would
    # land in the working directory under a name nobody can see, the picture beside it as ` .png`
    with pytest.raises(ValueError, match=r"^`report_path` must name a file, got '[^']*', which is blank\. .*`\"\"`"):
        PerformanceMonitor(report_path=value)


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_a_blank_snapshot_dir_is_refused_instead_of_ignored(value: str) -> None:
    # `snapshot_dir=""` went silently to the log directory: `report_path=""` means "write nothing", so `""` here
    # reads as "no snapshots", which it was not
    with pytest.raises(
        ValueError, match=r"^`snapshot_dir` must be a directory path or URL, got '[^']*', which is blank"
    ):
        CudaMemoryManager(snapshot_dir=value)


_KILLED_WRITE = r"""
import json, os, signal, sys
import lightning.pytorch as pl
from lightning_accel.callbacks import PerformanceMonitor
from tests.tiny import TimedModule, loaders

report = sys.argv[1]
mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path=report)
trainer = pl.Trainer(
    accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    default_root_dir=os.path.dirname(report), callbacks=[mon],
)
train, _ = loaders(None, 0.0)
model = TimedModule()
trainer.fit(model, train)
print(json.dumps({"steps": json.load(open(report))["steps"]}), flush=True)

def killed(*args, **kwargs):  # the process dies where the new report would take the old one's place
    os.kill(os.getpid(), signal.SIGKILL)

os.replace = killed
trainer.fit_loop.max_epochs = 2
trainer.fit(model, train)
"""


def test_a_process_killed_while_writing_the_report_leaves_the_previous_one_whole(tmp_path) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys

    report = tmp_path / "perf.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITE, str(report)], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["steps"] == 3  # 4 batches, 1 of warm-up
    assert json.loads(report.read_text())["steps"] == first["steps"]  # the first fit's report, whole


def _fit(mon: PerformanceMonitor) -> None:
    import lightning.pytorch as pl

    from tests.tiny import TimedModule, loaders

    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[mon],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    trainer.fit(TimedModule(), train)


def test_a_file_put_in_place_of_the_monitors_own_between_two_fits_is_kept(tmp_path) -> None:
    """The files a monitor wrote are its own to replace in its next fit only while they are what it wrote: a file of
    the user's put at that place since (the report moved away, notes saved under its name) is left as it is."""
    import json

    pytest.importorskip("matplotlib")
    report, png = tmp_path / "perf.json", tmp_path / "perf.png"
    mon = PerformanceMonitor(skip_steps=1, count_flops=False, verbose=False, report_path=str(report))
    _fit(mon)
    assert json.loads(report.read_text())["steps"] == 3 and mon.png_path == str(png)
    report.write_text('{"my": "notes"}')
    png.write_bytes(b"\x89PNG\r\n\x1a\nthe user's own plot")
    with pytest.warns(UserWarning, match=r"'.*perf\.json' exists and is not a report the monitor wrote") as caught:
        _fit(mon)
    assert any("perf.png' exists and is not a picture the monitor wrote" in str(w.message) for w in caught)
    assert report.read_text() == '{"my": "notes"}'
    assert png.read_bytes() == b"\x89PNG\r\n\x1a\nthe user's own plot" and mon.png_path is None
    assert mon.report is not None and mon.report.steps == 3  # the numbers are still kept

    # the monitor's own files, left as it wrote them, are replaced without a word, fit after fit
    import warnings

    report.unlink()
    png.unlink()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            _fit(mon)
    assert not [w for w in seen if "PerformanceMonitor" in str(w.message)]
    assert json.loads(report.read_text())["steps"] == 3 and mon.png_path == str(png)


def test_a_peak_without_a_flop_count_is_refused_instead_of_ignored() -> None:
    # MFU is the counted FLOPs over the peak: with `count_flops=False` a peak given would silently do nothing
    with pytest.raises(
        ValueError,
        match=r"^`peak_flops` is 1e\+12, but `count_flops=False` counts no FLOPs, so no MFU is reported: pass "
        r"`count_flops=True` for MFU, or leave `peak_flops` out\.$",
    ):
        PerformanceMonitor(count_flops=False, peak_flops=1e12)
    assert PerformanceMonitor(count_flops=True, peak_flops=1e12).peak_flops == 1e12
    assert PerformanceMonitor(count_flops=False).peak_flops is None
