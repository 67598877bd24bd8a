"""``StructuredPruning`` argument checks that need no Trainer: one line at construction, naming the argument."""

from __future__ import annotations

import pytest

from lightning_accel.callbacks import StructuredPruning


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_target_is_refused_with_the_fix(empty: str) -> None:
    # `get_submodule("")` is the module itself: an empty name pruned the whole model, like None
    with pytest.raises(ValueError, match=r"^`target` must be the dotted name of a submodule or None, got ") as e:
        StructuredPruning(0.5, target=empty)
    msg = str(e.value)
    assert "\n" not in msg and f"got {empty!r}. Use None to prune the whole LightningModule" in msg


def test_none_and_a_dotted_name_are_accepted() -> None:
    assert StructuredPruning(0.5).target is None
    assert StructuredPruning(0.5, target="model.backbone").target == "model.backbone"
