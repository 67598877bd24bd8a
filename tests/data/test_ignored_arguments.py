"""An argument that the other arguments make unused is refused in ``__init__``, not silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel.data import CachedDataModule


def test_a_shuffle_window_under_the_global_shuffle_is_refused(small_digits: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^`shuffle_window` 8 has no effect with `shuffle='global'`.*'window'"):
        CachedDataModule(str(small_digits), cache_dir=str(tmp_path), shuffle="global", shuffle_window=8)
    for shuffle in ("window", "auto"):  # a window applies (to a packed origin)
        dm = CachedDataModule(str(small_digits), cache_dir=str(tmp_path), shuffle=shuffle, shuffle_window=8)
        assert dm.shuffle_window == 8
