"""Trainer-level tests: DeltaCheckpointIO with ModelCheckpoint (top-k, last, link), resume, async, AsyncCheckpointIO."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_accel import DeltaCheckpointIO
from lightning_accel.checkpoint.manifest import NotADeltaCheckpointError
from lightning_accel.checkpoint.store import BLOB_DIR, PENDING_NAME, DeltaStore
from tests.tiny import CheckpointModel, tiny_loader
from tests.tiny import ckpt_trainer as trainer

torch.set_num_threads(1)


class _Recorder(ModelCheckpoint):
    """ModelCheckpoint that also keeps, per saved path, a private copy of the model/optimizer state it saved."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.saved: dict[str, dict] = {}

    def _save_checkpoint(self, trainer, filepath: str) -> None:  # noqa: ANN001
        ckpt = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
        self.saved[os.path.abspath(filepath)] = {
            "state_dict": {k: v.clone() for k, v in ckpt["state_dict"].items()},
            "optimizer": [
                {k: {n: t.clone() for n, t in s.items()} for k, s in o["state"].items()}
                for o in ckpt["optimizer_states"]
            ],
        }
        super()._save_checkpoint(trainer, filepath)


def _assert_equal_state(loaded: dict, expected: dict) -> None:
    for k, v in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][k], v), k
    for o_loaded, o_exp in zip(loaded["optimizer_states"], expected["optimizer"], strict=True):
        for pid, s in o_exp.items():
            for n, t in s.items():
                assert torch.equal(o_loaded["state"][pid][n], t), (pid, n)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_top_k_and_last_stay_loadable_and_exact(tmp_path: Path, async_save: bool) -> None:
    io = DeltaCheckpointIO(async_save=async_save)
    ckpt = _Recorder(
        dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=3, save_last=True, monitor="step", mode="max"
    )
    t = trainer(tmp_path, [io], [ckpt])
    t.fit(CheckpointModel(), tiny_loader(), tiny_loader(32))
    remaining = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_file())
    assert len(remaining) == 4 and "last.ckpt" in remaining, remaining  # 3 top-k + last
    store = DeltaStore()
    for name in remaining:
        path = os.path.abspath(tmp_path / "ckpt" / name)
        loaded = io.load_checkpoint(path)
        _assert_equal_state(loaded, ckpt.saved[path])
        assert store.verify(path)["ok"]
    # Garbage collection left exactly the blobs the remaining manifests reference, plus those still waiting out
    # their grace period (recorded in the pending-deletions file).
    d = str(tmp_path / "ckpt")
    blobs = {
        p.name
        for p in (tmp_path / "ckpt" / BLOB_DIR).rglob("*")
        if p.is_file() and p.name not in (".lock", PENDING_NAME)
    }
    assert blobs == store.live_keys(d) | set(store.pending_deletions(d))
    # last.ckpt duplicates the newest step: its tensors are references, not rewrites.
    saves = io.history
    assert any(s.path.endswith("last.ckpt") and s.tensors_unchanged > 0 and s.tensors_full == 0 for s in saves)


