"""The safety contract every demo renderer keeps on disk (``<root>/<class>/<NNNNNN>.jpg`` + a marker file).

- Idempotent and crash-safe: the marker file is written first (saying "rendering") and rewritten last (saying what
  the tree holds). A tree whose marker matches the arguments is reused as is, one whose marker says "rendering" (a run
  killed halfway) is rebuilt, and so is one made with the same arguments by an older ``format_version`` of the
  renderer, or one whose class folders lack an image the marker counts (a copy cut short, a folder removed: reused,
  it would shift the labels of the classes after the missing one) or hold an image that is not a whole JPEG (empty or
  cut short by a power loss after the render: served, it would stop the loader mid-epoch); one whose marker differs
  otherwise is refused rather than mixed.
- Never writes into someone else's directory: a renderer writes only into a directory that does not exist, is empty,
  or carries its own marker and nothing but the class folders of ``NNNNNN.jpg`` files it writes. Anything else (a
  user's ImageFolder tree, a note file) is refused with one line before the first write, and left as it was.
- One render at a time per directory: a render holds an exclusive ``flock`` on a lock file in the root
  (``.lightning_accel_<what>.lock``, left in place: removing a lock file races with a process about to lock it) from
  before it decides to (re)build until its final marker is written. A second render of the same directory waits for
  the first and then decides again (reuse, rebuild or refuse) on what the first one left. Forked rendering processes
  inherit the lock, so it is held until the last of them is gone.
- No partial image at a final name: images are written to ``.NNNNNN.jpg.<hex>.tmp`` and renamed into place
  (:func:`~lightning_accel._utils.atomic.atomic_publish_file`); the temporary names a killed render leaves behind are
  recognised as the renderer's own and removed by the next render.

:class:`TreeSpec` names one renderer's marker, classes and marker keys; :func:`check_tree` decides (without writing),
:func:`render_lock` serialises renders, :func:`begin_render` writes the "rendering" marker and empties the class
folders, :func:`publish_image` writes one image, :func:`finish_render` makes the tree durable and writes the final
marker.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_accel._utils.atomic import atomic_publish_file, atomic_write_text, fsync_dir

try:
    import fcntl
except ImportError:  # Windows: no flock; renders of one directory are then not serialised
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "TreeSpec",
    "begin_render",
    "check_tree",
    "finish_render",
    "publish_image",
    "render_lock",
    "render_tree",
    "resolve_root",
]

_RENDERING = "rendering"  # the marker's `state` while a render is under way
IMAGE_NAME = re.compile(r"\d{6}\.jpg")  # the only file names a renderer writes in a class folder
# an image's temporary name while it is written (atomic_publish_file's `.<name>.<32 hex>.tmp`): a render killed
# mid-write leaves one behind, which is still the renderer's own file
IMAGE_TMP_NAME = re.compile(r"\.\d{6}\.jpg\.[0-9a-f]{32}\.tmp")
PROBE = ".write_probe"  # written and removed before the render (left behind only by a kill in between)


@dataclass(frozen=True)
class TreeSpec:
    """One renderer's on-disk identity.

    Attributes:
        what: the data set's name in messages ("digits", "photos").
        marker: the marker file's name in the root.
        classes: the class folder names.
        info_keys: the keys of the marker's content (without ``state``).
        writable_hint: how to pick a writable directory, quoted by :func:`begin_render`'s ``PermissionError``;
            ``{arg}`` in it is replaced by the name of the argument that gave the directory (``origin``, ``data_dir``).
    """

    what: str
    marker: str
    classes: tuple[str, ...]
    info_keys: frozenset[str]
    writable_hint: str

    @property
    def _marker_tmp(self) -> re.Pattern[str]:  # atomic_write_text's temporary marker
        return re.compile(re.escape(f".{self.marker}.") + r"[0-9a-f]+\.tmp")

    @property
    def lock(self) -> str:
        """The lock file's name in the root (``.lightning_accel_digits.lock`` beside the ``.json`` marker)."""
        return self.marker.removesuffix(".json") + ".lock"


