"""An argument that the other arguments make unused is refused in ``__init__``, not silently ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.data import CachedDataModule, GpuAugment


def test_a_shuffle_window_under_the_global_shuffle_is_refused(small_digits: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^`shuffle_window` 8 has no effect with `shuffle='global'`.*'window'"):
        CachedDataModule(str(small_digits), cache_dir=str(tmp_path), shuffle="global", shuffle_window=8)
    for shuffle in ("window", "auto"):  # a window applies (to a packed origin)
        dm = CachedDataModule(str(small_digits), cache_dir=str(tmp_path), shuffle=shuffle, shuffle_window=8)
        assert dm.shuffle_window == 8


def _invert(images: torch.Tensor, train: bool = False) -> torch.Tensor:
    """A plain callable augmentation (not a ``GpuAugment``)."""
    return 1.0 - images.float() / 255


def test_cpu_augment_thread_without_a_gpu_augment_is_refused(small_digits: Path, tmp_path: Path) -> None:
    """Only a ``GpuAugment`` (whose batch ``k`` draws from its own seeded stream) can be augmented ahead on the loader's
    thread: with any other ``train_augment`` an explicit ``cpu_augment="thread"`` would be ignored."""
    kw: dict[str, Any] = {"cache_dir": str(tmp_path), "train_augment": _invert}
    with pytest.raises(
        ValueError,
        match=r"^`cpu_augment` 'thread' needs a GpuAugment `train_augment`, got <function _invert .*> \(function\)",
    ):
        CachedDataModule(str(small_digits), cpu_augment="thread", **kw)
    assert CachedDataModule(str(small_digits), **kw).cpu_augment == "step"  # left out: where it runs, the step
    assert CachedDataModule(str(small_digits), cpu_augment="step", **kw).cpu_augment == "step"
    # a GpuAugment (the default one included) runs on the thread unless told otherwise
    assert CachedDataModule(str(small_digits), cache_dir=str(tmp_path)).cpu_augment == "thread"
    dm = CachedDataModule(str(small_digits), cache_dir=str(tmp_path), train_augment=GpuAugment(flip_p=0.5))
    assert dm.cpu_augment == "thread"
    with pytest.raises(TypeError, match=r"`cpu_augment` must be one of 'thread', 'step', None"):
        CachedDataModule(str(small_digits), cpu_augment=1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["mean", "std"])
def test_mean_or_std_with_both_augmentations_given_is_refused(small_digits: Path, tmp_path: Path, name: str) -> None:
    """``mean`` and ``std`` set the default augmentations' normalisation: with ``train_augment`` and ``val_augment``
    both given there is none left to set, and the values were dropped."""
    both: dict[str, Any] = {"train_augment": GpuAugment(flip_p=0.5), "val_augment": GpuAugment(flip_p=0.0)}
    with pytest.raises(ValueError, match=rf"^`{name}` \(0\.5, 0\.5, 0\.5\) has no effect: `train_augment` and "):
        CachedDataModule(str(small_digits), cache_dir=str(tmp_path), **{name: (0.5,) * 3}, **both)
    with pytest.raises(ValueError, match=rf"^`{name}` \(0\.5, 0\.5, 0\.5\) has no effect: "):
        plain = {"train_augment": GpuAugment(flip_p=0.5), "val_augment": _invert}  # not a GpuAugment: no `{name}`
        CachedDataModule(str(small_digits), cache_dir=str(tmp_path), **{name: (0.5,) * 3}, **plain)
    same = getattr(both["train_augment"], name)  # the value both already have: redundant, nothing is dropped
    dm = CachedDataModule(str(small_digits), cache_dir=str(tmp_path), **{name: same}, **both)
    assert dm.train_augment is both["train_augment"] and dm.val_augment is both["val_augment"]
    # with either augmentation left to its default, the value applies to it
    for kw in ({"train_augment": both["train_augment"]}, {"val_augment": both["val_augment"]}):
        dm = CachedDataModule(str(small_digits), cache_dir=str(tmp_path), mean=(0.5,) * 3, std=(0.5,) * 3, **kw)
        default = dm.val_augment if "train_augment" in kw else dm.train_augment
        assert isinstance(default, GpuAugment) and getattr(default, name) == (0.5,) * 3


@pytest.mark.parametrize(
    ("kw", "channels", "needs"),
    [
        ({"saturation": 0.2}, 1, r"3 channels \(RGB\)"),
        ({"saturation": 0.2}, 4, r"3 channels \(RGB\)"),
        ({"contrast": 0.2}, 4, r"1 or 3 channels \(grey or RGB\)"),
        ({"contrast": 0.2}, 2, r"1 or 3 channels \(grey or RGB\)"),
    ],
)
def test_a_colour_jitter_the_channels_cannot_take_is_refused(kw: dict[str, float], channels: int, needs: str) -> None:
    """``mean``/``std`` fix the channel count (``forward`` refuses any other): a jitter that count cannot take (the
    saturation of a grey image) was skipped in every batch."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"^`{name}` 0\.2 needs {needs}, but `mean`/`std` give {channels}: "):
        GpuAugment((0.5,) * channels, (0.2,) * channels, **kw)
    for ok in ((0.5,) * 3, (0.5,) if name == "contrast" else (0.5,) * 3):
        aug = GpuAugment(ok, (0.2,) * len(ok), **kw)
        assert getattr(aug, name) == 0.2
    GpuAugment((0.5,) * channels, (0.2,) * channels, **{name: 0.0})  # 0: no jitter asked for