def test_resume_from_last_continues_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    io = DeltaCheckpointIO(async_save=True)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    model = CheckpointModel()
    trainer(tmp_path, [io], [ckpt], max_epochs=1).fit(model, tiny_loader())
    # Resume into a fresh model for a second epoch; compare with an uninterrupted 2-epoch run.
    resumed = CheckpointModel()
    t2 = trainer(tmp_path, [DeltaCheckpointIO()], [], max_epochs=2, enable_checkpointing=False)
    t2.fit(resumed, tiny_loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    torch.manual_seed(0)
    straight = CheckpointModel()
    trainer(tmp_path / "b", [], [], max_epochs=2, enable_checkpointing=False).fit(straight, tiny_loader())
    for (k, a), b in zip(resumed.state_dict().items(), straight.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_wrapped_by_lightning_async_checkpoint_io(tmp_path: Path) -> None:
    ckpt = _Recorder(
        dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    io = AsyncCheckpointIO(DeltaCheckpointIO())
    trainer(tmp_path, [io], [ckpt]).fit(CheckpointModel(), tiny_loader())
    for p in (tmp_path / "ckpt").glob("*.ckpt"):
        _assert_equal_state(DeltaStore().load(p), ckpt.saved[os.path.abspath(p)])


def test_save_last_link_survives_removal_of_its_target(tmp_path: Path) -> None:
    io = DeltaCheckpointIO()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1, save_last="link", monitor="step", mode="max"
    )
    trainer(tmp_path, [io], [ckpt], max_epochs=1).fit(CheckpointModel(), tiny_loader())
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink()
    target = Path(os.path.realpath(last))
    io.remove_checkpoint(target)  # e.g. a later top-k eviction
    assert not target.exists() and not last.is_symlink()
    assert DeltaStore().verify(last)["ok"]


def test_background_failure_is_raised_not_lost(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x.ckpt").mkdir()  # a directory where a checkpoint should go
    io.save_checkpoint({"a": torch.zeros(300)}, tmp_path / "ckpt" / "x.ckpt")
    with pytest.raises(ValueError, match="is a directory"):
        io.teardown()
    io.save_checkpoint({"a": torch.zeros(300)}, tmp_path / "ckpt" / "y.ckpt")
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "ckpt" / "y.ckpt")["a"], torch.zeros(300))


def test_loads_plain_torch_checkpoint_safely(tmp_path: Path) -> None:
    p = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}}, p)
    assert torch.equal(DeltaCheckpointIO().load_checkpoint(p)["state_dict"]["w"], torch.ones(3))
    with pytest.raises(ValueError, match="weights_only=False"):
        DeltaCheckpointIO().load_checkpoint(p, weights_only=False)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_run_switched_to_the_plugin_rotates_the_plain_checkpoints_it_resumed_from(
    tmp_path: Path, async_save: bool
) -> None:
    # The first run writes plain `torch.save` checkpoints; the second resumes from them with the plugin, in the same
    # `dirpath`: Lightning rotates the tracked plain files out and replaces `last.ckpt`, as TorchCheckpointIO would.
    ckpt = tmp_path / "ckpt"

    def fit(max_epochs: int, plugins: list, resume: bool) -> None:  # noqa: ANN001
        cb = ModelCheckpoint(dirpath=ckpt, save_top_k=2, monitor="step", mode="max", save_last=True)
        trainer(tmp_path, plugins, [cb], max_epochs=max_epochs, limit_val_batches=0).fit(
            CheckpointModel(), tiny_loader(), ckpt_path=str(ckpt / "last.ckpt") if resume else None
        )

    fit(2, [], resume=False)
    plain = sorted(p.name for p in ckpt.glob("*.ckpt"))
    assert len(plain) == 3
    user = ckpt / "epoch=9-step=99.ckpt"  # a user's own torch.save file, named like a checkpoint, never tracked
    torch.save({"w": torch.ones(2)}, user)
    (ckpt / "notes.txt").write_text("mine")
    io = DeltaCheckpointIO(async_save=async_save)
    fit(4, [io], resume=True)
    io.teardown()
    names = sorted(p.name for p in ckpt.glob("*.ckpt"))
    assert names == ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt", "epoch=9-step=99.ckpt", "last.ckpt"], names
    store = DeltaStore()
    for name in ("epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt", "last.ckpt"):
        assert store.verify(ckpt / name)["ok"], name  # delta manifests now
    assert torch.equal(torch.load(user, weights_only=True)["w"], torch.ones(2))
    assert (ckpt / "notes.txt").read_text() == "mine"
    # Only tracked zip files are adopted: a text file is still refused.
    assert store.adopt([ckpt / "notes.txt", ckpt / "missing.ckpt"]) == []
    with pytest.raises(NotADeltaCheckpointError, match="Refusing to remove"):
        store.remove(ckpt / "notes.txt")
    assert store.adopt([user]) == [str(user)]  # adopted by hand: removed like a manifest
    store.remove(user)
    assert not user.exists()


def test_async_removal_is_ordered_after_queued_saves(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True)
    state = {"w": torch.randn(1000)}
    for i in range(4):
        io.save_checkpoint(state, tmp_path / f"{i}.ckpt")
        if i:
            io.remove_checkpoint(tmp_path / f"{i - 1}.ckpt")  # queued behind the save it follows
    io.teardown()
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["3.ckpt"]
    assert torch.equal(io.load_checkpoint(tmp_path / "3.ckpt")["w"], state["w"])
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(state, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(ValueError, match="`quantize`"):
        DeltaCheckpointIO(quantize="int2")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_cuda_tensors_snapshot_and_map_location(tmp_path: Path, async_save: bool) -> None:
    io = DeltaCheckpointIO(async_save=async_save)
    w = torch.randn(4096, device="cuda")
    state = {"state_dict": {"w": w}, "step": 1}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    expected = w.cpu()
    w.add_(1.0)  # an optimizer step racing the background save must not leak into the checkpoint
    io.teardown()
    back = io.load_checkpoint(tmp_path / "a.ckpt", map_location="cuda")
    assert back["state_dict"]["w"].is_cuda and torch.equal(back["state_dict"]["w"].cpu(), expected)
    assert io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"].device.type == "cpu"


def test_quickstart_yaml_wires_the_plugin(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "quickstart.yaml"
    cli = AccelCLI(
        args=["--config", str(config), f"--trainer.default_root_dir={tmp_path}", f"--data.origin={tmp_path}/d"],
        run=False,
    )
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, DeltaCheckpointIO) and io.async_save


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_top_k_removes_the_subfolders_it_empties_and_nothing_of_the_users(tmp_path: Path, async_save: bool) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "epoch=0").mkdir(parents=True)  # a folder the run saves into, holding a file of the user's
    (ckpt / "epoch=0" / "notes.txt").write_text("mine")
    (ckpt / "epoch=9").mkdir()  # and a user's empty folder the run never saves into
    io = DeltaCheckpointIO(async_save=async_save, gc_grace_s=0)
    # `filename` with a `/`: one subfolder per epoch, each with its own blob store
    cb = ModelCheckpoint(dirpath=ckpt, filename="{epoch}/{step}", save_top_k=1, every_n_train_steps=3)
    t = trainer(tmp_path, [io], [cb], max_epochs=4)
    t.fit(CheckpointModel(), tiny_loader(64))
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0", "epoch=3", "epoch=9"]
    # the user's file stays, with the blob store beside it (none, when the save there was cancelled while queued)
    assert {p.name for p in (ckpt / "epoch=0").iterdir()} - {BLOB_DIR} == {"notes.txt"}
    assert (ckpt / "epoch=0" / "notes.txt").read_text() == "mine"
    assert list((ckpt / "epoch=9").iterdir()) == []
    assert [p.name for p in (ckpt / "epoch=3").glob("*.ckpt")] == [os.path.basename(cb.best_model_path)]
    assert DeltaStore().verify(cb.best_model_path)["ok"]


