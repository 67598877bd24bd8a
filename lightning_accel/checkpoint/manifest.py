"""The on-disk format of a delta checkpoint: the manifest (one JSON file per checkpoint path) and the blob layout.

Layout of a checkpoint directory (local path or any fsspec URL)::

    <dir>/epoch=0-step=50.ckpt        manifest (JSON, a few KB)
    <dir>/last.ckpt                   another manifest; unchanged tensors point at the same blobs
    <dir>/.delta_blobs/ab/ab12...     blobs, named by the BLAKE2b-160 of their bytes (40 hex digits, content-addressed)
    <dir>/.delta_blobs/ab/ab12....copy  the second copy of a base blob (``redundancy=2``)

A manifest is one compact JSON object (``separators=(",", ":")``) whose keys come in this order, so that its first
bytes are always ``{"format":"lightning-accel/delta-checkpoint"`` (:func:`is_manifest_bytes` tells a manifest from a
``torch.save`` file by them, without reading the whole file)::

    {
      "format": "lightning-accel/delta-checkpoint",
      "version": 1,
      "blob_dir": ".delta_blobs",
      "created": 1764635400.25,            # time.time() of the save (newest "last" checkpoint)
      "skeleton": "<key>",                 # blob: the torch.save'd non-tensor state + the small tensors
      "lossy": false,                      # true when any tensor was restored from a quantized delta
      "tensors": {
        "<tensor name>": {
          "dtype": "float32",
          "shape": [64, 16],
          "chain": ["<base key>", "<delta key>"],   # 1..64 blob keys: a full snapshot, then deltas
          "sizes": [3012, 911],                     # bytes of each blob of the chain (optional in old manifests)
          "crc32": 123456789,                       # CRC-32 of the restored tensor's bytes
          "copy": true,                             # only when the base blob has a second copy
          "mcrc": 987654321                         # CRC-32 of this entry and its name (optional in old manifests)
        }
      },
      "redundancy": 2,                     # only with redundancy=2: every blob (skeleton, bases, deltas) has a copy
      "checksum": "<32 hex digits>"        # BLAKE2b-128 of the manifest without this key (optional in old ones)
    }

``checksum`` is the BLAKE2b-128 of ``json.dumps(manifest without "checksum", sort_keys=True, separators=(",", ":"))``:
it covers the skeleton key, every entry (with its ``mcrc``), ``created`` and ``lossy``, so a manifest whose skeleton
key was swapped for another checkpoint's, or whose bytes were changed anywhere, is refused on load. Manifests written
before it existed have no ``checksum`` and still load: each of their entries is checked by its ``mcrc`` (so names,
shapes and keys are still covered), only the skeleton key and ``created`` are then unchecked;
:meth:`Manifest.checksummed` tells them apart. Without ``redundancy`` (old manifests, ``redundancy=1``) only the
base blob of an entry with ``"copy": true`` has a second copy.

``mcrc`` is the CRC-32 of ``json.dumps([name, entry without "mcrc"], sort_keys=True, separators=(",", ":"))``, so a
flipped byte in a name, a shape or a key is caught on load and names the tensor. Readers ignore keys they do not
know. Every damaged manifest raises :class:`CheckpointCorruptError` naming the file and, where one is at fault, the
tensor (a manifest cut short, down to an empty file, included: :func:`truncated_manifest_head`); a file that is no
manifest at all raises :class:`NotADeltaCheckpointError`.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_accel.checkpoint import codec

__all__ = [
    "BLOB_DIR",
    "COPY_SUFFIX",
    "MANIFEST_FORMAT",
    "MAX_CHAIN_LEN",
    "CheckpointCorruptError",
    "Manifest",
    "NotADeltaCheckpointError",
    "TensorEntry",
    "damaged_manifest_head",
    "entry_crc",
    "is_blob_key",
    "is_manifest_bytes",
    "manifest_checksum",
    "manifest_references",
    "truncated_manifest_head",
]

MANIFEST_FORMAT = "lightning-accel/delta-checkpoint"
MANIFEST_VERSION = 1
#: Every top-level key a manifest may hold (``redundancy`` and ``checksum`` are absent from older ones).
_MANIFEST_KEYS = frozenset(
    {"format", "version", "blob_dir", "created", "skeleton", "lossy", "tensors", "redundancy", "checksum"}
)
_MANIFEST_PREFIX = ('{"format":"' + MANIFEST_FORMAT + '"').encode()
BLOB_DIR = ".delta_blobs"
#: Suffix of the second copy of a full (base) blob written with ``redundancy=2``.
COPY_SUFFIX = ".copy"
#: Most blobs one tensor's chain may hold.
MAX_CHAIN_LEN = 64
_MAX_DIMS = 64
_KEY_RE = re.compile(r"^[0-9a-f]{40}$")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint cannot be restored: a blob is missing or fails its checksum, or the manifest is damaged."""


