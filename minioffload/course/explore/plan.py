"""Chapter 9's plan explorer in the page: the planner's best plan of each kind, precomputed over a grid.

The planner (plan.search: an enumeration and a MILP per configuration) cannot run in a browser, so `plan_grid` runs
it here for every point of a small grid (model size x hardware preset x host GB x NVMe GB, one batch) and the page's
menus pick a point. For each point the chart shows what `widgets.plan_explorer` prints and draws: the best plan of
each kind (plan.best_per_family), its bytes per tier against the capacity (as viz.plan_memory), and its predicted
tokens/s and step time; when nothing fits, what the closest configuration lacks (NoPlanError.short).

The default grid (DEFAULT_GRID) is GPT-3-shaped models of 1.3B, 6.7B, 13B, 30B and 70B parameters
(ModelSpec.of_params, context 2048) x the rtx4090 and h100-sxm presets x 128 or 1024 GB of host memory x no NVMe or
4 TB, at a batch of 8 sequences: 40 searches, about 20 s of one core on the course's 2-core machine (measured
with plan.search's default micro-batches). The grid is computed once per process (functools.lru_cache on its
arguments).

What this is not: the planner at any point: between grid points the chart shows nothing new. For another model or
machine, call plan_chart with a grid of your own (each point costs one plan.search), or plan_explorer in a kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys
from collections.abc import Iterator, Sequence

from ...machine.profiles import PAPER_PRESETS, PRESETS, preset
from ...planner import search as planner
from ...planner.plan import HOMES
from ...units import GB, format_bytes
from ..viz.style import tier_color
from .chart import Chart

DEFAULT_GRID = {"sizes": (1.3e9, 13e9, 70e9, 175e9), "hardware": ("rtx4090", "h100-sxm"),
                "host_gb": (128, 1024), "nvme_gb": (0, 4000), "batch": 8}
TOP = 4  # plans shown per point: the fastest of each kind


def _size_label(num_params: float) -> str:
    return f"{num_params / 1e9:.3g}B"


def _point(num_params: float, hardware: str, host_gb: float, nvme_gb: float, batch: int) -> list[dict]:
    """One grid point's rows: one per (plan, tier), or per tier of the closest configuration when nothing fits."""
    spec, hw = planner.ModelSpec.of_params(num_params), preset(hardware)
    limits = planner.Limits(batch=batch, host_bytes=host_gb * GB, nvme_bytes=nvme_gb * GB)
    key = {"size": _size_label(num_params), "hardware": hardware, "host_gb": host_gb, "nvme_gb": nvme_gb}
    capacity = limits.capacity(hw)
    try:
        plans = planner.best_per_family(planner.search(spec, hw, limits))[:TOP]
    except planner.NoPlanError as err:
        lacking = ", ".join(f"{format_bytes(v)} more {t}" for t, v in err.short.items() if v > 0) or "more memory"
        return [{**key, "plan": "closest", "rank": 0, "tier": tier, "bytes": float(capacity[tier] or 0) + err.short.get(
                    tier, 0.0), "capacity": capacity[tier], "over": err.short.get(tier, 0.0) > 0, "tokens_per_s": 0,
                 "step_s": 0, "text": f"nothing fits: the closest configuration needs {lacking}"} for tier in HOMES]
    return [{**key, "plan": f"#{rank}", "rank": rank, "tier": tier, "bytes": float(p.memory.get(tier, 0)),
             "capacity": capacity[tier], "over": False, "tokens_per_s": round(p.tokens_per_s, 1),
             "step_s": p.step_s, "text": f"#{rank}: {p.tokens_per_s:,.0f} tokens/s, step {p.step_s:.3g} s, bound by "
                                         f"{p.bound}\n{p.describe()}"}
            for rank, p in enumerate(plans, 1) for tier in HOMES]


@contextlib.contextmanager
def _quiet_c_stdout() -> Iterator[None]:
    """Send what C code prints to file descriptor 1 to /dev/null meanwhile: SciPy's HiGHS prints a debugging line
    ("HighsMipSolverData::transformNewIntegerFeasibleSolution ...") for some of the planner's programs, which a
    notebook shows as cell output. Python's own prints are untouched (in a kernel they do not go through fd 1)."""
    fd = 1
    try:
        libc = ctypes.CDLL(None)
        os.fstat(fd)
    except (OSError, TypeError):  # no C library to flush (Windows), or no fd 1: let HiGHS print
        yield
        return
    sys.stdout.flush()
    libc.fflush(None)
    saved, devnull = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    try:
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


@functools.lru_cache(maxsize=4)
def _grid(sizes: tuple, hardware: tuple, host_gb: tuple, nvme_gb: tuple, batch: int) -> tuple[dict, ...]:
    with _quiet_c_stdout():
        return tuple(row for n in sizes for hw in hardware for host in host_gb for nvme in nvme_gb
                     for row in _point(n, hw, host, nvme, batch))


def _values(name: str, values: Sequence[float], low: float) -> tuple:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low
                         for v in values):
        raise ValueError(f"plan_chart: {name} must be a non-empty list of numbers >= {low:g}, got {values!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"plan_chart: {name} lists a value twice: {values!r}")
    return values


def plan_grid(sizes: Sequence[float] = DEFAULT_GRID["sizes"], hardware: Sequence[str] = DEFAULT_GRID["hardware"],
              host_gb: Sequence[float] = DEFAULT_GRID["host_gb"], nvme_gb: Sequence[float] = DEFAULT_GRID["nvme_gb"],
              batch: int = DEFAULT_GRID["batch"]) -> list[dict]:
    """The rows the chart draws: for every grid point, one row per (plan, tier) with its bytes, the tier's capacity
    (None: unbounded), tokens/s, step seconds and a line of text. Each point costs one plan.search; the whole grid is
    cached per process."""
    sizes = _values("sizes", sizes, 1e6)
    names = [*PRESETS, *PAPER_PRESETS]
    hardware = tuple(hardware)
    unknown = [h for h in hardware if h not in names]
    if not hardware or unknown:
        raise ValueError(f"plan_chart: unknown hardware preset(s) {unknown or hardware!r}; choose from "
                         f"{', '.join(names)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"plan_chart: batch must be a positive int (sequences per step), got {batch!r}")
    return [dict(row) for row in _grid(sizes, hardware, _values("host_gb", host_gb, 0),
                                       _values("nvme_gb", nvme_gb, 0), batch)]


def _menu(name: str, label: str, values: Sequence, start, labels: Sequence[str] | None = None) -> dict:
    if start not in values:
        raise ValueError(f"plan_chart: the starting {name} {start!r} is not in the grid's {list(values)}")
    bind = {"input": "select", "options": list(values), "name": label}
    if labels is not None:
        bind["labels"] = list(labels)
    return {"name": name, "value": start, "bind": bind}


def plan_chart(size: float = 70e9, hardware: str = "h100-sxm", host_gb: float = 1024, nvme_gb: float = 4000,
               grid: dict | None = None) -> Chart:
    """Menus over the grid (model size, hardware, host GB, NVMe GB) starting at the point given; per point the best
    plan of each kind: bytes per tier against capacity (dashed), and tokens/s with the plan in words. `grid` replaces
    DEFAULT_GRID's entries (sizes, hardware, host_gb, nvme_gb, batch)."""
    unknown = set(grid or {}) - set(DEFAULT_GRID)
    if unknown:
        raise ValueError(f"plan_chart: unknown grid key(s) {sorted(unknown)}; the keys are {', '.join(DEFAULT_GRID)}")
    g = {**DEFAULT_GRID, **(grid or {})}
    rows = plan_grid(g["sizes"], g["hardware"], g["host_gb"], g["nvme_gb"], g["batch"])
    params = [_menu("size", "model ", [_size_label(n) for n in g["sizes"]],
                    _size_label(size) if isinstance(size, (int, float)) else size),
              _menu("hardware", "hardware ", list(g["hardware"]), hardware),
              _menu("host_gb", "host GB ", list(g["host_gb"]), host_gb),
              _menu("nvme_gb", "NVMe GB ", list(g["nvme_gb"]), nvme_gb, [f"{v:g}" + (" (none)" if v == 0 else "")
                                                                         for v in g["nvme_gb"]])]
    point = ("datum.size == size && datum.hardware == hardware && datum.host_gb == host_gb && "
             "datum.nvme_gb == nvme_gb")
    memory = {
        "transform": [{"calculate": "datum.bytes / 1e9", "as": "GB"},
                      {"calculate": "datum.capacity === null ? null : datum.capacity / 1e9", "as": "capacity_GB"}],
        "facet": {"column": {"field": "tier", "type": "nominal", "sort": list(HOMES), "title": None,
                             "header": {"labelFontSize": 11}}},
        "spec": {"width": 140, "height": 170, "layer": [
            {"mark": {"type": "bar"},
             "encoding": {"x": {"field": "plan", "type": "nominal", "sort": {"field": "rank"}, "title": None,
                                "axis": {"labelAngle": 0}},
                          "y": {"field": "GB", "type": "quantitative", "title": "GB"},
                          "color": {"field": "tier", "type": "nominal", "legend": None,
                                    "scale": {"domain": list(HOMES), "range": [tier_color(t) for t in HOMES]}},
                          "stroke": {"condition": {"test": "datum.over", "value": "#C44E52"}, "value": None},
                          "strokeWidth": {"value": 2},
                          "tooltip": [{"field": "plan"}, {"field": "tier"}, {"field": "GB", "format": ",.1f"},
                                      {"field": "capacity_GB", "title": "capacity GB", "format": ",.0f"}]}},
            {"transform": [{"filter": "datum.capacity_GB !== null"}, {"aggregate": [
                {"op": "max", "field": "capacity_GB", "as": "capacity_GB"}], "groupby": []}],
             "mark": {"type": "rule", "strokeDash": [5, 3], "color": "black"},
             "encoding": {"y": {"field": "capacity_GB", "type": "quantitative"}}}]},
        "resolve": {"scale": {"y": "independent"}},
    }
    lines = {
        "transform": [{"filter": "datum.tier == 'device'"}],
        "width": 560, "height": {"step": 30},
        "mark": {"type": "text", "align": "left", "baseline": "top", "x": 0, "fontSize": 11, "limit": 600,
                 "lineBreak": "\n"},
        "encoding": {"y": {"field": "rank", "type": "ordinal", "axis": None}, "text": {"field": "text"}},
    }
    spec = {
        "description": "The planner's best plan of each kind on a precomputed grid (minioffload.planner.search.search)",
        "title": {"text": "Best plan of each kind: bytes per tier against capacity (dashed)", "anchor": "start",
                  "subtitle": f"batch {g['batch']}; grid precomputed with plan.search; red outline: over capacity"},
        "params": params,
        "data": {"values": rows},
        "transform": [{"filter": point}],
        "vconcat": [memory, lines],
        # a point with more plans has more lines of text: without resize the first point's height would clip them
        "autosize": {"type": "pad", "resize": True},
        "config": {"view": {"stroke": None}},
    }
    return Chart(spec, "plan", f"{len(rows)} rows over a grid of {len(g['sizes'])} sizes x {len(g['hardware'])} "
                               f"machines x {len(g['host_gb'])} host x {len(g['nvme_gb'])} NVMe sizes")
