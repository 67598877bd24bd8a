from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_accel.datasets import (
    DIGITS_CLASSES,
    digits_tokens,
    load_digits_arrays,
    materialize_digits,
    materialize_photos,
)
from lightning_accel.datasets.digits import DIGITS_COUNT, MARKER


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.jpg")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_real_digits_arrays() -> None:
    images, labels = load_digits_arrays()
    assert images.shape == (DIGITS_COUNT, 8, 8) == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 16
    assert sorted(set(labels.tolist())) == list(range(10))


def test_session_tree_is_imagefolder(digits_dir: Path) -> None:
    from torchvision.datasets import ImageFolder  # type: ignore[import-untyped]  # torchvision ships no type hints

    ds = ImageFolder(str(digits_dir))
    assert len(ds) == 1797 and ds.classes == list(DIGITS_CLASSES)
    img, label = ds[0]
    assert img.size == (32, 32) and img.mode == "RGB" and label == 0
    assert json.loads((digits_dir / MARKER).read_text())["num_images"] == 1797


def test_repeats_are_deterministic_and_perturbed(tmp_path: Path) -> None:
    a = materialize_digits(tmp_path / "a", size=16, num_images=1797 + 40)
    materialize_digits(tmp_path / "b", size=16, num_images=1797 + 40)
    assert a.num_images == 1837 and sum(a.class_counts().values()) == 1837
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    # a repeat differs from its original (perturbation), but keeps the label
    from PIL import Image

    orig, rep = tmp_path / "a" / "0" / "000000.jpg", tmp_path / "a" / "0" / "001797.jpg"
    assert rep.exists()
    assert not np.array_equal(np.asarray(Image.open(orig)), np.asarray(Image.open(rep)))


def test_idempotent_and_interrupted_run_is_redone(tmp_path: Path) -> None:
    import json

    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=30)
    stamp = (root / "0" / "000000.jpg").stat().st_mtime_ns
    materialize_digits(root, size=8, num_images=30)  # complete: reused untouched
    assert (root / "0" / "000000.jpg").stat().st_mtime_ns == stamp
    # simulate a run killed halfway: the marker still says "rendering", a partial file is present
    marker = json.loads((root / MARKER).read_text())
    (root / MARKER).write_text(json.dumps({**marker, "state": "rendering"}))
    (root / "3" / "000003.jpg").write_bytes(b"\xff\xd8partial")
    (root / "4" / "000004.jpg").unlink()
    materialize_digits(root, size=8, num_images=30)
    assert json.loads((root / MARKER).read_text()) == marker
    assert sum(1 for _ in root.rglob("*.jpg")) == 30
    from PIL import Image

    Image.open(root / "3" / "000003.jpg").load()
    Image.open(root / "4" / "000004.jpg").load()


def test_mismatched_marker_is_refused(tmp_path: Path) -> None:
    materialize_digits(tmp_path, size=8, num_images=20)
    with pytest.raises(ValueError, match=r"already holds digits.*another directory"):
        materialize_digits(tmp_path, size=16, num_images=20)


@pytest.mark.parametrize(
    ("kwargs", "kind", "match"),
    [
        ({"size": 4}, ValueError, "`size` must be an integer >= 8, got 4. It is the side of the images in pixels"),
        ({"num_images": 0}, ValueError, "`num_images` must be an integer >= 10 or None, got 0"),
        ({"num_images": 9}, ValueError, "`num_images` must be an integer >= 10 or None, got 9. Every one of the 10"),
        ({"quality": 101}, ValueError, "`quality` must be an integer >= 1 and <= 100, got 101"),
        ({"size": True}, TypeError, "`size` must be an integer >= 8, got True \\(bool\\)"),
        ({"num_images": 2.0}, TypeError, "`num_images`"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, kind: type[Exception], match: str) -> None:
    with pytest.raises(kind, match=match):
        materialize_digits(tmp_path, **kwargs)


def test_unwritable_root_is_clear(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match=r"Cannot write the digits.*writable directory"):
        materialize_digits(blocker / "sub", size=8, num_images=10)


def test_sklearn_missing_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel._utils import imports

    imports.module_available.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setattr(imports.importlib.util, "find_spec", lambda name: None if name == "sklearn" else object())
    try:
        with pytest.raises(ModuleNotFoundError, match=r"pip install scikit-learn"):
            materialize_digits(tmp_path, size=8)
    finally:
        imports.module_available.cache_clear()


def test_tokens() -> None:
    tokens, labels = digits_tokens()
    assert tokens.shape == (1797, 65) and tokens.max() < 27
    assert (tokens[:, 0] == labels + 17).all()


@pytest.mark.parametrize("render", ["digits", "photos"])
@pytest.mark.parametrize(
    ("root", "kind", "match"),
    [
        # an empty string resolved to the current directory: the digits were rendered into it when it was empty
        ("", ValueError, r"^`root` must be a non-empty directory path .*, got '' \(str\)\. Pass e\.g\. `root='data/"),
        # os.fspath's "expected str, bytes or os.PathLike object, not NoneType", naming no argument
        (None, TypeError, r"^`root` must be a non-empty directory path .*, got None \(NoneType\)\. Pass e\.g\."),
    ],
)
def test_an_empty_or_missing_root_is_refused_never_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, render: str, root: object, kind: type[Exception], match: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kind, match=match) as exc:
        if render == "digits":
            materialize_digits(root, size=8, num_images=10)  # type: ignore[arg-type]
        else:
            materialize_photos(root, num_images=10, size=32, workers=0)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)
    assert list(tmp_path.iterdir()) == []