def resolve_root(root: object, *, arg: str, what: str) -> Path:
    """``root`` (a ``str`` or ``os.PathLike``) as an absolute path, or one line naming ``arg``.

    An empty string used to resolve to the current directory, so ``materialize_digits("")`` rendered into whatever
    directory the script ran in when it was empty; ``None`` failed in ``os.fspath`` without naming the argument.

    Raises:
        TypeError: ``root`` is not a ``str`` or ``os.PathLike``.
        ValueError: ``root`` is empty.
    """
    value = os.fspath(root) if isinstance(root, os.PathLike) else root
    if not isinstance(value, str) or not value:
        kind = ValueError if isinstance(value, str) else TypeError
        raise kind(
            f"`{arg}` must be a non-empty directory path (a str or pathlib.Path) to render the demo {what} into, got "
            f"{root!r} ({type(root).__name__}). Pass e.g. `{arg}='data/{what}'`."
        )
    return Path(value).expanduser().resolve()


def _read_marker(spec: TreeSpec, path: Path) -> dict | None:
    """The marker's content when it is one the renderer wrote (its keys, its states), else None."""
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(have, dict):
        return None
    keys = set(have) - {"state"}
    if keys != spec.info_keys or have.get("state", _RENDERING) != _RENDERING:
        return None
    return have


def _own_root_entry(spec: TreeSpec, name: str) -> bool:
    """``name`` in a tree's root is one of the renderer's own files other than a class folder: the marker, the lock
    file, the write probe or a temporary marker (:func:`~lightning_accel._utils.atomic.atomic_write_text`'s, there
    only while a render writes the marker, or left by one killed at that moment)."""
    return name in (spec.marker, spec.lock, PROBE) or spec._marker_tmp.fullmatch(name) is not None


def _foreign_entry(spec: TreeSpec, root: Path) -> Path | None:
    """The first entry under ``root`` that the renderer does not write (None: the tree holds only its own files).

    Another process may render into ``root`` during the scan (the scan is read-only and takes no lock): a file of
    the renderer's own name that is gone by the time it is looked at (an image's temporary file renamed into place,
    an image removed by a rebuild) was the renderer's, not a foreign entry.
    """
    for entry in sorted(root.iterdir()):
        if _own_root_entry(spec, entry.name):
            continue
        if entry.name not in spec.classes or entry.is_symlink() or not entry.is_dir():
            return entry
        for f in sorted(entry.iterdir()):
            if not (IMAGE_NAME.fullmatch(f.name) or IMAGE_TMP_NAME.fullmatch(f.name)):
                return f
            try:
                mode = f.lstat().st_mode
            except FileNotFoundError:
                continue  # renamed or removed since the listing by a render under way: it was an own file
            if not stat.S_ISREG(mode):  # a folder or a link under an image's name: not something a render writes
                return f
    return None


def _older_format_only(have: dict, want: dict) -> bool:
    """``have`` is ``want`` made by an older format of the renderer (every other argument equal)."""
    old, new = have.get("format_version"), want.get("format_version")
    same_args = {k: v for k, v in have.items() if k != "format_version"} == {
        k: v for k, v in want.items() if k != "format_version"
    }
    return same_args and isinstance(old, int) and isinstance(new, int) and old < new


