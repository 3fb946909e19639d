"""Lab 5 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import math

import pytest
from grader_harness import (
    assert_fails,
    assert_passes,
    mistakes_fail,
    reference_passes,
    same_verdict_every_run,
    stubs_are_todo,
)

from minioffload import layout, options
from minioffload.course.check import lab05, lab05_diagnose
from minioffload.course.check.lab05 import GEN4, GEN5
from minioffload.predict import hybrid_split

# Task 5.1 --------------------------------------------------------------------------------------

def subgroups_with(*, front=False, from_zero=False, truncate=False, validate=True):
    """A correct device_subgroups, with switches that turn it into one plausible mistake at a time."""
    def fn(count, gpu_fraction=None, stride=None):
        if validate:
            options.check_split(gpu_fraction, stride)
        if gpu_fraction is not None:
            n = int(gpu_fraction * count) if truncate else round(gpu_fraction * count)
            return (list(range(n)) if front else list(range(count - n, count))), []
        if stride is not None:
            return [], list(range(0 if from_zero else stride - 1, count, stride))
        return [], []
    return fn


# Task 5.2 --------------------------------------------------------------------------------------

def split_with(*, bytes_per_param=12, fraction=None, speedup=None):
    """device_rate_from_link, then best_split, as the lab's split_over_link calls them; mistakes by switch."""
    def fn(cpu_rate, bandwidth):
        r_g = bandwidth / bytes_per_param
        f = fraction(cpu_rate, r_g) if fraction else r_g / (cpu_rate + r_g)
        s = speedup(cpu_rate, r_g) if speedup else (cpu_rate + r_g) / cpu_rate
        return {"device_rate": r_g, "fraction": f, "speedup": s}
    return fn


# Task 5.3 --------------------------------------------------------------------------------------

STATE = ("master", "exp_avg", "exp_avg_sq")


def update_streamed(dev, subgroups, scratch, streams, update, *, wait_free=True, wait_arrived=True,
                    wait_updated=True, free_after="out", serial=False, sets=2, stream_for_all=None,
                    duration=True):
    """The reference answer, with switches that turn it into one plausible mistake at a time."""
    state_in, adam, state_out = (streams[stream_for_all] if stream_for_all else streams[name]
                                 for name in ("state_in", "adam", "state_out"))
    free = [None] * sets
    for k, host in enumerate(subgroups):
        s, numel = k % sets, host["master"].numel()
        buffers = {name: scratch[s][name][:numel] for name in STATE}
        if wait_free and free[s] is not None:
            state_in.wait(free[s])
        for name in STATE:
            dev.copy(buffers[name], host[name], state_in)
        arrived = dev.event()
        arrived.record(state_in)
        if wait_arrived:
            adam.wait(arrived)
        dev.launch(adam, update, k, buffers, duration=numel / dev.adam_rate if duration else None)
        updated = dev.event()
        updated.record(adam)
        if wait_updated:
            state_out.wait(updated)
        for name in STATE:
            dev.copy(host[name], buffers[name], state_out)
        free[s] = dev.event()
        free[s].record(state_out if free_after == "out" else adam)
        if serial:
            dev.synchronize()  # the host waits for every subgroup: correct, and nothing overlaps


def streamed_with(**mistake):
    def fn(dev, subgroups, scratch, streams, update):
        update_streamed(dev, subgroups, scratch, streams, update, **mistake)
    return fn


def update_streamed_host_waits(dev, subgroups, scratch, streams, update):
    """Another right answer: an event after each copy in, the adam stream waiting for all three, and the host (not
    the state_in stream) waiting before it reuses a scratch set. Still overlapped: subgroup k + 1 is issued while
    subgroup k is still on the device."""
    free = {}
    for k, host in enumerate(subgroups):
        s, numel = k % 2, host["master"].numel()
        if s in free:
            free.pop(s).synchronize()  # the host waits: set s's previous subgroup has gone home
        buffers = {name: scratch[s][name].narrow(0, 0, numel) for name in reversed(STATE)}
        for name, view in buffers.items():
            dev.copy(view, host[name], streams["state_in"])
            arrived = dev.event()
            arrived.record(streams["state_in"])
            streams["adam"].wait(arrived)
        dev.launch(streams["adam"], update, k, buffers, duration=numel / dev.adam_rate)
        updated = dev.event()
        updated.record(streams["adam"])
        streams["state_out"].wait(updated)
        for name, view in buffers.items():
            dev.copy(host[name], view, streams["state_out"])
        free[s] = dev.event()
        free[s].record(streams["state_out"])


