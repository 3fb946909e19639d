"""The planner's figures (course/viz/plan.py) draw what they are given and name bad input; the explorer redraws."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minioffload.course import viz  # noqa: E402
from minioffload.planner import search as plan  # noqa: E402
from minioffload.planner.milp import Option, Problem, brute_force, solve  # noqa: E402
from minioffload.trace import Trace  # noqa: E402
from minioffload.units import GB  # noqa: E402

SPEC = plan.ModelSpec(n_layer=2, d_model=64, n_head=4, vocab=100, seq_len=32)
CAPACITY = {"device": 80 * GB, "host": 512 * GB, "nvme": None}


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def a_plan(device=40 * GB, host=300 * GB, nvme=0, capacity=CAPACITY, optimizer_on="host"):
    return plan.Plan(SPEC, "h100-sxm", "mixed_bf16", 4, 2, optimizer_on, "device", ("keep", "recompute"),
                     step_s=1.0, memory={"device": device, "host": host, "nvme": nvme}, bound="cpu",
                     capacity=dict(capacity))


def bar_heights(ax):
    return [round(p.get_height(), 6) for p in ax.patches]


def test_plan_memory_draws_a_bar_per_plan_in_each_tier_and_the_capacity_dashed():
    plans = [a_plan(), a_plan(device=90 * GB, host=100 * GB, nvme=2000 * GB)]
    fig = viz.plan_memory(plans)
    device, host, nvme = fig.axes
    assert bar_heights(device) == [40, 90] and bar_heights(host) == [300, 100]  # GB
    assert bar_heights(nvme) == [0, 2]  # TB
    assert [line.get_ydata()[0] for line in device.get_lines()] == [80]
    assert nvme.get_lines() == [] and "unbounded" in nvme.get_title(loc="left")
    assert [t.get_text() for t in device.get_xticklabels()] == ["#1", "#2"]
    over = [p.get_edgecolor()[:3] for p in device.patches]
    assert over[0] != over[1]  # the plan over the device's capacity is outlined


def test_plan_memory_without_plans_draws_what_is_missing_on_top_of_capacity():
    fig = viz.plan_memory([], capacity={"device": 80 * GB, "host": 256 * GB, "nvme": 0},
                          short={"device": 0.0, "host": 144 * GB, "nvme": 0.0})
    host = fig.axes[1]
    assert any(p.get_hatch() == "///" for p in host.patches)
    assert any(t.get_text().startswith("+134") for t in host.texts)  # 144 GB = 134.11 GiB
    assert "none" in [t.get_text() for t in fig.axes[2].texts]  # no NVMe at all


@pytest.mark.parametrize("kwargs, message", [
    ({"plans": []}, "short="),
    ({"plans": [], "short": {"host": 1.0}}, "capacity="),
    ({"plans": [a_plan()], "capacity": {"gpu": 1.0}}, "unknown tier"),
    ({"plans": [a_plan()], "labels": ["a", "b"]}, "2 labels for 1 plans"),
])
def test_plan_memory_names_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        viz.plan_memory(**kwargs)


def small_problem(budget):
    options = (Option("offload", 0, 4.0, 0.3), Option("recompute", 1.0, 0, 0.2), Option("keep", 3.0, 0, 0.0))
    return Problem(4, options, budget, host_budget=8.0, subgroups=3, max_resident=2, resident_bytes=2.0, cpu_s=0.1,
                   device_s=0.05)


def test_policy_mix_stacks_every_block_per_budget_and_marks_what_does_not_fit():
    budgets = [16.0, 8.0, 4.0, 0.0]
    solutions = [solve(small_problem(b)) for b in budgets]
    assert [s and s.objective for s in solutions] == pytest.approx(
        [s and s.objective for s in map(brute_force, map(small_problem, budgets))])
    fig = viz.policy_mix(budgets, solutions, policies=("offload", "recompute", "keep"))
    ax = fig.axes[0]
    stacked = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        stacked[x] = stacked.get(x, 0) + bar.get_height()
    for i, s in enumerate(solutions):
        assert stacked.get(i, 0) == (4 if s is not None else 0)
    assert ("no fit" in [t.get_text() for t in ax.texts]) == (None in solutions)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"keep", "subgroups on\nthe device"} <= set(legend)
    assert len(fig.axes) == 2  # the hybrid split's axis


def test_policy_mix_names_bad_input():
    with pytest.raises(ValueError, match="one solution"):
        viz.policy_mix([1.0, 2.0], [None])
    with pytest.raises(ValueError, match="not among policies"):
        viz.policy_mix([4.0], [solve(small_problem(4.0))], policies=("keep",))


def a_trace(scale):
    trace = Trace(origin=0.0)
    trace.record("compute", "forward", 1.0, 1.0 + 0.02 * scale)
    trace.record("d2h", "d2h grad", 1.01, 1.03, nbytes=100)
    trace.record("cpu", "adam", 1.03, 1.0 + 0.05 * scale)
    return trace


def test_timeline_pair_puts_predicted_over_measured_on_one_time_axis():
    fig = viz.timeline_pair(a_trace(1), a_trace(2))
    top, bottom = fig.axes
    assert [t.get_text() for t in top.get_yticklabels()] == ["compute", "d2h", "cpu"]
    assert top.get_title(loc="left").startswith("predicted: 50 ms")
    assert bottom.get_title(loc="left").startswith("measured: 100 ms")
    assert top.get_xlim() == bottom.get_xlim() and bottom.get_xlim()[1] >= 100
    assert len(top.collections) == len(bottom.collections) == 3  # one bar set per lane
    only = viz.timeline_pair(a_trace(1), a_trace(1), lanes=["cpu"])
    assert [t.get_text() for t in only.axes[0].get_yticklabels()] == ["cpu"]


def test_timeline_pair_names_bad_input_and_says_when_a_trace_is_empty():
    with pytest.raises(TypeError, match="measured must be a Trace"):
        viz.timeline_pair(a_trace(1), [])
    fig = viz.timeline_pair(a_trace(1), Trace())
    assert "no spans in the measured trace" in [t.get_text() for t in fig.axes[0].texts]


def test_what_if_grid_has_a_cell_per_row_and_says_what_is_missing():
    rows = [{"model": "7B", "hardware": "h100-sxm", "tokens_per_s": 1750.0, "bound": "cpu"},
            {"model": "7B", "hardware": "gh200", "tokens_per_s": 7330.0, "bound": "cpu"},
            {"model": "70B", "hardware": "h100-sxm", "tokens_per_s": None, "missing": "device +4 GB, host +144 GB"},
            {"model": "70B", "hardware": "gh200", "tokens_per_s": 38.0, "bound": "nvme"}]
    ax = viz.what_if_grid(rows).axes[0]
    assert len(ax.patches) == 4
    texts = [t.get_text() for t in ax.texts]
    assert "no fit\ndevice +4 GB\nhost +144 GB" in texts and "7,330\ncpu" in texts
    with pytest.raises(ValueError, match="lacks"):
        viz.what_if_grid([{"model": "7B"}])
    with pytest.raises(ValueError, match="at least one row"):
        viz.what_if_grid([])


def test_plan_explorer_searches_with_the_controls_values_and_draws_the_best_plans():
    from minioffload.course import widgets

    searched, drawn = [], []

    def search(spec, hw, limits):
        searched.append((spec, hw.name, limits))
        if limits.nvme_bytes == 0:
            raise plan.NoPlanError("nothing fits", {"device": 0.0, "host": 5 * GB, "nvme": 0.0})
        return [a_plan(), a_plan(optimizer_on="nvme", host=100 * GB, nvme=900 * GB)]

    def draw(plans, **kwargs):
        drawn.append((plans, kwargs))
        return viz.plan_memory(plans, **kwargs)

    box = widgets.plan_explorer(params=7e9, hardware="gh200", host_gb=480, nvme_gb=4000, batch=8, search=search,
                                draw=draw)
    spec, hw, limits = searched[-1]
    assert hw == "gh200" and limits.batch == 8 and limits.host_bytes == pytest.approx(480 * GB)
    assert spec.num_params == pytest.approx(7e9, rel=0.15)
    assert len(drawn[-1][0]) == 2  # one plan per family
    nvme = box.children[1].children[1]
    nvme.value = 0
    assert searched[-1][2].nvme_bytes == 0
    assert drawn[-1][0] == [] and drawn[-1][1]["short"]["host"] == 5 * GB
    with pytest.raises(ValueError, match="unknown hardware preset"):
        widgets.plan_explorer(hardware="tpu", search=search, draw=draw)
