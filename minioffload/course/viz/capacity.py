"""Chapter 12's figures: where a plan's bytes live as host memory grows, and how busy a step keeps its drive.

Pure functions: numbers in, a matplotlib Figure out.

    bytes_by_tier(rows, capacity={"device": B, "nvme": B})  # rows: {"label", "device", "host", "nvme"} in bytes
    drive_use(trace, rate, marks={"update": t})             # the drive's MB/s over a step, against its rate

What this is not: the planner (planner/search.py) or the trace's own timeline (viz/timeline.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ...trace import Trace
from .style import TIER_COLORS, lane_color
from .timeline import binned_bandwidth

TIERS = ("device", "host", "nvme")


def bytes_by_tier(rows: Sequence[Mapping], capacity: Mapping[str, float] | None = None,
                  title: str = "Where the bytes live") -> Figure:
    """One group of bars per row (a plan), one bar per tier, in GB on a log axis; each row's host capacity (its
    "host_capacity", if given) and `capacity`'s other tiers drawn as ticks over their bars."""
    if not rows:
        raise ValueError("bytes_by_tier needs at least one row: {'label': ..., 'device': B, 'host': B, 'nvme': B}")
    missing = [tier for row in rows for tier in TIERS if tier not in row]
    if missing:
        raise ValueError(f"every row needs bytes for {', '.join(TIERS)}; missing {sorted(set(missing))}")
    capacity = capacity or {}
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    x, width = np.arange(len(rows)), 0.26
    for offset, tier in zip((-width, 0.0, width), TIERS, strict=True):
        values = [max(row[tier], 1.0) / 1e9 for row in rows]
        ax.bar(x + offset, values, width, color=TIER_COLORS[tier], label=tier)
        for index, row in enumerate(rows):
            limit = row.get(f"{tier}_capacity", capacity.get(tier))
            if limit:
                ax.hlines(limit / 1e9, x[index] + offset - width / 2, x[index] + offset + width / 2, color="black",
                          linewidth=1.5)
    ax.set_yscale("log")
    ax.set_xticks(x, [row["label"] for row in rows])
    ax.set_ylabel("GB (log scale)")
    ax.set_title(title + " (black ticks: capacity)")
    ax.legend(fontsize=8, ncols=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def drive_use(trace: Trace, rate: float, marks: Mapping[str, float] | None = None, bins: int = 70,
              title: str = "The drive over one step") -> Figure:
    """The drive's reads and writes in MB/s over the trace (stacked, binned as `binned_bandwidth`: a request's bytes
    spread over its span), its rate `rate` (bytes/s, reads and writes together) dashed, and `marks` (name: seconds)
    as vertical lines."""
    lanes = [lane for lane in ("nvme_read", "nvme_write") if trace.on(lane)]
    if not lanes:
        raise ValueError("drive_use needs a trace with nvme_read or nvme_write spans (a Swapper's trace)")
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    below = None
    for lane in lanes:  # the lanes of one trace share their bins, so they stack
        edges, lane_rate = binned_bandwidth(trace, bins, lane)
        top = lane_rate / 1e6 if below is None else below + lane_rate / 1e6
        ax.stairs(top, edges * 1e3, baseline=below if below is not None else 0, fill=True, color=lane_color(lane),
                  alpha=0.8, label=lane.replace("nvme_", "") + "s")
        below = top
    ax.axhline(rate / 1e6, color="black", linestyle="--", linewidth=1, label=f"the drive's rate ({rate / 1e6:g} MB/s)")
    for name, at in (marks or {}).items():
        ax.axvline(at * 1e3, color="dimgray", linewidth=1)
        ax.annotate(name, (at * 1e3, rate / 1e6 * 1.12), fontsize=8, color="dimgray", xytext=(3, 0),
                    textcoords="offset points")
    ax.set_ylim(0, rate / 1e6 * 1.25)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("MB/s")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    fig.tight_layout()
    return fig
