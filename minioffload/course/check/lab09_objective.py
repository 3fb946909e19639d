"""Grader for Lab 9's Task 9.2: a lower bound on a plan's step. Task 9.1: lab09.py; Task 9.3: lab09_search.py.

The learner's `step_bound(p, hw, limits)` gets a plan with its predictions blanked and returns seconds the plan's step
cannot beat. Many answers are right; two properties are checked on every plan of four searches (a course GPT in fp32
on a laptop preset, the same on that preset as a shared host like the simulated device, and a 1.3B model in bf16 on
an RTX 4090 with NVMe, in its slot and behind a slow external link):

- it is a bound: never above the planner's step (`p.step_s`, 1e-9 relative);
- it is a useful one: at least 60% of the step on 80% of each search's plans.

A failure names the plan, the bound, the step and the step model's busy seconds per lane, which say where the time
went. Verdicts carry ratios and counts of the model's arithmetic (the same every run), never a measured time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable

from ...machine import profiles
from ...planner import search as plan
from ...planner.plan import ModelSpec, Plan
from ...units import GB, MiB
from .grading import grader

RTOL = 1e-9  # a bound may equal the step, up to rounding
USEFUL = 0.6  # of the step: a bound at least this close ...
SHARE = 0.8  # ... on at least this share of each search's plans


def _setups() -> tuple:
    course = ModelSpec(6, 128, 4, 74, 128)
    laptop = profiles.preset("laptop")
    shared = laptop.replace(name="laptop-shared", shared_host=True)  # the device computes on the CPU's cores
    small = plan.Limits(batch=8, device_bytes=24 * MiB, precision="fp32", micro_batches=(2, 8), nvme_bytes=0)
    rtx = profiles.preset("rtx4090")
    # the same card behind a Thunderbolt enclosure: PCIe 3.0 x4, about 2.8 GB/s each way (an estimate)
    egpu = rtx.replace(name="rtx4090-egpu", link_theoretical=5e9, link_h2d=2.8e9, link_d2h=2.8e9)
    big = plan.Limits(batch=4, host_bytes=24 * GB, nvme_bytes=2000 * GB, micro_batches=(1, 2))
    return (
        (course, laptop, small),
        (course, shared, dataclasses.replace(small, mfu=0.3, block_overhead_s=2e-4)),
        (ModelSpec.of_params(1.3e9), rtx, big),
        (ModelSpec.of_params(1.3e9), egpu, big),
    )


@functools.lru_cache(maxsize=1)
def searches() -> tuple:
    """((hw, limits, plans), ...): every plan of each search."""
    return tuple((hw, limits, tuple(plan.search(model, hw, limits))) for model, hw, limits in _setups())


def blank(p: Plan) -> Plan:
    """The plan as the learner gets it: its configuration, none of its predictions."""
    return dataclasses.replace(p, step_s=0.0, busy={}, bound="")


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms" if seconds < 1 else f"{seconds:,.3f} s"


def _lanes(p: Plan) -> str:
    return ", ".join(f"{lane} {_time(seconds)}" for lane, seconds in sorted(p.busy.items(), key=lambda kv: -kv[1]))


HINT = ("two kinds of bound hold: a resource can do only one thing at a time, so the step is no shorter than any "
        "one resource's work (the device's compute, each link direction, the CPU, the drive); and work that waits "
        "for other work adds up: without the delayed update, the update waits for every gradient and the next "
        "forward for the update")


@grader("9.2", rebuilds=(
    "minioffload.predict.stepmodel.predict",
    "minioffload.planner.search.prediction",
    "minioffload.planner.search.step_seconds",
    "minioffload.planner.search._accumulation_s",
    "minioffload.planner.search.search",
))
def step_bound(fn: Callable) -> str:
    """fn(plan, hw, limits) -> seconds: never above the plan's step, and close to it on most plans."""
    ratios = []
    for hw, limits, plans in searches():
        mine = []
        for p in plans:
            call = f"step_bound(<{p.describe()}>, {hw.name}, <limits: mfu {limits.mfu}, {limits.precision}>)"
            got = fn(blank(p), hw, limits)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got) or got < 0:
                raise AssertionError(f"{call} returned {got!r:.60}; expected seconds: a number >= 0")
            if got > p.step_s * (1 + RTOL):
                raise AssertionError(
                    f"{call} returned {_time(got)}, above the planner's step, {_time(p.step_s)}: a lower bound counts "
                    "only work that cannot overlap, each piece once. The planner's busy time per lane in this step: "
                    f"{_lanes(p)}")
            mine.append((got / p.step_s, p))
        useful = sum(r >= USEFUL for r, _ in mine)
        if useful < SHARE * len(mine):
            ratio, loosest = min(mine, key=lambda rp: rp[0])
            raise AssertionError(
                f"on {hw.name}, {useful} of {len(mine)} plans get a bound of at least {USEFUL:.0%} of their step "
                f"({SHARE:.0%} of them needed). The loosest: <{loosest.describe()}>, your bound is {ratio:.0%} of its "
                f"step (the planner's busy time per lane in it: {_lanes(loosest)}). {HINT}")
        ratios += [r for r, _ in mine]
    return (f"{len(ratios)} plans from {len(searches())} searches: your bound is never above the planner's step, and "
            f"at least {USEFUL:.0%} of it on {sum(r >= USEFUL for r in ratios)} of them ({SHARE:.0%} of each search's "
            f"needed); the median bound is {statistics.median(ratios):.0%} of the step")
