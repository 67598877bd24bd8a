"""Checkpoint and resume mistakes through the real CLI: one ``lightning-accel: error:`` line, exit 2, no step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel._utils.fs import FileStore
from lightning_accel.checkpoint.lock import DirectoryLock
from lightning_accel.cli import _check_config_file, _user_line, main
from tests.test_cli import _tiny


def _edited(config: Path, yaml_edit: tuple[str, str] | None, tmp_path: Path) -> Path:
    """``config``, or a copy in ``tmp_path`` with the first occurrence of ``yaml_edit[0]`` (which must be there)
    replaced by ``yaml_edit[1]``."""
    if yaml_edit is None:
        return config
    text = config.read_text()
    assert yaml_edit[0] in text
    edited = tmp_path / "job.yaml"
    edited.write_text(text.replace(*yaml_edit, 1))
    return edited


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("lightning-accel: error:")]
    assert len(errors) == 1, err
    assert len(errors[0]) <= 400, errors[0]
    assert "Traceback" not in err
    return errors[0]


def _fit_argv(digits_dir: Path, root: Path, *extra: str) -> list[str]:
    return ["fit", *_tiny(digits_dir, root), "--trainer.logger=false", *extra]


def test_ckpt_path_of_a_text_file(digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("these are my notes, not a checkpoint\n")
    line = _one_line_error(_fit_argv(digits_dir, tmp_path / "run", f"--ckpt_path={notes}"), capsys)
    assert "ckpt_path" in line and "notes.txt" in line and "delta checkpoint manifest" in line
    assert notes.read_text() == "these are my notes, not a checkpoint\n"
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing saved


def test_ckpt_path_that_does_not_exist_is_refused_before_anything_is_built(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    built: list[str] = []

    def instantiate_classes(self: object) -> None:  # stands in for building the model, the data and the Trainer
        built.append("classes")
        raise RuntimeError("stop before building")

    monkeypatch.setattr("lightning_accel.cli.AccelCLI.instantiate_classes", instantiate_classes)
    line = _one_line_error(_fit_argv(digits_dir, tmp_path / "run", "--ckpt_path=runs/last.ckpt"), capsys)
    assert line == (
        f"lightning-accel: error: ckpt_path: 'runs/last.ckpt' does not exist (cwd: {tmp_path}); pass a checkpoint "
        "file, `--ckpt_path last` for the last checkpoint the run's ModelCheckpoint saved, or start without "
        "`--ckpt_path`."
    )
    assert built == []  # Lightning said so only once the model, the data and the Trainer were built
    # an empty path is no checkpoint to Lightning (`--ckpt_path=$CKPT` with CKPT unset): not refused here
    with pytest.raises(RuntimeError, match="stop before building"):
        main(_fit_argv(digits_dir, tmp_path / "run", "--ckpt_path="))
    assert built == ["classes"]


def test_ckpt_path_under_the_home_folder_is_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel.cli import _check_ckpt_exists

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "last.ckpt").write_bytes(b"")
    _check_ckpt_exists("~/last.ckpt")  # Lightning's reader expands `~`: the file is there
    with pytest.raises(ValueError, match=r"^ckpt_path: '~/nope\.ckpt' does not exist"):
        _check_ckpt_exists("~/nope.ckpt")


def test_a_store_error_outside_the_data_is_not_called_a_data_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_accel._utils.fs import StorageUnavailableError

    def unreachable(args: list[str] | None = None) -> None:  # what reading a `--ckpt_path` URL raises, unwrapped
        url = "s3://bucket/run/last.ckpt"
        raise StorageUnavailableError(f"cannot read {url!r} after 5 attempts: timeout", url=url, attempts=5)

    monkeypatch.setattr("lightning_accel.cli.AccelCLI", unreachable)
    line = _one_line_error(["validate", "--ckpt_path=s3://bucket/run/last.ckpt"], capsys)
    assert line.startswith("lightning-accel: error: storage: StorageUnavailableError: cannot read 's3://bucket/run/")


def test_truncated_checkpoints(digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    main(_fit_argv(digits_dir, run))
    last = run / "checkpoints" / "last.ckpt"
    manifest = last.read_bytes()
    assert manifest[:1] == b"{"

    # a truncated delta manifest, in fit and in validate
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(manifest[: len(manifest) // 2])
    for sub in ("fit", "validate"):
        argv = [sub, *_tiny(digits_dir, tmp_path / sub), "--trainer.logger=false", f"--ckpt_path={cut}"]
        if sub == "validate":
            argv = [a for a in argv if "limit_train" not in a and "max_epochs" not in a]
        line = _one_line_error(argv, capsys)
        assert "ckpt_path" in line and "cut.ckpt" in line

    # a delta checkpoint whose blob is damaged: one that last.ckpt itself needs (other blobs may belong only to the
    # step checkpoints beside it, whose hash-named files sort anywhere)
    import json

    blob_dir = run / "checkpoints" / ".delta_blobs"
    needed = {key for entry in json.loads(manifest)["tensors"].values() for key in entry["chain"]}
    blobs = sorted(p for p in blob_dir.rglob("*") if p.is_file() and p.name in needed and p.stat().st_size > 64)
    assert blobs
    data = bytearray(blobs[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    blobs[0].write_bytes(bytes(data))
    line = _one_line_error(_fit_argv(digits_dir, tmp_path / "again", f"--ckpt_path={last}"), capsys)
    assert "ckpt_path" in line

    # a truncated torch.save file
    import torch

    full = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1000)}}, full)
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes(full.read_bytes()[:300])
    line = _one_line_error(_fit_argv(digits_dir, tmp_path / "torn", f"--ckpt_path={torn}"), capsys)
    assert "ckpt_path" in line and "torn.ckpt" in line


def test_locked_checkpoint_directory_is_refused_before_training(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    holder = DirectoryLock(FileStore(None), str(ckpt_dir))  # another run writing there
    holder.acquire()
    try:
        line = _one_line_error(_fit_argv(digits_dir, tmp_path / "run"), capsys)
    finally:
        holder.release()
    assert "checkpoint" in line and str(ckpt_dir) in line
    assert not list(ckpt_dir.glob("*.ckpt"))  # refused before the first step: nothing saved


def test_resuming_with_fewer_epochs_than_the_checkpoint(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    main(_fit_argv(digits_dir, run, "--trainer.max_epochs=3"))  # restores as current_epoch=2
    line = _one_line_error(_fit_argv(digits_dir, run, "--trainer.max_epochs=1", "--ckpt_path=last"), capsys)
    assert "current_epoch=" in line and "--trainer.max_epochs" in line


def test_a_worker_error_prints_the_workers_own_line() -> None:
    text = (
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    raise ValueError(...)\nValueError: `ram_bytes` is too small\n'
    )
    assert _user_line(ValueError(text)) == "ValueError: `ram_bytes` is too small"
    assert _user_line(TypeError("a\nb")) == "TypeError: a b"


def test_help_names_every_tool(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "data pack" in out and "data clean" in out and "ckpt" in out


_SUBCOMMANDS = "The subcommands are fit, validate, test, predict, ckpt, data or tune."


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["fitt"], f"'fitt' is not a subcommand; did you mean 'fit'? {_SUBCOMMANDS}"),
        (["tnue", "--trainer.max_epochs=1"], f"'tnue' is not a subcommand; did you mean 'tune'? {_SUBCOMMANDS}"),
        (["--config", "{}", "chpt"], f"'chpt' is not a subcommand; did you mean 'ckpt'? {_SUBCOMMANDS}"),
        (["zzz"], f"'zzz' is not a subcommand. {_SUBCOMMANDS}"),
        (["--config", "{}", "tune"], "'tune' must come first, before any option: `lightning-accel tune ...`"),
        ([], "a subcommand is required: fit, validate, test, predict, ckpt, data or tune, e.g. `lightning-accel fit"),
        (["--print_config"], "a subcommand is required: fit, validate, test, predict, ckpt, data or tune"),
    ],
)
def test_a_misspelt_or_missing_subcommand_names_every_subcommand(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _one_line_error(argv, capsys).startswith(f"lightning-accel: error: {expected}")


def test_a_config_that_chooses_the_subcommand_is_no_missing_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("fit:\n  trainer:\n    max_epochs: 1\n")
    line = _one_line_error(["--config", str(config)], capsys)
    assert "subcommand" not in line and "model, data: required" in line


def test_a_config_before_the_subcommand_is_told_to_come_after_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("trainer:\n  max_epochs: 1\n")
    line = _one_line_error(["--config", str(config), "fit"], capsys)
    assert line == (
        f"lightning-accel: error: `--config` {str(config)!r} comes before the subcommand 'fit', where a config holds "
        "one section per subcommand (`fit:`), and it holds fit's own settings; give it after the subcommand: "
        f"`lightning-accel fit --config {config}`."
    )
    line = _one_line_error(["--config", str(config)], capsys)  # and no subcommand at all: the example uses it
    assert line.endswith(
        f"e.g. `lightning-accel fit --config {config}` (`lightning-accel --help` says what each does)."
    )


def test_a_config_with_subcommand_sections_is_told_where_it_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("fit:\n  trainer:\n    max_epocs: 1\n")
    # before any subcommand (where `fit:` belongs): the misspelt Trainer option is named with its fix
    line = _one_line_error(["--config", str(config)], capsys)
    assert line == "lightning-accel: error: trainer.max_epocs: not an option of Trainer; did you mean 'max_epochs'?"
    # after the subcommand: the `fit:` level is the mistake (was "fit: not an option of `lightning-accel fit`")
    line = _one_line_error(["fit", "--config", str(config)], capsys)
    assert line == (
        "lightning-accel: error: fit: a config given after the subcommand holds fit's settings at its top level "
        "(`trainer:`, `model:`, `data:`); drop the `fit:` level, or give this config before any subcommand "
        "(`lightning-accel --config job.yaml`, where its sections choose the subcommand)."
    )


_INLINE = "e.g. `--config '{trainer: {max_epochs: 1}}'`"


@pytest.mark.parametrize(
    ("inline", "expected"),
    [
        # was `config: in "<unicode string>", line 1, column 2`
        (
            "{trainer:{max_epocs:1}}",
            f"holds the key 'max_epocs:1': YAML needs a space after the colon, `max_epocs: 1` ({_INLINE}).",
        ),
        (
            "{trainer: {max_epochs: 1}",
            f"is not valid YAML (expected ',' or '}}', but got '<stream end>'); an inline config is a YAML mapping, "
            f"{_INLINE}.",
        ),
        ("[1, 2]", f"must be a mapping of settings, {_INLINE}."),
    ],
)
def test_an_inline_config_that_is_no_yaml_mapping_says_how_to_write_one(
    inline: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error(["fit", "--config", inline], capsys)
    assert line == f"lightning-accel: error: `--config` {inline!r} {expected}"


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,ckpt,data,tune}" in out.replace("\n", "").replace(" ", "")


def test_ckpt_path_last_says_which_file_it_resumed(
    digits_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    main(_fit_argv(digits_dir, run))
    capfd.readouterr()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "last").write_text("notes\n")  # a file named like the keyword: `last` still means the checkpoint
    main(_fit_argv(digits_dir, run, "--trainer.max_epochs=2", "--ckpt_path=last"))
    err = capfd.readouterr().err
    assert f"lightning-accel: resuming from {run / 'checkpoints' / 'last.ckpt'}" in err.splitlines()
    # validating a checkpoint resumes nothing: the line says what the run does with it
    argv = [a for a in _fit_argv(digits_dir, run) if "max_epochs" not in a and "limit_train" not in a]
    main(["validate", *argv[1:], "--ckpt_path=last"])
    err = capfd.readouterr().err
    assert f"lightning-accel: validating {run / 'checkpoints' / 'last.ckpt'}" in err.splitlines()


def test_optimizer_state_of_another_optimizer(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    main(_fit_argv(digits_dir, run))  # the model's own AdamW
    last = run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    sgd = ["--optimizer=torch.optim.SGD", "--optimizer.lr=0.1", "--optimizer.momentum=0.9"]
    line = _one_line_error(_fit_argv(digits_dir, run, *sgd, "--trainer.max_epochs=2", "--ckpt_path=last"), capsys)
    assert "SGD" in line and "momentum" in line and "ckpt_path" in line
    assert last.read_bytes() == before  # refused before the first step: nothing saved over it


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("trainer:\n  max_epochs: [1\n", ["not valid YAML", "line 2, column 15", "expected ',' or ']'"]),
        ("", ["is empty"]),
        ("# only a comment\n", ["is empty"]),
        ("- trainer\n- model\n", ["must hold a mapping of settings", "got a list"]),
    ],
    ids=["syntax", "empty", "comment-only", "list"],
)
def test_a_config_file_that_is_no_config_names_the_file(
    content: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(content)
    line = _one_line_error(["fit", "--config", str(config)], capsys)
    assert f"`--config` {str(config)!r}" in line and all(w in line for w in words), line


def test_a_value_of_the_wrong_type_in_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text('trainer:\n  max_epochs: "five"\n')
    line = _one_line_error(["fit", "--config", str(config), "--print_config"], capsys)
    assert line == "lightning-accel: error: trainer.max_epochs: expected int or None, got 'five'."


_REPO = Path(__file__).resolve().parent.parent
_QUICKSTART = _REPO / "examples" / "configs" / "quickstart.yaml"
_BORING = [
    "fit",
    "--model=lightning.pytorch.demos.boring_classes.BoringModel",
    "--data=lightning.pytorch.demos.boring_classes.BoringDataModule",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
]


def test_a_misspelled_strategy_name_names_the_key_and_the_suites_strategies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error([*_BORING, f"--trainer.default_root_dir={tmp_path}", "--trainer.strategy=ddp_1bits"], capsys)
    assert line.startswith(
        "lightning-accel: error: trainer.strategy: 'ddp_1bits' is not a strategy name; did you mean 'ddp_1bit'? "
        "Names: ddp_1bit, diloco, pipeline (lightning-accel); auto, ddp, "
    ), line
    assert "Example choices" not in line and "ddp_find_unused" not in line  # base names only: the line stays short
    line = _one_line_error([*_BORING, f"--trainer.default_root_dir={tmp_path}", "--trainer.strategy=zzz"], capsys)
    assert "'zzz' is not a strategy name. Names: ddp_1bit" in line and "did you mean" not in line


def test_precision_beside_a_precision_plugin_names_both_keys_and_the_plugins_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin = "--trainer.plugins=[{class_path: lightning_accel.precision.plugin.FusedPrecision}]"
    argv = [*_BORING, f"--trainer.default_root_dir={tmp_path}", plugin, "--trainer.precision=16-mixed"]
    line = _one_line_error(argv, capsys)
    assert line == (
        "lightning-accel: error: trainer.precision: '16-mixed' is set and `trainer.plugins` holds FusedPrecision, "
        "which sets the precision itself: drop `trainer.precision` and give the precision to the plugin, "
        "`init_args: {precision: 16-mixed}` under its `class_path:` in `trainer.plugins` (FusedPrecision takes "
        "'bf16-mixed' or '16-mixed')."
    )


@pytest.mark.parametrize(
    ("yaml_edit", "args", "expected"),
    [
        (
            None,
            ["--data.batchsize=32"],
            "data.batchsize: not an option of DigitsCachedDataModule; did you mean 'batch_size'?",
        ),
        (
            ("batch_size: 64", "batch_sise: 64"),
            [],
            "data.batch_sise: not an option of DigitsCachedDataModule; did you mean 'batch_size'?",
        ),
        (None, ["--model.init_args.widht=8"], "model.widht: not an option of ImageClassifier; did you mean 'width'?"),
        (None, ["--trainer.max_epocs=3"], "trainer.max_epocs: not an option of Trainer; did you mean 'max_epochs'?"),
        (
            ("max_epochs: 5", "max_epocs: 5"),
            [],
            "trainer.max_epocs: not an option of Trainer; did you mean 'max_epochs'?",
        ),
        (
            None,
            ["--data.qqq=1"],
            "data.qqq: not an option of DigitsCachedDataModule; "
            "`--data.help lightning_accel.datasets.DigitsCachedDataModule` lists its options.",
        ),
    ],
    ids=["data-cli", "data-yaml", "model-cli", "trainer-cli", "trainer-yaml", "no-close-match"],
)
def test_a_misspelled_key_names_the_class_and_the_closest_option(
    yaml_edit: tuple[str, str] | None,
    args: list[str],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _edited(_QUICKSTART, yaml_edit, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(config), *args, "--print_config"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"lightning-accel: error: {expected}" in err.splitlines(), err
    assert "NestedArg" not in err and "is not accepted" not in err


def test_a_config_folder_is_named_a_folder_with_its_yaml_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = _REPO / "examples" / "configs"
    line = _one_line_error(["fit", "--config", f"{configs}/"], capsys)
    assert line.startswith(f"lightning-accel: error: `--config` '{configs}/' is a folder, not a YAML file. "), line
    assert "quickstart.yaml" in line and f"e.g. `--config {configs}/all_plugins.yaml`" in line
    line = _one_line_error(["fit", "--config", str(tmp_path)], capsys)
    assert "is a folder, not a YAML file, and holds no .yaml file" in line and "does not exist" not in line


def test_data_pack_and_ckpt_gc_errors_are_one_finished_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["data", "pack", str(tmp_path / "missing"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert err.startswith("lightning-accel data: error: FileNotFoundError: ") and len(err.splitlines()) == 1, err
    # named as the command line names them: SOURCE and `--manifest`, not the Python API's `origin` and `manifest=`
    assert f"SOURCE {str(tmp_path / 'missing')!r} does not exist" in err and "`origin`" not in err, err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["data", "pack", str(tmp_path / "empty"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "SOURCE" in err and "pass `--manifest` naming a JSONL list" in err and "`origin`" not in err, err
    with pytest.raises(SystemExit):
        main(["ckpt", "gc", str(tmp_path / "missing"), "--dry-run"])
    err = capsys.readouterr().err
    assert err == (
        f"lightning-accel ckpt: error: Checkpoint directory '{tmp_path / 'missing'}' does not exist (nothing "
        "collected). Check the path.\n"
    )
    assert not (tmp_path / "missing").exists()


_ALL_PLUGINS = _REPO / "examples" / "configs" / "all_plugins.yaml"
_CLASS_KEYS = "(a class is given as `class_path:` with its import path and `init_args:` with its arguments)"


@pytest.mark.parametrize(
    ("yaml_edit", "args", "expected"),
    [
        # an option of a class nested in another class: the full key, not the outer one (was `data.flipp`)
        (None, ["--data.train_augment.flipp=0.5"], "data.train_augment.flipp: not an option of GpuAugment; "),
        (("flip_p: 0.0", "flipp: 0.0"), [], "data.train_augment.flipp: not an option of GpuAugment; "),
        # a misspelled key of the class config itself (was `expected None, got "{...}"` or `not an option of ...`)
        (
            ("  class_path: lightning_accel.models", "  clas_path: lightning_accel.models"),
            [],
            f"model.clas_path: not a key of a class config; did you mean 'class_path'? {_CLASS_KEYS}",
        ),
        (
            ("init_args:\n    num_classes: auto", "init_arg:\n    num_classes: auto"),
            [],
            f"model.init_arg: not a key of a class config; did you mean 'init_args'? {_CLASS_KEYS}",
        ),
        (
            ("- class_path: lightning_accel.PerStepLR", "- clas_path: lightning_accel.PerStepLR"),
            [],
            f"trainer.callbacks.clas_path: not a key of a class config; did you mean 'class_path'? {_CLASS_KEYS}",
        ),
        (
            ("    class_path: lightning_accel.strategies", "    classpath: lightning_accel.strategies"),
            [],
            f"trainer.strategy.classpath: not a key of a class config; did you mean 'class_path'? {_CLASS_KEYS}",
        ),
        (
            ("      class_path: lightning_accel.GpuAugment", "      clas_path: lightning_accel.GpuAugment"),
            [],
            f"data.train_augment.clas_path: not a key of a class config; did you mean 'class_path'? {_CLASS_KEYS}",
        ),
        # a misspelled top-level key (was `Subcommand 'fit' does not accept option 'trainner.strategy...'`)
        (("trainer:", "trainner:"), [], "trainner: not an option of `lightning-accel fit`; did you mean 'trainer'?"),
        (None, ["--trainner.max_steps=1"], "trainner: not an option of `lightning-accel fit`; did you mean 'trainer'?"),
        (None, ["--ckpt_paht=last"], "ckpt_paht: not an option of `lightning-accel fit`; did you mean 'ckpt_path'?"),
        (None, ["--zzzz=1"], "zzzz: not an option of `lightning-accel fit`; `lightning-accel fit --help` lists its "),
        # a misspelled class name (was `module 'lightning_accel' has no attribute 'PerStepLRR'` and a config dump)
        (
            ("lightning_accel.PerStepLR", "lightning_accel.PerStepLRR"),
            [],
            "trainer.callbacks: class_path 'lightning_accel.PerStepLRR' does not exist: module 'lightning_accel' has "
            "no attribute 'PerStepLRR'; did you mean 'lightning_accel.PerStepLR'?",
        ),
        (
            ("lightning_accel.GpuAugment", "lightning_accel.GPUAugment"),
            [],
            "data.train_augment: class_path 'lightning_accel.GPUAugment' does not exist: module 'lightning_accel' has "
            "no attribute 'GPUAugment'; did you mean 'lightning_accel.GpuAugment'?",
        ),
        (
            None,
            ["--optimizer=torch.optim.SGDD"],
            "optimizer: class_path 'torch.optim.SGDD' does not exist: module 'torch.optim' has no attribute 'SGDD'; "
            "did you mean 'torch.optim.SGD'?",
        ),
        # an option under a strategy name (was `trainer.strategy: Expected a dot import path string: ddp_1bit, got '3'`)
        (
            None,
            ["--trainer.strategy=ddp_1bit", "--trainer.strategy.warmup_steps=3"],
            "trainer.strategy.warmup_steps: 'ddp_1bit' is a name, which takes no options; to set 'warmup_steps', give "
            "`--trainer.strategy=lightning_accel.OneBitDDPStrategy`, then `--trainer.strategy.warmup_steps=...` (in ",
        ),
    ],
    ids=[
        "nested-cli",
        "nested-yaml",
        "class_path-model",
        "init_args-model",
        "class_path-callback",
        "class_path-strategy",
        "class_path-nested",
        "group-yaml",
        "group-cli",
        "top-option-cli",
        "top-no-close-match",
        "class-name-callback",
        "class-name-case",
        "class-name-optimizer",
        "strategy-name-with-option",
    ],
)
def test_a_misspelled_key_or_class_anywhere_in_the_config_is_named_with_its_fix(
    yaml_edit: tuple[str, str] | None,
    args: list[str],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _edited(_ALL_PLUGINS, yaml_edit, tmp_path)
    line = _one_line_error(["fit", "--config", str(config), *args, "--print_config"], capsys)
    assert line.startswith(f"lightning-accel: error: {expected}"), line
    assert "Given value" not in line and "{'" not in line and "is not accepted" not in line


def test_a_class_name_without_its_module_gets_its_import_path(tmp_path: Path) -> None:
    # jsonargparse resolves a bare name only among the subclasses imported so far: in a fresh process (no config naming
    # the demo first) it said `Expected a dot import path string: ImageClassifier`, which does not say what to write
    cmd = [sys.executable, "-m", "lightning_accel.cli", "fit", "--model=ImageClassifier", "--print_config"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "lightning-accel: error: model: 'ImageClassifier' is a class name without its module; give its import path, "
        "e.g. `--model=lightning_accel.models.ImageClassifier`."
    ) in out.stderr.splitlines(), out.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "model, data: required; give a config that sets `model:` and `data:` (e.g. `--config "),
        (["--model=lightning_accel.models.ImageClassifier"], "data: required; give a config that sets `data:` "),
    ],
    ids=["nothing", "no-data"],
)
def test_a_missing_model_or_data_names_the_keys_and_how_to_give_them(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # was `the following arguments are required: fit.data, fit.model` (keys no config or option spells so)
    line = _one_line_error(["fit", *args], capsys)
    assert line.startswith(f"lightning-accel: error: {expected}"), line
    assert "fit.data" not in line


def test_a_delta_checkpoint_without_the_plugin_to_read_it(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the quickstart saves DeltaCheckpointIO manifests; validating (or resuming) one with a config without the plugin
    # used to end in torch.load's `WeightsUnpickler error: Unsupported operand 123` traceback, exit 1
    main(_fit_argv(digits_dir, tmp_path / "run", "--trainer.max_epochs=1", "--trainer.limit_train_batches=1"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.read_bytes()[:1] == b"{"
    argv = ["validate", *_tiny(digits_dir, tmp_path / "run"), "--trainer.logger=false", "--trainer.plugins=[]"]
    line = _one_line_error([*argv, f"--ckpt_path={last}"], capsys)
    assert line == (
        f"lightning-accel: error: ckpt_path: {str(last)!r} is a DeltaCheckpointIO manifest and `trainer.plugins` "
        "holds no DeltaCheckpointIO to read it: add `--trainer.plugins+=lightning_accel.DeltaCheckpointIO` (or its "
        "`class_path:` in the YAML), or pass a plain file made by `lightning-accel ckpt export`."
    )
    main([*argv, "--trainer.plugins+=lightning_accel.DeltaCheckpointIO", f"--ckpt_path={last}"])  # the fix works


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (["--trainer.max_ep", "1"], "trainer.max_ep: not an option of Trainer; did you mean 'max_epochs'?"),
        (["--trainer.limit_val=0"], "trainer.limit_val: not an option of Trainer; did you mean 'limit_val_batches'?"),
        (["--seed_every", "3"], "seed_every: not an option of `lightning-accel fit`; did you mean 'seed_everything'?"),
    ],
    ids=["trainer-space", "trainer-equals", "top-level"],
)
def test_a_shortened_option_is_refused_with_its_full_name(
    option: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse took any unique prefix of an option (`--trainer.max_ep` ran with `max_epochs`), so a typo bound
    # silently to whichever option it began; `--print_config` then printed the config and exited 0
    line = _one_line_error([*_BORING, *option, "--print_config"], capsys)
    assert line == f"lightning-accel: error: {expected}"


def test_a_variable_in_a_config_is_refused_not_taken_literally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `${RUNS}` was taken as written: `default_root_dir: ${RUNS}/x` made a folder named `${RUNS}` in the cwd
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    config = tmp_path / "job.yaml"
    config.write_text(
        "trainer:\n  default_root_dir: ${RUNS}/x\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:\n        dirpath: $CKPT\n"
    )
    line = _one_line_error([*_BORING, "--config", str(config), "--print_config"], capsys)
    assert line == (
        f"lightning-accel: error: trainer.default_root_dir: '${{RUNS}}/x' in `--config` {str(config)!r} holds "
        "'${RUNS}', which is not expanded (config values are taken as written, not read from the environment); "
        "write the value itself, or give it on the command line, where the shell expands it: "
        '`--trainer.default_root_dir="${RUNS}/x"`.'
    )
    config.write_text(config.read_text().replace("${RUNS}/x", "runs"))  # a list item: the key, no flag to suggest
    line = _one_line_error([*_BORING, "--config", str(config), "--print_config"], capsys)
    assert line.startswith("lightning-accel: error: trainer.callbacks[0].init_args.dirpath: '$CKPT' in `--config` ")
    assert line.endswith("where the shell expands it.")
    assert not list(tmp_path.glob("$*"))
    # any other `$` is a literal character (a password, a name), which a refusal would leave no way to write
    config.write_text(config.read_text().replace("$CKPT", "ck$pt/x$y"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*_BORING, "--config", str(config), "--print_config"])
    assert exc.value.code in (0, None) and "dirpath: ck$pt/x$y" in capsys.readouterr().out


def test_a_folder_of_checkpoints_as_ckpt_path_names_its_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--ckpt_path runs/.../checkpoints` was opened as a file once the model was built: an IsADirectoryError traceback
    monkeypatch.chdir(tmp_path)
    folder = Path("logs", "version_0", "checkpoints")
    folder.mkdir(parents=True)
    (folder / "epoch=0-step=4.ckpt").write_bytes(b"not read")
    argv = [*_BORING, "--trainer.default_root_dir=.", "--trainer.max_epochs=1", "--trainer.limit_train_batches=1"]
    line = _one_line_error([*argv, f"--ckpt_path={folder}"], capsys)
    assert line == (
        f"lightning-accel: error: ckpt_path: {str(folder)!r} is a folder, not a checkpoint file; it holds 1 "
        f"checkpoint: pass it, `--ckpt_path={folder / 'epoch=0-step=4.ckpt'}`, or `--ckpt_path last` for the last "
        "checkpoint the run's ModelCheckpoint saved."
    )
    (folder / "last.ckpt").write_bytes(b"not read")
    line = _one_line_error(["validate", *argv[1:], "--ckpt_path=logs"], capsys)
    assert f"it holds 2 checkpoints: pass one of them, e.g. the newest, `--ckpt_path={folder}{os.sep}" in line


def test_an_option_the_class_of_a_strategy_name_does_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    # the name error said to give the class, then `--trainer.strategy.sync_evry=...`: an option the class does not
    # take either, so following the advice only led to a second error
    argv = [*_BORING, "--trainer.strategy=diloco", "--trainer.strategy.sync_evry=3", "--print_config"]
    assert _one_line_error(argv, capsys) == (
        "lightning-accel: error: trainer.strategy.sync_evry: 'diloco' is a name, which takes no options, and its class "
        "LocalStepsStrategy has no option 'sync_evry'; did you mean 'sync_every'? (an option is given with the class: "
        "`--trainer.strategy=lightning_accel.LocalStepsStrategy` `--trainer.strategy.<option>=...`)."
    )
    argv = [*_BORING, "--trainer.strategy=diloco", "--trainer.strategy.sync_every=3", "--print_config"]
    assert "give `--trainer.strategy=lightning_accel.LocalStepsStrategy`, then `--trainer.strategy.sync_every=...`" in (
        _one_line_error(argv, capsys)
    )


def test_a_key_set_twice_in_a_config_is_refused_with_both_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # YAML keeps the last of a repeated key without a word: the first `trainer:` block (max_epochs: 1) was dropped and
    # the run went on for Lightning's default 1000 epochs
    config = tmp_path / "job.yaml"
    config.write_text("trainer:\n  max_epochs: 1\nseed_everything: 0\ntrainer:\n  limit_train_batches: 2\n")
    line = _one_line_error([*_BORING, "--config", str(config), "--print_config"], capsys)
    assert line == (
        f"lightning-accel: error: `--config` {str(config)!r} sets 'trainer' twice in one mapping (lines 1 and 4): YAML "
        "keeps only the second, so everything set by the first was dropped. Keep one 'trainer' and merge the two."
    )
    # a key set beside a `<<:` merge overrides the merged one, as YAML means: no error
    config.write_text("base: &b\n  max_epochs: 1\n  max_steps: 3\ntrainer:\n  <<: *b\n  max_epochs: 2\n")
    assert _check_config_file(str(config))["trainer"] == {"max_epochs": 2, "max_steps": 3}


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["ckpt", "export", "a.ckpt", "b.ckpt", "--over"], "--over"),  # was taken as --overwrite
        (["data", "pack", "src", "dst", "--shard", "1MiB"], "--shard"),  # was taken as --shard-bytes
        (["data", "clean", "--dry"], "--dry"),  # was taken as --dry-run
        (["tune", "--config", "job.yaml", "--budg", "1m"], "--budg"),  # was taken as --budget
    ],
    ids=["ckpt", "data-pack", "data-clean", "tune"],
)
def test_the_tools_refuse_shortened_options(
    argv: list[str], unknown: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing is read or written: the parse fails first
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {unknown}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


_DEVICES_FORMS = (
    "expected a positive int (how many devices, or processes on CPU: `--trainer.devices=2`), a list of device indices "
    "(`--trainer.devices=[0,1]`), -1 for every device, or 'auto'."
)


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (
            "--trainer.devices=abc",
            f"trainer.devices: 'abc' is not a number of devices or a list of them: {_DEVICES_FORMS}",
        ),
        (
            "--trainer.devices=1.5",
            f"trainer.devices: '1.5' is not a number of devices or a list of them: {_DEVICES_FORMS}",
        ),
        (
            "--trainer.devices=-3",
            f"trainer.devices: '-3' is not a number of devices or a list of them: {_DEVICES_FORMS}",
        ),
        ("--trainer.devices=0", f"trainer.devices: '0' is not a number of devices or a list of them: {_DEVICES_FORMS}"),
        (
            "--trainer.devices=[0,x]",
            f"trainer.devices: '[0,x]' is not a number of devices or a list of them: {_DEVICES_FORMS}",
        ),
        (
            "--trainer.devices=[0,1]",
            "trainer.devices: [0, 1] selects device indices, which the CPU accelerator does not take: on CPU `devices` "
            "is the number of processes, a positive int (`--trainer.devices=2`), or 'auto'.",
        ),
        (
            "--trainer.num_nodes=0",
            "trainer.num_nodes: 0 is not a positive int: expected 1 or more (e.g. `--trainer.num_nodes=1`, the "
            "default).",
        ),
        (
            "--trainer.accumulate_grad_batches=0",
            "trainer.accumulate_grad_batches: 0 is not a positive int: expected 1 or more (e.g. "
            "`--trainer.accumulate_grad_batches=1`, the default).",
        ),
        (
            "--trainer.val_check_interval=0",
            "trainer.val_check_interval: 0 is no number of batches: expected an int of 1 or more (batches between "
            "validations), a float in (0.0, 1.0] (a fraction of the epoch, e.g. `--trainer.val_check_interval=0.25`) "
            "or a duration ('DD:HH:MM:SS'); to skip validation, set `--trainer.limit_val_batches=0`.",
        ),
        (
            "--trainer.check_val_every_n_epoch=0",
            "trainer.check_val_every_n_epoch: 0 is not a positive int: expected 1 or more (validate every N epochs, "
            "e.g. `--trainer.check_val_every_n_epoch=1`, the default), or null to validate every "
            "`val_check_interval` batches; to skip validation, set `--trainer.limit_val_batches=0`.",
        ),
    ],
    ids=[
        "word",
        "fraction",
        "negative",
        "zero",
        "bad-list",
        "indices-on-cpu",
        "no-nodes",
        "no-accumulation",
        "no-validation-batches",
        "no-validation-epochs",
    ],
)
def test_a_malformed_trainer_value_is_refused_before_anything_is_built(
    option: str, expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning refused `devices=abc` once the model and the data were built, with a line naming neither the key nor
    # the value (`devices` selected with `CPUAccelerator` should be an int > 0.), and ran `accumulate_grad_batches=0`
    # into a ZeroDivisionError traceback at the first step (`val_check_interval=0` and `check_val_every_n_epoch=0` too,
    # at the first step and at the first epoch's end)
    built: list[str] = []

    def instantiate_classes(self: object) -> None:  # stands in for building the model, the data and the Trainer
        built.append("classes")

    monkeypatch.setattr("lightning_accel.cli.AccelCLI.instantiate_classes", instantiate_classes)
    line = _one_line_error([*_BORING, "--trainer.accelerator=cpu", option], capsys)
    assert line == f"lightning-accel: error: {expected}"
    assert built == []


@pytest.mark.parametrize(
    "options",
    [
        ["--trainer.val_check_interval=0.0"],  # a fraction of the epoch: every batch, as Lightning reads it
        ["--trainer.val_check_interval=3", "--trainer.check_val_every_n_epoch=null"],
        ["--trainer.check_val_every_n_epoch=2"],
    ],
    ids=["zero-fraction", "by-batches", "every-2-epochs"],
)
def test_a_well_formed_validation_schedule_is_not_refused(options: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def instantiate_classes(self: object) -> None:
        built.append("classes")
        raise RuntimeError("stop before building")

    monkeypatch.setattr("lightning_accel.cli.AccelCLI.instantiate_classes", instantiate_classes)
    with pytest.raises(RuntimeError, match="stop before building"):
        main([*_BORING, "--trainer.accelerator=cpu", *options])
    assert built == ["classes"]


@pytest.mark.parametrize("devices", ["2", "auto", "1,"])
def test_a_well_formed_devices_value_is_not_refused(devices: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def instantiate_classes(self: object) -> None:
        built.append("classes")
        raise RuntimeError("stop before building")

    monkeypatch.setattr("lightning_accel.cli.AccelCLI.instantiate_classes", instantiate_classes)
    accelerator = "cuda" if devices == "1," else "cpu"  # device indices are for an accelerator with devices
    with pytest.raises(RuntimeError, match="stop before building"):
        main([*_BORING, f"--trainer.accelerator={accelerator}", f"--trainer.devices={devices}"])
    assert built == ["classes"]
