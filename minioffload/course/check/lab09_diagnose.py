"""Grader for Lab 9's diagnosis task (9.4): a plan family that misses its prediction, its cause named and fixed.

The learner gets a profile and the same model run at several subgroup sizes, each predicted once and measured over
a few rounds, and returns the cause and a fixed profile. The measurements are made here from a hidden truth (the
same step model with one figure changed, or nothing changed) and seeded noise, so that every run grades alike.
Three causes, two cases of each:

    per_subgroup_cost   the host pays a fixed time per subgroup the profile does not have: the gap grows with the count
    cpu_adam_rate       the CPU's Adam is slower than the profile says: every plan is slower by the same time
    noise               nothing is wrong: the gaps stay within what the rounds vary by, and change sign

The fix is graded by running it: the step model with the learner's profile must predict every plan within FIX_TOLERANCE
of its median measured step, and a case of noise must leave the profile as it was. A wrong cause fails with why that
cause does not fit these measurements. Verdicts name counts and milliseconds of the hidden data, never a timing.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable

from ...machine import profiles
from ...predict import stepmodel
from .grading import grader

CAUSES = ("per_subgroup_cost", "cpu_adam_rate", "noise")
FIX_TOLERANCE = 0.03  # the fixed profile's prediction against each plan's median measured step
ROUNDS = 5
SIZES = (1 << 24, 1 << 23, 1 << 22, 1 << 20)  # elements per subgroup: about 22, 44, 88 and 300 subgroups


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    change: dict  # the hidden truth: figures of the profile that differ from what the learner is given
    noise: float  # each round's measured step is the truth times a factor within 1 +- noise
    seed: int


CASES = (
    Case("per_subgroup_cost", {"subgroup_overhead": 400e-6}, 0.01, 1),
    Case("cpu_adam_rate", {"cpu_adam_rate": 1 / 1.6}, 0.01, 2),  # a factor on the given rate
    Case("noise", {}, 0.025, 3),
    Case("per_subgroup_cost", {"subgroup_overhead": 150e-6}, 0.005, 4),
    Case("noise", {}, 0.015, 5),
    Case("cpu_adam_rate", {"cpu_adam_rate": 1 / 1.25}, 0.005, 6),
)

EXAMPLE = Case("per_subgroup_cost", {"subgroup_overhead": 250e-6}, 0.01, 11)  # the lab's worked table, not graded


def _workload() -> stepmodel.Workload:
    """A 350M-parameter model of 300 tensors, 2 sequences of 1024 tokens a step, bf16 with fp32 Adam."""
    return stepmodel.Workload(350_000_000, 2 * 1024, "mixed_bf16", num_tensors=300)


def _given() -> profiles.Hardware:
    """The learner's profile: the RTX 4090 preset, the optimizer updated on its host."""
    return profiles.preset("rtx4090")


def predict(hw: profiles.Hardware, subgroup_numel: int) -> float:
    """The step model's step for the workload at `subgroup_numel`, clipping on, the update synchronous."""
    return stepmodel.predict(_workload(), hw, stepmodel.StepConfig(subgroup_numel=subgroup_numel,
                                                                  max_grad_norm=1.0)).step_s


def _truth(case: Case) -> profiles.Hardware:
    hw = _given()
    changes = dict(case.change)
    if "cpu_adam_rate" in changes:
        changes["cpu_adam_rate"] = hw.cpu_adam_rate * changes["cpu_adam_rate"]
    return hw.replace(**changes) if changes else hw


def runs_of(case: Case) -> list[dict]:
    """What the learner sees of one case: per subgroup size, the subgroups, the prediction with the given profile,
    and the measured step of each round."""
    hw, truth, rng = _given(), _truth(case), random.Random(case.seed)
    work = _workload()
    runs = []
    for numel in SIZES:
        true_s = predict(truth, numel)
        runs.append({"subgroup_numel": numel, "subgroups": len(work.subgroups(numel)), "params": work.num_params,
                     "predicted_s": predict(hw, numel),
                     "measured_s": [true_s * (1 + rng.uniform(-case.noise, case.noise)) for _ in range(ROUNDS)]})
    return runs


def example() -> list[dict]:
    """The measurements the lab shows before the task (a case the grader does not use)."""
    return runs_of(EXAMPLE)


def _gaps(runs: list[dict]) -> str:
    return ", ".join(f"{statistics.median(r['measured_s']) * 1e3 - r['predicted_s'] * 1e3:+.0f} ms at "
                     f"{r['subgroups']} subgroups" for r in runs)


def _why_not(named: str, case: Case, runs: list[dict]) -> str:
    """Why `named` is not the cause of this case's misses, from what the measurements show."""
    gaps = _gaps(runs)
    if named == "noise":
        return (f"the gaps (median measured - predicted: {gaps}) are larger than the rounds vary by and keep their "
                "sign in every round: noise does not do that")
    if case.cause == "noise":
        return (f"the gaps ({gaps}) are within what the rounds of one plan vary by, and the rounds' sign changes: "
                f"there is nothing here for '{named}' to explain")
    if named == "cpu_adam_rate":
        return (f"every plan updates the same {runs[0]['params'] / 1e6:.0f}M parameters, so a slower Adam would "
                f"slow them all alike, but the gap grows with the number of subgroups ({gaps})")
    return (f"a cost per subgroup would grow with the count, but the gap is about the same at "
            f"{runs[0]['subgroups']} subgroups as at {runs[-1]['subgroups']} ({gaps})")


@grader("9.4", nothing_to_refuse=(
    "no runtime function diagnoses a missed prediction; the fix is graded by the step model it is given"
))
def diagnose(fn: Callable) -> str:
    """fn(hw, runs, predict) -> (cause, fixed profile), for each case."""
    given = _given()
    for number, case in enumerate(CASES, 1):
        runs = runs_of(case)
        answer = fn(given, [dict(r, measured_s=list(r["measured_s"])) for r in runs], predict)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose returned {answer!r}; return (cause, profile), e.g. ('noise', hw)")
        cause, fixed = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fixed, profiles.Hardware), (
            f"case {number}: the fix is a {type(fixed).__name__}; return a profile, hw.replace(figure=value)")
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, runs)}")
        if case.cause == "noise":
            changed = [f for f in profiles.FIGURES if getattr(fixed, f) != getattr(given, f)]
            assert not changed, (f"case {number}: noise, rightly, but the profile changed ({', '.join(changed)}): a "
                                 "profile fitted to one run's noise predicts the next run worse; return it as given")
            continue
        for r in runs:
            measured = statistics.median(r["measured_s"])
            fixed_s = predict(fixed, r["subgroup_numel"])
            error = abs(fixed_s - measured) / measured
            assert error <= FIX_TOLERANCE, (
                f"case {number} ({case.cause}, rightly): with your profile the step model predicts "
                f"{fixed_s * 1e3:.0f} ms at {r['subgroups']} subgroups against {measured * 1e3:.0f} ms measured "
                f"(median), {error:.1%} off; the fix must bring every plan within {FIX_TOLERANCE:.0%}")
    return (f"{len(CASES)} cases: each cause named ({', '.join(sorted(set(c.cause for c in CASES)))}), and each "
            f"fixed profile predicts every plan within {FIX_TOLERANCE:.0%} of its median measured step")
