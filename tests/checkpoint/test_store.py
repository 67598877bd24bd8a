"""DeltaStore: references, deltas, chain policy, GC derived from manifests, integrity, faults, S3, CLI."""

from __future__ import annotations

import errno
import json
import os
import posixpath
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import codec
from lightning_accel.checkpoint.cli import main as ckpt_main
from lightning_accel.checkpoint.skeleton import UnsafeCheckpointContent
from lightning_accel.checkpoint.store import (
    BLOB_DIR,
    CheckpointCorruptError,
    DeltaStore,
    NotADeltaCheckpointError,
)


def _state(seed: int, n: int = 2048) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"w": torch.randn(n, generator=g), "frozen": torch.arange(n, dtype=torch.float32)},
        "optimizer_states": [
            {
                "state": {
                    0: {
                        "exp_avg": torch.randn(n, generator=g),
                        "exp_avg_sq": torch.rand(n, generator=g) ** 4,
                        "step": torch.tensor(float(seed)),
                    }
                },
                "param_groups": [{"lr": 0.1}],
            }
        ],
        "epoch": seed,
        "names": ["a", ("b", 2)],
    }


def _drift(s: dict[str, Any], eps: float, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + seed)
    out = {**s, "state_dict": dict(s["state_dict"]), "epoch": s["epoch"] + 1}
    out["state_dict"]["w"] = s["state_dict"]["w"] + eps * torch.randn(s["state_dict"]["w"].shape, generator=g)
    st = s["optimizer_states"][0]["state"][0]
    out["optimizer_states"] = [
        {
            "state": {
                0: {
                    "exp_avg": st["exp_avg"] * 0.9 + 0.01 * torch.randn(st["exp_avg"].shape, generator=g),
                    "exp_avg_sq": st["exp_avg_sq"] * 0.999 + 1e-6,
                    "step": st["step"] + 1,
                }
            },
            "param_groups": [{"lr": 0.1}],
        }
    ]
    return out


