"""One writer per checkpoint directory: a second process is refused with the directory and the holder named; a
killed holder's lock is taken over; the S3 lease (conditional PUTs against moto) does the same."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from typing_extensions import override

from lightning_accel.checkpoint import (
    CheckpointDirectoryLockedError,
    DeltaCheckpointIO,
    DeltaModelCheckpoint,
    DeltaStore,
)
from lightning_accel.checkpoint.lock import LOCK_NAME


def _hold(directory: str, ready: Any) -> None:
    """Child process: take the directory (its first save) and keep it until killed."""
    store = DeltaStore()
    store.save({"w": torch.zeros(300)}, os.path.join(directory, "child.ckpt"))
    ready.set()
    time.sleep(120)


def test_second_process_refused_then_takes_over_from_a_killed_holder(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")  # a second process in ~10 ms (no `import lightning` again)
    ready = ctx.Event()
    child = ctx.Process(target=_hold, args=(str(tmp_path), ready), daemon=True)
    child.start()
    assert child.pid is not None
    try:
        assert ready.wait(60)
        io = DeltaCheckpointIO()
        with pytest.raises(CheckpointDirectoryLockedError) as info:
            io.save_checkpoint({"w": torch.ones(300)}, tmp_path / "a.ckpt")
        msg = str(info.value)
        assert str(tmp_path) in msg and f"pid {child.pid} on host {socket.gethostname()}" in msg and "\n" not in msg
        assert info.value.holder["pid"] == child.pid
        assert not (tmp_path / "a.ckpt").exists()
        with pytest.raises(CheckpointDirectoryLockedError):
            io.remove_checkpoint(tmp_path / "child.ckpt")  # removals are writes too
        assert (tmp_path / "child.ckpt").exists()
        assert DeltaStore().load(tmp_path / "child.ckpt")["w"].sum() == 0  # readers never lock
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    # The kernel dropped the dead holder's flock: the lock file still names it, and is taken over.
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == child.pid
    with pytest.warns(UserWarning, match=f"Took over the writer lock .* from pid {child.pid}"):
        io.save_checkpoint({"w": torch.ones(300)}, tmp_path / "a.ckpt")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    io.teardown()  # releases: another writer (here: this process) may take it again
    assert (tmp_path / LOCK_NAME).read_text() == ""
    store = DeltaStore()
    store.remove(tmp_path / "child.ckpt")
    store.close()


def test_two_writers_in_one_process_are_refused_until_teardown(tmp_path: Path) -> None:
    a, b = DeltaCheckpointIO(), DeltaCheckpointIO()
    a.save_checkpoint({"w": torch.ones(300)}, tmp_path / "a.ckpt")
    with pytest.raises(CheckpointDirectoryLockedError, match="another DeltaStore / DeltaCheckpointIO of this process"):
        b.save_checkpoint({"w": torch.ones(300)}, tmp_path / "b.ckpt")
    a.teardown()
    b.save_checkpoint({"w": torch.ones(300)}, tmp_path / "b.ckpt")
    b.teardown()
    assert DeltaCheckpointIO(lock=False).store.lock is False


def test_s3_lease_refuses_a_second_writer_and_expired_or_dead_leases_are_taken_over(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    root = f"s3://{bucket}/run/ckpt"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    lease = f"{bucket}/run/ckpt/{LOCK_NAME}"
    first = DeltaStore(storage_options=opts)
    first.save({"w": torch.zeros(300)}, f"{root}/a.ckpt")
    held = json.loads(fs.cat(lease))
    assert held["pid"] == os.getpid() and held["expires"] > time.time()
    second = DeltaStore(storage_options=opts)
    with pytest.raises(CheckpointDirectoryLockedError, match=f"{root}.* is being written by another DeltaStore"):
        second.save({"w": torch.ones(300)}, f"{root}/b.ckpt")
    first.close()
    assert not fs.exists(lease)  # released: the lease object is gone
    # A lease left by a writer on another host that stopped renewing it 1 s ago (killed): taken over.
    stale = {"owner": "x", "pid": 1, "host": "elsewhere", "since": time.time() - 300, "expires": time.time() - 1}
    fs.pipe_file(lease, json.dumps(stale).encode())
    with pytest.warns(UserWarning, match="from pid 1 on host elsewhere"):
        second.save({"w": torch.ones(300)}, f"{root}/b.ckpt")
    second.close()
    # A live lease of another host is respected; one of a process of this host that is gone is stale at once.
    live = {**stale, "expires": time.time() + 600}
    fs.pipe_file(lease, json.dumps(live).encode())
    with pytest.raises(CheckpointDirectoryLockedError, match="pid 1 on host elsewhere.*expires in"):
        second.save({"w": torch.ones(300)}, f"{root}/c.ckpt")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    fs.pipe_file(lease, json.dumps({**live, "pid": dead, "host": socket.gethostname()}).encode())
    with pytest.warns(UserWarning, match=f"from pid {dead}"):
        second.save({"w": torch.ones(300)}, f"{root}/c.ckpt")
    second.close()
    assert torch.equal(DeltaStore(storage_options=opts).load(f"{root}/c.ckpt")["w"], torch.ones(300))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_after_fit_holds_the_lock_only_while_it_is_written(tmp_path: Path, async_save: bool) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    ckpt = tmp_path / "ckpt"
    io = DeltaCheckpointIO(async_save=async_save)
    trainer = ckpt_trainer(tmp_path, [io], [ModelCheckpoint(dirpath=ckpt, save_last=True)], max_epochs=1)
    trainer.fit(CheckpointModel(), tiny_loader(32))
    trainer.save_checkpoint(ckpt / "final.ckpt")  # after `fit`: the plugin's teardown has run
    io.wait()
    assert (ckpt / LOCK_NAME).read_text() == ""  # released as the save ended, not at the process's exit
    # Another writer of the directory (a resumed run, `ckpt gc`) is not refused while this process lives on.
    other = DeltaStore(gc_grace_s=0)
    other.collect_garbage(ckpt)
    assert json.loads((ckpt / LOCK_NAME).read_text())["pid"] == os.getpid()  # taken by `other`
    other.close()
    final = DeltaStore().load(ckpt / "final.ckpt")
    assert torch.equal(final["state_dict"]["net.0.weight"], trainer.lightning_module.state_dict()["net.0.weight"])
    # A later save of this plugin takes the lock again for its own writing, and gives it back.
    trainer.save_checkpoint(ckpt / "final2.ckpt")
    io.wait()
    assert (ckpt / LOCK_NAME).read_text() == ""
    assert torch.equal(
        DeltaStore().load(ckpt / "final2.ckpt")["state_dict"]["net.0.weight"], final["state_dict"]["net.0.weight"]
    )
    # `claim` (CheckpointGuard, the CLI) holds it again until the next teardown.
    io.claim(ckpt)
    trainer.save_checkpoint(ckpt / "final3.ckpt")
    io.wait()
    with pytest.raises(CheckpointDirectoryLockedError):
        DeltaStore().claim(str(ckpt))
    io.teardown()
    assert (ckpt / LOCK_NAME).read_text() == ""


class _LockProbe(Callback):
    """Records, at the end of each training epoch (after that epoch's save), whether the directory is held."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.held: list[bool] = []

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        try:
            DeltaStore(lock=True).claim(str(self.directory))
        except CheckpointDirectoryLockedError:
            self.held.append(True)
        else:
            self.held.append(False)


def test_a_fit_after_an_earlier_stage_holds_the_lock_and_saves_deltas(tmp_path: Path) -> None:
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    ckpt = tmp_path / "ckpt"
    io = DeltaCheckpointIO()
    probe = _LockProbe(ckpt)
    cb = DeltaModelCheckpoint(dirpath=ckpt, save_last=True, every_n_train_steps=2)
    trainer = ckpt_trainer(tmp_path, [io], [cb, probe], max_epochs=2)
    model = CheckpointModel()
    trainer.validate(model, tiny_loader(32))  # a stage whose teardown tears the plugin down
    trainer.fit(model, tiny_loader(64))
    # `on_train_epoch_end` runs before the epoch's `last.ckpt` save: the first epoch's check sees the step saves
    assert probe.held == [True, True]
    assert any(s.tensors_delta + s.tensors_unchanged for s in io.history)  # the chain state was kept between saves
    assert (ckpt / LOCK_NAME).read_text() == ""  # released by the fit's teardown