class NotADeltaCheckpointError(ValueError):
    """The path exists but holds something other than a delta checkpoint manifest."""


def is_blob_key(key: Any) -> bool:
    """True for a blob key as manifests hold them (40 lowercase hex digits)."""
    return isinstance(key, str) and _KEY_RE.match(key) is not None


def is_manifest_bytes(head: bytes) -> bool:
    """True when ``head`` (the first ~100 bytes of a file) starts like a delta checkpoint manifest: as the store
    writes it, or re-serialised with whitespace (a manifest pretty-printed by hand is still one)."""
    if head.startswith(_MANIFEST_PREFIX):
        return True
    compact = b"".join(head.split())
    return compact.startswith(_MANIFEST_PREFIX[: len(compact)]) and len(compact) >= len(_MANIFEST_PREFIX)


def damaged_manifest_head(head: bytes) -> bool:
    """A file whose start is one or two bytes off a manifest's (``{"format":"lightning-accel/delta-checkpoint"``)."""
    want = _MANIFEST_PREFIX
    if len(head) < len(want):
        return head.startswith(b"{") and b"lightning-accel" in head
    return sum(a != b for a, b in zip(head, want, strict=False)) <= 2


def truncated_manifest_head(head: bytes) -> bool:
    """A file that is the start of a manifest's first bytes and nothing more: a manifest cut to 0 bytes up to just
    before the end of ``{"format":"lightning-accel/delta-checkpoint"`` (longer cuts fail to parse as JSON)."""
    return len(head) < len(_MANIFEST_PREFIX) and _MANIFEST_PREFIX.startswith(head)


