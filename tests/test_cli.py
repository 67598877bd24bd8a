from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback

from lightning_accel.cli import main

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "configs" / "quickstart.yaml"


def _tiny(digits_dir: Path, root: Path) -> list[str]:
    return [
        "--config",
        str(QUICKSTART),
        f"--trainer.default_root_dir={root}",
        f"--trainer.callbacks.init_args.dirpath={root}/checkpoints",  # the ModelCheckpoint, last in the list
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",
        f"--data.origin={digits_dir}",
        "--data.digits_size=null",  # the 32 px digits of `digits_dir` already exist: render nothing
        f"--data.cache_dir={root}/cache",
        f"--data.ram_dir={root}/ram",
        "--data.image_size=32",
        "--data.num_workers=0",
        "--model.init_args.width=8",
    ]


def test_fit_with_overrides_writes_metrics_csv(digits_dir: Path, tmp_path: Path) -> None:
    main(["fit", *_tiny(digits_dir, tmp_path / "run")])
    csvs = list((tmp_path / "run").rglob("metrics.csv"))
    assert len(csvs) == 1
    header = csvs[0].read_text().splitlines()[0]
    assert "val_acc" in header and "train_loss" in header
    # The quickstart saves DeltaCheckpointIO manifests; `validate --ckpt_path` must read them (LightningCLI itself
    # would torch.load the file to find hyper-parameters, and fail on a JSON manifest).
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.read_bytes()[:1] == b"{"
    argv = [a for a in _tiny(digits_dir, tmp_path / "val") if "limit_train" not in a and "max_epochs" not in a]
    main(["validate", *argv, f"--ckpt_path={ckpt}"])
    assert list((tmp_path / "val").rglob("metrics.csv"))


