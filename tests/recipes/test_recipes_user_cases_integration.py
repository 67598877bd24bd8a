"""Trainer-level tests of the recipes under setups users combine them with: a resume at another
``accumulate_grad_batches``, Lightning's ``BaseFinetuning`` adding a param group mid-fit, Lightning's
``GradientAccumulationScheduler``, a teacher sharing parameters with the student, a teacher built from YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler, ModelCheckpoint
from torch import nn
from torch.optim import Optimizer

from lightning_accel.callbacks import KnowledgeDistillation, LinearScalingLR, PerStepLR
from lightning_accel.cli import AccelCLI
from lightning_accel.recipes.lr import WarmupCosineLR, warmup_cosine_value
from tests.tiny import LRProbe, classifier, loader, trainer


def _warmup_cosine_model(lr: float = 0.1) -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        return {"optimizer": opt, "lr_scheduler": WarmupCosineLR(opt, warmup_steps=2, min_lr=0.001)}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


@pytest.mark.parametrize(
    ("accumulate", "start", "steps"),
    [
        (1, 4, 12),  # 8 steps per epoch now: Lightning resumes at batch 4 (4 steps), then 4 + 8 steps
        (4, 1, 3),  # 2 steps per epoch now: batch 4 is 1 step of 4 batches, then 1 + 2 steps
    ],
)
def test_a_resume_mid_epoch_at_another_accumulation_ends_at_min_lr_with_the_fit(
    tmp_path: Path, accumulate: int, start: int, steps: int
) -> None:
    # 2 epochs of 8 batches accumulated by 2 (4 steps per epoch); resumed after 2 steps (4 batches) of epoch 0
    first = trainer(
        callbacks=[PerStepLR(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)],
        enable_checkpointing=True,
        limit_train_batches=None,
        max_epochs=2,
        accumulate_grad_batches=2,
    )
    first.fit(_warmup_cosine_model(), loader(32, 256))
    probe = LRProbe()
    t = trainer(
        callbacks=[PerStepLR(), probe], limit_train_batches=None, max_epochs=2, accumulate_grad_batches=accumulate
    )
    t.fit(_warmup_cosine_model(), loader(32, 256), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR)
    total = 2 * 8 // accumulate
    assert sched.total_steps == total and start + steps == total
    # one rate per batch: the rate of each optimizer step is seen by the `accumulate` batches that make it up
    got = probe.lrs[accumulate - 1 :: accumulate] if accumulate > 1 else probe.lrs
    expected = [warmup_cosine_value(start + k, 0.1, total, 2, 0.001) for k in range(steps)]
    assert got == pytest.approx(expected, rel=1e-9)
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)  # the cosine ends with the fit


class _UnfreezeHead(BaseFinetuning):
    """Trains the backbone only, then adds the head as a param group of its own at ``epoch``."""

    def __init__(self, epoch: int = 1) -> None:
        super().__init__()
        self.epoch = epoch

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze(pl_module.model.fc)  # type: ignore[arg-type]

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Optimizer) -> None:
        if epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.model.fc, optimizer, lr=0.005)  # type: ignore[arg-type]


def _scheduled_model(total_steps: int | None = None) -> Any:
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.1)
        sched = WarmupCosineLR(opt, total_steps=total_steps, warmup_steps=2, min_lr=0.001)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


def test_a_param_group_added_mid_fit_keeps_its_own_rate(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    cbs = [_UnfreezeHead(epoch=1), LinearScalingLR(base_batch_size=32), PerStepLR(), ckpt]
    t = trainer(callbacks=cbs, max_epochs=2, enable_checkpointing=True)
    t.fit(_scheduled_model(), loader(32))
    groups = t.optimizers[0].param_groups
    # the group added at epoch 1 keeps the finetuning callback's rate; the schedule went on for the groups it knows
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(0.005)
    assert groups[0]["lr"] == pytest.approx(0.001)
    # resumed after the head was added: the finetuning callback restores its group before the schedule is restored
    probe = LRProbe()
    cbs = [_UnfreezeHead(epoch=1), LinearScalingLR(base_batch_size=32), PerStepLR(), probe]
    t2 = trainer(callbacks=cbs, max_epochs=3)
    t2.fit(_scheduled_model(), loader(32), ckpt_path=tmp_path / "last.ckpt")
    groups = t2.optimizers[0].param_groups
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(0.005)
    sched = t2.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR) and sched.total_steps == 12
    assert probe.lrs == pytest.approx([warmup_cosine_value(8 + k, 0.1, 12, 2, 0.001) for k in range(4)])


def test_a_resume_at_another_global_batch_rescales_a_group_added_mid_fit(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    m = classifier(lr=0.01)

    def constant(model: Any) -> Any:
        model.configure_optimizers = lambda: torch.optim.SGD(  # type: ignore[method-assign]
            [p for p in model.parameters() if p.requires_grad], lr=0.01
        )
        return model

    t = trainer(callbacks=[_UnfreezeHead(epoch=1), LinearScalingLR(16), ckpt], max_epochs=2, enable_checkpointing=True)
    t.fit(constant(m), loader(32))
    assert [g["lr"] for g in t.optimizers[0].param_groups] == pytest.approx([0.02, 0.005])
    t2 = trainer(callbacks=[_UnfreezeHead(epoch=1), LinearScalingLR(16)], max_epochs=3)
    t2.fit(constant(classifier(lr=0.01)), loader(64), ckpt_path=tmp_path / "last.ckpt")
    # the global batch doubled: every group's rate doubles, the one added mid-fit included
    assert [g["lr"] for g in t2.optimizers[0].param_groups] == pytest.approx([0.04, 0.01])


class _EpochLR(LRProbe):
    """Records the first param group's rate and the accumulation at each epoch's first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.by_epoch: dict[int, tuple[float, int]] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
            self.by_epoch[trainer.current_epoch] = (lr, trainer.accumulate_grad_batches)


