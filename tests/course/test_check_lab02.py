"""Lab 2 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import itertools
import re
import threading

import pytest
from grader_harness import mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

from minioffload.course import check
from minioffload.course.check import lab02, lab02_diagnose, lab02_pool
from minioffload.devices import pipeline


class SlotPool:
    """The reference answer to Task 2.1."""

    def __init__(self, slots):
        self.slots, self._free, self._lent = slots, list(range(slots)), set()
        self._cond = threading.Condition()

    def acquire(self, block=False):
        with self._cond:
            if not self._free:
                if not block:
                    raise RuntimeError(f"pool exhausted: all {self.slots} slots are lent")
                self._cond.wait_for(lambda: self._free)
            index = self._free.pop()
            self._lent.add(index)
            return index

    def release(self, index):
        with self._cond:
            if index not in self._lent:
                raise ValueError(f"slot {index} is not lent out")
            self._lent.remove(index)
            self._free.append(index)
            self._cond.notify()


class NeverBlocks(SlotPool):
    def acquire(self, block=False):
        return super().acquire(block=False)


class NoNotify(SlotPool):
    def release(self, index):
        with self._cond:
            if index not in self._lent:
                raise ValueError(f"slot {index} is not lent out")
            self._lent.remove(index)
            self._free.append(index)  # forgot self._cond.notify(): a waiter sleeps forever


class LaxRelease(SlotPool):
    def release(self, index):
        with self._cond:
            self._lent.discard(index)
            if index not in self._free:
                self._free.append(index)
            self._cond.notify()


class RoundRobin(SlotPool):
    """Hands out slots in turn, whether or not they came back."""

    def acquire(self, block=False):
        with self._cond:
            index = len(self._lent) % self.slots
            self._lent.add(index)
            return index


class VagueError(SlotPool):
    def acquire(self, block=False):
        if not block and not self._free:
            raise RuntimeError("no slot")
        return super().acquire(block)


def overlapped_2(dev, chunks_in, chunks_out, kernel, kernel_seconds=None):
    pipeline.overlapped(dev, chunks_in, chunks_out, kernel, kernel_seconds, buffers=2)


def without(wait):
    def run(dev, chunks_in, chunks_out, kernel, kernel_seconds=None):
        pipeline.overlapped(dev, chunks_in, chunks_out, kernel, kernel_seconds, buffers=2,
                            waits=pipeline.WAITS - {wait})
    return run


def no_synchronize(dev, chunks_in, chunks_out, kernel, kernel_seconds=None):
    real = dev.synchronize
    dev.synchronize = lambda: None  # the learner forgot the last line
    try:
        overlapped_2(dev, chunks_in, chunks_out, kernel, kernel_seconds)
    finally:
        dev.synchronize = real


def overlap_by_trace(spans):
    """The reference, worked out its own way (the grader refuses Trace.overlap_fraction to a solution): between each
    two neighbouring span edges, count the lanes busy at the midpoint."""
    edges = sorted({t for _, start, end in spans if end > start for t in (start, end)})
    busy = both = 0.0
    for a, b in itertools.pairwise(edges):
        lanes = {lane for lane, start, end in spans if start < (a + b) / 2 < end}
        busy += (b - a) if lanes else 0.0
        both += (b - a) if len(lanes) >= 2 else 0.0
    return both / busy if busy else 0.0


def needed_waits(num_chunks, buffers):
    """The reference answer to Task 2.3 (the grader holds none: it asks the strict simulator)."""
    data = {"compute_after_h2d", "d2h_after_compute"}
    return data | {"h2d_after_compute", "compute_after_d2h"} if buffers < num_chunks else data


def pipeline_makespan(num_chunks, buffers, h2d, compute, d2h):
    """The reference answer to Task 2.5 (the grader holds none: it asks the runtime's list scheduler)."""
    h2d_end, compute_end, d2h_end = [], [], []
    for k in range(num_chunks):
        reused = k - buffers
        start = max(h2d_end[k - 1] if k else 0.0, compute_end[reused] if reused >= 0 else 0.0)
        h2d_end.append(start + h2d)
        start = max(compute_end[k - 1] if k else 0.0, h2d_end[k], d2h_end[reused] if reused >= 0 else 0.0)
        compute_end.append(start + compute)
        d2h_end.append(max(d2h_end[k - 1] if k else 0.0, compute_end[k]) + d2h)
    return d2h_end[-1] if num_chunks else 0.0


def counts_spans_not_lanes(spans):
    """Counts two overlapping spans on one lane as overlap."""
    edges = sorted({t for _, start, end in spans for t in (start, end)})
    any_busy = many_busy = 0.0
    for a, b in zip(edges, edges[1:], strict=False):
        busy = sum(1 for _, start, end in spans if start <= a and b <= end)
        any_busy += (b - a) if busy else 0.0
        many_busy += (b - a) if busy >= 2 else 0.0
    return many_busy / any_busy if any_busy else 0.0


def diagnose_with(*, hazard_is=None, slow_is=None, host_lane_ignored=False, peak_ignored=False, waits=None,
                  streams=3, buffers=None, pinned=True, extra_key=False):
    """A correct answer to Task 2.6, with switches that turn it into one plausible mistake at a time."""
    def diagnose_pipeline(run):
        if run["error"]:
            later, earlier = (int(k) for k in re.findall(r"'(?:h2d|compute|d2h) (\d+)'", run["error"])[:2])
            cause = hazard_is or ("data_wait" if later == earlier else "reuse_wait")
            return cause, {"waits": set(pipeline.WAITS) if waits is None else waits}
        trace, chunk = run["trace"], run["chunk_bytes"]
        if slow_is:
            cause = slow_is
        elif trace.on("host") and not host_lane_ignored:
            cause = "pageable"
        elif run["peak_bytes"] <= 2 * chunk and not peak_ignored:
            cause = "one_buffer"
        else:
            cause = "shared_stream"
        room = run["limits"]["device_bytes"] // (2 * chunk)
        fix = {"pageable": {"pinned": pinned}, "shared_stream": {"streams": streams},
               "one_buffer": {"buffers": buffers or min(2, room)}}.get(cause, {"buffers": 2})
        return cause, dict(fix, kernel_seconds=0.0) if extra_key else fix
    return diagnose_pipeline


REFERENCE = {
    "2.6": diagnose_with(),
    "2.1": SlotPool,
    "2.2": overlapped_2,
    "2.3": needed_waits,
    "2.4": overlap_by_trace,
    "2.5": pipeline_makespan,
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("2.1", NeverBlocks, "wait until a slot is released"),
    ("2.1", NoNotify, "notify"),
    ("2.1", LaxRelease, "ValueError"),
    ("2.1", RoundRobin, "never lend more than"),
    ("2.1", VagueError, "exhausted"),
    *[("2.2", without(wait), wait) for wait in sorted(pipeline.WAITS)],
    ("2.2", pipeline.serial, "no H2D copy overlapped any compute"),
    ("2.2", pipeline.single_buffer, "no H2D copy overlapped any compute"),
    ("2.2", lambda dev, i, o, k, s=None: pipeline.overlapped(dev, i, o, k, s, buffers=3), "peaked at 6 chunk buffers"),
    ("2.2", lambda dev, i, o, k, s=None: pipeline.overlapped(dev, i, o, k, None, buffers=2), "kernel_seconds"),
    ("2.2", no_synchronize, "dev.synchronize()"),
    ("2.3", lambda num_chunks, buffers: set(pipeline.WAITS),
     "needed_waits(1, 1) returned ['compute_after_d2h', 'compute_after_h2d', 'd2h_after_compute', "
     "'h2d_after_compute'], with 'compute_after_d2h', which the pipeline does not need here"),
    ("2.3", lambda num_chunks, buffers: {"compute_after_h2d", "d2h_after_compute"},
     "needed_waits(2, 1) returned ['compute_after_h2d', 'd2h_after_compute'], without 'compute_after_d2h': "
     "pipeline.overlapped with your waits on the strict simulator stops at a hazard: the launch 'compute 1'"),
    ("2.3", lambda num_chunks, buffers: needed_waits(num_chunks + 1, buffers), "does not need here"),
    ("2.3", lambda num_chunks, buffers: needed_waits(num_chunks, buffers) - {"compute_after_h2d"},
     "without 'compute_after_h2d'"),
    ("2.3", lambda num_chunks, buffers: sorted(needed_waits(num_chunks, buffers)), "return a set"),
    ("2.4", counts_spans_not_lanes, "one lane, overlapping spans"),
    ("2.4", lambda spans: overlap_by_trace(spans) if spans else 1.0, "no spans"),
    ("2.5", lambda n, b, h, c, d: (h + c + d) + (n - 1) * max(h, c, d), "expected"),
    ("2.5", lambda n, b, h, c, d: n * (h + c + d) + 1.0, "longer than running every op one after another"),
    ("2.5", lambda n, b, h, c, d: pipeline_makespan(n, b + 1, h, c, d), "expected"),
    ("2.5", lambda n, b, h, c, d: n * max(h, c, d), "a rule that makes an op wait is missing"),
    ("2.6", diagnose_with(hazard_is="data_wait"), "two chunks that share a buffer"),
    ("2.6", diagnose_with(hazard_is="reuse_wait"), "the checker names chunk 0 twice"),
    ("2.6", diagnose_with(slow_is="data_wait"), "with no HazardError"),
    ("2.6", diagnose_with(host_lane_ignored=True), "blocked the host"),
    ("2.6", diagnose_with(peak_ignored=True), "H2D copies overlapped a D2H copy"),
    ("2.6", diagnose_with(slow_is="one_buffer"), "yet no two of the device's spans overlapped"),
    ("2.6", diagnose_with(slow_is="pageable"), "the host chunks are pinned"),
    ("2.6", diagnose_with(waits={"compute_after_h2d", "d2h_after_compute"}), "still stops at a hazard"),
    ("2.6", diagnose_with(streams=2), "0 of its 8 H2D copies overlap a compute"),
    ("2.6", diagnose_with(pinned=False), "16 copies block the host"),
    ("2.6", diagnose_with(buffers=3), "the device holds 4"),
    ("2.6", diagnose_with(pinned="yes"), "True or False"),
    ("2.6", diagnose_with(extra_key=True), "a fix may change only"),
]

test_reference_passes = reference_passes(REFERENCE, built_on_the_runtime=("2.2",))
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG, built_on_the_runtime=("2.2",))
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("2.2", "2.3", "2.6"), built_on_the_runtime=("2.2",))


