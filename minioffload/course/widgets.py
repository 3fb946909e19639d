"""Interactive wrappers over the figure functions in `minioffload.course.viz`.

Thin on purpose: each widget only maps controls to a pure figure function's arguments, so the
static book shows the same figure and tests call the function, not the widget.
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.figure import Figure

from ..machine.profiles import PAPER_PRESETS, PRESETS, preset
from ..planner import search as planner
from ..predict.memory import GB, OPTIMIZERS, PLACEMENTS, PRECISIONS
from ..trace import Trace
from .viz import footprint_figure, plan_memory, streamed_step, timeline


def footprint_explorer(num_params: float = 7e9, gpu_gb: float = 80,
                       draw: Callable[..., Figure] = footprint_figure) -> widgets.VBox:
    """Sliders and menus over `footprint_figure` (or `draw`, same signature): parameters (log scale),
    precision, optimizer, placement and GPU memory."""
    controls = {
        "num_params": widgets.FloatLogSlider(value=num_params, base=10, min=8, max=12, step=0.01,
                                             description="parameters", readout_format=".3g",
                                             continuous_update=False),
        "precision": widgets.Dropdown(options=PRECISIONS, value="mixed_bf16", description="precision"),
        "optimizer": widgets.Dropdown(options=OPTIMIZERS, value="adam", description="optimizer"),
        "placement": widgets.Dropdown(options=PLACEMENTS, value="device", description="placement"),
        "gpu_gb": widgets.FloatSlider(value=gpu_gb, min=8, max=192, step=1, description="GPU GB",
                                      continuous_update=False),
    }
    out = widgets.Output()

    def redraw(_change=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        with out:
            out.clear_output(wait=True)
            fig = draw(values["num_params"], values["precision"], values["optimizer"],
                                   values["placement"], values["gpu_gb"] * GB)
            display(fig)
            plt.close(fig)

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([controls["num_params"], controls["gpu_gb"]]),
                         widgets.HBox([controls["precision"], controls["optimizer"], controls["placement"]]),
                         out])


def timeline_explorer(trace: Trace, draw: Callable[..., Figure] = timeline) -> widgets.VBox:
    """A checkbox per lane and a zoom slider (ms) over `timeline` (or `draw`, called as
    `draw(trace, lanes=[...], t_range=(t0, t1))` with seconds)."""
    end_ms = max((s.end for s in trace.spans), default=0.0) * 1e3 or 1.0
    toggles = {lane: widgets.Checkbox(value=True, description=lane, indent=False,
                                      layout=widgets.Layout(width="auto"))
               for lane in trace.lanes()}
    zoom = widgets.FloatRangeSlider(value=(0.0, end_ms), min=0.0, max=end_ms, step=end_ms / 1000,
                                    description="zoom (ms)", readout_format=".3g", continuous_update=False,
                                    layout=widgets.Layout(width="95%"))
    out = widgets.Output()

    def redraw(_change=None) -> None:
        lanes = [lane for lane, toggle in toggles.items() if toggle.value]
        lo_ms, hi_ms = zoom.value
        with out:
            out.clear_output(wait=True)
            fig = draw(trace, lanes=lanes, t_range=(lo_ms / 1e3, hi_ms / 1e3))
            display(fig)
            plt.close(fig)

    for control in [*toggles.values(), zoom]:
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox(list(toggles.values())), zoom, out])


def streaming_explorer(work, hw, draw: Callable[..., Figure] = streamed_step) -> widgets.VBox:
    """Sliders over `streamed_step` (or `draw`, same signature): prefetch depth, budget in blocks, the link's
    GB/s, and where the weights live."""
    controls = {
        "prefetch": widgets.IntSlider(value=1, min=0, max=4, description="prefetch", continuous_update=False),
        "budget_blocks": widgets.IntSlider(value=3, min=1, max=6, description="budget (blocks)",
                                           continuous_update=False),
        "link_gbps": widgets.FloatLogSlider(value=hw.link_h2d / GB, base=10, min=-1, max=3, step=0.05,
                                            description="link GB/s", readout_format=".3g", continuous_update=False),
        "params_on": widgets.Dropdown(options=["host", "nvme"], value="host", description="weights on"),
    }
    out = widgets.Output()

    def redraw(_change=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        link = values["link_gbps"] * GB
        with out:
            out.clear_output(wait=True)
            fig = draw(work, hw.replace(link_h2d=link, link_d2h=link), values["prefetch"], values["budget_blocks"],
                       values["params_on"])
            display(fig)
            plt.close(fig)

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([controls["prefetch"], controls["budget_blocks"]]),
                         widgets.HBox([controls["link_gbps"], controls["params_on"]]), out])


def plan_explorer(params: float = 70e9, hardware: str = "h100-sxm", host_gb: float = 512, nvme_gb: float = 4000,
                  batch: int = 8, top: int = 4, search: Callable[..., list] = planner.search,
                  draw: Callable[..., Figure] = plan_memory) -> widgets.VBox:
    """Sliders and menus over the planner: model size (a GPT-3-family shape, log scale), hardware preset, host and
    NVMe GB (0: no NVMe) and the batch. Shows the best plan of each kind (`plan.table`) and `draw(plans)` (bytes per
    tier against capacity), or NoPlanError's message and `draw([], capacity=..., short=...)` when nothing fits.
    `search(spec, hw, limits)` is `plan.search` unless given (tests pass a faster one)."""
    names = [*PRESETS, *PAPER_PRESETS]
    if hardware not in names:
        raise ValueError(f"unknown hardware preset {hardware!r}; choose one of {', '.join(names)}")
    controls = {
        "params": widgets.FloatLogSlider(value=params, base=10, min=8.5, max=11.6, step=0.01, description="parameters",
                                         readout_format=".3g", continuous_update=False),
        "hardware": widgets.Dropdown(options=names, value=hardware, description="hardware"),
        "host_gb": widgets.FloatLogSlider(value=host_gb, base=10, min=1, max=4, step=0.01, description="host GB",
                                          readout_format=".4g", continuous_update=False),
        "nvme_gb": widgets.FloatSlider(value=nvme_gb, min=0, max=32000, step=250, description="NVMe GB",
                                       readout_format=".0f", continuous_update=False),
        "batch": widgets.Dropdown(options=[1, 2, 4, 8, 16, 32], value=batch, description="batch"),
    }
    table, out = widgets.Output(), widgets.Output()

    def redraw(_change=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        spec = planner.ModelSpec.of_params(values["params"])
        hw = preset(values["hardware"])
        limits = planner.Limits(batch=values["batch"], host_bytes=values["host_gb"] * GB,
                                nvme_bytes=values["nvme_gb"] * GB)
        try:
            plans, error = planner.best_per_family(search(spec, hw, limits))[:top], None
        except planner.NoPlanError as err:
            plans, error = [], err
        with table:
            table.clear_output(wait=True)
            print(f"{spec} on {hw.name}, batch {values['batch']}")
            print(str(error) if error else planner.table(plans))
        with out:
            out.clear_output(wait=True)
            fig = draw(plans) if plans else draw([], capacity=limits.capacity(hw), short=error.short)
            display(fig)
            plt.close(fig)

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([controls["params"], controls["hardware"]]),
                         widgets.HBox([controls["host_gb"], controls["nvme_gb"], controls["batch"]]), table, out])
