"""The package's one fsspec access layer: every file the data and checkpoint rooms read or write goes through a
:class:`FileStore`.

- **URLs.** Plain paths, ``file://`` URLs and any single-protocol fsspec URL (``s3://``, ``gs://``, ``memory://``,
  ...). Local files are served by ``os`` directly: symlinks stay links (a dangling one "exists", listings include
  links), reads skip fsspec's file objects, and writes are tmp + fsync + rename. Other URLs go to fsspec, with paths
  from the public ``fsspec.core.strip_protocol``.
- **One filesystem per protocol and process**, made on first use with ``skip_instance_cache=True`` and kept in a
  :class:`~lightning_accel._utils.forksafe.PerProcess`: async filesystems such as s3fs own an event loop and open
  connections that a forked DataLoader worker must never share. A pickled FileStore carries no filesystem either.
- **Errors.** One classification (:func:`is_transient`). Permanent errors (missing key, access denied, a directory
  where a file was expected, a full or read-only disk, bad arguments) fail at once, keeping their type so callers can
  still ``except FileNotFoundError``, and name the URL. Anything else (connection resets, timeouts, throttling, 5xx)
  is retried ``retries`` times with exponential backoff ``backoff_s * 2**attempt`` (each wait at most a day), then
  raised as :class:`StorageUnavailableError` naming the URL and the attempts. These are the only retries: an S3
  filesystem is made with s3fs's and botocore's own retries off (botocore's stay if ``storage_options`` configure
  them). Both retry inside each of our attempts: an unreachable store took ~40 s to report with ``retries=4``, and a
  connection closed by the server was tried 10 times per attempt.
- **Writes publish atomically** through :func:`~lightning_accel._utils.atomic.atomic_write_bytes`: readers see the
  old object or the new one, never a partial one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lightning_accel._utils.atomic import atomic_write_bytes, is_local_url, strip_file_scheme
from lightning_accel._utils.checks import check_int, check_number
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess

__all__ = ["FileStore", "StorageUnavailableError", "is_transient", "storage_endpoint"]

_T = TypeVar("_T")

# Retrying these cannot help: the object is missing or of the wrong kind, access is denied, the arguments are wrong.
_PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    NotImplementedError,
    ValueError,
    TypeError,
)
# ... nor these, which arrive as a plain OSError (a full, read-only or over-quota disk, a name too long).
_PERMANENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG, errno.EINVAL, errno.ENOTEMPTY, errno.EXDEV}
)
# Built-in error types whose message is rewritten to name the URL (s3fs's say only "The specified key does not
# exist.", with no key at all), keeping the type.
_RENAMEABLE = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError, OSError)
# Permanent errors of these exact types (fsspec's "Invalid bucket name", "not supported") carry no URL: re-raised as
# the same type with the URL in front. Subclasses keep theirs: their constructors take other arguments.
_RENAMEABLE_PLAIN = (ValueError, TypeError, NotImplementedError)
# The longest single wait between retries: `time.sleep` overflows near 1e10 s, and no store outage worth waiting for
# lasts longer than a day.
_MAX_BACKOFF_S = 86_400.0
# Protocols served by s3fs, whose botocore client retries on its own unless told not to.
_BOTOCORE_PROTOCOLS = frozenset({"s3", "s3a"})
# botocore's data loader (the parsed S3 service model, endpoint rules and partitions) shared by every S3 filesystem
# this process makes, and inherited by the processes it forks: see `_share_botocore_loader`.
_botocore_loader: Any = None
_botocore_loader_lock = ForkSafeLock()
_DEFAULT_ERRNO = {
    FileNotFoundError: errno.ENOENT,
    FileExistsError: errno.EEXIST,
    PermissionError: errno.EACCES,
    IsADirectoryError: errno.EISDIR,
    NotADirectoryError: errno.ENOTDIR,
}


class StorageUnavailableError(OSError):
    """Transient errors (connection resets, timeouts, throttling, 5xx) outlasted the retry budget.

    Attributes:
        url: the URL the operation was on.
        attempts: how many times it was tried.
    """

    def __init__(self, message: str, *, url: str = "", attempts: int = 0) -> None:
        super().__init__(message)
        self.url = url
        self.attempts = attempts


def is_transient(error: BaseException) -> bool:
    """True when retrying the operation that raised ``error`` may succeed.

    Permanent: missing or wrong-kind objects, denied access, bad arguments (``ValueError``, ``TypeError``), an
    unsupported operation, and ``OSError`` s of a full / read-only / over-quota disk or an invalid name. Transient:
    every other ``Exception`` (connection errors, timeouts, throttling, server errors, ``EIO``). ``KeyboardInterrupt``
    and other ``BaseException`` s are never retried.
    """
    if not isinstance(error, Exception) or isinstance(error, _PERMANENT):
        return False
    return not (isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS)


def _naming(error: Exception, url: str, op: str = "access") -> Exception:
    """``error``, or an error of the same built-in type whose message names ``url`` (the original as its cause)."""
    if url in str(error):
        return error
    if type(error) in _RENAMEABLE_PLAIN:
        return type(error)(f"cannot {op} {url!r}: {error}")
    if type(error) not in _RENAMEABLE:
        return error
    assert isinstance(error, OSError)
    code = error.errno or _DEFAULT_ERRNO.get(type(error), errno.EIO)
    # OSError(errno, ...) picks the subclass of that errno itself, so the type is kept (or made more precise).
    return OSError(code, error.strerror or os.strerror(code), url)


def _one_retry_layer(protocol: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for a new ``protocol`` filesystem, with botocore's retries off unless they say otherwise.

    :meth:`FileStore.call` retries transient errors itself; a client retrying inside each of its attempts multiplies
    the attempts and the time to report an unreachable store.
    """
    out = dict(options)
    if protocol not in _BOTOCORE_PROTOCOLS:
        return out
    config = out.get("config_kwargs")
    if config is None:
        config = {}
    elif not isinstance(config, Mapping):
        return out  # s3fs reports the bad value itself
    if "retries" not in config:
        out["config_kwargs"] = {**config, "retries": {"total_max_attempts": 1}}
    return out