def test_a_subfolder_emptied_while_its_blobs_wait_goes_with_them(tmp_path: Path) -> None:
    io = DeltaCheckpointIO()  # the default grace period: the removal leaves the blobs waiting
    state = {"w": torch.randn(4096)}
    io.save_checkpoint(state, tmp_path / "epoch=0" / "a.ckpt")
    io.save_checkpoint(state, tmp_path / "epoch=1" / "b.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0" / "a.ckpt")
    assert (tmp_path / "epoch=0" / BLOB_DIR / PENDING_NAME).exists()  # a reader may still need its blobs
    io.store.gc_grace_s = 0.0  # the grace period has passed
    io.save_checkpoint({"w": state["w"] + 1}, tmp_path / "epoch=1" / "c.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=1" / "b.ckpt")  # the next rotation collects the blobs that waited
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1"]
    io.teardown()
    assert torch.equal(DeltaStore().load(tmp_path / "epoch=1" / "c.ckpt")["w"], state["w"] + 1)


def test_a_removal_that_cancels_a_queued_save_removes_the_folders_made_for_it(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True, write_delay_s=5.0)  # the saves stay queued until the removals come
    (tmp_path / "mine").mkdir()  # a folder of the user's, empty
    state = {"w": torch.randn(600)}
    for path in (tmp_path / "a" / "epoch=1" / "x.ckpt", tmp_path / "mine" / "x.ckpt"):
        io.save_checkpoint(state, path)
        assert path.parent.is_dir()  # made before the save returns (Lightning may link into it at once)
        io.remove_checkpoint(path)
    io.wait()
    assert io.writer_stats.cancelled == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # `a/epoch=1` made for the save, and `a`, went
    assert list((tmp_path / "mine").iterdir()) == []
    # a later save there makes it again
    io.save_checkpoint(state, tmp_path / "a" / "epoch=1" / "y.ckpt")
    io.teardown()
    assert torch.equal(DeltaStore().load(tmp_path / "a" / "epoch=1" / "y.ckpt")["w"], state["w"])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_takes_back_the_folder_it_made_and_nothing_else(
    tmp_path: Path, async_save: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = DeltaCheckpointIO(async_save=async_save, on_save_error="warn" if async_save else "raise")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    write = io.store.fs.write

    def full_disk(url: str, data: bytes) -> None:
        if "/.delta_blobs/" in str(url):
            raise OSError(errno.ENOSPC, "No space left on device", str(url))
        write(url, data)

    monkeypatch.setattr(io.store.fs, "write", full_disk)
    for path in (tmp_path / "epoch=1" / "x.ckpt", tmp_path / "mine" / "x.ckpt"):
        if async_save:
            io.save_checkpoint({"w": torch.randn(600)}, path)
            with pytest.warns(UserWarning, match="No space left"):
                io.wait()
        else:
            with pytest.raises(OSError, match="No space left"):
                io.save_checkpoint({"w": torch.randn(600)}, path)
    # the folder made for the failed save went; the user's folder and file stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "mine" / "x.ckpt").exists()
    monkeypatch.setattr(io.store.fs, "write", write)  # space again: the next save there works
    io.save_checkpoint({"w": torch.ones(600)}, tmp_path / "epoch=1" / "x.ckpt")
    io.teardown()
    assert torch.equal(DeltaStore().load(tmp_path / "epoch=1" / "x.ckpt")["w"], torch.ones(600))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_leaves_the_users_empty_folder_where_it_was(tmp_path: Path, async_save: bool) -> None:
    # The folder existed before the save (made by the user for the run): the failed save takes back only what it
    # made there (its blob store), not the folder itself.
    mine = tmp_path / "runs" / "ckpt"
    mine.mkdir(parents=True)
    io = DeltaCheckpointIO(async_save=async_save)
    bad = {"w": torch.randn(600), "config": ValueError("not plain data")}
    with pytest.raises(TypeError, match="unpickling arbitrary code"):
        io.save_checkpoint(bad, mine / "last.ckpt")
        io.wait()
    assert mine.is_dir() and list(mine.iterdir()) == []
    io.save_checkpoint({"w": torch.ones(600)}, mine / "last.ckpt")  # the folder still serves the run
    io.teardown()
    assert torch.equal(DeltaStore().load(mine / "last.ckpt")["w"], torch.ones(600))
