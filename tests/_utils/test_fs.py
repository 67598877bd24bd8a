"""FileStore: the one fsspec layer (local, memory://, moto S3), its error split, retries, fork and pickle safety."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractFileSystem

from lightning_accel._utils.fs import FileStore, StorageUnavailableError, is_transient, storage_endpoint


@pytest.fixture(params=["local", "file-url", "memory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(root URL, storage_options)`` of an empty directory on each kind of storage."""
    if request.param == "local":
        yield str(tmp_path / "root"), {}
    elif request.param == "file-url":
        yield f"file://{tmp_path}/root", {}
    elif request.param == "memory":
        name = f"la-test-fs-{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}/root", {}
        with contextlib.suppress(FileNotFoundError):
            MemoryFileSystem().rm(f"/{name}", recursive=True)
    else:
        bucket, opts = request.getfixturevalue("s3_bucket")
        yield f"s3://{bucket}/root", opts


def test_operations_on_every_kind_of_storage(root: tuple[str, dict[str, Any]]) -> None:
    url, opts = root
    store = FileStore(opts)
    assert not store.exists(f"{url}/a.bin") and store.list_files(url) == [] and store.find(url) == []
    store.write(f"{url}/a.bin", b"0123456789")
    store.write(f"{url}/sub/b.bin", memoryview(b"bb"))
    store.write(f"{url}/a.bin", b"abcdefghij")  # replaced atomically
    assert store.read(f"{url}/a.bin") == b"abcdefghij"
    assert store.read(f"{url}/a.bin", 2, 5) == b"cde"  # one ranged read
    assert store.read(f"{url}/a.bin", -3) == b"hij"
    assert store.head(f"{url}/a.bin", 4) == b"abcd" and store.head(f"{url}/sub/b.bin", 100) == b"bb"
    assert store.exists(f"{url}/a.bin") and store.isdir(f"{url}/sub") and not store.isdir(f"{url}/a.bin")
    assert store.list_files(url) == ["a.bin"]  # files directly inside, names only
    assert sorted(store.find(url)) == ["a.bin", "sub/b.bin"]
    store.rm(f"{url}/a.bin")
    store.rm(f"{url}/a.bin")  # a missing file is not an error
    assert not store.exists(f"{url}/a.bin") and store.find(url) == ["sub/b.bin"]
    with pytest.raises(FileNotFoundError, match=r"a\.bin"):  # permanent: raised at once, naming the URL
        store.read(f"{url}/a.bin")
    fs, path = store.resolve(url)
    assert fs is store.filesystem(f"{url}/sub") and "://" not in path and path.rstrip("/").endswith("root")


