"""Int-or-float Trainer arguments through the real CLI: ``1`` is one batch, ``1.0`` the whole epoch, ``0.5`` half."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import pytest

from lightning_accel.cli import AccelCLI, int_first_hint

# BoringDataModule's training split: 64 batches an epoch
_FULL_EPOCH = 64


@pytest.fixture(autouse=True)
def _argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["lightning-accel"])  # LightningCLI warns when `args` and sys.argv both hold some


def _fit(tmp_path: Path, *extra: str) -> AccelCLI:
    return AccelCLI(
        args=[
            "fit",
            "--model=lightning.pytorch.demos.boring_classes.BoringModel",
            "--data=lightning.pytorch.demos.boring_classes.BoringDataModule",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_epochs=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    ("value", "batches"),
    [("1", 1), ("3", 3), ("1.0", _FULL_EPOCH), ("0.5", _FULL_EPOCH // 2)],
)
def test_limit_train_batches_on_the_command_line(tmp_path: Path, value: str, batches: int) -> None:
    cli = _fit(tmp_path, f"--trainer.limit_train_batches={value}", "--trainer.limit_val_batches=0")
    assert cli.trainer.num_training_batches == batches
    assert cli.trainer.global_step == batches


def test_int_and_float_from_a_yaml_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  limit_train_batches: 1\n  limit_val_batches: 1\n  val_check_interval: 1\n  overfit_batches: 0\n"
    )
    cli = _fit(tmp_path, f"--config={config}")
    assert cli.trainer.num_training_batches == 1 and cli.trainer.global_step == 1
    assert cli.trainer.num_val_batches == [1]
    assert isinstance(cli.config["fit"]["trainer"]["val_check_interval"], int)
    config.write_text("trainer:\n  limit_train_batches: 1.0\n  limit_val_batches: 0.25\n")
    cli = _fit(tmp_path, f"--config={config}")
    assert cli.trainer.num_training_batches == _FULL_EPOCH
    assert cli.trainer.num_val_batches == [_FULL_EPOCH // 4]


def test_help_keeps_the_trainer_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        AccelCLI(args=["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--trainer.limit_train_batches" in out and "int = num_batches" in out


def test_int_first_hint_reorders_a_cache_poisoned_union() -> None:
    # Spelling the float-first Union first makes typing hand it back for the int-first spelling (one cache key).
    poisoned = Optional[Union[float, int]]  # noqa: UP007, UP045 - the typing spellings are what is tested
    spelled = Optional[Union[int, float]]  # noqa: UP007, UP045
    assert poisoned.__args__[0] is float and spelled.__args__[0] is float
    fixed = int_first_hint(spelled)
    assert fixed.__args__ == (int, float, type(None))
    assert int_first_hint(Optional[int]) is None  # noqa: UP007, UP045
    assert int_first_hint(str) is None
