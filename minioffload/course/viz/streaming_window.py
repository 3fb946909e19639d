"""Figure of chapter 8 (streaming): the streamed weights on the device over one step, one line per prefetch depth,
against each depth's budget, the window of k + 1 blocks that depth k holds.

Pure functions: `held_series` turns ledger events into the numbers, `window_memory` draws them.
What this is not: the streamer (`minioffload.model.streaming`) nor its budget check (`streaming.plan`); the chapter runs
those and hands the ledger's history here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

MiB = 2**20
DEPTH_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


def held_series(history: Sequence, since: int = 0, prefix: str = "streamed block") -> tuple[list[float], list[int]]:
    """Bytes held by the allocations whose name starts with `prefix`, after each of their events from index `since`
    of `history` on: (ms since `history[since]`, bytes). Events before `since` count towards what is held but are
    not drawn (the step starts with what the previous one left). Events need `.name`, `.delta` and `.time`."""
    if not 0 <= since < len(history):
        raise ValueError(f"since={since} is outside the history's {len(history)} events; pass the index where the "
                         "step starts")
    held, times, used = 0, [], []
    for n, e in enumerate(history):
        if e.name.startswith(prefix):
            held += e.delta
            if n >= since:
                times.append((e.time - history[since].time) * 1e3)
                used.append(held)
    return times, used


def window_memory(series: Mapping[int, tuple[Sequence[float], Sequence[float]]], budgets: Mapping[int, float],
                  title: str = "One block, two, three: the window each depth holds") -> Figure:
    """A step line per prefetch depth of the streamed weights on the device (MiB) against time in the step (ms),
    each depth's budget dotted in its colour. `series` maps a depth to (times_ms, bytes), e.g. from
    `held_series`; `budgets` a depth to its budget in bytes."""
    missing = set(series) - set(budgets)
    if not series or missing:
        raise ValueError(f"window_memory needs a series and a budget per depth; no budget for {sorted(missing)}")
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    for i, (depth, (times, held)) in enumerate(sorted(series.items())):
        color = DEPTH_COLORS[i % len(DEPTH_COLORS)]
        ax.step(list(times), [b / MiB for b in held], where="post", color=color, lw=1.5,
                label=f"depth {depth} (budget {budgets[depth] / MiB:.0f} MiB)")
        ax.axhline(budgets[depth] / MiB, color=color, lw=0.8, ls=":")
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("streamed weights on the device (MiB)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="y", color="0.9")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
