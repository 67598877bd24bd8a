"""What a save costs and what a failed one leaves: unchanged tensors are recognised without encoding (and without
hashing when a byte comparison or a snapshot's content id says so), a failed save deletes the blobs it wrote, and an
async failure stops the fit at the next save with one line naming the first failure, no removal run after it.

Ordering is explicit: the tests wait for the writer's observable state (failures counted, nothing pending), never for
a duration.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore
from lightning_accel.checkpoint import store as store_module
from lightning_accel.checkpoint.background import SnapshotPool
from lightning_accel.checkpoint.plugin import CheckpointSaveError
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def _until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def _blobs(d: Path) -> set[str]:
    return {p.name for p in (d / ".delta_blobs").rglob("*") if p.is_file() and p.name != ".lock"}


class _Counts:
    """Counts the store's hashes, byte comparisons and encodes (module functions wrapped by monkeypatch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = {"hash": 0, "compare": 0, "encode": 0}
        for attr, what, mod in (
            ("_raw_hash", "hash", store_module),
            ("same_bytes", "compare", store_module.codec),
            ("encode_full", "encode", store_module.codec),
            ("encode_xor", "encode", store_module.codec),
        ):
            monkeypatch.setattr(mod, attr, self._wrap(getattr(mod, attr), what))

    def _wrap(self, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        def counted(*a: Any, **kw: Any) -> Any:
            self.n[what] += 1
            return fn(*a, **kw)

        return counted

    def take(self) -> dict[str, int]:
        out, self.n = self.n, {k: 0 for k in self.n}
        return out


def test_an_unchanged_tensor_costs_a_comparison_not_an_encode_or_a_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _Counts(monkeypatch)
    store = DeltaStore()
    frozen, trained = torch.randn(4096), torch.randn(4096)
    ck = {"state_dict": {"frozen": frozen, "trained": trained}}
    store.save(ck, tmp_path / "a.ckpt")
    assert counts.take() == {"hash": 2, "compare": 0, "encode": 2}  # new tensors: hashed and encoded
    trained.add_(1e-3)
    st = store.save(ck, tmp_path / "b.ckpt")
    # frozen: its bytes equal the chain's reference (a full snapshot): one comparison, no hash, no encode
    assert st.tensors_unchanged == 1 and counts.take() == {"hash": 1, "compare": 2, "encode": 1}
    st = store.save(ck, tmp_path / "c.ckpt")  # `trained` is now a delta: its reference is the base, not the last save
    assert st.tensors_unchanged == 2 and st.bytes_written < 1000
    assert counts.take() == {"hash": 1, "compare": 1, "encode": 0}  # hashed once, not encoded
    frozen.copy_(-frozen)  # changed: the comparison fails, the tensor is encoded
    st = store.save(ck, tmp_path / "d.ckpt")
    assert st.tensors_unchanged == 1 and counts.take()["encode"] == 1
    assert st.hash_s >= 0 and st.encode_s > 0 and st.write_s > 0
    store.close()
    for name, want in (("c", None), ("d", None)):
        got = DeltaStore().load(tmp_path / f"{name}.ckpt")["state_dict"]
        assert want is None and torch.equal(got["trained"], trained)
    assert torch.equal(DeltaStore().load(tmp_path / "d.ckpt")["state_dict"]["frozen"], frozen)


def test_a_snapshot_content_id_skips_even_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _Counts(monkeypatch)
    store = DeltaStore()
    w = torch.randn(4096)
    ids = {w.data_ptr(): 7}
    store.save({"w": w}, tmp_path / "a.ckpt", content_id=lambda t: ids.get(t.data_ptr()))
    counts.take()
    st = store.save({"w": w}, tmp_path / "last.ckpt", content_id=lambda t: ids.get(t.data_ptr()))
    assert st.tensors_unchanged == 1 and counts.take() == {"hash": 0, "compare": 0, "encode": 0}
    w[:10] += 1.0  # new content, new id: compared, hashed, encoded (a delta)
    ids[w.data_ptr()] = 8
    st = store.save({"w": w}, tmp_path / "b.ckpt", content_id=lambda t: ids.get(t.data_ptr()))
    # a snapshot's bytes are named by its content id: compared with the reference, never hashed
    assert st.tensors_unchanged == 0 and counts.take() == {"hash": 0, "compare": 1, "encode": 1}
    store.close()
    assert torch.equal(DeltaStore().load(tmp_path / "b.ckpt")["w"], w)


def test_async_small_tensors_copied_again_are_still_saved_as_unchanged(tmp_path: Path) -> None:
    """The snapshot copies small tensors without comparing them (cheaper on the training thread), so their
    content ids are new at every save; the writer's store still finds them unchanged (``last.ckpt`` right after
    ``step=N.ckpt``) and writes no blob for them, and both checkpoints load exactly."""
    io = DeltaCheckpointIO(async_save=True)
    # 16 KB: stored as a blob of its own (not inline in the skeleton), copied by the snapshot without comparing
    state = {"state_dict": {"bn.running_mean": torch.randn(4096), "w": torch.randn(40_000)}, "step": 3}
    io.save_checkpoint(state, str(tmp_path / "step=3.ckpt"))
    io.save_checkpoint(state, str(tmp_path / "last.ckpt"))
    io.wait()
    first, second = list(io.history)[-2:]
    assert second.tensors_unchanged == 2 and second.bytes_written < first.bytes_written / 100
    io.teardown()
    for name in ("step=3.ckpt", "last.ckpt"):
        got = DeltaStore().load(tmp_path / name)["state_dict"]
        assert all(torch.equal(got[k], v) for k, v in state["state_dict"].items())


def test_a_failed_save_deletes_the_blobs_it_wrote_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DeltaStore()
    w, v = torch.randn(4096), torch.randn(4096)
    store.save({"w": w, "v": v}, tmp_path / "a.ckpt")
    w0 = w.clone()
    # a user's files beside the checkpoint and inside the blob directory: a failed save's cleanup leaves them alone
    mine = {tmp_path / "notes.txt": b"mine", tmp_path / store_module.BLOB_DIR / "README": b"do not touch"}
    for path, data in mine.items():
        path.write_bytes(data)
    before = _blobs(tmp_path)
    real_write = store.fs.write

    def write(url: Any, data: Any) -> None:
        if str(url).endswith("b.ckpt"):  # the manifest: everything else was written already
            raise OSError(28, "No space left on device")
        real_write(url, data)

    monkeypatch.setattr(store.fs, "write", write)
    w.add_(1.0)  # a new blob for w; v is unchanged (a reference to a blob a.ckpt needs)
    with pytest.raises(OSError, match="No space left"):
        store.save({"w": w, "v": v}, tmp_path / "b.ckpt")
    assert _blobs(tmp_path) == before and not (tmp_path / "b.ckpt").exists()
    assert all(path.read_bytes() == data for path, data in mine.items())
    monkeypatch.setattr(store.fs, "write", real_write)
    store.save({"w": w, "v": v}, tmp_path / "b.ckpt")  # the chain did not advance: b deltas against a's base
    store.close()
    assert torch.equal(DeltaStore().load(tmp_path / "a.ckpt")["w"], w0)
    assert torch.equal(DeltaStore().load(tmp_path / "b.ckpt")["w"], w)


class _FailAt:
    """Makes the plugin's store fail the ``n``-th save (1-based) with ENOSPC; records the paths it was asked for."""

    def __init__(self, io: DeltaCheckpointIO, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real = io.store.save

        def save(ck: dict[str, Any], path: Any, **kw: Any) -> Any:
            self.paths.append(str(path))
            if len(self.paths) >= n:
                raise OSError(28, f"No space left on device: {path}")
            return real(ck, path, **kw)

        monkeypatch.setattr(io.store, "save", save)


class _OneStepAtATime(L.Callback):
    """Before each step, wait until the writer is idle: a failure is then known before the next save call."""

    def __init__(self, io: DeltaCheckpointIO) -> None:
        self.io = io

    def on_train_batch_start(self, *args: Any, **kw: Any) -> None:
        _until(lambda: self.io._writer.pending == 0, "the writer is idle")


def test_an_async_failure_stops_the_fit_at_the_next_save_naming_the_first_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = DeltaCheckpointIO(async_save=True)
    fail = _FailAt(io, 3, monkeypatch)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1, filename="{step}")
    trainer = ckpt_trainer(tmp_path, [io], [_OneStepAtATime(io), cb], max_epochs=1)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.fit(CheckpointModel(), tiny_loader())
    msg = str(info.value)
    assert f"{fail.paths[2]!r}" in msg and "No space left" in msg and "\n" not in msg
    # saves 1, 2 ran; save 3 (step 3) failed; the next call raised: step 3's removal of step=2 (when the failure
    # was already known then) or step 4's save. No later step ran, no later save reached the store.
    assert trainer.global_step in (3, 4) and len(fail.paths) == 3 and io.writer_stats.failed == 1
    # the removal of step=2 queued after the failed save never ran: the last good checkpoint is still there
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == ["step=2.ckpt"]
    assert DeltaCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "step=2.ckpt")["global_step"] == 2


