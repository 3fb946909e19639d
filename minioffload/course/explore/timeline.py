"""Chapters 2 and 4's timeline explorer in the page: the spans of a `Trace` as bars, one row per lane.

A checkbox per lane hides or shows it (the rows left close up, as `viz.timeline(lanes=...)` draws them); brushing
the overview strip under the chart zooms the chart to that time range (double-click the strip to zoom out); hovering
a bar names its span.

What this is not: a trace viewer for thousands of spans (save the trace with `Trace.save` and open it in
ui.perfetto.dev), nor a figure of its own: it draws `trace.spans`, in ms from the trace's origin, nothing computed.
`widgets.timeline_explorer` is the kernel-side twin.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ...trace import Trace
from ..viz.style import lane_color
from .chart import Chart


def timeline_table(trace: Trace, lanes: Sequence[str] | None = None) -> list[dict]:
    """The spans as rows: {lane, name, start_ms, end_ms, ms, bytes}, in the trace's order (only `lanes`' if given)."""
    return [{"lane": s.lane, "name": s.name, "start_ms": s.start * 1e3, "end_ms": s.end * 1e3,
             "ms": s.duration * 1e3, "bytes": s.nbytes} for s in trace.spans if lanes is None or s.lane in lanes]


def timeline_chart(trace: Trace, lanes: Sequence[str] | None = None, title: str = "Timeline",
                   width: int = 560) -> Chart:
    """Bars per lane over time (ms), a checkbox per lane, and an overview strip to brush a time range into view.
    `lanes`: the rows, top to bottom (default: every lane of the trace, in `trace.lanes()` order)."""
    if not isinstance(trace, Trace):
        raise TypeError(f"timeline_chart needs a minioffload.trace.Trace (e.g. a device's .trace), got "
                        f"{type(trace).__name__}")
    if not trace.spans:
        raise ValueError("timeline_chart: the trace has no spans; run some work on a device first (its .trace records "
                         "every copy and kernel)")
    if isinstance(lanes, str):
        raise TypeError(f"timeline_chart: lanes is a list of lane names, got the string {lanes!r}")
    if lanes is not None:
        lanes = list(lanes)
        missing = [lane for lane in lanes if lane not in trace.lanes()]
        if not lanes or missing:
            raise ValueError(f"timeline_chart: lanes {missing or lanes!r} not in the trace; its lanes are "
                             f"{trace.lanes()}")
    else:
        lanes = trace.lanes()
    toggles = [{"name": f"lane_{i}", "value": True, "bind": {"input": "checkbox", "name": f"{lane} "}}
               for i, lane in enumerate(lanes)]
    shown = " || ".join(f"(datum.lane == {json.dumps(lane)} && lane_{i})" for i, lane in enumerate(lanes))
    colors = {"field": "lane", "type": "nominal", "legend": None,
              "scale": {"domain": lanes, "range": [lane_color(lane) for lane in lanes]}}
    lane_axis = {"field": "lane", "type": "nominal", "sort": lanes, "title": None}
    detail = {
        "width": width, "height": max(60, 26 * len(lanes)),
        "mark": {"type": "bar", "clip": True, "stroke": "white", "strokeWidth": 0.5},
        "encoding": {
            "x": {"field": "start_ms", "type": "quantitative", "title": "time (ms)",
                  "scale": {"domain": {"param": "zoom", "encoding": "x"}}},
            "x2": {"field": "end_ms"},
            "y": lane_axis,
            "color": colors,
            "tooltip": [{"field": "name"}, {"field": "lane"}, {"field": "start_ms", "format": ".3f"},
                        {"field": "ms", "format": ".3f"}, {"field": "bytes", "format": ","}],
        },
    }
    overview = {
        "width": width, "height": 8 * len(lanes) + 10,
        "params": [{"name": "zoom", "select": {"type": "interval", "encodings": ["x"]}}],
        "mark": {"type": "bar"},
        "encoding": {"x": {"field": "start_ms", "type": "quantitative", "title": "brush here to zoom (ms)",
                           "scale": {"zero": False}},
                     "x2": {"field": "end_ms"}, "y": {**lane_axis, "axis": None}, "color": colors},
    }
    spec = {
        "description": f"{title}: the spans of a minioffload Trace by lane",
        "title": {"text": title, "subtitle": f"makespan {trace.makespan() * 1e3:.3g} ms, overlap "
                                             f"{trace.overlap_fraction():.0%}", "anchor": "start"},
        "params": toggles,
        "data": {"values": timeline_table(trace, lanes)},
        "transform": [{"filter": shown}],
        "vconcat": [detail, overview],
        "config": {"view": {"stroke": None}},
    }
    return Chart(spec, "timeline", f"{len(spec['data']['values'])} spans on {len(lanes)} lanes; lane checkboxes, "
                                   "brush to zoom")
