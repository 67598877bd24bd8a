"""The digits demo never writes into a directory of someone's own images (every renderer, every entry point)."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.datasets import DigitsCachedDataModule, DigitsDataModule, materialize_digits
from lightning_accel.datasets.digits import MARKER


def _user_tree(root: Path, classes: list[str]) -> Path:
    """A user's ImageFolder: two real JPEGs per class and a note file at the top."""
    from PIL import Image

    for i, c in enumerate(classes):
        (root / c).mkdir(parents=True)
        for j in range(2):
            Image.new("RGB", (12, 12), (20 * i, 40 * j, 90)).save(root / c / f"photo_{j}.jpg", format="JPEG")
    (root / "NOTES.txt").write_text("my own labels, do not lose\n")
    return root


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    } | {str(p.relative_to(root)) + "/": "dir" for p in root.rglob("*") if p.is_dir()}


def _one_line_error(exc: pytest.ExceptionInfo[ValueError], root: Path) -> str:
    msg = str(exc.value)
    # the CLI prints it after `lightning-accel: error: data: ` within 400 characters
    assert "\n" not in msg and len(msg) - len(str(root.resolve())) <= 300, msg
    assert str(root.resolve()) in msg
    return msg


@pytest.mark.parametrize(
    "classes", [[str(i) for i in range(10)], ["cat", "dog", "heron"]], ids=["digit_names", "other"]
)
def test_user_image_folder_is_refused_and_left_byte_identical(tmp_path: Path, classes: list[str]) -> None:
    root = _user_tree(tmp_path / "mine", classes)
    before = _hashes(root)

    with pytest.raises(ValueError) as exc:
        DigitsCachedDataModule(str(root), digits_size=64, cache_dir=str(tmp_path / "cache"), ram_bytes=0)
    msg = _one_line_error(exc, root)
    assert "`origin`" in msg and "`digits_size: null`" in msg and "lightning_accel.data.CachedDataModule" in msg

    with pytest.raises(ValueError) as exc:
        DigitsDataModule(data_dir=str(root))
    msg = _one_line_error(exc, root)
    assert "`data_dir`" in msg and "lightning_accel.data.CachedDataModule" in msg

    with pytest.raises(ValueError) as exc:
        materialize_digits(root, size=8, num_images=20)
    assert "`root`" in _one_line_error(exc, root)

    assert _hashes(root) == before
    assert not (root / MARKER).exists()


def test_user_folder_without_rendering_is_read_not_written(tmp_path: Path) -> None:
    root = _user_tree(tmp_path / "mine", ["cat", "dog"])
    before = _hashes(root)
    dm = DigitsCachedDataModule(
        str(root), digits_size=None, image_size=8, cache_dir=str(tmp_path / "c"), ram_bytes=0, val_fraction=0.5
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert len(dm.train_set) == 2 and len(dm.val_set) == 2
    assert _hashes(root) == before


def test_a_file_added_to_an_unfinished_demo_tree_is_not_deleted(tmp_path: Path) -> None:
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=30)
    # the renderer's in-progress marker (a run killed halfway), and a file of the user's beside the digits
    marker = root / MARKER
    marker.write_text(marker.read_text()[:-1] + ', "state": "rendering"}')
    (root / "5" / "mine.jpg").write_bytes(b"user bytes")
    before = _hashes(root)
    with pytest.raises(ValueError, match=r"'5/mine.jpg', which the digits demo did not write") as exc:
        materialize_digits(root, size=8, num_images=30)
    _one_line_error(exc, root)
    assert _hashes(root) == before


