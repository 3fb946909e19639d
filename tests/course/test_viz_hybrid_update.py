"""Chapter 5's figures (course/viz/hybrid_update.py) draw the numbers they are given, and name bad input."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.hybrid_update import link_by_phase, memory_by_phase, split_sweep  # noqa: E402
from minioffload.predict.memory import MiB  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


WINDOWS = {"forward": (0.0, 0.01), "backward": (0.01, 0.02), "update": (0.02, 0.03)}


def test_memory_by_phase_draws_one_panel_per_run_with_the_levels_in_mib():
    run = {"seconds": np.array([-1.0, 0.005, 0.015, 0.025]), "used": np.array([4, 20, 10, 4]) * MiB,
           "windows": WINDOWS}
    fig = memory_by_phase({"a": run, "b": run}, 40 * MiB, "title")
    assert len(fig.axes) == 2
    ax = fig.axes[0]
    level, capacity = ax.get_lines()
    assert list(level.get_ydata()) == [4, 20, 10, 4, 4]                # starts at the level before 0, ends at update
    assert list(level.get_xdata()) == pytest.approx([0, 5, 15, 25, 30])
    assert capacity.get_ydata()[0] == 40
    assert [t.get_text() for t in ax.texts] == ["forward", "backward", "update"]
    assert ax.get_title(loc="left") == "a"


def test_memory_by_phase_names_a_run_without_an_update_window_or_a_start():
    run = {"seconds": np.array([0.0]), "used": np.array([1.0]), "windows": {"forward": (0, 1)}}
    with pytest.raises(ValueError, match="no 'update' window"):
        memory_by_phase({"r": run}, MiB)
    late = {"seconds": np.array([0.5]), "used": np.array([1.0]), "windows": WINDOWS}
    with pytest.raises(ValueError, match="at or before time 0"):
        memory_by_phase({"late": late}, MiB)


def test_link_by_phase_draws_bytes_per_param_for_each_direction():
    moved = {"backward": {"d2h": 400.0, "h2d": 0.0}, "update": {"d2h": 0.0, "h2d": 600.0}}
    fig = link_by_phase({"cpu only": moved}, num_params=100)
    (ax,) = fig.axes
    assert [round(p.get_height(), 6) for p in ax.patches] == [4.0, 0.0, 0.0, 6.0]   # d2h bars, then h2d bars
    assert [t.get_text() for t in ax.get_xticklabels()] == ["backward", "update"]
    with pytest.raises(ValueError, match="num_params"):
        link_by_phase({"a": moved}, 0)


def test_split_sweep_plots_points_curves_and_the_picked_iterations():
    def point(share, update):
        return {"share": share, "update": update, "iteration": 2 * update}

    strides = {"stride 1": point(1.0, 0.1), "stride 3": point(0.33, 0.06)}
    fractions = {"fraction 0.5": point(0.5, 0.03)}
    grid = np.linspace(0, 1, 5)
    curves = {"model": (grid, 0.05 * (1 - grid) + 0.01, "#4C72B0", "-")}
    fig = split_sweep(point(0.0, 0.05), strides, fractions, curves, 0.4, ["CPU only", "fraction 0.5"])
    ax, bars = fig.axes
    (model,) = ax.get_lines()[:1]
    assert list(model.get_ydata()) == pytest.approx([60, 47.5, 35, 22.5, 10])     # seconds drawn as ms
    assert len(ax.collections) == 3                                               # strides, fractions, CPU only
    assert [a.get_text() for a in ax.texts][:2] == ["1", "3"]                     # each stride labelled by k
    assert [round(p.get_height(), 6) for p in bars.patches] == [100.0, 60.0]
    with pytest.raises(ValueError, match="not among the measured runs"):
        split_sweep(point(0.0, 0.05), strides, fractions, curves, 0.4, ["stride 9"])
