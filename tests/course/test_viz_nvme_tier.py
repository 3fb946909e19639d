"""Chapter 6's figures (course/viz/nvme_tier.py) draw the numbers they are given, and name bad input."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.nvme_tier import NO_FIT_COLOR, placement_grid, tune_sweep  # noqa: E402
from minioffload.predict.memory import MiB  # noqa: E402

ROWS = [{"block_size": b, "workers": w, "write_GBps": b / 2**20 * w, "read_GBps": 2 * b / 2**20 * w}
        for b in (1 << 16, 1 << 20) for w in (1, 2)]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_tune_sweep_draws_a_line_per_worker_count_on_each_side():
    fig = tune_sweep(ROWS, 128 * MiB, fio={"write": 3.0, "read": 4.0})
    write, read = fig.axes
    lines = [line for line in read.get_lines() if line.get_linestyle() != "--"]
    assert len(lines) == 2
    assert list(lines[1].get_xdata()) == [64, 1024] and list(lines[1].get_ydata()) == pytest.approx([0.25, 4.0])
    fio_line = [line for line in write.get_lines() if line.get_linestyle() == "--"]
    assert fio_line and fio_line[0].get_ydata()[0] == 3.0
    assert "128 MiB" in write.get_title() and "read" in read.get_title()
    assert [t.get_text() for t in read.get_legend().get_texts()] == ["1 worker", "2 workers", "fio, best (bench)"]


def test_tune_sweep_without_fio_and_without_rows():
    fig = tune_sweep(ROWS, 64 * MiB)
    assert all(line.get_linestyle() != "--" for line in fig.axes[0].get_lines())
    with pytest.raises(ValueError, match="rows of nvme_tune.tune"):
        tune_sweep([], MiB)


def test_placement_grid_labels_every_cell_and_colours_what_does_not_fit():
    placements = {("7B", "128 GB"): "optimizer_cpu", ("7B", "512 GB"): "optimizer_cpu",
                  ("70B", "128 GB"): None, ("70B", "512 GB"): "params_nvme"}
    fig = placement_grid(placements, ["7B", "70B"], ["128 GB", "512 GB"])
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.texts] == ["optimizer_cpu", "optimizer_cpu", "does not fit", "params_nvme"]
    assert ax.patches[2].get_facecolor()[:3] == matplotlib.colors.to_rgb(NO_FIT_COLOR)
    assert ax.patches[0].get_facecolor()[:3] != ax.patches[3].get_facecolor()[:3]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "512"]
    with pytest.raises(ValueError, match="no placement for"):
        placement_grid(placements, ["7B", "13B"], ["128 GB"])
