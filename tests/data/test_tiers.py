from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import stat
from pathlib import Path

import pytest

from lightning_accel.data import tiers as tiers_mod
from lightning_accel.data.tiers import BudgetTooSmallError, LmdbTier, parse_bytes
from tests.helpers import mounted_tmpfs, run_in_processes

VAL = 10_000  # bytes per test value: 3 LMDB overflow pages


def _items(lo: int, hi: int, size: int = VAL) -> list[tuple[bytes, bytes]]:
    return [(f"k{i:05d}".encode(), bytes([i % 251]) * size) for i in range(lo, hi)]


def test_put_get_contains_delete(tmp_cache_dir: Path) -> None:
    t = LmdbTier(tmp_cache_dir / "ssd", 4 << 20)
    r = t.put_many(_items(0, 10))
    assert (r.stored, r.rejected, r.evicted) == (10, 0, 0)
    assert t.get(b"k00003") == bytes([3]) * VAL
    assert t.get(b"nope") is None
    assert t.contains([b"k00001", b"zzz"]) == [True, False]
    assert t.put_many(_items(0, 2)).rejected == 2  # already there: left alone
    assert t.delete([b"k00001", b"missing"]) == 1
    assert len(t) == 9
    assert t.used_bytes() == 9 * t.cost(b"k00000", VAL)
    with t.reader() as get:
        view = get(b"k00002")
        assert isinstance(view, memoryview) and view[0] == 2


def test_asking_an_unwritten_tier_creates_nothing_and_a_written_one_answers(tmp_cache_dir: Path) -> None:
    path = tmp_cache_dir / "ssd"
    t = LmdbTier(path, 4 << 20)
    assert t.contains([b"k00001", b"k00002"]) == [False, False]
    assert not path.exists()  # no environment opened (a fork would only close it again)
    writer = LmdbTier(path, 4 << 20)  # another handle of the same directory stores first
    writer.put_many(_items(0, 3))
    assert t.contains([b"k00001", b"zzz"]) == [True, False]


def test_keep_policy_never_exceeds_the_budget_and_keeps_a_stable_subset(tmp_cache_dir: Path) -> None:
    budget = 1 << 20
    t = LmdbTier(tmp_cache_dir / "ssd", budget, policy="keep")
    for lo in range(0, 300, 25):
        t.put_many(_items(lo, lo + 25))
    n = len(t)
    assert 0 < n < 300
    assert t.used_bytes() <= t.usable_bytes <= budget
    assert t.file_bytes() <= budget
    first = t.contains([k for k, _ in _items(0, n)])
    assert all(first)  # the first entries that fit stay: a scan does not churn the cache
    assert t.put_many(_items(1000, 1010)).rejected == 10


def test_fifo_policy_evicts_the_oldest(tmp_cache_dir: Path) -> None:
    t = LmdbTier(tmp_cache_dir / "ssd", 1 << 20, policy="fifo")
    assert t.put_many(_items(0, 100)).evicted > 0  # 1.2 MB into a 1 MB budget
    n = len(t)
    evicted = t.put_many(_items(100, 110)).evicted
    assert evicted >= 10
    assert t.get(b"k00000") is None and t.get(b"k00109") is not None
    assert len(t) == n + 10 - evicted
    assert t.used_bytes() <= t.usable_bytes and t.file_bytes() <= (1 << 20)


def test_map_grows_on_map_full(tmp_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers_mod, "_INITIAL_MAP", 1 << 20)
    t = LmdbTier(tmp_cache_dir / "ssd", None)
    for lo in range(0, 400, 50):  # 4 MB of values into a 1 MB initial map
        assert t.put_many(_items(lo, lo + 50)).stored == 50
    assert t._env.info()["map_size"] > (1 << 20)
    assert len(t) == 400


def test_budget_smaller_than_one_sample_names_both_numbers(tmp_cache_dir: Path) -> None:
    t = LmdbTier(tmp_cache_dir / "ssd", 64 << 10, name="ssd")
    with pytest.raises(BudgetTooSmallError, match=r"`ssd_bytes` budget 65536 bytes.*\(\d+ bytes for a 200000-byte"):
        t.put_many([(b"big", b"x" * 200_000)])


