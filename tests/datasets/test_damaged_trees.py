"""A tree whose marker says complete but whose files do not (a copy cut short, a folder removed) is rendered again,
never reused with shifted labels; a user's file in it still stops the render."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from torchvision.datasets import ImageFolder  # type: ignore[import-untyped]  # torchvision ships no type hints

from lightning_accel.datasets import DigitsDataModule, materialize_digits, materialize_photos


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.jpg")}


def test_a_complete_tree_without_a_class_folder_is_rendered_again_not_mislabelled(tmp_path: Path) -> None:
    """It used to be reused as is: ImageFolder numbered the nine folders left from 0, so every image of the digits
    4..9 was labelled one less, while the data module said 10 classes."""
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=40)
    good = _hashes(root)
    shutil.rmtree(root / "3")
    dm = DigitsDataModule(str(root), image_size=8, num_images=40, num_workers=0, val_fraction=0.0)
    with pytest.warns(UserWarning, match=r"complete digits tree by its marker, but it lacks its class folder '3'"):
        dm.prepare_data()
    dm.setup("fit")
    assert _hashes(root) == good
    assert dm.train_set is not None
    ds = dm.train_set.dataset
    assert isinstance(ds, ImageFolder)
    assert ds.classes == dm.classes and all(Path(p).parent.name == str(y) for p, y in ds.samples)


def test_a_complete_tree_missing_an_image_is_rendered_again_and_identical(tmp_path: Path) -> None:
    root = tmp_path / "p"
    materialize_photos(root, num_images=20, size=32, workers=0)
    good = _hashes(root)
    next(root.rglob("000007.jpg")).unlink()
    with pytest.warns(UserWarning, match=r"lacks 1 of its 20 images"):
        materialize_photos(root, num_images=20, size=32, workers=0)
    assert _hashes(root) == good


def test_a_damaged_tree_holding_a_users_file_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    next(root.rglob("000005.jpg")).unlink()
    (root / "2" / "mine.png").write_bytes(b"user data")
    before = _hashes(root)
    with pytest.raises(ValueError, match=r"holds '2/mine.png', which the digits demo did not write"):
        materialize_digits(root, size=8, num_images=20)
    assert _hashes(root) == before and (root / "2" / "mine.png").read_bytes() == b"user data"


def test_an_intact_tree_is_still_reused_without_a_write(tmp_path: Path) -> None:
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    materialize_digits(root, size=8, num_images=20)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_an_image_copied_into_a_second_class_is_rendered_again(tmp_path: Path) -> None:
    """The same sample under two labels: ImageFolder would read both."""
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    good = _hashes(root)
    src = next(root.rglob("000004.jpg"))
    shutil.copy(src, root / ("5" if src.parent.name != "5" else "6") / src.name)
    with pytest.warns(UserWarning, match=r"holds 1 image\(s\) beyond its 20"):
        materialize_digits(root, size=8, num_images=20)
    assert _hashes(root) == good


def _cut(path: Path, keep: int) -> None:
    """Leave the first ``keep`` bytes of ``path``, as a power loss does to a file whose data was not yet on disk."""
    path.write_bytes(path.read_bytes()[:keep])


def test_images_cut_short_by_a_power_loss_are_rendered_again_never_served(tmp_path: Path) -> None:
    """A JPEG cut short and an empty one under a complete marker used to be reused: the loader then stopped mid-epoch
    with "Truncated File Read"."""
    root = tmp_path / "d"
    materialize_digits(root, size=16, num_images=20)
    good = _hashes(root)
    cut = next(root.rglob("000003.jpg"))
    _cut(cut, cut.stat().st_size // 2)
    _cut(next(root.rglob("000004.jpg")), 0)
    dm = DigitsDataModule(str(root), image_size=16, num_images=20, batch_size=4, num_workers=0, val_fraction=0.0)
    with pytest.warns(UserWarning, match=r"holds 2 image\(s\) cut short or empty \(e\.g\. '3/000003\.jpg'\)"):
        dm.prepare_data()
    dm.setup("fit")
    assert _hashes(root) == good  # the same bytes as the first render
    assert sum(len(x) for x, _ in dm.train_dataloader()) == 20


@pytest.mark.parametrize("keep", [0, 1, 2, 300])
def test_a_photo_cut_short_is_rendered_again_and_identical(tmp_path: Path, keep: int) -> None:
    root = tmp_path / "p"
    materialize_photos(root, num_images=20, size=32, workers=0)
    good = _hashes(root)
    _cut(next(root.rglob("000011.jpg")), keep)
    with pytest.warns(UserWarning, match=r"holds 1 image\(s\) cut short or empty"):
        materialize_photos(root, num_images=20, size=32, workers=0)
    assert _hashes(root) == good
