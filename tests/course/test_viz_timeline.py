"""Timeline, bandwidth and memory figures show what the trace or ledger holds; the explorer redraws."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minioffload.course import viz  # noqa: E402
from minioffload.course.viz.style import LANE_COLORS, lane_color, tier_color  # noqa: E402
from minioffload.predict.memory import GiB, Ledger  # noqa: E402
from minioffload.trace import LANE_ORDER, Trace  # noqa: E402

MB = 10**6


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def chunked_trace(chunks: int = 4) -> Trace:
    """h2d 10 ms -> compute 14 ms -> d2h 8 ms per chunk, each lane in order, copies overlapping compute."""
    trace = Trace()
    h2d_end = compute_end = d2h_end = 0.0
    for k in range(chunks):
        trace.record("h2d", f"h2d {k}", h2d_end, h2d_end + 0.010, 256 * MB)
        h2d_end += 0.010
        compute_start = max(h2d_end, compute_end)
        trace.record("compute", f"layer {k}", compute_start, compute_start + 0.014)
        compute_end = compute_start + 0.014
        d2h_start = max(compute_end, d2h_end)
        trace.record("d2h", f"d2h {k}", d2h_start, d2h_start + 0.008, 128 * MB)
        d2h_end = d2h_start + 0.008
    trace.record("custom", "extra", 0.005, 0.006)
    return trace


def row_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_style_gives_every_lane_a_fixed_colour_and_others_a_stable_fallback():
    assert set(LANE_ORDER) <= set(LANE_COLORS)
    assert len(set(LANE_COLORS.values())) == len(LANE_COLORS)
    assert lane_color("h2d") == LANE_COLORS["h2d"]
    assert lane_color("my_lane") == lane_color("my_lane") == "#CCB974"  # crc32: same in every run
    assert tier_color("pinned") != tier_color("pageable")


def test_timeline_draws_one_row_per_lane_top_to_bottom_in_lane_order():
    trace = chunked_trace()
    fig = viz.timeline(trace)
    ax = fig.axes[0]
    assert row_labels(fig) == ["h2d", "compute", "d2h", "custom"]
    bottom, top = ax.get_ylim()
    assert bottom > top  # row 0 (the first lane) is drawn at the top
    for bars in ax.collections:
        assert to_rgba(bars.get_facecolor()[0]) == to_rgba(lane_color(bars.get_label()))
        assert len(bars.get_paths()) == len(trace.on(bars.get_label()))
    assert LANE_COLORS["compute"] == lane_color("compute")
    assert "makespan 74 ms, overlap" in ax.get_title(loc="right")
    x0, x1 = ax.get_xlim()
    assert x0 <= 0 and x1 >= 74  # milliseconds, the whole trace
    assert "layer 1" in [t.get_text() for t in ax.texts]  # wide spans are named


def test_timeline_respects_lanes_and_t_range():
    fig = viz.timeline(chunked_trace(), lanes=["compute", "h2d"], t_range=(0.020, 0.045), title="zoomed")
    ax = fig.axes[0]
    assert row_labels(fig) == ["compute", "h2d"]
    assert ax.get_xlim() == pytest.approx((20, 45))
    assert ax.get_title(loc="left") == "zoomed"
    assert {bars.get_label() for bars in ax.collections} == {"compute", "h2d"}
    with pytest.raises(ValueError, match="t_range"):
        viz.timeline(chunked_trace(), t_range=(0.02, 0.01))


def test_timeline_of_an_empty_trace_or_no_lanes_says_so():
    assert "no spans" in [t.get_text() for t in viz.timeline(Trace()).axes[0].texts]
    no_lanes = viz.timeline(chunked_trace(), lanes=[])
    assert "no lanes selected" in [t.get_text() for t in no_lanes.axes[0].texts]


def test_binned_bandwidth_spreads_one_span_over_the_bins_it_covers():
    trace = Trace()
    trace.record("h2d", "copy", 0.0, 0.5, 10**9)
    trace.record("compute", "k", 0.0, 1.0)  # stretches the trace to 1 s: 10 bins of 0.1 s
    edges, rate = viz.binned_bandwidth(trace, 10, "h2d")
    assert edges == pytest.approx(np.linspace(0, 1, 11))
    assert rate == pytest.approx([2e9] * 5 + [0.0] * 5)  # 1 GB over 0.5 s
    assert viz.binned_bandwidth(trace, 10, "compute")[1] == pytest.approx(np.zeros(10))
    with pytest.raises(ValueError, match="bins"):
        viz.binned_bandwidth(trace, 0, "h2d")


@pytest.mark.parametrize("bins", [1, 7, 50, 333])
def test_binned_bandwidth_conserves_bytes(bins):
    trace = chunked_trace()
    trace.record("h2d", "instant", 0.003, 0.003, 12345)  # zero duration: all of it lands in one bin
    for lane in ("h2d", "d2h"):
        edges, rate = viz.binned_bandwidth(trace, bins, lane)
        assert len(edges) == bins + 1 and len(rate) == bins
        assert np.sum(rate * np.diff(edges)) == pytest.approx(sum(s.nbytes for s in trace.on(lane)), rel=1e-9)


def test_bandwidth_over_time_draws_one_step_line_per_lane_that_moves_bytes():
    fig = viz.bandwidth_over_time(chunked_trace(), bins=37)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [label.split()[0] for label in labels] == ["h2d", "d2h"]  # compute and custom move nothing
    assert labels[0] == "h2d (25.6 GB/s while busy)"
    assert ax.get_ylim()[1] >= 25.6  # GB/s
    assert "no bytes moved" in [t.get_text() for t in viz.bandwidth_over_time(Trace()).axes[0].texts]
    only_d2h = viz.bandwidth_over_time(chunked_trace(), lanes=["d2h"]).axes[0]
    assert [t.get_text().split()[0] for t in only_d2h.get_legend().get_texts()] == ["d2h"]


def fake_clock(*times: float):
    return iter(times).__next__


def small_ledger() -> Ledger:
    ledger = Ledger({"device": 8 * GiB, "pinned": 4 * GiB, "nvme": None},
                    clock=fake_clock(10.0, 10.001, 10.004, 10.006))
    ledger.allocate("weights", "device", 3 * GiB)  # t = 0 ms
    ledger.allocate("buffer", "pinned", GiB)  # t = 1 ms
    ledger.allocate("activations", "device", 4 * GiB)  # t = 4 ms
    ledger.free("activations")  # t = 6 ms
    return ledger


def test_usage_series_follows_the_ledger_from_zero():
    ledger = small_ledger()
    times, used = viz.usage_series(ledger, "device")
    assert times == pytest.approx([0.0, 0.0, 0.004, 0.006])
    assert list(used) == [0, 3 * GiB, 7 * GiB, 3 * GiB]
    times, used = viz.usage_series(ledger, "pinned")
    assert times == pytest.approx([0.0, 0.001]) and list(used) == [0, GiB]
    times, used = viz.usage_series(ledger, "nvme")
    assert list(times) == [0.0] and list(used) == [0]
    with pytest.raises(ValueError, match="unknown tier"):
        viz.usage_series(ledger, "tape")


def test_memory_over_time_draws_usage_and_capacity_in_gib():
    fig = viz.memory_over_time(small_ledger(), tiers=["device", "pinned"])
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    device = lines["device (peak 7.00 GiB)"]
    assert max(device.get_ydata()) == pytest.approx(7)
    assert device.get_xdata()[2] == pytest.approx(4)  # ms after the first event
    capacity = lines["device capacity 8.00 GiB"]
    assert capacity.get_linestyle() == "--" and set(capacity.get_ydata()) == {8}
    assert to_rgba(capacity.get_color()) == to_rgba(tier_color("device"))
    assert "pinned capacity 4.00 GiB" in lines
    assert ax.get_ylabel() == "in use (GiB)"
    no_caps = viz.memory_over_time(small_ledger(), capacity_lines=False).axes[0]
    assert not [line for line in no_caps.get_lines() if "capacity" in line.get_label()]
    assert len(no_caps.get_lines()) == 3  # device, pinned, nvme
    empty = viz.memory_over_time(Ledger({"device": GiB}))
    assert "no allocations" in [t.get_text() for t in empty.axes[0].texts]


def test_timeline_explorer_redraws_with_the_lanes_and_zoom_chosen():
    from minioffload.course import widgets

    calls = []

    def spy(trace, **kwargs):
        calls.append(kwargs)
        return viz.timeline(trace, **kwargs)

    trace = chunked_trace()
    box = widgets.timeline_explorer(trace, draw=spy)
    assert calls[-1]["lanes"] == ["h2d", "compute", "d2h", "custom"]
    assert calls[-1]["t_range"] == pytest.approx((0.0, 0.074))
    toggles, zoom = box.children[0].children, box.children[1]
    assert [t.description for t in toggles] == ["h2d", "compute", "d2h", "custom"]
    toggles[1].value = False
    assert calls[-1]["lanes"] == ["h2d", "d2h", "custom"]
    zoom.value = (20.0, 45.0)
    assert calls[-1]["t_range"] == pytest.approx((0.020, 0.045))
    assert calls[-1]["lanes"] == ["h2d", "d2h", "custom"]
    assert len(calls) == 3
