"""The list scheduler places every op exactly where the plain rule does (a reference kept here: pop the ready op with
the smallest (ready time, index), send it back while its resource is busy), on random plans with shared resources,
streams, zero-length ops, marks and ties; and Trace.record_many records what record does."""

import heapq
import math
import random

import pytest

from minioffload.predict.schedule import Plan, schedule
from minioffload.trace import Trace


def reference(plan: Plan, resource_of) -> list[tuple[float, float]]:
    """The scheduler's rule, written plainly: (start, end) per op."""
    ops = plan.ops
    end = [math.nan] * len(ops)
    remaining = [len(op.deps) for op in ops]
    users: list[list[int]] = [[] for _ in ops]
    for i, op in enumerate(ops):
        for d in op.deps:
            users[d].append(i)
    free: dict[str, float] = {}
    start = [math.nan] * len(ops)
    ready = [(0.0, i) for i, op in enumerate(ops) if not op.deps]
    while ready:
        at, i = heapq.heappop(ready)
        resource = resource_of(ops[i].lane) if ops[i].lane else None
        begin = max(at, free.get(resource, 0.0)) if resource else at
        if resource and begin > at:
            heapq.heappush(ready, (begin, i))
            continue
        start[i], end[i] = begin, begin + ops[i].seconds
        if resource:
            free[resource] = end[i]
        for u in users[i]:
            remaining[u] -= 1
            if not remaining[u]:
                heapq.heappush(ready, (max(end[d] for d in ops[u].deps), u))
    return list(zip(start, end, strict=True))


def random_plan(rng: random.Random, size: int) -> Plan:
    plan = Plan()
    lanes = ["compute", "d2h", "h2d", "cpu", "nvme_read", "nvme_write", "cpu:1"]
    for i in range(size):
        deps = [rng.randrange(i) if i and rng.random() < 0.8 else None for _ in range(rng.randrange(4))]
        seconds = rng.choice([0.0, 0.5, 1.0, 1.5, rng.random(), -1.0])  # equal lengths make ties; < 0 counts as 0
        if rng.random() < 0.1:
            plan.mark(deps)
        else:
            plan.add(rng.choice(lanes), f"op {i}", seconds, deps, rng.randrange(100),
                     stream=rng.choice([None, "a", "b", "host"]))
    return plan


@pytest.mark.parametrize("seed", range(40))
def test_the_scheduler_places_every_op_as_the_plain_rule_does(seed):
    rng = random.Random(seed)
    plan = random_plan(rng, rng.choice([5, 30, 300]))
    shared = rng.choice([lambda lane: lane, lambda lane: "nvme" if lane.startswith("nvme") else lane,
                         lambda lane: "one"])  # more sharing, more queueing
    expected = reference(plan, shared)
    schedule(plan, shared)
    assert [(op.start, op.end) for op in plan.ops] == expected


def test_record_many_records_what_record_does_and_refuses_alike():
    rows = [("cpu", "a", 0.0, 1.0, 3), ("h2d", "b", 0.5, 0.5, 0), ("cpu", "c", 2.0, 3.5, 7)]
    one, many = Trace(origin=0.0), Trace(origin=0.0)
    for row in rows:
        one.record(*row)
    many.record_many(iter(rows))
    assert many.spans == one.spans
    for bad, message in ((("cpu", "x", 2.0, 1.0, 0), "start <= end"), (("cpu", "x", math.nan, 1.0, 0), "start"),
                         (("cpu", "x", 0.0, 1.0, -1), "cannot move")):
        with pytest.raises(ValueError, match=message):
            one.record(*bad)
        with pytest.raises(ValueError, match=message):
            many.record_many([rows[0], bad])
    assert many.spans == one.spans  # nothing recorded from a refused batch
