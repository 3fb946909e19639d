"""Chapter 8's window figure: the held bytes follow the streamed blocks' events only, one line and budget per depth."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz.streaming_window import held_series, window_memory  # noqa: E402

MiB = 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def event(name, delta, time):
    return SimpleNamespace(name=name, delta=delta, time=time)


def test_held_series_counts_streamed_blocks_only_and_draws_from_since():
    history = [event("streamed block 0", 3 * MiB, 0.0),      # before the step: counted, not drawn
               event("grad", 9 * MiB, 0.5),                  # not a streamed block: ignored
               event("streamed block 1", 3 * MiB, 1.0),
               event("streamed block 0", -3 * MiB, 1.004)]
    times, held = held_series(history, since=2)
    assert times == pytest.approx([0.0, 4.0])
    assert held == [6 * MiB, 3 * MiB]
    with pytest.raises(ValueError, match="outside the history"):
        held_series(history, since=4)


def test_window_memory_draws_a_line_and_a_budget_per_depth():
    series = {0: ([0, 1], [3 * MiB, 0]), 1: ([0, 1], [6 * MiB, 3 * MiB])}
    fig = window_memory(series, budgets={0: 3 * MiB, 1: 6 * MiB})
    ax = fig.axes[0]
    assert len(fig.axes) == 1
    lines = ax.get_lines()
    assert len(lines) == 4  # a step line and a budget line per depth
    assert list(lines[2].get_ydata()) == [6, 3]
    assert list(lines[3].get_ydata()) == [6, 6]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["depth 0 (budget 3 MiB)", "depth 1 (budget 6 MiB)"]
    with pytest.raises(ValueError, match="no budget"):
        window_memory(series, budgets={0: 3 * MiB})