def test_local_symlinks_stay_links(tmp_path: Path) -> None:
    store = FileStore()
    (tmp_path / "target").write_bytes(b"x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert store.exists(tmp_path / "dangling")  # can be replaced or removed, not mistaken for free
    assert sorted(store.list_files(tmp_path)) == ["dangling", "link", "target"]
    store.rm(tmp_path / "link")
    assert (tmp_path / "target").exists() and not (tmp_path / "link").exists()


def test_s3_missing_key_names_the_url(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    with pytest.raises(FileNotFoundError, match=rf"s3://{bucket}/nope\.bin"):  # s3fs alone names no key
        FileStore(opts, retries=0).read(f"s3://{bucket}/nope.bin")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError("timed out"), True),
        (OSError(errno.EIO, "Slow Down"), True),  # what s3fs raises for throttling and unknown 5xx
        (RuntimeError("event loop hiccup"), True),
        (FileNotFoundError("k"), False),
        (PermissionError("Access Denied"), False),
        (IsADirectoryError("d"), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (OSError(errno.EROFS, "Read-only file system"), False),
        (ValueError("bad key"), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_one_classification_of_errors(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


class FlakyFS(AbstractFileSystem):
    """A fake remote filesystem (``la-flaky://``): reads fail with a transient error while ``failures`` > 0."""

    protocol = "la-flaky"
    failures = 0
    calls = 0
    files: dict[str, bytes] = {}

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        FlakyFS.calls += 1
        if FlakyFS.failures > 0:
            FlakyFS.failures -= 1
            raise ConnectionResetError("connection reset by peer")
        if path not in FlakyFS.files:
            raise FileNotFoundError(path)
        return FlakyFS.files[path][start:end]


@pytest.fixture
def flaky() -> Iterator[type[FlakyFS]]:
    fsspec.register_implementation(FlakyFS.protocol, FlakyFS, clobber=True)
    FlakyFS.files = {"/bucket/k": b"payload"}
    FlakyFS.failures = FlakyFS.calls = 0
    yield FlakyFS


def test_transient_errors_are_retried_with_exponential_backoff(
    flaky: type[FlakyFS], monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    retried: list[BaseException] = []
    store = FileStore(retries=3, backoff_s=0.01)
    flaky.failures = 3
    assert store.read("la-flaky:///bucket/k", 0, 3, on_retry=retried.append) == b"pay"
    assert sleeps == pytest.approx([0.01, 0.02, 0.04]) and len(retried) == 3 and flaky.calls == 4
    flaky.failures, flaky.calls = 10, 0
    with pytest.raises(StorageUnavailableError, match=r"la-flaky:///bucket/k.* after 4 attempts.*ConnectionReset") as e:
        store.read("la-flaky:///bucket/k")
    assert e.value.attempts == 4 and e.value.url == "la-flaky:///bucket/k" and flaky.calls == 4
    assert isinstance(e.value.__cause__, ConnectionResetError)
    flaky.failures, flaky.calls = 0, 0
    with pytest.raises(FileNotFoundError, match=r"la-flaky:///bucket/missing"):  # permanent: one call, no retry
        store.read("la-flaky:///bucket/missing")
    assert flaky.calls == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="`storage_options` must be a dict"):
        FileStore("anon=true")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^`storage_options` must be .*, got a key 1 \(int\)\. Write each option's"):
        FileStore({1: "x"})
    with pytest.raises(ValueError, match="`retries` must be an integer >= 0"):
        FileStore(retries=-1)
    with pytest.raises(ValueError, match="`backoff_s`"):
        FileStore(backoff_s=-0.1)
    with pytest.raises(ValueError, match="`backoff_s` must be a number >= 0 and <= 86400, got inf"):
        FileStore(backoff_s=float("inf"))


def test_many_retries_wait_at_most_a_day_each(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    store = FileStore(retries=80, backoff_s=3600.0)

    def reset() -> bytes:
        raise ConnectionResetError("reset")

    with pytest.raises(StorageUnavailableError, match="after 81 attempts"):  # never an OverflowError from the wait
        store.call("read", "s3://b/k", reset)
    assert sleeps[:2] == [3600.0, 7200.0] and max(sleeps) == 86_400.0 and len(sleeps) == 80


@pytest.mark.parametrize(
    "error", [ValueError("Invalid bucket name"), NotImplementedError("not supported"), TypeError("x")]
)
def test_permanent_errors_of_any_kind_name_the_url(error: Exception) -> None:
    def op() -> bytes:
        raise error

    with pytest.raises(type(error), match=r"cannot read 'memory://bucket/key': ") as info:
        FileStore(retries=0).call("read", "memory://bucket/key", op)
    assert type(info.value) is type(error) and info.value.__cause__ is error


def test_pickles_without_its_filesystems(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    store = FileStore(opts, retries=2)
    store.write(f"s3://{bucket}/k", b"v")
    parent_fs = store.filesystem(f"s3://{bucket}")
    data = pickle.dumps(store)
    assert b"S3FileSystem" not in data  # the factory travels, not the filesystem (nor its event loop)
    copy = pickle.loads(data)
    assert copy.storage_options == opts and copy.retries == 2
    assert copy.read(f"s3://{bucket}/k") == b"v" and copy.filesystem(f"s3://{bucket}") is not parent_fs


def _wait(pid: int, timeout_s: float = 60.0) -> int:
    """The exit code of child ``pid``; kill it and fail when it hangs (a deadlocked inherited event loop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs os.fork")
def test_a_forked_child_makes_its_own_s3_filesystem(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    store = FileStore(opts)
    store.write(f"s3://{bucket}/k", b"v")  # the parent's s3fs is live: its loop thread and connections exist
    parent_fs = store.filesystem(f"s3://{bucket}")
    loader = parent_fs.session.get_component("data_loader")
    pid = os.fork()
    if pid == 0:  # the child: must not touch the parent's filesystem, and its reads must work
        code = 1
        try:
            fs = store.filesystem(f"s3://{bucket}")
            ok = fs is not parent_fs and store.read(f"s3://{bucket}/k") == b"v"
            # ...with a session of its own, whose botocore loader is the one the parent filled (no second parse of
            # the service model: ~60 ms of CPU per DataLoader worker)
            shared = fs.session is not parent_fs.session and fs.session.get_component("data_loader") is loader
            code = 0 if ok and shared else 2
        finally:
            os._exit(code)
    assert _wait(pid) == 0
    assert store.filesystem(f"s3://{bucket}") is parent_fs and store.read(f"s3://{bucket}/k") == b"v"


def test_s3_filesystems_share_one_botocore_loader_and_keep_a_users_session(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    from aiobotocore.session import AioSession

    bucket, opts = s3_bucket
    a, b = FileStore(opts), FileStore(opts)
    a.write(f"s3://{bucket}/k", b"v")
    fa, fb = a.filesystem(f"s3://{bucket}"), b.filesystem(f"s3://{bucket}")
    assert fa.session is not fb.session
    assert fa.session.get_component("data_loader") is fb.session.get_component("data_loader")
    assert b.read(f"s3://{bucket}/k") == b"v"
    mine = AioSession()
    c = FileStore({**opts, "session": mine})
    assert c.filesystem(f"s3://{bucket}").session is mine and c.read(f"s3://{bucket}/k") == b"v"


def test_retries_count_every_attempt_on_s3() -> None:
    """``retries`` is the whole budget: neither botocore nor s3fs retries inside an attempt (5 requests each before)."""
    import socket
    import threading

    requests: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()
    body = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"
    reply = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    def serve() -> None:  # an S3 endpoint answering every request with a 500: a transient error
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(2)
            with contextlib.suppress(OSError), conn:
                while data := conn.recv(65536):
                    requests.append(data.split(b"\r\n")[0])
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    try:
        with pytest.raises(StorageUnavailableError, match="after 3 attempts") as info:
            FileStore(opts, retries=2, backoff_s=0.0).read("s3://bucket/key", 0, 10)
        assert info.value.attempts == 3 and requests == [b"GET /bucket/key HTTP/1.1"] * 3
        requests.clear()
        with pytest.raises(StorageUnavailableError):  # a retry policy the user configures is theirs to keep
            mine = {**opts, "config_kwargs": {"retries": {"total_max_attempts": 2}}}
            FileStore(mine, retries=0).read("s3://bucket/key", 0, 10)
        assert len(requests) == 2
    finally:
        stop.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(
    ("options", "endpoint"),
    [
        (None, None),
        ({"key": "k", "secret": "s"}, None),  # credentials alone: the protocol's default endpoint
        ({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000/"}, "secret": "s"}, "http://127.0.0.1:9000"),
        ({"endpoint_url": "https://minio.local"}, "https://minio.local"),
        ({"host": "https://gcs.example"}, "https://gcs.example"),
        ({"client_kwargs": {"region_name": "eu-west-1"}}, None),
    ],
)
def test_storage_endpoint_reads_the_endpoint_never_the_credentials(options: Any, endpoint: str | None) -> None:
    assert storage_endpoint(options) == endpoint