@pytest.mark.parametrize("wait", sorted(pipeline.WAITS))
def test_a_missing_wait_is_named_from_the_trace(wait):
    verdict = check.grade("2.2", without(wait), refuse=False)  # the runtime's pipeline, one wait left out
    assert verdict.status == "FAIL" and f"add the wait {wait!r}" in verdict.detail, str(verdict)
    assert "chunk" in verdict.detail


def test_a_pool_whose_constructor_is_a_stub_is_todo():
    class Stub:
        def __init__(self, slots):
            raise NotImplementedError("Task 2.1")

    assert check.grade("2.1", Stub).status == "TODO"


def test_a_pool_that_deadlocks_under_contention_fails_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(lab02_pool, "HAMMER_TIMEOUT", 1.0)

    class LosesSlots(SlotPool):
        """Under contention some releases are lost: the pool slowly runs dry and every thread waits."""

        def __init__(self, slots):
            super().__init__(slots)
            self._releases = 0

        def release(self, index):
            with self._cond:
                if index not in self._lent:
                    raise ValueError(f"slot {index} is not lent out")
                self._releases += 1
                self._lent.remove(index)
                if self._releases > 10 and self._releases % 7 == 0:
                    return  # lost
                self._free.append(index)
                self._cond.notify()

    verdict = check.grade("2.1", LosesSlots)
    assert verdict.status == "FAIL" and "still wait" in verdict.detail, str(verdict)


