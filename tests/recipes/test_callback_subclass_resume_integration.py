"""A user's subclass of KnowledgeDistillation or StructuredPruning resumes its own checkpoints, the base class's, and
the base class resumes the subclass's: the state belongs to the algorithm, not to the class name."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_accel.callbacks import KnowledgeDistillation, StructuredPruning
from lightning_accel.recipes.distill import legacy_teacher_fingerprint, teacher_fingerprint
from tests.tiny import DictStudent, classifier, loader, trainer


class MyPruning(StructuredPruning):
    """A user's subclass that changes nothing of the state."""


class MyKD(KnowledgeDistillation):
    """A user's subclass that changes nothing of the state."""


def _teacher() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 10))


def _pruned_once(tmp_path: Path, cls: type[StructuredPruning]) -> Path:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(callbacks=[cls(0.5, schedule=[0, 1]), ckpt], enable_checkpointing=True, limit_train_batches=2).fit(
        classifier(width=8), loader()
    )
    return tmp_path / "last.ckpt"


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(StructuredPruning, MyPruning), (MyPruning, StructuredPruning)])
def test_pruning_resumes_across_a_subclass(
    tmp_path: Path, saved_by: type[StructuredPruning], resumed_by: type[StructuredPruning]
) -> None:
    """Resumed by the other class, the epochs pruned were lost: epoch 0 was reported missed and the model ended a
    quarter pruned instead of half."""
    last = _pruned_once(tmp_path, saved_by)
    model, cb = classifier(width=8), resumed_by(0.5, schedule=[0, 1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(callbacks=[cb], max_epochs=2, limit_train_batches=2).fit(model, loader(), ckpt_path=last)
    assert not [w for w in seen if "come before epoch" in str(w.message)]
    assert cb.done == [0, 1]
    assert model.model.layers[0].conv1.out_channels == 4


def test_pruning_subclass_state_of_an_earlier_version_resumes(tmp_path: Path) -> None:
    """Earlier versions keyed a subclass's state by the subclass's name, with and without the arguments."""
    last = _pruned_once(tmp_path, StructuredPruning)
    state = torch.load(last, weights_only=False)
    (key,) = [k for k in state["callbacks"] if str(k).startswith("StructuredPruning")]
    for old in (key.replace("StructuredPruning", "MyPruning", 1), "MyPruning"):
        state["callbacks"] = {old: state["callbacks"].pop(next(iter(state["callbacks"])))}
        torch.save(state, tmp_path / "old.ckpt")
        cb = MyPruning(0.5, schedule=[0, 1])
        trainer(callbacks=[cb], max_epochs=2, limit_train_batches=2).fit(
            classifier(width=8), loader(), ckpt_path=tmp_path / "old.ckpt"
        )
        assert cb.done == [0, 1], old


def test_a_subclass_saves_under_the_base_key_and_the_base_key_is_unchanged() -> None:
    assert MyPruning(0.5, schedule=[0]).state_key == StructuredPruning(0.5, schedule=[0]).state_key
    assert StructuredPruning(0.5, schedule=[0]).state_key == "StructuredPruning{'target': None, 'schedule': [0]}"
    assert MyKD(_teacher(), temperature=3.0).state_key == KnowledgeDistillation(_teacher(), temperature=3.0).state_key
    assert KnowledgeDistillation(_teacher()).state_key.startswith("KnowledgeDistillation{'teacher': 'Sequential@")


@pytest.mark.parametrize("old_name", ["KnowledgeDistillation", "MyKD"])
@pytest.mark.parametrize("resumed_by", [KnowledgeDistillation, MyKD])
@pytest.mark.parametrize("legacy", [False, True])
def test_distillation_state_resumes_across_a_subclass(
    tmp_path: Path, old_name: str, resumed_by: type[KnowledgeDistillation], legacy: bool
) -> None:
    """A state keyed by either class name (with the current or the earlier teacher hash) is this teacher's."""
    t = trainer(callbacks=[KnowledgeDistillation(_teacher(), temperature=3.0)], enable_checkpointing=False)
    t.fit(DictStudent(), loader())
    t.save_checkpoint(tmp_path / "a.ckpt")
    state = torch.load(tmp_path / "a.ckpt", weights_only=False)
    teacher = legacy_teacher_fingerprint(_teacher()) if legacy else teacher_fingerprint(_teacher())
    config = {"teacher": teacher, "temperature": 4.0, "alpha": 0.5}
    state["callbacks"] = {f"{old_name}{config!r}": {"temperature": 4.0, "alpha": 0.5}}
    torch.save(state, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match="trained with temperature 4.0 and alpha 0.5; this fit continues with temp"):
        trainer(callbacks=[resumed_by(_teacher(), temperature=3.0)], max_epochs=2).fit(
            DictStudent(), loader(), ckpt_path=tmp_path / "old.ckpt"
        )
