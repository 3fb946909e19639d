"""The list scheduler under the step model: dependencies, in-order streams, shared resources, cycles."""

import pytest

from minioffload.predict.schedule import Plan, schedule


def test_ops_wait_for_their_deps_and_their_stream_and_share_resources():
    plan = Plan()
    a = plan.add("d2h", "a", 2.0, stream="s")
    b = plan.add("cpu", "b", 1.0, [a])
    c = plan.add("d2h", "c", 1.0, stream="s")  # same stream: after a, though it needs nothing else
    d = plan.add("h2d", "d", 3.0)  # its own lane: runs at once
    schedule(plan, lambda lane: lane)
    ops = plan.ops
    assert (ops[a].start, ops[b].start, ops[c].start, ops[d].start) == (0.0, 2.0, 2.0, 0.0)
    shared = Plan()
    shared.add("h2d", "x", 3.0)
    y = shared.add("d2h", "y", 1.0)
    schedule(shared, lambda lane: "link")  # one resource for both lanes: y queues behind x
    assert shared.ops[y].start == 3.0


def test_a_cycle_is_refused():
    plan = Plan()
    plan.add("cpu", "a", 1.0, [1])
    plan.add("cpu", "b", 1.0, [0])
    with pytest.raises(RuntimeError, match="cycle"):
        schedule(plan, lambda lane: lane)
