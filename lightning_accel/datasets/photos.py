"""Render a 10-class photo data set as JPEG files in an ImageFolder tree (``<root>/<class>/<index>.jpg``).

Contract:

- Real-photo statistics, no download: every image is a random crop (position, scale, aspect) of one of the two
  photographs that ship inside scikit-learn (``load_sample_images()``: 427x640 px), resized to ``size`` px, flipped,
  colour-shifted (per-channel gain, brightness) and grained (sensor-like noise), with the class drawn into it: one of
  ten filled shapes (:data:`PHOTO_CLASSES`) at a random place, size, rotation and opacity, in a random colour 90-160
  levels per channel away from the background under it (visible at the training resolution in every image).
  Learnable, not trivially: at 64 px a star, a cross and a ring of 13-20 px differ by a few pixels on a textured
  background.
- Photo-sized files: ``size`` >= 384 px at ``quality`` 90 gives 33-60 KB per JPEG, ~46 KB median (200 images at 384 px:
  9 % below 40 KB); decoding one costs several times a 224 px digit (``docs/performance.md`` has the measured numbers).
- Deterministic: image ``i`` is drawn from ``numpy.random.default_rng([seed, i])`` alone, so the same arguments give
  byte-identical files whatever ``workers`` renders them; its shape is ``PHOTO_CLASSES[i % 10]`` (balanced classes).
- Labels: :data:`PHOTO_CLASSES` is the render order, not the training labels. ``ImageFolder`` and the data modules
  number the class folders in sorted order (``bar`` is label 0): name a prediction with the data module's
  ``classes[label]``, never with ``PHOTO_CLASSES[label]``.
- Fast: the images are rendered by ``workers`` forked processes (default: every CPU this process may use); 4,000
  images at 384 px take ~15 s on 2 cores. The workers die with the render: on Linux the kernel kills them when the
  rendering process dies (``PR_SET_PDEATHSIG``), elsewhere each stops before its next image once its parent is gone;
  so a render killed halfway stops writing, and the next render of the folder does not mix the killed one's images
  into its own.
- Idempotent, crash-safe, one render of a folder at a time and never writing into someone else's directory: the same
  contract as the digits (:mod:`lightning_accel.datasets._tree`: marker ``.lightning_accel_photos.json``, lock file
  ``.lightning_accel_photos.lock``, images renamed into place).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing as mp
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_accel._utils.checks import check_int, check_seed
from lightning_accel._utils.imports import require
from lightning_accel.datasets._tree import TreeSpec, check_tree, publish_image, render_tree, resolve_root

# per process: the photographs and grain banks, made once (fork copies them from the parent)
_WORKER: dict[Any, Any] = {}

__all__ = [
    "PHOTO_CLASSES",
    "PhotosInfo",
    "check_photos_target",
    "load_photo_arrays",
    "materialize_photos",
    "photos_marker",
]

PHOTO_CLASSES = (
    "circle",
    "triangle",
    "square",
    "diamond",
    "star",
    "cross",
    "x_cross",
    "ring",
    "half_disc",
    "bar",
)
MARKER = ".lightning_accel_photos.json"
_FORMAT_VERSION = 2  # 2: the shape's colour contrasts with its background
_SPEC = TreeSpec(
    what="photos",
    marker=MARKER,
    classes=PHOTO_CLASSES,
    info_keys=frozenset({"size", "num_images", "quality", "seed", "format_version"}),
    writable_hint="e.g. `{arg}=/tmp/photos`",
)
DEFAULT_FIX = "for your own images use `lightning_accel.data.CachedDataModule`; else pick a new or empty directory"


@dataclass(frozen=True)
class PhotosInfo:
    """What a materialised tree holds (also the marker file's content, without ``root``)."""

    root: str
    size: int
    num_images: int
    quality: int
    seed: int
    format_version: int = _FORMAT_VERSION

    def class_counts(self) -> dict[str, int]:
        """Images per class directory, counted from disk."""
        return {c: len(list((Path(self.root) / c).glob("*.jpg"))) for c in PHOTO_CLASSES}


def load_photo_arrays() -> list[np.ndarray]:
    """scikit-learn's two sample photographs as uint8 (427, 640, 3) arrays."""
    require("sklearn", purpose="The embedded photo data set", pip_name="scikit-learn")
    from sklearn.datasets import load_sample_images

    return [np.ascontiguousarray(im, dtype=np.uint8) for im in load_sample_images().images]


def _shape_mask(label: int, size: int, rng: np.random.Generator) -> Any:
    """An ``"L"`` mask (255 inside) of class ``label``'s shape at a random centre, radius and rotation."""
    from PIL import Image, ImageDraw

    r = float(rng.uniform(0.22, 0.34)) * size
    cx, cy = (float(v) for v in rng.uniform(r, size - r, size=2))
    # upright, +-15 degrees: a cross and an x (a square and a diamond) stay apart, and a small CNN learns it in epochs
    tilt = float(rng.uniform(-0.26, 0.26))
    theta = tilt - np.pi / 2
    mask = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(mask)

    def poly(radii: np.ndarray, n: int) -> list[tuple[float, float]]:
        a = theta + np.arange(n) * (2 * np.pi / n)
        return [(cx + float(q) * np.cos(t), cy + float(q) * np.sin(t)) for q, t in zip(radii, a, strict=True)]

    def rect(w: float, h: float) -> list[tuple[float, float]]:
        c, s = np.cos(theta), np.sin(theta)
        pts = [(-w, -h), (w, -h), (w, h), (-w, h)]
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]

    name = PHOTO_CLASSES[label]
    if name == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    elif name == "triangle":
        draw.polygon(poly(np.full(3, r), 3), fill=255)
    elif name in ("square", "diamond"):
        theta += np.pi / 4 if name == "square" else 0.0  # a square's corners at 45 degrees, a diamond's up
        draw.polygon(poly(np.full(4, r), 4), fill=255)
    elif name == "star":
        draw.polygon(poly(np.tile([r, 0.45 * r], 5), 10), fill=255)
    elif name in ("cross", "x_cross"):
        theta += np.pi / 4 if name == "x_cross" else 0.0
        draw.polygon(rect(r, 0.3 * r), fill=255)
        draw.polygon(rect(0.3 * r, r), fill=255)
    elif name == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
        draw.ellipse((cx - 0.55 * r, cy - 0.55 * r, cx + 0.55 * r, cy + 0.55 * r), fill=0)
    elif name == "half_disc":
        start = float(np.degrees(theta))
        draw.pieslice((cx - r, cy - r, cx + r, cy + r), start, start + 180, fill=255)
    else:  # bar
        draw.polygon(rect(r, 0.35 * r), fill=255)
    return mask