def manifest_checksum(raw: Mapping[str, Any]) -> str:
    """The ``checksum`` of a manifest's JSON object: BLAKE2b-128 of it without ``checksum``, keys sorted."""
    body = {k: v for k, v in raw.items() if k != "checksum"}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def entry_crc(name: str, meta: Mapping[str, Any]) -> int:
    """CRC-32 of one manifest entry and its tensor name (``mcrc``): a flipped byte in a name, a shape or a chain key
    is caught on load and names the tensor."""
    body = {k: v for k, v in meta.items() if k != "mcrc"}
    return zlib.crc32(json.dumps([name, body], sort_keys=True, separators=(",", ":")).encode())


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest: how to restore it and how to check the result.

    Attributes:
        dtype: the tensor's dtype name (``"float32"``; :func:`~lightning_accel.checkpoint.codec.dtype_name`).
        shape: its shape.
        chain: blob keys to decode in order: a full snapshot, then deltas (each against the previous reconstruction,
            or all against the base with ``delta_ref="base"``).
        sizes: bytes of each blob of ``chain`` (empty when an old manifest did not record them).
        crc32: CRC-32 of the restored tensor's bytes.
        copy: the base blob has a second copy (``<key>.copy``).
    """

    dtype: str
    shape: tuple[int, ...]
    chain: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    crc32: int = 0
    copy: bool = False

    def to_json(self, name: str) -> dict[str, Any]:
        """The JSON object of this entry under ``name``, with its ``mcrc``."""
        meta: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chain": list(self.chain),
            "sizes": list(self.sizes),
            "crc32": self.crc32,
        }
        if self.copy:
            meta["copy"] = True
        meta["mcrc"] = entry_crc(name, meta)
        return meta

    @classmethod
    def from_json(cls, path: str, name: Any, meta: Any) -> TensorEntry:
        """Validate one manifest entry (its ``mcrc`` when present) and return it.

        Raises:
            CheckpointCorruptError: the entry is damaged, naming the checkpoint ``path`` and the tensor.
        """
        what = f"Checkpoint {path!r}: the manifest entry of tensor `{name}`"
        if not isinstance(meta, dict):
            raise CheckpointCorruptError(f"{what} is damaged (a {type(meta).__name__}, not a mapping).")
        try:
            if "mcrc" in meta and entry_crc(str(name), meta) != meta["mcrc"]:
                raise ValueError(
                    "its checksum (mcrc) does not match: a byte of its name, shape, dtype or chain changed"
                )
            codec.dtype_from_name(meta["dtype"])
            shape, chain, sizes = meta["shape"], meta["chain"], meta.get("sizes", [])
            if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
                raise ValueError(f"shape {shape!r}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in shape):
                raise ValueError(f"shape {shape!r}")
            if not isinstance(chain, list) or not 1 <= len(chain) <= MAX_CHAIN_LEN:
                raise ValueError(f"a chain of {len(chain) if isinstance(chain, list) else chain!r} blobs")
            if not all(is_blob_key(k) for k in chain):
                raise ValueError(f"chain {chain!r}")
            if not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes):
                raise ValueError(f"sizes {sizes!r}")
            crc = meta["crc32"]
            if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 1 << 32:
                raise ValueError(f"crc32 {crc!r}")
        except (KeyError, TypeError, ValueError, codec.CodecError) as e:
            raise CheckpointCorruptError(f"{what} is damaged ({type(e).__name__}: {e}).") from e
        return cls(
            dtype=meta["dtype"],
            shape=tuple(shape),
            chain=tuple(chain),
            sizes=tuple(int(n) for n in sizes),
            crc32=crc,
            copy=bool(meta.get("copy")),
        )

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Raw bytes of the tensor."""
        return self.numel * codec.itemsize_of(codec.dtype_from_name(self.dtype))