def fresh_scratch_per_subgroup(dev, subgroups, scratch, streams, update):
    """Right numbers and overlapped, but each subgroup gets new device memory: the device would hold every
    subgroup's state at once, which the two scratch sets exist to avoid."""
    own = [{name: dev.empty(host["master"].numel(), name=f"mine {k} {name}") for name in STATE}
           for k, host in enumerate(subgroups)]
    update_streamed(dev, subgroups, own, streams, update, sets=len(subgroups))


def update_on_the_host(dev, subgroups, scratch, streams, update):
    for k, host in enumerate(subgroups):
        update(k, host)


def unsliced_scratch(dev, subgroups, scratch, streams, update):
    for name in STATE:
        dev.copy(scratch[0][name], subgroups[0][name], streams["state_in"])


# Task 5.4 --------------------------------------------------------------------------------------

def best_stride(cpu_rate, bandwidth=GEN5):
    """The reference answer to Task 5.4 (the grader holds none: it searches the model for the best fraction)."""
    return hybrid_split.nearest_stride(hybrid_split.best_split(cpu_rate, hybrid_split.link_rate(bandwidth))["fraction"])


# Task 5.5 --------------------------------------------------------------------------------------

FIGURES = {"cpu": ("cpu_adam_rate",), "link": ("link_h2d", "link_d2h"), "device": ("device_adam_rate",)}


def lane_busy(trace, cause):
    """Seconds the spans of `cause`'s half of the update ran (the same reading the lab's example shows)."""
    return lab05_diagnose.busy(trace, cause)


