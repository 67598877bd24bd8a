from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision.datasets import ImageFolder  # type: ignore[import-untyped]  # torchvision ships no type hints

from lightning_accel.data import CachedDataModule
from lightning_accel.datasets import DigitsCachedDataModule, DigitsDataModule


def test_datamodule_batches(digits_dir: Path) -> None:
    dm = DigitsDataModule(data_dir=str(digits_dir), image_size=32, batch_size=16, num_workers=0)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert dm.train_set is not None and dm.val_set is not None
    assert len(dm.train_set) + len(dm.val_set) == 1797
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1, got 0"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(TypeError, match="`batch_size`"):
        DigitsDataModule(batch_size=True)


def test_cli_yaml_builds_the_cached_digits_module(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"""
model:
  class_path: lightning_accel.models.ImageClassifier
data:
  class_path: lightning_accel.datasets.DigitsCachedDataModule
  init_args:
    origin: {tmp_path / "digits"}
    digits_size: 16
    num_images: 50
    cache_dir: {tmp_path / "cache"}
    ram_bytes: 0
    ssd_bytes: 64MiB
    image_size: 16
    train_augment:
      class_path: lightning_accel.data.GpuAugment
      init_args: {{crop_scale: [0.5, 1.0], flip_p: 0.0}}
"""
    )
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    dm = cli.datamodule
    assert isinstance(dm, CachedDataModule) and dm.ssd_bytes == 64 << 20 and dm.train_augment.crop_scale == (0.5, 1.0)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert len(dm.train_set) + len(dm.val_set) == 50


def test_cached_digits_render_in_setup_too(tmp_path: Path) -> None:
    # a rank other than local rank 0 skips prepare_data: setup renders (a no-op once the tree is complete)
    dm = DigitsCachedDataModule(
        str(tmp_path / "digits"),
        digits_size=8,
        num_images=30,
        image_size=8,
        cache_dir=str(tmp_path / "cache"),
        ram_bytes=0,
    )
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert len(dm.train_set) + len(dm.val_set) == 30
    x, y = dm.train_set.__getitems__([0, 1])
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.uint8 and len(y) == 2


def test_cached_digits_without_rendering_read_an_existing_tree(digits_dir: Path, tmp_path: Path) -> None:
    dm = DigitsCachedDataModule(
        str(digits_dir), digits_size=None, image_size=32, cache_dir=str(tmp_path / "cache"), ram_bytes=0
    )
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    assert len(dm.train_set) + len(dm.val_set) == 1797
    # nothing to render: a missing tree is refused when the module is built, as CachedDataModule's is
    with pytest.raises(FileNotFoundError, match="`origin` '.*absent' does not exist"):
        DigitsCachedDataModule(str(tmp_path / "absent"), digits_size=None, cache_dir=str(tmp_path / "cache"))
    DigitsCachedDataModule(str(tmp_path / "new"), cache_dir=str(tmp_path / "cache"))  # rendered in prepare_data


def test_cached_digits_need_a_local_origin_to_render_into() -> None:
    with pytest.raises(ValueError, match="`origin` must be a local directory"):
        DigitsCachedDataModule("s3://bucket/digits")
    DigitsCachedDataModule("s3://bucket/digits", digits_size=None)  # reading an existing remote tree is fine


