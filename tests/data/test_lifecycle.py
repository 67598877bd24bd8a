"""RAM tier lifecycle: in-use detection through the memory maps, the TTL sweep, ``data clean`` and the automatic sweep
in ``prepare_data``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lightning_accel.data import CachedDataModule, LmdbTier
from lightning_accel.data.cli import main as data_main
from lightning_accel.data.lifecycle import find_tiers, parse_duration, sweep


def _tier(root: Path, name: str, age_s: float) -> Path:
    """A tier directory with an LMDB environment in it, last used ``age_s`` seconds ago, mapped by no process."""
    d = root / name
    t = LmdbTier(d, 1 << 20, name="ram")
    t.open()
    t.put_many([(b"k", b"v" * 100)])
    t.flush()
    from lightning_accel.data.tiers import _ENVS  # this process's environments: close it, as an exited job has

    _ENVS.get().pop(os.path.realpath(d)).env.close()
    past = time.time() - age_s
    for p in [d, *d.iterdir()]:
        os.utime(p, (past, past))
    return d


def test_parse_duration() -> None:
    assert parse_duration("90s", name="x") == 90
    assert parse_duration("12h", name="x") == 12 * 3600
    assert parse_duration("1.5d", name="x") == 1.5 * 86400
    assert parse_duration(30, name="x") == 30 and parse_duration(None, name="x") is None
    for bad in ("soon", "-1h", -5, "3 parsecs"):
        with pytest.raises(ValueError, match="`--older-than` must be"):
            parse_duration(bad, name="--older-than")


def test_sweep_removes_only_stale_unused_tiers(tmp_path: Path) -> None:
    old = _tier(tmp_path, "old", 3 * 3600)
    recent = _tier(tmp_path, "recent", 60)
    busy = _tier(tmp_path, "busy", 3 * 3600)
    LmdbTier(busy, 1 << 20, name="ram").open()  # this process maps it now, as a running job does
    info = {Path(t.path).name: t for t in find_tiers(str(tmp_path))}
    assert info["busy"].in_use and os.getpid() in info["busy"].pids
    assert not info["old"].in_use and info["old"].bytes > 0
    assert sweep(str(tmp_path), older_than_s=3600, dry_run=True)[0].path == str(old) and old.exists()
    removed = [t.path for t in sweep(str(tmp_path), older_than_s=3600)]
    assert removed == [str(old)] and not old.exists() and recent.exists() and busy.exists()
    assert [t.path for t in sweep(str(tmp_path), older_than_s=0, keep=[str(recent)])] == []


def test_data_clean_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = _tier(tmp_path, "stale", 7200)
    fresh = _tier(tmp_path, "fresh", 10)
    assert data_main(["clean", "--root", str(tmp_path), "--older-than", "1h"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == [str(stale)] and out["bytes_freed"] > 0
    assert [k["path"] for k in out["kept"]] == [str(fresh)] and fresh.exists()
    assert data_main(["clean", "--root", str(tmp_path), "--older-than", "soon"]) == 2
    assert "`--older-than` must be" in capsys.readouterr().err


def test_prepare_data_sweeps_stale_tiers_next_to_its_own(
    small_digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "shm"
    monkeypatch.setenv("LIGHTNING_ACCEL_RAM_ROOT", str(root))
    stale = _tier(root, "stale", 2 * 86400)
    fresh = _tier(root, "fresh", 3600)
    dm = CachedDataModule(str(small_digits), cache_dir=str(tmp_path / "cache"), image_size=16, ram_ttl="1d")
    assert dm.ram_dir is not None and Path(dm.ram_dir).parent == root
    dm.prepare_data()
    assert not stale.exists() and fresh.exists()
    with pytest.raises(ValueError, match="`ram_ttl`"):
        CachedDataModule(str(small_digits), cache_dir=str(tmp_path / "cache"), ram_ttl="forever")