def test_validate_subcommand(digits_dir: Path, tmp_path: Path) -> None:
    main(
        [
            "validate",
            *[a for a in _tiny(digits_dir, tmp_path / "v") if "limit_train" not in a and "max_epochs" not in a],
        ]
    )
    assert list((tmp_path / "v").rglob("metrics.csv"))


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_missing_config_is_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _error(["fit", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert "`--config`" in err and "nope.yaml" in err and "does not exist" in err


def test_unknown_class_path(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(["fit", "--config", str(QUICKSTART), "--model.class_path=no_such_pkg.Model"], capsys)
    assert "no_such_pkg.Model" in err and "model" in err


def test_unwritable_data_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    argv = [
        "fit",
        "--config",
        str(QUICKSTART),
        f"--data.origin={blocker}/digits",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    err = _error(argv, capsys)
    assert "Cannot write the digits" in err and str(blocker) in err and "writable directory" in err


@pytest.mark.skipif(shutil.which("lightning-accel") is None, reason="console script not installed")
def test_console_script_help() -> None:
    out = subprocess.run(["lightning-accel", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "fit" in out.stdout and "predict" in out.stdout
    usage = " ".join(out.stdout.split("\n\n")[0].split())
    assert usage == "usage: lightning-accel [-c CONFIG] {fit,validate,test,predict,ckpt,data,tune} ..."
    text = " ".join(out.stdout.split())
    assert "ckpt checks, exports" in text and "data packs an origin" in text and "tune measures" in text


def test_module_entry_point_reports_bad_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_accel.cli", "bogus"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "'bogus' is not a subcommand" in out.stderr and "ckpt, data or tune" in out.stderr


def test_config_is_saved_beside_the_logs_never_in_the_working_directory(
    digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    # no logger and no default_root_dir: Lightning's own callback would write ./config.yaml
    argv = [a for a in _tiny(digits_dir, tmp_path / "nolog") if not a.startswith("--trainer.default_root_dir")]
    main(["fit", *argv, "--trainer.logger=false"])
    assert not (cwd / "config.yaml").exists()
    main(["fit", *_tiny(digits_dir, tmp_path / "logged")])  # with the default CSV logger: beside metrics.csv
    (saved,) = (tmp_path / "logged").rglob("config.yaml")
    assert (saved.parent / "metrics.csv").exists()
    assert not (cwd / "config.yaml").exists()


def _epoch_rows(root: Path, version: int) -> dict[int, dict[str, str]]:
    import csv

    (path,) = (root / "lightning_logs" / f"version_{version}").glob("metrics.csv")
    rows = [r for r in csv.DictReader(path.read_text().splitlines()) if r.get("val_acc")]
    return {int(r["epoch"]): r for r in rows}


class StopAfter(Callback):
    """Ends the fit after ``epochs`` epochs, as if the job were stopped (the schedule still plans ``max_epochs``)."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def test_resume_from_last_continues_like_an_uninterrupted_run(digits_dir: Path, tmp_path: Path) -> None:
    """The quickstart config as shipped: 2 of 3 epochs, then `fit --ckpt_path last` == 3 epochs in one go."""
    main(["fit", *_tiny(digits_dir, tmp_path / "a"), "--trainer.max_epochs=3"])
    stop = ["--trainer.callbacks+=tests.test_cli.StopAfter", "--trainer.callbacks.init_args.epochs=2"]
    main(["fit", *_tiny(digits_dir, tmp_path / "b"), "--trainer.max_epochs=3", *stop])
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").is_file()
    main(["fit", *_tiny(digits_dir, tmp_path / "b"), "--trainer.max_epochs=3", "--ckpt_path=last"])
    whole, resumed = _epoch_rows(tmp_path / "a", 0), _epoch_rows(tmp_path / "b", 1)
    assert sorted(resumed) == [2]  # the resumed fit ran epoch 2 only, from the saved step
    assert resumed[2]["step"] == whole[2]["step"]
    for key in ("val_acc", "val_loss"):
        assert float(resumed[2][key]) == pytest.approx(float(whole[2][key]), abs=1e-6), key


def test_a_logger_with_a_fixed_version_keeps_each_runs_config(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fit` then `validate` into one log directory (a fixed logger `version`, as a resume keeps its logs together):
    the second run used to stop with Lightning's `expected .../config.yaml to NOT exist` traceback."""
    root = tmp_path / "run"
    logger = ["--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={root}", "--trainer.logger.version=v1"]
    main(["fit", *_tiny(digits_dir, root), *logger, "--trainer.max_epochs=1", "--trainer.limit_train_batches=1"])
    log_dir = root / "lightning_logs" / "v1"
    first = (log_dir / "config.yaml").read_text()
    capsys.readouterr()
    main(["validate", *_tiny(digits_dir, root), *logger, "--trainer.limit_val_batches=1"])
    assert (log_dir / "config.yaml").read_text() == first  # the fit's record is kept
    assert "limit_val_batches: 2" in first and "limit_val_batches: 1" in (log_dir / "config_1.yaml").read_text()
    assert f"{log_dir} holds config.yaml of an earlier run (kept)" in capsys.readouterr().err


ALL_PLUGINS = REPO / "examples" / "configs" / "all_plugins.yaml"
_PLUGINS = "--trainer.plugins=[{class_path: lightning_accel.%s, init_args: {%s}}]"


@pytest.mark.parametrize(
    ("arg", "key", "words"),
    [
        (_PLUGINS % ("FusedPrecision", "precision: bf8-mixed"), "trainer.plugins.precision", ["bf8-mixed"]),
        (_PLUGINS % ("FusedPrecision", "fusions: [conv_bn_gelu]"), "trainer.plugins", ["fusions", "conv_bn_gelu"]),
        (_PLUGINS % ("DeltaCheckpointIO", "quantize: int3"), "trainer.plugins.quantize", ["int3"]),
        ("--trainer.strategy.init_args.block_size=-1", "trainer.strategy", ["block_size", "-1"]),
        ("--data.init_args.ram_bytes=64XB", "data", ["ram_bytes", "64XB"]),
    ],
    ids=["precision", "fusions", "quantize", "block_size", "ram_bytes"],
)
def test_bad_value_is_one_line_with_its_key(
    arg: str, key: str, words: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = _error(["fit", "--config", str(ALL_PLUGINS), arg, f"--trainer.default_root_dir={tmp_path}"], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning-accel: error:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lightning-accel: error: {key}: "), lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    assert "Subtypes" not in err and "Namespace(" not in err and len(lines[0]) < 400


def test_debug_shows_the_full_text(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LIGHTNING_ACCEL_DEBUG", "1")
    with pytest.raises(ValueError) as exc:
        main(["fit", "--config", str(ALL_PLUGINS), "--trainer.strategy.init_args.block_size=-1"])
    assert "block_size" in str(exc.value)
    assert "Subtypes" in capsys.readouterr().err  # jsonargparse's whole dump


def test_origin_without_credentials_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    argv = [
        "fit",
        "--config",
        str(QUICKSTART),
        "--data.class_path=lightning_accel.data.CachedDataModule",
        "--data.init_args.origin=s3://no-such-bucket-lightning-accel/train",
        f"--data.init_args.cache_dir={tmp_path}/cache",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path}/ckpt",
        "--trainer.logger=false",
    ]
    err = _error(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning-accel: error:")]
    assert len(lines) == 1 and lines[0].startswith("lightning-accel: error: data: "), err
    assert "s3://no-such-bucket-lightning-accel/train" in lines[0]


def test_tune_help_is_plain_text() -> None:
    from lightning_accel.tune.cli import build_parser, plain_help

    text = build_parser().format_help()
    assert "``" not in text and ":func:" not in text, text
    assert "(see lightning_accel.tune.tune_job)" in " ".join(text.split())
    assert plain_help("a ``b``\n:class:`~x.Y` and :mod:`z`") == "a `b` x.Y and z"


def test_a_bare_class_name_is_saved_by_its_current_import_path(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    # once the demo is imported, jsonargparse resolves `--model=ImageClassifier` to the shortest path reaching the
    # class, the deprecated alias `lightning_accel.ImageClassifier`: the saved config.yaml named it, and reloading it
    # (or any config naming the class) warned about the alias
    import lightning_accel.datasets
    import lightning_accel.models  # noqa: F401 - the demo imported, as in a script or an earlier run in the process
    from lightning_accel.cli import AccelCLI

    monkeypatch.setattr("sys.argv", ["lightning-accel"])
    warnings.simplefilter("always", DeprecationWarning)
    cli = AccelCLI(args=["--model=ImageClassifier", "--data=DigitsDataModule", "--trainer.logger=false"], run=False)
    assert cli.config["model"]["class_path"] == "lightning_accel.models.ImageClassifier"
    assert cli.config["data"]["class_path"] == "lightning_accel.datasets.DigitsDataModule"
    saved = cli.parser.dump(cli.config, skip_none=False)  # what SaveConfigCallback writes
    assert "class_path: lightning_accel.models.ImageClassifier" in saved
    assert "class_path: lightning_accel.datasets.DigitsDataModule" in saved
    alias_warnings = [str(w.message) for w in recwarn if "`lightning_accel." in str(w.message)]
    assert not alias_warnings


def test_print_config_names_a_bare_class_by_its_current_import_path(capsys: pytest.CaptureFixture[str]) -> None:
    # `--print_config` dumps the config straight from the parse: it printed the alias `lightning_accel.ImageClassifier`
    import lightning_accel.datasets
    import lightning_accel.models  # noqa: F401 - the demo imported, as in a script or an earlier run in the process

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--model=ImageClassifier", "--data=DigitsDataModule", "--print_config"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: lightning_accel.models.ImageClassifier" in out
    assert "class_path: lightning_accel.datasets.DigitsDataModule" in out
