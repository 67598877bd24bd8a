"""Bad input and damage: arguments refused in ``__init__`` in one line, clear OS errors, planted pickles refused, and a
fuzz of manifests, skeletons and blobs that may only end in a ``CheckpointCorruptError`` naming the file (and the
tensor) or in identical data; ``ckpt verify`` never tracebacks."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import CheckpointCorruptError, DeltaCheckpointIO, DeltaStore, read_checkpoint
from lightning_accel.checkpoint.cli import main as ckpt_main
from lightning_accel.checkpoint.store import BLOB_DIR, NotADeltaCheckpointError


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"zstd_level": 99}, ValueError, ["`zstd_level`", "99", "<= 22"]),
        ({"zstd_level": "3"}, TypeError, ["`zstd_level`", "'3'", "str"]),
        ({"zstd_level": -1000000}, ValueError, ["`zstd_level`", "-1000000", ">= -131072"]),
        ({"zstd_threads": -5}, ValueError, ["`zstd_threads`", "-5", ">= -1"]),
        ({"zstd_threads": 10**6}, ValueError, ["`zstd_threads`", "1000000", "<= 200"]),
        ({"full_every": True}, TypeError, ["`full_every`", "True", "bool"]),
        ({"quantize": "int3"}, ValueError, ["`quantize`", "'int3'", "'int8'"]),
        ({"quant_block": -1}, ValueError, ["`quant_block`", "-1", ">= 1"]),
        ({"io_threads": 0}, ValueError, ["`io_threads`", ">= 1"]),
        ({"redundancy": 3}, ValueError, ["`redundancy`", "<= 2"]),
        ({"rebase_dead_fraction": 0}, ValueError, ["`rebase_dead_fraction`", "> 0"]),
        ({"quantize_groups": []}, ValueError, ["`quantize_groups`", "non-empty"]),
        ({"max_pending": 0}, ValueError, ["`max_pending`", ">= 1"]),
        ({"lock": "yes"}, TypeError, ["`lock`"]),
    ],
)
def test_arguments_are_refused_in_init_in_one_line(kwargs: dict, error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        DeltaCheckpointIO(**kwargs)
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_quantize_groups_that_match_nothing_warn_at_the_first_save(tmp_path: Path) -> None:
    # The tensor names exist only once a checkpoint does, so this is the earliest point it can be known.
    store = DeltaStore(quantize="int8", quantize_groups=["nomatch"])
    with pytest.warns(UserWarning, match="matches none of the checkpoint's 1 float tensors"):
        store.save({"state_dict": {"w": torch.randn(512)}}, tmp_path / "a.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.save({"state_dict": {"w": torch.randn(512)}}, tmp_path / "b.ckpt")  # once
    with pytest.warns(UserWarning, match="has no effect without `quantize`"):
        DeltaStore(quantize_groups="all")


def test_os_errors_name_the_path_and_the_fix(tmp_path: Path) -> None:
    store = DeltaStore()
    state = {"w": torch.randn(300)}
    store.save(state, tmp_path / "ok" / "a.ckpt")
    with pytest.raises(NotADeltaCheckpointError, match=r"is a directory.*a\.ckpt"):
        store.load(tmp_path / "ok")  # loading the directory lists what to pass instead
    with pytest.raises(NotADeltaCheckpointError, match="is a directory"):
        DeltaCheckpointIO().load_checkpoint(tmp_path / "ok")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"'.*file' is a file .*`dirpath`"):
        store.save(state, tmp_path / "file" / "a.ckpt")
    with pytest.raises(OSError, match=r"Cannot write checkpoints to '/proc/.*' .*writable `dirpath`"):
        store.save(state, "/proc/lightning-accel-test/a.ckpt")  # unwritable even for root
    with pytest.raises(FileNotFoundError, match="does not exist"):
        store.load(tmp_path / "missing.ckpt")


class _Planted:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch planted-ran",))


def test_a_planted_pickle_is_refused_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "x": _Planted()}, path)
    for load in (lambda: read_checkpoint(path), lambda: DeltaCheckpointIO().load_checkpoint(path)):
        with pytest.raises(pickle.UnpicklingError) as info:
            load()
        msg = str(info.value)
        assert str(path) in msg and "never unpickles" in msg and "weights_only=False" not in msg
    assert not (tmp_path / "planted-ran").exists()


# ---------------------------------------------------------------------------------------------------------- fuzz
def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(600, generator=g)},
        "optimizer_states": [
            {"state": {3: {"exp_avg_sq": torch.rand(64, 32, generator=g), "step": torch.tensor(5.0)}}}
        ],
        "epoch": seed,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _mutations(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    """Byte flips, truncations and, for JSON, renamed / deleted / retyped keys and values."""
    out = []
    for _ in range(n):
        b = bytearray(data)
        kind = rng.random()
        if kind < 0.6:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif kind < 0.75:
            b = b[: rng.randrange(len(b))]
        else:
            try:
                doc = json.loads(data)
            except ValueError:
                i = rng.randrange(len(b))
                b[i] = rng.randrange(256)
            else:
                _mutate_json(doc, rng)
                b = bytearray(json.dumps(doc, separators=(",", ":")).encode())
        out.append(bytes(b))
    return out


def _mutate_json(doc: Any, rng: random.Random) -> None:
    node = doc
    while True:  # walk down to a random mapping
        kids = [k for k, v in node.items() if isinstance(v, dict) and v]
        if not kids or rng.random() < 0.3:
            break
        node = node[rng.choice(kids)]
    key = rng.choice(list(node))
    how = rng.randrange(4)
    if how == 0:
        node[key[:-1] + chr(ord(key[-1]) ^ 1) if key else "x"] = node.pop(key)  # a damaged name
    elif how == 1:
        del node[key]
    elif how == 2:
        node[key] = rng.choice([None, 7, "x", [], {}, [1, 2], -1, True])
    else:
        v = node[key]
        if isinstance(v, list) and v:
            v[rng.randrange(len(v))] = rng.choice(["0" * 40, 1 << 40, None, "../../etc/passwd"])
        else:
            node[key] = [v, v]


def test_fuzzed_manifests_skeletons_and_blobs_fail_cleanly_or_load_identically(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    store = DeltaStore(inline_bytes=64)
    s0, s1 = _state(0), _state(0)
    s1["state_dict"]["w"] = s1["state_dict"]["w"] + 1e-3  # a delta chain for `w`, references for the rest
    store.save(s0, clean / "a.ckpt")
    store.save(s1, clean / "last.ckpt")
    store.close()
    want = DeltaStore().load(clean / "last.ckpt")
    manifest = json.loads((clean / "last.ckpt").read_bytes())
    skeleton = clean / BLOB_DIR / manifest["skeleton"][:2] / manifest["skeleton"]
    blobs = sorted({k for m in manifest["tensors"].values() for k in m["chain"]})
    targets = [clean / "last.ckpt", skeleton] + [clean / BLOB_DIR / k[:2] / k for k in blobs]
    rng = random.Random(0)
    work = tmp_path / "work"
    outcomes = {"error": 0, "identical": 0}
    reader = DeltaStore(io_threads=1)
    for target in targets:
        original = target.read_bytes()
        cases = _mutations(original, rng, 200 if target.name == "last.ckpt" else 60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(clean, work)
        victim = work / target.relative_to(clean)
        for bad in cases:
            victim.write_bytes(bad)
            try:
                got = reader.load(work / "last.ckpt")
            except (CheckpointCorruptError, NotADeltaCheckpointError) as e:
                assert str(work / "last.ckpt") in str(e), e  # names the file
                if victim != work / "last.ckpt" and victim.name != manifest["skeleton"]:
                    assert "tensor `" in str(e), e  # a tensor blob: names the tensor too
                outcomes["error"] += 1
            else:
                assert _same(got, want), f"{victim.name}: silently different data"
                outcomes["identical"] += 1
        victim.write_bytes(original)
    assert outcomes["error"] > 400 and sum(outcomes.values()) == 200 + 60 * (len(targets) - 1)


def test_verify_prints_its_json_line_for_any_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = DeltaStore()
    store.save(_state(1), tmp_path / "last.ckpt")
    store.close()
    m = json.loads((tmp_path / "last.ckpt").read_bytes())
    name = "optimizer_states/0/state/3/exp_avg_sq"
    m["tensors"][name[:-1] + "Q"] = m["tensors"].pop(name)  # the damaged name reported as a raw KeyError before
    (tmp_path / "last.ckpt").write_text(json.dumps(m))
    (tmp_path / "dir.ckpt").mkdir()
    assert ckpt_main(["verify", str(tmp_path / "last.ckpt"), str(tmp_path / "dir.ckpt")]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["ok"] for x in lines] == [False, False]
    assert "exp_avg_sQ" in lines[0]["error"] and "is a directory" in lines[1]["error"]
