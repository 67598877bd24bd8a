"""A teacher that is no module is refused in one short line that names what was passed and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.callbacks import KnowledgeDistillation


def test_a_teacher_state_dict_is_refused_in_one_short_line_with_the_fix() -> None:
    weights = nn.Linear(256, 256).state_dict()
    with pytest.raises(TypeError) as info:
        KnowledgeDistillation(weights)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    assert "`teacher`" in message and "mapping (OrderedDict) of 2 entries" in message and "load_state_dict" in message


@pytest.mark.parametrize("teacher", [None, 3, [torch.zeros(1000, 1000)]])
def test_a_teacher_of_another_type_is_refused_in_one_short_line(teacher: object) -> None:
    with pytest.raises(TypeError, match=r"`teacher` must be a torch.nn.Module") as info:
        KnowledgeDistillation(teacher)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    assert type(teacher).__name__ in message
