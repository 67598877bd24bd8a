"""Trainer-level tests of KnowledgeDistillation: the loss, the protocol, a frozen teacher kept out of state, DDP."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from typing_extensions import override

from lightning_accel.callbacks import KnowledgeDistillation
from lightning_accel.checkpoint import DeltaCheckpointIO
from lightning_accel.models import ImageClassifier
from lightning_accel.recipes.distill import distillation_loss, legacy_teacher_fingerprint
from tests.helpers import run_in_processes
from tests.tiny import DictStudent, classifier, loader, trainer


def _teacher(out: int = 10, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, out))


class _LossCheck(Callback):
    def __init__(self, teacher: nn.Module, alpha: float, T: float) -> None:
        self.teacher, self.alpha, self.T = teacher, alpha, T
        self.checked = 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        x, y = batch
        logits = outputs["logits"].detach()
        with torch.no_grad():
            t = self.teacher(x)
        expected = (1 - self.alpha) * F.cross_entropy(logits, y) + self.alpha * distillation_loss(logits, t, self.T)
        assert outputs["loss"].item() == pytest.approx(expected.item(), rel=1e-5)
        self.checked += 1


def test_loss_is_the_weighted_sum_with_the_dict_protocol() -> None:
    teacher = _teacher()
    reference = copy.deepcopy(teacher).eval()
    check = _LossCheck(reference, alpha=0.7, T=3.0)
    kd = KnowledgeDistillation(teacher, temperature=3.0, alpha=0.7)
    student = DictStudent()
    trainer(callbacks=[kd, check]).fit(student, loader())
    assert check.checked == 4
    assert "training_step" not in student.__dict__  # unwrapped after fit
    assert student.training_step.__func__ is DictStudent.training_step  # type: ignore[attr-defined]  # the original
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), reference.parameters(), strict=True))


def test_alpha_zero_is_plain_training_and_forward_capture_works() -> None:
    torch.manual_seed(0)
    plain = classifier()
    kd_student = copy.deepcopy(plain)
    trainer().fit(plain, loader())
    torch.manual_seed(0)
    kd = KnowledgeDistillation(_teacher(), temperature=2.0, alpha=0.0)
    trainer(callbacks=[kd]).fit(kd_student, loader())
    for a, b in zip(plain.parameters(), kd_student.parameters(), strict=True):
        assert torch.allclose(a, b)
    # with alpha > 0 the same start diverges: the teacher term really reaches the gradients
    torch.manual_seed(0)
    other = copy.deepcopy(kd_student)
    trainer(callbacks=[KnowledgeDistillation(_teacher(), alpha=0.9)]).fit(other, loader())
    assert not all(torch.allclose(a, b) for a, b in zip(kd_student.parameters(), other.parameters(), strict=True))


def test_teacher_stays_out_of_optimizer_and_checkpoint(tmp_path: Path) -> None:
    teacher = _teacher()
    kd = KnowledgeDistillation(teacher, alpha=0.5)
    student = classifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(callbacks=[kd, ckpt], enable_checkpointing=True, default_root_dir=tmp_path)
    t.fit(student, loader())
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not any(id(p) in teacher_ids for g in t.optimizers[0].param_groups for p in g["params"])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert set(saved["state_dict"]) == set(student.state_dict())
    assert saved["callbacks"][kd.state_key] == {"temperature": 4.0, "alpha": 0.5}
    n_teacher = sum(p.numel() for p in teacher.parameters())
    assert not any(v.numel() == n_teacher for v in saved["state_dict"].values())


def test_teacher_from_a_checkpoint_path(tmp_path: Path) -> None:
    big = classifier(width=8)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(callbacks=[ckpt], enable_checkpointing=True, default_root_dir=tmp_path, limit_train_batches=2).fit(
        big, loader()
    )
    kd = KnowledgeDistillation(str(tmp_path / "last.ckpt"), teacher_class="lightning_accel.models.ImageClassifier")
    assert isinstance(kd.teacher, ImageClassifier) and kd.teacher.hparams["width"] == 8
    x = torch.randn(2, 3, 8, 8)
    big.eval()
    with torch.no_grad():
        assert torch.allclose(kd.teacher(x), big(x))
    trainer(callbacks=[kd], limit_train_batches=2).fit(classifier(), loader())


def test_teacher_from_a_delta_checkpoint_of_a_run(tmp_path: Path) -> None:
    big = classifier(width=8)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(
        plugins=[DeltaCheckpointIO()],
        callbacks=[ckpt],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        limit_train_batches=2,
    ).fit(big, loader())
    assert (tmp_path / "last.ckpt").read_bytes().startswith(b'{"format":"lightning-accel/delta-checkpoint"')
    kd = KnowledgeDistillation(str(tmp_path / "last.ckpt"), teacher_class="lightning_accel.models.ImageClassifier")
    assert isinstance(kd.teacher, ImageClassifier) and kd.teacher.hparams["width"] == 8
    x = torch.randn(2, 3, 8, 8)
    big.eval()
    with torch.no_grad():
        assert torch.allclose(kd.teacher(x), big(x))
    trainer(callbacks=[kd], limit_train_batches=2).fit(classifier(), loader())


class ConfigTeacher(LightningModule):
    """A teacher configured by one dict, saved with ``self.save_hyperparameters(config)`` (Lightning records the
    dict's entries and ``hparams_name="config"``)."""

    def __init__(self, config: dict[str, int]) -> None:
        super().__init__()
        self.save_hyperparameters(config)
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(192, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 10)
        )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_teacher_from_a_checkpoint_of_a_module_configured_by_one_dict(tmp_path: Path) -> None:
    big = ConfigTeacher({"hidden": 12})
    t = trainer(limit_train_batches=2)
    t.fit(big, loader())
    t.save_checkpoint(tmp_path / "teacher.ckpt")
    # Lightning's own loader builds it as ConfigTeacher(config={...}); so must the teacher's
    assert ConfigTeacher.load_from_checkpoint(tmp_path / "teacher.ckpt").hparams["hidden"] == 12
    kd = KnowledgeDistillation(str(tmp_path / "teacher.ckpt"), teacher_class=ConfigTeacher)
    assert isinstance(kd.teacher, ConfigTeacher) and kd.teacher.hparams["hidden"] == 12
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(kd.teacher(x), big.eval()(x))
    trainer(callbacks=[kd], limit_train_batches=2).fit(classifier(), loader())


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="`temperature`"):
        KnowledgeDistillation(_teacher(), temperature=0.0)
    with pytest.raises(ValueError, match="`temperature` must be a number > 0 and < inf, got inf"):
        KnowledgeDistillation(_teacher(), temperature=float("inf"))
    with pytest.warns(UserWarning, match="`teacher_class` .* is used only when `teacher` is a checkpoint path"):
        KnowledgeDistillation(_teacher(), teacher_class=ImageClassifier)
    with pytest.raises(ValueError, match="`alpha`"):
        KnowledgeDistillation(_teacher(), alpha=-0.1)
    failed = classifier()
    with pytest.raises(ValueError, match="`teacher` output shape \\(32, 7\\) differs"):
        trainer(callbacks=[KnowledgeDistillation(_teacher(out=7))]).fit(failed, loader())
    assert "training_step" not in failed.__dict__  # unwrapped after the failure
    student = classifier()
    student.helper = _teacher()  # a submodule would be trained and checkpointed
    with pytest.raises(ValueError, match="`teacher` is a submodule"):
        trainer(callbacks=[KnowledgeDistillation(student.helper)]).fit(student, loader())


