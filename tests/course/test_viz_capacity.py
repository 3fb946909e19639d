"""Chapter 12's figures (course/viz/capacity.py) draw the numbers they are given, and name bad input."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.capacity import bytes_by_tier, drive_use  # noqa: E402
from minioffload.trace import Trace  # noqa: E402

ROWS = [{"label": "small host", "device": 20e9, "host": 250e9, "nvme": 6e12, "host_capacity": 256e9},
        {"label": "large host", "device": 20e9, "host": 1.7e12, "nvme": 4e12, "host_capacity": 2048e9}]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_bytes_by_tier_draws_a_bar_per_tier_and_row_with_each_capacity():
    fig = bytes_by_tier(ROWS, {"device": 24e9, "nvme": 8e12})
    ax = fig.axes[0]
    heights = sorted(round(p.get_height()) for p in ax.patches)
    assert heights == sorted([20, 250, 6000, 20, 1700, 4000])  # GB
    ticks = sorted(round(float(np.ravel(c.get_segments()[0])[1])) for c in ax.collections)
    assert ticks == sorted([24, 256, 8000, 24, 2048, 8000])  # each row's host capacity, the others from `capacity`
    assert [t.get_text() for t in ax.get_xticklabels()] == ["small host", "large host"]


def test_bytes_by_tier_names_a_missing_tier_and_no_rows():
    with pytest.raises(ValueError, match="missing \\['nvme'\\]"):
        bytes_by_tier([{"label": "x", "device": 1, "host": 1}])
    with pytest.raises(ValueError, match="at least one row"):
        bytes_by_tier([])


def test_drive_use_stacks_writes_on_reads_and_marks_the_rate():
    trace = Trace()
    trace.record("nvme_read", "r", 0.0, 1.0, 100_000_000)  # 100 MB/s for a second
    trace.record("nvme_write", "w", 0.0, 1.0, 50_000_000)  # 50 MB/s beside it
    fig = drive_use(trace, 150e6, {"update": 0.5}, bins=4)
    ax = fig.axes[0]
    reads, writes = ax.patches[:2]
    assert np.allclose(reads.get_path().vertices[:, 1].max(), 100)
    assert np.allclose(writes.get_path().vertices[:, 1].max(), 150)  # stacked: 100 + 50
    rate = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert rate and rate[0].get_ydata()[0] == pytest.approx(150)
    assert any(t.get_text() == "update" for t in ax.texts)
    with pytest.raises(ValueError, match="nvme_read or nvme_write spans"):
        drive_use(Trace(), 1e6)