def _blobs(d: Path) -> set[str]:
    return {p.name for p in (d / BLOB_DIR).rglob("*") if p.is_file() and p.name != ".lock"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_unchanged_tensors_are_references_and_changed_ones_deltas(tmp_path: Path) -> None:
    store = DeltaStore()
    s0 = _state(0)
    first = store.save(s0, tmp_path / "a.ckpt")
    again = store.save(s0, tmp_path / "same.ckpt")  # save_last: the same step twice
    assert first.tensors_full == 4 and again.tensors_unchanged == 4 and again.blobs_written == 0
    s1 = _drift(s0, 1e-4, 1)
    third = store.save(s1, tmp_path / "b.ckpt")
    assert third.tensors_unchanged == 1  # "frozen"
    assert third.tensors_delta >= 1
    for name, s in (("a", s0), ("same", s0), ("b", s1)):
        assert _equal(store.load(tmp_path / f"{name}.ckpt"), s)
    m = json.loads((tmp_path / "b.ckpt").read_text())
    assert (
        m["tensors"]["state_dict/frozen"]["chain"]
        == json.loads((tmp_path / "a.ckpt").read_text())["tensors"]["state_dict/frozen"]["chain"]
    )
    assert all(len(t["chain"]) <= 2 for t in m["tensors"].values())


def test_chain_policy_full_every_and_previous_mode(tmp_path: Path) -> None:
    store = DeltaStore(full_every=2, rebase_ratio=10.0)
    s = _state(0)
    kinds = []
    for i in range(6):
        kinds.append(store.save(s, tmp_path / f"{i}.ckpt").tensors_full)
        s = _drift(s, 1e-3, i)
    assert kinds == [4, 0, 0, 3, 0, 0]  # w, exp_avg, exp_avg_sq rebased every 3rd save; "frozen" never changes
    prev = DeltaStore(delta_ref="previous", max_chain=3, rebase_ratio=10.0)
    s = _state(0)
    for i in range(5):
        prev.save(s, tmp_path / "p" / f"{i}.ckpt")
        m = json.loads((tmp_path / "p" / f"{i}.ckpt").read_text())
        assert len(m["tensors"]["state_dict/w"]["chain"]) == [1, 2, 3, 1, 2][i]
        assert _equal(prev.load(tmp_path / "p" / f"{i}.ckpt"), s)
        s = _drift(s, 1e-3, i)


def test_remove_collects_exactly_the_unreferenced_blobs(tmp_path: Path) -> None:
    store = DeltaStore(full_every=1, gc_grace_s=0)
    s = _state(0)
    states = {}
    for i in range(5):
        store.save(s, tmp_path / f"{i}.ckpt")
        states[i] = s
        s = _drift(s, 1e-3, i)
    for i in (0, 2, 3):  # arbitrary older checkpoints, like ModelCheckpoint(save_top_k=...)
        store.remove(tmp_path / f"{i}.ckpt")
        assert _blobs(tmp_path) == store.live_keys(str(tmp_path))
    for i in (1, 4):
        assert _equal(store.load(tmp_path / f"{i}.ckpt"), states[i])
    # A fresh process (no in-memory state) derives the same references from the manifests alone (once the first
    # writer released the directory: one writer at a time).
    store.close()
    fresh = DeltaStore(gc_grace_s=0)
    assert fresh.collect_garbage(tmp_path) == 0
    fresh.close()
    store.remove(tmp_path / "1.ckpt")
    store.forget()
    store.remove(tmp_path / "4.ckpt")
    assert _blobs(tmp_path) == set()
    store.remove(tmp_path / "4.ckpt")  # missing: a no-op, like TorchCheckpointIO


@pytest.mark.parametrize("quantize,qmax", [("int8", 127), ("int4", 7)])
def test_quantized_deltas_do_not_accumulate_error(tmp_path: Path, quantize: str, qmax: int) -> None:
    store = DeltaStore(quantize=quantize, quantize_groups="all", full_every=100, rebase_ratio=10.0)
    s = _state(0)
    worst = []
    for i in range(8):
        store.save(s, tmp_path / f"{i}.ckpt")
        back = store.load(tmp_path / f"{i}.ckpt")
        w, wb = s["state_dict"]["w"], back["state_dict"]["w"]
        base = _state(0)["state_dict"]["w"]
        bound = (w - base).abs().max() / (2 * qmax) + 1e-7  # one block's worst case, against the lossless base
        worst.append(float((w - wb).abs().max()))
        assert worst[-1] <= bound
        assert bool((back["optimizer_states"][0]["state"][0]["exp_avg_sq"] >= 0).all())
        assert torch.equal(back["state_dict"]["frozen"], s["state_dict"]["frozen"])
        s = _drift(s, 1e-3, i)
    assert worst[0] == 0.0  # the first save is a lossless full snapshot
    assert json.loads((tmp_path / "7.ckpt").read_text())["lossy"] is True


def test_bad_paths_are_refused_clearly(tmp_path: Path) -> None:
    store = DeltaStore()
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(NotADeltaCheckpointError, match="is a directory"):
        store.save(_state(0), tmp_path / "dir.ckpt")
    torch.save({"x": 1}, tmp_path / "plain.ckpt")
    with pytest.raises(NotADeltaCheckpointError, match="refusing to overwrite"):
        store.save(_state(0), tmp_path / "plain.ckpt")
    with pytest.raises(NotADeltaCheckpointError):
        store.load(tmp_path / "plain.ckpt")
    with pytest.raises(NotADeltaCheckpointError, match="Refusing to remove"):
        store.remove(tmp_path / "plain.ckpt")
    with pytest.raises(FileNotFoundError):
        store.load(tmp_path / "nope.ckpt")
    with pytest.raises(ValueError, match="`quantize`"):
        DeltaStore(quantize="int3")
    with pytest.raises(TypeError, match="`/bad`"):
        store.save({"bad": object()}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def test_missing_or_corrupt_blob_names_checkpoint_and_tensor(tmp_path: Path) -> None:
    store = DeltaStore()
    store.save(_state(0), tmp_path / "c.ckpt")
    m = json.loads((tmp_path / "c.ckpt").read_text())
    key = m["tensors"]["state_dict/w"]["chain"][0]
    blob = tmp_path / BLOB_DIR / key[:2] / key
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0x01
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"c\.ckpt.*tensor `state_dict/w`.*(checksum|corrupt)"):
        store.load(tmp_path / "c.ckpt")
    blob.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"c\.ckpt.*tensor `state_dict/w`.*missing"):
        store.load(tmp_path / "c.ckpt")
    assert ckpt_main(["verify", str(tmp_path / "c.ckpt")]) == 1


