"""`ImageClassifier(num_classes=...)`: "auto" follows the data module; too few outputs for the data is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.data import CachedDataModule
from lightning_accel.models import ImageClassifier
from tests.tiny import trainer

#: a CLI config of the classifier whose head follows the data module (tests append to its `init_args`)
_AUTO_MODEL_YAML = """
model:
  class_path: lightning_accel.models.ImageClassifier
  init_args:
    num_classes: auto
    width: 4
"""


def _image_folder(root: Path, n_classes: int, per_class: int = 2) -> Path:
    """A tiny ImageFolder of real JPEGs, class ``i`` a distinct colour."""
    from PIL import Image

    for i in range(n_classes):
        (root / f"c{i:02d}").mkdir(parents=True)
        for j in range(per_class):
            colour = (i * 20 % 256, (i * 50 + j * 7) % 256, 255 - i * 20 % 256)
            Image.new("RGB", (8, 8), colour).save(root / f"c{i:02d}" / f"{j}.jpg", format="JPEG")
    return root


def _dm(tmp_path: Path, n_classes: int) -> CachedDataModule:
    return CachedDataModule(
        origin=str(_image_folder(tmp_path / "imgs", n_classes)),
        image_size=8,
        cache_dir=str(tmp_path / "cache"),
        ram_bytes=0,
        ssd_bytes="16MiB",
        val_fraction=0.25,
        batch_size=4,
        num_workers=0,
    )


def test_too_many_classes_for_the_head_is_one_line_before_training(tmp_path: Path) -> None:
    model = ImageClassifier(num_classes=10, width=4, blocks=(1,))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as exc:
        trainer().fit(model, datamodule=_dm(tmp_path, 12))
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 300, msg
    assert "`num_classes` is 10" in msg and "12 classes" in msg and "`num_classes: auto`" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # no step was taken


def test_auto_takes_the_class_count_from_the_data_and_trains(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,), lr=1e-2)
    assert model.hparams["num_classes"] == "auto"  # the head is sized in setup, from the data
    t = trainer(max_epochs=3, limit_train_batches=None, enable_checkpointing=True, default_root_dir=str(tmp_path))
    dm = _dm(tmp_path, 12)
    t.fit(model, datamodule=dm)
    assert model.model is not None and model.model.fc.out_features == 12
    assert model.hparams["num_classes"] == 12  # resolved: what a checkpoint saves
    assert t.global_step > 0 and torch.isfinite(t.callback_metrics["train_loss"])

    # the checkpoint restores without a data module (hyper-parameters hold the resolved count) ...
    ckpt = t.checkpoint_callback.best_model_path if t.checkpoint_callback else ""
    assert ckpt
    restored = ImageClassifier.load_from_checkpoint(ckpt)
    assert restored.model is not None and restored.model.fc.out_features == 12
    x = torch.randn(2, 3, 8, 8)
    model.eval()
    restored.eval()
    torch.testing.assert_close(restored(x), model(x))
    # ... and a fresh "auto" model resumes from it through the Trainer (the head is built before the load)
    again = ImageClassifier(num_classes="auto", width=4, blocks=(1,), lr=1e-2)
    trainer(max_epochs=4, limit_train_batches=None).fit(again, datamodule=dm, ckpt_path=ckpt)
    assert again.model is not None and again.model.fc.out_features == 12


def test_an_optimizer_from_the_cli_config_trains_the_head_auto_sizes(tmp_path: Path) -> None:
    """LightningCLI's `optimizer:` block builds the optimizer from the model's parameters when it parses the config,
    before `setup` sizes the head: the head must stay the parameters that optimizer holds (it trained a provisional
    2-way head nothing used, and the real head stayed at its initial values)."""
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        _AUTO_MODEL_YAML + "    blocks: [1]\noptimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.1\n"
    )
    args = ["--config", str(cfg), "--data=lightning_accel.datasets.DigitsDataModule"]
    args += [f"--data.data_dir={tmp_path / 'digits'}", "--data.image_size=8", "--trainer.max_steps=2"]
    args += ["--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
    args += ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    args += [f"--trainer.default_root_dir={tmp_path}"]
    cli = AccelCLI(args=args, run=False)
    model = cli.model
    assert isinstance(model, ImageClassifier) and model.model is not None
    cli.trainer.fit(model, datamodule=cli.datamodule)
    head = model.model.fc
    assert head.out_features == 10 and tuple(head.weight.shape) == (10, head.in_features)
    trained = {id(p) for group in cli.trainer.optimizers[0].param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters()} <= trained
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


def test_auto_reads_the_digits_module_count() -> None:
    from lightning_accel.datasets import DigitsDataModule

    assert DigitsDataModule(data_dir="/nonexistent/digits-x").num_classes == 10


def test_auto_needs_a_data_module_that_tells(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,))
    data = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.arange(8) % 3), batch_size=4)
    with pytest.raises(ValueError, match=r"`num_classes='auto'` needs a data module .* integer `num_classes`"):
        trainer().fit(model, train_dataloaders=data)
    with pytest.raises(RuntimeError, match="sizes its head in `setup"):
        model(torch.randn(1, 3, 8, 8))


def test_auto_takes_its_head_from_the_checkpoint_of_an_evaluation(tmp_path: Path) -> None:
    """``test(ImageClassifier("auto"), dataloaders=..., ckpt_path=...)``: no data module tells the count, the
    checkpoint does (it is restored after ``setup``, which used to refuse the run)."""
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.arange(8) % 3), batch_size=4)
    fitted = ImageClassifier(num_classes=3, width=4, blocks=(1,))
    trainer(max_steps=1).fit(fitted, train_dataloaders=data)
    path = tmp_path / "three.ckpt"
    t = trainer(max_steps=1)
    t.fit(fitted, train_dataloaders=data)
    t.save_checkpoint(path)
    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,))
    out = trainer().test(model, dataloaders=data, ckpt_path=path, verbose=False)
    assert model.model.fc.out_features == 3 and "test_acc" in out[0]
    assert torch.equal(model.model.fc.weight, fitted.model.fc.weight)


def test_an_explicit_int_keeps_building_in_init() -> None:
    model = ImageClassifier(num_classes=7, width=4, blocks=(1,))
    assert model.model is not None and model.model.fc.out_features == 7
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 7)


@pytest.mark.parametrize(
    ("bad", "kind"), [(1, ValueError), (0, ValueError), ("ten", TypeError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_num_classes_is_one_line(bad: Any, kind: type[Exception]) -> None:
    with pytest.raises(kind, match=r"`num_classes` must be an integer >= 2, got .*Or pass 'auto'") as e:
        ImageClassifier(num_classes=bad)
    assert "\n" not in str(e.value)


def test_cli_accepts_num_classes_auto(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "c.yaml"
    cfg.write_text(_AUTO_MODEL_YAML)
    data = f"--data=lightning_accel.datasets.DigitsDataModule --data.data_dir={tmp_path / 'digits'}".split()
    cli = AccelCLI(args=["--config", str(cfg), *data], run=False)
    assert isinstance(cli.model, ImageClassifier) and cli.model.hparams["num_classes"] == "auto"
    cli = AccelCLI(args=["--config", str(cfg), *data, "--model.num_classes=12"], run=False)
    assert cli.model.model is not None and cli.model.model.fc.out_features == 12


def test_quickstart_on_twelve_classes_with_an_int_is_one_cli_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_accel.cli import main

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "quickstart.yaml"
    argv = ["fit", "--config", str(config), "--data=lightning_accel.data.CachedDataModule"]
    argv += [f"--data.origin={_image_folder(tmp_path / 'imgs', 12)}", f"--data.cache_dir={tmp_path}/cache"]
    argv += ["--data.ram_bytes=0", "--data.num_workers=0", "--data.image_size=8", "--model.num_classes=10"]
    argv += [f"--trainer.default_root_dir={tmp_path}/run", "--trainer.logger=false", "--trainer.max_epochs=1"]
    argv += [f"--trainer.callbacks.init_args.dirpath={tmp_path}/ckpt", "--model.width=4"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning-accel: error:")]
    assert len(lines) == 1 and "Traceback" not in err and len(lines[0]) <= 400, err
    assert "`num_classes` is 10" in lines[0] and "12 classes" in lines[0] and "`num_classes: auto`" in lines[0]
    assert not list((tmp_path / "ckpt").glob("*.ckpt"))  # stopped before training