def test_cached_digits_refuse_a_count_with_nothing_to_render(digits_dir: Path, tmp_path: Path) -> None:
    # nothing is rendered without `digits_size`: the count would be silently ignored
    with pytest.raises(ValueError, match=r"`num_images` is only used to render.*num_images=500 with digits_size=None"):
        DigitsCachedDataModule(str(digits_dir), digits_size=None, num_images=500, cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize(
    ("module", "kwargs", "kind", "match"),
    [
        ("plain", {"image_size": 4}, ValueError, r"`image_size` must be an integer >= 8, got 4\. It is the side"),
        ("plain", {"image_size": True}, TypeError, r"`image_size` must be an integer >= 8, got True \(bool\)"),
        ("plain", {"num_images": 0}, ValueError, r"`num_images` must be an integer >= 10 or None, got 0"),
        # fewer images than classes: some class folder would stay empty, which failed only after the render
        ("plain", {"num_images": 9}, ValueError, r"`num_images` must be an integer >= 10 or None, got 9\. Every one"),
        (
            "plain",
            {"seed": "a"},
            TypeError,
            r"^`seed` must be an integer >= 0 and <= 4294967295, got 'a' \(str\)\. It seeds the",
        ),
        ("plain", {"augment": "yes"}, TypeError, r"^`augment` must be True or False, got 'yes' \(str\)"),
        ("plain", {"num_workers": -3}, ValueError, r"`num_workers` must be an integer >= 0 or None, got -3"),
        ("cached", {"digits_size": 0}, ValueError, r"`digits_size` must be an integer >= 8, got 0\. It is the side"),
        ("cached", {"num_images": 0}, ValueError, r"`num_images` must be an integer >= 10 or None, got 0"),
        ("cached", {"num_images": 5}, ValueError, r"`num_images` must be an integer >= 10 or None, got 5\. Every one"),
        ("cached", {"digits_size": None, "num_images": "9"}, ValueError, r"`num_images` is only used to render"),
    ],
)
def test_bad_arguments_are_refused_in_init_under_their_own_names(
    tmp_path: Path, module: str, kwargs: dict, kind: type[Exception], match: str
) -> None:
    with pytest.raises(kind, match=match):
        if module == "plain":
            DigitsDataModule(data_dir=str(tmp_path / "d"), **kwargs)
        else:
            DigitsCachedDataModule(str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"), **kwargs)
    assert not (tmp_path / "d").exists()


def test_a_tree_made_with_other_arguments_is_refused_in_init_naming_the_directory_argument(tmp_path: Path) -> None:
    from lightning_accel.datasets import materialize_digits

    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    with pytest.raises(ValueError, match=r"^`data_dir` .* already holds digits made with .*'size': 8.*'size': 16"):
        DigitsDataModule(data_dir=str(root), image_size=16, num_images=20)
    with pytest.raises(ValueError, match=r"^`origin` .* already holds digits made with .*'num_images': 20.* 30"):
        DigitsCachedDataModule(str(root), digits_size=8, num_images=30, cache_dir=str(tmp_path / "cache"))
    DigitsDataModule(data_dir=str(root), image_size=8, num_images=20)  # the same arguments: reused
    # a tree that changes between __init__ and prepare_data is still refused under the user's argument name
    dm = DigitsDataModule(data_dir=str(tmp_path / "late"), image_size=16, num_images=20)
    materialize_digits(tmp_path / "late", size=8, num_images=20)
    with pytest.raises(ValueError, match=r"^`data_dir` .* already holds digits made with"):
        dm.prepare_data()


def test_the_plain_and_the_cached_module_hold_out_the_same_images(digits_dir: Path, tmp_path: Path) -> None:
    """Both split a tree by each image's relative key, so a comparison of the two validates on the same images."""
    plain = DigitsDataModule(data_dir=str(digits_dir), image_size=32, val_fraction=0.1, seed=3)
    plain.setup("fit")
    assert plain.val_set is not None
    folder = plain.val_set.dataset
    assert isinstance(folder, ImageFolder)
    plain_val = {Path(folder.samples[i][0]).relative_to(digits_dir).as_posix() for i in plain.val_set.indices}
    cached = CachedDataModule(
        origin=str(digits_dir), cache_dir=str(tmp_path / "c"), image_size=32, val_fraction=0.1, seed=3, ram_bytes=0
    )
    cached.setup("fit")
    val = cached.val_set
    assert val is not None
    cached_val = {val.cache.listing.keys[i] for i in val.indices}
    assert len(plain_val) == 180 and plain_val == cached_val
