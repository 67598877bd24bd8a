"""Skeleton: tensors out, placeholders in, safe to load; unsafe objects refused with their key path."""

from __future__ import annotations

import enum
from collections import OrderedDict

import numpy as np
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


class _StrKey(str, enum.Enum):
    A = "a"


class _IntKey(int, enum.Enum):
    B = 1


@pytest.mark.parametrize(
    "value,where",
    [
        ({"v": {_StrKey.A: 1}}, "/v"),
        ({"v": {_IntKey.B: 1}}, "/v"),
        ({"v": {np.float64(0.5): 1}}, "/v"),
        ({"v": frozenset({3})}, "/v"),
        ({"v": [_StrKey.A]}, "/v/0"),
    ],
    ids=["str-enum-key", "int-enum-key", "numpy-float-key", "frozenset", "str-enum-value"],
)
def test_what_the_weights_only_loader_refuses_is_refused_at_save(value: dict, where: str) -> None:
    # Each of these passes an isinstance test but not `torch.load(weights_only=True)`: written, it could never load.
    with pytest.raises(UnsafeCheckpointContent, match=f"`{where}`"):
        split(value)


def test_every_allowed_key_and_leaf_type_loads_back() -> None:
    leaves = ["s", b"b", 1, 2.5, True, None, 1j, torch.float16, torch.device("cpu"), torch.Size([2, 3])]
    ckpt = {"keys": {k: i for i, k in enumerate(leaves)}, "leaves": leaves, "set": {1, "a"}}
    back = load_skeleton(dump_skeleton(split(ckpt)[0]))
    assert back == ckpt
