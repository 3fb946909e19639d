"""Explorers that work in the static book page: interactive Vega-Lite charts, no kernel and no network.

    from minioffload.course import explore
    explore.footprint_chart()                 # chapter 1: bytes per tier against GPU memory
    explore.timeline_chart(trace)             # chapters 2 and 4: a Trace's spans by lane, lane toggles, zoom
    explore.streaming_chart(work, hw)         # chapter 8: the step model's streamed step by depth, budget, link
    explore.plan_chart()                      # chapter 9: the planner's best plans over a precomputed grid
    explore.hiding_chart()                    # the appendix: the tokens at which each transfer hides

Each returns a `Chart`: JupyterLab draws it with its Vega-Lite renderer, the book with the Vega scripts it serves
itself (chart.py says how). What needs Python (memory.footprint, plan.search) is computed here into data tables;
the page only filters them by its menus and multiplies by its sliders. (stepmodel.predict too: the streaming chart
carries every prediction its controls can pick.)

What this is not: a replacement for `widgets` where a live kernel adds something (running the simulator); those
stay as they are.
"""

from .chart import Chart
from .footprint import footprint_chart, footprint_table
from .hiding import hiding_chart, hiding_table
from .plan import DEFAULT_GRID, plan_chart, plan_grid
from .streaming import streaming_chart, streaming_table
from .timeline import timeline_chart, timeline_table

__all__ = ["DEFAULT_GRID", "Chart", "footprint_chart", "footprint_table", "hiding_chart", "hiding_table", "plan_chart",
           "plan_grid", "streaming_chart", "streaming_table", "timeline_chart", "timeline_table"]
