"""Grader for Lab 8's diagnosis task (8.4): a streamed step whose fetches are exposed, its cause named from the trace
and fixed.

The learner gets the profile a run was planned with and one step of that run: its workload, its configuration, the
limits of the machine (how deep the device lets it prefetch, how many tokens a micro-batch may hold, whether host
memory can hold the weights) and the step's trace. The trace is the step model's on a hidden truth: the profile as
given, or with its link or its drive slower. Three causes, two cases of each:

    prefetch   the copies run at the profile's rates, but each block's fetch starts only when the block is next: the
               link idles while blocks compute, and every block waits for its own weights
    link       the H2D copies run slower than the profile's link (a card in a narrower slot, a link shared with
               another device): a block's fetch outlasts its compute at any prefetch depth
    drive      the weights' home is on NVMe, and the drive reads slower than the profile says

The fix is graded by running it: under the hidden truth, the step model's exposed fetch time with the learner's
changes must be at most FIX_SHARE of the step, within the limits. More than one fix can be right (a deeper prefetch
or a larger micro-batch, a home in host memory or more tokens per fetch). A wrong cause fails with why it does not fit
the trace. Everything is the step model's arithmetic: verdicts are the same on every machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...machine import profiles
from ...predict import stepmodel
from ...predict.step_config import StepConfig, Workload
from ...trace import Trace
from .grading import grader

CAUSES = ("prefetch", "link", "drive")
FIX_SHARE = 0.05  # the exposed fetch time a fix may leave, as a share of its step
FIX_KEYS = ("prefetch", "tokens", "params_on")
MAX_PREFETCH = 2  # blocks fetched ahead that the device's memory leaves room for
MAX_TOKENS = 16384  # tokens a micro-batch may hold (its activations)


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    home: str  # where the blocks' weights live: "host" or "nvme"
    tokens: int
    prefetch: int
    slower: dict  # the hidden truth: {figure: factor on the profile's}
    host_home: bool = True  # host memory can hold the weights (a home on the host is a fix)


CASES = (
    Case("prefetch", "host", 2048, 0, {}),
    Case("link", "host", 4096, 2, {"link_h2d": 1 / 4}),
    Case("drive", "nvme", 8192, 2, {"nvme_read": 1 / 2}),
    Case("prefetch", "nvme", 16384, 0, {}, host_home=False),
    Case("link", "host", 2048, 2, {"link_h2d": 1 / 2}),
    Case("drive", "nvme", 4096, 1, {"nvme_read": 1 / 2}, host_home=False),
)

EXAMPLE = Case("link", "host", 4096, 1, {"link_h2d": 1 / 3})  # the lab's worked trace, not graded


def given() -> profiles.Hardware:
    """The profile the runs were planned with: the RTX 4090 preset."""
    return profiles.preset("rtx4090")


def workload(tokens: int) -> Workload:
    """A 1.3B-parameter GPT of 24 blocks (100M parameters outside them, resident), bf16 weights with fp32 Adam."""
    return Workload(1.3e9, tokens, "mixed_bf16", num_tensors=200, num_layers=24, resident_params=0.1e9)


def predict(hw: profiles.Hardware, work: Workload, config: StepConfig) -> stepmodel.Prediction:
    """The step model, as the learner may call it to try a fix (with the profile they believe)."""
    return stepmodel.predict(work, hw, config)


def _truth(case: Case) -> profiles.Hardware:
    hw = given()
    return hw.replace(**{figure: getattr(hw, figure) * factor for figure, factor in case.slower.items()})


def _config(case: Case) -> StepConfig:
    return StepConfig(params_on=case.home, prefetch=case.prefetch)


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the step's workload, configuration, limits, trace and figures."""
    measured = predict(_truth(case), workload(case.tokens), _config(case))
    return {"work": workload(case.tokens), "config": _config(case), "trace": measured.trace,
            "step_s": measured.step_s, "exposed_fetch_s": measured.exposed_fetch_s,
            "limits": {"max_prefetch": MAX_PREFETCH, "max_tokens": MAX_TOKENS, "host_home": case.host_home}}


def example() -> dict:
    """The step the lab shows before the task (a case the grader does not use)."""
    return run_of(EXAMPLE)


def rate(trace: Trace, lane: str) -> float:
    """Bytes per second the spans of `lane` moved while they ran (0 when the lane is empty)."""
    spans = [s for s in trace.on(lane) if s.nbytes]
    seconds = sum(s.duration for s in spans)
    return sum(s.nbytes for s in spans) / seconds if seconds else 0.0


