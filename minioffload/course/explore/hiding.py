"""The appendix's "when does it hide?" calculator in the page: each mechanism's threshold in tokens per micro-batch
against a tokens slider, for a GPU preset and a model size.

Every token threshold of predict/hiding.py is proportional to the FLOP rate the compute runs at, peak x mfu (more
FLOP/s leaves less time to hide under), so `hiding_table` computes each one here at mfu 1 and the page multiplies it
by the mfu slider: threshold = threshold_at_full_rate x mfu. A bar is green when the slider's tokens reach it.

What this is not: a second model. Every threshold the chart draws is a row of `hiding_table` times the slider; tests
check the rows against predict/hiding.py at other mfu values.
"""

from __future__ import annotations

import math

from ...machine import profiles
from ...predict import hiding
from ...predict.shapes import ModelSpec
from .chart import Chart

SIZES = {"7B": 7e9, "13B": 13e9, "70B": 70e9}
TOKENS_LOG10 = (2.0, 6.0)  # the slider: 100 to 1M tokens per micro-batch
THRESHOLD_EXPR = "datum.threshold_full_rate * mfu"  # the one calculation the page does
MECHANISMS = {  # label -> the condition, from a workload and a profile (mfu 1)
    "weights streamed from host": lambda work, hw: hiding.streamed_fetch(work, hw, "host", mfu=1.0),
    "weights streamed from NVMe": lambda work, hw: hiding.streamed_fetch(work, hw, "nvme", mfu=1.0),
    "gradients to the host": lambda work, hw: hiding.gradient_copies(work, hw, mfu=1.0),
    "delayed CPU update": lambda work, hw: hiding.delayed_update(work, hw, mfu=1.0),
    "lazy checkpoint write": lambda work, hw: hiding.checkpoint_write(work, hw, mfu=1.0),
}


def gpu_presets() -> list[str]:
    return [name for name, hw in profiles.PRESETS.items() if not hw.shared_host]


def hiding_table() -> list[dict]:
    """One row per (preset, size, mechanism): {preset, size, mechanism, threshold_full_rate} in tokens per
    micro-batch at mfu 1, for a GPT-3-family model of that size in bf16."""
    rows = []
    for name in gpu_presets():
        hw = profiles.preset(name)
        for size, params in SIZES.items():
            work = ModelSpec.of_params(params).workload(2048)
            rows += [{"preset": name, "size": size, "mechanism": label,
                      "threshold_full_rate": condition(work, hw).threshold, "order": i}
                     for i, (label, condition) in enumerate(MECHANISMS.items())]
    return rows


def hiding_chart(preset: str = "h100-sxm", size: str = "7B", tokens: int = 8 * 2048, mfu: float = 0.4) -> Chart:
    """Bars of each mechanism's threshold (tokens per micro-batch, log scale) for one preset and model size, a rule
    at the tokens slider, green where the work hides; menus for the preset and the size, sliders for tokens and
    mfu. The arguments are the controls' starting values."""
    presets = gpu_presets()
    if preset not in presets:
        raise ValueError(f"unknown GPU preset {preset!r}; choose one of {', '.join(presets)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if not (isinstance(tokens, (int, float)) and 10 ** TOKENS_LOG10[0] <= tokens <= 10 ** TOKENS_LOG10[1]):
        raise ValueError(f"tokens must be from 100 to 1,000,000 per micro-batch (the slider's range), got {tokens!r}")
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0.05 <= mfu <= 1:
        raise ValueError(f"mfu must be from 0.05 to 1, got {mfu!r}")
    params = [
        {"name": "log10_tokens", "value": round(math.log10(tokens), 3),
         "bind": {"input": "range", "min": TOKENS_LOG10[0], "max": TOKENS_LOG10[1], "step": 0.01,
                  "name": "tokens per micro-batch (log10) "}},
        {"name": "mfu", "value": mfu, "bind": {"input": "range", "min": 0.05, "max": 1, "step": 0.05, "name": "mfu "}},
        {"name": "preset", "value": preset, "bind": {"input": "select", "options": presets, "name": "machine "}},
        {"name": "size", "value": size, "bind": {"input": "select", "options": list(SIZES), "name": "model "}},
    ]
    setup = [{"filter": "datum.preset == preset && datum.size == size"},
             {"calculate": THRESHOLD_EXPR, "as": "threshold"},
             {"calculate": "pow(10, log10_tokens) >= datum.threshold ? 'hides' : 'exposed'", "as": "verdict"}]
    bars = {
        "mark": {"type": "bar"},
        "transform": setup,
        "encoding": {
            "y": {"field": "mechanism", "type": "nominal", "sort": list(MECHANISMS), "title": None},
            "x": {"field": "threshold", "type": "quantitative", "scale": {"type": "log", "domain": [10, 1e7]},
                  "title": "tokens per micro-batch at which it hides"},
            "color": {"field": "verdict", "type": "nominal", "title": None,
                      "scale": {"domain": ["hides", "exposed"], "range": ["#4c9a2a", "#c8553d"]}},
            "tooltip": [{"field": "mechanism"}, {"field": "threshold", "format": ",.0f", "title": "threshold"},
                        {"field": "verdict"}],
        },
    }
    rule = {
        "data": {"values": [{}]},
        "transform": [{"calculate": "pow(10, log10_tokens)", "as": "tokens"},
                      {"calculate": "format(pow(10, log10_tokens), ',.0f') + ' tokens'", "as": "label"}],
        "layer": [{"mark": {"type": "rule", "strokeDash": [5, 3], "color": "black"},
                   "encoding": {"x": {"field": "tokens", "type": "quantitative"}}},
                  {"mark": {"type": "text", "align": "left", "dx": 3, "y": -6, "fontSize": 10},
                   "encoding": {"x": {"field": "tokens", "type": "quantitative"}, "text": {"field": "label"}}}],
    }
    spec = {
        "description": "Tokens per micro-batch at which each transfer hides under compute (predict.hiding)",
        "params": params,
        "datasets": {"hiding": hiding_table()},
        "data": {"name": "hiding"},
        "width": 420, "height": 170,
        "padding": {"top": 18, "left": 5, "right": 5, "bottom": 5},
        "layer": [bars, rule],
        "config": {"view": {"stroke": None}},
    }
    return Chart(spec, "hiding", "the tokens per micro-batch at which each transfer hides; sliders for tokens and mfu")