def test_complete_demo_tree_and_empty_dir_are_accepted(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    DigitsDataModule(data_dir=str(empty))  # empty: allowed
    info = materialize_digits(empty, size=8, num_images=20)
    assert sum(1 for _ in empty.rglob("*.jpg")) == 20 and info.num_images == 20
    (empty / "README").write_text("notes beside a finished demo tree\n")
    DigitsCachedDataModule(str(empty), digits_size=8, num_images=20)  # the demo's own (complete) tree: reused
    materialize_digits(empty, size=8, num_images=20)  # reuse writes nothing, so it leaves the note alone
    assert (empty / "README").read_text() == "notes beside a finished demo tree\n"


def test_forged_marker_does_not_make_a_folder_ours(tmp_path: Path) -> None:
    root = _user_tree(tmp_path / "mine", ["0", "1"])
    (root / MARKER).write_text('{"hello": 1}')  # not a marker the renderer writes
    before = _hashes(root)
    with pytest.raises(ValueError, match=r"is not a digits demo tree \(no `.lightning_accel_digits.json` marker\)"):
        materialize_digits(root, size=8, num_images=20)
    assert _hashes(root) == before


def test_quickstart_pointed_at_a_user_folder_is_one_cli_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_accel.cli import main

    root = _user_tree(tmp_path / "mine", [str(i) for i in range(10)])
    before = _hashes(root)
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "quickstart.yaml"
    argv = ["fit", "--config", str(config), f"--data.origin={root}", f"--data.cache_dir={tmp_path}/cache"]
    argv += [f"--trainer.default_root_dir={tmp_path}/run", "--trainer.logger=false"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning-accel: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "`digits_size: null`" in lines[0] and "lightning_accel.data.CachedDataModule" in lines[0]
    assert len(lines[0]) - len(str(root.resolve())) <= 400 - 60
    assert _hashes(root) == before


def _planted(root: Path, folder: str) -> Path:
    """A rendered digits tree with ``folder`` added beside the class folders, holding a copy of digit 0."""
    materialize_digits(root, size=8, num_images=30)
    (root / folder).mkdir()
    (root / folder / "000000-copy.jpg").write_bytes((root / "0" / "000000.jpg").read_bytes())
    return root


def test_a_hidden_folder_beside_the_digits_is_not_read_as_a_class(tmp_path: Path) -> None:
    """A folder such as Jupyter's `.ipynb_checkpoints` inside `data_dir` used to be a class of the plain module's
    `ImageFolder`: label 0, so digit d was labelled d + 1 (or, empty, the fit stopped with "Found no valid file")."""
    root = _planted(tmp_path / "d", ".ipynb_checkpoints")
    (root / "3" / ".ipynb_checkpoints").mkdir()
    (root / "3" / ".ipynb_checkpoints" / "000003-copy.jpg").write_bytes((root / "3" / "000003.jpg").read_bytes())
    dm = DigitsDataModule(root, image_size=8, num_images=30, num_workers=0, val_fraction=0.2)
    dm.setup("fit")
    assert dm.train_set is not None
    folder: Any = dm.train_set.dataset
    assert folder.classes == [str(i) for i in range(10)]
    assert len(folder.samples) == 30  # the renderer's images only
    assert all(Path(path).parent.name == str(label) for path, label in folder.samples)
    # a DataLoader worker started by spawn / forkserver receives the data set pickled
    assert pickle.loads(pickle.dumps(dm.train_set)).dataset.samples == folder.samples


@pytest.mark.parametrize("module", ["plain", "cached", "cached_from_yaml"])
def test_a_visible_folder_beside_the_digits_is_refused_in_one_line(tmp_path: Path, module: str) -> None:
    """A folder named like `0_old` sorts among the digits: both modules used to read it as a class, shifting the
    labels of the digits after it (the cached module then also reported 11 classes)."""
    root = _planted(tmp_path / "d", "0_old")
    dm: DigitsDataModule | DigitsCachedDataModule
    if module == "plain":
        dm = DigitsDataModule(root, image_size=8, num_images=30, num_workers=0)
    else:
        # from a YAML config LightningCLI passes every argument, `classes: null` included
        extra = {"classes": None} if module == "cached_from_yaml" else {}
        dm = DigitsCachedDataModule(
            root, digits_size=8, num_images=30, num_workers=0, image_size=8, cache_dir=str(tmp_path / "c"), **extra
        )
        assert dm.num_classes == 10
    with pytest.raises(ValueError, match="0_old") as exc:
        dm.setup("fit")
    _one_line_error(exc, root)
