"""read_checkpoint: delta manifests and plain torch.save files (zip and legacy), safely; one-line errors otherwise."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import (
    CheckpointCorruptError,
    DeltaCheckpointIO,
    DeltaStore,
    NotADeltaCheckpointError,
    read_checkpoint,
)
from lightning_accel.checkpoint.cli import main as ckpt_main


def _ckpt() -> dict[str, Any]:
    return {"state_dict": {"w": torch.arange(600.0), "b": torch.ones(3)}, "epoch": 2, "hyper_parameters": {"h": 4}}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    sa, sb = a["state_dict"], b["state_dict"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa) and a["epoch"] == b["epoch"]


def test_reads_a_delta_manifest_and_plain_files_alike(tmp_path: Path) -> None:
    DeltaStore().save(_ckpt(), tmp_path / "delta.ckpt")
    torch.save(_ckpt(), tmp_path / "zip.ckpt")
    torch.save(_ckpt(), tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    for name in ("delta.ckpt", "zip.ckpt", "legacy.ckpt"):
        back = read_checkpoint(tmp_path / name)
        assert _same(back, _ckpt()) and back["hyper_parameters"] == {"h": 4}, name
        assert back["state_dict"]["w"].device.type == "cpu"
    assert _same(read_checkpoint(f"file://{tmp_path}/delta.ckpt"), _ckpt())


def test_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    torch.save({"state_dict": {}, "obj": pickle.Pickler}, tmp_path / "evil.ckpt")  # a global: refused
    with pytest.raises(pickle.UnpicklingError, match=r"evil\.ckpt.*refused.*Unsupported global.*never unpickles") as e:
        read_checkpoint(tmp_path / "evil.ckpt")
    assert "\n" not in str(e.value)


def test_anything_else_fails_in_one_line_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotADeltaCheckpointError, match=r"notes\.txt.* neither a delta checkpoint manifest nor") as e:
        read_checkpoint(tmp_path / "notes.txt")
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"nope\.ckpt"):
        read_checkpoint(tmp_path / "nope.ckpt")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(NotADeltaCheckpointError, match="is a directory"):
        read_checkpoint(tmp_path / "dir.ckpt")
    buf = io.BytesIO()
    torch.save(_ckpt(), buf)
    (tmp_path / "cut.ckpt").write_bytes(buf.getvalue()[:200])  # a truncated archive
    with pytest.raises(CheckpointCorruptError, match=r"cut\.ckpt.* damaged `torch.save` file") as c:
        read_checkpoint(tmp_path / "cut.ckpt")
    assert "\n" not in str(c.value)
    torch.save([torch.ones(1)], tmp_path / "list.ckpt")
    with pytest.raises(ValueError, match=r"list\.ckpt.* holds a list, not a checkpoint dict"):
        read_checkpoint(tmp_path / "list.ckpt")


def test_map_location(tmp_path: Path) -> None:
    torch.save(_ckpt(), tmp_path / "zip.ckpt")
    DeltaStore().save(_ckpt(), tmp_path / "delta.ckpt")
    for name in ("zip.ckpt", "delta.ckpt"):
        back = read_checkpoint(tmp_path / name, map_location=torch.device("cpu"))
        assert back["state_dict"]["w"].device.type == "cpu"


def test_s3_delta_and_plain_through_storage_options(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    import fsspec

    bucket, opts = s3_bucket
    DeltaStore(storage_options=opts).save(_ckpt(), f"s3://{bucket}/run/last.ckpt")
    buf = io.BytesIO()
    torch.save(_ckpt(), buf)
    fsspec.filesystem("s3", skip_instance_cache=True, **opts).pipe_file(f"{bucket}/run/plain.ckpt", buf.getvalue())
    assert _same(read_checkpoint(f"s3://{bucket}/run/last.ckpt", storage_options=opts), _ckpt())
    assert _same(read_checkpoint(f"s3://{bucket}/run/plain.ckpt", storage_options=opts), _ckpt())
    # the plugin reads plain remote files with its own storage options too
    assert _same(DeltaCheckpointIO(storage_options=opts).load_checkpoint(f"s3://{bucket}/run/plain.ckpt"), _ckpt())


def test_cli_verifies_and_exports_plain_files_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(_ckpt(), tmp_path / "plain.ckpt")
    (tmp_path / "notes.txt").write_text("hello")
    assert ckpt_main(["verify", str(tmp_path / "plain.ckpt")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] is True and summary["format"] == "torch.save" and summary["tensors"] == 2
    assert ckpt_main(["verify", str(tmp_path / "notes.txt")]) == 1
    failed = json.loads(capsys.readouterr().out)
    assert failed["ok"] is False and "neither a delta checkpoint manifest" in failed["error"]
    DeltaStore().save(_ckpt(), tmp_path / "delta.ckpt")
    assert ckpt_main(["export", str(tmp_path / "delta.ckpt"), str(tmp_path / "out.ckpt")]) == 0
    assert _same(torch.load(tmp_path / "out.ckpt", weights_only=True), _ckpt())
    assert ckpt_main(["export", str(tmp_path / "notes.txt"), str(tmp_path / "x.ckpt")]) == 1
    assert "notes.txt" in capsys.readouterr().err and not (tmp_path / "x.ckpt").exists()


def test_cli_verifies_every_checkpoint_of_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "ckpts"
    store = DeltaStore()
    store.save(_ckpt(), run / "epoch=0.ckpt")
    store.save(_ckpt(), run / "last.ckpt")
    torch.save(_ckpt(), run / "plain.ckpt")
    (run / "notes.txt").write_text("not a checkpoint")  # a user's file beside them: not a checkpoint, not verified
    assert ckpt_main(["verify", str(run)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [Path(x["path"]).name for x in lines] == ["epoch=0.ckpt", "last.ckpt", "plain.ckpt"]
    assert all(x["ok"] for x in lines)
    (run / "broken.ckpt").write_text("{")
    assert ckpt_main(["verify", str(run)]) == 1
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["ok"] for x in lines] == [False, True, True, True]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckpt_main(["verify", str(empty)]) == 1
    assert "is a directory" in json.loads(capsys.readouterr().out)["error"]