def _read_local(path: str, start: int | None, end: int | None) -> bytes:
    """Bytes ``[start, end)`` of a local file; negative offsets count from the end (as fsspec's ``cat_file``)."""
    with open(path, "rb") as f:
        if start is None and end is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        lo = 0 if start is None else (start if start >= 0 else max(0, size + start))
        hi = size if end is None else min(size, end if end >= 0 else size + end)
        f.seek(lo)
        return f.read(max(0, hi - lo))


def check_storage_options(value: object, name: str = "storage_options") -> dict[str, Any]:
    """``value`` as a dict of fsspec options: None (no options) or a mapping whose keys, and those of the mappings
    nested in it (``client_kwargs``, ...), are strings, as fsspec passes them on as keyword arguments. A non-string
    key would otherwise fail only at the first read, deep inside fsspec ("keywords must be strings"). The error names
    the key, never the values (they hold credentials).

    Raises:
        TypeError: ``value`` is not a mapping, or one of its keys is not a string.
    """
    expected = "a dict of fsspec options with string keys (e.g. {'key': ..., 'secret': ...}) or None"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"`{name}` must be {expected}, got {value!r} ({type(value).__name__}).")
    todo: list[tuple[str, Mapping[Any, Any]]] = [("", value)]
    while todo:
        where, options = todo.pop()
        for key, inner in options.items():
            if not isinstance(key, str):
                within = f" in `{name}{where}`" if where else ""
                raise TypeError(
                    f"`{name}` must be {expected}, got a key {key!r} ({type(key).__name__}){within}. Write each "
                    "option's name as a string."
                )
            if isinstance(inner, Mapping):
                todo.append((f"{where}[{key!r}]", inner))
    return dict(value)


def storage_endpoint(options: Mapping[str, Any] | None) -> str | None:
    """The service endpoint ``options`` point a filesystem at, or None for the protocol's default: ``endpoint_url``
    (s3fs, gcsfs, adlfs ...), ``client_kwargs["endpoint_url"]`` (s3fs through botocore), ``endpoint`` or ``host``.

    One URL such as ``s3://data/train`` names other objects on another endpoint (a MinIO beside AWS, a moto server in
    a test), so what is derived from a URL alone (a listing saved beside a cache) is told apart by this too. Never the
    credentials: a rotated key is the same store.
    """
    if not options:
        return None
    for where in (options, options.get("client_kwargs")):
        if isinstance(where, Mapping):
            for key in ("endpoint_url", "endpoint", "host"):
                value = where.get(key)
                if isinstance(value, str) and value:
                    return value.rstrip("/")
    return None


def _share_botocore_loader(fs: Any) -> None:
    """Give a new s3fs filesystem that has no session yet (none in ``storage_options``) the session s3fs would make,
    with the process's shared botocore data loader.

    Each botocore session parses the S3 service model and the endpoint rules from its data files on its first client:
    measured here, a forked DataLoader worker's first request took 117 ms of CPU with its own loader and 60 ms with the
    parent's, already filled by the listing the parent made. The loader holds parsed JSON only (no connection, lock or
    event loop), so sharing it across threads and forks is safe; a session configured with its own ``data_path`` keeps
    its own loader.
    """
    global _botocore_loader
    if getattr(fs, "session", False) is not None or not isinstance(getattr(fs, "kwargs", None), dict):
        return  # a session of the user's, or not s3fs
    from aiobotocore.session import AioSession

    session = AioSession(**fs.kwargs)  # what s3fs's set_session makes when it has none
    if not session.get_config_variable("data_path"):
        with _botocore_loader_lock:
            if _botocore_loader is None:
                _botocore_loader = session.get_component("data_loader")
            loader = _botocore_loader
        session.register_component("data_loader", loader)
    fs.session = session


