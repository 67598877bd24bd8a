"""The resume commands of docs/quickstart.md, run as written (plus small-data overrides) through the CLI.

- continue, extend, then continue the extended run: each resumes the previous run's ``last.ckpt``;
- a run moved with ``--trainer.default_root_dir`` (and its checkpoint ``dirpath``, as documented) leaves the
  default run's checkpoints byte-identical and writes no ``last-v1.ckpt`` beside them;
- continuing an extended run with the config's smaller ``max_epochs`` is refused by Lightning's check.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_accel.checkpoint import read_checkpoint
from lightning_accel.cli import main

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_DOC = REPO / "docs" / "quickstart.md"
_BASH = re.compile(r"```bash\n(.*?)\n```", re.S)


def _doc_fit_lines() -> list[list[str]]:
    """Every ``lightning-accel fit`` command of the page's bash blocks, as argv after the subcommand, comments cut."""
    out = []
    for block in _BASH.findall(QUICKSTART_DOC.read_text()):
        for line in block.replace("\\\n", " ").splitlines():  # a backslash-continued command is one line
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["lightning-accel", "fit"]:
                out.append(argv[2:])
    return out


def _small(digits_dir: Path) -> list[str]:
    """Overrides that shrink the quickstart (data, width, batches), placed before the documented arguments."""
    return [
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--data.origin={digits_dir}",
        "--data.digits_size=null",
        "--data.cache_dir=cache",
        "--data.ram_dir=ram",
        "--data.image_size=32",
        "--data.num_workers=0",
        "--model.init_args.width=4",
    ]


def _fit(doc_argv: list[str], digits_dir: Path) -> None:
    config, rest = doc_argv[:2], doc_argv[2:]
    assert config[0] == "--config"
    main(["fit", "--config", str(REPO / config[1]), *_small(digits_dir), *rest])


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _epoch(ckpt: Path) -> int:
    return int(read_checkpoint(str(ckpt))["epoch"])


def test_documented_resume_sequence(digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the config's relative `runs/quickstart/...` land here
    lines = _doc_fit_lines()
    first = next(a for a in lines if a == ["--config", "examples/configs/quickstart.yaml"])
    moved = next(a for a in lines if any(x.startswith("--trainer.default_root_dir=") for x in a))
    resumes = [a for a in lines if a[-2:] == ["--ckpt_path", "last"] and a[1] == "examples/configs/quickstart.yaml"]
    assert len(resumes) == 3  # continue, extend, continue the extended run

    ckpt_dir = tmp_path / "runs" / "quickstart" / "checkpoints"
    _fit(first, digits_dir)  # the config's 5 epochs
    assert _epoch(ckpt_dir / "last.ckpt") == 4
    _fit(resumes[0], digits_dir)  # continue a finished run: nothing left to train, no error
    assert _epoch(ckpt_dir / "last.ckpt") == 4

    # a run moved elsewhere, as documented: the default run's checkpoints stay as they are
    planted = ckpt_dir / "notes.txt"
    planted.write_bytes(b"my notes\n")
    before = _files(ckpt_dir)
    _fit(moved, digits_dir)
    root = Path(next(x.split("=", 1)[1] for x in moved if x.startswith("--trainer.default_root_dir=")))
    assert (tmp_path / root / "checkpoints" / "last.ckpt").is_file()
    assert _files(ckpt_dir) == before  # no last-v1.ckpt, nothing rewritten

    _fit(resumes[1], digits_dir)  # extend to 8 epochs
    assert _epoch(ckpt_dir / "last.ckpt") == 7
    _fit(resumes[2], digits_dir)  # continue the extended run with its max_epochs: accepted
    assert _epoch(ckpt_dir / "last.ckpt") == 7
    assert sorted(p.name for p in ckpt_dir.glob("last*.ckpt")) == ["last.ckpt"]

    # continuing with the config's max_epochs (5) after the extend: Lightning's check refuses it
    with pytest.raises((MisconfigurationException, SystemExit)) as info:
        _fit(resumes[0], digits_dir)
    if isinstance(info.value, MisconfigurationException):
        assert str(info.value).startswith("You restored a checkpoint with current_epoch=")
    else:
        assert isinstance(info.value, SystemExit) and info.value.code == 2
