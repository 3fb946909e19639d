"""Chapter 10's figures (course/viz/distributed.py) read the traces of train --shard and draw what they get."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course.viz import distributed  # noqa: E402
from minioffload.layout import shard_owners  # noqa: E402
from minioffload.trace import Trace  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def rank_trace(offset: float, steps: int = 3, step_s: float = 0.1) -> Trace:
    """A sharded run's lanes: forward, backward, a reduce per subgroup, the owner's copy down, Adam, copy up, and a
    broadcast per subgroup; rank timelines start `offset` seconds late (their own origin)."""
    trace = Trace(origin=0.0)
    for k in range(steps):
        t = offset + k * step_s
        trace.record("compute", "forward", t, t + 0.02)
        trace.record("compute", "backward", t + 0.02, t + 0.06)
        trace.record("net", "reduce 0", t + 0.04, t + 0.05, 4000)
        trace.record("net", "reduce 1", t + 0.06, t + 0.065, 2000)
        trace.record("d2h", "d2h grad", t + 0.066, t + 0.067, 4000)
        trace.record("cpu", "adam", t + 0.067, t + 0.08, 28000)
        trace.record("h2d", "h2d weights", t + 0.08, t + 0.081, 4000)
        trace.record("net", "broadcast 0", t + 0.082, t + 0.085, 4000)
        trace.record("net", "broadcast 1", t + 0.085, t + 0.09, 2000)
    return trace


def test_load_trace_reads_back_what_trace_save_wrote(tmp_path):
    trace = rank_trace(0.25)
    loaded = distributed.load_trace(trace.save(tmp_path / "trace.json"))
    assert [(s.lane, s.name, s.nbytes) for s in loaded.spans] == [(s.lane, s.name, s.nbytes)
                                                                  for s in sorted(trace.spans, key=lambda s: s.start)]
    assert [s.start for s in loaded.spans] == pytest.approx(sorted(s.start for s in trace.spans))
    assert loaded.busy("net") == pytest.approx(trace.busy("net"))
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a trace written by Trace.save"):
        distributed.load_trace(tmp_path / "other.json")


def test_one_step_cuts_a_step_and_starts_it_at_zero():
    trace = rank_trace(0.5)
    assert distributed.step_starts(trace) == pytest.approx([0.5, 0.6, 0.7])
    assert distributed.step_starts(trace, micro_batches=2) == pytest.approx([0.5, 0.7])
    step = distributed.one_step(trace, step=1)
    assert min(s.start for s in step.spans) == 0.0
    assert len(step.spans) == 9 and step.makespan() == pytest.approx(0.09)
    assert sum(s.nbytes for s in step.on("net")) == 12000
    last = distributed.one_step(trace, step=-1)  # the last step ends at the trace's last span
    assert last.makespan() == pytest.approx(0.09)
    with pytest.raises(ValueError, match="out of range: the trace has 3 steps"):
        distributed.one_step(trace, step=3)
    with pytest.raises(ValueError, match="no 'forward' span"):
        distributed.one_step(Trace(origin=0.0))
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        distributed.step_starts(trace, micro_batches=0)


def test_rank_timelines_stacks_a_panel_per_rank_with_the_net_lane_last():
    fig = distributed.rank_timelines([rank_trace(0.0), rank_trace(0.37)], step=1)
    assert len(fig.axes) == 2
    for rank, ax in enumerate(fig.axes):
        assert [t.get_text() for t in ax.get_yticklabels()] == ["h2d", "compute", "d2h", "cpu", "net"]
        assert ax.get_title(loc="left") == f"rank {rank}"
        assert "net: 4 collectives" in ax.get_title(loc="right")
        assert ax.get_xlim()[0] == 0  # each rank's step from its own start, whatever its origin
    net_bars = fig.axes[1].collections[-1]
    assert len(net_bars.get_paths()) == 4  # two reduces and two broadcasts
    only = distributed.rank_timelines([rank_trace(0.0)], lanes=["compute", "net"])
    assert [t.get_text() for t in only.axes[0].get_yticklabels()] == ["compute", "net"]
    empty = distributed.rank_timelines([])
    assert "no ranks" in [t.get_text() for t in empty.axes[0].texts]


def test_shard_map_draws_each_ranks_elements_as_its_subgroups():
    sizes = [8960, 12480, 4288, 16384, 256, 16384]
    owners = shard_owners(sizes, 2)
    fig = distributed.shard_map(sizes, owners)
    ax = fig.axes[0]
    assert len(ax.patches) == len(sizes)
    for rank in (0, 1):
        widths = [p.get_width() for p in ax.patches if round(p.get_y() + p.get_height() / 2) == rank]
        assert sum(widths) == sum(n for n, o in zip(sizes, owners, strict=True) if o == rank)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    idle = distributed.shard_map([5, 5], [0, 0], ranks=3)  # a rank that owns nothing: an empty bar, 0%
    assert any("0 (0%)" in t.get_text() for t in idle.axes[0].texts)
    with pytest.raises(ValueError, match="one entry per subgroup"):
        distributed.shard_map([1, 2], [0])
    with pytest.raises(ValueError, match="owner 2 is not a rank of 2"):
        distributed.shard_map([1, 2], [0, 2], ranks=2)
    with pytest.raises(ValueError, match="owners must be ranks"):
        distributed.shard_map([1, 2], [0, -1])


def test_link_bytes_draws_a_bar_per_rank_of_each_run():
    fig = distributed.link_bytes({"1 rank": [871424], "2 ranks": [471552, 399872]})
    ax = fig.axes[0]
    assert [round(p.get_height(), 3) for p in ax.patches] == [871.424, 471.552, 399.872]  # kB
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 rank", "2 ranks\nrank 0", "2 ranks\nrank 1"]
    with pytest.raises(ValueError, match=">= 0"):
        distributed.link_bytes({"bad": [-1]})


def test_scaling_lines_plots_tokens_per_gpu_against_ranks():
    rows = [{"ranks": r, "tokens_per_s_per_gpu": 1000.0 * r ** 0.5, "bound": "cpu" if r < 4 else "compute"}
            for r in (1, 2, 4, 8)]
    fig = distributed.scaling_lines({"node": rows})
    ax = fig.axes[0]
    x, y = ax.lines[0].get_data()
    assert list(x) == [1, 2, 4, 8] and list(y) == pytest.approx([1000 * r ** 0.5 for r in (1, 2, 4, 8)])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["node (bound: cpu then compute)"]
    assert "no predictions" in [t.get_text() for t in distributed.scaling_lines({}).axes[0].texts]