def test_disk_full_mid_save_keeps_earlier_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DeltaStore(gc_grace_s=0)
    s0 = _state(0)
    store.save(s0, tmp_path / "ok.ckpt")
    calls = {"n": 0}
    real_write = store.fs.write

    def flaky(url: str, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(url, data)

    monkeypatch.setattr(store.fs, "write", flaky)
    s1 = _drift(s0, 1e-3, 0)
    with pytest.raises(OSError, match="No space"):
        store.save(s1, tmp_path / "ok.ckpt")  # overwrite attempt fails half way
    with pytest.raises(OSError, match="No space"):
        calls["n"] = 1
        store.save(s1, tmp_path / "new.ckpt")
    monkeypatch.undo()
    assert not (tmp_path / "new.ckpt").exists()
    assert _equal(store.load(tmp_path / "ok.ckpt"), s0)
    store.save(s1, tmp_path / "new.ckpt")  # the chain state was not advanced by the failed saves
    assert _equal(store.load(tmp_path / "new.ckpt"), s1)
    store.collect_garbage(tmp_path)
    assert _blobs(tmp_path) == store.live_keys(str(tmp_path))


def test_leftovers_of_a_killed_save_are_collected(tmp_path: Path) -> None:
    store = DeltaStore()
    store.save(_state(0), tmp_path / "a.ckpt")
    orphan = tmp_path / BLOB_DIR / "ff" / ("f" * 40)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(codec.encode_full(torch.zeros(10)))
    tmp = tmp_path / f".b.ckpt.{'0' * 32}.tmp"
    tmp.write_bytes((tmp_path / "a.ckpt").read_bytes()[:150])  # a manifest's write, cut short
    # a user's own atomic write in flight beside the checkpoints, named in the same form: not the store's
    mine = tmp_path / f".notes.txt.{'1' * 32}.tmp"
    mine.write_bytes(b"half of my notes")
    store.close()  # the next writer (a fresh process) collects it
    assert DeltaStore(gc_grace_s=0).collect_garbage(tmp_path) == 2
    assert not orphan.exists() and not tmp.exists()
    assert mine.read_bytes() == b"half of my notes"
    assert DeltaStore().verify(tmp_path / "a.ckpt")["ok"]


def test_cli_verify_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _state(3)
    DeltaStore().save(s, tmp_path / "c.ckpt")
    assert ckpt_main(["verify", str(tmp_path / "c.ckpt")]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert ckpt_main(["export", str(tmp_path / "c.ckpt"), str(tmp_path / "plain.ckpt")]) == 0
    assert _equal(torch.load(tmp_path / "plain.ckpt", weights_only=True), s)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_accel.checkpoint", "verify", str(tmp_path / "c.ckpt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tensors"] == 4
    from lightning_accel.cli import main as accel_main  # `lightning-accel ckpt ...` dispatches to the same tool

    with pytest.raises(SystemExit) as exit_info:
        accel_main(["ckpt", "export", str(tmp_path / "c.ckpt"), str(tmp_path / "plain2.ckpt")])
    assert exit_info.value.code == 0 and (tmp_path / "plain2.ckpt").exists()


def test_cli_refuses_a_missing_gc_directory_and_an_export_onto_a_directory_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    DeltaStore().save(_state(0), tmp_path / "c.ckpt")
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, words in [
        (["gc", str(tmp_path / "typo")], "does not exist"),
        (["gc", str(tmp_path / "c.ckpt")], "is a file"),
        (["export", str(tmp_path / "c.ckpt"), str(tmp_path)], "is a directory"),
    ]:
        assert ckpt_main(argv) == 1
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created


def test_cli_error_lines_have_one_format_across_subcommands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.ckpt")
    assert ckpt_main(["verify", missing]) == 1
    verify_error = json.loads(capsys.readouterr().out)["error"]
    assert ckpt_main(["export", missing, str(tmp_path / "out.pt")]) == 1
    export_error = capsys.readouterr().err.strip()
    assert ckpt_main(["gc", str(tmp_path / "typo")]) == 1
    gc_error = capsys.readouterr().err.strip()
    assert "does not exist" in verify_error and not verify_error.startswith("[Errno")
    assert export_error.endswith(f": error: {verify_error}")  # the same line, without Python's errno prefix
    assert "[Errno" not in export_error + gc_error


@pytest.mark.parametrize("grace", ["-1", "nan", "inf", "1e999"])
def test_cli_gc_names_a_bad_grace_period_as_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], grace: str
) -> None:
    store = DeltaStore(gc_grace_s=60)
    store.save(_state(0), tmp_path / "a.ckpt")
    store.save(_state(1), tmp_path / "b.ckpt")
    store.remove(tmp_path / "a.ckpt")
    store.close()
    before = sorted(p.name for p in (tmp_path / BLOB_DIR).rglob("*"))
    assert ckpt_main(["gc", str(tmp_path), "--grace-s", grace]) == 2
    err = capsys.readouterr().err
    # an infinite grace period too: `gc` would remove the untracked checkpoints and then none of their blobs
    assert f"`--grace-s` must be a finite number of seconds >= 0, got {float(grace):g}" in err
    assert len(err.strip().splitlines()) == 1 and "gc_grace_s" not in err
    assert sorted(p.name for p in (tmp_path / BLOB_DIR).rglob("*")) == before


