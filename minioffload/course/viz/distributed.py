"""Figures of sharded runs (chapter 10): every rank's timeline, who owns which subgroup, each rank's link bytes, and
the step model's scaling over rank counts.

    traces = [load_trace(out / "trace.json"), load_trace(out / "trace_rank1.json")]   # train --shard's traces
    fig = rank_timelines(traces, step=-2)      # one panel per rank; the "net" lane holds the reduces and broadcasts
    fig = shard_map(sizes, owners)             # elements per rank, one segment per subgroup
    fig = link_bytes({"1 rank": [871424], "2 ranks": [471552, 399872]})
    fig = scaling_lines({"8xh100-sxm": scaling.scaling(work, hw)})

Pure functions: data in, a matplotlib Figure out (plus `load_trace` and `one_step`, which read and cut the traces the
figures draw). `trace.Trace` writes Chrome JSON and has no reader; `load_trace` is that reader.

What this is not: a trace viewer (open each rank's file in ui.perfetto.dev), nor a clock: each rank's trace counts
from its own origin, so `one_step` lines the ranks up at the start of the same step. The collectives make every rank
wait for the others, so a step starts at nearly the same moment on each; the offset left is what the figure shows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from ...trace import LANE_ORDER, Trace
from ...units import format_bytes
from .style import fallback_color
from .timeline import _label_spans, _message_figure, lane_rows

NET = "net"  # the lane of the collectives (engine/sharding.py records reduces and broadcasts there)
SUBGROUP_COLORS = ("#4C72B0", "#9DB4D8")  # a rank's subgroups alternate between them


def load_trace(path: str | Path) -> Trace:
    """A `Trace` from the Chrome JSON `Trace.save` writes (each "X" event is a span; `cat` is its lane)."""
    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{path} is not a trace written by Trace.save (no 'traceEvents')")
    trace = Trace(origin=0.0)
    for event in data["traceEvents"]:
        if event.get("ph") != "X":
            continue
        start = event["ts"] / 1e6
        trace.record(event["cat"], event["name"], start, start + event["dur"] / 1e6,
                     event.get("args", {}).get("bytes", 0))
    return trace


def step_starts(trace: Trace, micro_batches: int = 1) -> list[float]:
    """When each step began: the start of its first forward (one "forward" span per micro-batch on "compute")."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    forwards = sorted(s.start for s in trace.on("compute") if s.name == "forward")
    return forwards[::micro_batches]


def one_step(trace: Trace, step: int = -2, micro_batches: int = 1) -> Trace:
    """The spans of step `step` (an index into `step_starts`: -2 is the one before the last, which does not evaluate),
    cut at its ends and shifted so that the step starts at 0. It ends where the next step starts (the last step: at
    the trace's last span)."""
    starts = step_starts(trace, micro_batches)
    if not starts:
        raise ValueError("the trace has no 'forward' span on 'compute': is it a training run's trace?")
    if not -len(starts) <= step < len(starts):
        raise ValueError(f"step {step} is out of range: the trace has {len(starts)} steps")
    index = step % len(starts)
    start = starts[index]
    end = starts[index + 1] if index + 1 < len(starts) else max(s.end for s in trace.spans)
    cut = Trace(origin=0.0)
    for s in trace.spans:
        if (s.end > start and s.start < end) or s.start == s.end == start:
            cut.record(s.lane, s.name, max(s.start, start) - start, min(s.end, end) - start, s.nbytes)
    return cut


def _lanes(traces: Sequence[Trace]) -> list[str]:
    seen = {lane for trace in traces for lane in trace.lanes()}
    ordered = [lane for lane in LANE_ORDER if lane in seen]
    return ordered + sorted(seen - set(ordered) - {NET}) + ([NET] if NET in seen else [])


