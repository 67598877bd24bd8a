"""What a resume does with arguments changed since the checkpoint: another teacher for ``KnowledgeDistillation``,
another warm-up or floor for ``WarmupCosineLR``; and ``StructuredPruning`` names that match no module."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.callbacks import KnowledgeDistillation, StructuredPruning
from lightning_accel.recipes.distill import legacy_teacher_fingerprint, teacher_fingerprint
from lightning_accel.recipes.lr import WarmupCosineLR, warmup_cosine_value
from tests.tiny import DictStudent, classifier, loader, trainer


def _teacher(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.ReLU(), nn.Linear(16, 10))


def _checkpoint(tmp_path: Path, kd: KnowledgeDistillation) -> Path:
    t = trainer(callbacks=[kd], enable_checkpointing=False)
    t.fit(DictStudent(), loader())
    path = tmp_path / "kd.ckpt"
    t.save_checkpoint(path)
    return path


def _Recorder(teacher: nn.Module, **kw: Any) -> KnowledgeDistillation:
    """A KnowledgeDistillation recording the states restored into it (in ``loaded``)."""
    kd = KnowledgeDistillation(teacher, **kw)
    loaded: list[dict[str, Any]] = []
    load = kd.load_state_dict

    def record(state_dict: dict[str, Any]) -> None:
        loaded.append(dict(state_dict))
        load(state_dict)

    kd.load_state_dict = record  # type: ignore[method-assign]
    kd.loaded = loaded  # type: ignore[attr-defined]
    return kd


def test_a_resume_with_another_teacher_starts_its_state_fresh_and_says_so(tmp_path: Path) -> None:
    old, new = _teacher(1), _teacher(2)
    path = _checkpoint(tmp_path, KnowledgeDistillation(old, alpha=0.3))
    kd = _Recorder(new, alpha=0.7)
    with pytest.warns(UserWarning) as record:
        trainer(callbacks=[kd], max_epochs=2).fit(DictStudent(), loader(), ckpt_path=path)
    messages = [str(w.message) for w in record if str(w.message).startswith("KnowledgeDistillation")]
    assert len(messages) == 1, messages
    assert teacher_fingerprint(old) in messages[0] and teacher_fingerprint(new) in messages[0]
    assert "alpha" not in messages[0].split("teacher")[0]  # not reported as a hyper-parameter change of one teacher
    assert kd.loaded == []


def test_a_resume_with_another_teacher_class_is_not_silent(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, KnowledgeDistillation(_teacher(1)))
    torch.manual_seed(3)
    other = nn.Sequential(nn.Flatten(), nn.Linear(192, 10))
    kd = _Recorder(other)
    with pytest.warns(UserWarning, match=r"Sequential@[0-9a-f]{12}.*Sequential@[0-9a-f]{12}"):
        trainer(callbacks=[kd], max_epochs=2).fit(DictStudent(), loader(), ckpt_path=path)
    assert kd.loaded == []


def test_a_state_keyed_by_the_sampled_hash_of_the_same_teacher_restores(tmp_path: Path) -> None:
    teacher = nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 10))  # > 4096 values
    path = _checkpoint(tmp_path, KnowledgeDistillation(teacher))
    assert legacy_teacher_fingerprint(teacher) != teacher_fingerprint(teacher)
    state = torch.load(path, weights_only=False)
    old = {"teacher": legacy_teacher_fingerprint(teacher), "temperature": 4.0, "alpha": 0.5}
    key = f"KnowledgeDistillation{old!r}"
    state["callbacks"] = {key: {"temperature": 4.0, "alpha": 0.5}}
    torch.save(state, tmp_path / "old.ckpt")
    kd = _Recorder(teacher, temperature=2.0)
    with pytest.warns(UserWarning, match="trained with temperature 4.0 and alpha 0.5; this fit continues"):
        trainer(callbacks=[kd], max_epochs=2).fit(DictStudent(), loader(), ckpt_path=tmp_path / "old.ckpt")
    assert kd.loaded == [{"temperature": 4.0, "alpha": 0.5}]


def _sched(**kw: Any) -> WarmupCosineLR:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    return WarmupCosineLR(opt, **kw)


@pytest.mark.parametrize(
    ("saved", "given", "name"),
    [
        ({"warmup_steps": 10}, {"warmup_steps": 2}, "warmup_steps"),
        ({"warmup_fraction": 0.5}, {"warmup_fraction": 0.1}, "warmup_fraction"),
        ({"warmup_steps": 4, "min_lr": 0.5}, {"warmup_steps": 4, "min_lr": 0.0}, "min_lr"),
    ],
)
@pytest.mark.parametrize("total", [20, None])
def test_warmup_cosine_resumed_with_changed_arguments_uses_the_given_ones(
    saved: dict[str, Any], given: dict[str, Any], name: str, total: int | None
) -> None:
    first = _sched(total_steps=20, **saved)
    for _ in range(6):
        first.optimizer.step()
        first.step()
    resumed = _sched(total_steps=total, **given)
    with pytest.warns(UserWarning, match=rf"`{name}`.*checkpoint.*given.*uses the given"):
        resumed.load_state_dict(first.state_dict())
    if total is None:
        resumed.bind(20)
    warm = round(0.1 * 20) if "warmup_fraction" in given else given.get("warmup_steps", 0)
    assert resumed.warmup_steps == warm
    assert resumed.min_lr == given.get("min_lr", 0.0)
    expected = warmup_cosine_value(6, 1.0, 20, warm, given.get("min_lr", 0.0))
    assert math.isclose(resumed.optimizer.param_groups[0]["lr"], expected)


def test_warmup_cosine_resumed_with_the_same_arguments_is_quiet() -> None:
    first = _sched(total_steps=20, warmup_fraction=0.2, min_lr=0.1)
    for _ in range(3):
        first.optimizer.step()
        first.step()
    resumed = _sched(total_steps=30, warmup_fraction=0.2, min_lr=0.1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(first.state_dict())
    assert resumed.warmup_steps == 6 and resumed.total_steps == 30


@pytest.mark.parametrize("names", [[""], ["", "fc"]])
def test_pruning_refuses_the_root_module_name(names: list[str]) -> None:
    with pytest.raises(ValueError, match=r"`ignore_modules` holds ''.*the pruned module itself"):
        StructuredPruning(0.5, ignore_modules=names)


def test_the_root_module_name_is_refused_against_a_model_too() -> None:
    from lightning_accel.recipes.channel_groups import check_module_names

    with pytest.raises(ValueError, match=r"`ignore_modules` holds ''.*e\.g\. 'net'"):
        check_module_names("ignore_modules", [""], _Net())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)


def test_pruning_lists_close_names_for_a_misspelt_module() -> None:
    model = classifier()
    names = [n for n, _ in model.named_modules() if n]
    wrong = names[-1] + "x"
    cb = StructuredPruning(0.5, ignore_modules=[wrong])
    with pytest.raises(ValueError, match=rf"{wrong!r}.*did you mean.*{names[-1]!r}"):
        trainer(callbacks=[cb]).fit(model, loader())
