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


def test_the_shape_contrasts_with_its_background_in_every_image() -> None:
    """Inside the drawn shape the image differs from the same render without it by >= 60 levels in some channel on
    average (the colour is 90-160 levels from the background's mean, at 85-100 % opacity, before JPEG)."""
    from lightning_accel.datasets import photos as ph

    arrays = load_photo_arrays()
    for i in range(30):
        _, img = render_photo(arrays, i, 96, 0)
        rng = np.random.default_rng([0, i])  # the same draws up to the shape: its mask
        mask = np.asarray(_replay_mask(ph, arrays, i, rng)) > 127
        colour = np.asarray(img, dtype=np.float32)[mask].mean(0)
        ring = np.asarray(img, dtype=np.float32)[~mask].mean(0)
        assert mask.mean() > 0.02
        assert np.abs(colour - ring).max() > 25, (i, colour, ring)  # against the whole image, a looser bound


def _replay_mask(ph: object, arrays: list[np.ndarray], index: int, rng: np.random.Generator) -> object:
    """The shape mask of image ``index`` at 96 px, drawn with the same rng stream as :func:`render_photo`."""
    calls: list[object] = []
    real = ph._shape_mask  # type: ignore[attr-defined]

    def spy(label: int, size: int, r: np.random.Generator) -> object:
        calls.append(m := real(label, size, r))
        return m

    ph._shape_mask = spy  # type: ignore[attr-defined]
    try:
        render_photo(arrays, index, 96, 0)
    finally:
        ph._shape_mask = real  # type: ignore[attr-defined]
    return calls[0]


def test_contrasting_colour_is_far_from_the_background_per_channel() -> None:
    from lightning_accel.datasets.photos import _contrasting_colour

    rng = np.random.default_rng(0)
    alpha = np.zeros((8, 8), np.float32)
    alpha[2:6, 2:6] = 1.0
    for bg in ((0, 0, 0), (255, 255, 255), (128, 20, 240), (60, 200, 100)):
        img = np.broadcast_to(np.asarray(bg, np.float32), (8, 8, 3)).copy()
        c = _contrasting_colour(img, alpha, rng)
        assert np.all(np.abs(c - np.asarray(bg)) >= 90) and np.all((c >= 0) & (c <= 255)), (bg, c)


def test_a_tree_of_an_older_format_is_rebuilt_only_when_it_holds_only_its_own_files(tmp_path: Path) -> None:
    root = tmp_path / "p"
    materialize_photos(root, num_images=10, size=48, workers=0)
    new = _hashes(root)
    marker = json.loads((root / MARKER).read_text())
    old = {**marker, "format_version": marker["format_version"] - 1}
    (root / MARKER).write_text(json.dumps(old))
    (root / "circle" / "000000.jpg").write_bytes(b"an older render")
    materialize_photos(root, num_images=10, size=48, workers=0)  # same arguments, older format: rebuilt
    assert json.loads((root / MARKER).read_text()) == marker and _hashes(root) == new
    (root / MARKER).write_text(json.dumps(old))
    (root / "ring" / "holiday.jpg").write_bytes(b"user bytes")
    with pytest.raises(ValueError, match=r"'ring/holiday.jpg', which the photos demo did not write"):
        materialize_photos(root, num_images=10, size=48, workers=0)
    assert (root / "ring" / "holiday.jpg").read_bytes() == b"user bytes"
    (root / "ring" / "holiday.jpg").unlink()
    (root / MARKER).write_text(json.dumps({**old, "seed": 5}))  # an older format of other arguments: refused
    with pytest.raises(ValueError, match="already holds photos made with"):
        materialize_photos(root, num_images=10, size=48, workers=0)


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


@pytest.mark.parametrize(
    ("kwargs", "kind", "match"),
    [
        ({"num_images": 5}, ValueError, r"`num_images` must be an integer >= 10, got 5"),
        ({"photo_size": 8}, ValueError, r"`photo_size` must be an integer >= 32, got 8"),
        ({"photo_seed": -1}, ValueError, r"`photo_seed` must be an integer >= 0 and <= 4294967295, got -1"),
        ({"photo_size": 64.0}, TypeError, r"`photo_size` must be an integer >= 32, got 64.0 \(float\)"),
    ],
)
def test_data_module_refuses_bad_arguments_in_init(
    tmp_path: Path, kwargs: dict, kind: type[Exception], match: str
) -> None:
    with pytest.raises(kind, match=match):
        PhotosCachedDataModule(str(tmp_path / "p"), cache_dir=str(tmp_path / "cache"), **kwargs)
    assert not (tmp_path / "p").exists()


def test_data_module_refuses_photos_made_with_other_arguments_in_init(tmp_path: Path) -> None:
    root = tmp_path / "p"
    materialize_photos(root, num_images=10, size=48, workers=0)
    with pytest.raises(ValueError, match=r"^`origin` .* already holds photos made with .*'size': 48.*'size': 64"):
        PhotosCachedDataModule(str(root), num_images=10, photo_size=64, cache_dir=str(tmp_path / "cache"))
    PhotosCachedDataModule(str(root), num_images=10, photo_size=48, cache_dir=str(tmp_path / "cache"))  # reused


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


def test_data_module_refuses_a_folder_added_beside_the_classes(tmp_path: Path) -> None:
    """A folder added to a rendered tree (`b_old` sorts between `bar` and `circle`) used to be listed as an eleventh
    class, every label after it shifted by one; it is refused in `setup` in one line naming it."""
    root = tmp_path / "p"
    materialize_photos(root, num_images=10, size=32, workers=0)
    (root / "b_old").mkdir()
    (root / "b_old" / "000000.jpg").write_bytes(next((root / "circle").glob("*.jpg")).read_bytes())
    dm = PhotosCachedDataModule(  # `classes: null` as LightningCLI passes it from a YAML config
        str(root), num_images=10, photo_size=32, cache_dir=str(tmp_path / "cache"), ram_bytes=0, num_workers=0,
        classes=None,
    )  # fmt: skip
    assert dm.num_classes == 10
    with pytest.raises(ValueError, match=r"^`origin` .*\['b_old'\][^\n]*Remove the folder") as exc:
        dm.setup("fit")
    assert "\n" not in str(exc.value)
