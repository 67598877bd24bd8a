"""Render scikit-learn's digits as JPEG files in an ImageFolder tree (``<root>/<class>/<index>.jpg``).

Contract:

- Real data: the 1,797 8x8 images that ship inside scikit-learn (no download), upscaled to ``size`` px RGB.
- ``num_images`` above 1,797 repeats the set with deterministic small perturbations (rotation, shift, scale,
  brightness), so the same arguments always give byte-identical files.
- Idempotent and crash-safe: the marker file ``.lightning_accel_digits.json`` is written first (saying "rendering")
  and rewritten last (saying what the tree holds). A tree whose marker matches the arguments is reused as is, one whose
  marker says "rendering" (a run killed halfway), or whose class folders lack an image (a copy cut short) or hold one
  that is not a whole JPEG (empty or cut short by a power loss), is rebuilt, one whose marker differs is refused rather
  than mixed.
- Never writes into someone else's directory: it renders only into a directory that does not exist, is empty, or
  carries its own marker and nothing but the class folders of ``NNNNNN.jpg`` files it writes. Anything else (a user's
  ImageFolder tree, a note file) is refused with one line before the first write, and left as it was.
- One render of a directory at a time (a lock file, ``.lightning_accel_digits.lock``, held for the whole render: a
  second render waits), and no partial image under a final name (each is written to a temporary name and renamed);
  see :mod:`lightning_accel.datasets._tree`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_accel._utils.checks import check_int
from lightning_accel._utils.imports import require
from lightning_accel.datasets._tree import TreeSpec, check_tree, publish_image, render_tree, resolve_root

__all__ = [
    "DIGITS_CLASSES",
    "DigitsInfo",
    "check_render_target",
    "digits_marker",
    "digits_tokens",
    "load_digits_arrays",
    "materialize_digits",
]

DIGITS_CLASSES = tuple(str(i) for i in range(10))
DIGITS_COUNT = 1797  # images in scikit-learn's digits (checked by the tests against the loaded arrays)
MARKER = ".lightning_accel_digits.json"
_FORMAT_VERSION = 1
_SPEC = TreeSpec(
    what="digits",
    marker=MARKER,
    classes=DIGITS_CLASSES,
    info_keys=frozenset({"size", "num_images", "quality", "format_version"}),
    writable_hint="e.g. `{arg}=/tmp/digits`; in the quickstart `--data.origin=/tmp/digits`",
)
DEFAULT_FIX = "for your own images use `lightning_accel.data.CachedDataModule`; else pick a new or empty directory"


@dataclass(frozen=True)
class DigitsInfo:
    """What a materialised tree holds (also the marker file's content)."""

    root: str
    size: int
    num_images: int
    quality: int
    format_version: int = _FORMAT_VERSION

    def class_counts(self) -> dict[str, int]:
        """Images per class directory, counted from disk."""
        return {c: len(list((Path(self.root) / c).glob("*.jpg"))) for c in DIGITS_CLASSES}


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The raw digits: ``images`` uint8 (1797, 8, 8) in [0, 16] and ``labels`` int64 (1797,)."""
    require("sklearn", purpose="The embedded digits data set", pip_name="scikit-learn")
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


def digits_tokens() -> tuple[np.ndarray, np.ndarray]:
    """Digits as token sequences for language-model style training.

    Returns:
        ``tokens`` int64 (1797, 65): token 0 is the class id + 17 (a "prompt"), then the 64 pixel intensities
        (0..16) in raster order; vocabulary size 27. ``labels`` int64 (1797,).
    """
    images, labels = load_digits_arrays()
    tokens = np.concatenate([(labels + 17)[:, None], images.reshape(len(images), 64).astype(np.int64)], axis=1)
    return tokens, labels


def _render(img8: np.ndarray, size: int, repeat: int, index: int):
    """Upscale one 8x8 digit to a ``size`` px RGB PIL image; ``repeat > 0`` adds a seeded perturbation."""
    from PIL import Image

    gray = Image.fromarray((img8.astype(np.float32) * (255.0 / 16.0)).round().astype(np.uint8), mode="L")
    # Pad by one cell so perturbations never cut the stroke, then upscale smoothly (bicubic looks like a scan).
    canvas = Image.new("L", (10, 10), 0)
    canvas.paste(gray, (1, 1))
    big = canvas.resize((size, size), Image.Resampling.BICUBIC)
    if repeat > 0:
        rng = np.random.default_rng([repeat, index])
        angle = float(rng.uniform(-10, 10))
        dx, dy = (float(v) for v in rng.uniform(-0.06, 0.06, size=2) * size)
        scale = float(rng.uniform(0.9, 1.1))
        big = big.rotate(
            angle,
            resample=Image.Resampling.BILINEAR,
            translate=(dx, dy),  # type: ignore[arg-type]  # sub-pixel shifts: PIL takes floats, its hints say int
        )
        if abs(scale - 1.0) > 1e-3:
            s = max(1, round(size * scale))
            scaled = big.resize((s, s), Image.Resampling.BILINEAR)
            off = (s - size) // 2
            big = scaled.crop((off, off, off + size, off + size)) if s >= size else _pad_center(scaled, size)
        gain = float(rng.uniform(0.85, 1.15))
        big = big.point(lambda p: min(255, int(p * gain)))
    return big.convert("RGB")


def _pad_center(img, size: int):
    from PIL import Image

    out = Image.new("L", (size, size), 0)
    off = (size - img.size[0]) // 2
    out.paste(img, (off, off))
    return out


def digits_marker(
    size: int = 64,
    num_images: int | None = None,
    quality: int = 90,
    *,
    size_arg: str = "size",
    count_arg: str = "num_images",
) -> dict[str, int]:
    """The marker content a render with these arguments writes (what :func:`check_render_target` compares a tree's
    marker with), after checking the arguments: a data module checks its own in ``__init__`` through this.

    Args:
        size: side of the square images in pixels (at least 8).
        num_images: total images, at least 10: image ``i`` is scikit-learn's digit ``i % 1797`` (the first ten are
            the digits 0-9 in order), and a class without images would fail the loader only after the render (None:
            the 1,797 originals).
        quality: JPEG quality.
        size_arg: the name of ``size`` quoted in the error (a data module's ``image_size`` / ``digits_size``).
        count_arg: the name of ``num_images`` quoted in the error.

    Raises:
        TypeError: an argument that is not an integer (a bool neither).
        ValueError: an argument out of range.
    """
    check_int(size_arg, size, low=8, fix="It is the side of the images in pixels.")
    check_int(
        count_arg,
        num_images,
        low=10,
        allow_none=True,
        fix="Every one of the 10 classes needs an image: pass 10 or more, or None for the 1,797 originals.",
    )
    check_int("quality", quality, low=1, high=100, fix="It is the JPEG quality.")
    n = DIGITS_COUNT if num_images is None else num_images
    return {"size": size, "num_images": n, "quality": quality, "format_version": _FORMAT_VERSION}


def materialize_digits(
    root: str | os.PathLike[str],
    *,
    size: int = 64,
    num_images: int | None = None,
    quality: int = 90,
    arg: str = "root",
) -> DigitsInfo:
    """Write the digits as ``<root>/<class>/<index:06d>.jpg`` and return what is there.

    While another process renders into ``root``, this call waits for it (one warning says so), then reuses, rebuilds
    or refuses what it left, as for any tree.

    Args:
        root: a local directory (created if missing).
        size: side of the square images in pixels (e.g. 64 for the quickstart, 224 for benchmarks).
        num_images: total images (at least 10); defaults to the 1,797 originals. More repeats them with perturbations.
        quality: JPEG quality.
        arg: the name of ``root`` quoted in errors (a data module's ``data_dir`` / ``origin``).

    Raises:
        TypeError: a ``size``/``num_images``/``quality`` that is not an integer (a bool neither), or a ``root`` that is
            not a path.
        ValueError: bad ``size``/``num_images``/``quality``; an empty ``root`` (it is not the current directory);
            ``root`` already holds digits made with other arguments;
            or ``root`` holds files the renderer did not write (see :func:`check_render_target`), nothing written.
        PermissionError: ``root`` cannot be written.
    """
    want = digits_marker(size, num_images, quality)
    n = want["num_images"]
    root_p = resolve_root(root, arg=arg, what="digits")
    info = DigitsInfo(root=str(root_p), **want)

    def draw() -> None:
        # Only a (re)build needs the arrays: a complete tree is reused without loading scikit-learn (setup() calls
        # this on every rank after prepare_data() built it).
        images, labels = load_digits_arrays()
        base = len(images)
        for i in range(n):
            src = i % base
            img = _render(images[src], size, i // base, src)
            publish_image(img, root_p / str(int(labels[src])) / f"{i:06d}.jpg", quality)

    render_tree(_SPEC, root_p, want, draw, arg=arg, fix=DEFAULT_FIX)
    return info


def check_render_target(
    root: str | os.PathLike[str],
    want: dict | None = None,
    *,
    arg: str = "root",
    fix: str = DEFAULT_FIX,
) -> str:
    """Decide, without writing anything, whether the digits may be rendered into ``root``.

    Args:
        root: the directory to render into.
        want: the marker content the render would write (``size``, ``num_images``, ``quality``, ``format_version``);
            ``None`` checks only that ``root`` is the demo's (or new, or empty), not which arguments made it.
        arg: the argument name quoted in the error (``origin``, ``data_dir``, ...).
        fix: what to do instead, quoted at the end of the error.

    Returns:
        ``"reuse"``: a complete tree made with ``want`` is there; ``"build"``: rendering may (re)write it.

    Raises:
        ValueError: (one line) ``root`` holds anything the renderer did not write, or digits made with other arguments.
    """
    return check_tree(_SPEC, root, want, arg=arg, fix=fix)
