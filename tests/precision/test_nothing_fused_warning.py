"""The warning of a surgery that fused nothing names the eligible modules it left unfused, with why: "nothing to fuse"
alone sent users to the docs for a reason the surgery already knew."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_accel.precision import apply_fusions


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


def test_nothing_fused_warning_names_the_skipped_modules_and_why() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1), nn.LayerNorm(3))
    with pytest.warns(UserWarning, match="found nothing to fuse") as record:
        apply_fusions(model, ignore_modules=["0", "2"])
    message = str(record[0].message)
    assert "2 eligible module(s) left unfused" in message, message
    assert "'0' (linear: ignored (`ignore_modules`))" in message and "'2' (norm" in message, message
    assert "\n" not in message


def test_nothing_fused_warning_shortens_a_long_list() -> None:
    model = nn.Sequential(*[_Attention() for _ in range(5)])
    with pytest.warns(UserWarning, match="found nothing to fuse") as record:
        apply_fusions(model)
    message = str(record[0].message)
    assert "5 eligible module(s) left unfused" in message and "register_block" in message, message
    assert "'0' (attention" in message and "'2' (attention" in message and "'3'" not in message
    assert "and 2 more (`report.table()` lists them all)" in message, message


def test_a_model_without_eligible_modules_says_only_nothing_to_fuse() -> None:
    with pytest.warns(UserWarning, match="found nothing to fuse") as record:
        apply_fusions(nn.Sequential(nn.ReLU()))
    assert "left unfused" not in str(record[0].message)