@dataclass(frozen=True)
class Manifest:
    """One checkpoint: its skeleton blob and its tensors (the whole file; see the module docstring).

    Attributes:
        skeleton: key of the skeleton blob (non-tensor state and small tensors).
        tensors: tensor name -> entry, in save order.
        lossy: any tensor comes from a quantized delta.
        created: ``time.time()`` of the save.
        version: the format version (1).
        blob_dir: the blob directory beside the manifest.
        redundancy: 2 when every blob of the checkpoint (skeleton, bases, deltas) has a second copy, 1 when only the
            bases of ``copy`` entries have one; ``None`` (a manifest being written): 2 when any entry has ``copy``.
        checksum: the manifest's ``checksum`` as read (``""``: an old manifest without one; on write it is computed).
    """

    skeleton: str
    tensors: Mapping[str, TensorEntry] = field(default_factory=dict)
    lossy: bool = False
    created: float = 0.0
    version: int = MANIFEST_VERSION
    blob_dir: str = BLOB_DIR
    redundancy: int | None = None
    checksum: str = ""

    @property
    def copies(self) -> int:
        """2 when every blob of the checkpoint has a second copy, else 1 (see :attr:`redundancy`)."""
        if self.redundancy is not None:
            return self.redundancy
        return 2 if any(e.copy for e in self.tensors.values()) else 1

    @property
    def checksummed(self) -> bool:
        """The manifest carried a ``checksum`` that matched (False: an old manifest without one)."""
        return bool(self.checksum)

    def copy_keys(self) -> set[str]:
        """The blob keys that have a second copy (``<key>.copy``)."""
        if self.copies == 2:
            return self.keys()
        return {e.chain[0] for e in self.tensors.values() if e.copy}

    def keys(self) -> set[str]:
        """Every blob key the checkpoint needs (skeleton and chains)."""
        out = {self.skeleton}
        for e in self.tensors.values():
            out.update(e.chain)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the manifest (keys in the documented order)."""
        out: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "blob_dir": self.blob_dir,
            "created": self.created,
            "skeleton": self.skeleton,
            "lossy": self.lossy,
            "tensors": {n: e.to_json(n) for n, e in self.tensors.items()},
        }
        if self.copies == 2:
            out["redundancy"] = 2
        out["checksum"] = manifest_checksum(out)
        return out

    def to_json(self) -> bytes:
        """The manifest file's bytes (compact JSON, starting with the format marker)."""
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        assert is_manifest_bytes(data)
        return data

    @classmethod
    def from_dict(cls, path: str, raw: Any) -> Manifest:
        """Validate a parsed manifest (every tensor entry, with its ``mcrc`` when present) and return it.

        Raises:
            CheckpointCorruptError: the manifest is damaged (naming ``path``, and the tensor when one is at fault).
        """
        try:
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            if raw.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}")
            if raw["version"] != MANIFEST_VERSION or not isinstance(raw["tensors"], dict):
                raise ValueError(f"unsupported manifest version {raw['version']!r}")
            if not is_blob_key(raw["skeleton"]):
                raise ValueError(f"bad skeleton key {raw['skeleton']!r}")
            # A key this format does not write is damage (one flipped bit in "checksum" would otherwise turn a
            # checked manifest into an unchecked one that reads as written before checksums).
            unknown = sorted(set(raw) - _MANIFEST_KEYS)
            if unknown:
                raise ValueError(f"unknown keys {unknown}")
            checksum = raw.get("checksum", "")
            redundancy = raw.get("redundancy", 1)
            if redundancy not in (1, 2) or isinstance(redundancy, bool):
                raise ValueError(f"redundancy {redundancy!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(f"The manifest of checkpoint {path!r} is damaged ({e!r}).") from e
        # The entries first: a damaged one is named by its own `mcrc`; then the whole manifest's checksum.
        tensors = {name: TensorEntry.from_json(path, name, meta) for name, meta in raw["tensors"].items()}
        if "checksum" in raw and checksum != manifest_checksum(raw):
            raise CheckpointCorruptError(
                f"The manifest of checkpoint {path!r} is damaged: its checksum does not match its content (a byte of "
                "its skeleton key, an entry or its time changed, or it was edited by hand). Load another checkpoint "
                "of the directory."
            )
        created = raw.get("created")
        return cls(
            skeleton=raw["skeleton"],
            tensors=tensors,
            lossy=bool(raw.get("lossy")),
            created=float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else 0.0,
            version=raw["version"],
            blob_dir=str(raw.get("blob_dir", BLOB_DIR)),
            redundancy=int(redundancy),
            checksum=str(checksum),
        )

    @classmethod
    def from_json(cls, path: str, data: bytes) -> Manifest:
        """Parse and validate the manifest file ``data`` read from ``path``.

        Raises:
            CheckpointCorruptError: the manifest is damaged.
        """
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise CheckpointCorruptError(f"The manifest of checkpoint {path!r} is damaged ({e!r}).") from e
        return cls.from_dict(path, raw)


def manifest_references(data: bytes) -> tuple[str, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]]:
    """What a manifest file keeps alive, read without full validation (garbage collection): its skeleton key and,
    per tensor, ``(chain, sizes)``.

    Raises:
        ValueError, KeyError, TypeError, AttributeError: the file is not a readable manifest.
    """
    m = json.loads(data)
    chains = {
        name: (tuple(meta["chain"]), tuple(int(n) for n in meta.get("sizes", ())))
        for name, meta in m["tensors"].items()
    }
    return m["skeleton"], chains