class FileStore:
    """Files at local paths and fsspec URLs, with one set of ``storage_options``, bounded retries and atomic writes.

    Every operation takes a full URL (or path). Usable from any thread; safe to fork and to pickle (each process
    makes its own filesystems, see the module docstring).

    Args:
        storage_options: fsspec options for remote URLs (endpoint, credentials), e.g.
            ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`` for S3. botocore's own retries
            stay off unless ``config_kwargs`` sets ``"retries"``.
        retries: retries of a transient error before :class:`StorageUnavailableError` is raised (the only retries:
            ``retries=0`` is one attempt).
        backoff_s: the first backoff in seconds (at most a day); it doubles with each retry, each wait capped at a
            day. The defaults ride out ~3 s of errors (0.2 + 0.4 + 0.8 + 1.6 s of waits).

    Raises:
        TypeError: ``storage_options`` is not a mapping, ``retries`` not an int or ``backoff_s`` not a number.
        ValueError: ``retries`` or ``backoff_s`` is negative, or ``backoff_s`` is above a day (or infinite).
    """

    def __init__(
        self, storage_options: Mapping[str, Any] | None = None, *, retries: int = 4, backoff_s: float = 0.2
    ) -> None:
        options = check_storage_options(storage_options)
        self.retries: int = check_int("retries", retries, low=0, fix="Use 0 to fail on the first transient error.")
        self.backoff_s: float = check_number(
            "backoff_s", backoff_s, low=0, high=_MAX_BACKOFF_S, fix="It is the first retry's wait in seconds."
        )
        self.storage_options: dict[str, Any] = options
        self._filesystems: PerProcess[dict[str, Any]] = PerProcess(dict)  # protocol -> this process's filesystem
        self._lock = ForkSafeLock()

    def __repr__(self) -> str:
        return f"FileStore(protocols={sorted(self._filesystems.get())}, retries={self.retries})"

    # ---- filesystems -------------------------------------------------------------------------------------------
    def filesystem(self, url: str | os.PathLike[str]) -> Any:
        """This process's fsspec filesystem for ``url``'s protocol (made on first use, never shared across a fork)."""
        import fsspec

        u = os.fspath(url)
        protocol = fsspec.utils.get_protocol(u)
        cache = self._filesystems.get()
        fs = cache.get(protocol)
        if fs is None:
            with self._lock:  # the read pool's threads may ask at once: make one filesystem, not several
                fs = cache.get(protocol)
                if fs is None:
                    # skip_instance_cache: never reuse an instance (and its event loop) made before a fork.
                    options = _one_retry_layer(protocol, self.storage_options)
                    fs = fsspec.core.url_to_fs(u, skip_instance_cache=True, **options)[0]
                    if protocol in _BOTOCORE_PROTOCOLS and isinstance(getattr(fs, "retries", None), int):
                        # s3fs's retry loops (5 tries, nested per request) are ours: one try each. This instance
                        # is ours alone (skip_instance_cache), so no other user of s3fs sees the change.
                        fs.retries = 1
                        _share_botocore_loader(fs)
                    cache[protocol] = fs
        return fs

    def fs_path(self, url: str | os.PathLike[str]) -> str:
        """``url`` as its filesystem names it (no scheme; local paths absolute)."""
        import fsspec

        return str(fsspec.core.strip_protocol(os.fspath(url)))

    def resolve(self, url: str | os.PathLike[str]) -> tuple[Any, str]:
        """``(filesystem, path)`` of ``url``, like ``fsspec.core.url_to_fs`` but with this process's filesystem."""
        return self.filesystem(url), self.fs_path(url)

    # ---- retries -----------------------------------------------------------------------------------------------
    def call(
        self,
        op: str,
        url: str,
        fn: Callable[[], _T],
        *,
        on_retry: Callable[[BaseException], None] | None = None,
    ) -> _T:
        """Run ``fn()`` (an operation ``op`` on ``url``), retrying transient errors with exponential backoff.

        Args:
            op: a verb for messages (``"read"``, ``"write"``, ...).
            url: the URL the operation is on, for messages.
            fn: the operation.
            on_retry: called with the error before each retry (e.g. to count retries).

        Raises:
            StorageUnavailableError: transient errors persisted through ``retries`` retries (the last one chained).
            Exception: a permanent error, of its own type, naming ``url``.
        """
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as e:
                if not is_transient(e):
                    named = _naming(e, url, op)
                    if named is e:
                        raise
                    raise named from e
                if attempt >= self.retries:
                    raise StorageUnavailableError(
                        f"cannot {op} {url!r} after {attempt + 1} attempts: {type(e).__name__}: {e}. Is the store "
                        "reachable (endpoint, network, credentials)? Raise `retries` for flaky stores.",
                        url=url,
                        attempts=attempt + 1,
                    ) from e
                # the exponent is bounded so that `2**attempt` stays a float (inf at worst), never an int overflow
                time.sleep(min(self.backoff_s * 2.0 ** min(attempt, 64), _MAX_BACKOFF_S))
                attempt += 1
                if on_retry is not None:
                    on_retry(e)

    # ---- operations --------------------------------------------------------------------------------------------
    def read(
        self,
        url: str | os.PathLike[str],
        start: int | None = None,
        end: int | None = None,
        *,
        on_retry: Callable[[BaseException], None] | None = None,
    ) -> bytes:
        """The bytes of ``url`` (bytes ``[start, end)`` when given: one ranged GET on object stores)."""
        u = os.fspath(url)
        if is_local_url(u):
            p = strip_file_scheme(u)
            return self.call("read", u, lambda: _read_local(p, start, end), on_retry=on_retry)

        def remote() -> bytes:
            fs, p = self.resolve(u)
            return bytes(fs.cat_file(p, start=start, end=end))

        return self.call("read", u, remote, on_retry=on_retry)

    def head(self, url: str | os.PathLike[str], n: int) -> bytes:
        """The first ``n`` bytes of ``url`` (fewer if it is shorter)."""
        return self.read(url, 0, n)

    def exists(self, url: str | os.PathLike[str]) -> bool:
        """True when something is at ``url`` (locally: a dangling symlink counts, so it can be replaced)."""
        u = os.fspath(url)
        if is_local_url(u):
            return os.path.lexists(strip_file_scheme(u))
        return bool(self.call("check", u, lambda: self.filesystem(u).exists(self.fs_path(u))))

    def isdir(self, url: str | os.PathLike[str]) -> bool:
        """True when ``url`` is a directory (or, on object stores, a prefix with objects below it)."""
        u = os.fspath(url)
        if is_local_url(u):
            return os.path.isdir(strip_file_scheme(u))
        return bool(self.call("check", u, lambda: self.filesystem(u).isdir(self.fs_path(u))))

    def rm(self, url: str | os.PathLike[str]) -> None:
        """Delete the file at ``url`` (a local symlink as a link); a missing file is not an error."""
        u = os.fspath(url)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                if is_local_url(u):
                    os.unlink(strip_file_scheme(u))
                else:
                    self.filesystem(u).rm_file(self.fs_path(u))

        self.call("remove", u, remove)

    def list_files(self, url: str | os.PathLike[str]) -> list[str]:
        """Names (not paths) of the files directly inside ``url``, symlinks included; ``[]`` if it does not exist."""
        u = os.fspath(url)

        def listing() -> list[str]:
            if is_local_url(u):
                try:
                    with os.scandir(strip_file_scheme(u)) as it:
                        return [e.name for e in it if e.is_file() or e.is_symlink()]
                except (FileNotFoundError, NotADirectoryError):
                    return []
            fs, p = self.resolve(u)
            with contextlib.suppress(Exception):  # see our own writes even with a listings cache configured
                fs.invalidate_cache(p)
            try:
                return [posixpath.basename(e["name"]) for e in fs.ls(p, detail=True) if e.get("type") == "file"]
            except FileNotFoundError:
                return []

        return self.call("list", u, listing)

    def find(self, url: str | os.PathLike[str]) -> list[str]:
        """Paths relative to ``url`` (``/``-separated) of every file below it; ``[]`` if it does not exist."""
        u = os.fspath(url)

        def walk() -> list[str]:
            if is_local_url(u):
                root = strip_file_scheme(u)
                out: list[str] = []
                for d, _, files in os.walk(root):
                    out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files]
                return out
            fs, p = self.resolve(u)
            with contextlib.suppress(Exception):
                fs.invalidate_cache(p)
            try:
                return [posixpath.relpath(f, p) for f in fs.find(p)]
            except FileNotFoundError:
                return []

        return self.call("list", u, walk)

    def write(self, url: str | os.PathLike[str], data: bytes | memoryview) -> None:
        """Publish ``data`` at ``url`` atomically (readers see the old or the new content, never a partial file)."""
        u = os.fspath(url)
        fs = None if is_local_url(u) else self.filesystem(u)
        self.call("write", u, lambda: atomic_write_bytes(u, data, storage_options=self.storage_options, fs=fs))
