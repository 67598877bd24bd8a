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
    with pytest.raises(ValueError, match=r"`--older-than` must be a number >= 0, got -5\. .*seconds"):
        parse_duration(-5, name="--older-than")
    for wrong in (True, [3600]):
        with pytest.raises(TypeError, match=r"`ram_ttl` must be a duration such as 3600.*\((bool|list)\)"):
            parse_duration(wrong, name="ram_ttl")  # type: ignore[arg-type]


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
    assert out["kept"][0]["note"] is None  # made without a note (a data module's tier names its cache_dir)
    assert data_main(["clean", "--root", str(tmp_path), "--older-than", "soon"]) == 2
    assert "`--older-than` must be" in capsys.readouterr().err


def test_data_clean_counts_as_freed_only_what_it_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's file inside a tier stays, so `bytes_freed` leaves it out (it reported that file as freed)."""
    planted = _tier(tmp_path, "planted", 7200)
    own = sum(p.stat().st_blocks * 512 for p in planted.iterdir())
    (planted / "results.bin").write_bytes(os.urandom(1 << 20))
    past = time.time() - 7200
    for p in (planted / "results.bin", planted):  # the new file made the directory look used now
        os.utime(p, (past, past))
    for dry in (True, False):
        assert data_main(["clean", "--root", str(tmp_path), "--older-than", "1h", *(["--dry-run"] * dry)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["removed"] == [str(planted)] and out["bytes_freed"] == own > 0
    assert [p.name for p in planted.iterdir()] == ["results.bin"]


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
    # the module's own tier says whose it is: the cleanup lists it with its cache_dir
    (own,) = [t for t in find_tiers(str(root)) if t.path == dm.ram_dir]
    assert own.note == f"RAM tier of the cache in {tmp_path / 'cache'}"
    assert {t.note for t in find_tiers(str(root)) if t.path != dm.ram_dir} == {None}  # made without a note
    with pytest.raises(ValueError, match="`ram_ttl`"):
        CachedDataModule(str(small_digits), cache_dir=str(tmp_path / "cache"), ram_ttl="forever")


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def test_ram_tier_carries_an_owner_marker_and_an_ssd_tier_none(tmp_path: Path) -> None:
    from lightning_accel.data.tiers import TIER_MARKER, read_marker

    ram = _tier(tmp_path, "ram", 0)
    doc = read_marker(str(ram))
    assert doc is not None and doc["owner"]["pid"] == os.getpid() and doc["owner"]["host"] and doc["owner"]["user"]
    assert time.time() - 60 < doc["created"] <= time.time()
    ssd = LmdbTier(tmp_path / "ssd", 1 << 20, name="ssd")
    assert ssd.open() and not (tmp_path / "ssd" / TIER_MARKER).exists()
    mine = tmp_path / "mine"  # a directory of the user's own, chosen as a RAM tier: not made a removable tier
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    assert LmdbTier(mine, 1 << 20, name="ram").open() and read_marker(str(mine)) is None


def test_sweep_touches_only_marked_tiers(tmp_path: Path) -> None:
    stale = _tier(tmp_path, "stale", 7200)
    user = tmp_path / "proj"
    user.mkdir()
    (user / "a.py").write_text("print('hi')\n")
    lookalike = tmp_path / "lmdb-of-mine"  # an LMDB environment the package did not create
    lookalike.mkdir()
    (lookalike / "data.mdb").write_bytes(b"\0" * 4096)
    (tmp_path / "notes.txt").write_text("notes")
    planted = _tier(tmp_path, "planted", 7200)
    (planted / "results.csv").write_text("a,b\n1,2\n")  # the user's file inside a tier
    before = _snapshot(user) | {"notes": (tmp_path / "notes.txt").read_bytes()}
    before_look = _snapshot(lookalike)
    assert {Path(t.path).name for t in find_tiers(str(tmp_path))} == {"stale", "planted"}
    removed = {Path(t.path).name for t in sweep(str(tmp_path), older_than_s=0)}
    assert removed == {"stale", "planted"} and not stale.exists()
    assert _snapshot(user) | {"notes": (tmp_path / "notes.txt").read_bytes()} == before
    assert _snapshot(lookalike) == before_look
    assert _snapshot(planted) == {"results.csv": b"a,b\n1,2\n"}  # only what the tier created is gone


def test_data_clean_refuses_a_root_holding_other_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "x"
    (root / "proj").mkdir(parents=True)
    (root / "proj" / "a.py").write_text("hi\n")
    stale = _tier(root, "stale", 7200)
    other = _tier(root, "other", 7200)
    before = _snapshot(root / "proj")
    for argv in (["clean", "--root", str(root)], ["clean", "--root", str(root), "--dry-run"]):
        assert data_main(argv) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and len(cap.err) <= 400
        assert "`--root`" in cap.err and "'proj'" in cap.err and "--tier NAME" in cap.err
    assert stale.exists() and other.exists() and _snapshot(root / "proj") == before
    assert data_main(["clean", "--root", str(root), "--tier", "stale"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == [str(stale)] and [k["path"] for k in out["kept"]] == [str(other)]
    assert not stale.exists() and other.exists() and _snapshot(root / "proj") == before
    assert data_main(["clean", "--root", str(root), "--tier", "proj"]) == 2  # not a tier: refused
    err = capsys.readouterr().err
    assert "`--tier` 'proj' is not a RAM tier" in err and len(err.strip().splitlines()) == 1
    assert _snapshot(root / "proj") == before


def test_data_clean_on_a_run_folder_lists_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    for d in ("checkpoints", "lightning_logs/version_0"):
        (run / d).mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    before = _snapshot(run)
    assert sweep(str(run), dry_run=True) == [] and sweep(str(run)) == []
    assert data_main(["clean", "--root", str(run), "--dry-run"]) == 2
    assert "not RAM tiers" in capsys.readouterr().err and _snapshot(run) == before


def test_data_clean_reports_a_missing_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert data_main(["clean", "--root", str(tmp_path / "nowhere")]) == 1  # a missing target, as for `data pack`
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1
    assert "`--root`" in cap.err and "nowhere" in cap.err and "is not an existing directory" in cap.err


def test_a_ram_dir_holding_an_lmdb_database_of_the_users_is_left_untouched(tmp_path: Path) -> None:
    """The user's own data.mdb/lock.mdb look like a tier's files: the tier neither marks nor writes into them (opening
    the environment added the tier's four databases to the user's), it is disabled with one warning instead."""
    import lmdb

    from lightning_accel.data.lifecycle import remove_tier
    from lightning_accel.data.tiers import read_marker

    mine = tmp_path / "user_lmdb"
    env = lmdb.open(str(mine), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"record", b"precious")
    env.close()
    before = (mine / "data.mdb").read_bytes()
    tier = LmdbTier(mine, 1 << 20, name="ram")
    disabled = r"the ram tier at .*user_lmdb.* is disabled .*this cache did not create"
    with pytest.warns(RuntimeWarning, match=disabled) as w:
        assert not tier.open()
    # the fix fits the cause (not the generic "a writable local directory with free space")
    assert str(w[0].message).endswith("Point the ram tier at a new or empty directory to re-enable it.")
    assert tier.put_many([(b"k", b"v")]).stored == 0 and tier.get(b"k") is None
    assert (mine / "data.mdb").read_bytes() == before and read_marker(str(mine)) is None
    assert not remove_tier(str(mine)) and {p.name for p in mine.iterdir()} == {"data.mdb", "lock.mdb"}
    assert find_tiers(str(tmp_path)) == []
    # a tier's own environment without its marker (made before markers, or the marker failed) is still used
    legacy = tmp_path / "legacy"
    env = lmdb.open(str(legacy), map_size=1 << 20, max_dbs=4)
    with env.begin(write=True) as txn:
        for name in (b"data", b"index", b"fifo", b"meta"):
            env.open_db(name, txn=txn)
    env.close()
    assert LmdbTier(legacy, 1 << 20, name="ram").open()
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory (made ahead, e.g. by a launcher) becomes a tier as a missing one does
    assert LmdbTier(empty, 1 << 20, name="ram").open() and read_marker(str(empty)) is not None


def test_a_tier_whose_path_holds_a_newline_is_in_use_while_mapped(tmp_path: Path) -> None:
    """/proc/<pid>/maps writes a newline in a path as \\012: the tier is still seen as mapped, and not swept."""
    t = LmdbTier(tmp_path / "job\nb", 1 << 20, name="ram")
    t.open()
    t.put_many([(b"k", b"v")])
    (info,) = find_tiers(str(tmp_path))
    assert info.in_use and sweep(str(tmp_path), older_than_s=0) == []
    assert t.get(b"k") == b"v" and (tmp_path / "job\nb").is_dir()


@pytest.mark.parametrize("default_root", ["missing", "no-such-tier"])
def test_data_clean_reports_a_tier_it_cannot_find_under_the_default_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], default_root: str
) -> None:
    """A mistyped ``--tier`` without ``--root`` is one error line naming the tier and where it was looked for (exit 1,
    as a missing target is for ``data pack``), and nothing is removed: neither a tier nor a user's files beside it."""
    root = tmp_path / "shm"
    monkeypatch.setenv("LIGHTNING_ACCEL_RAM_ROOT", str(root))
    if default_root == "no-such-tier":
        stale = _tier(root, "stale", 7200)
        (root / "proj").mkdir()  # a user's files beside the tiers
        (root / "proj" / "notes.txt").write_text("mine\n")
    before = _snapshot(root) if root.exists() else None
    assert data_main(["clean", "--tier", "typo"]) == 1
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and len(cap.err) <= 400
    assert "`--tier` 'typo'" in cap.err and repr(str(root)) in cap.err
    assert (_snapshot(root) if root.exists() else None) == before
    if default_root == "no-such-tier":
        assert stale.exists() and (root / "proj" / "notes.txt").read_text() == "mine\n"


def test_data_clean_without_tier_under_a_missing_default_root_has_nothing_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LIGHTNING_ACCEL_RAM_ROOT", str(tmp_path / "shm"))
    assert data_main(["clean"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == []


def test_data_clean_names_the_fix_for_a_tier_given_as_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary lists tiers by their full path; passed back as `--tier`, the error says how to name it."""
    stale = _tier(tmp_path, "stale", 7200)
    assert data_main(["clean", "--root", str(tmp_path), "--tier", str(stale)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"Pass `--tier stale` with `--root {tmp_path}`." in err
    assert stale.exists()
    assert data_main(["clean", "--root", str(tmp_path), "--tier", "stale"]) == 0 and not stale.exists()


def test_data_clean_pointed_at_a_tier_itself_names_its_parent_and_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tier's own files are not tiers: the refusal gives the `--root` and `--tier` that remove it, not `--tier NAME`
    with no name to give."""
    stale = _tier(tmp_path, "stale", 7200)
    before = _snapshot(stale)
    assert data_main(["clean", "--root", str(stale)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is a RAM tier itself" in err
    assert f"Pass `--root {tmp_path}` `--tier stale`" in err and _snapshot(stale) == before
