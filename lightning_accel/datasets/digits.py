"""Render scikit-learn's digits as JPEG files in an ImageFolder tree (``<root>/<class>/<index>.jpg``).

Contract:

- Real data: the 1,797 8x8 images that ship inside scikit-learn (no download), upscaled to ``size`` px RGB.
- ``num_images`` above 1,797 repeats the set with deterministic small perturbations (rotation, shift, scale,
  brightness), so the same arguments always give byte-identical files.
- Idempotent and crash-safe: the marker file ``.lightning_accel_digits.json`` is written first (saying "rendering")
  and rewritten last (saying what the tree holds). A tree whose marker matches the arguments is reused as is, one whose
  marker says "rendering" (a run killed halfway) is rebuilt, one whose marker differs is refused rather than mixed.
- Never writes into someone else's directory: it renders only into a directory that does not exist, is empty, or
  carries its own marker and nothing but the class folders of ``NNNNNN.jpg`` files it writes. Anything else (a user's
  ImageFolder tree, a note file) is refused with one line before the first write, and left as it was.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lightning_accel._utils.atomic import atomic_write_text, fsync_dir
from lightning_accel._utils.checks import check_int
from lightning_accel._utils.imports import require

__all__ = [
    "DIGITS_CLASSES",
    "DigitsInfo",
    "check_render_target",
    "digits_tokens",
    "load_digits_arrays",
    "materialize_digits",
]

DIGITS_CLASSES = tuple(str(i) for i in range(10))
DIGITS_COUNT = 1797  # images in scikit-learn's digits (checked by the tests against the loaded arrays)
MARKER = ".lightning_accel_digits.json"
_FORMAT_VERSION = 1
_RENDERING = "rendering"  # the marker's `state` while a render is under way
_IMAGE_NAME = re.compile(r"\d{6}\.jpg")  # the only file names the renderer writes in a class folder
_MARKER_TMP = re.compile(re.escape(f".{MARKER}.") + r"[0-9a-f]+\.tmp")  # atomic_write_text's temporary marker
_PROBE = ".write_probe"  # written and removed before the render (left behind only by a kill in between)
_INFO_KEYS = frozenset({"size", "num_images", "quality", "format_version"})
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


def materialize_digits(
    root: str | os.PathLike[str], *, size: int = 64, num_images: int | None = None, quality: int = 90
) -> DigitsInfo:
    """Write the digits as ``<root>/<class>/<index:06d>.jpg`` and return what is there.

    Args:
        root: a local directory (created if missing).
        size: side of the square images in pixels (e.g. 64 for the quickstart, 224 for benchmarks).
        num_images: total images; defaults to the 1,797 originals. More repeats them with perturbations.
        quality: JPEG quality.

    Raises:
        TypeError: a ``size``/``num_images``/``quality`` that is not an integer (a bool neither).
        ValueError: bad ``size``/``num_images``/``quality``; ``root`` already holds digits made with other arguments;
            or ``root`` holds files the renderer did not write (see :func:`check_render_target`), nothing written.
        PermissionError: ``root`` cannot be written.
    """
    check_int("size", size, low=8, fix="It is the side of the images in pixels.")
    check_int("num_images", num_images, low=1, allow_none=True)
    check_int("quality", quality, low=1, high=100, fix="It is the JPEG quality.")
    n = DIGITS_COUNT if num_images is None else num_images
    root_p = Path(os.fspath(root)).expanduser().resolve()
    info = DigitsInfo(root=str(root_p), size=size, num_images=n, quality=quality)
    want = {k: v for k, v in asdict(info).items() if k != "root"}
    if check_render_target(root_p, want) == "reuse":
        return info
    marker = root_p / MARKER
    try:
        root_p.mkdir(parents=True, exist_ok=True)
        probe = root_p / _PROBE
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(
            f"Cannot write the digits data set to `root` {str(root_p)!r}: {e.strerror or e}. "
            "Choose a writable directory (e.g. `--data.origin=/tmp/digits` in the quickstart, "
            "`--data.data_dir=/tmp/digits` for DigitsDataModule)."
        ) from e
    # Only a (re)build needs the arrays: a complete tree is reused without loading scikit-learn (setup() calls this on
    # every rank after prepare_data() built it).
    images, labels = load_digits_arrays()
    # The marker goes first: a run killed halfway leaves a tree that is recognisably ours, so the next run may redo it.
    atomic_write_text(marker, json.dumps({**want, "state": _RENDERING}, sort_keys=True))
    for c in DIGITS_CLASSES:
        d = root_p / c
        d.mkdir(exist_ok=True)
        for f in d.iterdir():  # check_render_target allowed only our own image names here
            f.unlink()
    base = len(images)
    for i in range(n):
        src = i % base
        img = _render(images[src], size, i // base, src)
        img.save(root_p / str(int(labels[src])) / f"{i:06d}.jpg", format="JPEG", quality=quality)
    for c in DIGITS_CLASSES:
        fsync_dir(root_p / c)
    atomic_write_text(marker, json.dumps(want, sort_keys=True))
    return info


def _read_marker(path: Path) -> dict | None:
    """The marker's content when it is one the renderer wrote (its keys, its states), else None."""
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(have, dict):
        return None
    keys = set(have) - {"state"}
    if keys != _INFO_KEYS or have.get("state", _RENDERING) != _RENDERING:
        return None
    return have


def _foreign_entry(root: Path) -> Path | None:
    """The first entry under ``root`` that the renderer does not write (None: the tree holds only its own files)."""
    for entry in sorted(root.iterdir()):
        if entry.name in (MARKER, _PROBE) or _MARKER_TMP.fullmatch(entry.name):
            continue
        if entry.name not in DIGITS_CLASSES or entry.is_symlink() or not entry.is_dir():
            return entry
        for f in sorted(entry.iterdir()):
            if not _IMAGE_NAME.fullmatch(f.name) or f.is_symlink() or not f.is_file():
                return f
    return None


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
    root_p = Path(os.fspath(root)).expanduser().resolve()
    if not root_p.exists():
        return "build"
    if not root_p.is_dir():
        raise ValueError(f"`{arg}` {str(root_p)!r} is a file, not a directory to render the demo digits into; {fix}.")
    if all(e.name == _PROBE for e in root_p.iterdir()):  # empty (or only our probe, from a kill right after it)
        return "build"
    have = _read_marker(root_p / MARKER)
    if have is None:
        raise ValueError(
            f"`{arg}` {str(root_p)!r} is not a digits demo tree (no `{MARKER}` marker), so nothing is rendered there; "
            f"{fix}."
        )
    if "state" not in have:  # a complete demo tree: reused as is (nothing written), or refused when made otherwise
        if want is None or have == want:
            return "reuse"
        raise ValueError(
            f"`{arg}` {str(root_p)!r} already holds digits made with {have}, not {want}. "
            "Pass another directory, or delete this one to rebuild it."
        )
    foreign = _foreign_entry(root_p)
    if foreign is not None:
        raise ValueError(
            f"`{arg}` {str(root_p)!r} holds {str(foreign.relative_to(root_p))!r}, which the digits demo did not write, "
            f"so nothing is rendered there; {fix}."
        )
    return "build"
