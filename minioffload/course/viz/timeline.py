"""Figures of a `Trace`: which lane was busy when (a Gantt chart), and bytes per second over time.

Pure functions: a trace in, a matplotlib Figure out (plus `binned_bandwidth`, the numbers behind the
bandwidth figure). Times on the x axis are milliseconds from the trace's origin.

What this is not: an interactive trace viewer. For thousands of spans, save the trace with
`Trace.save` and open it in ui.perfetto.dev; `widgets.timeline_explorer` adds lane toggles and zoom.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from ...trace import Trace
from .style import lane_color

_LABEL_FONT = 7  # points
_CHAR_WIDTH_IN = 0.6 * _LABEL_FONT / 72  # a rough average glyph width, in inches


def _message_figure(message: str, title: str | None) -> Figure:
    fig, ax = plt.subplots(figsize=(7.2, 2.5))
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, color="dimgray",
            transform=ax.transAxes)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    return fig


def _text_color_on(color: str) -> str:
    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def lane_rows(ax: Axes, trace: Trace, rows: Sequence[str], fontsize: float = 8, linewidth: float = 0.6) -> None:
    """Draw `trace`'s spans on `ax` as bars in ms, one row per lane of `rows` (first on top), in the lane's colour,
    and style the axes as every timeline in the course is: lane names as ticks, a light x grid, no frame."""
    for row, lane in enumerate(rows):
        ax.broken_barh([(s.start * 1e3, s.duration * 1e3) for s in trace.on(lane)], (row - 0.38, 0.76),
                       facecolors=lane_color(lane), edgecolors="white", linewidths=linewidth, label=lane)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), rows, fontsize=fontsize)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="0.9", lw=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def timeline(trace: Trace, lanes: Sequence[str] | None = None,
             t_range: tuple[float, float] | None = None, title: str | None = None) -> Figure:
    """One row per lane (top to bottom in `trace.lanes()` order, or in the order of `lanes`), one bar
    per span. `t_range=(t0, t1)` in seconds zooms in. Wide enough spans carry their name."""
    title = title or "Timeline"
    if not trace.spans:
        return _message_figure("no spans", title)
    rows = trace.lanes() if lanes is None else list(lanes)
    if not rows:
        return _message_figure("no lanes selected", title)

    fig, ax = plt.subplots(figsize=(7.2, min(4.0, max(2.5, 1.3 + 0.42 * len(rows)))))
    lane_rows(ax, trace, rows, fontsize=9)

    if t_range is None:
        first, last = min(s.start for s in trace.spans), max(s.end for s in trace.spans)
        pad = 0.01 * (last - first)
        x0, x1 = (first - pad) * 1e3, (last + pad) * 1e3
    else:
        if not t_range[1] > t_range[0]:
            raise ValueError(f"t_range must be (start, end) in seconds with end > start, got {t_range!r}")
        x0, x1 = t_range[0] * 1e3, t_range[1] * 1e3
    if x1 <= x0:  # every span has zero duration at one instant
        x0, x1 = x0 - 0.5, x1 + 0.5
    ax.set_xlim(x0, x1)
    _label_spans(ax, trace, rows, x0, x1, axis_width_in=fig.get_figwidth() * 0.82)

    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_title(f"makespan {trace.makespan() * 1e3:.3g} ms, overlap {trace.overlap_fraction():.0%}",
                 fontsize=8, loc="right", color="dimgray")
    fig.tight_layout()
    return fig


def _label_spans(ax: Axes, trace: Trace, rows: list[str], x0: float, x1: float,
                 axis_width_in: float) -> None:
    """Write a span's name inside its bar when the visible part of the bar is wide enough."""
    inches_per_ms = axis_width_in / (x1 - x0)
    for row, lane in enumerate(rows):
        color = _text_color_on(lane_color(lane))
        for s in trace.on(lane):
            left, right = max(s.start * 1e3, x0), min(s.end * 1e3, x1)
            if (right - left) * inches_per_ms < len(s.name) * _CHAR_WIDTH_IN + 0.08:
                continue
            ax.text((left + right) / 2, row, s.name, ha="center", va="center", fontsize=_LABEL_FONT,
                    color=color, clip_on=True)


def binned_bandwidth(trace: Trace, bins: int, lane: str) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per second moved on `lane` in each of `bins` equal bins over the whole trace.

    Each span's bytes are spread evenly over its duration (a span of zero duration puts its bytes
    in the bin it falls in), so sum(rate * bin_width) is the lane's total bytes. Every lane of one
    trace gets the same bin edges. Returns (edges in seconds, shape (bins + 1,); rates in bytes/s,
    shape (bins,)).
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    first = min((s.start for s in trace.spans), default=0.0)
    last = max((s.end for s in trace.spans), default=0.0)
    if last <= first:
        last = first + 1e-6  # an empty or instantaneous trace still gets bins of non-zero width
    edges = np.linspace(first, last, bins + 1)
    moved = np.zeros(bins)  # bytes per bin
    for s in trace.on(lane):
        if not s.nbytes:
            continue
        if s.duration > 0:
            overlap = np.clip(np.minimum(s.end, edges[1:]) - np.maximum(s.start, edges[:-1]), 0, None)
            moved += s.nbytes * overlap / s.duration
        else:
            moved[min(np.searchsorted(edges, s.start, side="right") - 1, bins - 1)] += s.nbytes
    return edges, moved / np.diff(edges)


def bandwidth_over_time(trace: Trace, bins: int = 50, lanes: Sequence[str] | None = None) -> Figure:
    """GB/s per lane over time (one step line per lane that moves bytes), binned as `binned_bandwidth`."""
    title = "Bandwidth over time"
    moving = [lane for lane in (trace.lanes() if lanes is None else lanes)
              if sum(s.nbytes for s in trace.on(lane))]
    if not moving:
        return _message_figure("no bytes moved", title)
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    peak = 0.0
    for lane in moving:
        edges, rate = binned_bandwidth(trace, bins, lane)
        peak = max(peak, rate.max())
        color = lane_color(lane)
        ax.stairs(rate / 1e9, edges * 1e3, color=color, lw=1.6,
                  label=f"{lane} ({trace.bandwidth(lane) / 1e9:.3g} GB/s while busy)")
        ax.stairs(rate / 1e9, edges * 1e3, color=color, alpha=0.12, fill=True)
    ax.set_xlim(edges[0] * 1e3, edges[-1] * 1e3)
    ax.set_ylim(0, peak / 1e9 * 1.08)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("GB/s")
    ax.grid(axis="y", color="0.9", lw=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_title(f"bins of {(edges[1] - edges[0]) * 1e3:.3g} ms", fontsize=8, loc="right", color="dimgray")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(len(moving), 3),
              frameon=False)
    fig.tight_layout()
    return fig