def test_unwritable_directory_warns_once_and_disables(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores directory permissions: use a path under a regular file instead (mkdir fails for everyone)
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "ssd"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        path = ro / "ssd"
    t = LmdbTier(path, 1 << 20)
    with pytest.warns(RuntimeWarning, match="disabled"):
        assert not t.open()
    assert t.disabled
    assert t.put_many(_items(0, 2)).stored == 0
    assert t.get(b"k00000") is None  # no second warning, no error


def test_pickle_drops_the_environment(tmp_cache_dir: Path) -> None:
    import lmdb

    t = LmdbTier(tmp_cache_dir / "ssd", 1 << 20)
    t.put_many(_items(0, 3))
    t2 = pickle.loads(pickle.dumps(t))
    assert not any(isinstance(v, lmdb.Environment) for v in vars(t2).values())  # no handle travels
    assert t2.get(b"k00001") == bytes([1]) * VAL
    assert t2._env is t._env  # in one process, one environment per directory (LMDB forbids two)


def _child_reads_and_writes(path: str, q: mp.Queue) -> None:
    t = LmdbTier(path, 4 << 20)
    q.put((t.get(b"k00002") == bytes([2]) * VAL, t.put_many(_items(50, 55)).stored))


def test_a_forked_child_opens_its_own_environment(tmp_cache_dir: Path) -> None:
    # (spawned processes are covered by the DataLoader worker test in test_dataset.py)
    t = LmdbTier(tmp_cache_dir / "ssd", 4 << 20)
    t.put_many(_items(0, 5))  # the parent has the environment open while it forks
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads_and_writes, args=(str(tmp_cache_dir / "ssd"), q))
    p.start()
    ok, stored = q.get(timeout=120)
    p.join(30)
    assert ok and stored == 5 and p.exitcode == 0
    assert t.get(b"k00052") == bytes([52 % 251]) * VAL  # the parent still works and sees the child's writes
    assert len(t) == 10


def _rank_writes(rank: int, world: int, path: str) -> tuple[int, int]:
    t = LmdbTier(path, 2 << 20)
    total = 0
    for lo in range(0, 200, 20):  # both ranks write overlapping key ranges into one directory
        total += t.put_many(_items(lo + rank * 10, lo + rank * 10 + 20)).stored
    return total, t.used_bytes()


def test_two_processes_share_one_directory_within_the_budget(tmp_cache_dir: Path) -> None:
    path = str(tmp_cache_dir / "ssd")
    res = run_in_processes(_rank_writes, 2, (path,), init_process_group=False, timeout=120)
    t = LmdbTier(path, 2 << 20)
    assert sum(r[0] for r in res) == len(t)  # no key stored twice
    assert t.used_bytes() == len(t) * t.cost(b"k00000", VAL)  # one consistent count across processes
    assert t.used_bytes() <= t.usable_bytes and t.file_bytes() <= (2 << 20)


