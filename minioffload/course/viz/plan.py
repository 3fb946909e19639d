"""Figures of the planner (chapter 9): a plan's bytes per tier against the machine's, the activation policies the
exact program chooses as device memory shrinks, a predicted step beside a measured one, and a grid of what-ifs.

Pure functions: plans, solutions or traces in, a matplotlib Figure out; `widgets.plan_explorer` wraps
`plan_memory`, tests call them directly.

What this is not: the planner (planner/search.py searches, milp.py solves) or a measurement; a figure draws what it is
given, and says so in words when that is nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ...planner.plan import HOMES, Plan
from ...trace import LANE_ORDER, Trace
from ...units import format_bytes
from .style import fallback_color, tier_color
from .timeline import _label_spans, _message_figure, lane_rows

# chapter 7's policies, lightest on the device first (plan.POLICY_ORDER), each with a colour of its own
POLICY_COLORS = {"offload_input": "#2F4B7C", "offload": "#64B5CD", "recompute": "#8172B3", "selective": "#CCB974",
                 "keep": "#55A868"}
_SCALES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))


def _scale(largest: float) -> tuple[str, float]:
    return next(((unit, size) for unit, size in _SCALES if largest >= size), _SCALES[-1])


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 10 else f"{t * 1e3:.3g} ms"


def plan_memory(plans: Sequence[Plan], capacity: dict | None = None, short: dict | None = None,
                title: str | None = None, labels: Sequence[str] | None = None) -> Figure:
    """One panel per tier (device, host, nvme): a bar per plan of the bytes it needs there, and the tier's capacity
    dashed (None: unbounded). With no plans, `short` (NoPlanError.short) draws what the closest configuration lacks
    on top of each capacity, hatched. `capacity` defaults to the first plan's; `labels` to "#1", "#2", ..."""
    plans = list(plans)
    if not plans and short is None:
        raise ValueError("plan_memory needs at least one Plan, or short= (NoPlanError.short) with capacity= to "
                         "draw what is missing")
    capacity = dict(capacity if capacity is not None else plans[0].capacity if plans else {})
    unknown = {*capacity, *(short or {})} - set(HOMES)
    if unknown:
        raise ValueError(f"plan_memory: unknown tier(s) {sorted(unknown)}; the tiers are {', '.join(HOMES)}")
    if not plans and not capacity:
        raise ValueError("plan_memory: with no plans, give capacity= (bytes per tier) beside short=")
    labels = list(labels) if labels is not None else [f"#{i}" for i in range(1, len(plans) + 1)]
    if len(labels) != len(plans):
        raise ValueError(f"plan_memory: {len(labels)} labels for {len(plans)} plans")
    fig, axes = plt.subplots(1, len(HOMES), figsize=(7.2, 3.0))
    for ax, tier in zip(axes, HOMES, strict=True):
        cap = capacity.get(tier)
        needs = [float(p.memory.get(tier, 0)) for p in plans]
        lacking = max(0.0, float((short or {}).get(tier, 0.0))) if not plans else 0.0
        unit, size = _scale(max([*needs, cap or 0.0, (cap or 0.0) + lacking, 1.0]))
        color = tier_color(tier)
        if plans:
            over = [cap is not None and n > cap for n in needs]
            ax.bar(range(len(plans)), [n / size for n in needs], color=color, edgecolor=["#C44E52" if o else "white"
                                                                                         for o in over])
            ax.set_xticks(range(len(plans)), labels, fontsize=8)
        else:
            base = (cap or 0.0) / size
            ax.bar([0], [base], color=color, alpha=0.35, label="capacity")
            if lacking:
                ax.bar([0], [lacking / size], bottom=[base], color="none", edgecolor="#C44E52", hatch="///",
                       label="missing")
                ax.text(0, base + lacking / size, f"+{format_bytes(lacking)}", ha="center", va="bottom", fontsize=8,
                        color="#C44E52")
            ax.set_xticks([0], ["closest"], fontsize=8)
        if cap is not None:
            ax.axhline(cap / size, color="black", ls="--", lw=1)
        cap_text = "unbounded" if cap is None else format_bytes(cap)
        ax.set_title(f"{tier}: {cap_text}", fontsize=9, loc="left")
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        top = max([n / size for n in needs] + [(cap or 0.0) / size + lacking / size])
        if top > 0:
            ax.set_ylim(0, top * 1.18)
        else:  # nothing needed and no capacity: say so rather than draw an axis of zeros
            ax.set_ylim(0, 1)
            ax.set_yticks([])
            ax.text(0.5, 0.5, "none", ha="center", va="center", fontsize=9, color="dimgray", transform=ax.transAxes)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    if title is None:
        title = (f"{len(plans)} plan(s): bytes per tier against capacity (dashed)" if plans else
                 "nothing fits: what the closest configuration lacks (hatched)")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def policy_mix(budgets: Sequence[float], solutions: Sequence, policies: Sequence[str] = tuple(POLICY_COLORS),
               title: str = "Activation policies the MILP chooses as device memory shrinks") -> Figure:
    """Stacked bars of blocks per policy, one bar per device budget (bytes, in the order given), from plan_milp
    `Solution`s (`counts`, `resident`; None: nothing fits, marked). Subgroups updated on the device (the hybrid
    split), when any, on a second axis."""
    budgets, solutions = list(budgets), list(solutions)
    if not budgets or len(budgets) != len(solutions):
        raise ValueError(f"policy_mix needs one solution (or None) per budget, got {len(budgets)} budgets and "
                         f"{len(solutions)} solutions")
    named = {name for s in solutions if s is not None for name in s.counts}
    unknown = named - set(policies)
    if unknown:
        raise ValueError(f"policy_mix: solutions use {sorted(unknown)}, not among policies {list(policies)}")
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    x = np.arange(len(budgets))
    bottom = np.zeros(len(budgets))
    for name in policies:
        counts = np.array([s.counts.get(name, 0) if s is not None else 0 for s in solutions], dtype=float)
        if counts.any():
            ax.bar(x, counts, bottom=bottom, color=POLICY_COLORS.get(name) or fallback_color(name),
                   edgecolor="white", label=name)
            bottom += counts
    blocks = max(bottom.max(), 1.0)
    for i, s in enumerate(solutions):
        if s is None:
            ax.text(i, blocks / 2, "no fit", ha="center", va="center", rotation=90, fontsize=8, color="#C44E52")
    unit, size = _scale(max(budgets))
    ax.set_xticks(x, [f"{b / size:.3g}" for b in budgets], fontsize=8)
    ax.set_xlabel(f"device memory left for activations and resident state ({unit})")
    ax.set_ylabel("blocks")
    ax.set_ylim(0, blocks * 1.05)
    resident = [s.resident if s is not None else None for s in solutions]
    handles, names = ax.get_legend_handles_labels()
    if any(r for r in resident if r):
        twin = ax.twinx()
        line = twin.plot([i for i, r in enumerate(resident) if r is not None], [r for r in resident if r is not None],
                         "o-", color="#C44E52", lw=1.2, ms=4)
        twin.set_ylabel("subgroups updated on the device", fontsize=8, color="#C44E52")
        twin.set_ylim(0, max(r for r in resident if r is not None) * 1.3 + 1)
        handles, names = handles + line, names + ["subgroups on\nthe device"]
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(handles, names, fontsize=8, frameon=False, loc="upper left",
              bbox_to_anchor=(1.1 if len(handles) > len(ax.get_legend_handles_labels()[0]) else 1.0, 1))
    fig.tight_layout()
    return fig


