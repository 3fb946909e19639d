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
from itertools import accumulate


@dataclass(slots=True)  # a large plan has tens of thousands of ops: slots make them smaller and faster to read
class Op:
    lane: str
    name: str
    seconds: float
    deps: tuple[int, ...]  # a tuple of ints: the garbage collector stops tracking it (a plan's ops live long)
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
        deps = tuple([d for d in deps if d is not None])
        ops, index = self.ops, len(self.ops)
        if stream is not None and stream in self.last_in_stream:
            deps += (self.last_in_stream[stream],)
        # `seconds if seconds > 0.0 else 0.0` is max(0.0, seconds) without the call: a step has thousands of ops
        ops.append(Op(lane, name, seconds if seconds > 0.0 else 0.0, deps, int(nbytes), host_bytes))
        if stream is not None:
            self.last_in_stream[stream] = index
        return index

    def mark(self, deps) -> int:
        """A zero-length point that waits for `deps` (a host wait)."""
        return self.add("", "mark", 0.0, deps)


def schedule(plan: Plan, resource_of: Callable[[str], str]) -> None:
    """Place every op at the earliest time its deps are done and its resource (`resource_of(lane)`) is free,
    ready ops first, ties in issue order, like stream workers that take a free engine as soon as their input is
    there. Sets each op's start and end.

    The rule, exactly: of the ops whose deps are done, the one with the smallest (max(end of its deps, its resource's
    free time), index) goes next, at that time. The heap `ready` holds a lower bound of that key for each ready op
    (a resource's free time only grows): an entry found too early is pushed back with the op's key now. The ops found
    waiting for a busy resource wait in its `line` (by index: once the resource is busy past their deps, their keys
    differ only in the index); only the first in line has an entry in `ready`, so each op placed on a resource moves
    one entry, not every op waiting for it."""
    ops = plan.ops
    count = len(ops)
    resources = {lane: resource_of(lane) if lane else None for lane in {op.lane for op in ops}}
    slots: dict[str, int] = {}  # resource -> its index in `free` and `lines`
    slot_of_lane = {lane: slots.setdefault(resource, len(slots)) if resource else None
                    for lane, resource in resources.items()}
    slot = [slot_of_lane[op.lane] for op in ops]  # per op: its resource's index, None for none
    seconds = [op.seconds for op in ops]
    free = [0.0] * len(slots)  # when each resource is next free
    lines: list[list[int]] = [[] for _ in slots]  # per resource: the ops waiting for it (a heap of indices)
    in_line = bytearray(count)  # 1: the op waits in its resource's line
    has_entry = bytearray(count)  # 1: an op in line has an entry in `ready`
    remaining = [len(op.deps) for op in ops]  # deps not done yet
    ready_at = [-math.inf] * count  # the latest end of an op's deps done so far
    # who waits for whom, flat: op d's users are users[first[d]:first[d + 1]], in issue order
    waiting = [0] * count
    for op in ops:
        for d in op.deps:
            waiting[d] += 1
    first = list(accumulate(waiting, initial=0))
    fill, users = first[:-1], [0] * first[-1]
    for i, op in enumerate(ops):
        for d in op.deps:
            users[fill[d]] = i
            fill[d] += 1
    heappop, heappush = heapq.heappop, heapq.heappush
    ready = [(0.0, i) for i, op in enumerate(ops) if not op.deps]  # in index order: already a heap
    while ready:
        at, i = heappop(ready)
        s = slot[i]
        if s is None:
            end = at + seconds[i]
        elif in_line[i]:  # the entry of the first in line, or of one that no longer is
            line = lines[s]
            if line[0] != i:  # one with a smaller index came: it has an entry of its own
                has_entry[i] = 0
                continue
            if free[s] > at:  # the resource was taken since: come back when it is free
                heappush(ready, (free[s], i))
                continue
            heappop(line)
            end = free[s] = at + seconds[i]
            if line and not has_entry[line[0]]:
                has_entry[line[0]] = 1
                heappush(ready, (end, line[0]))
        elif free[s] > at:  # the resource is busy: wait in line
            in_line[i] = 1
            line = lines[s]
            heappush(line, i)
            if line[0] == i:
                has_entry[i] = 1
                heappush(ready, (free[s], i))
            continue
        else:
            end = free[s] = at + seconds[i]
        op = ops[i]
        op.start, op.end = at, end
        for u in users[first[i]:first[i + 1]]:
            if end > ready_at[u]:
                ready_at[u] = end
            left = remaining[u] - 1
            remaining[u] = left
            if not left:
                at_u, s = ready_at[u], slot[u]
                heappush(ready, (free[s] if s is not None and free[s] > at_u else at_u, u))
    if any(math.isnan(op.end) for op in ops):
        raise RuntimeError("the plan has a cycle: an op waits, directly or not, for itself")
