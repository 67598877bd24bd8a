"""Tensors that share memory at save time (tied weights, views of one buffer) share one storage again after a load,
as with ``torch.save`` / ``torch.load``: full saves, deltas and async saves alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaStore
from lightning_accel.checkpoint.manifest import CheckpointCorruptError
from lightning_accel.checkpoint.skeleton import pack_skeleton_blob, restore_aliases


class _TiedLM(nn.Module):
    """A GPT-style model: the output projection is the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def _checkpoint(flat: torch.Tensor, model: nn.Module) -> dict[str, Any]:
    return {
        "state_dict": model.state_dict(),
        "views": {
            "first": flat[:400],
            "square": flat[300:700].view(20, 20),
            "strided": flat[::3],
            "tiny": flat[:4],  # inlined in the skeleton blob, still a view of the same buffer
            "empty": flat[:0],
            "expanded": flat[:10].expand(3, 10),  # a view that overlaps itself
        },
        "bf16": {"t": (bf := torch.randn(32, 32, dtype=torch.bfloat16).t()), "rows": bf[1:]},
        "global_step": 1,
    }


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_shared(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    for group in ("state_dict", "views", "bf16"):
        for name, t in saved[group].items():
            got = loaded[group][name]
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    sd, views = loaded["state_dict"], loaded["views"]
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    assert not _same_storage(sd["embed.weight"], sd["body.weight"])
    assert all(_same_storage(views["first"], views[k]) for k in ("square", "strided", "tiny", "expanded"))
    assert views["strided"].stride() == (3,) and views["square"].storage_offset() == 300
    assert _same_storage(loaded["bf16"]["t"], loaded["bf16"]["rows"])
    views["first"][0] = 42.0  # one storage: a write through one view shows through the others
    assert views["strided"][0] == 42.0 and views["tiny"][0] == 42.0 and views["expanded"][2, 0] == 42.0
    sd["embed.weight"][0, 0] = 7.0
    assert sd["head.weight"][0, 0] == 7.0


@pytest.mark.parametrize("delta_ref", ["base", "previous"])
def test_full_saves_and_deltas_restore_shared_storage(tmp_path: Path, delta_ref: str) -> None:
    torch.manual_seed(0)
    model, flat = _TiedLM(), torch.randn(1000)
    store = DeltaStore(delta_ref=delta_ref, gc_grace_s=0)
    for step in range(3):  # a full save, then deltas of the changed tensors
        ckpt = _checkpoint(flat, model)
        path = tmp_path / f"step={step}.ckpt"
        store.save(ckpt, path)
        _check_shared(ckpt, store.load(path))
        _check_shared(ckpt, store.load(path, map_location=torch.device("cpu")))
        with torch.no_grad():
            model.embed.weight.add_(0.01)
            flat[::2] += 1
    store.close()


def test_async_saves_restore_shared_storage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, flat = _TiedLM(), torch.randn(1000)
    io = DeltaCheckpointIO(async_save=True, write_delay_s=0)
    saved = []
    for step in range(2):
        ckpt = _checkpoint(flat, model)
        io.save_checkpoint(ckpt, tmp_path / f"step={step}.ckpt")
        saved.append({g: {k: v.clone() for k, v in ckpt[g].items()} for g in ("state_dict", "views", "bf16")})
        io.wait()
        with torch.no_grad():
            model.embed.weight.add_(0.01)
    for step, ckpt in enumerate(saved):
        _check_shared(ckpt, io.load_checkpoint(tmp_path / f"step={step}.ckpt"))
    io.teardown()


def test_a_tied_model_loads_into_a_fresh_model(tmp_path: Path) -> None:
    model = _TiedLM()
    io = DeltaCheckpointIO()
    io.save_checkpoint({"state_dict": model.state_dict()}, tmp_path / "m.ckpt")
    loaded = io.load_checkpoint(tmp_path / "m.ckpt")["state_dict"]
    assert loaded["embed.weight"].data_ptr() == loaded["head.weight"].data_ptr()
    fresh = _TiedLM()
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.head.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight
    io.teardown()


def test_a_checkpoint_without_the_record_loads_as_separate_tensors(tmp_path: Path) -> None:
    # What a store writes without shared tensors (and what it wrote before it recorded them): no `aliases` key in
    # the skeleton blob, so the blob is byte-identical to the old format.
    assert pack_skeleton_blob(b"x", {}) == pack_skeleton_blob(b"x", {}, [])
    w = torch.randn(64, 64)
    store = DeltaStore()
    store.save({"a": w, "b": w}, tmp_path / "old.ckpt", aliases=[])
    out = store.load(tmp_path / "old.ckpt")
    assert torch.equal(out["a"], w) and torch.equal(out["b"], w) and not _same_storage(out["a"], out["b"])
    store.close()


def test_a_damaged_record_is_reported() -> None:
    tensors = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(ValueError, match="names no tensor"):
        restore_aliases([[["a", 0, [1]], ["zz", 0, [1]]]], tensors)
    with pytest.raises(ValueError, match="bad offset or strides"):
        restore_aliases([[["a", 0, [1]], ["b", -4, [1]]]], tensors)


def test_a_damaged_record_fails_the_load_naming_the_checkpoint(tmp_path: Path) -> None:
    store = DeltaStore()
    w = torch.randn(64, 64)
    store.save({"a": w, "b": w}, tmp_path / "x.ckpt", aliases=[[["a", 0, [64, 1]], ["b", 0, [64]]]])
    with pytest.raises(CheckpointCorruptError, match="x.ckpt.*sharing memory is damaged"):
        store.load(tmp_path / "x.ckpt")
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_cuda_tied_weights_stay_shared_through_a_map_location(tmp_path: Path, async_save: bool) -> None:
    model = _TiedLM().cuda()
    flat = torch.randn(1000, device="cuda")
    ckpt = {
        "state_dict": model.state_dict(),
        "views": {"all": flat, "tail": flat[500:], "expanded": flat[:8].expand(2, 8)},
    }
    io = DeltaCheckpointIO(async_save=async_save)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    io.wait()
    for where in ("cuda", "cpu"):
        back = io.load_checkpoint(tmp_path / "a.ckpt", map_location=where)
        sd, views = back["state_dict"], back["views"]
        assert sd["embed.weight"].device.type == where and sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
        assert torch.equal(sd["head.weight"].cpu(), model.head.weight.detach().cpu())
        assert all(_same_storage(views["all"], views[k]) for k in ("tail", "expanded"))
        assert torch.equal(views["expanded"].cpu(), flat[:8].expand(2, 8).cpu())
    io.teardown()
