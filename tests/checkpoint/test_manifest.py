"""The manifest format: what the store writes is the documented JSON, byte for byte; manifests in that format (also
without the optional ``sizes`` / ``mcrc``) load; the encode policy as a pure function."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import policy
from lightning_accel.checkpoint.manifest import (
    BLOB_DIR,
    MANIFEST_FORMAT,
    CheckpointCorruptError,
    Manifest,
    TensorEntry,
)
from lightning_accel.checkpoint.options import StoreOptions
from lightning_accel.checkpoint.store import DeltaStore


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"w": torch.randn(4096, generator=g), "b": torch.zeros(300)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(4096, generator=g)}}}],
        "epoch": seed,
    }


def _written_as_before(raw: dict[str, Any]) -> bytes:
    """The manifest as the store has always written it: a dict literal in this key order, each entry with its
    ``mcrc`` over ``[name, entry]``."""
    tensors = {}
    for name, m in raw["tensors"].items():
        meta: dict[str, Any] = {
            "dtype": m["dtype"],
            "shape": m["shape"],
            "chain": m["chain"],
            "sizes": m["sizes"],
            "crc32": m["crc32"],
        }
        if m.get("copy"):
            meta["copy"] = True
        meta["mcrc"] = zlib.crc32(json.dumps([name, meta], sort_keys=True, separators=(",", ":")).encode())
        tensors[name] = meta
    manifest = {
        "format": "lightning-accel/delta-checkpoint",
        "version": 1,
        "blob_dir": ".delta_blobs",
        "created": raw["created"],
        "skeleton": raw["skeleton"],
        "lossy": raw["lossy"],
        "tensors": tensors,
    }
    if any(m.get("copy") for m in tensors.values()):
        manifest["redundancy"] = 2  # every blob has a second copy
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["checksum"] = hashlib.blake2b(body, digest_size=16).hexdigest()  # of everything above, keys sorted
    return json.dumps(manifest, separators=(",", ":")).encode()


@pytest.mark.parametrize("kwargs", [{}, {"redundancy": 2, "quantize": "int8"}])
def test_the_written_manifest_is_the_documented_format_byte_for_byte(tmp_path: Path, kwargs: dict) -> None:
    store = DeltaStore(inline_bytes=2048, **kwargs)
    for i in range(3):
        store.save(_state(i), tmp_path / f"{i}.ckpt")
    store.close()
    for i in range(3):
        data = (tmp_path / f"{i}.ckpt").read_bytes()
        assert data == _written_as_before(json.loads(data))
        assert Manifest.from_json(str(tmp_path), data).to_json() == data  # parse + write round-trips
    assert json.loads((tmp_path / "2.ckpt").read_bytes())["lossy"] is bool(kwargs)


def test_a_manifest_in_the_old_format_loads_with_the_same_restore_path(tmp_path: Path) -> None:
    """A manifest built by hand in the format (one entry without ``sizes`` and ``mcrc``, as early manifests were)
    over the blobs of a saved checkpoint restores the same tensors."""
    store = DeltaStore()
    state = _state(0)
    store.save(state, tmp_path / "a.ckpt")
    store.save(_state(1), tmp_path / "b.ckpt")
    store.close()
    saved = json.loads((tmp_path / "b.ckpt").read_bytes())
    legacy = dict(saved, tensors=dict(saved["tensors"]))
    del legacy["checksum"]  # early manifests had no checksum of their own
    w = dict(legacy["tensors"]["state_dict/w"])
    del w["sizes"], w["mcrc"]
    legacy["tensors"]["state_dict/w"] = w
    (tmp_path / "old.ckpt").write_text(json.dumps(legacy, indent=1))  # whitespace too: still a manifest
    want = DeltaStore().load(tmp_path / "b.ckpt")
    got = DeltaStore().load(tmp_path / "old.ckpt")
    for k in ("w", "b"):
        assert torch.equal(got["state_dict"][k], want["state_dict"][k])
    assert got["epoch"] == 1
    m = DeltaStore().open_manifest(tmp_path / "old.ckpt")
    assert m.tensors["state_dict/w"].sizes == () and m.tensors["state_dict/b"].sizes
    assert DeltaStore().read_manifest(tmp_path / "old.ckpt")["tensors"]["state_dict/w"] == w  # the raw JSON
    summary = DeltaStore().verify(tmp_path / "old.ckpt")
    assert summary["ok"] and summary["manifest_checksum"] is False
    assert DeltaStore().verify(tmp_path / "b.ckpt")["manifest_checksum"] is True
    # A flipped bit in the key "checksum" does not pass the manifest off as one from before checksums.
    renamed = (tmp_path / "b.ckpt").read_bytes().replace(b'"checksum"', b'"checksul"')
    (tmp_path / "renamed.ckpt").write_bytes(renamed)
    with pytest.raises(CheckpointCorruptError, match=r"unknown keys \['checksul'\]"):
        DeltaStore().open_manifest(tmp_path / "renamed.ckpt")


def test_damaged_entries_and_manifests_name_the_file_and_tensor() -> None:
    entry = TensorEntry(dtype="float32", shape=(2, 3), chain=("a" * 40,), sizes=(10,), crc32=7)
    meta = entry.to_json("state_dict/w")
    assert TensorEntry.from_json("x.ckpt", "state_dict/w", meta) == entry
    with pytest.raises(CheckpointCorruptError, match=r"'x\.ckpt'.*tensor `state_dict/v`.*mcrc"):
        TensorEntry.from_json("x.ckpt", "state_dict/v", meta)  # renamed: the checksum covers the name
    with pytest.raises(CheckpointCorruptError, match="tensor `t`.*shape"):
        TensorEntry.from_json("x.ckpt", "t", {"dtype": "float32", "shape": [True], "chain": ["a" * 40], "crc32": 1})
    good = {"format": MANIFEST_FORMAT, "version": 1, "blob_dir": BLOB_DIR, "skeleton": "b" * 40, "tensors": {}}
    assert Manifest.from_dict("x.ckpt", good).keys() == {"b" * 40}
    for bad in ({**good, "version": 2}, {**good, "skeleton": "zz"}, {**good, "format": "other"}, [1]):
        with pytest.raises(CheckpointCorruptError, match=r"manifest of checkpoint 'x\.ckpt' is damaged"):
            Manifest.from_dict("x.ckpt", bad)
    with pytest.raises(CheckpointCorruptError, match="damaged"):
        Manifest.from_json("x.ckpt", b'{"format":"lightning-accel/delta-checkpoint", trunc')


def _prev(chain: tuple[str, ...], age: int = 1, sizes: tuple[int, ...] = (1000, 100)) -> policy.ChainState:
    entry = TensorEntry(dtype="float32", shape=(4,), chain=chain, sizes=sizes[: len(chain)], crc32=0)
    return policy.ChainState(entry=entry, hash="h", src_hash="s", ref=torch.zeros(4), age=age)


def test_the_encode_policy() -> None:
    base, prev_key = "a" * 40, "b" * 40
    o = StoreOptions()
    plan = policy.plan
    assert plan(o, "state_dict/w", "float32", (4,), "new", True, None).kind == "full"
    assert plan(o, "state_dict/w", "float32", (5,), "new", True, _prev((base,))).kind == "full"  # shape changed
    assert plan(o, "state_dict/w", "float32", (4,), "s", True, _prev((base,))).kind == "unchanged"
    assert plan(o, "state_dict/w", "float32", (4,), "h", True, _prev((base,))).kind == "unchanged"  # = the restore
    assert plan(o, "state_dict/w", "float32", (4,), "new", True, _prev((base, prev_key))) == policy.Plan("xor", base)
    assert plan(o, "state_dict/w", "float32", (4,), "new", True, _prev((base,), age=16)).kind == "full"
    dead = {("state_dict/w", base)}
    assert plan(o, "state_dict/w", "float32", (4,), "new", True, _prev((base,)), dead).kind == "rebased"
    q = StoreOptions(quantize="int8")
    assert plan(q, "optimizer_states/0/m", "float32", (4,), "n", True, _prev((base,))) == policy.Plan("quant", base)
    assert plan(q, "state_dict/w", "float32", (4,), "n", True, _prev((base,))).kind == "xor"  # not in the group
    assert plan(q, "optimizer_states/0/m", "int64", (4,), "n", False, None).kind == "full"
    p = StoreOptions(delta_ref="previous", max_chain=3)
    assert plan(p, "w", "float32", (4,), "n", True, _prev((base, prev_key))) == policy.Plan("xor", prev_key)
    assert plan(p, "w", "float32", (4,), "n", True, _prev((base, prev_key, "c" * 40))).kind == "full"  # chain full
    assert policy.keep_delta(o, 799, _prev((base,))) and not policy.keep_delta(o, 800, _prev((base,)))
    assert policy.wants_quant(StoreOptions(quantize="int4", quantize_groups=["state_dict/h"]), "state_dict/head", True)
    live = {"x.ckpt": {"w": ((base, prev_key), (1000, 10))}}
    assert policy.dead_bases(o, live) == set()  # rebase_dead_fraction=1.0: never
    assert policy.dead_bases(StoreOptions(rebase_dead_fraction=0.5), live) == {("w", base)}
    live["y.ckpt"] = {"w": ((base,), (1000,))}  # the base's own checkpoint is live again
    assert policy.dead_bases(StoreOptions(rebase_dead_fraction=0.5), live) == set()
