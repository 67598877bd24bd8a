"""``data pack`` to a DEST below a file (a mistyped path: ``run.log/pack``): refused before a sample is read, in one
line naming DEST and the file in the way (exit 1), the file untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel.data import pack_origin
from lightning_accel.data.cli import main as data_main


@pytest.mark.parametrize("below", ["pack", "deeper/pack"])
def test_pack_refuses_a_dest_below_a_file(
    small_digits: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], below: str
) -> None:
    blocker = tmp_path / "run.log"
    blocker.write_text("my log\n")
    dest = blocker / below
    assert data_main(["pack", str(small_digits), str(dest)]) == 1
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err  # no progress line: nothing was read
    assert "DEST" in cap.err and str(dest) in cap.err and f"{str(blocker)!r}, which is a file" in cap.err, cap.err
    assert blocker.read_text() == "my log\n"
    with pytest.raises(NotADirectoryError, match=r"`dest` .* lies under .*run\.log', which is a file"):
        pack_origin(str(small_digits), str(dest))
