"""The per-epoch picture: a PNG the monitor recognises as its own, drawn without touching the user's matplotlib."""

from __future__ import annotations

import pytest

from lightning_accel.perf import epoch_breakdown_png
from lightning_accel.perf.plot import is_breakdown_png


def test_drawing_leaves_the_processs_matplotlib_backend_as_the_user_set_it() -> None:
    """Drawing switched the process to the Agg backend: after a fit, a notebook's inline figures (or an interactive
    window's) no longer showed."""
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend other than Agg, as a notebook's inline one is
    try:
        png = epoch_breakdown_png([{"epoch": 0, "data": 1.0, "compute": 2.0}, {"epoch": 1, "compute": 1.5}])
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and is_breakdown_png(png[:4096])


def test_nothing_to_draw_says_so() -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="`epochs` is empty: no epoch was timed"):
        epoch_breakdown_png([])