class _NoLogits(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(192, 10)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x.flatten(1)), y)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_protocol_violation_explains_the_fix() -> None:
    with pytest.raises(ValueError, match="'logits'"):
        trainer(callbacks=[KnowledgeDistillation(_teacher())]).fit(_NoLogits(), loader())


class _RecordsContext(nn.Module):
    """A teacher that records, at each forward, its weight's dtype, the default dtype and whether CPU autocast is on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _teacher()
        self.seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.net.get_submodule("1").get_parameter("weight")
        self.seen.append((weight.dtype, torch.get_default_dtype(), torch.is_autocast_enabled("cpu")))
        return self.net(x)


@pytest.mark.parametrize(
    ("precision", "dtype", "autocast"),
    [
        ("bf16-true", torch.bfloat16, False),
        ("16-true", torch.float16, False),
        ("64-true", torch.float64, False),
        ("bf16-mixed", torch.float32, True),
    ],
)
def test_teacher_takes_the_precision_of_the_student(precision: str, dtype: torch.dtype, autocast: bool) -> None:
    teacher = _RecordsContext()
    student = DictStudent()
    trainer(precision=precision, limit_train_batches=2, callbacks=[KnowledgeDistillation(teacher)]).fit(
        student, loader(batch_size=16)
    )
    # given back in its own dtype (it ran in the student's, recorded below), frozen and in eval mode
    assert {p.dtype for p in teacher.parameters()} == {torch.float32}
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    # and run under the student's forward context: the default dtype of a "-true" precision, autocast of a "-mixed" one
    default = dtype if precision.endswith("-true") else torch.float32
    assert teacher.seen == [(dtype, default, autocast)] * 2


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_a_true_precision_gives_the_teacher_back_unchanged_for_the_next_fit(precision: str) -> None:
    # the teacher kept the fit's dtype: the next float32 fit distilled from bfloat16-rounded weights, run in bfloat16
    teacher = _RecordsContext()
    original = {k: v.clone() for k, v in teacher.state_dict().items()}
    cb = KnowledgeDistillation(teacher)
    trainer(precision=precision, limit_train_batches=1, callbacks=[cb]).fit(DictStudent(), loader(batch_size=16))
    after = teacher.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in original.items())
    trainer(limit_train_batches=1, callbacks=[cb]).fit(DictStudent(), loader(batch_size=16))
    assert [seen[0] for seen in teacher.seen] == [_precision_dtype(precision), torch.float32]
    # a failed fit gives it back too
    with pytest.raises(RuntimeError, match="stop"):
        trainer(precision=precision, limit_train_batches=1, callbacks=[cb, _Raises()]).fit(
            DictStudent(), loader(batch_size=16)
        )
    after = teacher.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in original.items())


def _precision_dtype(precision: str) -> torch.dtype:
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}[precision]


class _Raises(Callback):
    @override
    def on_train_batch_end(self, *args: Any) -> None:
        raise RuntimeError("stop")


@pytest.mark.parametrize(
    ("teacher_dtype", "precision"),
    [(torch.bfloat16, "32-true"), (torch.float64, "32-true"), (torch.float64, "bf16-mixed")],
)
def test_a_teacher_in_another_dtype_gets_its_inputs_in_its_dtype(teacher_dtype: torch.dtype, precision: str) -> None:
    # a bfloat16 teacher kept small beside a float32 student used to fail with torch's "mat1 and mat2 must have the
    # same dtype" at the first step: its inputs were the student's
    teacher = _teacher().to(teacher_dtype)
    callbacks: list[Callback] = [KnowledgeDistillation(teacher, 2.0, 0.5)]
    check = _LossCheck(nn.Sequential(_Cast(teacher_dtype), copy.deepcopy(teacher).eval()), alpha=0.5, T=2.0)
    if precision == "32-true":  # under autocast the student's bf16 logits make the recomputed loss differ a little
        callbacks.append(check)
    t = trainer(precision=precision, limit_train_batches=2, callbacks=callbacks)
    t.fit(DictStudent(), loader(batch_size=16))
    assert check.checked == (2 if precision == "32-true" else 0)
    assert torch.isfinite(t.callback_metrics["distill/soft_loss"])
    assert {p.dtype for p in teacher.parameters()} == {teacher_dtype}  # left in its own dtype


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


class _ManualStudent(DictStudent):
    """Manual optimization: ``training_step`` back-propagates its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_is_refused_at_fit_start() -> None:
    # the callback adds the soft term to the returned loss, which nobody back-propagates under manual optimization:
    # the student used to train exactly as without a teacher, silently (with distill/* metrics logged)
    student = _ManualStudent()
    before = [p.detach().clone() for p in student.parameters()]
    with pytest.raises(ValueError, match="KnowledgeDistillation needs automatic optimization, but _ManualStudent sets"):
        trainer(limit_train_batches=2, callbacks=[KnowledgeDistillation(_teacher())]).fit(student, loader())
    assert all(torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))  # nothing trained
    assert type(student).training_step is _ManualStudent.training_step and "training_step" not in vars(student)