def test_warn_mode_keeps_training_warns_every_failure_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = DeltaCheckpointIO(async_save=True, on_save_error="warn")
    fail = _FailAt(io, 3, monkeypatch)  # every save from the third on fails
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1, filename="{step}")
    trainer = ckpt_trainer(tmp_path, [io], [_OneStepAtATime(io), cb], max_epochs=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(CheckpointModel(), tiny_loader())
    failed = [str(r.message) for r in record if "Async checkpoint save" in str(r.message)]
    assert trainer.global_step == 8 and len(fail.paths) == 8
    assert len(failed) == 6 and all("No space left" in line for line in failed)
    assert io.writer_stats.failed == 6 and io.writer_stats.skipped == 6  # no removal after a failed save
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == ["step=2.ckpt"]
    with pytest.raises(ValueError, match="`on_save_error` must be 'raise' or 'warn', got 'ignore'"):
        DeltaCheckpointIO(on_save_error="ignore")  # type: ignore[arg-type]


def test_a_failed_save_that_rebased_a_chain_restarts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-based chain reuses its old reference's memory; when that save fails, the chain restarts with a full
    snapshot instead of deltas against (or references to) bytes that were never published."""
    store = DeltaStore()
    w = torch.randn(4096)
    store.save({"w": w}, tmp_path / "a.ckpt")
    w0 = w.clone()
    real_write = store.fs.write

    def write(url: Any, data: Any) -> None:
        if str(url).endswith("b.ckpt"):
            raise OSError(28, "No space left on device")
        real_write(url, data)

    monkeypatch.setattr(store.fs, "write", write)
    w.copy_(torch.randn(4096))  # all new bits: the delta is rejected, a full snapshot re-bases the chain
    with pytest.raises(OSError):
        store.save({"w": w}, tmp_path / "b.ckpt")
    monkeypatch.setattr(store.fs, "write", real_write)
    st = store.save({"w": w}, tmp_path / "b.ckpt")  # the same bytes again: a full snapshot, not "unchanged"
    assert st.tensors_full == 1 and st.tensors_unchanged == 0
    w[:10] += 1.0
    assert store.save({"w": w}, tmp_path / "c.ckpt").tensors_delta == 1
    store.close()
    fresh = DeltaStore()
    assert torch.equal(fresh.load(tmp_path / "a.ckpt")["w"], w0)
    assert torch.equal(fresh.load(tmp_path / "c.ckpt")["w"], w)


# A save requested after `fit` (teardown already closed the writer) and then the script ends: the writer's thread
# must finish it before the interpreter exits, as Lightning's `AsyncCheckpointIO` does.
_SAVE_THEN_EXIT = """
import sys
import lightning as L
from lightning_accel.checkpoint import DeltaCheckpointIO
from tests.tiny import CheckpointModel, tiny_loader

root = sys.argv[1]
io = DeltaCheckpointIO(async_save=True)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, plugins=[io])
trainer.fit(CheckpointModel(), tiny_loader())
trainer.save_checkpoint(root + "/final.ckpt")
print("ASKED", flush=True)
"""


def test_a_save_requested_just_before_the_process_exits_is_finished_and_readable(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from lightning_accel.checkpoint import read_checkpoint

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    root = tmp_path / "ckpt"
    cmd = [sys.executable, "-c", _SAVE_THEN_EXIT, str(root)]
    r = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "ASKED" in r.stdout, r.stderr[-2000:]
    state = read_checkpoint(str(root / "final.ckpt"))
    assert state["global_step"] > 0 and state["state_dict"]


def test_a_deferred_value_is_resolved_on_the_writer_thread_and_saved(tmp_path: Path) -> None:
    import threading

    from lightning_accel._utils.deferred import Deferred
    from lightning_accel.checkpoint import read_checkpoint

    release, on = threading.Event(), []

    def produce() -> dict[str, Any]:  # a collective still in flight when the training thread returns
        on.append(threading.get_ident())
        release.wait(30)
        return {"errors": torch.arange(4.0), "world_size": 2}

    io = DeltaCheckpointIO(async_save=True)
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "gathered": Deferred(produce)}, path)
    release.set()  # the save returned before the value existed
    io.teardown()
    assert on and on[0] != threading.get_ident()
    back = read_checkpoint(path)
    assert torch.equal(back["gathered"]["errors"], torch.arange(4.0)) and back["gathered"]["world_size"] == 2
    assert torch.equal(back["state_dict"]["w"], torch.ones(3))


def test_a_deferred_value_that_fails_fails_that_save_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    from lightning_accel._utils.deferred import Deferred
    from lightning_accel.checkpoint import read_checkpoint

    def fail() -> Any:
        raise RuntimeError("gather failed: rank 1 is gone")

    io = DeltaCheckpointIO(async_save=True, on_save_error="warn")
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.ones(3)}, path)
    io.wait()
    with pytest.warns(UserWarning, match="rank 1 is gone"):
        io.save_checkpoint({"w": torch.zeros(3), "gathered": Deferred(fail)}, path)
        io.wait()
    io.teardown()
    assert torch.equal(read_checkpoint(path)["w"], torch.ones(3))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_dicts_module_versions_survive_as_with_torch_save(tmp_path: Path, async_save: bool) -> None:
    # Without `_metadata` `load_state_dict` takes every module for a pre-versioning one and migrates it: an observer's
    # saved `eps` was replaced by the float32 default, so a resumed QAT run trained with another epsilon.
    from torch.ao.quantization import MinMaxObserver

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MinMaxObserver(eps=1e-3))
    model(torch.randn(8, 4))
    io = DeltaCheckpointIO(async_save=async_save)
    io.save_checkpoint({"state_dict": model.state_dict()}, tmp_path / "last.ckpt")
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]
    assert loaded._metadata == model.state_dict()._metadata
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), MinMaxObserver())
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh[1].eps, model[1].eps)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_sparse_csr_tensor_is_saved_and_the_writer_goes_on(tmp_path: Path, async_save: bool) -> None:
    # A CSR tensor has no strides: releasing its snapshot copy raised on the writer thread, which died, and every
    # later wait (the next save's slot, `teardown`) blocked forever.
    csr = torch.randn(6, 5).relu().to_sparse_csr()
    pool = SnapshotPool()
    for _ in range(3):  # the cause, on this thread: a release that raises (checked first: no writer thread left hung)
        pool.release(pool.take({"m": csr, "coo": csr.to_sparse_coo()}))
    assert not pool._spare  # a sparse copy is no dense tensor's spare: none is kept per save
    io = DeltaCheckpointIO(async_save=async_save)
    for step in range(3):
        io.save_checkpoint({"m": csr, "w": torch.full((300,), float(step))}, tmp_path / f"step={step}.ckpt")
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (io.teardown(), done.set()), daemon=True)
    waiter.start()
    assert done.wait(60), "the writer stopped: teardown never returned"
    out = io.load_checkpoint(tmp_path / "step=2.ckpt")
    assert out["m"].layout is torch.sparse_csr and torch.equal(out["m"].to_dense(), csr.to_dense())
    assert torch.equal(out["w"], torch.full((300,), 2.0))