def timeline_pair(predicted: Trace, measured: Trace, lanes: Sequence[str] | None = None,
                  title: str = "One step: predicted above, measured below") -> Figure:
    """Two Gantt charts on one time axis (ms from each trace's first span): the step model's trace above, a measured
    step's below, the same lanes in the same order (default: every lane either has, in trace order)."""
    for name, trace in (("predicted", predicted), ("measured", measured)):
        if not isinstance(trace, Trace):
            raise TypeError(f"timeline_pair: {name} must be a Trace, got {type(trace).__name__}")
    if not predicted.spans or not measured.spans:
        return _message_figure("no spans in the " + ("predicted" if not predicted.spans else "measured") + " trace",
                               title)
    seen = {*predicted.lanes(), *measured.lanes()}
    rows = list(lanes) if lanes is not None else [lane for lane in LANE_ORDER if lane in seen] + sorted(
        seen - set(LANE_ORDER))
    if not rows:
        return _message_figure("no lanes selected", title)
    height = min(6.0, 1.6 + 0.55 * len(rows))
    fig, axes = plt.subplots(2, 1, figsize=(7.2, height), sharex=True)
    ends, shifted_traces = [], []
    for ax, (name, trace) in zip(axes, (("predicted", predicted), ("measured", measured)), strict=True):
        first = min(s.start for s in trace.spans)
        ends.append(max(s.end for s in trace.spans) - first)
        shifted = Trace(origin=0.0)
        for s in trace.spans:
            shifted.record(s.lane, s.name, s.start - first, s.end - first, s.nbytes)
        lane_rows(ax, shifted, rows, linewidth=0.5)
        ax.set_title(f"{name}: {_seconds(ends[-1])}", fontsize=9, loc="left")
        shifted_traces.append(shifted)  # labelled once the shared x range is known
    x1 = max(ends) * 1e3 * 1.01 or 1.0
    for ax, shifted in zip(axes, shifted_traces, strict=True):
        ax.set_xlim(0, x1)
        _label_spans(ax, shifted, rows, 0.0, x1, axis_width_in=fig.get_figwidth() * 0.82)
    if x1 > 10_000:  # a step of more than ten seconds: label the axis in seconds
        axes[-1].xaxis.set_major_formatter(lambda value, _pos: f"{value / 1e3:.4g}")
    axes[-1].set_xlabel("time in the step (" + ("s" if x1 > 10_000 else "ms") + ")")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def what_if_grid(rows: Sequence[dict], title: str = "Best plan per model and machine (tokens/s)") -> Figure:
    """A table of models x machines: each cell the best plan's tokens/s and the resource that bounds it, or what
    is missing when nothing fits. A row is {"model", "hardware", "tokens_per_s" (None: nothing fits), "bound",
    "missing" (text, when nothing fits; one line per ", " part)}; cells are shaded by log tokens/s, red where nothing
    fits."""
    rows = list(rows)
    if not rows:
        raise ValueError("what_if_grid needs at least one row of {'model', 'hardware', 'tokens_per_s', ...}")
    for row in rows:
        missing = {"model", "hardware", "tokens_per_s"} - row.keys()
        if missing:
            raise ValueError(f"what_if_grid: row {row!r} lacks {sorted(missing)}")
    models = list(dict.fromkeys(r["model"] for r in rows))
    machines = list(dict.fromkeys(r["hardware"] for r in rows))
    rates = [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
    lo, hi = (np.log10(min(rates)), np.log10(max(rates))) if rates else (0.0, 1.0)
    cmap = plt.get_cmap("Greens")
    fig, ax = plt.subplots(figsize=(7.2, 0.5 * len(models) + 1.6))
    for r in rows:
        col, row = machines.index(r["hardware"]), models.index(r["model"])
        rate = r["tokens_per_s"]
        if rate:
            level = 0.2 + 0.6 * ((np.log10(rate) - lo) / (hi - lo) if hi > lo else 1.0)
            color, text = cmap(level), f"{rate:,.0f}\n{r.get('bound', '')}"
        else:
            color, text = "#F2C4C4", "no fit\n" + str(r.get("missing", "")).replace(", ", "\n")
        ax.add_patch(plt.Rectangle((col, row), 1, 1, color=color, ec="white"))
        ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", fontsize=6.5,
                color="white" if rate and level > 0.6 else "black")
    ax.set_xlim(0, len(machines))
    ax.set_ylim(len(models), 0)
    ax.set_xticks(np.arange(len(machines)) + 0.5, machines, fontsize=8, rotation=20, ha="right")
    ax.set_yticks(np.arange(len(models)) + 0.5, models, fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig
