"""Grader for Lab 5's diagnosis task (5.5): a hybrid update whose two halves do not finish together, its cause named
from the step's trace beside the planned one, and its split changed.

The learner gets the profile a run was planned with (the laptop preset), the run's workload, its split (the best one
the step model found on that profile, within the device memory left for resident state) and two traces of one step:
the planned one (the step model on the profile) and the measured one (the step model on a hidden truth). In the
truth one figure of the profile is off. Three causes, two cases of each:

    cpu      the CPU's Adam is slower than the profile says: the CPU half finishes last, the device idles
    link     the link is slower: the streamed state's copies finish last, the CPU idles
    device   the device's Adam is slower (a power-capped mobile GPU): the device half finishes last

The fix is a new split, graded by running it: under the hidden truth, the step model's step with the learner's split
must be within FIX_SHARE of the best split's within the limits (a fraction of the subgroups resident, a stride, or the
CPU alone). More than one split can be right. A wrong cause fails with what the trace shows of that cause's lanes.
Everything is the step model's arithmetic: verdicts are the same on every machine. This is not the engine's hybrid
update (engine/device_path.py) nor the model of the split (predict/hybrid_split.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from ...machine import profiles
from ...predict import stepmodel
from ...predict.step_config import StepConfig, Workload
from ...trace import Trace
from .grading import grader

CAUSES = ("cpu", "link", "device")
FIX_SHARE = 0.05  # how much longer than the best split's step a fix's step may be, on the machine as it is
FIX_KEYS = ("gpu_fraction", "stride")
SUBGROUP_NUMEL = 1 << 24
MAX_STRIDE = 8  # the strides searched for the best split (a larger one streams almost nothing: the CPU alone is there)


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    tokens: int
    max_gpu_fraction: float  # the device memory left for resident state, as a share of the subgroups
    slower: tuple  # the hidden truth: ((figure, factor on the profile's), ...)


CASES = (
    Case("link", 512, 0.2, (("link_h2d", 1 / 2.5), ("link_d2h", 1 / 2.5))),
    Case("cpu", 512, 0.2, (("cpu_adam_rate", 1 / 3),)),
    Case("device", 512, 0.9, (("device_adam_rate", 1 / 6),)),
    Case("link", 1024, 0.4, (("link_h2d", 1 / 4), ("link_d2h", 1 / 4))),
    Case("device", 1024, 0.6, (("device_adam_rate", 1 / 12),)),
    Case("cpu", 1024, 0.0, (("cpu_adam_rate", 1 / 3),)),
)

EXAMPLE = Case("device", 512, 0.9, (("device_adam_rate", 1 / 9),))  # the lab's worked trace, not graded


def given() -> profiles.Hardware:
    """The profile the runs were planned with: the laptop preset (a mobile GPU with 8 GB on PCIe 4.0 x8)."""
    return profiles.preset("laptop")


def workload(tokens: int) -> Workload:
    """A 350M-parameter GPT, bf16 weights with fp32 Adam, `tokens` a step."""
    return Workload(350e6, tokens, "mixed_bf16", num_tensors=150)


def _config(split: dict) -> StepConfig:
    return StepConfig(subgroup_numel=SUBGROUP_NUMEL, **split)


def _truth(case: Case) -> profiles.Hardware:
    hw = given()
    return hw.replace(**{figure: getattr(hw, figure) * factor for figure, factor in case.slower})


def _splits(case: Case) -> list[dict]:
    """The splits within the limits: the CPU alone, each stride up to MAX_STRIDE, each resident share of subgroups."""
    count = len(workload(case.tokens).subgroups(SUBGROUP_NUMEL))
    shares = [k / count for k in range(1, count + 1) if k / count <= case.max_gpu_fraction + 1e-9]
    return [{}, *({"stride": k} for k in range(1, MAX_STRIDE + 1)), *({"gpu_fraction": f} for f in shares)]


@functools.cache
def _best(case: Case, truth: bool) -> tuple[float, tuple]:
    """The shortest step over the splits within the limits, on the truth or on the profile: (seconds, split)."""
    hw = _truth(case) if truth else given()
    work = workload(case.tokens)
    step, split = min(((stepmodel.predict(work, hw, _config(s)).step_s, tuple(s.items())) for s in _splits(case)),
                      key=lambda pair: pair[0])
    return step, split


def planned_split(case: Case) -> dict:
    return dict(_best(case, truth=False)[1])


@functools.cache
def _run(case: Case) -> dict:
    work, config = workload(case.tokens), _config(planned_split(case))
    planned, measured = stepmodel.predict(work, given(), config), stepmodel.predict(work, _truth(case), config)
    return {"work": work, "subgroups": len(work.subgroups(SUBGROUP_NUMEL)), "split": planned_split(case),
            "trace": measured.trace, "step_s": measured.step_s,
            "planned_trace": planned.trace, "planned_s": planned.step_s,
            "limits": {"max_gpu_fraction": case.max_gpu_fraction}}


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the workload and its number of subgroups, the split, the measured and
    planned traces, the limits."""
    run = _run(case)
    return dict(run, split=dict(run["split"]), limits=dict(run["limits"]))


