"""Grader for Lab 6, Task 6.3: the three-stage read-update-write pipeline against a fake drive (see lab06.py).

Task 6.3 runs the learner's pipeline against a fake drive on a thread pool whose stages sleep. Every call and
every future's completion moves a buffer through free -> reading -> read -> updated -> writing -> free, and a call
out of turn fails at once with the rule it breaks. A slow read and a slow write make a missing wait collide with
a future still in flight whatever the scheduling; a balanced run then checks that the stages overlap.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...pinned import aligned_empty
from .grading import grader

# ---------------------------------------------------------------------------------------------
# Task 6.3: the three-stage pipeline

BUFFERS = 3
BUFFER_FLOATS = 1024
# (name, n, read, update, write seconds): a slow stage makes a missing wait meet a future still in flight.
PIPELINE_SCENARIOS = (
    ("no subgroups", 0, 0.001, 0.001, 0.001),
    ("one subgroup", 1, 0.005, 0.001, 0.005),
    ("two subgroups", 2, 0.005, 0.001, 0.005),
    ("a slow read", 6, 0.060, 0.005, 0.005),
    ("a slow write", 8, 0.005, 0.005, 0.080),
)
BALANCED = ("three stages of 20 ms", 12, 0.020, 0.020, 0.020)
SERIAL_SHARE = 0.75  # the balanced run must take less than this share of n * (read + update + write)
ATTEMPTS = 3  # the best of: a loaded machine can slow one run


class _Violation(AssertionError):
    pass


class _FakeDrive:
    """read/update/write for the learner, on a thread pool, tracking each buffer's state under one lock."""

    def __init__(self, pool: ThreadPoolExecutor, buffers: list, n: int, stages: tuple[float, float, float]):
        self.pool, self.buffers, self.n = pool, buffers, n
        self.read_s, self.update_s, self.write_s = stages
        self.number = {id(b): i for i, b in enumerate(buffers)}
        self.state: dict[int, tuple[str, int | None]] = {i: ("free", None) for i in range(len(buffers))}
        self.lock = threading.Lock()
        self.counts: dict[str, Counter] = {"read": Counter(), "update": Counter(), "write": Counter()}
        self.stored: dict[int, bool] = {}
        self.problems: list[str] = []
        self.log: list[tuple[float, str, int]] = []  # (time, "read"/"update"/"read done"/"write done"..., k)

    def _buffer(self, call: str, k: int, buf) -> int:
        if id(buf) not in self.number:
            raise _Violation(f"{call}({k}, buf) was given a buffer that is not one of `buffers`: allocate none, "
                             "reuse the ones given (host memory holds only those)")
        if not isinstance(k, int) or not 0 <= k < self.n:
            raise _Violation(f"{call}({k!r}, ...): subgroups are numbered 0 to n - 1 = {self.n - 1}")
        self.counts[call][k] += 1
        if self.counts[call][k] > 1:
            raise _Violation(f"{call}({k}, ...) was called twice: each subgroup is read, updated and written once")
        return self.number[id(buf)]

    def _note(self, what: str, k: int) -> None:
        self.log.append((time.perf_counter(), what, k))

    def read(self, k: int, buf) -> Future:
        with self.lock:
            b = self._buffer("read", k, buf)
            state, j = self.state[b]
            if state == "writing":
                raise _Violation(f"read({k}) started into buffer {b} while write({j}) from it was still in flight: "
                                 f"the drive would write subgroup {k}'s data as subgroup {j}. Wait for a buffer's "
                                 "write future before reading into it again")
            if state != "free":
                raise _Violation(f"read({k}) started into buffer {b}, which still held subgroup {j} ({state}, not "
                                 "written back yet)")
            self.state[b] = ("reading", k)
            self._note("read", k)

        def work() -> None:
            time.sleep(self.read_s)
            buf.fill_(float(k))
            with self.lock:
                self.state[b] = ("read", k)
                self._note("read done", k)
        return self.pool.submit(work)

    def update(self, k: int, buf) -> None:
        with self.lock:
            b = self._buffer("update", k, buf)
            state, j = self.state[b]
            if state == "reading" and j == k:
                raise _Violation(f"update({k}) ran before read({k}) had finished: wait for the read's future "
                                 "(.result()) before updating")
            if (state, j) != ("read", k):
                raise _Violation(f"update({k}) was given buffer {b}, which holds "
                                 + (f"subgroup {j} ({state})" if j is not None else "no subgroup")
                                 + ": update each subgroup in the buffer it was read into")
            self._note("update", k)
        if not bool((buf == float(k)).all()):
            raise _Violation(f"update({k}): buffer {b} does not hold subgroup {k}'s data (it changed after the read)")
        time.sleep(self.update_s)
        buf.add_(0.5)
        with self.lock:
            self.state[b] = ("updated", k)
            self._note("update done", k)

    def write(self, k: int, buf) -> Future:
        with self.lock:
            b = self._buffer("write", k, buf)
            state, j = self.state[b]
            if (state, j) != ("updated", k):
                raise _Violation(f"write({k}) was given buffer {b}, which holds "
                                 + (f"subgroup {j} ({state})" if j is not None else "no subgroup")
                                 + f": write subgroup {k} back once it is updated, from its buffer")
            self.state[b] = ("writing", k)
            self._note("write", k)

        def work() -> None:
            time.sleep(self.write_s)
            with self.lock:
                if not bool((buf == k + 0.5).all()):
                    self.problems.append(f"buffer {b} changed while write({k}) was still in flight: wait for a "
                                         "buffer's write future before reusing it")
                self.stored[k] = True
                self.state[b] = ("free", None)
                self._note("write done", k)
        return self.pool.submit(work)

    def in_flight(self) -> list[int]:
        with self.lock:
            return sorted(j for state, j in self.state.values() if state == "writing")


