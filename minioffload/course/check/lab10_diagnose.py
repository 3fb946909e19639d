"""Grader for Lab 10's diagnosis task (10.4): a 4-rank step slower than its plan, its cause named from the trace and
fixed under the hidden truth.

The learner gets the profile a run was planned with (the 8xh100-sxm node) and one step of a sharded-offload run on
4 of its GPUs: the workload, the settings, the step model's trace of rank 0 on the machine as it is (a hidden truth),
the bytes each rank's host link carried, the step the plan promised for that many tokens (the best the profile
predicts over the subgroup sizes 2^20 to 2^28) and the limits. Three causes, two cases of each, on two models:

    latency        every collective pays a fixed cost far above the profile's `collective_latency`, and the run's
                   small subgroups make two collectives each: the count, not the bytes, costs the time
    interconnect   the interconnect moves bytes far slower than the profile's `interconnect`: each step's reduces and
                   broadcasts take long whatever the subgroups; only more tokens per step spread them thinner
    imbalance      the machine is as profiled, but the subgroups are so large that the ranks own unequal shares:
                   the heaviest rank's update sets the step

The fix (a subgroup size and/or tokens per step) is graded by running it: under the hidden truth, the step model's
tokens per second with the learner's changes must reach FIX_SHARE of the plan's, within the limits. More than one fix
can be right. A wrong cause fails with why it does not fit the case's trace. The step model is arithmetic: verdicts
are the same on every machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...machine import profiles
from ...predict import stepmodel
from ...predict.shapes import ModelSpec
from ...predict.step_config import StepConfig, Workload
from .grading import grader

CAUSES = ("latency", "interconnect", "imbalance")
FIX_SHARE = 0.9  # tokens per second a fix must reach on the machine as it is, as a share of the plan's
FIX_KEYS = ("subgroup_numel", "tokens")
RANKS = 4
SEQUENCE = 2048  # tokens per sequence: a step's tokens are whole sequences
MIN_NUMEL, MAX_NUMEL = 1 << 20, 1 << 28  # the subgroup sizes the run may use (elements)
PLAN_NUMELS = tuple(1 << e for e in range(20, 29))  # the sizes the plan chose from


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    params: float  # the GPT's size (predict/shapes.py's ModelSpec.of_params)
    tokens: int  # per rank per step
    max_tokens: int  # the most tokens per rank per step the training recipe allows
    subgroup_numel: int
    truth: dict  # the hidden truth: {figure: factor on the profile's}


CASES = (
    Case("latency", 1.3e9, 32768, 32768, 1 << 22, {"collective_latency": 40}),
    Case("interconnect", 1.3e9, 16384, 32768, 1 << 22, {"interconnect": 1 / 40}),
    Case("imbalance", 1.3e9, 32768, 32768, 1 << 28, {}),
    Case("latency", 350e6, 32768, 32768, 1 << 21, {"collective_latency": 40}),
    Case("imbalance", 350e6, 16384, 16384, 1 << 26, {}),
    Case("interconnect", 350e6, 8192, 16384, 1 << 22, {"interconnect": 1 / 30}),
)

EXAMPLE = Case("latency", 1.3e9, 16384, 16384, 1 << 21, {"collective_latency": 30})  # the lab's worked trace


def given() -> profiles.Hardware:
    """The profile the runs were planned with: one GPU of the 8xh100-sxm node."""
    return profiles.preset("8xh100-sxm")


def workload(params: float, tokens: int) -> Workload:
    """A GPT of `params` parameters (shapes.ModelSpec.of_params: 24 blocks, 292 tensors), bf16 with fp32 Adam."""
    spec = ModelSpec.of_params(params)
    return Workload(spec.num_params, tokens, "mixed_bf16", spec.num_tensors, num_layers=spec.n_layer,
                    resident_params=spec.resident_params)


def settings(subgroup_numel: int) -> StepConfig:
    """Sharded optimizer offload on RANKS ranks, gradients clipped."""
    return StepConfig(ranks=RANKS, subgroup_numel=subgroup_numel, max_grad_norm=1.0)


def predict(hw: profiles.Hardware, work: Workload, config: StepConfig) -> stepmodel.Prediction:
    """The step model, as the learner may call it to try a fix (with the profile they believe)."""
    return stepmodel.predict(work, hw, config)


def _truth(case: Case) -> profiles.Hardware:
    hw = given()
    return hw.replace(**{figure: getattr(hw, figure) * factor for figure, factor in case.truth.items()})


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the step's workload, settings, trace, per-rank link bytes, plan, limits."""
    work = workload(case.params, case.tokens)
    measured = predict(_truth(case), work, settings(case.subgroup_numel))
    planned = min(predict(given(), work, settings(n)).step_s for n in PLAN_NUMELS)
    return {"work": work, "config": settings(case.subgroup_numel), "trace": measured.trace,
            "step_s": measured.step_s, "planned_s": planned, "rank_link_bytes": measured.rank_link_bytes,
            "limits": {"max_tokens": case.max_tokens, "min_subgroup_numel": MIN_NUMEL,
                       "max_subgroup_numel": MAX_NUMEL}}


