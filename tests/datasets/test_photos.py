"""The photo demo data set: photo-sized JPEGs, deterministic bytes, the class drawn in, the digits' disk contract."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_accel.datasets import PHOTO_CLASSES, PhotosCachedDataModule, load_photo_arrays, materialize_photos
from lightning_accel.datasets.photos import MARKER, render_photo


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.jpg")}


def test_photo_sized_jpegs_with_balanced_classes(tmp_path: Path) -> None:
    from PIL import Image

    info = materialize_photos(tmp_path / "p", num_images=30, workers=0)
    assert info.class_counts() == dict.fromkeys(PHOTO_CLASSES, 3)
    for i in (0, 7, 29):
        f = tmp_path / "p" / PHOTO_CLASSES[i % 10] / f"{i:06d}.jpg"
        assert f.stat().st_size >= 30 * 1024, (f, f.stat().st_size)
        with Image.open(f) as im:
            assert im.size == (384, 384) and im.mode == "RGB" and im.format == "JPEG"


def test_same_bytes_whatever_the_workers_and_another_seed_differs(tmp_path: Path) -> None:
    materialize_photos(tmp_path / "a", num_images=20, workers=0)
    materialize_photos(tmp_path / "b", num_images=20, workers=2)
    materialize_photos(tmp_path / "c", num_images=20, seed=1, workers=0)
    a, b, c = (_hashes(tmp_path / d) for d in "abc")
    assert a == b and len(a) == 20
    assert set(a) == set(c) and all(a[k] != c[k] for k in a)


def test_the_class_is_what_differs() -> None:
    """The drawn shape changes pixels inside it only: the same background with another class's shape differs by a
    blob covering a few percent of the image, and the shapes of two classes are not the same masks."""
    from lightning_accel.datasets.photos import _shape_mask

    masks = [np.asarray(_shape_mask(k, 96, np.random.default_rng(0))) > 0 for k in range(10)]
    for k in range(10):
        assert 0.02 < masks[k].mean() < 0.5, (PHOTO_CLASSES[k], masks[k].mean())
        for j in range(k):
            assert (masks[k] != masks[j]).mean() > 0.005, (PHOTO_CLASSES[k], PHOTO_CLASSES[j])
    photos = load_photo_arrays()
    label, img = render_photo(photos, 13, 96, 0)
    assert label == 3 and img.size == (96, 96)
    assert np.array_equal(np.asarray(img), np.asarray(render_photo(photos, 13, 96, 0)[1]))


def test_idempotent_rebuilds_a_killed_render_and_refuses_other_arguments(tmp_path: Path) -> None:
    root = tmp_path / "p"
    materialize_photos(root, num_images=20, size=64, workers=0)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    materialize_photos(root, num_images=20, size=64, workers=0)  # reused: nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")} == before
    with pytest.raises(ValueError, match=r"already holds photos made with .*another directory"):
        materialize_photos(root, num_images=20, size=96, workers=0)
    # a run killed halfway: the marker still says "rendering", a file is cut short, another missing
    marker = json.loads((root / MARKER).read_text())
    (root / MARKER).write_text(json.dumps({**marker, "state": "rendering"}))
    good = _hashes(root)
    (root / "circle" / "000000.jpg").write_bytes(b"\xff\xd8partial")
    (root / "star" / "000004.jpg").unlink()
    materialize_photos(root, num_images=20, size=64, workers=0)
    assert json.loads((root / MARKER).read_text()) == marker and _hashes(root) == good


def test_a_users_folder_is_refused_and_left_byte_identical(tmp_path: Path) -> None:
    from PIL import Image

    root = tmp_path / "mine"
    (root / "circle").mkdir(parents=True)
    Image.new("RGB", (12, 12), (1, 2, 3)).save(root / "circle" / "000000.jpg", format="JPEG")
    (root / "NOTES.txt").write_text("mine\n")
    before = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"is not a photos demo tree \(no `.lightning_accel_photos.json` marker\)"):
        materialize_photos(root, num_images=10, workers=0)
    with pytest.raises(ValueError, match=r"`origin` .* is not a photos demo tree.*lightning_accel.data.CachedData"):
        PhotosCachedDataModule(str(root), cache_dir=str(tmp_path / "cache"), ram_bytes=0)
    # planted beside a finished render that a killed rerun left "rendering": refused, nothing touched
    ours = tmp_path / "ours"
    materialize_photos(ours, num_images=10, size=48, workers=0)
    marker = json.loads((ours / MARKER).read_text())
    (ours / MARKER).write_text(json.dumps({**marker, "state": "rendering"}))
    (ours / "ring" / "holiday.jpg").write_bytes(b"user bytes")
    with pytest.raises(ValueError, match=r"'ring/holiday.jpg', which the photos demo did not write"):
        materialize_photos(ours, num_images=10, size=48, workers=0)
    assert (ours / "ring" / "holiday.jpg").read_bytes() == b"user bytes"
    assert {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="`origin` must be a local directory to render the photos into"):
        PhotosCachedDataModule("s3://bucket/photos")


@pytest.mark.parametrize(
    ("kwargs", "kind", "match"),
    [
        ({"num_images": 5}, ValueError, "`num_images` must be an integer >= 10, got 5"),
        ({"size": 16}, ValueError, "`size` must be an integer >= 32, got 16"),
        ({"quality": 0}, ValueError, "`quality` must be an integer >= 1 and <= 100, got 0"),
        ({"seed": True}, TypeError, "`seed`"),
        ({"workers": -1}, ValueError, "`workers`"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, kind: type[Exception], match: str) -> None:
    with pytest.raises(kind, match=match):
        materialize_photos(tmp_path / "p", **kwargs)
    assert not (tmp_path / "p").exists()


def test_data_module_renders_then_caches(tmp_path: Path) -> None:
    dm = PhotosCachedDataModule(
        str(tmp_path / "p"), num_images=20, photo_size=64, cache_dir=str(tmp_path / "cache"), ram_bytes=0,
        image_size=32, batch_size=4, val_fraction=0.2, num_workers=0,
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    assert dm.num_classes == 10 and list(dm.classes) == sorted(PHOTO_CLASSES)
    x, y = next(iter(dm.train_dataloader()))
    assert tuple(x.shape[1:]) == (3, 32, 32) and len(y) == 4
