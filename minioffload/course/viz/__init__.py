"""Figures: pure functions that take data and return a matplotlib Figure (no display, no globals)."""

from .bandwidth import bandwidth_vs_size
from .footprint import fit_chart, fit_grid, footprint_figure
from .memory_plot import memory_over_time, usage_series
from .plan import plan_memory, policy_mix, timeline_pair, what_if_grid
from .step import predicted_vs_measured
from .streaming import streamed_step
from .timeline import bandwidth_over_time, binned_bandwidth, timeline

__all__ = ["bandwidth_over_time", "bandwidth_vs_size", "binned_bandwidth", "fit_chart", "fit_grid",
           "footprint_figure", "memory_over_time", "plan_memory", "policy_mix", "predicted_vs_measured",
           "streamed_step", "timeline", "timeline_pair", "usage_series", "what_if_grid"]
