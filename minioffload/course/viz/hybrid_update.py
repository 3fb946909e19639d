"""Chapter 5's figures of the hybrid update: device memory per phase, link bytes per phase, and the split sweep.

Pure functions: measured numbers in, a matplotlib Figure out.

    memory_by_phase({label: {"seconds", "used", "windows"}}, capacity)   # one panel per run, phases shaded
    link_by_phase({label: {phase: {"d2h": B, "h2d": B}}}, num_params)    # bars of B/param per phase and direction
    split_sweep(cpu_only, strides, fractions, curves, f_star, picked)    # update phase against the device's share

What this is not: the measurement (course.instrument reads the ledger and the trace) nor the model
(predict/hybrid_split.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ...predict.memory import MiB
from .style import lane_color

PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "update": "#C44E52"}
STRIDE_COLOR, STATIC_COLOR = "#4C72B0", "#C44E52"


def _clean(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def memory_by_phase(runs: Mapping[str, Mapping], capacity: float, title: str = "Device memory over one iteration"
                    ) -> Figure:
    """Device memory in use over one iteration, one panel per run; the phases shaded, the capacity dashed.

    A run is {"seconds": array, "used": array (bytes, a step function from the ledger, on the trace's clock),
    "windows": {phase: (start, end)}}, with an "update" window whose end closes the iteration; the level at time 0
    is the last one recorded at or before it."""
    if not runs:
        raise ValueError("memory_by_phase needs at least one run: {label: {'seconds', 'used', 'windows'}}")
    fig, axes = plt.subplots(len(runs), 1, figsize=(7.2, 0.9 + 1.9 * len(runs)), sharey=True, squeeze=False)
    for ax, (label, run) in zip(axes[:, 0], runs.items(), strict=True):
        seconds, used = np.asarray(run["seconds"], float), np.asarray(run["used"], float)
        if "update" not in run["windows"]:
            raise ValueError(f"run {label!r} has no 'update' window; its windows are {sorted(run['windows'])}")
        end = run["windows"]["update"][1]
        if not (seconds <= 0).any():
            raise ValueError(f"run {label!r} has no memory level at or before time 0: record the ledger from the start")
        inside = (seconds > 0) & (seconds <= end)
        times = np.concatenate([[0.0], seconds[inside], [end]])
        levels = np.concatenate([[used[seconds <= 0][-1]], used[inside], [used[seconds <= end][-1]]])
        ax.step(times * 1e3, levels / MiB, where="post", color="#4C72B0", lw=1.6)
        ax.axhline(capacity / MiB, color="0.4", ls="--", lw=1)
        for phase, (start, stop) in run["windows"].items():
            ax.axvspan(start * 1e3, stop * 1e3, color=PHASE_COLORS.get(phase, "0.8"), alpha=0.13, lw=0)
            ax.text((start + stop) / 2 * 1e3, capacity / MiB * 0.97, phase, ha="center", va="top", fontsize=8)
        ax.set_xlim(0, end * 1e3)
        ax.set_ylim(0, capacity / MiB * 1.05)
        ax.set_ylabel("in use (MiB)")
        ax.set_title(label, fontsize=9, loc="left")
        _clean(ax)
    axes[-1, 0].set_xlabel("time since the iteration started (ms); dashed: device capacity")
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def link_by_phase(runs: Mapping[str, Mapping[str, Mapping[str, float]]], num_params: int,
                  title: str = "Link traffic per phase") -> Figure:
    """Bytes over each link direction per phase, divided by `num_params`: one panel per run, two bars per phase."""
    if not runs:
        raise ValueError("link_by_phase needs at least one run: {label: {phase: {'d2h': bytes, 'h2d': bytes}}}")
    if num_params <= 0:
        raise ValueError(f"num_params must be positive (bytes are shown per parameter), got {num_params}")
    fig, axes = plt.subplots(1, len(runs), figsize=(7.2, 2.9), sharey=True, squeeze=False)
    for ax, (label, moved) in zip(axes[0], runs.items(), strict=True):
        phases = list(moved)
        positions = np.arange(len(phases))
        for offset, lane in ((-0.2, "d2h"), (0.2, "h2d")):
            ax.bar(positions + offset, [moved[phase][lane] / num_params for phase in phases], 0.4,
                   color=lane_color(lane), label=f"{lane} ({'to the host' if lane == 'd2h' else 'to the device'})")
        ax.set_xticks(positions, phases)
        ax.set_title(label, fontsize=9, loc="left")
        _clean(ax)
    axes[0, 0].set_ylabel("bytes over the link (B/param)")
    axes[0, -1].legend(fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def split_sweep(cpu_only: Mapping[str, float], strides: Mapping[str, Mapping[str, float]],
                fractions: Mapping[str, Mapping[str, float]], curves: Mapping[str, tuple], f_star: float,
                picked: Sequence[str], title: str = "Update phase against the split") -> Figure:
    """Left: the update phase (ms) against the device's share, measured points and model curves; right: whole
    iterations of the runs named in `picked`.

    A point is {"share", "update", "iteration"} (seconds); strides are drawn as circles labelled with the last word
    of their label, fractions as squares. A curve is (shares, seconds, colour, line style)."""
    points = {"CPU only": cpu_only, **strides, **fractions}
    unknown = [p for p in picked if p not in points]
    if unknown:
        raise ValueError(f"picked {unknown} are not among the measured runs {sorted(points)}")
    ms = 1e3
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(7.6, 3.9), gridspec_kw={"width_ratios": [2.1, 1]})
    for label, (xs, ys, color, style) in curves.items():
        ax.plot(xs, np.asarray(ys, float) * ms, color=color, lw=1.3, ls=style, label=label)
    ax.scatter([p["share"] for p in strides.values()], [p["update"] * ms for p in strides.values()],
               color=STRIDE_COLOR, zorder=3, label="measured, stride k")
    for label, p in strides.items():
        ax.annotate(label.split()[-1], (p["share"], p["update"] * ms), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color=STRIDE_COLOR)
    ax.scatter([p["share"] for p in fractions.values()], [p["update"] * ms for p in fractions.values()], marker="s",
               color=STATIC_COLOR, zorder=3, label="measured, gpu_fraction")
    ax.scatter([cpu_only["share"]], [cpu_only["update"] * ms], color="black", zorder=3, label="measured, CPU only")
    ax.axvline(f_star, color="0.5", ls="--", lw=0.8)
    ax.annotate("model's $f^*$", (f_star, 0), textcoords="offset points", xytext=(3, 3), fontsize=7, color="0.4")
    ax.set_xlabel("share of the parameters updated on the device")
    ax.set_ylabel("update phase (ms, median)")
    ax.set_ylim(0, None)
    ax.set_title(title, fontsize=9, loc="left")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, frameon=False, ncol=3, loc="lower center")
    colors = ["0.3" if p == "CPU only" else STRIDE_COLOR if p in strides else STATIC_COLOR for p in picked]
    bars.bar(range(len(picked)), [points[p]["iteration"] * ms for p in picked], color=colors)
    bars.set_xticks(range(len(picked)), list(picked), fontsize=8, rotation=20)
    bars.set_ylabel("iteration (ms, median)")
    bars.set_title("Whole iteration", fontsize=9, loc="left")
    for a in (ax, bars):
        _clean(a)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig
