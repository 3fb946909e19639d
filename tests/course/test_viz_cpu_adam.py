"""Chapter 3's figures plot the rates they are given: useful and extra bandwidth per version, thread scaling."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.cpu_adam import adam_bandwidth_bars, thread_scaling  # noqa: E402

N = 10_000_000


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_bars_stack_extra_bytes_on_the_useful_rate_and_draw_the_roofline():
    seconds = {"adam_ref": 0.1, "adam_fused": 0.01, "torch fused": 0.014}
    fig = adam_bandwidth_bars(seconds, {"adam_ref": 156, "adam_fused": 28}, N, roofline=30e9, threads=2)
    ax = fig.axes[0]
    assert len(fig.axes) == 1
    bars = ax.patches
    assert len(bars) == 2 * len(seconds)                     # useful, then extra, one of each per version
    useful = [b.get_height() for b in bars[:3]]
    extra = [b.get_height() for b in bars[3:]]
    np.testing.assert_allclose(useful, [28 * N / s / 1e9 for s in seconds.values()])
    np.testing.assert_allclose(extra, [128 * N / 0.1 / 1e9, 0, 0])
    assert [b.get_y() for b in bars[3:]] == pytest.approx(useful)     # stacked on the useful part
    assert [t.get_text() for t in ax.get_xticklabels()] == list(seconds)
    roof = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(roof) == 1 and roof[0].get_ydata()[0] == pytest.approx(30.0)
    assert ax.get_ylabel() == "GB/s" and "10M" in ax.get_title() and "2 threads" in ax.get_title()
    assert ax.get_ylim()[1] > useful[1]                      # the fastest bar is inside the axes


def test_bars_refuse_empty_or_non_positive_inputs():
    with pytest.raises(ValueError, match="at least one"):
        adam_bandwidth_bars({}, {}, N, roofline=1e9)
    with pytest.raises(ValueError, match="positive"):
        adam_bandwidth_bars({"adam_fused": 0.0}, {}, N, roofline=1e9)


def test_thread_scaling_plots_both_series_in_thread_order():
    fig = thread_scaling({2: (40e9, 44e9), 1: (20e9, 22e9)}, N)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"roofline (7 streams)", "adam_fused"}
    assert list(lines["adam_fused"].get_xdata()) == [1, 2]
    assert list(lines["adam_fused"].get_ydata()) == pytest.approx([20.0, 40.0])
    assert list(lines["roofline (7 streams)"].get_ydata()) == pytest.approx([22.0, 44.0])
    assert ax.get_xlabel() == "threads" and ax.get_ylim()[0] == 0
    with pytest.raises(ValueError):
        thread_scaling({}, N)