def _ddp_fit(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    pl.seed_everything(0)
    teacher = _teacher()
    check = _LossCheck(copy.deepcopy(teacher).eval(), alpha=0.5, T=2.0)
    kd = KnowledgeDistillation(teacher, temperature=2.0, alpha=0.5)
    student = DictStudent()
    t = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[kd, check],
    )
    t.fit(student, loader(batch_size=16))
    return {
        "world": t.world_size,
        "checked": check.checked,
        "weights": torch.cat([p.detach().flatten() for p in student.parameters()]).tolist(),
        "teacher_frozen": not teacher.training and not any(p.requires_grad for p in teacher.parameters()),
        "unwrapped": "training_step" not in student.__dict__,
    }


@pytest.mark.slow
def test_ddp_two_processes() -> None:
    r0, r1 = run_in_processes(_ddp_fit, 2, init_process_group=False, timeout=240)
    assert r0["world"] == r1["world"] == 2
    assert r0["checked"] == r1["checked"] == 3  # each rank's loss is its own hard + soft mix
    assert torch.allclose(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))  # DDP kept the students in sync
    assert r0["teacher_frozen"] and r1["teacher_frozen"] and r0["unwrapped"]


@pytest.mark.gpu
def test_teacher_follows_the_student_to_the_gpu() -> None:
    teacher = _teacher()
    check = _LossCheck(copy.deepcopy(teacher).eval().cuda(), alpha=0.5, T=2.0)
    t = trainer(accelerator="gpu", callbacks=[KnowledgeDistillation(teacher, temperature=2.0, alpha=0.5), check])
    t.fit(DictStudent(), loader())
    assert next(teacher.parameters()).is_cuda and check.checked == 4


