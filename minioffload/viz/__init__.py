"""Figures: pure functions that take data and return a matplotlib Figure (no display, no globals)."""

from .footprint import fit_chart, fit_grid, footprint_figure

__all__ = ["fit_chart", "fit_grid", "footprint_figure"]
