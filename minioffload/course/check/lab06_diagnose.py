"""Grader for Lab 6's diagnosis task (6.5): a step with its optimizer state on NVMe that misses the step it was planned
for, its cause named from the trace and fixed.

The learner gets the profile the run was planned with (the RTX 4090 preset: a consumer drive whose durable commit
costs 2 ms a file) and one step of the run: its workload, its settings (subgroup size, the drives the state is striped
over, the threads of the CPU Adam), the step it was planned to take, the limits of the machine and the step's trace.
The trace is the step model's on a hidden truth: the profile as given, or with its drive slower. Three causes, two
cases of each:

    commits   the profile is right, but the subgroups are so small (one tensor each) that the drive spends a large
              share of its time on per-file costs (each commit's fsyncs and index rename), not on bytes
    drive     the drive moves bytes slower than the profile says (writes throttled once its cache is full; a slot
              with half the lanes): the drive's time is bytes, at a lower rate
    cpu       the CPU Adam runs on a few of the host's cores (a job scheduler's allotment, a launcher's thread count):
              the drive waits for the CPU between its reads

The model of the settings, which the lab states: striping over d drives multiplies both drive rates by d (a file's
stripes commit in parallel, so the per-file costs stay); t threads run the CPU Adam at t / cores of the profile's
rate. The fix is graded by running it: under the hidden truth, the step model's step with the learner's settings must
be no longer than the planned step, within the limits. More than one fix can be right. A wrong cause fails with why
it does not fit the trace. Everything is the step model's arithmetic: verdicts are the same on every machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...machine import profiles
from ...predict import stepmodel
from ...predict.step_config import StepConfig, Workload
from ...trace import Trace
from .grading import grader

CAUSES = ("commits", "drive", "cpu")
SETTINGS = ("subgroup_numel", "drives", "threads")
SLACK = 0.15  # the planned step: the profile's prediction with the limits' subgroups and threads, plus this share


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    model: str  # a key of MODELS
    subgroup_numel: int
    threads: int
    slower: dict  # the hidden truth: {figure: factor on the profile's}
    max_subgroup_numel: int = 1 << 24  # host memory holds three working sets of this many parameters' state
    max_drives: int = 1  # drives the machine has for the state
    max_threads: int = 16  # the cores the job may use


MODELS = {  # bf16 weights with fp32 Adam; tensors of equal size (the step model knows counts, not shapes)
    "125M": Workload(124_000_000, 8 * 1024, "mixed_bf16", num_tensors=148),
    "350M": Workload(355_000_000, 8 * 1024, "mixed_bf16", num_tensors=292),
    "1.3B": Workload(1_300_000_000, 8 * 2048, "mixed_bf16", num_tensors=580),
}

CASES = (
    Case("commits", "350M", 1 << 20, 8, {}),
    Case("drive", "1.3B", 1 << 24, 16, {"nvme_write": 1 / 3}, max_drives=3),
    Case("cpu", "350M", 1 << 24, 1, {}, max_drives=2),
    Case("commits", "125M", 1 << 18, 4, {}, max_subgroup_numel=1 << 23),
    Case("cpu", "1.3B", 1 << 24, 2, {}, max_threads=12),
    Case("drive", "350M", 1 << 23, 2, {"nvme_read": 1 / 2, "nvme_write": 1 / 2}, max_drives=2),
)

EXAMPLE = Case("drive", "125M", 1 << 23, 16, {"nvme_write": 0.4}, max_drives=2)  # the lab's worked step, not graded


def given() -> profiles.Hardware:
    """The profile the runs were planned with: the RTX 4090 preset."""
    return profiles.preset("rtx4090")


def predict(hw: profiles.Hardware, work: Workload, settings: dict) -> stepmodel.Prediction:
    """The step model with the state on `settings["drives"]` drives like `hw`'s and the CPU Adam on
    `settings["threads"]` of its cores, as the learner may call it to try a fix (with the profile they believe)."""
    drives, threads = settings["drives"], settings["threads"]
    hw = hw.replace(nvme_read=hw.nvme_read * drives, nvme_write=hw.nvme_write * drives,
                    cpu_adam_rate=hw.cpu_adam_rate * threads / hw.cores)
    return stepmodel.predict(work, hw, StepConfig(optimizer_on="nvme", subgroup_numel=settings["subgroup_numel"]))


def _truth(case: Case) -> profiles.Hardware:
    hw = given()
    return hw.replace(**{figure: getattr(hw, figure) * factor for figure, factor in case.slower.items()})


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the workload, settings, planned step, limits, trace and step."""
    work = MODELS[case.model]
    settings = {"subgroup_numel": case.subgroup_numel, "drives": 1, "threads": case.threads}
    plan = {"subgroup_numel": case.max_subgroup_numel, "drives": 1, "threads": case.max_threads}
    measured = predict(_truth(case), work, settings)
    return {"work": work, "settings": settings, "trace": measured.trace, "step_s": measured.step_s,
            "target_s": (1 + SLACK) * predict(given(), work, plan).step_s,
            "limits": {"max_subgroup_numel": case.max_subgroup_numel, "drives": case.max_drives,
                       "threads": case.max_threads}}