def render_photo(photos: list[np.ndarray], index: int, size: int, seed: int) -> tuple[int, Any]:
    """Image ``index`` of the data set: its class (an index into :data:`PHOTO_CLASSES`, the render order; the data
    modules' labels number the folders in sorted order) and an RGB PIL image of ``size`` px, from
    ``default_rng([seed, i])``.

    Args:
        photos: :func:`load_photo_arrays`'s arrays.
        index: the image's index (its shape is ``PHOTO_CLASSES[index % 10]``).
        size: side in pixels.
        seed: the data set's seed.
    """
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    label = index % len(PHOTO_CLASSES)
    src = photos[int(rng.integers(len(photos)))]
    h, w = src.shape[:2]
    best: tuple[float, int, int, int, int] | None = None
    for _ in range(4):  # the most textured of 4 crops: a crop of plain sky would be a 6 KB JPEG, not a photo
        side = float(rng.uniform(0.45, 1.0)) * min(h, w)  # 190..427 px of the photo: 0.5-1.1x zoom to 384 px
        aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        ch, cw = min(h, round(side / np.sqrt(aspect))), min(w, round(side * np.sqrt(aspect)))
        y0, x0 = int(rng.integers(h - ch + 1)), int(rng.integers(w - cw + 1))
        texture = float(src[y0 : y0 + ch : 8, x0 : x0 + cw : 8].std())
        if best is None or texture > best[0]:
            best = (texture, y0, x0, ch, cw)
    assert best is not None
    _, y0, x0, ch, cw = best
    crop = Image.fromarray(src[y0 : y0 + ch, x0 : x0 + cw]).resize((size, size), Image.Resampling.BILINEAR)
    img = np.asarray(crop, dtype=np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    # colour shift below 1.1x so bright sky does not clip to flat white
    gains = rng.uniform(0.7, 1.05, size=3).astype(np.float32) * np.float32(rng.uniform(0.85, 1.05))
    dy, dx = (int(v) for v in rng.integers(_NOISE_PAD, size=2))
    grain = _noise_bank(size, seed)[dy : dy + size, dx : dx + size]  # sensor-like grain, one bank per seed
    img = img * gains + grain
    alpha = np.asarray(_shape_mask(label, size, rng), dtype=np.float32)[..., None] * np.float32(
        rng.uniform(0.85, 1.0) / 255.0
    )
    colour = _contrasting_colour(img, alpha[..., 0], rng)
    img = img * (1.0 - alpha) + colour * alpha
    return label, Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8), mode="RGB")