def _cut_short(path: str) -> bool:
    """The file at ``path`` is not a whole JPEG as the renderer writes it: it does not start with the JPEG
    start-of-image marker ``FF D8`` or does not end with the end-of-image marker ``FF D9`` (nothing follows it in a
    file PIL writes), or it cannot be read.

    An image is published without an ``fsync`` of its data (:func:`publish_image`), so a power loss after a render can
    leave a zero-length file or a file cut short under its final name; the loader then failed on it mid-epoch
    ("Truncated File Read", "cannot identify image file"). Inside the entropy-coded data a ``FF`` byte is always
    followed by ``00`` or a restart marker, so a file cut anywhere else does not end in ``FF D9``. Two 2-byte reads per
    file, no decode.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(-2, os.SEEK_END)  # OSError for a file of fewer than 2 bytes
            tail = f.read(2)
    except OSError:
        return True
    return head != b"\xff\xd8" or tail != b"\xff\xd9"


def _missing_images(spec: TreeSpec, root_p: Path, have: dict) -> str | None:
    """What is wrong with a tree whose marker says "complete" (None: nothing), as a phrase: it lacks a class folder
    or some of the ``have["num_images"]`` images ``000000.jpg`` ... under its class folders, holds more, or holds an
    image that is not a whole JPEG (:func:`_cut_short`).

    A marker says complete, not that the files are still there: a copy of the tree cut short (the marker is copied
    first, being a dotfile in the root), or a class folder removed by hand, used to be reused as is, and torchvision's
    ``ImageFolder`` then numbered the remaining folders from 0, labelling every image of a later class as the class
    before it. Nor does it say the files are whole: a power loss after the render can leave images cut short or empty.
    One directory listing per class folder, and the first and last two bytes of every image.
    """
    want_n = have.get("num_images")
    found: list[int] = []
    damaged: list[str] = []
    for c in spec.classes:
        d = root_p / c
        if d.is_symlink() or not d.is_dir():
            return f"lacks its class folder {c!r}"
        with os.scandir(d) as it:
            for e in it:
                if IMAGE_NAME.fullmatch(e.name):
                    found.append(int(e.name[:6]))
                    if _cut_short(e.path):
                        damaged.append(f"{c}/{e.name}")
    if isinstance(want_n, int):
        missing = want_n - len(set(found) & set(range(want_n)))
        if missing:
            return f"lacks {missing} of its {want_n} images"
        if len(found) > want_n:  # a larger render's images, or copies in a second class: ImageFolder reads them all
            return f"holds {len(found) - want_n} image(s) beyond its {want_n}"
    if damaged:
        return f"holds {len(damaged)} image(s) cut short or empty (e.g. {sorted(damaged)[0]!r})"
    return None


def check_tree(spec: TreeSpec, root: str | os.PathLike[str], want: dict | None, *, arg: str, fix: str) -> str:
    """Decide, without writing anything, whether ``spec``'s data set may be rendered into ``root``.

    A tree whose marker says complete but whose class folders lack an image (a copy cut short, files removed by
    hand) or hold one that is not a whole JPEG (empty or cut short by a power loss) is rebuilt like a tree left by a
    killed render, when it holds nothing but the renderer's own files.

    Returns:
        ``"reuse"``: a complete tree made with ``want`` is there (``want=None``: any complete tree of this renderer);
        ``"build"``: rendering may (re)write it.

    Raises:
        TypeError: (one line) ``root`` is not a path.
        ValueError: (one line) ``root`` is empty, holds anything the renderer did not write, or a tree made with other
            arguments.
    """
    w = spec.what
    root_p = resolve_root(root, arg=arg, what=w)
    if not root_p.exists():
        return "build"
    if not root_p.is_dir():
        raise ValueError(f"`{arg}` {str(root_p)!r} is a file, not a directory to render the demo {w} into; {fix}.")
    if all(_own_root_entry(spec, e.name) and e.name != spec.marker for e in root_p.iterdir()):
        # empty, or only our probe, lock or temporary marker: a render starting (its first marker not yet renamed
        # into place), or one killed before that
        return "build"
    have = _read_marker(spec, root_p / spec.marker)
    if have is None:
        raise ValueError(
            f"`{arg}` {str(root_p)!r} is not a {w} demo tree (no `{spec.marker}` marker), so nothing is rendered "
            f"there; {fix}."
        )
    if "state" not in have:  # a complete demo tree: reused as is (nothing written), or refused when made otherwise
        if want is None or have == want:
            if _missing_images(spec, root_p, have) is None:
                return "reuse"
            # else: a damaged tree (see _missing_images): rebuilt (below) when it holds nothing but its own files
        elif not _older_format_only(have, want):
            raise ValueError(
                f"`{arg}` {str(root_p)!r} already holds {w} made with {have}, not {want}. "
                "Pass another directory, or delete this one to rebuild it."
            )
        # else: the same arguments rendered by an older version of this renderer: rebuilt (below) when the tree
        # holds nothing but its own files, so an upgrade does not leave a user with a directory to delete by hand
    foreign = _foreign_entry(spec, root_p)
    if foreign is not None:
        raise ValueError(
            f"`{arg}` {str(root_p)!r} holds {str(foreign.relative_to(root_p))!r}, which the {w} demo did not write, "
            f"so nothing is rendered there; {fix}."
        )
    return "build"


def _unwritable(spec: TreeSpec, root_p: Path, arg: str, e: OSError) -> PermissionError:
    return PermissionError(
        f"Cannot write the {spec.what} data set to `{arg}` {str(root_p)!r}: {e.strerror or e}. "
        f"Choose a writable directory ({spec.writable_hint.replace('{arg}', arg)})."
    )


@contextlib.contextmanager
def render_lock(spec: TreeSpec, root_p: Path, *, arg: str = "root") -> Iterator[None]:
    """Hold an exclusive lock on ``root_p``'s lock file for the block: one render of a directory at a time.

    Call it only after :func:`check_tree` said ``"build"`` (it creates ``root_p`` and the lock file), and call
    :func:`check_tree` again inside the block: another render may have finished (or started over) while this one
    waited. The lock is an ``flock`` on an open file, so the kernel releases it when the last process holding it
    exits, however it exits (a killed render never leaves a stale lock); processes forked inside the block share it,
    so a render whose workers outlive it still holds the directory until they are gone. Where ``flock`` does not
    exist (Windows) the block runs unlocked.

    Args:
        spec: the renderer.
        root_p: the (resolved) root directory.
        arg: the argument name quoted in the error and in the warning issued when another render holds the lock.

    Raises:
        PermissionError: ``root_p`` or its lock file cannot be created (nothing else written).
    """
    lock = root_p / spec.lock
    try:
        root_p.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise _unwritable(spec, root_p, arg, e) from e
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                warnings.warn(
                    f"Another process is rendering the {spec.what} into `{arg}` {str(root_p)!r}; waiting for it to "
                    f"finish (it holds {str(lock)!r}).",
                    stacklevel=4,
                )
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until that render (and any worker it forked) is gone
        yield
    finally:
        os.close(fd)  # releases the lock (once no forked worker holds the file open either)


def publish_image(img: Any, path: Path, quality: int) -> None:
    """Save the PIL image ``img`` as a JPEG at ``path`` through a temporary name and a rename: a process killed
    mid-write leaves a temporary file (recognised and removed by the next render), never a partial image under its
    final name. The data is not fsynced (thousands of small files that a render can always redo; only the folders
    are, by :func:`finish_render`)."""
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    atomic_publish_file(buf.getvalue(), path, durable=False)


def render_tree(
    spec: TreeSpec, root_p: Path, want: dict, draw: Callable[[], None], *, arg: str = "root", fix: str
) -> None:
    """Render ``spec``'s data set into ``root_p`` unless it holds that very data set already: decide
    (:func:`check_tree`), then under :func:`render_lock` decide again (a render that held the lock may have finished
    this tree, or another one), write the "rendering" marker (:func:`begin_render`), ``draw()`` every image (through
    :func:`publish_image`) and publish the tree (:func:`finish_render`).

    Raises:
        ValueError, PermissionError: as :func:`check_tree`, :func:`render_lock` and :func:`begin_render`.
    """
    if check_tree(spec, root_p, want, arg=arg, fix=fix) == "reuse":
        return
    with render_lock(spec, root_p, arg=arg):
        if check_tree(spec, root_p, want, arg=arg, fix=fix) == "reuse":
            return
        have = _read_marker(spec, root_p / spec.marker)
        missing = _missing_images(spec, root_p, have) if have is not None and "state" not in have else None
        if missing is not None:
            warnings.warn(
                f"`{arg}` {str(root_p)!r} holds a complete {spec.what} tree by its marker, but it {missing} (a copy "
                "cut short, files removed or added by hand, or a power loss after the render): rendering it again.",
                stacklevel=3,
            )
        begin_render(spec, root_p, want, arg=arg)
        draw()
        finish_render(spec, root_p, want)


def begin_render(spec: TreeSpec, root_p: Path, want: dict, *, arg: str = "root") -> None:
    """After :func:`check_tree` said ``"build"``: check ``root_p`` is writable, write the "rendering" marker first (a
    run killed halfway leaves a tree that is recognisably ours, so the next run may redo it) and empty the class
    folders (which :func:`check_tree` allowed to hold only our own image names) and the root of a temporary marker
    a killed render left. Call it under :func:`render_lock`. ``arg`` is the argument name quoted in the error.

    Raises:
        PermissionError: ``root_p`` cannot be written (nothing written).
    """
    try:
        root_p.mkdir(parents=True, exist_ok=True)
        probe = root_p / PROBE
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise _unwritable(spec, root_p, arg, e) from e
    atomic_write_text(root_p / spec.marker, json.dumps({**want, "state": _RENDERING}, sort_keys=True))
    for entry in root_p.iterdir():
        # a killed render's half-written marker (the lock keeps out a live render's)
        if spec._marker_tmp.fullmatch(entry.name):
            entry.unlink(missing_ok=True)
    for c in spec.classes:
        d = root_p / c
        d.mkdir(exist_ok=True)
        for f in d.iterdir():
            f.unlink()


def finish_render(spec: TreeSpec, root_p: Path, want: dict) -> None:
    """Make the class folders durable, then write the final marker (the tree is complete from here on)."""
    for c in spec.classes:
        fsync_dir(root_p / c)
    atomic_write_text(root_p / spec.marker, json.dumps(want, sort_keys=True))
