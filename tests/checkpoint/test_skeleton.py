"""Skeleton: tensors out, placeholders in, safe to load; unsafe objects refused with their key path."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from lightning_accel.checkpoint.skeleton import (
    PLACEHOLDER,
    UnsafeCheckpointContent,
    dump_skeleton,
    fill_skeleton,
    load_skeleton,
    split,
)


def test_split_fill_round_trip() -> None:
    big, small = torch.randn(600), torch.tensor(3.0)
    ckpt = {
        "a": OrderedDict(w=big),
        "b": [small, (1, "x", None)],
        "c": {"n": 2.5, "d": torch.float16},
        3: {big.clone().sum().item()},
    }
    skel, tensors = split(ckpt)
    assert list(tensors) == ["a/w", "b/0"] and skel["a"]["w"] == PLACEHOLDER + "a/w"
    back = fill_skeleton(load_skeleton(dump_skeleton(skel)), tensors)
    assert torch.equal(back["a"]["w"], big) and isinstance(back["a"], OrderedDict)
    assert torch.equal(back["b"][0], small) and back["b"][1] == (1, "x", None) and back["c"]["d"] is torch.float16


class Custom:
    pass


@pytest.mark.parametrize(
    "value,where",
    [({"x": {"y": Custom()}}, "/x/y"), ({"cb": [1, lambda: 0]}, "/cb/1"), ({Custom(): 1}, "/")],
)
def test_unsafe_objects_are_refused_with_their_path(value: dict, where: str) -> None:
    with pytest.raises(UnsafeCheckpointContent, match=f"`{where}`"):
        split(value)


def test_reserved_placeholder_string_refused() -> None:
    with pytest.raises(UnsafeCheckpointContent, match="reserved"):
        split({"s": PLACEHOLDER + "x"})


def test_duplicate_names_get_suffixes() -> None:
    _, tensors = split({"a/b": torch.zeros(300), "a": {"b": torch.ones(300)}})
    assert sorted(tensors) == ["a%2Fb", "a/b"]
