"""Chapter 7's figures draw what they are given: one line per policy, the crossover's two lines and its marker."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.activations import (  # noqa: E402
    POLICY_COLORS,
    ledger_series,
    memory_by_policy,
    offload_crossover,
)

MiB = 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_ledger_series_is_ms_and_mib_beyond_the_base():
    events = [SimpleNamespace(time=1.0, used=10 * MiB), SimpleNamespace(time=1.002, used=14 * MiB)]
    times, used = ledger_series(events, base=10 * MiB)
    assert times == pytest.approx([0.0, 2.0])
    assert used == pytest.approx([0.0, 4.0])
    with pytest.raises(ValueError, match="at least one event"):
        ledger_series([])


def test_memory_by_policy_draws_one_line_per_policy_with_its_peak():
    series = {"keep": ([0, 1, 2], [0, 30, 0]), "offload": ([0, 1, 2], [0, 5, 0])}
    fig = memory_by_policy(series, peaks_mib={"keep": 30, "offload": 5})
    ax = fig.axes[0]
    assert len(fig.axes) == 1
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["keep (peak 30 MiB)", "offload (peak 5 MiB)"]
    assert list(ax.get_lines()[0].get_ydata()) == [0, 30, 0]
    assert ax.get_lines()[1].get_color() == POLICY_COLORS["offload"]
    assert "MiB" in ax.get_ylabel() and "ms" in ax.get_xlabel()
    with pytest.raises(ValueError):
        memory_by_policy({})


def test_offload_crossover_plots_measured_model_and_the_free_bandwidth():
    fig = offload_crossover([0.25, 1, 4], [4.0, 1.3, 1.2], [8.6, 2.5, 1.0], hide_gbps=5.3)
    ax = fig.axes[0]
    measured, model, free, one = ax.get_lines()
    assert list(measured.get_ydata()) == [4.0, 1.3, 1.2]
    assert list(model.get_ydata()) == [8.6, 2.5, 1.0]
    assert list(free.get_xdata()) == [5.3, 5.3]
    assert "5.3 GB/s" in free.get_label()
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.25", "1", "4"]
    with pytest.raises(ValueError, match="equally long"):
        offload_crossover([1, 2], [1.0], [1.0, 1.0], hide_gbps=1)
