"""The demo data modules check their directory, seed and split arguments in `__init__`, in one line naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accel.datasets import DigitsCachedDataModule, DigitsDataModule, PhotosCachedDataModule


@pytest.mark.parametrize(
    ("kwargs", "kind", "match"),
    [
        # torch's generator raised "Overflow when unpacking long long" (no argument named)
        (
            {"seed": 2**64},
            ValueError,
            r"^`seed` must be an integer >= 0 and <= 4294967295, got 18446744073709551616\. It seeds",
        ),
        # pathlib raised "expected str, bytes or os.PathLike object, not NoneType"
        ({"data_dir": None}, TypeError, r"^`data_dir` must be a non-empty directory path .*got None \(NoneType\)"),
        # an empty string used to mean the current directory
        ({"data_dir": ""}, ValueError, r"^`data_dir` must be a non-empty directory path"),
        # a split that holds out every image: the fit then ran no step
        ({"num_images": 10, "val_fraction": 0.95}, ValueError, r"^`val_fraction` 0.95 holds out all 10 images"),
        # a fraction that rounds to no image: validation silently read the training images
        (
            {"num_images": 10, "val_fraction": 0.04},
            ValueError,
            r"^`val_fraction` 0.04 holds out none of the 10 images\. Raise it \(to at least 0.1 for 10 images\)",
        ),
    ],
    ids=["seed-overflow", "data-dir-none", "data-dir-empty", "empty-train-split", "empty-val-split"],
)
def test_digits_module_refuses_in_init(
    tmp_path: Path, kwargs: dict[str, Any], kind: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"data_dir": str(tmp_path / "d"), **kwargs}
    with pytest.raises(kind, match=match) as exc:
        DigitsDataModule(**args)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "d").exists()


def test_a_split_leaving_one_training_image_is_accepted(tmp_path: Path) -> None:
    DigitsDataModule(str(tmp_path / "d"), num_images=10, val_fraction=0.9)
    DigitsDataModule(str(tmp_path / "d"), seed=2**32 - 1)  # the largest seed `seed_everything` takes
    DigitsDataModule(str(tmp_path / "d"), num_images=10, val_fraction=0.1)  # the smallest that holds one out
    DigitsDataModule(str(tmp_path / "d"), num_images=10, val_fraction=0)  # validates on the training images


def test_a_pathlib_origin_is_a_local_directory(tmp_path: Path) -> None:
    """A ``Path`` used to be refused: "`origin` must be a local directory to render the photos into, got
    PosixPath(...)" (and, for the digits, by CachedDataModule as "must be a non-empty path")."""
    photos = PhotosCachedDataModule(tmp_path / "p", num_images=10, photo_size=32, cache_dir=str(tmp_path / "c1"))
    digits = DigitsCachedDataModule(tmp_path / "d", digits_size=8, num_images=10, cache_dir=str(tmp_path / "c2"))
    assert photos.origin == str(tmp_path / "p") and digits.origin == str(tmp_path / "d")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "note.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^`origin` .*mine.* is not a photos demo tree"):  # still checked in init
        PhotosCachedDataModule(tmp_path / "mine", cache_dir=str(tmp_path / "c3"))
    with pytest.raises(TypeError, match=r"^`origin` must be a non-empty directory path .*got 3 \(int\)"):
        PhotosCachedDataModule(3)  # type: ignore[arg-type]


def test_an_unwritable_origin_names_the_argument_it_came_from(tmp_path: Path) -> None:
    """The photos' hint used to say `root=/tmp/photos` to a data module that has no `root`."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    dm = PhotosCachedDataModule(str(blocker / "p"), num_images=10, photo_size=32, cache_dir=str(tmp_path / "c"))
    with pytest.raises(PermissionError, match=r"^Cannot write the photos .* \(e\.g\. `origin=/tmp/photos`\)\.$"):
        dm.prepare_data()
    digits = DigitsDataModule(str(blocker / "d"), num_images=10, image_size=8)
    with pytest.raises(PermissionError, match=r"^Cannot write the digits .* \(e\.g\. `data_dir=/tmp/digits`; "):
        digits.prepare_data()


def test_the_photo_render_forks_one_worker_per_usable_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process allowed 2 of a machine's 64 CPUs (taskset, Slurm) used to fork 64 rendering workers onto them."""
    import os
    from types import SimpleNamespace

    from lightning_accel.datasets import materialize_photos
    from lightning_accel.datasets import photos as photos_mod

    sizes: list[int] = []

    class _InlinePool:  # records the pool's size, renders in this process
        def __init__(self, n: int, **_: Any) -> None:
            sizes.append(n)

        def __enter__(self) -> _InlinePool:
            return self

        def __exit__(self, *_: Any) -> None:
            return None

        def map(self, fn: Any, jobs: list[Any], chunksize: int = 1) -> list[Any]:
            return [fn(j) for j in jobs]

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(photos_mod.mp, "get_context", lambda method: SimpleNamespace(Pool=_InlinePool))
    materialize_photos(tmp_path / "p", num_images=10, size=32)
    assert sizes == [2] and len(list((tmp_path / "p").rglob("*.jpg"))) == 10