@pytest.mark.parametrize("order", ["scheduler_first", "scaling_first"])
def test_linear_scaling_follows_a_gradient_accumulation_scheduler(order: str) -> None:
    m = classifier(lr=0.01)
    m.configure_optimizers = lambda: torch.optim.SGD(m.parameters(), lr=0.01)  # type: ignore[method-assign]
    probe, scaling = _EpochLR(), LinearScalingLR(base_batch_size=32)
    accumulation = GradientAccumulationScheduler({0: 2, 1: 4})
    cbs = [accumulation, scaling] if order == "scheduler_first" else [scaling, accumulation]
    trainer(callbacks=[*cbs, probe], max_epochs=3, limit_train_batches=4).fit(m, loader(32))
    # the global batch is 32 x 2 in epoch 0, 32 x 4 from epoch 1: the rate follows it
    assert probe.by_epoch == {0: (pytest.approx(0.02), 2), 1: (pytest.approx(0.04), 4), 2: (pytest.approx(0.04), 4)}
    assert scaling.factor == 4.0 and scaling.global_batch_size == 128


class _SharedEmbedding(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.head = nn.Linear(embed.embedding_dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).mean(1))


class _TokenStudent(LightningModule):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.net = _SharedEmbedding(embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_teacher_sharing_parameters_with_the_student_is_refused_and_leaves_them_trainable() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    embed = nn.Embedding(11, 6)
    student, teacher = _TokenStudent(embed), _SharedEmbedding(embed)
    kd = KnowledgeDistillation(teacher)
    data = DataLoader(TensorDataset(torch.randint(0, 11, (16, 3)), torch.randint(0, 5, (16,))), batch_size=8)
    shared = r"`teacher` shares 1 parameter\(s\) with the student _TokenStudent: 'embed.weight'\..*deepcopy"
    with pytest.raises(ValueError, match=shared):
        trainer(callbacks=[kd], limit_train_batches=1).fit(student, data)
    assert embed.weight.requires_grad  # the student's embedding is not left frozen by the refused teacher
    assert not teacher.head.weight.requires_grad  # the teacher's own parameters stay frozen


TEACHER_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  limit_train_batches: 2
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_accel.callbacks.KnowledgeDistillation
      init_args:
        teacher:
          class_path: lightning_accel.models.ImageClassifier
          init_args: {{width: 8}}
        temperature: 2.0
        alpha: 0.25
model:
  class_path: lightning_accel.models.ImageClassifier
  init_args: {{width: 4}}
data:
  class_path: tests.tiny.TinyDigits
  init_args: {{batch_size: 32}}
"""


def test_a_teacher_given_as_a_class_path_block_in_yaml(tmp_path: Path) -> None:
    from lightning_accel.models import ImageClassifier

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TEACHER_CONFIG.format(root=tmp_path))
    cli = AccelCLI(args=["fit", "--config", str(cfg)])
    kd = next(c for c in cli.trainer.callbacks if isinstance(c, KnowledgeDistillation))  # type: ignore[attr-defined]
    assert isinstance(kd.teacher, ImageClassifier) and kd.temperature == 2.0 and kd.alpha == 0.25
    assert not any(p.requires_grad for p in kd.teacher.parameters())
    assert cli.trainer.global_step == 2


def test_recalibrating_a_target_behind_a_stem_leaves_the_stem_statistics_alone() -> None:
    from lightning_accel.callbacks import StructuredPruning

    stems = []
    for recalibrate in (False, True):
        torch.manual_seed(0)
        model = classifier(width=8)
        cb = StructuredPruning(amount=0.5, schedule=0, target="model.layers", recalibrate_bn=recalibrate)
        trainer(callbacks=[cb], limit_train_batches=1).fit(model, loader())
        assert model.model.layers[0].conv1.out_channels == 4  # pruned behind the stem
        stems.append(model.model.stem[1])
    # the stem is not pruned: its BatchNorm sees the one training batch once, not again in the recalibration forward
    plain, recalibrated = stems
    assert int(recalibrated.num_batches_tracked) == int(plain.num_batches_tracked) == 1
    assert torch.equal(recalibrated.running_mean, plain.running_mean)
    assert torch.equal(recalibrated.running_var, plain.running_var)


@pytest.mark.parametrize(("frequency", "max_steps", "expected"), [(1, -1, 6), (2, -1, 4), (1, 5, 5), (2, 5, 3)])
def test_per_step_schedule_spans_a_fit_with_a_gradient_accumulation_scheduler(
    frequency: int, max_steps: int, expected: int
) -> None:
    # 4 batches per epoch accumulated by 2 in epoch 0 (2 optimizer steps), by 1 in epoch 1 (4): 6 steps, or 2 + 3 with
    # `max_steps=5`; with `frequency=2` the scheduler steps at batch positions 2 and 4 of each epoch: 2 + 2, or 2 + 1
    m = classifier()

    def configure_optimizers() -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = WarmupCosineLR(opt, warmup_steps=1, min_lr=0.001)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": frequency}}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    accumulation = GradientAccumulationScheduler({0: 2, 1: 1})
    t = trainer(callbacks=[accumulation, PerStepLR()], max_epochs=2, max_steps=max_steps, limit_train_batches=4)
    t.fit(m, loader())
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR)
    assert sched.total_steps == expected
    assert sched.last_epoch == expected  # stepped once per scheduler step: the cosine ends with the fit
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)