def _contrasting_colour(img: np.ndarray, alpha: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The shape's RGB colour: per channel, 90-160 levels away from the background's mean under the shape, towards
    whichever side has room (a random side when both have). A colour drawn uniformly from 0-255 lands within ~20
    levels of the background in every channel for a few percent of the images: shapes a 64 px view cannot see, which
    capped accuracy near 0.93 and made the runs of one job differ by several points."""
    weight = np.float32(alpha.sum()) + np.float32(1e-6)
    under = (img * alpha[..., None]).reshape(-1, 3).sum(0) / weight  # the background's mean colour under the mask
    offset = rng.uniform(90.0, 160.0, size=3).astype(np.float32)
    up = rng.random(3) < 0.5
    up = np.where(under + offset > 255.0, False, np.where(under - offset < 0.0, True, up))
    return np.clip(np.where(up, under + offset, under - offset), 0.0, 255.0).astype(np.float32)


_NOISE_PAD = 64  # the grain bank is this much wider than an image: each image reads it at its own offset
_NOISE_SIGMA = 7.0


def _noise_bank(size: int, seed: int) -> np.ndarray:
    """Gaussian grain (float32, ``size + _NOISE_PAD`` square, 3 channels) drawn once per ``(size, seed)`` and process:
    a fresh draw per image cost 6.4 ms of the 18 ms an image took to render."""
    key = ("noise", size, seed)
    bank = _WORKER.get(key)
    if bank is None:
        n = size + _NOISE_PAD
        bank = np.random.default_rng([seed, 2**32 - 1]).normal(0.0, _NOISE_SIGMA, size=(n, n, 3)).astype(np.float32)
        _WORKER[key] = bank
    return bank


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Pool initializer: end this worker when the rendering process ``parent`` dies, however it dies.

    A forked pool worker otherwise outlives a parent killed by SIGTERM/SIGKILL and goes on writing its chunk into a
    folder that the next render is already filling. On Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` has the kernel kill
    the worker with its parent (SIGKILL: a Python-level SIGTERM handler inherited through fork, e.g. Lightning's,
    would keep it alive); :func:`_render_range` also checks ``os.getppid()`` before each image, the portable fallback.
    """
    _WORKER["parent"] = parent
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl in this libc: the per-image check still stops it
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect: nobody will read this worker's result
        os._exit(1)


def _render_range(args: tuple[str, int, int, int, int, int]) -> int:
    root, start, stop, size, quality, seed = args
    photos = _WORKER.get("photos") or load_photo_arrays()
    parent = _WORKER.get("parent")  # set in forked workers only
    for i in range(start, stop):
        if parent is not None and os.getppid() != parent:
            os._exit(1)  # orphaned (the render was killed): writing on would mix into the next render's tree
        label, img = render_photo(photos, i, size, seed)
        publish_image(img, Path(root) / PHOTO_CLASSES[label] / f"{i:06d}.jpg", quality)
    return stop - start


def photos_marker(
    num_images: int = 4000,
    size: int = 384,
    seed: int = 0,
    quality: int = 90,
    *,
    size_arg: str = "size",
    seed_arg: str = "seed",
) -> dict[str, int]:
    """The marker content a render with these arguments writes (what :func:`check_photos_target` compares a tree's
    marker with), after checking the arguments: a data module checks its own in ``__init__`` through this.

    Args:
        num_images: total images (at least 10: one per class).
        size: side of the square JPEGs in pixels (at least 32).
        seed: the data set's seed, ``0 .. 2**32 - 1`` (what ``seed_everything`` takes).
        quality: JPEG quality.
        size_arg: the name of ``size`` quoted in the error (a data module's ``photo_size``).
        seed_arg: the name of ``seed`` quoted in the error (a data module's ``photo_seed``).

    Raises:
        TypeError: an argument that is not an integer (a bool neither).
        ValueError: an argument out of range.
    """
    check_int("num_images", num_images, low=10, fix="It is the total number of images (10 classes).")
    check_int(size_arg, size, low=32, fix="It is the side of the images in pixels.")
    check_seed(seed_arg, seed, what="the photos (same seed, byte-identical files)")
    check_int("quality", quality, low=1, high=100, fix="It is the JPEG quality.")
    return {"size": size, "num_images": num_images, "quality": quality, "seed": seed, "format_version": _FORMAT_VERSION}


def materialize_photos(
    root: str | os.PathLike[str],
    *,
    num_images: int = 4000,
    size: int = 384,
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
    arg: str = "root",
) -> PhotosInfo:
    """Write the photo data set as ``<root>/<class>/<index:06d>.jpg`` and return what is there.

    While another process renders into ``root``, this call waits for it (one warning says so), then reuses, rebuilds
    or refuses what it left, as for any tree.

    Args:
        root: a local directory (created if missing; only a new or empty one, or one this function rendered).
        num_images: total images (image ``i`` of class ``PHOTO_CLASSES[i % 10]``: balanced classes).
        size: side of the square JPEGs in pixels.
        seed: the data set's seed, ``0 .. 2**32 - 1`` (same seed, same bytes).
        quality: JPEG quality.
        workers: rendering processes (``None``: every CPU this process may use, its affinity mask where it has one;
            0 or 1: in this process). Not part of the output.
        arg: the name of ``root`` quoted in errors (a data module's ``origin``).

    Raises:
        TypeError: an argument that is not an integer (a bool neither), or a ``root`` that is not a path.
        ValueError: an argument out of range; an empty ``root`` (it is not the current directory); ``root`` already
            holds photos made with other arguments; or ``root`` holds files the renderer did not write, nothing
            written.
        PermissionError: ``root`` cannot be written.
    """
    want = photos_marker(num_images, size, seed, quality)
    check_int("workers", workers, low=0, allow_none=True)
    root_p = resolve_root(root, arg=arg, what="photos")
    info = PhotosInfo(root=str(root_p), **want)
    draw = functools.partial(_render_all, root_p, num_images, size, quality, seed, workers)
    render_tree(_SPEC, root_p, want, draw, arg=arg, fix=DEFAULT_FIX)
    return info


def _usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (``taskset``, a Slurm job's
    ``--cpus-per-task``), else the machine's count. ``os.cpu_count()`` alone counts the whole machine: on a 64-core
    node with 2 cores allotted, the render forked 64 workers onto those 2 cores."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows: no affinity call
        return os.cpu_count() or 1


def _render_all(root_p: Path, num_images: int, size: int, quality: int, seed: int, workers: int | None) -> None:
    n_proc = min(_usable_cpus(), num_images) if workers is None else max(1, workers)
    # contiguous chunks, a few per process so an unlucky slow chunk does not hold the others back
    chunks = max(1, min(num_images, n_proc * 4))
    bounds = np.linspace(0, num_images, chunks + 1).round().astype(int)
    jobs = [(str(root_p), int(a), int(b), size, quality, seed) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    _WORKER["photos"] = load_photo_arrays()
    try:
        if n_proc == 1 or "fork" not in mp.get_all_start_methods():
            for job in jobs:
                _render_range(job)
        else:
            # fork: a worker starts in milliseconds with the photographs already in memory (spawn would re-import
            # the package, seconds per worker); rendering is PIL + numpy only, no torch threads in the children
            ctx = mp.get_context("fork")
            with ctx.Pool(n_proc, initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
                pool.map(_render_range, jobs, chunksize=1)
    finally:
        _WORKER.pop("photos", None)


def check_photos_target(
    root: str | os.PathLike[str], want: dict | None = None, *, arg: str = "root", fix: str = DEFAULT_FIX
) -> str:
    """Decide, without writing anything, whether the photos may be rendered into ``root``.

    Args:
        root: the directory to render into.
        want: the marker content the render would write; ``None`` checks only that ``root`` is the demo's (or new,
            or empty), not which arguments made it.
        arg: the argument name quoted in the error.
        fix: what to do instead, quoted at the end of the error.

    Returns:
        ``"reuse"`` (a complete tree made with ``want`` is there) or ``"build"``.

    Raises:
        ValueError: (one line) ``root`` holds anything the renderer did not write, or photos made with other arguments.
    """
    return check_tree(_SPEC, root, want, arg=arg, fix=fix)
