"""Chapter 1's footprint explorer in the page: bytes per tier of a training setup against the GPU's memory.

The model is memory.footprint's, computed here in Python: one row per (precision, optimizer, placement, part) with
its tier and bytes per parameter (`footprint_table`). In the page, the menus pick the rows of one setup and a Vega
`calculate` multiplies them by the parameter slider (log scale): GB = bytes_per_param * 10^log10_params / 1e9.

What this is not: a second calculator. Every number the chart draws is a row of `footprint_table` times the slider;
tests check the rows against memory.footprint. `widgets.footprint_explorer` is the kernel-side twin.
"""

from __future__ import annotations

import math

from ...predict.memory import OPTIMIZERS, PLACEMENTS, PRECISIONS, TIERS, footprint
from ..viz.style import PART_COLORS
from .chart import Chart

PARAMS_LOG10 = (8.0, 12.0)  # the slider's range: 100M to 1T parameters, as footprint_explorer's
GPU_GB = (8, 192)
GB_EXPR = "datum.bytes_per_param * pow(10, log10_params) / 1e9"  # the one calculation the page does
SETUP = "datum.precision == precision && datum.optimizer == optimizer && datum.placement == placement"


def footprint_table() -> list[dict]:
    """Every setup's parts: {precision, optimizer, placement, part, tier, bytes_per_param, order, device_bpp} with
    `device_bpp` the setup's bytes per parameter on the device (the verdict line reads it)."""
    rows = []
    for precision in PRECISIONS:
        for optimizer in OPTIMIZERS:
            for placement in PLACEMENTS:
                fp = footprint(precision, optimizer, placement)
                device = fp.per_param("device")
                rows += [{"precision": precision, "optimizer": optimizer, "placement": placement, "part": p.name,
                          "tier": p.tier, "bytes_per_param": p.bytes_per_param, "order": i, "device_bpp": device}
                         for i, p in enumerate(fp.parts)]
    return rows


def _choice(values: tuple[str, ...], value: str, what: str) -> str:
    if value not in values:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(map(repr, values))}")
    return value


def footprint_chart(num_params: float = 7e9, precision: str = "mixed_bf16", optimizer: str = "adam",
                    placement: str = "device", gpu_gb: float = 80) -> Chart:
    """Stacked bars of GB per tier (device, host, nvme), one segment per part, and the GPU's memory dashed, with a
    parameter slider (log10, 1e8 to 1e12), menus for precision, optimizer and placement, and a GPU GB slider: the
    controls of `widgets.footprint_explorer`, in the page. The arguments are the controls' starting values."""
    if not (isinstance(num_params, (int, float)) and 10 ** PARAMS_LOG10[0] <= num_params <= 10 ** PARAMS_LOG10[1]):
        raise ValueError(f"num_params must be a number of parameters from 1e8 to 1e12 (the slider's range), "
                         f"got {num_params!r}")
    if not (isinstance(gpu_gb, (int, float)) and GPU_GB[0] <= gpu_gb <= GPU_GB[1]):
        raise ValueError(f"gpu_gb must be the GPU's memory in GB, from {GPU_GB[0]} to {GPU_GB[1]}, got {gpu_gb!r}")
    params = [
        {"name": "log10_params", "value": round(math.log10(num_params), 3),
         "bind": {"input": "range", "min": PARAMS_LOG10[0], "max": PARAMS_LOG10[1], "step": 0.001,
                  "name": "parameters (log10) "}},
        {"name": "gpu_gb", "value": gpu_gb, "bind": {"input": "range", "min": GPU_GB[0], "max": GPU_GB[1], "step": 1,
                                                     "name": "GPU GB "}},
        {"name": "precision", "value": _choice(PRECISIONS, precision, "precision"),
         "bind": {"input": "select", "options": list(PRECISIONS), "name": "precision "}},
        {"name": "optimizer", "value": _choice(OPTIMIZERS, optimizer, "optimizer"),
         "bind": {"input": "select", "options": list(OPTIMIZERS), "name": "optimizer "}},
        {"name": "placement", "value": _choice(PLACEMENTS, placement, "placement"),
         "bind": {"input": "select", "options": list(PLACEMENTS), "name": "placement "}},
    ]
    parts = list(dict.fromkeys(row["part"] for row in footprint_table()))
    bars = {
        "mark": {"type": "bar", "stroke": "white", "strokeWidth": 0.5},
        "transform": [{"filter": SETUP}, {"calculate": GB_EXPR, "as": "GB"}],
        "encoding": {
            "x": {"field": "tier", "type": "nominal", "sort": list(TIERS), "scale": {"domain": list(TIERS)},
                  "axis": {"labelAngle": 0, "title": None}},
            "y": {"field": "GB", "type": "quantitative", "aggregate": "sum", "title": "GB"},
            "color": {"field": "part", "type": "nominal", "title": "part",
                      "scale": {"domain": parts, "range": [PART_COLORS[p] for p in parts]}},
            "order": {"field": "order", "type": "quantitative"},
            "tooltip": [{"field": "part"}, {"field": "tier"}, {"field": "bytes_per_param", "title": "B/param"},
                        {"field": "GB", "aggregate": "sum", "format": ",.1f"}],
        },
    }
    gpu_line = {
        "data": {"values": [{}]},
        "transform": [{"calculate": "gpu_gb", "as": "GB"}],
        "layer": [{"mark": {"type": "rule", "strokeDash": [5, 3], "color": "black"},
                   "encoding": {"y": {"field": "GB", "type": "quantitative"}}},
                  {"mark": {"type": "text", "align": "right", "baseline": "bottom", "dy": -3, "x": "width",
                            "fontSize": 10},
                   "encoding": {"y": {"field": "GB", "type": "quantitative"},
                                "text": {"field": "label"}},
                   "transform": [{"calculate": "'GPU ' + format(gpu_gb, '.0f') + ' GB'", "as": "label"}]}],
    }
    verdict = {  # one line from the weights row (every setup has one): device GB against the GPU's
        "mark": {"type": "text", "align": "left", "x": 0, "y": -12, "fontSize": 11},
        "transform": [{"filter": SETUP + " && datum.part == 'weights'"},
                      {"calculate": "datum.device_bpp * pow(10, log10_params) / 1e9", "as": "device_GB"},
                      {"calculate": "(log10_params >= 9 ? format(pow(10, log10_params) / 1e9, '.3~g') + 'B' : "
                                    "format(pow(10, log10_params) / 1e6, '.3~g') + 'M') + ' params: device ' + "
                                    "format(datum.device_GB, ',.0f') + ' GB, ' + "
                                    "(datum.device_GB <= gpu_gb ? 'fits' : 'does NOT fit') + ' in ' + "
                                    "format(gpu_gb, '.0f') + ' GB'", "as": "line"}],
        "encoding": {"text": {"field": "line"}},
    }
    spec = {
        "description": "Bytes per tier of a training setup (predict.memory.footprint) against the GPU's memory",
        "params": params,
        "datasets": {"footprint": footprint_table()},
        "data": {"name": "footprint"},
        "width": 320, "height": 260,
        "padding": {"top": 24, "left": 5, "right": 5, "bottom": 5},
        "layer": [bars, gpu_line, verdict],
        "config": {"view": {"stroke": None}},
    }
    return Chart(spec, "footprint", "bytes per tier against GPU memory; sliders for parameters and GPU GB")