def test_the_scheduled_makespan_follows_the_rules_by_hand():
    # equal stages: serial would be 3 per chunk; one buffer gives a period of 2, two buffers a period of 1
    assert lab02.scheduled_makespan(8, 1, 1.0, 1.0, 1.0) == 3 + 2 * 7
    assert lab02.scheduled_makespan(8, 2, 1.0, 1.0, 1.0) == 3 + 7
    assert lab02.scheduled_makespan(4, 8, 1.0, 3.0, 1.0) == 1 + 4 * 3 + 1  # compute-bound
    assert lab02.scheduled_makespan(0, 2, 1.0, 1.0, 1.0) == 0.0


def test_the_strict_simulator_needs_the_reuse_rules_exactly_when_a_buffer_is_reused():
    for num_chunks in range(1, 5):
        for buffers in range(1, 6):
            assert set(lab02.needed_by_hazards(num_chunks, buffers)) == needed_waits(num_chunks, buffers)



def test_the_diagnosis_grader_s_model_time_is_the_sims_schedule():
    # the fix is graded in model time, worked out: it must be the rules' schedule (Task 2.5's, for three streams
    # and pinned chunks) and a floor under what the sim takes (a busy machine only makes the sim later)
    for case in lab02_diagnose.CASES:
        for buffers in (1, 2, 3):
            settings = {**lab02_diagnose.HEALTHY, "buffers": buffers}
            copy = lab02_diagnose.LINK.seconds(lab02_diagnose.CHUNK_BYTES)
            assert lab02_diagnose.model_time(settings, case) == pytest.approx(lab02.scheduled_makespan(
                case.num_chunks, buffers, copy, lab02_diagnose.kernel_seconds(case), copy))
        broken = {**lab02_diagnose.HEALTHY, **case.broken}
        if case.cause in ("pageable", "shared_stream", "one_buffer"):
            slower = lab02_diagnose.model_time(broken, case) / lab02_diagnose.perfect_s(case)
            assert slower > lab02_diagnose.TARGET, (case, slower)  # the broken settings miss the target
            _, trace, _ = lab02_diagnose._run(broken, case, strict=False)
            assert lab02_diagnose.run_time(trace) >= 0.99 * lab02_diagnose.model_time(broken, case), case
