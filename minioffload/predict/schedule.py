"""Operations on lanes with dependencies, and a list scheduler that places them in time.

    plan = Plan()
    copy = plan.add("d2h", "grad", 0.02, stream="d2h")          # seconds; returns the op's index
    adam = plan.add("cpu", "adam", 0.03, [copy], stream="host")  # waits for the copy
    schedule(plan, resource_of=lambda lane: lane)                # sets every op's start and end

What this is not: a model of any hardware (predict/stepmodel.py chooses the ops, their durations and which lanes share
a resource), nor a simulator of a device (devices/sim.py runs real work).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)  # a large plan has tens of thousands of ops: slots make them smaller and faster to read
class Op:
    lane: str
    name: str
    seconds: float
    deps: list[int]
    nbytes: int = 0
    host_bytes: float = 0.0  # bytes it moves through host DRAM (CPU passes, and DMA to or from host memory)
    start: float = math.nan
    end: float = math.nan


@dataclass
class Plan:
    """Operations in issue order; `stream` chains give in-order queues (each op waits for the previous one)."""

    ops: list[Op] = field(default_factory=list)
    last_in_stream: dict[str, int] = field(default_factory=dict)

    def add(self, lane: str, name: str, seconds: float, deps=(), nbytes: int = 0, stream: str | None = None,
            host_bytes: float = 0.0) -> int:
        deps = [d for d in deps if d is not None]
        if stream is not None and stream in self.last_in_stream:
            deps.append(self.last_in_stream[stream])
        self.ops.append(Op(lane, name, max(0.0, seconds), deps, int(nbytes), host_bytes))
        index = len(self.ops) - 1
        if stream is not None:
            self.last_in_stream[stream] = index
        return index

    def mark(self, deps) -> int:
        """A zero-length point that waits for `deps` (a host wait)."""
        return self.add("", "mark", 0.0, deps)


def schedule(plan: Plan, resource_of: Callable[[str], str]) -> None:
    """Place every op at the earliest time its deps are done and its resource (`resource_of(lane)`) is free,
    ready ops first, ties in issue order, like stream workers that take a free engine as soon as their input is
    there. Sets each op's start and end."""
    remaining = [len(op.deps) for op in plan.ops]
    users: list[list[int]] = [[] for _ in plan.ops]
    for i, op in enumerate(plan.ops):
        for d in op.deps:
            users[d].append(i)
    free: dict[str, float] = {}
    resources = {lane: resource_of(lane) if lane else None for lane in {op.lane for op in plan.ops}}
    ready = [(0.0, i) for i, op in enumerate(plan.ops) if not op.deps]
    heapq.heapify(ready)
    while ready:
        at, i = heapq.heappop(ready)
        op = plan.ops[i]
        resource = resources[op.lane]
        start = max(at, free.get(resource, 0.0)) if resource else at
        if resource and start > at:  # the resource is busy: come back when it is free
            heapq.heappush(ready, (start, i))
            continue
        op.start, op.end = start, start + op.seconds
        if resource:
            free[resource] = op.end
        for u in users[i]:
            remaining[u] -= 1
            if not remaining[u]:
                heapq.heappush(ready, (max(plan.ops[d].end for d in plan.ops[u].deps), u))
    if any(math.isnan(op.end) for op in plan.ops):
        raise RuntimeError("the plan has a cycle: an op waits, directly or not, for itself")
