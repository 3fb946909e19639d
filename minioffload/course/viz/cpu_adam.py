"""Figures of chapter 3 (CPU Adam at memory speed): useful and wasted bandwidth per version, thread scaling.

Pure functions: measured numbers in, a matplotlib Figure out (no timing, no display, no globals). Rates are
bytes per second; "useful" bytes are the 28 B/param every fp32 Adam must move (`profiles.ADAM_BYTES_PER_PARAM`).

What this is not: the measurement (the chapter and `bench/adam.py` time the versions) or the roofline kernel
(`hardware.adam_roofline`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from minioffload.machine.profiles import ADAM_BYTES_PER_PARAM

USEFUL_COLOR = "tab:blue"


def adam_bandwidth_bars(seconds: dict[str, float], bytes_moved: dict[str, int], num_params: int,
                        roofline: float, threads: int | None = None) -> Figure:
    """One bar per version: the useful rate (28 B/param over its time) and, stacked lighter, its extra bytes.

    seconds: version -> seconds per step; bytes_moved: version -> bytes per parameter it moves (a version not
    listed moves the useful 28); roofline: bytes/s of the 7-stream kernel, drawn as a dashed line.
    """
    if not seconds:
        raise ValueError("adam_bandwidth_bars needs at least one version's seconds")
    if roofline <= 0 or any(s <= 0 for s in seconds.values()):
        raise ValueError(f"seconds and the roofline must be positive, got {seconds} and {roofline}")
    names = list(seconds)
    useful = np.array([ADAM_BYTES_PER_PARAM * num_params / seconds[n] / 1e9 for n in names])
    extra = np.array([(bytes_moved.get(n, ADAM_BYTES_PER_PARAM) - ADAM_BYTES_PER_PARAM) * num_params / seconds[n] / 1e9
                      for n in names])
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    ax.bar(names, useful, color=USEFUL_COLOR, label=f"the {ADAM_BYTES_PER_PARAM} B/param every Adam moves")
    ax.bar(names, extra, bottom=useful, color=USEFUL_COLOR, alpha=0.35, label="extra passes (NumPy versions)")
    ax.axhline(roofline / 1e9, color="black", linestyle="--", label="roofline: 7 streams, no arithmetic")
    ax.set_ylabel("GB/s")
    on = f", {threads} threads" if threads else ""
    ax.set_title(f"One AdamW step on {num_params / 1e6:.0f}M fp32 parameters{on}")
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylim(0, 1.45 * max(roofline / 1e9, float((useful + extra).max())))
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def thread_scaling(scaling: dict[int, tuple[float, float]], num_params: int) -> Figure:
    """The fused pass's and the roofline's bandwidth against the thread count.

    scaling: threads -> (fused pass bytes/s at 28 B/param, roofline bytes/s).
    """
    if not scaling:
        raise ValueError("thread_scaling needs at least one thread count")
    counts = sorted(scaling)
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    ax.plot(counts, [scaling[t][1] / 1e9 for t in counts], "k--o", label="roofline (7 streams)")
    ax.plot(counts, [scaling[t][0] / 1e9 for t in counts], "-o", color=USEFUL_COLOR, label="adam_fused")
    ax.set_xticks(counts)
    ax.set_xlabel("threads")
    ax.set_ylabel(f"GB/s at {ADAM_BYTES_PER_PARAM} B/param")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Thread scaling, {num_params / 1e6:.0f}M parameters")
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig
