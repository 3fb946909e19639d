"""Chapter 8's streaming explorer in the page: the step model's streamed step for a prefetch depth, a budget in
blocks, a link speed and where the weights live, as bars per lane.

The step model runs in Python, not in the browser, so every (depth, link, home) it can show is predicted here once
(`streaming_table`: 5 depths x the links in LINKS_GBPS plus the machine's own x host/NVMe, 80 predictions) and the
page's controls pick one. The spans go into the page as CSV (a few thousand rows: JSON would be five times larger).
The budget only decides whether the runtime accepts the depth (a block and its prefetches must fit), so it needs no
prediction: below depth + 1 blocks the chart says why it is refused, in the runtime's terms, as
`viz.streamed_step` does.

What this is not: a measurement (chapter 8 measures the sim beside it), nor a second model: `stepmodel.predict`
places every span. `widgets.streaming_explorer` is the kernel-side twin.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...predict.memory import GB
from ...predict.stepmodel import StepConfig, Workload, predict
from ..viz.style import lane_color
from .chart import Chart

LINKS_GBPS = (0.1, 1.0, 3.0, 10.0, 30.0, 100.0, 1000.0)  # besides the machine's own link
DEPTHS = range(5)
HOMES = ("host", "nvme")
LANES = ("compute", "nvme_read", "h2d", "cpu")


NUMBERS = ("depth", "link", "start_ms", "end_ms")


def _csv(rows: list[dict]) -> str:
    """The span rows as CSV text, times to 0.1 us (Vega parses it in the page; far smaller than JSON)."""
    fields = ["depth", "link", "home", "lane", "name", "start_ms", "end_ms"]
    lines = [",".join(fields)]
    for r in rows:
        lines.append(f"{r['depth']},{r['link']},{r['home']},{r['lane']},{r['name'].replace(',', ';')},"
                     f"{r['start_ms']:.4f},{r['end_ms']:.4f}")
    return "\n".join(lines)


def _own_link(hw) -> float:
    return round(hw.link_h2d / GB, 3)  # GB/s, as the menu shows it


def _links(hw) -> list[float]:
    return sorted({*LINKS_GBPS, _own_link(hw)})


def streaming_table(work: Workload, hw, links_gbps: Sequence[float] | None = None) -> tuple[list[dict], list[dict]]:
    """(spans, steps): every predicted span as {depth, link, home, lane, name, start_ms, end_ms}, and per prediction
    {depth, link, home, step_ms, exposed}; `link` is the index into `links_gbps` (default: LINKS_GBPS and hw's own)."""
    links = list(links_gbps) if links_gbps is not None else _links(hw)
    if not links or any(not isinstance(g, (int, float)) or g <= 0 for g in links):
        raise ValueError(f"streaming_table: links_gbps must be positive GB/s values, got {links!r}")
    spans, steps = [], []
    for index, gbps in enumerate(links):
        linked = hw.replace(link_h2d=gbps * GB, link_d2h=gbps * GB)
        for home in HOMES:
            for depth in DEPTHS:
                pred = predict(work, linked, StepConfig(params_on=home, prefetch=depth, mfu=1.0))
                key = {"depth": depth, "link": index, "home": home}
                spans += [{**key, "lane": s.lane, "name": s.name, "start_ms": s.start * 1e3, "end_ms": s.end * 1e3}
                          for s in pred.trace.spans if s.lane in LANES]
                steps.append({**key, "step_ms": pred.step_s * 1e3, "exposed": pred.exposed_fetch_fraction})
    return spans, steps


def streaming_chart(work: Workload, hw, prefetch: int = 1, budget_blocks: int = 3, home: str = "host",
                    width: int = 560) -> Chart:
    """Sliders for the prefetch depth and the budget (blocks), menus for the link (GB/s) and the weights' home,
    starting at the values given and at `hw`'s own link; the predicted step's spans by lane, titled with the step
    time and the share of fetch time exposed."""
    if not isinstance(work, Workload):
        raise TypeError(f"streaming_chart needs a stepmodel.Workload (Workload.of(model, tokens=...)), got "
                        f"{type(work).__name__}")
    if prefetch not in DEPTHS or not isinstance(budget_blocks, int) or not 1 <= budget_blocks <= 6:
        raise ValueError(f"streaming_chart: prefetch must be 0-{max(DEPTHS)} and budget_blocks 1-6, got "
                         f"{prefetch!r} and {budget_blocks!r}")
    if home not in HOMES:
        raise ValueError(f"streaming_chart: home must be one of {HOMES}, got {home!r}")
    links = _links(hw)
    spans, steps = streaming_table(work, hw, links)
    block_mb = work.block_params * work.model_bytes / 1e6  # the budget counts blocks of this size
    lanes = [lane for lane in LANES if any(s["lane"] == lane for s in spans)]
    params = [
        {"name": "depth", "value": prefetch, "bind": {"input": "range", "min": 0, "max": max(DEPTHS), "step": 1,
                                                      "name": "prefetch "}},
        {"name": "budget", "value": budget_blocks, "bind": {"input": "range", "min": 1, "max": 6, "step": 1,
                                                            "name": "budget (blocks) "}},
        {"name": "link", "value": links.index(_own_link(hw)),
         "bind": {"input": "select", "options": list(range(len(links))), "labels": [f"{g:g}" for g in links],
                  "name": "link GB/s "}},
        {"name": "home", "value": home, "bind": {"input": "select", "options": list(HOMES), "name": "weights on "}},
    ]
    chosen = "datum.depth == depth && datum.link == link && datum.home == home"
    refused = ("'refused: a budget of ' + budget + ' blocks is smaller than a block and its prefetch (' + "
               "(depth + 1) + ' blocks); raise the budget or lower the prefetch'")
    bars = {
        "data": {"values": _csv(spans), "format": {"type": "csv", "parse": {f: "number" for f in NUMBERS}}},
        "transform": [{"filter": f"{chosen} && budget >= depth + 1"}],
        "width": width, "height": 26 * len(lanes),
        "mark": {"type": "bar", "stroke": "white", "strokeWidth": 0.5},
        "encoding": {
            "x": {"field": "start_ms", "type": "quantitative", "title": "time (ms), predicted"},
            "x2": {"field": "end_ms"},
            "y": {"field": "lane", "type": "nominal", "sort": lanes, "title": None,
                  "scale": {"domain": lanes}},
            "color": {"field": "lane", "type": "nominal", "legend": None,
                      "scale": {"domain": lanes, "range": [lane_color(lane) for lane in lanes]}},
            "tooltip": [{"field": "name"}, {"field": "lane"}, {"field": "start_ms", "format": ".3f"},
                        {"field": "end_ms", "format": ".3f"}],
        },
    }
    summary = {
        "data": {"values": steps},
        "transform": [{"filter": chosen},
                      {"calculate": f"budget < depth + 1 ? {refused} : 'step ' + format(datum.step_ms, '.1f') + "
                                    "' ms, ' + format(datum.exposed, '.0%') + ' of fetch time exposed; streamed "
                                    f"weights on the device: at most ' + budget + ' x {block_mb:.3g} MB'",
                       "as": "text"}],
        "width": width, "height": 18,
        "mark": {"type": "text", "align": "left", "baseline": "top", "x": 0, "fontSize": 12, "limit": width},
        "encoding": {"text": {"field": "text"}},
    }
    spec = {
        "description": "The step model's streamed step (predict.stepmodel.predict) by depth, budget, link, home",
        "title": {"text": "A step with streamed weights, predicted", "anchor": "start",
                  "subtitle": f"every (depth, link, home) predicted in Python: {len(steps)} steps"},
        "params": params,
        "vconcat": [summary, bars],
        "config": {"view": {"stroke": None}},
    }
    return Chart(spec, "streaming", f"{len(steps)} predicted steps; prefetch and budget sliders, link and home menus")
