"""Chapter 4's phase bars (course/viz/offload_step.py) stack what they are given, in order, and name bad input."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.offload_step import PHASE_COLORS, phase_bars  # noqa: E402


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
