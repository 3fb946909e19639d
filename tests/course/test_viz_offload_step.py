"""Chapter 4's figures (course/viz/offload_step.py): phase bars stack what they are given, in order; speedup curves
draw one line per way at the given ratios; both name bad input."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.offload_step import PHASE_COLORS, phase_bars, speedup_curves  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_phase_bars_stacks_one_segment_per_phase_in_ms():
    split = {"baseline": {"forward": 0.010, "backward": 0.020}, "offloaded": {"forward": 0.012, "cpu Adam": 0.003}}
    fig = phase_bars(split, ("forward", "backward", "cpu Adam"), "t")
    (ax,) = fig.axes
    bars = ax.patches
    assert len(bars) == 2 * 3
    widths = [round(b.get_width(), 6) for b in bars]
    assert widths == [10.0, 12.0, 20.0, 0.0, 0.0, 3.0]        # phase by phase, run by run; a missing phase is 0
    lefts = [round(b.get_x(), 6) for b in bars]
    assert lefts[2:4] == [10.0, 12.0] and lefts[4:] == [30.0, 12.0]   # each segment starts where the last ended
    assert bars[4].get_facecolor()[:3] == matplotlib.colors.to_rgb(PHASE_COLORS["cpu Adam"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "cpu Adam"]
    assert "ms" in ax.get_xlabel() and ax.get_title(loc="left") == "t"


def test_phase_bars_colours_an_unknown_phase_and_refuses_empty_input():
    fig = phase_bars({"a": {"gather": 0.001}}, ("gather",), "t")
    assert len(fig.axes[0].patches) == 1
    with pytest.raises(ValueError, match="at least one run"):
        phase_bars({}, ("forward",), "t")
    with pytest.raises(ValueError, match="at least one phase"):
        phase_bars({"a": {"forward": 1.0}}, (), "t")


def test_speedup_curves_draws_one_line_per_way_at_the_given_ratios():
    ratios = [0.25, 1.0, 4.0]
    curves = {"speculative": [1.1, 1.7, 1.2], "delayed": [1.2, 1.5, 1.1]}
    fig = speedup_curves(ratios, curves, "t")
    (ax,) = fig.axes
    lines = [line for line in ax.get_lines() if line.get_label() in curves]
    assert [line.get_label() for line in lines] == ["speculative", "delayed"]
    for line, values in zip(lines, curves.values(), strict=True):
        assert list(line.get_xdata()) == ratios and list(line.get_ydata()) == values
    assert lines[0].get_color() != lines[1].get_color() and lines[0].get_linestyle() != lines[1].get_linestyle()
    assert ax.get_xscale() == "log" and ax.get_title(loc="left") == "t"
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())  # the no-gain line


def test_speedup_curves_names_bad_input():
    with pytest.raises(ValueError, match="at least one curve"):
        speedup_curves([1.0], {}, "t")
    with pytest.raises(ValueError, match="positive number"):
        speedup_curves([0.0, 1.0], {"a": [1.0, 1.0]}, "t")
    with pytest.raises(ValueError, match="one speedup per ratio"):
        speedup_curves([1.0, 2.0], {"a": [1.0]}, "t")
