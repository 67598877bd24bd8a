"""Unit tests of the distillation core: the loss, argument checks, safe teacher loading."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.recipes.distill import (
    check_distillation_args,
    combine_losses,
    distillation_loss,
    freeze_teacher,
    load_teacher,
    teacher_fingerprint,
)


def test_loss_matches_the_formula() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    T = 3.0
    p_t, p_s = F.softmax(t / T, -1), F.softmax(s / T, -1)
    expected = (p_t * (p_t.log() - p_s.log())).sum(-1).mean() * T * T
    assert distillation_loss(s, t, T).item() == pytest.approx(expected.item(), rel=1e-5)
    assert distillation_loss(t, t, T).item() == pytest.approx(0.0, abs=1e-6)
    # rows of any leading shape: (B, T, V) equals the flattened (B*T, V)
    s3, t3 = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    assert distillation_loss(s3, t3, T).item() == pytest.approx(
        distillation_loss(s3.reshape(6, 7), t3.reshape(6, 7), T).item(), rel=1e-6
    )


def test_classes_the_teacher_masks_contribute_nothing() -> None:
    # a teacher logit of -inf (a padded vocabulary, a forbidden class) used to make the loss NaN: F.kl_div computes
    # exp(-inf) * (-inf - s) = 0 * -inf there
    torch.manual_seed(0)
    s, t = torch.randn(4, 6), torch.randn(4, 6)
    t_masked, s_masked = t.clone(), s.clone()
    t_masked[:, 4:] = float("-inf")
    s_masked[:, 5] = float("-inf")  # masked by both
    T = 2.0
    p_t = F.softmax(t_masked[:, :4] / T, -1)
    for student in (s, s_masked):
        x = student.clone().requires_grad_(True)
        loss = distillation_loss(x, t_masked, T)
        expected = (p_t * (p_t.log() - F.log_softmax(x[:, :] / T, -1)[:, :4])).sum(-1).mean() * T * T
        assert torch.isfinite(loss) and loss.item() == pytest.approx(expected.item(), rel=1e-5)
        loss.backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    # the teacher's mass on a class the student rules out is an infinite divergence, as it should be
    t_masked[:, 5] = 0.0
    assert distillation_loss(s_masked, t_masked, T).item() == float("inf")


def test_gradient_reaches_the_student_only() -> None:
    s = torch.randn(4, 3, requires_grad=True)
    t = torch.randn(4, 3, requires_grad=True)
    distillation_loss(s, t, 2.0).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert t.grad is None
    # Hinton's gradient: (p_s - p_t) * T / B (the T^2 factor times the 1/T of the softmax)
    T = 2.0
    expected = (F.softmax(s.detach() / T, -1) - F.softmax(t.detach() / T, -1)) * T / 4
    assert torch.allclose(s.grad, expected, atol=1e-6)


def test_combine_losses() -> None:
    hard, soft = torch.tensor(2.0), torch.tensor(4.0)
    assert combine_losses(hard, soft, 0.25).item() == pytest.approx(0.75 * 2 + 0.25 * 4)
    assert combine_losses(hard, soft, 0.0) is hard
    assert combine_losses(hard, soft, 1.0).item() == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("bad", "kind"),
    [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("4", TypeError), (True, TypeError)],
)
def test_bad_temperature(bad: object, kind: type[Exception]) -> None:
    with pytest.raises(kind, match="`temperature` must be a number > 0 and < inf, got .*Typical values are 1-8"):
        check_distillation_args(bad, 0.5)  # type: ignore[arg-type]


def test_bad_alpha_and_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="`alpha` must be a number >= 0 and <= 1, got 1.5. It is the weight"):
        check_distillation_args(2.0, 1.5)
    with pytest.raises(ValueError, match="`teacher` output shape \\(4, 5\\) differs"):
        distillation_loss(torch.randn(4, 3), torch.randn(4, 5), 2.0)


def test_freeze_teacher() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    assert freeze_teacher(m) is m
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    with pytest.raises(TypeError, match="`teacher`"):
        freeze_teacher("nope")  # type: ignore[arg-type]


class _Net(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(3, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_load_teacher_from_checkpoint(tmp_path: Path) -> None:
    net = _Net(hidden=6)
    path = tmp_path / "t.ckpt"
    torch.save({"state_dict": net.state_dict(), "hyper_parameters": {"hidden": 6}}, path)
    loaded = load_teacher(path, _Net)
    x = torch.randn(2, 3)
    assert torch.equal(loaded(x), net(x))
    loaded2 = load_teacher(str(path), f"{__name__}._Net")
    assert torch.equal(loaded2(x), net(x))
    with pytest.raises(ValueError, match="`teacher_class` is not set"):
        load_teacher(path, None)
    with pytest.raises(FileNotFoundError, match="`teacher` checkpoint"):
        load_teacher(tmp_path / "missing.ckpt", _Net)
    # no hyper-parameters: `_Net()` has hidden=4, the layers are resized to the file's 6 (e.g. a pruned teacher)
    torch.save({"state_dict": net.state_dict()}, tmp_path / "p.ckpt")
    assert torch.equal(load_teacher(tmp_path / "p.ckpt", _Net)(x), net(x))
    torch.save({"state_dict": nn.Linear(3, 6).state_dict()}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="does not fit"):
        load_teacher(tmp_path / "other.ckpt", _Net)  # other keys: another architecture


def test_load_teacher_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "obj": _Net()}, path)  # a pickled module: not allowed under weights_only
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_teacher(path, _Net)


def test_teacher_from_a_delta_checkpoint(tmp_path: Path) -> None:
    from lightning_accel.callbacks import KnowledgeDistillation
    from lightning_accel.checkpoint import DeltaCheckpointIO

    net = _Net(hidden=6)
    path = tmp_path / "last.ckpt"
    io = DeltaCheckpointIO()
    io.save_checkpoint({"state_dict": net.state_dict(), "hyper_parameters": {"hidden": 6}, "epoch": 1}, path)
    io.teardown()
    with pytest.raises(pickle.UnpicklingError):  # a JSON manifest: what plain `torch.load` made of it
        torch.load(path, weights_only=True)
    kd = KnowledgeDistillation(str(path), teacher_class=_Net)
    x = torch.randn(2, 3)
    assert isinstance(kd.teacher, _Net) and torch.equal(kd.teacher(x), net(x))
    assert not kd.teacher.training and not any(p.requires_grad for p in kd.teacher.parameters())
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"notes\.txt.* neither a delta checkpoint manifest nor"):
        load_teacher(tmp_path / "notes.txt", _Net)


class _WithExtraState(nn.Linear):
    """A layer whose ``state_dict`` holds a non-tensor entry (``get_extra_state``), as some quantized layers do."""

    def get_extra_state(self) -> Any:
        return {"format": "e4m3"}

    def set_extra_state(self, state: Any) -> None:
        pass


def test_teacher_fingerprint_tells_weights_apart_and_reads_any_state() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    same = copy.deepcopy(a)
    other = copy.deepcopy(a)
    with torch.no_grad():
        other.get_submodule("0").get_parameter("weight")[0, 0] += 1.0
    assert teacher_fingerprint(a) == teacher_fingerprint(same)
    assert teacher_fingerprint(a) != teacher_fingerprint(other)
    assert teacher_fingerprint(a).startswith("Sequential@")
    # entries without readable bytes (extra state, meta tensors) count by name and type
    assert teacher_fingerprint(_WithExtraState(4, 3)).startswith("_WithExtraState@")
    with torch.device("meta"):
        meta = nn.Linear(4, 3)
    assert teacher_fingerprint(meta) == teacher_fingerprint(copy.deepcopy(meta))


@pytest.mark.parametrize(
    ("shape", "index"),
    [
        ((10, 512), (9, 500)),  # a classifier head of 5120 values: its last rows
        ((64, 4096), (3, 7)),  # a wide matrix: a value between the columns a sample of 4096 would read
    ],
)
def test_teacher_fingerprint_reads_every_value(shape: tuple[int, int], index: tuple[int, int]) -> None:
    torch.manual_seed(0)
    a = nn.Linear(shape[1], shape[0])
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.weight[index] += 1.0
    assert teacher_fingerprint(a) != teacher_fingerprint(b)


def test_teacher_fingerprint_of_a_teacher_restored_from_its_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = _Net()
    path = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": net.state_dict()}, path)
    assert teacher_fingerprint(load_teacher(path, _Net)) == teacher_fingerprint(net)
    assert teacher_fingerprint(_Net()) != teacher_fingerprint(net)  # other initial weights
    # dtypes without a numpy counterpart (bfloat16) and bool buffers are read too
    half = copy.deepcopy(net).to(torch.bfloat16)
    half.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    assert teacher_fingerprint(half) == teacher_fingerprint(copy.deepcopy(half))


def test_a_teacher_class_the_checkpoint_cannot_construct_is_named(tmp_path: Path) -> None:
    # a plain `state_dict` file of a class with required arguments used to fail with Python's bare TypeError
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": nn.Linear(3, 4).state_dict()}, path)
    with pytest.raises(
        ValueError,
        match=r"`teacher_class` Linear cannot be built from checkpoint '.*plain\.ckpt', which holds no "
        r"`hyper_parameters`: .*missing 2 required positional arguments.* Save the teacher with",
    ):
        load_teacher(path, nn.Linear)
    torch.save({"state_dict": nn.Linear(3, 4).state_dict(), "hyper_parameters": {"in_features": 3}}, path)
    with pytest.raises(ValueError, match=r"which holds its `hyper_parameters` \['in_features'\]: .*'out_features'"):
        load_teacher(path, nn.Linear)