def _per_block(trace: Trace, lane: str, word: str) -> float:
    spans = [s for s in trace.on(lane) if s.name.startswith(word)]
    return sum(s.duration for s in spans) / len(spans) if spans else 0.0


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` is not the cause of this case's exposed fetches, from what its trace shows."""
    hw, trace = given(), run["trace"]
    link, drive = rate(trace, "h2d") / 1e9, rate(trace, "nvme_read") / 1e9
    fetch_ms = 1e3 * max(_per_block(trace, "h2d", "fetch"), _per_block(trace, "nvme_read", "read"))
    compute_ms = 1e3 * _per_block(trace, "compute", "forward")
    if named == "drive" and case.home == "host":
        return "the weights live in host memory: no block is read from a drive in this trace"
    if named == "prefetch":
        slow, measured, figure = ("H2D copies", link, hw.link_h2d) if case.cause == "link" else (
            "drive reads", drive, hw.nvme_read)
        return (f"the {slow} ran at {measured:.1f} GB/s against the profile's {figure / 1e9:.1f}: a block takes "
                f"{fetch_ms:.1f} ms to arrive and {compute_ms:.1f} ms to compute forward, and no prefetch depth makes "
                f"the copies faster (this run prefetches {case.prefetch} already)")
    if named == "link":
        if case.cause == "drive":
            return (f"the H2D copies ran at {link:.1f} GB/s, the profile's {hw.link_h2d / 1e9:.1f} (less the "
                    f"per-copy latency); the drive read at {drive:.1f} GB/s against the profile's "
                    f"{hw.nvme_read / 1e9:.1f}")
        return (f"the H2D copies ran at {link:.1f} GB/s, the profile's {hw.link_h2d / 1e9:.1f} (less the per-copy "
                f"latency): the link is as fast as planned; the fetches start late (prefetch {case.prefetch})")
    return (f"the drive read at {drive:.1f} GB/s, the profile's {hw.nvme_read / 1e9:.1f} (less the per-read cost): "
            f"the drive is as fast as planned; the fetches start late (prefetch {case.prefetch})")


def _apply(fix: dict, case: Case, number: int) -> tuple[Workload, StepConfig]:
    """The case's workload and configuration with the learner's changes, refused outside the limits."""
    unknown = sorted(set(fix) - set(FIX_KEYS))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix may change only "
                         f"{', '.join(map(repr, FIX_KEYS))}")
    prefetch = fix.get("prefetch", case.prefetch)
    assert isinstance(prefetch, int) and not isinstance(prefetch, bool) and 0 <= prefetch <= MAX_PREFETCH, (
        f"case {number}: prefetch {prefetch!r}: the device has room for a prefetch of 0 to {MAX_PREFETCH}")
    tokens = fix.get("tokens", case.tokens)
    assert isinstance(tokens, int) and not isinstance(tokens, bool) and 0 < tokens <= MAX_TOKENS, (
        f"case {number}: tokens {tokens!r}: a micro-batch holds 1 to {MAX_TOKENS} tokens on this device")
    home = fix.get("params_on", case.home)
    assert home in ("host", "nvme"), f"case {number}: params_on {home!r}: the weights stream from 'host' or 'nvme'"
    assert home == case.home or case.host_home, (
        f"case {number}: params_on 'host' does not fit: this host's memory cannot hold the weights "
        "(limits['host_home'] is False)")
    return workload(tokens), StepConfig(params_on=home, prefetch=prefetch)


@grader("8.4", nothing_to_refuse=(
    "no runtime function diagnoses an exposed fetch; the fix is graded by the step model under the hidden truth"
))
def diagnose(fn: Callable) -> str:
    """fn(hw, run, predict) -> (cause, fix), for each case."""
    hw = given()
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(hw, dict(run, limits=dict(run["limits"])), predict)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_fetch returned {answer!r}; return (cause, fix), e.g. ('prefetch', "
            "{'prefetch': 1})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the fix is a {type(fix).__name__}; return a dict of changes"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run)}")
        work, config = _apply(fix, case, number)
        fixed = predict(_truth(case), work, config)
        share = fixed.exposed_fetch_s / fixed.step_s
        assert share <= FIX_SHARE, (
            f"case {number} ({case.cause}, rightly): with {fix} the step leaves {1e3 * fixed.exposed_fetch_s:.0f} ms "
            f"of fetches exposed, {share:.1%} of its {1e3 * fixed.step_s:.0f} ms (at most {FIX_SHARE:.0%}): "
            "the fix must hide the fetches on the machine as it is, not as the profile says")
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each fix leaves at most "
            f"{FIX_SHARE:.0%} of its step's fetches exposed on the machine as it is, within its limits")
