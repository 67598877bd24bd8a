"""A picture of where step time went, epoch by epoch: one stacked bar per epoch (plain matplotlib, no Lightning).

:class:`~lightning_accel.perf.PerformanceMonitor` writes it next to ``perf_report.json`` as ``perf_report.png``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from lightning_accel._utils.imports import module_available
from lightning_accel.perf.timers import CATEGORIES

__all__ = ["PLOT_CATEGORIES", "PNG_SOFTWARE", "epoch_breakdown_png", "is_breakdown_png", "plot_available"]

#: The ``Software`` text chunk of every picture :func:`epoch_breakdown_png` draws: how the monitor recognises a
#: picture of its own (which it may replace) from a user's file of the same name (which it never overwrites).
PNG_SOFTWARE = "lightning_accel PerformanceMonitor epoch breakdown"

#: The categories drawn, bottom to top (``other`` -- time outside all of them -- goes on top when non-zero).
PLOT_CATEGORIES: tuple[str, ...] = ("data", "compute", "comm", "checkpoint", "eval", "other")

_COLORS = {
    "data": "#d62728",
    "compute": "#1f77b4",
    "comm": "#ff7f0e",
    "checkpoint": "#9467bd",
    "eval": "#2ca02c",
    "other": "#7f7f7f",
}


def plot_available() -> bool:
    """Whether matplotlib can be imported (the ``dev`` extra installs it; the plugins do not need it)."""
    return module_available("matplotlib")


def epoch_breakdown_png(
    epochs: Sequence[Mapping[str, float]],
    *,
    title: str = "Where step time went",
    ylabel: str = "seconds (mean over ranks)",
) -> bytes:
    """Render per-epoch seconds per category as a stacked bar chart and return the PNG bytes (drawn off-screen; the
    process's matplotlib backend is not changed).

    Args:
        epochs: one mapping per epoch with ``"epoch"`` and a seconds value per category of
            :data:`~lightning_accel.perf.timers.CATEGORIES` (missing categories count as 0).
        title: the chart's title.
        ylabel: the y axis's label: what the seconds are (the mean over ranks, or one rank's own).

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install matplotlib``).
        ValueError: ``epochs`` is empty.
    """
    if not epochs:
        raise ValueError("`epochs` is empty: no epoch was timed, nothing to plot.")
    if not plot_available():
        raise ModuleNotFoundError("perf_report.png needs matplotlib: `pip install matplotlib`.")
    # a Figure on its own Agg canvas, never pyplot nor `matplotlib.use`: headless and without a display, and the
    # process's backend (a notebook's inline one, an interactive window's) is left as the user set it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    assert set(PLOT_CATEGORIES) == set(CATEGORIES)
    labels = [str(int(e.get("epoch", i))) for i, e in enumerate(epochs)]
    fig = Figure(figsize=(max(4.0, 0.6 * len(epochs) + 2.5), 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(epochs)
    for cat in PLOT_CATEGORIES:
        vals = [float(e.get(cat, 0.0)) for e in epochs]
        if not any(vals):
            continue
        ax.bar(labels, vals, bottom=bottom, color=_COLORS[cat], label=cat, width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": PNG_SOFTWARE})
    return buf.getvalue()


def is_breakdown_png(head: bytes) -> bool:
    """Whether ``head`` (the first bytes of a file; text chunks come before the image data) is a PNG that
    :func:`epoch_breakdown_png` drew."""
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Software\x00" + PNG_SOFTWARE.encode() in head
