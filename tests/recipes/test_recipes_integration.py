"""The example config end to end: LinearScalingLR, PerStepLR + WarmupCosineLR, StructuredPruning, then KD from YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_accel.callbacks import KnowledgeDistillation, LinearScalingLR, StructuredPruning
from lightning_accel.cli import AccelCLI
from lightning_accel.models import ImageClassifier
from lightning_accel.recipes.lr import WarmupCosineLR

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "recipes.yaml"


def _overrides(root: Path, digits_dir: Path) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}",
        f"--trainer.callbacks.init_args.dirpath={root}/checkpoints",
        "--trainer.max_epochs=4",
        "--trainer.limit_train_batches=1",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.width=4",
        f"--data.init_args.data_dir={digits_dir}",
        "--data.init_args.image_size=32",
        "--data.init_args.num_workers=0",
        "--data.init_args.batch_size=32",
    ]


@pytest.mark.slow
def test_example_config_then_distil_from_its_checkpoint(tmp_path: Path, digits_dir: Path) -> None:
    cli = AccelCLI(args=["fit", "--config", str(CONFIG), *_overrides(tmp_path / "run", digits_dir)])
    cbs = {type(c): c for c in cli.trainer.callbacks}
    assert cbs[LinearScalingLR].factor == 0.5  # batch 32 on 1 device vs base 64
    sched = cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR) and sched.total_steps == 4 and sched.last_epoch == 4
    assert cbs[StructuredPruning].done == [3]
    assert cli.model.model.layers[0].conv1.out_channels == 2
    ckpts = sorted((tmp_path / "run").rglob("*.ckpt"))
    assert ckpts, "the example config saves checkpoints"

    # Second run: distil the (pruned) model above into a fresh one, the teacher given by checkpoint path in YAML.
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["trainer"]["callbacks"] = [
        {
            "class_path": "lightning_accel.KnowledgeDistillation",
            "init_args": {
                "teacher": str(ckpts[-1]),
                "teacher_class": "lightning_accel.models.ImageClassifier",
                "temperature": 2.0,
                "alpha": 0.5,
            },
        }
    ]
    del cfg["lr_scheduler"]
    kd_cfg = tmp_path / "kd.yaml"
    kd_cfg.write_text(yaml.safe_dump(cfg))
    args = [a for a in _overrides(tmp_path / "kd", digits_dir) if "callbacks" not in a] + ["--trainer.max_epochs=1"]
    cli2 = AccelCLI(args=["fit", "--config", str(kd_cfg), *args])
    kd = next(c for c in cli2.trainer.callbacks if isinstance(c, KnowledgeDistillation))
    assert isinstance(kd.teacher, ImageClassifier) and kd.teacher.model.layers[0].conv1.out_channels == 2
    assert any(k.startswith("distill/soft_loss") for k in cli2.trainer.callback_metrics)
