"""``data clean`` and the sweep on a RAM tier that another process has open: refused (``--tier``) or kept (a root-wide
sweep), its files and a user's file beside it untouched, even where that process's memory maps cannot be read (another
user's process, another PID namespace sharing ``/dev/shm``): LMDB's own lock on ``lock.mdb`` tells."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_accel.data import LmdbTier, lifecycle
from lightning_accel.data.cli import main as data_main
from lightning_accel.data.lifecycle import find_tiers, remove_tier, sweep
from lightning_accel.data.tiers import _ENVS

_HOLDER = """
import sys, time
from lightning_accel.data.tiers import LmdbTier
t = LmdbTier(sys.argv[1], 1 << 20, name="ram")
assert t.open()
t.put_many([(b"k", b"v" * 100)])
t.flush()
print("open", flush=True)
time.sleep(120)
"""


def _old_tier(root: Path, name: str) -> Path:
    """A tier with one entry, closed in this process, last used two hours ago."""
    d = root / name
    t = LmdbTier(d, 1 << 20, name="ram")
    t.open()
    t.put_many([(b"k", b"v" * 100)])
    t.flush()
    _ENVS.get().pop(os.path.realpath(d)).env.close()
    past = time.time() - 7200
    for p in [d, *d.iterdir()]:
        os.utime(p, (past, past))
    return d


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A tier under ``tmp_path/root`` that a running process keeps open (as a fit does), and that process's pid."""
    tier = _old_tier(tmp_path / "root", "busy")
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tier)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        yield tier, proc.pid
    finally:
        proc.kill()
        proc.wait()


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("maps_readable", [True, False])
def test_data_clean_refuses_a_named_tier_in_use(
    held: tuple[Path, int],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    maps_readable: bool,
) -> None:
    tier, pid = held
    root = tier.parent
    (tier / "notes.txt").write_text("mine\n")  # a user's file inside the tier
    (root / "user.txt").write_text("also mine\n")  # and one beside it
    stale = _old_tier(root, "stale")
    if not maps_readable:  # the holder's /proc/<pid>/maps cannot be read (another user, another PID namespace)
        monkeypatch.setattr(lifecycle, "_mapped_dirs", dict)
    before = _files(root)
    for extra in ([], ["--dry-run"], ["--older-than", "1h"]):
        assert data_main(["clean", "--root", str(root), "--tier", "busy", "--tier", "stale", *extra]) == 1
        cap = capsys.readouterr()
        assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and len(cap.err) <= 400, cap.err
        assert "`--tier` 'busy'" in cap.err and "in use" in cap.err and f"pid {pid}" in cap.err
        assert "nothing was removed" in cap.err
        assert _files(root) == before and stale.exists()  # the tier named beside it is not removed either


def test_sweep_keeps_a_tier_whose_holder_maps_cannot_be_read(
    held: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, pid = held
    stale = _old_tier(tier.parent, "stale")
    monkeypatch.setattr(lifecycle, "_mapped_dirs", dict)
    info = {Path(t.path).name: t for t in find_tiers(str(tier.parent))}
    assert info["busy"].in_use and info["busy"].pids == [pid] and not info["stale"].in_use
    assert [t.path for t in sweep(str(tier.parent))] == [str(stale)]
    assert not stale.exists() and sorted(os.listdir(tier)) == sorted(
        ["data.mdb", "lock.mdb", ".lightning-accel-tier.json"]
    )
    # removing it directly is refused too: LMDB's lock says another process has it open
    assert remove_tier(str(tier)) is False and (tier / "data.mdb").exists()