def test_cli_gc_leaves_a_directory_without_checkpoints_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"  # e.g. the run's root given instead of its checkpoint directory
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    assert ckpt_main(["gc", str(run), "--grace-s", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == [] and out["blobs_deleted"] == 0 and out["pending"] == 0
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # no `.delta_blobs/.lock` left behind


def _blob_files(directory: Any) -> set[str]:
    """The blob keys stored in ``directory``'s blob store (second copies and other files left out)."""
    return {p.name for p in Path(directory, BLOB_DIR).rglob("*") if p.is_file() and len(p.name) == 40}


def test_cli_gc_collects_the_blob_stores_of_subdirectories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `ModelCheckpoint(filename="{epoch}-{val/loss:.2f}")` saves into `epoch=0-val/`, with a blob store of its own
    root, sub, deeper = tmp_path / "ckpt", tmp_path / "ckpt" / "epoch=0-val", tmp_path / "ckpt" / "a" / "b-val"
    store = DeltaStore(gc_grace_s=60)
    store.save(_state(0), root / "last.ckpt")
    store.save(_state(1), sub / "loss=0.50.ckpt")
    store.save(_state(2), sub / "loss=0.40.ckpt")
    store.save(_state(3), deeper / "loss=0.30.ckpt")
    store.save(_state(4), deeper / "loss=0.20.ckpt")
    store.remove(sub / "loss=0.50.ckpt")  # what `save_top_k` does; its blobs wait out the grace period
    store.remove(deeper / "loss=0.30.ckpt")
    kept = {d: store.live_keys(str(d)) for d in (sub, deeper)}
    store.close()
    assert all(_blob_files(d) > kept[d] for d in (sub, deeper))
    (sub / "notes.txt").write_text("mine")
    (sub / BLOB_DIR / "README").write_text("mine too")
    outside = tmp_path / "elsewhere"
    store2 = DeltaStore(gc_grace_s=0)
    store2.save(_state(5), outside / "x.ckpt")
    store2.remove(outside / "x.ckpt")  # unreferenced, but not below the directory: left alone
    store2.close()
    outside_blobs = _blob_files(outside)
    (root / "linked").symlink_to(outside)

    assert ckpt_main(["gc", str(root)]) == 0  # within the grace period: nothing deleted yet
    out = json.loads(capsys.readouterr().out)
    assert out["blobs_deleted"] == 0 and out["pending"] > 0 and out["subdirectories"] == ["a/b-val", "epoch=0-val"]
    assert ckpt_main(["gc", str(root), "--grace-s", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["blobs_deleted"] > 0 and out["pending"] == 0
    assert all(_blob_files(d) == kept[d] for d in (sub, deeper))
    assert (sub / "notes.txt").read_text() == "mine" and (sub / BLOB_DIR / "README").read_text() == "mine too"
    assert _blob_files(outside) == outside_blobs
    assert _equal(DeltaStore().load(sub / "loss=0.40.ckpt"), _state(2))
    assert _equal(DeltaStore().load(deeper / "loss=0.20.ckpt"), _state(4))


def test_cli_gc_refuses_a_subdirectory_a_run_writes_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, sub = tmp_path / "ckpt", tmp_path / "ckpt" / "epoch=0-val"
    writer = DeltaStore(gc_grace_s=60)
    writer.save(_state(0), sub / "a.ckpt")
    writer.save(_state(1), sub / "b.ckpt")
    writer.remove(sub / "a.ckpt")
    before = _blob_files(sub)
    assert ckpt_main(["gc", str(root), "--grace-s", "0"]) == 1  # the writer still holds the subdirectory's lock
    err = capsys.readouterr().err
    assert "epoch=0-val" in err and len(err.strip().splitlines()) == 1
    assert _blob_files(sub) == before and (sub / BLOB_DIR / ".lock").exists()
    writer.close()


def test_export_leaves_an_existing_file_and_the_exported_checkpoint_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = DeltaStore()
    store.save(_state(0), tmp_path / "c.ckpt")
    store.close()
    ckpt_bytes = (tmp_path / "c.ckpt").read_bytes()
    (tmp_path / "notes.pt").write_bytes(b"a user's own file")
    (tmp_path / "link.ckpt").symlink_to(tmp_path / "c.ckpt")
    for argv, words in [
        (["export", str(tmp_path / "c.ckpt"), str(tmp_path / "notes.pt")], "already exists"),
        (["export", str(tmp_path / "c.ckpt"), str(tmp_path / "c.ckpt")], "is the checkpoint being exported"),
        (["export", str(tmp_path / "c.ckpt"), str(tmp_path / "link.ckpt"), "--overwrite"], "being exported"),
    ]:
        assert ckpt_main(argv) == 1
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (tmp_path / "notes.pt").read_bytes() == b"a user's own file"
    assert (tmp_path / "c.ckpt").read_bytes() == ckpt_bytes
    with pytest.raises(FileExistsError, match="overwrite=True"):
        DeltaStore().export(tmp_path / "c.ckpt", tmp_path / "notes.pt")
    assert (tmp_path / "notes.pt").read_bytes() == b"a user's own file"
    # asked for: replaced
    assert ckpt_main(["export", str(tmp_path / "c.ckpt"), str(tmp_path / "notes.pt"), "--overwrite"]) == 0
    loaded = torch.load(tmp_path / "notes.pt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], _state(0)["state_dict"]["w"])


def test_the_blobs_of_a_removed_subdirectory_checkpoint_go_at_a_later_save_elsewhere(tmp_path: Path) -> None:
    # `ModelCheckpoint(filename="{epoch}-{val/loss:.2f}")` puts each checkpoint in a subdirectory of its own, where
    # nothing is saved or removed again once `save_top_k` removed it.
    store = DeltaStore()  # the default grace period: the removal only records the blobs as waiting
    sub = tmp_path / "epoch=0-val"
    store.save(_state(0), sub / "loss=0.50.ckpt")
    store.save(_state(1), tmp_path / "last.ckpt")
    store.remove(sub / "loss=0.50.ckpt")
    assert _blobs(sub), "blobs a reader may still need go only after the grace period"
    store.gc_grace_s = 0.0  # the grace period has passed
    store.save(_drift(_state(1), 1e-3, 1), tmp_path / "last.ckpt")
    assert _blobs(sub) == set()  # the chain base too: no checkpoint is left there to delta against
    assert store.pending_deletions(sub) == {}
    assert _equal(store.load(tmp_path / "last.ckpt"), _drift(_state(1), 1e-3, 1))
    # A later save there starts from a full snapshot and restores exactly.
    store.save(_state(2), sub / "loss=0.40.ckpt")
    store.close()
    assert _equal(store.load(sub / "loss=0.40.ckpt"), _state(2))
    assert store.verify(sub / "loss=0.40.ckpt")["ok"]


def test_export_refuses_a_target_that_names_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DeltaStore()
    store.save(_state(0), tmp_path / "c.ckpt")
    store.close()
    monkeypatch.chdir(tmp_path)  # an empty target would resolve here
    before = sorted(p.name for p in tmp_path.iterdir())
    for out in ["", " ", "exported/", str(tmp_path / "exported") + "/"]:
        assert ckpt_main(["export", str(tmp_path / "c.ckpt"), out]) == 1
        err = capsys.readouterr().err
        assert "names no file" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "ValueError" not in err
        with pytest.raises(ValueError, match="names no file"):
            store.export(tmp_path / "c.ckpt", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # `exported/` was not written as a file `exported`


def test_s3_round_trip_remove_and_gc(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    import fsspec

    bucket, opts = s3_bucket
    store = DeltaStore(storage_options=opts, gc_grace_s=0)
    root = f"s3://{bucket}/run/ckpt"
    s0, s1 = _state(0), _drift(_state(0), 1e-4, 0)
    store.save(s0, f"{root}/a.ckpt")
    store.save(s1, f"{root}/b.ckpt")
    store.save(s1, f"{root}/last.ckpt")
    assert _equal(store.load(f"{root}/a.ckpt"), s0)
    store.remove(f"{root}/b.ckpt")
    assert _equal(DeltaStore(storage_options=opts).load(f"{root}/last.ckpt"), s1)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    stored = {p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/run/ckpt/{BLOB_DIR}")} - {".lock"}
    assert stored == store.live_keys(root)
    assert ckpt_main(["verify", f"{root}/last.ckpt", "--storage-options", json.dumps(opts)]) == 0


def test_pickles_without_chain_state_locks_or_filesystems(tmp_path: Path) -> None:
    import pickle

    store = DeltaStore(full_every=3)
    s0 = _state(0)
    store.save(s0, tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(store))
    assert copy.full_every == 3 and copy.live_keys(str(tmp_path)) == store.live_keys(str(tmp_path))
    assert _equal(copy.load(tmp_path / "a.ckpt"), s0)
    store.close()  # one writer at a time: the copy writes next
    stats = copy.save(_drift(s0, 1e-3, 0), tmp_path / "b.ckpt")
    assert stats.tensors_delta == 0  # the copy saw no earlier save: full snapshots, never deltas against them


def test_redundancy_keeps_a_chain_alive_when_its_base_blob_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s0 = _state(0)
    s1 = _drift(s0, 1e-4, 0)
    for redundancy in (1, 2):
        d = tmp_path / f"r{redundancy}"
        store = DeltaStore(redundancy=redundancy, gc_grace_s=0)
        store.save(s0, d / "a.ckpt")
        store.save(s1, d / "b.ckpt")
        store.close()
        meta = json.loads((d / "b.ckpt").read_text())["tensors"]["state_dict/w"]
        assert len(meta["chain"]) == 2 and meta.get("copy", False) is (redundancy == 2)
        base = d / BLOB_DIR / meta["chain"][0][:2] / meta["chain"][0]
        base.unlink()  # one lost blob, shared by both checkpoints of the chain
        if redundancy == 1:
            with pytest.raises(CheckpointCorruptError, match=r"tensor `state_dict/w`.*is missing.*redundancy=2"):
                DeltaStore().load(d / "b.ckpt")
            continue
        with pytest.warns(UserWarning, match="restored from its second copy"):
            assert _equal(DeltaStore().load(d / "b.ckpt"), s1)
        assert ckpt_main(["verify", "--repair", str(d / "a.ckpt")]) == 0
        assert json.loads(capsys.readouterr().out)["repaired"] == [meta["chain"][0]]
        assert base.exists()
        data = bytearray(base.read_bytes())
        data[-5] ^= 0xFF  # now damage it in place: the checksum fails, the copy is used
        base.write_bytes(bytes(data))
        with pytest.warns(UserWarning, match="restored from its second copy"):
            assert _equal(DeltaStore().load(d / "b.ckpt"), s1)
        store.remove(d / "a.ckpt")
        store.forget()  # no chain state left to delta against: the last removal frees everything
        store.remove(d / "b.ckpt")
        assert _blobs(d) == set()  # copies are collected with their blobs
        store.close()


def test_a_dead_base_is_rebased_and_then_collected(tmp_path: Path) -> None:
    store = DeltaStore(rebase_dead_fraction=0.3, rebase_ratio=10.0, gc_grace_s=0)
    s = _state(0)
    store.save(s, tmp_path / "a.ckpt")
    s = _drift(s, 1e-3, 1)
    assert store.save(s, tmp_path / "b.ckpt").tensors_delta > 0
    store.remove(tmp_path / "a.ckpt")  # b's deltas now keep a's full snapshots alive, and nothing else uses them
    s = _drift(s, 1e-3, 2)
    stats = store.save(s, tmp_path / "c.ckpt")
    assert stats.tensors_rebased > 0 and stats.tensors_rebased == stats.tensors_full
    before = len(_blobs(tmp_path))
    store.remove(tmp_path / "b.ckpt")
    assert len(_blobs(tmp_path)) < before - stats.tensors_rebased  # the dead bases went with b
    assert _equal(store.load(tmp_path / "c.ckpt"), s)
    off = DeltaStore(rebase_ratio=10.0)  # the default (1.0) never re-bases for dead bytes
    off.save(_state(0), tmp_path / "o" / "a.ckpt")
    off.save(_drift(_state(0), 1e-3, 1), tmp_path / "o" / "b.ckpt")
    off.remove(tmp_path / "o" / "a.ckpt")
    assert off.save(_drift(_state(0), 1e-3, 2), tmp_path / "o" / "c.ckpt").tensors_rebased == 0


def test_non_finite_values_stay_exact_under_quantization(tmp_path: Path) -> None:
    store = DeltaStore(quantize="int8", quantize_groups="all", gc_grace_s=0, rebase_ratio=10.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g)
    x[5] = float("inf")  # e.g. a running minimum initialised to inf
    y = x + 0.01 * torch.randn(1024, generator=g)
    y[5] = 3.0  # the inf became finite: its delta is not
    z = y + 0.01 * torch.randn(1024, generator=g)
    z[700] = float("nan")  # a NaN appears
    f8 = torch.randn(300, generator=g)
    for i, (t, b) in enumerate([(x, f8), (y, f8 + 0.5), (z, f8 - 0.5)]):
        store.save({"b": t, "f8": b.to(torch.float8_e4m3fn)}, tmp_path / f"{i}.ckpt")
    for i, (t, b) in enumerate([(x, f8), (y, f8 + 0.5), (z, f8 - 0.5)]):
        back = store.load(tmp_path / f"{i}.ckpt")
        assert codec.same_bytes(back["b"], t)  # bit-exact: a lossless delta, not a block of NaNs
        assert codec.same_bytes(back["f8"], b.to(torch.float8_e4m3fn))  # float8 is never quantized
    last = store.open_manifest(tmp_path / "2.ckpt")
    assert len(last.tensors["b"].chain) == 2 and not last.lossy  # still a delta, a lossless one
    store.close()


def test_lazy_conjugate_and_negative_tensors_save_and_load(tmp_path: Path) -> None:
    store = DeltaStore(gc_grace_s=0)
    for n in (300, 20_000):
        c = torch.randn(n, dtype=torch.complex64)
        ckpt = {"conj": c.conj(), "neg": torch._neg_view(c), "imag": c.conj().imag}
        for i in range(2):  # a full snapshot, then the "unchanged?" comparison against the chain's reference
            store.save(ckpt, tmp_path / f"{n}-{i}.ckpt")
            back = store.load(tmp_path / f"{n}-{i}.ckpt")
            assert all(torch.equal(back[k], v.resolve_conj().resolve_neg()) for k, v in ckpt.items())
    store.close()


def test_files_named_as_the_plugin_never_writes_are_left_alone(tmp_path: Path) -> None:
    user = tmp_path / "C:\\notes.txt"  # safe_join refuses the name: it cannot be one of ours
    user.write_text("the user's")
    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "a.ckpt")
    store.save(_drift(_state(0), 1e-3, 0), tmp_path / "a.ckpt")  # replaces: collects garbage
    assert store.collect_garbage(tmp_path) == 0
    assert [u for u, _ in store.untracked_manifests(tmp_path, [])] == [str(tmp_path / "a.ckpt")]
    store.remove(tmp_path / "a.ckpt")
    store.close()
    assert user.read_text() == "the user's" and not (tmp_path / "a.ckpt").exists()


def test_a_refused_removal_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("user")
    store = DeltaStore()
    with pytest.raises(NotADeltaCheckpointError, match="Refusing to remove"):
        store.remove(tmp_path / "notes.txt")
    with pytest.raises(NotADeltaCheckpointError, match="Refusing to remove"):
        store.remove_checkpoints([str(tmp_path / "notes.txt")])
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no blob directory, no lock


def test_a_symlink_from_another_directory_loads_and_is_removed_as_a_link(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "best").mkdir()
    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "run" / "last.ckpt")
    store.close()
    link = tmp_path / "best" / "best.ckpt"
    link.symlink_to(tmp_path / "run" / "last.ckpt")
    reader = DeltaStore(gc_grace_s=0)
    assert _equal(reader.load(link), _state(0))
    assert reader.read_skeleton(link)["epoch"] == 0 and reader.verify(link)["ok"]
    reader.remove(link)
    reader.close()
    assert not link.is_symlink() and _equal(DeltaStore().load(tmp_path / "run" / "last.ckpt"), _state(0))


def test_a_manifest_write_cut_short_does_not_stop_collection(tmp_path: Path) -> None:
    """A kill during a manifest's write leaves its temporary file: it is no (damaged) manifest, so blobs are still
    collected and the file itself goes; nor is it an untracked checkpoint."""
    store = DeltaStore(gc_grace_s=0)
    store.save(_state(0), tmp_path / "a.ckpt")
    store.save(_state(1), tmp_path / "b.ckpt")
    cut = tmp_path / f".c.ckpt.{'a' * 32}.tmp"
    cut.write_bytes((tmp_path / "b.ckpt").read_bytes()[:60])
    assert [posixpath.basename(u) for u, _ in store.untracked_manifests(tmp_path, [])] == ["a.ckpt", "b.ckpt"]
    store.remove(tmp_path / "a.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "damaged manifest" warning
        store.collect_garbage(tmp_path)
    assert not cut.exists() and _blobs(tmp_path) == store.live_keys(str(tmp_path))
    assert store.verify(tmp_path / "b.ckpt")["ok"]


def test_cli_gc_removes_a_subdirectory_left_with_only_its_blob_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a subdirectory whose last checkpoint `save_top_k` removed kept `.delta_blobs/.lock` (and so itself) for good
    root = tmp_path / "ckpt"
    nested, flat, foreign, kept = root / "a" / "b-val", root / "c-val", root / "d-val", root / "e-val"
    store = DeltaStore(gc_grace_s=60)
    store.save(_state(0), root / "last.ckpt")
    for i, d in enumerate((nested, flat, foreign, kept)):
        store.save(_state(i + 1), d / "x.ckpt")
        if d != kept:
            store.remove(d / "x.ckpt")  # what `save_top_k` does; its blobs wait out the grace period
    store.close()
    (foreign / BLOB_DIR / "README").write_text("mine")  # a user's file inside the blob store: the folder stays
    assert ckpt_main(["gc", str(root)]) == 0  # blobs in their grace period: the store is not empty yet
    out = json.loads(capsys.readouterr().out)
    assert out["emptied"] == [] and out["pending"] > 0 and (nested / BLOB_DIR / ".lock").exists()
    assert ckpt_main(["gc", str(root), "--grace-s", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["emptied"] == ["a/b-val", "c-val"] and out["pending"] == 0
    # `a` only led to `a/b-val`: gone with it
    assert sorted(p.name for p in root.iterdir()) == [BLOB_DIR, "d-val", "e-val", "last.ckpt"]
    assert (foreign / BLOB_DIR / "README").read_text() == "mine"
    assert _equal(DeltaStore().load(kept / "x.ckpt"), _state(4))


@pytest.mark.timeout(300)
def test_cli_gc_on_s3_removes_a_subdirectory_left_with_only_its_blob_store(
    s3_bucket: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    bucket, opts = s3_bucket
    root = f"s3://{bucket}/run/ckpt"
    # folders are prefixes there: the store's objects (blobs waiting out their grace period) are all a subdirectory
    # is made of, and with them gone nothing of it is left
    store = DeltaStore(storage_options=opts, gc_grace_s=60)
    store.save(_state(0), f"{root}/last.ckpt")
    for sub in ("a-val", "b-val"):
        store.save(_state(1), f"{root}/{sub}/x.ckpt")
        store.remove(f"{root}/{sub}/x.ckpt")
    store.close()
    store.fs.write(f"{root}/b-val/notes.txt", b"mine")
    assert any(rel.startswith(f"{BLOB_DIR}/") for rel in store.fs.find(f"{root}/a-val"))
    assert ckpt_main(["gc", root, "--grace-s", "0", "--storage-options", json.dumps(opts)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["emptied"] == ["a-val"] and out["subdirectories"] == ["a-val", "b-val"]
    assert store.fs.find(f"{root}/a-val") == []
    assert store.fs.read(f"{root}/b-val/notes.txt") == b"mine"


def test_an_adopted_plain_checkpoint_is_still_replaced_after_a_failed_save(tmp_path: Path) -> None:
    # A run switched to the plugin resumes from TorchCheckpointIO's `last.ckpt`; its first save of `last.ckpt` fails
    # (a value that is not plain data, a full disk). The plain file is still there, so the next save replaces it,
    # instead of refusing it from then on as a file the plugin did not write.
    torch.save({"state_dict": {"w": torch.zeros(3)}}, tmp_path / "last.ckpt")
    store = DeltaStore()
    assert store.adopt([tmp_path / "last.ckpt"]) == [str(tmp_path / "last.ckpt")]
    with pytest.raises(UnsafeCheckpointContent):
        store.save({"w": torch.randn(600), "config": ValueError("not plain data")}, tmp_path / "last.ckpt")
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]["w"], torch.zeros(3))
    store.save({"w": torch.ones(600)}, tmp_path / "last.ckpt")
    store.close()
    assert torch.equal(DeltaStore().load(tmp_path / "last.ckpt")["w"], torch.ones(600))
