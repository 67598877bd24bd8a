"""The origin tier: any fsspec URL (local path, ``file://``, ``s3://``, ``memory://``, ...) read with bounded
concurrency and bounded retries, and its listing (an ImageFolder-style tree or a JSONL manifest).

- Reads go through the package's fsspec layer (:class:`~lightning_accel._utils.fs.FileStore`): the filesystem is
  made lazily in each process (async filesystems such as s3fs are not fork-safe) and never pickled.
- Transient errors (connection resets, timeouts, throttling, 5xx) are retried ``retries`` times with exponential
  backoff (``backoff_s * 2**attempt``), the only retries (the S3 client's own are off); permanent ones (missing key,
  access denied) fail at once. Either way the error names the URL.
- Keys never escape the origin (``safe_join``).
- A tree's or manifest's listing records each key's *content identity* (:class:`SampleKeys`): its size and
  modification time on a local disk, its ETag (or another checksum or time the store lists) and size on an object
  store. The cache folds it into each entry's key, so a file changed under the same name is decoded again once the
  origin is listed again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_accel._utils.atomic import atomic_write_text, is_local_url
from lightning_accel._utils.checks import check_int
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess
from lightning_accel._utils.fs import FileStore, StorageUnavailableError, check_storage_options
from lightning_accel._utils.paths import safe_join

if TYPE_CHECKING:
    from lightning_accel.data.pack import PackIndex

__all__ = [
    "IMAGE_EXTENSIONS",
    "MAX_CONCURRENCY",
    "MAX_RETRIES",
    "Listing",
    "ObjectStore",
    "OriginError",
    "SampleKeys",
    "check_origin",
    "check_storage_options",
    "content_stamp",
    "list_origin",
    "text_bytes",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_T = TypeVar("_T")

# Upper bounds a typo (an extra digit) would otherwise turn into a process brought down or a job that never fails.
# Each read in flight is a thread of the process's read pool (and a socket for a remote store): 10**6 of them
# exhaust the process's threads long before an object store serves them.
MAX_CONCURRENCY = 1024
# Waits double from `backoff_s` between retries: from 0.2 s, 16 retries already wait about 3.6 hours before giving up.
MAX_RETRIES = 16
_CONCURRENCY_FIX = "It counts origin reads in flight per process, a thread each (16 to 64 suit an object store)."


def check_origin(url: object, name: str = "origin", *, must_exist: bool = False) -> str:
    """``url`` when it is a non-empty string (a local path or an fsspec URL); with ``must_exist``, a local path (or
    ``file://`` URL) must exist as well. Remote URLs are not contacted here: their errors come when they are listed.

    Raises:
        TypeError: ``url`` is not a string.
        ValueError: ``url`` is empty (or blank).
        FileNotFoundError: ``must_exist`` and ``url`` is a local path that does not exist.
    """
    expected = "a non-empty path or fsspec URL"
    if not isinstance(url, str):
        raise TypeError(f"`{name}` must be {expected}, got {url!r} ({type(url).__name__}).")
    if not url.strip():
        raise ValueError(f"`{name}` must be {expected}, got {url!r}.")
    if must_exist and ("://" not in url or url.startswith("file://")):
        path = url.removeprefix("file://")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"`{name}` {url!r} does not exist (cwd: {os.getcwd()}). Pass a directory holding <class>/<image> "
                "files, a packed origin or a manifest's directory."
            )
    return url


def text_bytes(text: str) -> bytes:
    """``text`` as UTF-8, keeping a local file name that is not UTF-8 (Python's ``surrogateescape`` spelling of its
    bytes) as those bytes: the same bytes as ``text.encode()`` for any other text, so no key or namespace changes.

    Why: a key of a local tree comes from ``os.listdir``, which spells an undecodable byte as a lone surrogate
    (``caf\udce9.jpg`` for ``caf\xe9.jpg`` in Latin-1); plain ``encode()`` raised UnicodeEncodeError for it, so one such
    file failed ``prepare_data`` (torchvision's ``ImageFolder`` reads it)."""
    return text.encode("utf-8", "surrogateescape")


class OriginError(OSError):
    """The origin could not deliver a key (permanent error, or transient errors beyond the retry budget)."""


class _Counts:
    """What one process read through an :class:`ObjectStore` (see its ``_counts``)."""

    __slots__ = ("bytes_read", "retried")

    def __init__(self) -> None:
        self.retried = 0
        self.bytes_read = 0


class ObjectStore:
    """Reads keys under ``url`` through fsspec.

    Args:
        url: the origin root, e.g. ``/data/train``, ``file:///data/train``, ``s3://bucket/train``.
        storage_options: fsspec options (endpoint, credentials), e.g.
            ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`` for S3.
        max_concurrency: the most reads in flight from this process, 1 to 1024 (a thread each).
        retries: retries of a transient error before giving up, 0 to 16.
        backoff_s: first backoff in seconds (at most a day); doubles per retry.

    Raises:
        TypeError: ``url`` is not a string, ``max_concurrency`` or ``retries`` not an int, ``backoff_s`` not a number.
        ValueError: ``url`` is blank, or ``max_concurrency``, ``retries`` or ``backoff_s`` is out of range (or NaN).
    """

    # The filesystem, the read pool, the lock and the counters are this process's: each restarts in a pickled copy
    # (PerProcess, ForkSafeLock) and in a forked child, as the cache's baseline for the counters does.

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_concurrency: int = 16,
        retries: int = 4,
        backoff_s: float = 0.2,
    ) -> None:
        check_origin(url)
        check_int("max_concurrency", max_concurrency, low=1, high=MAX_CONCURRENCY, fix=_CONCURRENCY_FIX)
        check_int(
            "retries",
            retries,
            low=0,
            high=MAX_RETRIES,
            fix="It counts retries of a transient origin error, each wait twice the last; 0 for none.",
        )
        self.url = url.rstrip("/") if "://" in url else os.path.abspath(os.path.expanduser(url))
        # The one fsspec layer: per-process filesystems, the transient/permanent split, the retry loop.
        self.files = FileStore(storage_options, retries=retries, backoff_s=backoff_s)
        self.max_concurrency = max_concurrency
        # This process's read threads, made by the first `run` (a local origin never needs any).
        self._threads: PerProcess[ThreadPoolExecutor] = PerProcess(
            functools.partial(ThreadPoolExecutor, max_concurrency, thread_name_prefix="la-origin")
        )
        self._lock = ForkSafeLock()
        # Counters of this process, read (as differences) by the cache for its statistics. Per process, not plain
        # fields: a DataLoader worker forked while the main process's stage-ahead downloads were in flight inherited
        # the main process's count and added it to the statistics again (a packed epoch "fetched" 1.17-1.73x the
        # pack, its shards each read once).
        self._counts: PerProcess[_Counts] = PerProcess(_Counts)

    @property
    def retried(self) -> int:
        """Retries of transient errors in this process so far."""
        return self._counts.get().retried

    @property
    def bytes_read(self) -> int:
        """Bytes this process read from the origin so far."""
        return self._counts.get().bytes_read

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options of the origin."""
        return self.files.storage_options

    @property
    def retries(self) -> int:
        """Retries of a transient error before giving up."""
        return self.files.retries

    @property
    def backoff_s(self) -> float:
        """The first backoff; doubles per retry."""
        return self.files.backoff_s

    @property
    def is_local(self) -> bool:
        """True for plain paths and ``file://`` URLs."""
        return is_local_url(self.url)

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem."""
        return self.files.filesystem(self.url)

    @property
    def root(self) -> str:
        """The origin root as the filesystem sees it (no scheme)."""
        return self.files.fs_path(self.url).rstrip("/")

    @property
    def _pool(self) -> ThreadPoolExecutor | None:
        """This process's read pool; ``None`` until the first :meth:`run`."""
        return self._threads.peek()

    def url_of(self, key: str) -> str:
        """The full URL of ``key`` (for error messages)."""
        return safe_join(self.url, key)

    def _count_retry(self, error: BaseException) -> None:
        with self._lock:
            self._counts.get().retried += 1

    def fetch(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read one key (bytes ``[start, end)`` of it when given: one ranged GET), retrying transient errors.

        Raises:
            OriginError: naming the URL, for permanent errors and after the retries run out.
        """
        url = self.url_of(key)
        try:
            data = self.files.read(url, start, end, on_retry=self._count_retry)
        except StorageUnavailableError as e:  # transient: connection errors, timeouts, throttling, 5xx
            last = e.__cause__
            raise OriginError(
                f"cannot read {url!r} after {e.attempts} attempts: {type(last).__name__}: {last}. "
                "Is the object store reachable (endpoint, network)? Raise `retries` for flaky stores."
            ) from last
        except Exception as e:  # permanent: FileStore retried nothing
            raise OriginError(
                f"cannot read {url!r}: {type(e).__name__}: {e}. Check that the key exists and that "
                "`storage_options` grant read access."
            ) from e
        with self._lock:
            self._counts.get().bytes_read += len(data)
        return data

    def run(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run ``fn(*args)`` on this process's bounded thread pool (``max_concurrency`` threads)."""
        return self._threads.get().submit(fn, *args)

    def submit(self, key: str) -> Future[bytes]:
        """Start reading ``key`` on this process's bounded thread pool."""
        return self.run(self.fetch, key)

    def fetch_many(self, keys: Sequence[str]) -> list[bytes]:
        """Read ``keys`` concurrently (at most ``max_concurrency`` in flight); results in order."""
        if len(keys) <= 1:
            return [self.fetch(k) for k in keys]
        futs = [self.submit(k) for k in keys]
        return [f.result() for f in futs]


class SampleKeys(list[str]):
    """A listing's relative keys, and beside them each key's content identity (``stamps[i]`` belongs to ``self[i]``).

    A stamp is a short string that changes when the file's bytes change (see :func:`content_stamp`); ``""`` is
    unknown. The cache folds it into each entry's key, so a file changed under the same name is decoded again.

    Why a list of its own rather than a field of :class:`Listing`: a listing is rebuilt with new labels or classes
    from its keys (``Listing(old.origin, old.keys, new_labels, classes)``, as class remapping does), and the stamps
    must travel with the keys they describe. A new list made from the keys (a subset, a copy) carries none, as it
    must: its positions are others.

    Raises:
        ValueError: ``stamps`` does not hold one string per key.
    """

    stamps: list[str] | None

    def __init__(self, keys: Iterable[str] = (), stamps: Sequence[str] | None = None) -> None:
        super().__init__(keys)
        if stamps is not None and len(stamps) != len(self):
            raise ValueError(
                f"`stamps` must hold one content identity per key: got {len(stamps)} for {len(self)} keys. List the "
                "origin again (list_origin)."
            )
        self.stamps = [str(s) for s in stamps] if stamps is not None else None


def content_stamp(info: Mapping[str, Any]) -> str:
    """The content identity of one file from its fsspec listing entry ``info``: its size, and its ETag (or another
    checksum the store lists: GCS ``md5Hash``/``crc32c``, Azure ``etag``), else its modification time (a local disk:
    ``mtime``; ``LastModified``, ``updated``, ``created``). Deterministic for a given entry, so every rank and
    worker that reads one listing computes the same cache keys.

    A checksum comes first where there is one: an object uploaded again with the same bytes keeps its (single-part)
    ETag and its cache entries, while its time changes. Locally, the size and the mtime (sub-microsecond) are what
    ``rsync``'s quick check trusts too: a file rewritten in place gets a new mtime; for a symlink, its target's.
    """
    if info.get("islink"):
        # A local symlink (a tree of links into a shared store): fsspec's directory listing gives the link's own
        # mtime, which does not change when the file it points to is rewritten. The target's is what identifies.
        try:
            st = os.stat(str(info["name"]))
        except (OSError, KeyError):
            return ""  # a dangling link: its read fails, naming it
        return f"{st.st_size}@{st.st_mtime}"
    size = info.get("size")
    for name in ("ETag", "etag", "md5Hash", "crc32c"):
        tag = info.get(name)
        if tag:
            tag = str(tag).strip('"')  # S3 quotes its ETags
            return f"{size}:{tag}"
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        when = info.get(name)
        if when is not None:
            stamp = getattr(when, "timestamp", None)  # a datetime: its instant, whatever its time zone says
            return f"{size}@{stamp() if callable(stamp) else when}"
    return f"{size}" if size is not None else ""


@dataclass
class Listing:
    """The samples of an origin: relative keys, integer labels and class names (label ``i`` is ``classes[i]``);
    ``pack`` says where each sample lives when the origin is packed (see :mod:`lightning_accel.data.pack`).

    ``keys`` is a :class:`SampleKeys` when the listing knows each file's content identity (a tree or a manifest
    listed by :func:`list_origin`); a packed origin's identities are its index's CRC-32 and size.
    """

    origin: str
    keys: list[str]
    labels: list[int]
    classes: list[str] = field(default_factory=list)
    pack: PackIndex | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def stamps(self) -> list[str] | None:
        """Each key's content identity (see :class:`SampleKeys`); ``None`` when the listing does not record them."""
        return getattr(self.keys, "stamps", None)

    def fingerprint(self) -> str:
        """A short hash of the keys, labels and content identities (detects a changed origin)."""
        h = hashlib.sha1()
        for k, y in zip(self.keys, self.labels, strict=False):
            h.update(text_bytes(f"{k}\t{y}\n"))
        for st in self.stamps or ():
            h.update(text_bytes(f"{st}\n"))
        return h.hexdigest()[:16]

    def to_json(self) -> str:
        d: dict[str, Any] = {"origin": self.origin, "classes": self.classes, "keys": self.keys, "labels": self.labels}
        if self.stamps is not None:
            d["stamps"] = self.stamps
        if self.pack is not None:
            d["pack"] = self.pack.to_dict()
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Listing:
        d = json.loads(text)
        stamps = d.get("stamps")
        keys = SampleKeys(d["keys"], stamps) if stamps is not None else list(d["keys"])
        pack = None
        if d.get("pack") is not None:
            from lightning_accel.data.pack import PackIndex

            pack = PackIndex.from_dict(d["pack"], len(keys), "listing")
        return cls(origin=d["origin"], keys=keys, labels=[int(y) for y in d["labels"]], classes=d["classes"], pack=pack)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Publish atomically (other ranks may be reading the previous version)."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Listing:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


def _check_no_empty_class(store: ObjectStore, fs: Any, root: str, classes: set[str], exts: tuple[str, ...]) -> None:
    """Raise for a class folder without images: dropping it would shift the labels of every later class."""
    try:
        entries = fs.ls(root, detail=True)
    except Exception:  # a store that cannot list directories: the files found decide the classes
        return
    empty = sorted(
        name
        for e in entries
        if e.get("type") == "directory"
        and not (name := str(e["name"]).rstrip("/").rsplit("/", 1)[-1]).startswith(".")
        and name not in classes
    )
    if empty:
        raise ValueError(
            f"`origin` {store.url!r} has class folder(s) {empty[:3]} holding no files with extensions {list(exts)}; "
            "a class without samples would shift the labels of the classes after it. Add its images or remove the "
            "folder."
        )


def list_origin(
    store: ObjectStore, *, manifest: str | None = None, extensions: Sequence[str] = IMAGE_EXTENSIONS
) -> Listing:
    """List an origin once.

    ImageFolder layout: ``<origin>/<class>/**/<file><ext>``; classes are the sorted top-level directory names (like
    torchvision's ``ImageFolder``), hidden files and files outside class directories are ignored, and files whose
    keys are not plain relative paths (a backslash or ``::``: names an object store allows) are left
    out with a warning. Manifest layout:
    ``manifest`` names a JSONL file under the origin with one ``{"key": "<relative key>", "label": <int>}`` per line.
    Packed layout (:func:`~lightning_accel.data.pack.pack_origin`): the origin's ``lightning-accel-pack.json`` index
    (one GET) is the listing; it wins over the tree layout.

    A tree's or manifest's listing records each key's content identity (:func:`content_stamp`, in
    :attr:`Listing.stamps`) from the same directory listing that finds the files: free for a tree (the recursive
    listing carries sizes, times and ETags), and for a manifest one listing of each directory its keys live in (a
    key no listing shows gets ``""``: its read fails as before).

    Raises:
        FileNotFoundError: the origin (or manifest) does not exist, naming the URL.
        ValueError: nothing to train on (no matching files), or a class directory without images (torchvision's
            ``ImageFolder`` refuses it too: dropping it would shift the labels), naming the URL and the extensions;
            or the origin is a pack whose writing did not finish (its journal, no index), naming the fix.
    """
    fs, root = store.fs, store.root
    try:
        exists = fs.exists(root) if root else True
    except Exception as e:
        raise OriginError(f"cannot reach `origin` {store.url!r}: {type(e).__name__}: {e}") from e
    if manifest is not None:
        path = safe_join(root, manifest)
        if not fs.exists(path):
            raise FileNotFoundError(
                f"`manifest` {store.url_of(manifest)!r} does not exist. Write a JSONL file with one "
                '{"key": ..., "label": ...} per line there, or pass `manifest=None` for an ImageFolder tree.'
            )
        keys, labels = [], []
        for n, line in enumerate(fs.cat_file(path).decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key, label = str(rec["key"]), rec["label"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"`manifest` {store.url_of(manifest)!r} line {n} is not "
                    f'{{"key": "<relative key>", "label": <int>}}: {line[:120]!r}'
                ) from e
            # A label is a class index: an integer >= 0. 3.7 or true would be truncated to another class, and -1
            # would index the class list from its end.
            if isinstance(label, bool) or not isinstance(label, int) or label < 0:
                raise ValueError(
                    f"`manifest` {store.url_of(manifest)!r} line {n} (key {key!r}) has label {label!r}; a label must "
                    "be an integer >= 0 (the class index). Fix that line."
                )
            try:
                safe_join(root, key)
            except ValueError as e:
                raise ValueError(
                    f"`manifest` {store.url_of(manifest)!r} line {n} has key {key!r}, which would escape the origin "
                    "or is not a plain relative path (a key is a relative POSIX path without `..`, `.`, a leading "
                    "`/`, a scheme, `::` or backslashes). Fix that line."
                ) from e
            keys.append(key)
            labels.append(label)
        if not keys:
            raise ValueError(f"`manifest` {store.url_of(manifest)!r} lists no samples.")
        classes = [str(c) for c in range(max(labels) + 1)]
        stamps = _manifest_stamps(store, keys)
        return Listing(origin=store.url, keys=SampleKeys(keys, stamps), labels=labels, classes=classes)
    if not exists:
        raise FileNotFoundError(
            f"`origin` {store.url!r} does not exist. Pass a directory or URL holding <class>/<image> files "
            "(check the bucket/prefix and `storage_options`)."
        )
    from lightning_accel.data.pack import load_pack_index

    packed = load_pack_index(store)
    if packed is not None:
        return packed
    exts = tuple(e.lower() for e in extensions)
    found: dict[str, str] = {}  # relative key -> its content identity
    unreadable: list[str] = []
    for p, info in fs.find(root, detail=True).items():
        rel = p[len(root) :].lstrip("/") if root else p
        parts = rel.split("/")
        if len(parts) < 2 or any(s.startswith(".") for s in parts) or not rel.lower().endswith(exts):
            continue
        try:
            safe_join(root, rel)
        except ValueError:
            # An object store names objects freely (`a\b.jpg`, `a::b.jpg`), but every read joins the key
            # under the origin and refuses such a key: listed, it failed the fit at its first read, mid-epoch.
            unreadable.append(rel)
            continue
        found[rel] = content_stamp(info)
    if unreadable:
        unreadable.sort()
        shown = ", ".join(repr(k) for k in unreadable[:3]) + (", ..." if len(unreadable) > 3 else "")
        warnings.warn(
            f"`origin` {store.url!r}: left out {len(unreadable)} file(s) whose keys are not plain relative paths "
            f"({shown}: a backslash, `::` or a percent-encoded `..`); they cannot "
            "be read safely. Rename them to include them.",
            RuntimeWarning,
            stacklevel=2,
        )
    rels = list(found)
    if not rels:
        from lightning_accel.data.pack import PACK_INDEX, PACK_JOURNAL, PACK_LOCK

        # Only here, where nothing else was found: a pack being written (or killed while writing) holds no index yet,
        # only its journal and shards (or, before its first shard, only its lock file), and "no images inside class
        # directories" would not say what to do.
        mark = next((n for n in (PACK_JOURNAL, PACK_LOCK) if fs.exists(safe_join(root, n))), None)
        if mark is not None:
            raise ValueError(
                f"`origin` {store.url!r} is an incomplete pack: it holds {mark} but no {PACK_INDEX}, so "
                "writing it was interrupted (or is still running). Run `lightning-accel data pack SOURCE "
                f"{store.url}` (pack_origin) again to complete it, or wait for the running one."
            )
        raise ValueError(
            f"`origin` {store.url!r} holds no files with extensions {list(exts)} inside class directories. "
            "Expected <origin>/<class>/<image>, or pass `manifest=` naming a JSONL list of keys and labels."
        )
    rels.sort()
    classes = sorted({r.split("/", 1)[0] for r in rels})
    _check_no_empty_class(store, fs, root, set(classes), exts)
    cidx = {c: i for i, c in enumerate(classes)}
    keys = SampleKeys(rels, [found[r] for r in rels])
    return Listing(origin=store.url, keys=keys, labels=[cidx[r.split("/", 1)[0]] for r in rels], classes=classes)


def _manifest_stamps(store: ObjectStore, keys: Sequence[str]) -> list[str]:
    """The content identity of each of a manifest's ``keys``, from one listing of each directory they live in (not
    one request per key: a LIST returns up to 1,000 objects on S3). A directory that cannot be listed, and a key its
    listing lacks, give ``""``: that key's read fails, naming it, as it would have."""
    fs, root = store.fs, store.root
    dirs = sorted({posixpath.dirname(k) for k in keys})

    def entries(d: str) -> dict[str, str]:
        path = safe_join(root, d) if d else root
        try:
            listed = fs.ls(path, detail=True)
        except Exception:  # missing or unlistable: the reads of its keys report it
            return {}
        out = {}
        for e in listed:
            if e.get("type") != "directory":
                name = str(e["name"]).rstrip("/")
                out[name[len(root) :].lstrip("/") if root else name] = content_stamp(e)  # as the tree's keys
        return out

    if store.is_local or len(dirs) == 1:
        listed = [entries(d) for d in dirs]
    else:  # a remote store: the listings concurrently, on the store's bounded pool
        listed = [f.result() for f in [store.run(entries, d) for d in dirs]]
    by_key: dict[str, str] = {}
    for e in listed:
        by_key.update(e)
    return [by_key.get(k, "") for k in keys]