def example() -> dict:
    """The step the lab shows before the task (a case the grader does not use)."""
    return run_of(EXAMPLE)


def drive_rate(trace: Trace, lane: str, per_file_s: float) -> float:
    """Bytes per second `lane`'s transfers moved, once each file's fixed cost is taken off (0 when none). A transfer
    cut by the step's start or end (still running from the step before, or into the next) is left out: the trace
    holds only its part in this step."""
    last = max((s.end for s in trace.spans), default=0.0)
    spans = [s for s in trace.on(lane) if s.nbytes and 0 < s.start and s.end < last]
    seconds = sum(s.duration - per_file_s for s in spans)
    return sum(s.nbytes for s in spans) / seconds if seconds > 0 else 0.0


def _evidence(hw: profiles.Hardware, run: dict) -> dict:
    trace = run["trace"]
    reads, writes = trace.on("nvme_read"), trace.on("nvme_write")
    drive_s = sum(s.duration for s in reads + writes)
    return {"read": drive_rate(trace, "nvme_read", hw.nvme_read_overhead) / 1e9,
            "write": drive_rate(trace, "nvme_write", hw.nvme_write_overhead) / 1e9,
            "files": len(writes), "drive_ms": 1e3 * drive_s,
            "fixed_ms": 1e3 * (len(reads) * hw.nvme_read_overhead + len(writes) * hw.nvme_write_overhead),
            "cpu_ms": 1e3 * sum(s.duration for s in trace.on("cpu") if s.name.startswith("adam"))}


def _why_not(named: str, hw: profiles.Hardware, run: dict) -> str:
    """Why `named` is not the cause of this step's miss, from what its trace shows."""
    e, threads = _evidence(hw, run), run["settings"]["threads"]
    if named == "cpu":
        return (f"the CPU's Adam was busy {e['cpu_ms']:.0f} ms of the step and the drive {e['drive_ms']:.0f} ms: "
                f"the CPU ({threads} threads of {hw.cores}) keeps up, and the update waits for the drive")
    if named == "drive":
        return (f"with each file's fixed cost taken off, the drive read at {e['read']:.2f} GB/s and wrote at "
                f"{e['write']:.2f} GB/s, the profile's {hw.nvme_read / 1e9:.2f} and {hw.nvme_write / 1e9:.2f}: it "
                "moves bytes as fast as planned")
    return (f"the drive's {e['files']} files cost {e['fixed_ms']:.0f} ms of fixed per-file time, "
            f"{e['fixed_ms'] / e['drive_ms']:.0%} of its {e['drive_ms']:.0f} ms busy (the CPU's Adam: "
            f"{e['cpu_ms']:.0f} ms): fewer files would save at most that")


def _apply(fix: dict, run: dict, number: int) -> dict:
    """The case's settings with the learner's changes, refused outside the limits."""
    unknown = sorted(set(fix) - set(SETTINGS))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix may change only "
                         f"{', '.join(map(repr, SETTINGS))}")
    settings, limits = dict(run["settings"], **fix), run["limits"]
    highest = {"subgroup_numel": (limits["max_subgroup_numel"], "host memory holds the working sets of subgroups "
                                  f"of at most {limits['max_subgroup_numel']:,} parameters"),
               "drives": (limits["drives"], f"the machine has {limits['drives']} drive(s) for the state"),
               "threads": (limits["threads"], f"the job may use {limits['threads']} cores")}
    for key, (most, why) in highest.items():
        value = settings[key]
        assert isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most, (
            f"case {number}: {key} {value!r} does not fit: {why}")
    return settings


@grader("6.5", nothing_to_refuse=(
    "no runtime function diagnoses a slow NVMe step; the fix is graded by the step model under the hidden truth"
))
def diagnose(fn: Callable) -> str:
    """fn(hw, run, predict) -> (cause, fix), for each case."""
    hw = given()
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(hw, dict(run, settings=dict(run["settings"]), limits=dict(run["limits"])), predict)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_drive returned {answer!r}; return (cause, fix), e.g. ('cpu', {{'threads': 8}})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the fix is a {type(fix).__name__}; return a dict of changes"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, hw, run)}")
        fixed = predict(_truth(case), run["work"], _apply(fix, run, number))
        assert fixed.step_s <= run["target_s"], (
            f"case {number} ({case.cause}, rightly): with {fix} the step takes {fixed.step_s:.2f} s, over the "
            f"{run['target_s']:.2f} s it was planned for: the fix must meet the plan on the machine as it is, not as "
            "the profile says")
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each fix meets its planned step on the "
            "machine as it is, within its limits")