def diagnose_with(*, always=None, profile_as_given=False, plain_ratio=False, one_notch=False, all_resident=False,
                  both=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time."""
    def diagnose_split(hw, run, predict):
        split = run["split"]
        slowed = {cause: lane_busy(run["trace"], cause) / lane_busy(run["planned_trace"], cause)
                  for cause in FIGURES if lane_busy(run["planned_trace"], cause)}
        cause = always or max(slowed, key=slowed.get)
        if cause not in slowed:  # a wrong guess about a lane this split does not use
            return cause, split
        if one_notch:  # moved one step the right way, without measuring how far
            if "stride" in split:
                return cause, {"stride": max(1, split["stride"] + (-1 if cause == "cpu" else 1))}
            return cause, {"gpu_fraction": split["gpu_fraction"] + (0.1 if cause == "cpu" else -0.1)}
        if all_resident:
            return cause, {"gpu_fraction": 1.0}
        if both:
            return cause, {"gpu_fraction": 0.1, "stride": 2}
        factor = 1.0
        if not profile_as_given:
            figures = FIGURES[cause]
            planned, measured = lane_busy(run["planned_trace"], cause), lane_busy(run["trace"], cause)
            if plain_ratio:  # the whole span taken as the figure's: its fixed part scaled too
                factor = planned / measured
            else:  # the part of each span that does not depend on the figure, from a model with it very fast
                fast = hw.replace(**{f: getattr(hw, f) * 1e6 for f in figures})
                fixed = lane_busy(predict(fast, split).trace, cause)
                factor = (planned - fixed) / (measured - fixed)
        believed = hw.replace(**{f: getattr(hw, f) * factor for f in FIGURES[cause]})
        count = len(run["work"].subgroups(lab05_diagnose.SUBGROUP_NUMEL))
        limit = run["limits"]["max_gpu_fraction"]
        splits = [{}, *({"stride": k} for k in range(1, 9)),
                  *({"gpu_fraction": k / count} for k in range(1, count + 1) if k / count <= limit)]
        return cause, min(splits, key=lambda s: predict(believed, s).step_s)
    return diagnose_split


REFERENCE = {
    "5.5": diagnose_with(),
    "5.1": layout.device_subgroups,
    "5.2": split_with(),
    "5.3": update_streamed,
    "5.4": best_stride,
}
MISSING_WAITS = [  # (mistake, what the verdict must mention): each comes back wrong in a jittered run
    ({"wait_free": False}, "went into scratch set"),
    ({"free_after": "adam"}, "went into scratch set"),
    ({"wait_arrived": False}, "before its state had arrived"),
    ({"wait_updated": False}, "before its update had finished"),
]
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("5.1", subgroups_with(front=True), "the LAST round(f * count)"),
    ("5.1", subgroups_with(from_zero=True), "counts from subgroup 0"),
    ("5.1", subgroups_with(truncate=True), "int() truncates"),
    ("5.1", subgroups_with(validate=False), "expected a ValueError"),
    ("5.1", lambda count, gpu_fraction=None, stride=None: (list(range(count)), []), "nothing goes to the device"),
    ("5.2", split_with(bytes_per_param=24), "counts 24 B/param"),
    ("5.2", split_with(bytes_per_param=4), "12 bytes"),
    ("5.2", split_with(fraction=lambda r_c, r_g: r_c / (r_c + r_g)), "larger share to the slower path"),
    ("5.2", split_with(fraction=lambda r_c, r_g: 0.5), "balance the two paths"),
    ("5.2", split_with(speedup=lambda r_c, r_g: r_g / r_c), "that is r_g / r_c"),
    ("5.2", split_with(speedup=lambda r_c, r_g: (r_c + r_g) / r_g), "CPU-only time"),
    ("5.3", streamed_with(serial=True), "no subgroup's copies in overlapped"),
    ("5.3", streamed_with(sets=1), "no subgroup's copies in overlapped"),
    ("5.3", streamed_with(stream_for_all="state_in"), "ran on stream 'state_in'"),
    ("5.3", streamed_with(duration=False), "duration=numel / dev.adam_rate"),
    ("5.3", update_on_the_host, "the host thread"),
    ("5.3", unsliced_scratch, "[:numel]"),
    ("5.3", fresh_scratch_per_subgroup, "allocated device memory"),
    ("5.4", lambda cpu_rate, bandwidth=GEN5: round(1 / best_split_fraction(cpu_rate, bandwidth)), "closest share"),
    ("5.4", lambda cpu_rate, bandwidth=GEN5: math.floor(1 / best_split_fraction(cpu_rate, bandwidth)),
     "closest share"),
    ("5.4", lambda cpu_rate, bandwidth=GEN4: best_stride(cpu_rate, bandwidth), "PCIe Gen5"),
    ("5.4", lambda cpu_rate, bandwidth=GEN5: float(best_stride(cpu_rate, bandwidth)), "as an int"),
    ("5.5", diagnose_with(always="cpu"), "the CPU's Adam spans took"),
    ("5.5", diagnose_with(always="link"), "the streamed state's copies took"),
    ("5.5", diagnose_with(always="device"), "the device's Adam spans took"),
    ("5.5", diagnose_with(profile_as_given=True), "not as the profile says"),
    ("5.5", diagnose_with(plain_ratio=True), "longer than the best split within the limits"),
    ("5.5", diagnose_with(one_notch=True), "longer than the best split within the limits"),
    ("5.5", diagnose_with(all_resident=True), "holds resident state for at most"),
    ("5.5", diagnose_with(both=True), "not both"),
]


def best_split_fraction(cpu_rate, bandwidth):
    return hybrid_split.best_split(cpu_rate, hybrid_split.link_rate(bandwidth))["fraction"]


test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("5.2", "5.3", "5.5"))


@pytest.mark.parametrize("mistake, reason", MISSING_WAITS, ids=["no-free-wait", "free-after-adam", "no-arrived-wait",
                                                                 "no-updated-wait"])
def test_a_missing_wait_fails_and_the_trace_names_it(mistake, reason):
    """Not by luck: a scenario makes each missing wait corrupt the state whatever the jitter (checked in loops)."""
    verdict = assert_fails("5.3", streamed_with(**mistake), reason)
    assert verdict.detail.startswith("trial "), str(verdict)


def test_another_order_of_calls_and_waits_passes():
    """The lab states what must hold, not a sequence of calls: a different schedule that keeps the three orderings
    and overlaps passes."""
    assert_passes("5.3", update_streamed_host_waits)


def test_the_searched_fraction_and_strides_are_the_models():
    for cpu_rate in (5e8, 4e9, 1e11):
        for bandwidth in (GEN4, GEN5):
            fraction = best_split_fraction(cpu_rate, bandwidth)
            assert math.isclose(lab05.modelled_best_fraction(cpu_rate, bandwidth), fraction, rel_tol=1e-12)
            assert lab05._closest_strides(fraction) == [hybrid_split.nearest_stride(fraction)]