def example() -> dict:
    """The step the lab shows before the task (a case the grader does not use)."""
    return run_of(EXAMPLE)


def predictor(case: Case) -> Callable:
    """predict(hw, split) -> the step model's Prediction of this case's workload with `split`, on the profile `hw`."""
    def predict(hw: profiles.Hardware, split: dict) -> stepmodel.Prediction:
        return stepmodel.predict(workload(case.tokens), hw, _config(split))
    return predict


LANES = {"cpu": ("the CPU's Adam spans", (("cpu", "adam"),)),
         "link": ("the streamed state's copies", (("h2d", "h2d state"), ("d2h", "d2h state"))),
         "device": ("the device's Adam spans", (("compute", "device adam"),))}


def busy(trace: Trace, cause: str) -> float:
    """Seconds the spans of `cause`'s half of the update ran, in all (their names say whose they are)."""
    return sum(s.duration for lane, word in LANES[cause][1] for s in trace.on(lane) if s.name.startswith(word))


def _last_half(trace: Trace) -> str:
    ends = {"the CPU's": max((s.end for s in trace.on("cpu") if s.name.startswith("adam")), default=0.0),
            "the device's": max((s.end for lane, word in (*LANES["link"][1], *LANES["device"][1])
                                 for s in trace.on(lane) if s.name.startswith(word)), default=0.0)}
    return max(ends, key=ends.get)


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` is not the cause of this case's unbalanced halves, from the traces."""
    what = LANES[named][0]
    measured, planned = busy(run["trace"], named), busy(run["planned_trace"], named)
    last = f"{_last_half(run['trace'])} half finished last"
    if planned == 0:
        return (f"this split ({run['split'] or 'the CPU alone'}) has no {what.removeprefix('the ')}: nothing of "
                f"'{named}' is in its step ({last})")
    return (f"{what} took {1e3 * measured:.0f} ms in all, {1e3 * planned:.0f} ms planned: they ran as fast as the "
            f"profile says ({last})")


def _check_fix(fix: dict, case: Case, number: int) -> None:
    unknown = sorted(set(fix) - set(FIX_KEYS))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix is a split: "
                         f"{', '.join(map(repr, FIX_KEYS))}, or {{}} for the CPU alone")
    fraction, stride = fix.get("gpu_fraction"), fix.get("stride")
    assert fraction is None or stride is None, f"case {number}: {fix}: set gpu_fraction or stride, not both"
    if fraction is not None:
        assert isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and (
            0 <= fraction <= case.max_gpu_fraction), (
            f"case {number}: gpu_fraction {fraction!r}: the device's memory holds resident state for at most "
            f"{case.max_gpu_fraction:g} of the subgroups (limits['max_gpu_fraction'])")
    if stride is not None:
        assert isinstance(stride, int) and not isinstance(stride, bool) and stride >= 1, (
            f"case {number}: stride {stride!r}: a stride is an int >= 1")


@grader("5.5", nothing_to_refuse=(
    "no runtime function diagnoses an unbalanced split; the fix is graded by the step model under the hidden truth"
))
def diagnose(fn: Callable) -> str:
    """fn(hw, run, predict) -> (cause, split), for each case."""
    hw = given()
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(hw, run, predictor(case))
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_split returned {answer!r}; return (cause, split), e.g. ('cpu', {{'stride': 1}})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the split is a {type(fix).__name__}; return a dict"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run_of(case))}")
        _check_fix(fix, case, number)
        step = predictor(case)(_truth(case), {k: v for k, v in fix.items() if v is not None}).step_s
        best = _best(case, truth=True)[0]
        assert step <= (1 + FIX_SHARE) * best, (
            f"case {number} ({case.cause}, rightly): with {fix} the step takes {1e3 * step:.0f} ms on the machine as "
            f"it is, {step / best - 1:.0%} longer than the best split within the limits (at most {FIX_SHARE:.0%}): "
            "the split must balance the halves on the machine as it is, not as the profile says")
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each split's step within "
            f"{FIX_SHARE:.0%} of the best split's on the machine as it is, within the device's memory")
