"""Every `seed` argument of the demo takes what `seed_everything` takes (0 .. 2**32 - 1) and refuses the rest in one
line naming it (they used to take torch's -2**63 .. 2**64 - 1, or any integer >= 0 for the photos)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.fabric.utilities.seed as lightning_seed
import pytest

from lightning_accel._utils.checks import SEED_MAX, SEED_MIN
from lightning_accel.datasets import (
    DigitsCachedDataModule,
    DigitsDataModule,
    PhotosCachedDataModule,
    materialize_photos,
)
from lightning_accel.datasets.photos import photos_marker
from lightning_accel.models.gpt2 import gpt2_lm


def test_the_range_is_seed_everythings() -> None:
    assert (lightning_seed.min_seed_value, lightning_seed.max_seed_value) == (SEED_MIN, SEED_MAX)
    lightning_seed.seed_everything(SEED_MAX, verbose=False)  # the largest is one seed_everything takes
    with pytest.raises(ValueError, match="not in bounds"):
        lightning_seed.seed_everything(SEED_MAX + 1, verbose=False)


def _seeders(tmp: Path) -> dict[str, tuple[str, Callable[[int], Any]]]:
    """Each seed argument: its name in the message, and a call that passes it (writing nothing when refused)."""
    return {
        "gpt2_lm": ("seed", lambda s: gpt2_lm(layers=1, width=8, heads=2, seed=s)),
        "photos_marker": ("seed", lambda s: photos_marker(10, 32, s)),
        "materialize_photos": ("seed", lambda s: materialize_photos(tmp / "p", num_images=10, size=32, seed=s)),
        "DigitsDataModule": ("seed", lambda s: DigitsDataModule(tmp / "d", num_images=10, seed=s)),
        "PhotosCachedDataModule.photo_seed": (
            "photo_seed",
            lambda s: PhotosCachedDataModule(tmp / "p", num_images=10, photo_size=32, photo_seed=s, cache_dir=tmp),
        ),
        "PhotosCachedDataModule.seed": (
            "seed",
            lambda s: PhotosCachedDataModule(tmp / "p", num_images=10, photo_size=32, seed=s, cache_dir=tmp),
        ),
        "DigitsCachedDataModule.seed": (
            "seed",
            lambda s: DigitsCachedDataModule(tmp / "d", digits_size=8, num_images=10, seed=s, cache_dir=tmp),
        ),
    }


@pytest.mark.parametrize("where", list(_seeders(Path("."))))
@pytest.mark.parametrize("seed", [-1, 2**32, 2**63, 2**64 - 1])
def test_a_seed_seed_everything_refuses_is_refused(tmp_path: Path, where: str, seed: int) -> None:
    name, call = _seeders(tmp_path)[where]
    with pytest.raises(
        ValueError, match=rf"^`{name}` must be an integer >= 0 and <= 4294967295, got {seed}\. It seeds"
    ):
        call(seed)
    assert not (tmp_path / "p").exists() and not (tmp_path / "d").exists()


# materialize_photos would render: photos_marker checks its seed
@pytest.mark.parametrize("where", [w for w in _seeders(Path(".")) if w != "materialize_photos"])
def test_the_ends_of_the_range_are_taken(tmp_path: Path, where: str) -> None:
    _, call = _seeders(tmp_path)[where]
    call(0)
    call(2**32 - 1)


@pytest.mark.parametrize("where", list(_seeders(Path("."))))
def test_a_seed_of_another_type_is_a_type_error(tmp_path: Path, where: str) -> None:
    name, call = _seeders(tmp_path)[where]
    with pytest.raises(TypeError, match=rf"^`{name}` must be an integer >= 0 and <= 4294967295, got True \(bool\)"):
        call(True)
