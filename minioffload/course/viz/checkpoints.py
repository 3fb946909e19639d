"""Figures of chapter 11: a checkpoint written under the next step, how long each kind of checkpoint holds the
training loop, what two storage paths move alone and together, and what the update order saves in reads.

    fig = checkpoint_timeline(trace, marks=[("save(3)", t_save), ("committed", t_commit)])
    fig = blocked_bars({"blocking torch.save": 0.046, "async (ours)": 0.004}, recorded={...})  # seconds
    fig = path_bandwidths({"fast alone": {"fast": 1.9}, "both": {"fast": 1.7, "slow": 0.5}})  # GB/s
    fig = reads_per_step({"forward": [48e6, 48e6], "alternate": [48e6, 36e6]}, predicted={...})  # bytes

Pure functions: data in, a matplotlib Figure out. They draw what they are given and compute nothing from it but
sums and labels.

What this is not: a measurement (the chapter and bench/checkpoint.py, bench/swapper.py measure), nor a trace viewer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ...trace import Trace
from ...units import format_bytes
from .timeline import _CHAR_WIDTH_IN, _label_spans, _message_figure, lane_rows

CHECKPOINT_LANES = ("compute", "cpu", "d2h", "h2d", "nvme_write")  # the writer's files land on nvme_write
MARK_COLOR = "#333333"
RECORDED_ALPHA = 0.45  # a bench's recorded figure, drawn lighter beside this run's
MIB = 1 << 20
PALETTE = ("#C44E52", "#DD8452", "#4C72B0", "#55A868", "#8172B3", "#937860")  # by position: the first kind, path...


def _color(position: int) -> str:
    return PALETTE[position % len(PALETTE)]


def _spines_off(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def checkpoint_timeline(trace: Trace, marks: Sequence[tuple[str, float]] = (), lanes: Sequence[str] | None = None,
                        t_range: tuple[float, float] | None = None, title: str | None = None) -> Figure:
    """The trace's lanes (default: compute, cpu, d2h, h2d, nvme_write, those present) with a dashed vertical line at
    each mark: (label, seconds on the trace's clock), e.g. when `save()` was called and when the manifest was
    committed. `t_range=(t0, t1)` in seconds zooms in."""
    title = title or "Steps with a checkpoint in flight"
    for mark in marks:
        if (not isinstance(mark, tuple) or len(mark) != 2 or not isinstance(mark[0], str)
                or not isinstance(mark[1], (int, float)) or not math.isfinite(mark[1])):
            raise ValueError(f"each mark must be (label, seconds), a string and a finite number, got {mark!r}")
    if not trace.spans:
        return _message_figure("no spans", title)
    rows = [lane for lane in CHECKPOINT_LANES if trace.on(lane)] if lanes is None else list(lanes)
    if not rows:
        return _message_figure("no lanes selected", title)
    if t_range is not None and not t_range[1] > t_range[0]:
        raise ValueError(f"t_range must be (start, end) in seconds with end > start, got {t_range!r}")
    fig, ax = plt.subplots(figsize=(7.2, min(4.2, max(2.6, 1.5 + 0.42 * len(rows)))))
    lane_rows(ax, trace, rows, fontsize=9)
    if t_range is None:
        first = min([s.start for s in trace.spans] + [t for _, t in marks])
        last = max([s.end for s in trace.spans] + [t for _, t in marks])
        pad = 0.01 * (last - first) or 0.5e-3
        x0, x1 = (first - pad) * 1e3, (last + pad) * 1e3
    else:
        x0, x1 = t_range[0] * 1e3, t_range[1] * 1e3
    ax.set_xlim(x0, x1)
    _label_spans(ax, trace, rows, x0, x1, axis_width_in=fig.get_figwidth() * 0.82)
    levels = _mark_levels(marks, x1 - x0, fig.get_figwidth() * 0.82)
    for (label, seconds), level in zip(marks, levels, strict=True):
        ax.axvline(seconds * 1e3, color=MARK_COLOR, lw=1.0, ls="--")
        ax.text(seconds * 1e3, -0.55 - 0.42 * level, f" {label}", fontsize=7, color=MARK_COLOR, ha="left",
                va="bottom", clip_on=False)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10, loc="left", pad=14 + 11 * max(levels, default=0))
    fig.tight_layout()
    return fig


def _mark_levels(marks: Sequence[tuple[str, float]], span_ms: float, axis_width_in: float) -> list[int]:
    """A text row for each mark's label (0: just above the axes), so that labels of nearby marks do not overlap: in
    time order, each takes the lowest row where the label before it has ended."""
    inches_per_ms = axis_width_in / span_ms if span_ms > 0 else 0.0
    ends: list[float] = []  # per row: where (ms) the last label placed in it ends
    levels = [0] * len(marks)
    for index in sorted(range(len(marks)), key=lambda i: marks[i][1]):
        label, seconds = marks[index]
        start = seconds * 1e3
        width = (len(label) + 1) * _CHAR_WIDTH_IN / inches_per_ms if inches_per_ms else 0.0
        row = next((r for r, end in enumerate(ends) if end <= start), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = start + width
        levels[index] = row
    return levels


def blocked_bars(measured: Mapping[str, float], recorded: Mapping[str, float] | None = None,
                 title: str | None = None) -> Figure:
    """Seconds the training loop was held per checkpoint, one horizontal bar per kind of checkpoint (first on top):
    this run's, and beside it, lighter, a recorded run's (`recorded`, e.g. bench/results/checkpoint.json) where it
    has the same kind."""
    title = title or "Time the training loop waits per checkpoint"
    if not measured:
        return _message_figure("no checkpoints measured", title)
    values = [*measured.values(), *(recorded or {}).values()]
    if any(not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"blocked times must be finite seconds >= 0, got {values!r}")
    kinds = list(measured)
    both = recorded is not None and any(kind in recorded for kind in kinds)
    height = 0.38 if both else 0.7
    fig, ax = plt.subplots(figsize=(7.2, min(4.5, 1.3 + (0.6 if both else 0.42) * len(kinds))))
    for row, kind in enumerate(kinds):
        color = _color(row)
        offset = -height / 2 if both else 0.0
        bar = ax.barh(row + offset, measured[kind] * 1e3, height=height, color=color,
                      label="this run" if row == 0 else None)
        ax.bar_label(bar, [f"{measured[kind] * 1e3:.1f} ms"], fontsize=7, padding=2)
        if both and kind in recorded:
            bar = ax.barh(row + height / 2, recorded[kind] * 1e3, height=height, color=color, alpha=RECORDED_ALPHA,
                          hatch="//", label="recorded (bench)" if row == 0 else None)
            ax.bar_label(bar, [f"{recorded[kind] * 1e3:.1f} ms"], fontsize=7, padding=2)
    ax.set_yticks(range(len(kinds)), kinds, fontsize=9)
    ax.set_ylim(len(kinds) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(0, max(values) * 1e3 * 1.25 or 1.0)
    ax.set_xlabel("ms per checkpoint")
    ax.grid(axis="x", color="0.9", lw=0.8)
    ax.set_axisbelow(True)
    _spines_off(ax)
    if both:
        ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def path_bandwidths(runs: Mapping[str, Mapping[str, float]], predicted: Mapping[str, float] | None = None,
                    title: str | None = None, predicted_label: str = "predicted") -> Figure:
    """GB/s moved per configuration (one horizontal bar each, first on top), split into what each path carried
    (stacked, one colour per path, the same in every bar); a configuration's `predicted` total, if given, is a black
    tick on its bar, named `predicted_label` in the legend."""
    title = title or "Bandwidth of each path alone and together"
    if not runs or not any(runs.values()):
        return _message_figure("no runs", title)
    values = [v for parts in runs.values() for v in parts.values()] + list((predicted or {}).values())
    if any(not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"bandwidths must be finite GB/s >= 0, got {values!r}")
    unknown = set(predicted or {}) - set(runs)
    if unknown:
        raise ValueError(f"predicted names configurations that were not run: {sorted(unknown)}")
    paths = list(dict.fromkeys(path for parts in runs.values() for path in parts))
    colors = {path: _color(i + 2) for i, path in enumerate(paths)}
    fig, ax = plt.subplots(figsize=(7.2, min(4.0, 1.4 + 0.5 * len(runs))))
    labelled: set[str] = set()
    drawn_tick = False
    for row, (config, parts) in enumerate(runs.items()):
        left = 0.0
        for path, gbps in parts.items():
            ax.barh(row, gbps, left=left, height=0.6, color=colors[path], edgecolor="white", linewidth=0.6,
                    label=path if path not in labelled else None)
            labelled.add(path)
            if len(parts) > 1 and gbps > 0:
                ax.text(left + gbps / 2, row, f"{gbps:.2f}", ha="center", va="center", fontsize=7, color="white")
            left += gbps
        tick = predicted.get(config) if predicted else None
        ax.text(max(left, tick or 0.0), row, f"  {left:.2f} GB/s", va="center", fontsize=8)
        if tick is not None:
            ax.plot([tick] * 2, [row - 0.4, row + 0.4], color="black", lw=2,
                    label=predicted_label if not drawn_tick else None)
            drawn_tick = True
    ax.set_yticks(range(len(runs)), list(runs), fontsize=9)
    ax.set_ylim(len(runs) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(0, max([sum(parts.values()) for parts in runs.values()] + list((predicted or {}).values())) * 1.3)
    ax.set_xlabel("GB/s (bytes moved / seconds)")
    ax.grid(axis="x", color="0.9", lw=0.8)
    ax.set_axisbelow(True)
    _spines_off(ax)
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def reads_per_step(counts: Mapping[str, Sequence[float]], predicted: Mapping[str, Sequence[float]] | None = None,
                   title: str | None = None) -> Figure:
    """Bytes read from the drive in each step, one group of bars per step and one bar per order (e.g. "forward",
    "alternate"); `predicted`, per order, one value per step, drawn as a black tick on that bar."""
    title = title or "Bytes read from the drive per step"
    if not counts or not any(counts.values()):
        return _message_figure("no steps counted", title)
    steps = {len(values) for values in counts.values()}
    if len(steps) != 1:
        raise ValueError(f"every order needs the same number of steps, got {[len(v) for v in counts.values()]}")
    for order, values in (predicted or {}).items():
        if order not in counts or len(values) != len(counts[order]):
            raise ValueError(f"predicted[{order!r}] must be one value per step of an order in counts")
    values = [v for vs in counts.values() for v in vs] + [v for vs in (predicted or {}).values() for v in vs]
    if any(not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"bytes must be finite and >= 0, got {values!r}")
    (n_steps,) = steps
    width = 0.8 / len(counts)
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    tick_labelled = False
    for i, (order, read) in enumerate(counts.items()):
        xs = [step + (i - (len(counts) - 1) / 2) * width for step in range(n_steps)]
        ax.bar(xs, [v / MIB for v in read], width=width * 0.92, color=_color(i + 3) if i else "#8C8C8C", label=order)
        for x, v in zip(xs, (predicted or {}).get(order, [None] * n_steps), strict=True):
            if v is None:
                continue
            ax.plot([x - width * 0.45, x + width * 0.45], [v / MIB] * 2, color="black", lw=2,
                    label=None if tick_labelled else "predicted")
            tick_labelled = True
    ax.set_xticks(range(n_steps), [f"step {s + 1}" for s in range(n_steps)], fontsize=8)
    ax.set_ylabel("MiB read")
    ax.set_ylim(0, max(values) / MIB * 1.45 or 1.0)
    ax.grid(axis="y", color="0.9", lw=0.8)
    ax.set_axisbelow(True)
    _spines_off(ax)
    ax.legend(fontsize=8, frameon=False, loc="upper right", ncol=3)
    total = {order: sum(read) for order, read in counts.items()}
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_title(", ".join(f"{order} {format_bytes(t)}" for order, t in total.items()), fontsize=8, loc="right",
                 color="dimgray")
    fig.tight_layout()
    return fig