@pytest.mark.parametrize(
    ("value", "expected"), [(5, 5), ("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("0", 0), (None, None)]
)
def test_parse_bytes(value: object, expected: int | None) -> None:
    assert parse_bytes(value, name="ssd_bytes") == expected  # type: ignore[arg-type]


def test_parse_bytes_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="`ram_bytes` must be a byte count .*, or None for no cap, got 'lots'"):
        parse_bytes("lots", name="ram_bytes")
    with pytest.raises(ValueError, match="`ram_bytes` must be a byte count .*, got -1"):
        parse_bytes(-1, name="ram_bytes")
    with pytest.raises(TypeError, match=r"`ram_bytes` must be a byte count .*, got True \(bool\)"):
        parse_bytes(True, name="ram_bytes")


def test_tier_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`ssd_bytes` must be an integer >= 0 or None, got -1\. None: no cap"):
        LmdbTier("/nonexistent/x", -1)
    with pytest.raises(TypeError, match=r"`ram_bytes` must be an integer >= 0 or None, got True \(bool\)"):
        LmdbTier("/nonexistent/x", True, name="ram")
    with pytest.raises(ValueError, match="`policy` must be 'keep' or 'fifo', got 'lru'"):
        LmdbTier("/nonexistent/x", 1 << 20, policy="lru")
    with pytest.raises(ValueError, match=r"LmdbTier: `name` must be a non-empty string .*, got ''\. Use e\.g\."):
        LmdbTier("/nonexistent/x", 1 << 20, name="")
    with pytest.raises(TypeError, match=r"`sync` must be"):
        LmdbTier("/nonexistent/x", 1 << 20, sync="no")


def test_buffer_pool_bounds_its_buffers() -> None:
    from lightning_accel.data.buffers import BufferPool

    assert BufferPool(0).max_buffers == 0  # pooling off
    with pytest.raises(ValueError, match=r"`max_buffers` must be an integer >= 0 and <= 1024, got 100000\. 0 turns"):
        BufferPool(100_000)
    with pytest.raises(TypeError, match=r"`max_buffers` must be an integer .*, got 2\.0 \(float\)"):
        BufferPool(2.0)  # type: ignore[arg-type]


_FILL_A_SMALL_TMPFS = """
import os, sys, warnings
from lightning_accel.data.tiers import LmdbTier
warnings.simplefilter("always")
t = LmdbTier(sys.argv[1], 64 << 20, name="ram", policy=sys.argv[2])
v = os.urandom(150_000)
stored = 0
with warnings.catch_warnings(record=True) as seen:
    for b in range(60):  # 72 MB of entries against an 8 MB filesystem
        stored += t.put_many([(f"k{b}-{i}".encode(), v) for i in range(8)]).stored
assert 0 < stored < 60 and len(t) == stored or sys.argv[2] == "fifo", (stored, len(t))
assert not t.disabled
keys, n = t.scan_keys(b"k", limit=1000), len(t)
with t.reader() as get:
    assert sum(bytes(get(k)) == v for k in keys) == n
full = [w for w in seen if "is full" in str(w.message)]
assert len(full) == 1 and "`ram_bytes`" in str(full[0].message), [str(w.message) for w in seen]
print("ok", stored, len(t))
"""


@pytest.mark.parametrize("policy", ["keep", "fifo"])
def test_a_tier_on_a_full_tmpfs_stops_admitting_instead_of_crashing(tmp_path: Path, policy: str) -> None:
    # A RAM tier writes through its map on tmpfs, where a write into a full filesystem is a SIGBUS: its budget above
    # the filesystem's room must end in one warning and a full tier, the process alive. Run in a child process so
    # that a crash is seen as one.
    import subprocess
    import sys

    with mounted_tmpfs(tmp_path / "shm", "8m") as d:
        out = subprocess.run(
            [sys.executable, "-c", _FILL_A_SMALL_TMPFS, str(d / "ram"), policy],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("ok")


def _lmdb_keys(path: Path) -> list[bytes]:
    """The main database's keys, read in a child process (LMDB forbids a second environment in this one)."""
    import subprocess
    import sys

    code = (
        "import lmdb, sys; e = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=8); "
        "print(' '.join(sorted(bytes(k).decode() for k, _ in e.begin().cursor())))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    return [k.encode() for k in out.stdout.split()]


def test_the_ssd_tier_never_writes_into_an_lmdb_database_of_the_users(tmp_path: Path) -> None:
    """``cache_dir/ssd`` holding the user's own LMDB database: the SSD tier used to add its databases and entries to
    it (the RAM tier already refused such a directory)."""
    import lmdb

    path = tmp_path / "cache" / "ssd"
    path.mkdir(parents=True)
    env = lmdb.open(str(path), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"mine", b"precious")
    env.close()
    tier = LmdbTier(str(path), 4 << 20, name="ssd")
    with pytest.warns(RuntimeWarning, match=r"ssd tier at .* is disabled .*holds an LMDB database \(data\.mdb\)"):
        assert not tier.open()
    tier.put_many([(b"k", b"v" * 100)])  # a disabled tier writes nothing
    assert _lmdb_keys(path) == [b"mine"]
    own = LmdbTier(str(tmp_path / "cache2" / "ssd"), 4 << 20, name="ssd")  # a tier's own directory reopens
    assert own.open()
    own.put_many([(b"k", b"v" * 100)])
    own.flush()
    assert _lmdb_keys(tmp_path / "cache2" / "ssd") == [b"data", b"fifo", b"index", b"meta"]
