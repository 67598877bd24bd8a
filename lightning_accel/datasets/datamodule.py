"""The digits as Lightning data modules.

- ``DigitsDataModule``: the plain-Lightning baseline (torchvision ``ImageFolder`` + ``DataLoader``). It materialises
  the digits JPEGs on first use (``prepare_data``, once per node) and splits them deterministically into
  train/validation. Every plugin's benchmark compares against this module.
- ``DigitsCachedDataModule``: the product's :class:`~lightning_accel.data.CachedDataModule` over the same JPEGs,
  rendered into its ``origin`` first (the quickstart's data module).
- ``PhotosCachedDataModule``: the same over the photo data set (:func:`~lightning_accel.datasets.materialize_photos`),
  the end-to-end job's data module (``examples/configs/photos_all_plugins.yaml``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder  # type: ignore[import-untyped]  # torchvision ships no type hints
from torchvision.datasets.folder import IMG_EXTENSIONS  # type: ignore[import-untyped]
from typing_extensions import override

from lightning_accel._utils.checks import check_bool, check_int, check_seed
from lightning_accel.data import CachedDataModule
from lightning_accel.data.dataset import default_num_workers, drop_lone_last_batch, split_indices, split_keys
from lightning_accel.datasets.digits import DIGITS_CLASSES, check_render_target, digits_marker, materialize_digits
from lightning_accel.datasets.photos import PHOTO_CLASSES, check_photos_target, materialize_photos, photos_marker

__all__ = ["DigitsCachedDataModule", "DigitsDataModule", "PhotosCachedDataModule"]

# Digits are white strokes on black; these are the per-channel statistics of the 64 px rendering.
DIGITS_MEAN = (0.188, 0.188, 0.188)
DIGITS_STD = (0.318, 0.318, 0.318)


def _local_dir(name: str, value: object, what: str) -> str:
    """``value`` (a ``str`` or an ``os.PathLike`` such as ``pathlib.Path``) as a ``str``, else one ``TypeError``.

    A ``Path`` is what a script passes for a directory: it used to be refused as "not a local directory" (or, as a
    data module's ``origin``, with "must be a non-empty path"), and ``None`` failed deep in ``pathlib``.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        kind = ValueError if isinstance(value, str) else TypeError
        raise kind(
            f"`{name}` must be a non-empty directory path (a str or pathlib.Path) to hold {what}, got {value!r} "
            f"({type(value).__name__}). Pass e.g. `{name}='data/{what.split()[-1]}'`."
        )
    return value


class _DigitsFolder(ImageFolder):
    """torchvision's ``ImageFolder`` over a digits tree: the class folders ``"0"``..``"9"`` only (label ``i`` is digit
    ``i``), whatever else ``root`` holds. A module-level class: a DataLoader worker started by ``spawn`` or
    ``forkserver`` receives the data set pickled."""

    @override
    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        return list(DIGITS_CLASSES), {c: i for i, c in enumerate(DIGITS_CLASSES)}


def _digits_folder(root: str, transform: Any) -> _DigitsFolder:
    """:class:`_DigitsFolder` over ``root``, skipping every file or folder whose name starts with a dot, as
    :func:`~lightning_accel.data.origin.list_origin` does (the two modules read the same images)."""

    def visible_image(path: str) -> bool:  # used while listing only: the data set does not keep it
        rel = Path(path).relative_to(root)
        return not any(part.startswith(".") for part in rel.parts) and path.lower().endswith(IMG_EXTENSIONS)

    return _DigitsFolder(root, transform=transform, is_valid_file=visible_image)


class DigitsDataModule(LightningDataModule):
    """torchvision ``ImageFolder`` over the digits JPEGs, decoded every epoch (the baseline).

    ``data_dir`` must be new, empty or a tree this module rendered with the same ``image_size`` and ``num_images``: a
    directory of your own images, or digits rendered with other arguments, are refused in ``__init__`` (one
    ``ValueError`` naming ``data_dir``, nothing written); read your own images with
    :class:`~lightning_accel.data.CachedDataModule` (``origin:``) or torchvision's ``ImageFolder``.

    Args:
        data_dir: where the JPEG tree lives or is created (a ``str`` or ``pathlib.Path``; only the demo's own tree,
            see above).
        image_size: side of the rendered images in pixels (at least 8).
        num_images: number of images, at least 10 (``None``: the 1,797 originals; more adds perturbed repeats).
        batch_size: per-device batch size. A last training batch of one image is dropped when the model has a
            BatchNorm layer (it cannot train on one image once a feature map is 1x1, and would normalise by that one
            image's statistics otherwise); every other last batch is kept.
        num_workers: DataLoader workers, 0 or more (``None``: half the CPUs).
        val_fraction: fraction held out for validation (it must leave one image on each side; 0 holds out nothing,
            and validation then reads the training images, as :class:`~lightning_accel.data.CachedDataModule` does).
        augment: random affine augmentation of training images (on the CPU, per sample).
        seed: split seed, ``0 .. 2**32 - 1`` (what ``seed_everything`` takes).

    Raises:
        TypeError: an integer argument that is not one (a bool neither), an ``augment`` that is not a bool, or a
            ``data_dir`` that is not a path.
        ValueError: an argument out of range, a ``val_fraction`` that holds out every image or (above 0) none, or a
            ``data_dir`` the digits may not be rendered into (see above).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] = "data/digits64",
        image_size: int = 64,
        num_images: int | None = None,
        batch_size: int = 64,
        num_workers: int | None = None,
        val_fraction: float = 0.2,
        augment: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        data_dir = _local_dir("data_dir", data_dir, "the digits")
        check_int("batch_size", batch_size, low=1)
        check_int("num_workers", num_workers, low=0, allow_none=True, fix="None uses half the CPUs.")
        check_bool("augment", augment)
        check_seed("seed", seed, what="the train/validation split")
        split_indices(1, val_fraction, seed)  # validates val_fraction early
        # The render's arguments under this module's names: prepare_data is the first to render, after the Trainer
        # has started (and would name the renderer's `size`).
        want = digits_marker(image_size, num_images, size_arg="image_size")
        # the split setup() will make, now: a fraction that rounds to every image left the training split empty, and
        # the fit then ran no step (a Lightning warning about a zero-length loader, not an error)
        n = want["num_images"]
        tr, va = split_indices(n, val_fraction, seed)
        if not tr:
            raise ValueError(
                f"`val_fraction` {val_fraction!r} holds out all {n} images, leaving none to train on. Lower it "
                f"(below {math.floor((n - 0.5) / n * 1e4) / 1e4:g} for {n} images), or render more with `num_images`."
            )
        if val_fraction > 0 and not va:
            # it rounds to no image: validation would silently read the training images (what 0 asks for)
            raise ValueError(
                f"`val_fraction` {val_fraction!r} holds out none of the {n} images. Raise it (to at least "
                f"{math.ceil(1e4 / n) / 1e4:g} for {n} images), or pass 0 to validate on the training images."
            )
        # Before any write (read-only): the digits are rendered into data_dir, which must not be someone's own image
        # folder, nor digits made with other arguments.
        check_render_target(
            data_dir,
            want,
            arg="data_dir",
            fix="for your own images use `lightning_accel.data.CachedDataModule`; else pick a new or empty `data_dir`",
        )
        self.data_dir = str(Path(data_dir).expanduser())
        self.image_size = image_size
        self.num_images = num_images
        self.batch_size = batch_size
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        self.val_fraction = val_fraction
        self.augment = augment
        self.seed = seed
        self.save_hyperparameters()
        self.train_set: Subset | None = None
        self.val_set: Subset | None = None

    def _transforms(self, train: bool) -> Any:
        from torchvision import transforms as T  # type: ignore[import-untyped]  # torchvision ships no type hints

        ops = [T.RandomAffine(degrees=8, translate=(0.06, 0.06), scale=(0.9, 1.1))] if train and self.augment else []
        return T.Compose([*ops, T.ToTensor(), T.Normalize(DIGITS_MEAN, DIGITS_STD)])

    @override
    def prepare_data(self) -> None:
        materialize_digits(self.data_dir, size=self.image_size, num_images=self.num_images, arg="data_dir")

    @override
    def setup(self, stage: str) -> None:
        """Render the digits (a no-op when the tree is complete), then read the class folders ``"0"``..``"9"`` and
        split them.

        The tree is read as :class:`~lightning_accel.data.CachedDataModule` reads it (files and folders whose names
        start with a dot are skipped), with the ten classes fixed: torchvision's ``ImageFolder`` would take any folder
        in ``data_dir`` for a class, so a folder added beside the digits (``.ipynb_checkpoints``, ``0_old``) made it
        fail ("Found no valid file") or shift every label after it.

        Raises:
            ValueError: ``data_dir`` holds a folder beside the class folders whose name does not start with a dot
                (the cached module refuses it too: the two read the same images).
        """
        materialize_digits(self.data_dir, size=self.image_size, num_images=self.num_images, arg="data_dir")
        extra = sorted(
            e.name
            for e in os.scandir(self.data_dir)
            if e.is_dir() and not e.name.startswith(".") and e.name not in DIGITS_CLASSES
        )
        if extra:
            raise ValueError(
                f"`data_dir` {self.data_dir!r} holds the folder(s) {extra[:3]} beside the digits' class folders "
                f"{list(DIGITS_CLASSES)}; they would be read as classes. Move them out of `data_dir`."
            )
        train_full = _digits_folder(self.data_dir, self._transforms(train=True))
        val_full = _digits_folder(self.data_dir, self._transforms(train=False))
        # by each image's relative key, as CachedDataModule splits the same tree: both hold out the same images
        keys = [Path(path).relative_to(self.data_dir).as_posix() for path, _ in train_full.samples]
        tr, va = split_keys(keys, self.val_fraction, self.seed)
        self.train_set = Subset(train_full, tr)
        self.val_set = Subset(val_full, va if va else tr)

    @property
    def classes(self) -> list[str]:
        """Class names, label ``i`` is ``classes[i]`` (the digits ``"0"``..``"9"``)."""
        return list(DIGITS_CLASSES)

    @property
    def num_classes(self) -> int:
        """Number of classes (10); ``ImageClassifier(num_classes="auto")`` reads it."""
        return len(DIGITS_CLASSES)

    def _loader(self, ds: Subset, shuffle: bool, drop_last: bool = False) -> DataLoader:
        return DataLoader(
            ds,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            drop_last=drop_last,
        )

    def _drop_lone_last_batch(self, n: int) -> bool:
        """Whether the training loader drops a last batch of one image the model's BatchNorm cannot train on (see
        :func:`~lightning_accel.data.dataset.drop_lone_last_batch`). Under a distributed strategy a rank reads
        ``ceil(n / world_size)`` images (Lightning's ``DistributedSampler``)."""
        trainer = self.trainer
        if trainer is None:
            return False
        replicas = trainer.world_size if trainer.distributed_sampler_kwargs is not None else 1
        return drop_lone_last_batch(trainer.lightning_module, -(-n // replicas), self.batch_size, type(self).__name__)

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup('fit') first"
        return self._loader(self.train_set, shuffle=True, drop_last=self._drop_lone_last_batch(len(self.train_set)))

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return self._loader(self.val_set, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation split's loader, with a warning: the demo has no test split of its own."""
        rank_zero_warn(f"{type(self).__name__} has no test split: `test` runs on the validation split.")
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class _RenderedCachedDataModule(CachedDataModule):
    """A ``CachedDataModule`` over a demo tree that ``_render`` materialises (idempotent) before it is listed."""

    _origin_made_in_prepare = True

    def _render(self) -> None:
        """Materialise the tree into ``origin``; here nothing: the origin is read as it is."""

    @override
    def prepare_data(self) -> None:
        """Once per node: render the demo tree, then list it (and warm the cache, if asked)."""
        self._render()
        super().prepare_data()

    @override
    def setup(self, stage: str) -> None:
        self._render()  # no-op when complete (prepare_data ran on local rank 0 only)
        super().setup(stage)


class DigitsCachedDataModule(_RenderedCachedDataModule):
    """:class:`~lightning_accel.data.CachedDataModule` over the digits, rendered as JPEGs into ``origin`` first.

    ``prepare_data`` (once per node) renders the digits with :func:`~lightning_accel.datasets.materialize_digits`
    before the cache lists them, and ``setup`` renders again (a no-op once the tree is complete: ``prepare_data`` runs
    on local rank 0 only); everything else is ``CachedDataModule``'s. The quickstart's data module
    (``examples/configs/quickstart.yaml``).

    With ``digits_size`` set, ``origin`` must be new, empty or a tree this module rendered with the same
    ``digits_size`` and ``num_images``: a directory of your own images, or digits rendered with other arguments, are
    refused in ``__init__`` (one ``ValueError`` naming ``origin``, nothing written). For your own data use
    :class:`~lightning_accel.data.CachedDataModule` with ``origin:`` (or ``digits_size=None`` here).

    Args:
        origin: local directory the digits are rendered into (a ``str`` or ``pathlib.Path``; created if missing; only
            the demo's own tree).
        digits_size: side of the rendered JPEGs in pixels (at least 8); ``None``: ``origin`` already holds the digits
            (or any ImageFolder tree), render nothing and write nothing there.
        num_images: images to render, at least 10 (``None``: the 1,797 originals; more adds perturbed repeats);
            only with ``digits_size``.
        **kwargs: :class:`~lightning_accel.data.CachedDataModule` arguments (``cache_dir``, ``batch_size``, ...),
            with its defaults: ``image_size=224`` and the ImageNet ``mean``/``std`` unless given (the quickstart's
            YAML gives ``image_size: 64`` and the digits' statistics); with ``digits_size``, ``classes`` (``None``)
            means the ten digits, so a folder added to ``origin`` beside them is refused in ``setup`` (one line
            naming it) rather than read as an eleventh class; ``seed`` (the shuffle and split seed) is one of
            ``0 .. 2**32 - 1``, what ``seed_everything`` takes.

    Raises:
        TypeError: ``digits_size``, ``num_images`` or ``seed`` is not an integer (a bool neither), or ``origin`` is
            not a path.
        ValueError: ``digits_size``, ``num_images`` or ``seed`` is out of range, or ``num_images`` given without
            ``digits_size``; or ``origin`` is a remote URL, a directory the demo did not write, or digits made with
            other arguments, while ``digits_size`` asks for rendering.
    """

    def __init__(
        self,
        origin: str | os.PathLike[str] = "data/digits64",
        *,
        digits_size: int | None = 64,
        num_images: int | None = None,
        **kwargs: Any,
    ) -> None:
        origin = _local_dir("origin", origin, "the digits")
        if digits_size is not None and "://" in origin and not origin.startswith("file://"):
            raise ValueError(
                f"`origin` must be a local directory to render the digits into, got {origin!r}. Pass a local path, "
                "or `digits_size=None` when the origin already holds the images."
            )
        if digits_size is not None:
            # under this module's names, before the Trainer starts (prepare_data would name the renderer's `size`)
            want = digits_marker(digits_size, num_images, size_arg="digits_size")
        elif num_images is not None:  # nothing is rendered: a count would be silently ignored
            raise ValueError(
                f"`num_images` is only used to render the digits, got num_images={num_images!r} with "
                "digits_size=None (nothing rendered; the origin's images are read as they are). Remove "
                "`num_images`, or set `digits_size` to render that many."
            )
        if digits_size is not None:
            # Before anything is written: rendering into a user's own ImageFolder tree would replace (or mix with)
            # their images, and digits made with other arguments are refused rather than mixed.
            check_render_target(
                origin.removeprefix("file://"),
                want,
                arg="origin",
                fix="for your own images set `digits_size: null` or use `lightning_accel.data.CachedDataModule`; "
                "else pick a new or empty `origin`",
            )
        # with nothing to render the origin must already be there: checked like any CachedDataModule's
        self._origin_made_in_prepare = digits_size is not None
        # the rendered tree's classes, fixed: a folder added beside them would otherwise be listed as a class (one
        # sorting before "9" shifted the labels after it); listed with them, it is refused in `setup`. `None` too:
        # LightningCLI passes every CachedDataModule argument, `classes: null` included
        if digits_size is not None and kwargs.get("classes") is None:
            kwargs["classes"] = list(DIGITS_CLASSES)
        super().__init__(origin, **kwargs)
        self.digits_size = digits_size
        self.num_images = num_images

    def _render(self) -> None:
        if self.digits_size is not None:
            materialize_digits(
                self.origin.removeprefix("file://"), size=self.digits_size, num_images=self.num_images, arg="origin"
            )


class PhotosCachedDataModule(_RenderedCachedDataModule):
    """:class:`~lightning_accel.data.CachedDataModule` over the photo data set, rendered as JPEGs into ``origin`` first.

    ``prepare_data`` (once per node) renders the photos with :func:`~lightning_accel.datasets.materialize_photos`
    before the cache lists them, and ``setup`` renders again (a no-op once the tree is complete); everything else is
    ``CachedDataModule``'s. ``origin`` must be new, empty or a tree this module rendered with the same ``num_images``,
    ``photo_size`` and ``photo_seed``: a directory of your own images, or photos rendered with other arguments, are
    refused in ``__init__`` (one ``ValueError`` naming ``origin``, nothing written).

    Args:
        origin: local directory the photos are rendered into (a ``str`` or ``pathlib.Path``; created if missing; only
            the demo's own tree).
        num_images: images to render (10 classes, balanced; at least 10).
        photo_size: side of the rendered JPEGs in pixels (at least 32).
        photo_seed: the data set's seed, ``0 .. 2**32 - 1`` (same seed, byte-identical files).
        **kwargs: :class:`~lightning_accel.data.CachedDataModule` arguments (``cache_dir``, ``image_size``,
            ``batch_size``, ``train_augment``, ...); ``classes`` (``None``) means ``sorted(PHOTO_CLASSES)``, so a folder
            added to ``origin`` beside them is refused in ``setup`` (one line naming it) rather than read as a class;
            ``seed`` (the shuffle and split seed) is one of ``0 .. 2**32 - 1``, as ``photo_seed``.

    Raises:
        TypeError: ``num_images``, ``photo_size``, ``photo_seed`` or ``seed`` is not an integer (a bool neither), or
            ``origin`` is not a path.
        ValueError: one of them is out of range; or ``origin`` is a remote URL, a directory the demo did not write, or
            photos made with other arguments.
    """

    def __init__(
        self,
        origin: str | os.PathLike[str] = "data/photos",
        *,
        num_images: int = 4000,
        photo_size: int = 384,
        photo_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        origin = _local_dir("origin", origin, "the photos")
        if "://" in origin and not origin.startswith("file://"):
            raise ValueError(
                f"`origin` must be a local directory to render the photos into, got {origin!r}. Pass a local path, "
                "or use `lightning_accel.data.CachedDataModule` for images that are already there."
            )
        # under this module's names, before the Trainer starts (prepare_data would name the renderer's `size`)
        want = photos_marker(num_images, photo_size, photo_seed, size_arg="photo_size", seed_arg="photo_seed")
        check_photos_target(
            origin.removeprefix("file://"),
            want,
            arg="origin",
            fix="for your own images use `lightning_accel.data.CachedDataModule`; else pick a new or empty `origin`",
        )
        # the rendered tree's classes (the folders in sorted order, as listed), fixed as for the digits
        if kwargs.get("classes") is None:
            kwargs["classes"] = sorted(PHOTO_CLASSES)
        super().__init__(origin, **kwargs)
        self.num_images, self.photo_size, self.photo_seed = num_images, photo_size, photo_seed

    def _render(self) -> None:
        materialize_photos(
            self.origin.removeprefix("file://"),
            num_images=self.num_images,
            size=self.photo_size,
            seed=self.photo_seed,
            arg="origin",
        )