def rank_timelines(traces: Sequence[Trace], step: int = -2, micro_batches: int = 1,
                   lanes: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """One panel per rank (rank 0 on top), one row per lane, the same lanes in every panel; each rank's step `step`
    (see `one_step`) from its own start. The "net" lane, last, shows the collectives: a reduce of a subgroup's
    gradients to its owner, a broadcast of its new weights from it. A collective's span lasts until this rank's part
    of it is done, so it includes the time spent waiting for the other ranks to arrive."""
    title = title or f"{len(traces)} ranks, one step each"
    if not traces:
        return _message_figure("no ranks", title)
    steps = [one_step(trace, step, micro_batches) for trace in traces]
    rows = _lanes(steps) if lanes is None else list(lanes)
    if not rows:
        return _message_figure("no lanes selected", title)
    end = max((s.end for trace in steps for s in trace.spans), default=0.0) * 1e3 or 1.0
    height = min(9.0, 0.9 + len(steps) * (0.45 + 0.3 * len(rows)))
    fig, axes = plt.subplots(len(steps), 1, figsize=(7.2, height), sharex=True, squeeze=False)
    for rank, (ax, trace) in enumerate(zip(axes[:, 0], steps, strict=True)):
        lane_rows(ax, trace, rows)
        ax.set_xlim(0, end * 1.01)
        _label_spans(ax, trace, rows, 0, end * 1.01, axis_width_in=fig.get_figwidth() * 0.82)
        net = trace.on(NET)
        ax.set_title(f"rank {rank}", fontsize=9, loc="left")
        ax.set_title(f"step {trace.makespan() * 1e3:.3g} ms; {NET}: {len(net)} collectives, "
                     f"{format_bytes(sum(s.nbytes for s in net))}", fontsize=8, loc="right", color="dimgray")
    axes[-1, 0].set_xlabel("time from the step's start on each rank (ms)")
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def shard_map(sizes: Sequence[int], owners: Sequence[int], ranks: int | None = None,
              title: str | None = None) -> Figure:
    """One horizontal bar per rank: the elements it owns, one segment per subgroup (labelled with its index when it is
    wide enough), and its share of the whole. `ranks` defaults to the highest owner + 1 (a rank that owns nothing
    shows an empty bar)."""
    title = title or "Who owns which subgroup"
    if len(sizes) != len(owners):
        raise ValueError(f"sizes and owners must have one entry per subgroup, got {len(sizes)} and {len(owners)}")
    if any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in owners):
        raise ValueError(f"owners must be ranks (ints >= 0), got {list(owners)!r}")
    if any(not n >= 0 for n in sizes):
        raise ValueError(f"sizes must be element counts >= 0, got {list(sizes)!r}")
    ranks = (max(owners) + 1 if owners else 0) if ranks is None else ranks
    if owners and max(owners) >= ranks:
        raise ValueError(f"owner {max(owners)} is not a rank of {ranks}")
    if not ranks or not sum(sizes):
        return _message_figure("no subgroups", title)
    total = sum(sizes)
    held, count = [0] * ranks, [0] * ranks
    fig, ax = plt.subplots(figsize=(7.2, min(4.5, 1.2 + 0.42 * ranks)))
    for index, (size, rank) in enumerate(zip(sizes, owners, strict=True)):
        shade = count[rank] % 2  # neighbours on one bar differ
        ax.barh(rank, size, left=held[rank], height=0.7, color=SUBGROUP_COLORS[shade], edgecolor="white",
                linewidth=0.6)
        if size / total > 0.04 * ranks:
            ax.text(held[rank] + size / 2, rank, str(index), ha="center", va="center", fontsize=7,
                    color="white" if shade == 0 else "black")
        held[rank] += size
        count[rank] += 1
    for rank, elements in enumerate(held):
        ax.text(elements, rank, f"  {elements:,} ({elements / total:.0%})", va="center", fontsize=8)
    ax.set_xlim(0, max(held) * 1.3)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=9)
    ax.tick_params(axis="y", length=0)
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel("elements of optimizer state owned (each segment one subgroup)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_title(f"{len(sizes)} subgroups, fair share {total / ranks:,.0f}", fontsize=8, loc="right", color="dimgray")
    fig.tight_layout()
    return fig


def link_bytes(runs: Mapping[str, Sequence[float]], title: str | None = None) -> Figure:
    """Bytes over each rank's own host link per step (D2H + H2D), one group of bars per run, one bar per rank."""
    title = title or "Bytes over each rank's link per step"
    if not runs or not any(runs.values()):
        return _message_figure("no runs", title)
    if any(not b >= 0 for values in runs.values() for b in values):
        raise ValueError("link bytes must be >= 0")
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    x, ticks, labels = 0.0, [], []
    for run, values in runs.items():
        for rank, value in enumerate(values):
            bar = ax.bar(x, value / 1e3, width=0.8, color=fallback_color(f"rank {rank}") if rank else "#4C72B0")
            ax.bar_label(bar, [format_bytes(value)], fontsize=7, padding=2)
            ticks.append(x)
            labels.append(f"{run}\nrank {rank}" if len(values) > 1 else run)
            x += 1.0
        x += 0.6
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("kB per step")
    ax.set_ylim(0, max(v for values in runs.values() for v in values) / 1e3 * 1.2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def scaling_lines(rows_by_machine: Mapping[str, Sequence[Mapping]], title: str | None = None) -> Figure:
    """Tokens/s per GPU against the number of ranks, one line per machine (rows as `scaling.scaling` returns them);
    the legend names the resource that bounds the step, in order of ranks ("cpu then compute")."""
    title = title or "Predicted tokens/s per GPU"
    if not rows_by_machine or not any(rows_by_machine.values()):
        return _message_figure("no predictions", title)
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    for machine, rows in rows_by_machine.items():
        ranks = [r["ranks"] for r in rows]
        per_gpu = [r["tokens_per_s_per_gpu"] for r in rows]
        bounds = [r["bound"] for r in rows]
        changes = [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]]
        ax.plot(ranks, per_gpu, marker="o", color=fallback_color(machine),
                label=f"{machine} (bound: {' then '.join(changes)})")
    every = sorted({r["ranks"] for rows in rows_by_machine.values() for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(every, [str(n) for n in every])
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(0, max(r["tokens_per_s_per_gpu"] for rows in rows_by_machine.values() for r in rows) * 1.2)
    ax.grid(color="0.9", lw=0.8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig
