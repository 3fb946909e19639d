"""Chapter 4's figure of one offloaded step: where its time goes, phase by phase, as stacked bars.

Pure function: medians in, a matplotlib Figure out. `split` maps a run's label to {phase: seconds}; one bar per
run, one segment per phase in the order given (a phase a run lacks draws as zero).

What this is not: a timeline (viz.timeline draws spans) nor a measurement (the notebook times the phases).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import fallback_color

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