def test_two_teachers_train_log_and_resume_apart(tmp_path: Path) -> None:
    """Two callbacks (an ensemble of two teachers of one architecture) share a Trainer, its logs and checkpoints."""
    first, second = _teacher(seed=1), _teacher(seed=2)
    kds = [KnowledgeDistillation(first, temperature=2.0), KnowledgeDistillation(second, temperature=2.0)]
    assert kds[0].state_key != kds[1].state_key
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(callbacks=[*kds, ckpt], enable_checkpointing=True)
    t.fit(DictStudent(), loader())
    assert {"distill/soft_loss_epoch", "distill/soft_loss_1_epoch"} <= set(t.callback_metrics)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]
    assert {kd.state_key for kd in kds} <= set(saved)

    # a resume with fresh callbacks over the same teachers, listed the other way round, maps each state back
    again = [KnowledgeDistillation(copy.deepcopy(second), temperature=2.0, alpha=0.5)]
    again.append(KnowledgeDistillation(copy.deepcopy(first), temperature=2.0, alpha=0.5))
    assert [kd.state_key for kd in again] == [kds[1].state_key, kds[0].state_key]
    restored: list[tuple[str, dict[str, Any]]] = []

    def recorder(kd: KnowledgeDistillation) -> Callable[[dict[str, Any]], None]:
        return lambda state: restored.append((kd.state_key, state))

    for kd in again:
        kd.load_state_dict = recorder(kd)  # type: ignore[method-assign, assignment]
    trainer(callbacks=again, max_epochs=2).fit(DictStudent(), loader(), ckpt_path=tmp_path / "last.ckpt")
    assert sorted(restored) == sorted((kd.state_key, saved[kd.state_key]) for kd in kds)


def test_a_bare_class_name_state_from_an_older_checkpoint_is_checked(tmp_path: Path) -> None:
    t = trainer(callbacks=[KnowledgeDistillation(_teacher(), temperature=3.0)], enable_checkpointing=False)
    t.fit(DictStudent(), loader())
    t.save_checkpoint(tmp_path / "a.ckpt")
    state = torch.load(tmp_path / "a.ckpt", weights_only=False)
    state["callbacks"] = {"KnowledgeDistillation": {"temperature": 4.0, "alpha": 0.5}}
    torch.save(state, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match="trained with temperature 4.0 and alpha 0.5; this fit continues with temp"):
        trainer(callbacks=[KnowledgeDistillation(_teacher(), temperature=3.0)], max_epochs=2).fit(
            DictStudent(), loader(), ckpt_path=tmp_path / "old.ckpt"
        )


def test_a_state_keyed_by_an_earlier_teacher_hash_is_checked(tmp_path: Path) -> None:
    # an earlier version hashed a sample of the teacher's weights: the same teacher had another key then
    t = trainer(callbacks=[KnowledgeDistillation(_teacher(), temperature=3.0)], enable_checkpointing=False)
    t.fit(DictStudent(), loader())
    t.save_checkpoint(tmp_path / "a.ckpt")
    state = torch.load(tmp_path / "a.ckpt", weights_only=False)
    old = {"teacher": legacy_teacher_fingerprint(_teacher()), "temperature": 4.0, "alpha": 0.5}
    old_key = f"KnowledgeDistillation{old!r}"
    state["callbacks"] = {old_key: {"temperature": 4.0, "alpha": 0.5}}
    torch.save(state, tmp_path / "old.ckpt")
    kd = KnowledgeDistillation(_teacher(), temperature=3.0)
    assert kd.state_key != old_key
    with pytest.warns(UserWarning, match="trained with temperature 4.0 and alpha 0.5; this fit continues with temp"):
        trainer(callbacks=[kd], max_epochs=2).fit(DictStudent(), loader(), ckpt_path=tmp_path / "old.ckpt")


def test_two_teachers_differing_in_a_few_values_distil_side_by_side() -> None:
    """Teachers that share all but the last row of their head (one class retrained) are two teachers: each callback
    keeps its own state key, so one Trainer takes both."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Flatten(), nn.Linear(192, 512), nn.ReLU(), nn.Linear(512, 10))
    second = copy.deepcopy(first)
    with torch.no_grad():
        second.get_submodule("3").get_parameter("weight")[9] += 0.5
    kds = [KnowledgeDistillation(first, temperature=2.0), KnowledgeDistillation(second, temperature=2.0)]
    assert kds[0].state_key != kds[1].state_key
    t = trainer(callbacks=kds, limit_train_batches=2)
    t.fit(DictStudent(), loader())
    assert {"distill/soft_loss_epoch", "distill/soft_loss_1_epoch"} <= set(t.callback_metrics)
