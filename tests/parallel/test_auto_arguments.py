"""``AutoStrategy`` argument checks that need no Trainer: one line at construction, naming the argument."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_accel.parallel.strategies import AutoStrategy


@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_candidates_list_is_refused_with_the_fix(empty: Any) -> None:
    # it meant "every plan", like None, while reading as "time no plan"
    with pytest.raises(ValueError, match=r"^`candidates` must be a non-empty list of plan names \(of 'ddp', ") as e:
        AutoStrategy(policy="measure", candidates=empty)
    msg = str(e.value)
    assert "\n" not in msg and f"got {empty!r}. Use None to time every plan the memory estimate lets fit." in msg


def test_none_and_a_list_of_plans_are_accepted() -> None:
    assert AutoStrategy(policy="measure", candidates=None).candidates is None
    assert AutoStrategy(policy="measure", candidates=["ddp", "fsdp"]).candidates == ["ddp", "fsdp"]