def example() -> dict:
    """The step the lab shows before the task (a case the grader does not use)."""
    return run_of(EXAMPLE)


def collectives(trace) -> dict[str, tuple[int, float, float]]:
    """Per kind of span on the "net" lane: (count, bytes each rank sent, seconds), summed."""
    kinds: dict[str, tuple[int, float, float]] = {}
    for span in trace.on("net"):
        count, nbytes, seconds = kinds.get(span.name, (0, 0.0, 0.0))
        kinds[span.name] = (count + 1, nbytes + span.nbytes, seconds + span.duration)
    return kinds


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` is not the cause of this case's slow step, from what its trace shows."""
    hw, kinds = given(), collectives(run["trace"])
    _, _, norm_s = kinds["all-reduce norm"]  # no bytes: its time is the fixed cost alone
    count = sum(c for c, _, _ in kinds.values())
    sent = sum(b for _, b, _ in kinds.values())
    net_s = sum(s for _, _, s in kinds.values())
    rate = sent / (net_s - count * norm_s) / 1e9  # bytes over the time left once each fixed cost is taken off
    links = ", ".join(f"{b / 1e9:.2f}" for b in run["rank_link_bytes"])
    fixed = (f"the norm's all-reduce, which sends no bytes, took {norm_s * 1e6:.0f} us, the profile's "
             f"{hw.collective_latency * 1e6:.0f} us")
    if named == "imbalance":
        return (f"each rank's link carried about the same bytes a step ({links} GB): the ranks own even shares, so "
                f"their updates end together; the {count} collectives took {net_s * 1e3:.0f} ms of the "
                f"{run['step_s'] * 1e3:.0f} ms step")
    if case.cause == "imbalance":
        return (f"{fixed}, and the collectives moved their bytes at {rate:.0f} GB/s, the profile's "
                f"{hw.interconnect / 1e9:.0f}: the step ran as the profile predicts for these settings "
                f"({run['step_s'] * 1e3:.0f} ms); the links carried {links} GB a step")
    if named == "latency":
        return (f"{fixed}; the {count} collectives moved {sent / 1e9:.2f} GB at {rate:.0f} GB/s against the "
                f"profile's {hw.interconnect / 1e9:.0f}: the bytes are slow, not the count")
    return (f"the norm's all-reduce, which sends no bytes, took {norm_s * 1e6:.0f} us against the profile's "
            f"{hw.collective_latency * 1e6:.0f} us: each of the {count} collectives pays that fixed cost; take it off "
            f"and their bytes moved at {rate:.0f} GB/s, the profile's {hw.interconnect / 1e9:.0f}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _apply(fix: dict, case: Case, number: int) -> tuple[Workload, StepConfig]:
    """The case's workload and settings with the learner's changes, refused outside the limits."""
    unknown = sorted(set(fix) - set(FIX_KEYS))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix may change only "
                         f"{', '.join(map(repr, FIX_KEYS))}")
    numel = fix.get("subgroup_numel", case.subgroup_numel)
    assert _is_int(numel) and MIN_NUMEL <= numel <= MAX_NUMEL, (
        f"case {number}: subgroup_numel {numel!r}: the run takes subgroups of {MIN_NUMEL:,} to {MAX_NUMEL:,} elements")
    tokens = fix.get("tokens", case.tokens)
    assert _is_int(tokens) and 0 < tokens <= case.max_tokens and tokens % SEQUENCE == 0, (
        f"case {number}: tokens {tokens!r}: a rank's step takes whole sequences of {SEQUENCE}, at most "
        f"{case.max_tokens} tokens (limits['max_tokens'])")
    return workload(case.params, tokens), settings(numel)


@grader("10.4", nothing_to_refuse=(
    "no runtime function diagnoses a slow multi-rank step; the fix is graded by the step model under the hidden truth"
))
def diagnose(fn: Callable) -> str:
    """fn(hw, run, predict) -> (cause, fix), for each case."""
    hw = given()
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(hw, dict(run, limits=dict(run["limits"])), predict)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_ranks returned {answer!r}; return (cause, fix), e.g. ('latency', "
            "{'subgroup_numel': 1 << 24})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the fix is a {type(fix).__name__}; return a dict of changes"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run)}")
        work, config = _apply(fix, case, number)
        fixed = predict(_truth(case), work, config)
        reached, promised = work.tokens / fixed.step_s, case.tokens / run["planned_s"]
        on_paper = work.tokens / predict(hw, work, config).step_s / promised
        assert reached >= FIX_SHARE * promised, (
            f"case {number} ({case.cause}, rightly): with {fix} the step takes {fixed.step_s * 1e3:.0f} ms for "
            f"{work.tokens} tokens, {reached:,.0f} tokens/s a rank, {reached / promised:.0%} of the plan's "
            f"{promised:,.0f} (at least {FIX_SHARE:.0%}) on the machine as it is; " + (
                f"the profile as given predicts {on_paper:.0%}: check a fix with what the trace measured"
                if on_paper >= FIX_SHARE else f"even the profile as given predicts {on_paper:.0%}"))
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each fix reaches at least "
            f"{FIX_SHARE:.0%} of its plan's tokens per second on the machine as it is, within its limits")
