"""Figure for copy bandwidth against transfer size, pinned vs pageable, per direction.

Pure function over the rows `minioffload.machine.measure.copy_bandwidth_sweep` returns; no measuring here.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import lane_color


def bandwidth_vs_size(rows: list[dict], link_bytes_per_s: float | None = None, title: str | None = None) -> Figure:
    """GB/s against bytes per copy (log x): a line per (direction, pinned); the link's peak dashed."""
    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    for direction in ("h2d", "d2h"):
        for pinned in (True, False):
            series = sorted((r["bytes"], r["bytes_per_s"]) for r in rows
                            if r["direction"] == direction and r["pinned"] == pinned)
            if not series:
                continue
            sizes, rates = zip(*series, strict=True)
            ax.plot(sizes, [r / 1e9 for r in rates], "-o" if pinned else "--s", ms=4, color=lane_color(direction),
                    alpha=1.0 if pinned else 0.6, label=f"{direction}, {'pinned' if pinned else 'pageable'}")
    ax.set_xscale("log", base=2)
    if link_bytes_per_s:
        ax.axhline(link_bytes_per_s / 1e9, color="gray", ls=":", lw=1)
        ax.annotate("link peak", (0.01, link_bytes_per_s / 1e9), xycoords=("axes fraction", "data"),
                    xytext=(0, 3), textcoords="offset points", fontsize=8, color="dimgray")
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Copy bandwidth against size", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(_size_label))
    fig.tight_layout()
    return fig


def _size_label(value: float, _pos: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value:g} B"
