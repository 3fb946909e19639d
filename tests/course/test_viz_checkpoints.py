"""Chapter 11's figures (course/viz/checkpoints.py) draw what they are given and refuse what they cannot draw."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz import checkpoints  # noqa: E402
from minioffload.trace import Trace  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def steps_with_a_checkpoint() -> Trace:
    """Two steps; after the first update a writer puts three files on nvme_write under the second forward."""
    trace = Trace(origin=0.0)
    for t in (0.0, 0.1):
        trace.record("compute", "forward", t, t + 0.03)
        trace.record("compute", "backward", t + 0.03, t + 0.07)
        trace.record("d2h", "grad", t + 0.05, t + 0.07, 4000)
        trace.record("cpu", "adam", t + 0.07, t + 0.09, 28000)
        trace.record("h2d", "weights", t + 0.09, t + 0.095, 4000)
    for i, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
        trace.record("nvme_write", f"subgroup0/{name}", 0.1 + 0.01 * i, 0.11 + 0.01 * i, 4096)
    return trace


def bar_widths(ax) -> list[float]:
    return [round(p.get_width(), 6) for p in ax.patches]


def test_checkpoint_timeline_draws_the_lanes_present_and_a_line_per_mark():
    fig = checkpoints.checkpoint_timeline(steps_with_a_checkpoint(), marks=[("save(1)", 0.096), ("committed", 0.13)])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["compute", "cpu", "d2h", "h2d", "nvme_write"]
    writes = ax.collections[-1]
    assert len(writes.get_paths()) == 3  # the writer's three files
    dashed = [line.get_xdata()[0] for line in ax.lines]
    assert dashed == pytest.approx([96.0, 130.0])  # in ms
    assert {"save(1)", "committed"} <= {t.get_text().strip() for t in ax.texts}
    close = checkpoints.checkpoint_timeline(steps_with_a_checkpoint(), marks=[("save(1)", 0.096), ("captured", 0.097),
                                                                            ("committed", 0.13)])
    rows = {t.get_text().strip(): t.get_position()[1] for t in close.axes[0].texts if t.get_text().startswith(" ")}
    assert rows["captured"] != rows["save(1)"]  # 1 ms apart: their labels go on different rows
    assert rows["committed"] == rows["save(1)"]  # far enough from the first to share its row
    only = checkpoints.checkpoint_timeline(steps_with_a_checkpoint(), lanes=["compute", "nvme_write"],
                                           t_range=(0.1, 0.2))
    assert [t.get_text() for t in only.axes[0].get_yticklabels()] == ["compute", "nvme_write"]
    assert only.axes[0].get_xlim() == pytest.approx((100.0, 200.0))
    assert "no spans" in [t.get_text() for t in checkpoints.checkpoint_timeline(Trace()).axes[0].texts]


def test_checkpoint_timeline_refuses_bad_marks_and_ranges():
    with pytest.raises(ValueError, match=r"each mark must be \(label, seconds\)"):
        checkpoints.checkpoint_timeline(steps_with_a_checkpoint(), marks=[("save", float("nan"))])
    with pytest.raises(ValueError, match=r"each mark must be \(label, seconds\)"):
        checkpoints.checkpoint_timeline(steps_with_a_checkpoint(), marks=[0.1])
    with pytest.raises(ValueError, match="end > start"):
        checkpoints.checkpoint_timeline(steps_with_a_checkpoint(), t_range=(0.2, 0.1))


def test_blocked_bars_puts_this_run_beside_the_recorded_one():
    measured = {"blocking torch.save": 0.046, "DCP async_save": 0.051, "async (ours)": 0.004}
    recorded = {"blocking torch.save": 0.41, "async (ours)": 0.032}
    fig = checkpoints.blocked_bars(measured, recorded)
    ax = fig.axes[0]
    assert bar_widths(ax) == [46.0, 410.0, 51.0, 4.0, 32.0]  # ms; DCP has no recorded bar here
    assert [t.get_text() for t in ax.get_yticklabels()] == list(measured)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["this run", "recorded (bench)"]
    alone = checkpoints.blocked_bars({"async (ours)": 0.004})
    assert bar_widths(alone.axes[0]) == [4.0] and alone.axes[0].get_legend() is None
    assert "no checkpoints measured" in [t.get_text() for t in checkpoints.blocked_bars({}).axes[0].texts]
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        checkpoints.blocked_bars({"ours": -0.1})


def test_path_bandwidths_stacks_what_each_path_carried():
    runs = {"fast alone": {"fast": 1.9}, "slow alone": {"slow": 0.5}, "both": {"fast": 1.7, "slow": 0.45}}
    fig = checkpoints.path_bandwidths(runs, predicted={"both": 2.4})
    ax = fig.axes[0]
    assert bar_widths(ax) == [1.9, 0.5, 1.7, 0.45]
    lefts = [round(p.get_x(), 6) for p in ax.patches]
    assert lefts == [0.0, 0.0, 0.0, 1.7]  # the slow path's share starts where the fast path's ends
    assert [p.get_facecolor() for p in ax.patches][0] == [p.get_facecolor() for p in ax.patches][2]  # one colour a path
    assert any("2.15 GB/s" in t.get_text() for t in ax.texts)
    assert list(ax.lines[0].get_xdata()) == [2.4, 2.4]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["fast", "predicted", "slow"]
    named = checkpoints.path_bandwidths(runs, predicted={"both": 2.4}, predicted_label="perfect split")
    assert "perfect split" in [t.get_text() for t in named.axes[0].get_legend().get_texts()]
    with pytest.raises(ValueError, match="not run"):
        checkpoints.path_bandwidths(runs, predicted={"three paths": 3.0})
    with pytest.raises(ValueError, match="finite GB/s >= 0"):
        checkpoints.path_bandwidths({"both": {"fast": float("inf")}})
    assert "no runs" in [t.get_text() for t in checkpoints.path_bandwidths({}).axes[0].texts]


def test_reads_per_step_groups_the_orders_by_step_with_the_predictions():
    mib = 1 << 20
    counts = {"forward": [48 * mib] * 3, "alternate": [48 * mib, 36 * mib, 36 * mib]}
    predicted = {"alternate": [48 * mib, 36 * mib, 36 * mib]}
    fig = checkpoints.reads_per_step(counts, predicted)
    ax = fig.axes[0]
    assert [round(p.get_height(), 6) for p in ax.patches] == [48.0, 48.0, 48.0, 48.0, 36.0, 36.0]  # MiB
    assert [line.get_ydata()[0] for line in ax.lines] == [48.0, 36.0, 36.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["step 1", "step 2", "step 3"]
    assert "forward 144.00 MiB, alternate 120.00 MiB" in ax.get_title(loc="right")
    with pytest.raises(ValueError, match="same number of steps"):
        checkpoints.reads_per_step({"forward": [1.0], "alternate": [1.0, 2.0]})
    with pytest.raises(ValueError, match="one value per step"):
        checkpoints.reads_per_step(counts, {"alternate": [1.0]})
    with pytest.raises(ValueError, match="finite and >= 0"):
        checkpoints.reads_per_step({"forward": [-1.0]})