def _pipeline_run(fn: Callable, scenario: tuple) -> tuple[float, _FakeDrive]:
    name, n, *stages = scenario
    buffers = [aligned_empty(BUFFER_FLOATS * 4, pin=False).view(torch.float32)
               for _ in range(BUFFERS)]
    with ThreadPoolExecutor(4, thread_name_prefix="fake-drive") as pool:
        drive = _FakeDrive(pool, buffers, n, tuple(stages))
        started = time.perf_counter()
        try:
            fn(n, drive.read, drive.update, drive.write, list(buffers))
        except _Violation as err:
            raise AssertionError(f"{name}: {err}") from None
        elapsed = time.perf_counter() - started
        pending = drive.in_flight()
    assert not pending, (f"{name}: pipelined_update returned while write({pending[0]}) was still in flight: wait for "
                         "every write's future before returning (the caller reuses the buffers)")
    assert not drive.problems, f"{name}: {drive.problems[0]}"
    for call in ("read", "update", "write"):
        missing = [k for k in range(n) if drive.counts[call][k] == 0]
        assert not missing, f"{name}: subgroup {missing[0]} was never {call}{'ed' if call == 'update' else ''}" + (
            "" if call != "write" else " back")
    assert all(drive.stored.get(k) for k in range(n)), f"{name}: not every write finished"
    return elapsed, drive


def _overlap_problem(drive: _FakeDrive, n: int) -> str | None:
    """From the log of the balanced run: whether update(k) ran while read(k + 1) and write(k - 1) were in flight,
    for most k (the calls' order is the learner's; a 20 ms stage leaves ample slack for the scheduler)."""
    at = {}
    for when, what, k in drive.log:
        at.setdefault((what, k), when)

    def during_update(stage: str, j: int, k: int) -> bool:
        return at[(stage, j)] < at[("update done", k)] and at[(f"{stage} done", j)] > at[("update", k)]

    middle = range(1, n - 1)
    reads = sum(during_update("read", k + 1, k) for k in middle)
    writes = sum(during_update("write", k - 1, k) for k in middle)
    if reads < len(middle) / 2:
        if all(at[("read", k + 1)] > at[("update", k)] for k in middle):
            return "read(k + 1) only started after update(k): start the next read before updating this subgroup"
        return ("read(k + 1) had finished before update(k) started: wait for read(k) alone, then update, while "
                "read(k + 1) goes on")
    if writes < len(middle) / 2:
        return ("each write had finished before the next update started: do not wait for write(k) at once; wait "
                "for it only when you need its buffer again")
    return None


@grader("6.3")
def pipelined_update(fn: Callable) -> str:
    """fn(n, read, update, write, buffers): each subgroup read, updated and written, the three stages overlapped."""
    for scenario in PIPELINE_SCENARIOS:
        _pipeline_run(fn, scenario)
    name, n, read_s, update_s, write_s = BALANCED
    serial = n * (read_s + update_s + write_s)
    best = None
    for _ in range(ATTEMPTS):
        elapsed, drive = _pipeline_run(fn, BALANCED)
        problem = _overlap_problem(drive, n)
        assert problem is None, (f"{name}: the stages did not overlap; a subgroup should be updated while the next "
                                 f"one is read and the previous one written: {problem}")
        best = elapsed if best is None else min(best, elapsed)
        if best < SERIAL_SHARE * serial:
            break
    assert best < SERIAL_SHARE * serial, (
        f"{name}: {n} subgroups took {best / serial:.0%} of the serial time n x (read + update + write) at best of "
        f"{ATTEMPTS} runs, though the stages overlapped; a pipeline of independent stages (this fake drive reads "
        f"and writes at once; one real drive does not) takes about n x the slowest stage, "
        f"{(n + 2) / (3 * n):.0%} here (the check asks for under {SERIAL_SHARE:.0%}): wait on futures "
        "(.result()), do not poll them in a loop, and do no other slow work between the calls")
    scenarios = ", ".join(s[0] for s in PIPELINE_SCENARIOS[3:])
    return (f"{len(PIPELINE_SCENARIOS) + 1} runs through {BUFFERS} buffers (0-{n} subgroups; {scenarios}; "
            f"{name}): each subgroup read, updated and written once, in a buffer holding its data, no buffer reused "
            f"before its write finished, every write done on return; with three equal stages, each update ran while "
            f"the next read and the previous write were in flight, in under {SERIAL_SHARE:.0%} of the serial time")

