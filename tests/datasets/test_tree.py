"""The demo renderers' shared disk contract under concurrency and kills: one render of a folder at a time, workers
that die with their render, images renamed into place."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest

from lightning_accel.datasets import digits as digits_mod
from lightning_accel.datasets import materialize_digits, materialize_photos
from lightning_accel.datasets import photos as photos_mod


def _files(root: Path) -> dict[str, int]:
    """Every file under ``root`` (temporary ones included) with its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_a_killed_photo_render_stops_writing_and_the_next_render_is_not_mixed(tmp_path: Path) -> None:
    """SIGKILL the rendering process: its forked pool workers die with it (they used to go on writing their chunks
    into the folder the next render was filling, which then held images of two sizes under a "complete" marker)."""
    from PIL import Image

    root = tmp_path / "p"
    ctx = mp.get_context("fork")  # the test's imports are already done: the render starts at once
    render = ctx.Process(
        target=materialize_photos, args=(root,), kwargs={"num_images": 3000, "size": 96, "seed": 1, "workers": 2}
    )
    render.start()
    try:
        deadline = time.monotonic() + 60
        while sum(1 for _ in root.rglob("*.jpg")) < 4:
            assert render.is_alive() and time.monotonic() < deadline, "the render did not start"
            time.sleep(0.02)
    finally:
        os.kill(render.pid, signal.SIGKILL)  # type: ignore[arg-type]
        render.join()
    time.sleep(0.3)  # the kernel delivers the workers' death signal at once; let the reaping finish
    after_kill = _files(root)
    time.sleep(1.0)
    assert _files(root) == after_kill, "workers of the killed render are still writing"

    info = materialize_photos(root, num_images=40, size=32, seed=1, workers=2)
    time.sleep(0.5)
    sizes: dict[int, int] = {}
    for p in root.rglob("*.jpg"):
        with Image.open(p) as im:
            sizes[im.size[0]] = sizes.get(im.size[0], 0) + 1
    assert sizes == {32: 40} and sum(info.class_counts().values()) == 40
    assert not [p for p in root.rglob("*.tmp")]


def test_an_orphaned_worker_stops_before_its_next_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable fallback of the death signal: a worker whose parent is no longer the render exits unwritten."""
    root = tmp_path / "p"
    for c in photos_mod.PHOTO_CLASSES:
        (root / c).mkdir(parents=True)
    monkeypatch.setitem(photos_mod._WORKER, "parent", -1)  # "the render that forked me" is gone
    monkeypatch.setitem(photos_mod._WORKER, "photos", photos_mod.load_photo_arrays())
    worker = mp.get_context("fork").Process(target=photos_mod._render_range, args=((str(root), 0, 5, 32, 90, 0),))
    worker.start()
    worker.join(30)
    assert worker.exitcode == 1
    assert not list(root.rglob("*.jpg"))


def test_a_second_render_waits_for_the_running_one_then_decides_on_what_it_left(tmp_path: Path) -> None:
    """A render of a folder that another render holds waits for it (one warning), then checks the folder again:
    here the first one completed digits of another size, so the second refuses instead of rendering over them."""
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    marker = root / digits_mod.MARKER
    done = marker.read_text()
    marker.write_text(json.dumps({**json.loads(done), "state": "rendering"}))  # "a render is under way"
    fd = os.open(root / ".lightning_accel_digits.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held by that render

    def finish() -> None:
        marker.write_text(done)
        os.close(fd)

    timer = threading.Timer(0.5, finish)
    timer.start()
    t0 = time.monotonic()
    try:
        with (
            pytest.warns(UserWarning, match=r"Another process is rendering the digits into `root`.*waiting"),
            pytest.raises(ValueError, match=r"already holds digits made with .*'size': 8"),
        ):
            materialize_digits(root, size=16, num_images=20)
    finally:
        timer.join()
    assert time.monotonic() - t0 >= 0.45
    assert marker.read_text() == done
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the lock is free again: no wait, no warning
        assert materialize_digits(root, size=8, num_images=20).size == 8  # reused


def test_a_temporary_image_left_by_a_killed_render_is_the_renderers_own(tmp_path: Path) -> None:
    """Images are written to `.NNNNNN.jpg.<hex>.tmp` and renamed; one left by a kill does not make the folder
    "someone else's": the next render removes it and completes the tree."""
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    marker = root / digits_mod.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "state": "rendering"}))
    leftover = root / "3" / f".000003.jpg.{'ab' * 16}.tmp"
    leftover.write_bytes(b"\xff\xd8partial")
    (root / "3" / "000003.jpg").unlink()
    materialize_digits(root, size=8, num_images=20)
    assert not leftover.exists() and (root / "3" / "000003.jpg").is_file()
    assert sum(1 for _ in root.rglob("*.jpg")) == 20
    assert "state" not in json.loads(marker.read_text())


def test_an_image_renamed_into_place_during_the_check_is_not_someone_elses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-only check (a data module's ``__init__``, a second render before it waits for the lock) lists a class
    folder while another process renders into it: a temporary image listed, then renamed into place by that render
    before the check looks at it, used to be taken for a file the demo did not write, and the check refused the
    folder."""
    root = tmp_path / "d"
    materialize_digits(root, size=8, num_images=20)
    marker = root / digits_mod.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "state": "rendering"}))  # a render under way
    final = root / "3" / "000003.jpg"
    tmp = root / "3" / f".000003.jpg.{'cd' * 16}.tmp"
    final.rename(tmp)  # the image being written
    listing = Path.iterdir

    def iterdir_then_publish(self: Path):  # the render renames the image between the listing and the look at it
        names = list(listing(self))
        if self == root / "3" and tmp.exists():
            os.replace(tmp, final)
        return iter(names)

    monkeypatch.setattr(Path, "iterdir", iterdir_then_publish)
    want = digits_mod.digits_marker(8, 20)
    assert digits_mod.check_render_target(root, want) == "build"


def test_a_render_writing_its_first_marker_is_not_someone_elses_folder(tmp_path: Path) -> None:
    """A render's first marker is written to a temporary name and renamed: a folder holding only the lock file and that
    temporary marker (a render starting, or one killed right then) used to be refused as "not a digits demo tree"; it
    is the renderer's own, and the next render completes it and removes the temporary marker."""
    root = tmp_path / "d"
    root.mkdir()
    (root / ".lightning_accel_digits.lock").write_bytes(b"")
    half = root / f".{digits_mod.MARKER}.{'ef' * 16}.tmp"
    half.write_text('{"format_ver')
    want = digits_mod.digits_marker(8, 20)
    assert digits_mod.check_render_target(root, want) == "build"
    materialize_digits(root, size=8, num_images=20)
    assert not half.exists()
    assert sum(1 for _ in root.rglob("*.jpg")) == 20
    assert json.loads((root / digits_mod.MARKER).read_text()) == want
