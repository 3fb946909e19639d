"""Chapter 4's figures of the offloaded step: where its time goes (phase bars), when an overlap pays (speedups).

Pure functions: numbers in, a matplotlib Figure out.
    phase_bars      `split` maps a run's label to {phase: seconds}; one bar per run, one segment per phase in the
                    order given (a phase a run lacks draws as zero)
    speedup_curves  one line per way of running the step: its speedup over the synchronous step (the step model's
                    prediction), against the ratio of forward + backward to the CPU update

What this is not: a timeline (viz.timeline draws spans), a measurement (the notebook times the phases) nor the step
model (the notebook calls stepmodel.predict and passes the ratios in).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import fallback_color

CURVE_STYLES = (("#C44E52", "-"), ("#4C72B0", "--"), ("#8C8C8C", ":"), ("#55A868", "-."))  # colour, line, in order
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "cpu Adam": "#C44E52", "exposed copies": "#DD8452",
                "other": "#BBBBBB", "torch AdamW": "#8172B3"}


def phase_bars(split: Mapping[str, Mapping[str, float]], phases: Sequence[str], title: str) -> Figure:
    """Stacked horizontal bars: one row per run (top to bottom in `split`'s order), one segment per phase, in ms."""
    if not split:
        raise ValueError("phase_bars needs at least one run: {label: {phase: seconds}}")
    if not phases:
        raise ValueError("phase_bars needs at least one phase to draw, e.g. ('forward', 'backward')")
    labels = list(split)
    fig, ax = plt.subplots(figsize=(7.2, 0.6 * len(labels) + 1.6))
    left = [0.0] * len(labels)
    for phase in phases:
        widths = [split[label].get(phase, 0.0) * 1e3 for label in labels]
        ax.barh(labels, widths, left=left, color=PHASE_COLORS.get(phase) or fallback_color(phase), label=phase,
                height=0.6)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("median time per step (ms)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, ncol=len(phases), loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def speedup_curves(ratios: Sequence[float], speedups: Mapping[str, Sequence[float]], title: str,
                   xlabel: str = "forward + backward / CPU update") -> Figure:
    """Speedup over the synchronous step (y) against `ratios` (x, log scale, e.g. compute time over update time), one
    line per entry of `speedups` (label -> one value per ratio); a gray line marks 1 (no gain) and one marks x = 1."""
    ratios = list(ratios)
    if not ratios or not speedups:
        raise ValueError("speedup_curves needs ratios and at least one curve: {label: [speedup per ratio]}")
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"speedup_curves: every ratio must be a positive number (log x axis), got {ratios}")
    for label, values in speedups.items():
        if len(values) != len(ratios):
            raise ValueError(f"speedup_curves: {label!r} has {len(values)} values for {len(ratios)} ratios; "
                             "give one speedup per ratio")
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    ax.axhline(1.0, color="#BBBBBB", linewidth=0.8)
    ax.axvline(1.0, color="#BBBBBB", linewidth=0.8, linestyle=":")
    for index, (label, values) in enumerate(speedups.items()):
        color, line = CURVE_STYLES[index % len(CURVE_STYLES)]
        ax.plot(ratios, list(values), linestyle=line, marker="o", markersize=3, color=color, label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over synchronous")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
