"""The class list of ``CachedDataModule``: fixed once (training origin or ``classes``), every split labelled through it,
part of the cache key and of the checkpointed state."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.data import CachedDataModule, ObjectStore, list_origin


def _tree(root: Path, classes: dict[str, int], src: Path) -> Path:
    """An ImageFolder tree with ``n`` JPEGs of the digits fixture per class name (0 makes an empty folder)."""
    jpgs = sorted(src.rglob("*.jpg"))
    k = 0
    for name, n in classes.items():
        (root / name).mkdir(parents=True)
        for _ in range(n):
            shutil.copy(jpgs[k], root / name / f"{k:04d}.jpg")
            k += 1
    return root


def _dm(origin: Path, tmp: Path, **kw: Any) -> CachedDataModule:
    kw = {"cache_dir": str(tmp / "cache"), "ram_bytes": 0, "image_size": 16, "num_workers": 0, "batch_size": 4, **kw}
    kw.setdefault("val_fraction", 0.0)  # trees of a few images: hold out nothing (0.1 of 4 would be no sample)
    return CachedDataModule(str(origin), **kw)


def _labels(ds: Any) -> dict[str, set[int]]:
    """class folder -> labels the dataset yields for its samples."""
    out: dict[str, set[int]] = {}
    _, y = ds.__getitems__(list(range(len(ds))))
    for pos, label in zip(ds.indices, y.tolist(), strict=True):
        out.setdefault(ds.cache.listing.keys[pos].split("/")[0], set()).add(int(label))
    return out


def test_val_origin_missing_a_class_keeps_the_training_labels(small_digits: Path, tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"a": 3, "b": 3, "c": 3}, small_digits)
    val = _tree(tmp_path / "val", {"a": 2, "c": 2}, small_digits)  # no "b"
    dm = _dm(train, tmp_path, val_origin=str(val))
    dm.setup("fit")
    assert dm.classes == ["a", "b", "c"] and dm.num_classes == 3
    assert _labels(dm.train_set) == {"a": {0}, "b": {1}, "c": {2}}
    assert _labels(dm.val_set) == {"a": {0}, "c": {2}}  # "c" is 2 in both splits, not 1
    assert list_origin(ObjectStore(str(val))).labels[-1] == 1  # what the val tree alone would have said


def test_explicit_classes_fix_the_labels_and_the_cache_key(small_digits: Path, tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"b": 2, "c": 2}, small_digits)
    dm = _dm(train, tmp_path, classes=["a", "b", "c"])
    assert dm.classes == ["a", "b", "c"]  # known before setup when given
    dm.setup("fit")
    assert _labels(dm.train_set) == {"b": {1}, "c": {2}} and dm.num_classes == 3
    other = _dm(train, tmp_path)  # same origin and cache_dir, other class list: other cache entries
    other.setup("fit")
    assert _labels(other.train_set) == {"b": {0}, "c": {1}}
    assert other.train_set is not None and dm.train_set is not None
    assert other.train_set.cache.namespace != dm.train_set.cache.namespace
    with pytest.raises(ValueError, match=r"`origin` .* class folder\(s\) \['c'\] that the training classes"):
        _dm(train, tmp_path, classes=["a", "b"]).setup("fit")
    for bad in ([], ["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="`classes` must be a non-empty list of distinct class names"):
            _dm(train, tmp_path, classes=bad)
    for wrong in ("abc", [1, 2], 3):
        with pytest.raises(TypeError, match=r"`classes` must be a non-empty list of distinct class names.*\(\w+\)"):
            _dm(train, tmp_path, classes=wrong)


def test_classes_before_setup_is_an_error(small_digits: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"setup\(\)"):
        _ = _dm(small_digits, tmp_path).classes


def test_empty_class_folder_is_an_error(small_digits: Path, tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"a": 2, "b": 0, "c": 2}, small_digits)
    dm = _dm(train, tmp_path)
    with pytest.raises(ValueError, match=r"class folder\(s\) \['b'\] holding no files") as e:
        dm.prepare_data()
    assert "\n" not in str(e.value)
    val = _tree(tmp_path / "val", {"a": 1, "c": 0}, small_digits)
    train2 = _tree(tmp_path / "train2", {"a": 2, "c": 2}, small_digits)
    with pytest.raises(ValueError, match=r"`origin` .*\['c'\] holding no files"):
        _dm(train2, tmp_path, val_origin=str(val)).setup("fit")


def test_unknown_validation_class_is_an_error(small_digits: Path, tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"a": 2, "b": 2}, small_digits)
    val = _tree(tmp_path / "val", {"a": 1, "z": 1}, small_digits)
    with pytest.raises(ValueError, match=r"`val_origin` .* class folder\(s\) \['z'\] that the training classes") as e:
        _dm(train, tmp_path, val_origin=str(val)).setup("fit")
    assert "\n" not in str(e.value)


def test_manifest_labels_are_checked_against_the_training_labels(tmp_path: Path, small_digits: Path) -> None:
    for name, labels in (("train", [0, 1, 2]), ("val", [0, 3])):
        root = tmp_path / name
        root.mkdir()
        jpgs = sorted(small_digits.rglob("*.jpg"))
        lines = []
        for k, y in enumerate(labels):
            shutil.copy(jpgs[k], root / f"{k}.jpg")
            lines.append(f'{{"key": "{k}.jpg", "label": {y}}}')
        (root / "m.jsonl").write_text("\n".join(lines))
    dm = _dm(tmp_path / "train", tmp_path, manifest="m.jsonl", val_origin=str(tmp_path / "val"))
    with pytest.raises(ValueError, match=r"`val_origin` .* has label 3, but the training classes have only 3"):
        dm.setup("fit")


def test_state_dict_carries_the_classes_and_a_resume_on_other_classes_fails(small_digits: Path, tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"a": 2, "b": 2, "c": 2}, small_digits)
    dm = _dm(train, tmp_path)
    dm.setup("fit")
    state = dm.state_dict()
    assert state["classes"] == ["a", "b", "c"]
    same = _dm(train, tmp_path)
    same.load_state_dict(state)  # before setup: checked there
    same.setup("fit")
    other = _tree(tmp_path / "other", {"a": 2, "c": 2}, small_digits)
    late = _dm(other, tmp_path)
    late.setup("fit")
    with pytest.raises(ValueError, match=r"the checkpoint was trained on 3 classes .* has 2 classes") as e:
        late.load_state_dict(state)  # after setup, where Lightning restores it
    assert "\n" not in str(e.value)
    early = _dm(other, tmp_path)
    early.load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint was trained on 3 classes"):
        early.setup("fit")
    old = _dm(other, tmp_path)
    old.load_state_dict({})  # a checkpoint without classes (written before they were saved) is accepted
    old.setup("fit")
    assert old.classes == ["a", "c"]
