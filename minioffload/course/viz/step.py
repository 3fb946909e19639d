"""Figures of the step model: predicted beside measured step times, one pair of bars per configuration.

Pure function: rows in, a matplotlib Figure out. A row is {"name", "predicted_s", "measured_s"} (the keys
`stepmodel.compare` returns, plus a name); the ratio predicted / measured is written above each pair.

What this is not: the model (predict/stepmodel.py) or a timeline (viz.timeline draws `Prediction.trace`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure


def predicted_vs_measured(rows: list[dict], title: str = "Step time: predicted vs measured") -> Figure:
    if not rows:
        raise ValueError("predicted_vs_measured needs at least one row of {'name', 'predicted_s', 'measured_s'}")
    for row in rows:
        missing = {"name", "predicted_s", "measured_s"} - row.keys()
        if missing:
            raise ValueError(f"row {row.get('name', row)!r} lacks {sorted(missing)}")
    x = np.arange(len(rows))
    predicted = [row["predicted_s"] * 1e3 for row in rows]
    measured = [row["measured_s"] * 1e3 for row in rows]
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    ax.bar(x - 0.2, predicted, 0.4, label="predicted", color="#8172B3")
    ax.bar(x + 0.2, measured, 0.4, label="measured", color="#55A868")
    top = max(predicted + measured)
    for i, (p, m) in enumerate(zip(predicted, measured, strict=True)):
        ax.text(i, max(p, m) + 0.02 * top, f"{p / m:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [row["name"] for row in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, top * 1.15)
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
