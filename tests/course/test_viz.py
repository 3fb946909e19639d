"""Figure functions return figures that show what they claim; the widget redraws on change."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course import viz  # noqa: E402
from minioffload.predict import memory  # noqa: E402
from minioffload.predict.memory import GB  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_fit_grid_shows_device_gigabytes_and_colours_by_fit():
    fig = viz.fit_grid(memory.MODELS, memory.GPUS)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "2,800.0 GB" in texts  # GPT-3 175B, everything on the device: 16 B x 175e9
    assert "13.4 GB" in texts  # GPT-3 6.7B with the optimizer offloaded: 2 B x 6.7e9
    colours = {round(p.get_facecolor()[0], 3) for p in fig.axes[0].patches}
    assert len(colours) == 3  # fits the 80 GB GPU, the 141 GB one only, neither


def test_fit_chart_draws_one_line_per_distinct_device_footprint():
    fig = viz.fit_chart(memory.MODELS, memory.GPUS)
    labels = [line.get_label() for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
    assert labels == ["device (16 B/param)", "optimizer_cpu / optimizer_nvme (2 B/param)"]


def test_footprint_figure_stacks_parts_per_tier_and_says_whether_it_fits():
    fig = viz.footprint_figure(7e9, placement="optimizer_cpu", gpu_bytes=80 * GB)
    ax = fig.axes[0]
    assert "device 14 GB, fits" in ax.get_title()
    heights: dict[int, float] = {}  # bar position (0 device, 1 host, 2 nvme) -> stacked GB
    for bar in ax.patches:
        position = round(bar.get_x() + bar.get_width() / 2)
        heights[position] = heights.get(position, 0) + bar.get_height()
    assert heights[0] == pytest.approx(14) and heights[1] == pytest.approx(126)  # 2 and 18 B/param
    assert "does NOT fit" in viz.footprint_figure(7e9, gpu_bytes=80 * GB).axes[0].get_title()


def test_footprint_explorer_redraws_with_the_controls_values():
    from minioffload.course import widgets

    calls = []

    def spy(*args):
        calls.append(args)
        return viz.footprint_figure(*args)

    box = widgets.footprint_explorer(num_params=7e9, gpu_gb=80, draw=spy)
    assert calls[-1][1:] == ("mixed_bf16", "adam", "device", 80 * GB)
    assert calls[-1][0] == pytest.approx(7e9, rel=0.01)
    placement, gpu_gb = box.children[1].children[2], box.children[0].children[1]
    placement.value = "optimizer_cpu"
    gpu_gb.value = 141
    assert calls[-1][1:] == ("mixed_bf16", "adam", "optimizer_cpu", 141 * GB)
    assert len(calls) == 3


def test_fit_grid_legend_with_three_gpus_does_not_claim_the_largest():
    gpus = {"24 GB": 24 * GB, "80 GB": 80 * GB, "141 GB": 141 * GB}
    fig = viz.fit_grid(memory.MODELS, gpus)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["fits 24 GB", "fits a larger GPU only", "fits none"]


def test_footprint_figure_adds_activations_to_the_device():
    fig = viz.footprint_figure(6.7e9, placement="optimizer_cpu", gpu_bytes=80 * GB, activation_bytes=73e9)
    assert "device 86 GB, does NOT fit" in fig.axes[0].get_title()
    assert "activations" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
