"""Memory over time: bytes in use on each tier of a `Ledger`, from its history of allocations and frees.

Pure functions: a ledger in, a matplotlib Figure out (plus `usage_series`, the numbers behind it).
Times are relative to the ledger's first event.

What this is not: the real allocator's view. A ledger counts what the runtime says it holds; the
chapters compare it with torch.cuda.memory_allocated where a GPU exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ...predict.memory import Ledger
from ...units import format_bytes
from .style import tier_color

_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def usage_series(ledger: Ledger, tier: str) -> tuple[np.ndarray, np.ndarray]:
    """Bytes in use on `tier` after each of its events: (seconds since the ledger's first event,
    bytes). Starts with (0, 0), so a step plot of it begins at zero."""
    ledger.capacity(tier)  # refuses an unknown tier, with the ledger's own message
    history = ledger.history
    origin = history[0].time if history else 0.0
    events = [e for e in history if e.tier == tier]
    times = np.array([0.0] + [e.time - origin for e in events])
    used = np.array([0] + [e.used for e in events], dtype=np.int64)
    return times, used


def memory_over_time(ledger: Ledger, tiers: Sequence[str] | None = None,
                     capacity_lines: bool = True) -> Figure:
    """A step line per tier of bytes in use against time (ms), with each finite capacity dashed.

    The y unit (GiB, MiB, ...) is the largest one in which the tallest line or capacity is >= 1.
    """
    tiers = ledger.tiers if tiers is None else list(tiers)
    history = ledger.history
    if not history:
        fig, ax = plt.subplots(figsize=(7.2, 2.5))
        ax.text(0.5, 0.5, "no allocations", ha="center", va="center", fontsize=11, color="dimgray",
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    # lines run a little past the last event, so a change there is seen to last
    end_ms = ((history[-1].time - history[0].time) * 1e3 or 1.0) * 1.05
    series = {tier: usage_series(ledger, tier) for tier in tiers}
    capacities = {tier: ledger.capacity(tier) for tier in tiers} if capacity_lines else {}
    tallest = max([int(used.max()) for _, used in series.values()] +
                  [c for c in capacities.values() if c is not None], default=0)
    unit, scale = next(((u, s) for u, s in _UNITS if tallest >= s), _UNITS[-1])

    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    for tier, (times, used) in series.items():
        color = tier_color(tier)
        ax.step(np.append(times * 1e3, end_ms), np.append(used, used[-1]) / scale, where="post",
                color=color, lw=1.8, label=f"{tier} (peak {format_bytes(ledger.peak(tier))})")
        capacity = capacities.get(tier)
        if capacity is not None:
            ax.axhline(capacity / scale, color=color, ls="--", lw=1,
                       label=f"{tier} capacity {format_bytes(capacity)}")
    ax.set_xlim(0, end_ms)
    ax.set_ylim(0, None)
    ax.set_xlabel("time since the first allocation (ms)")
    ax.set_ylabel(f"in use ({unit})")
    ax.grid(axis="y", color="0.9", lw=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title("Memory in use per tier", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig
