"""Grader for Lab 2's diagnosis task (2.6): a chunk pipeline that races or does not overlap, its cause named from
the strict simulator's HazardError or from the run's trace, and fixed.

The grader owns the pipeline: the runtime's `pipeline.overlapped` on the simulated GPU, with four settings (the
waits it uses, the buffers each way, pinned or pageable host chunks, and how many streams its three stages are
spread over). Each case breaks one setting of a healthy pipeline. Five causes, two cases of each:

    data_wait      a wait for the data is missing: compute or a D2H copy may use a chunk before it is there
    reuse_wait     a wait for the buffer is missing: chunk k + buffers overwrites a buffer chunk k still uses
    pageable       the host chunks are pageable: each copy runs slower and blocks the host until it is done
    shared_stream  the stages share a stream (all on the default one, or both copies on one): nothing overlaps
    one_buffer     one device buffer each way: the H2D of chunk k+1 must wait for compute k

The learner sees what a practitioner sees: the strict simulator's message when it stopped the run, otherwise the
run's trace and its device memory peak. The fix is a dict of changed settings, graded by running it: on the strict
simulator (no hazard, every chunk right, within the device's memory) and in the simulated GPU's model time, which
must be at most TARGET times a perfect pipeline's time. Model time is the schedule the sim keeps on an idle machine
(`model_schedule`): each op starts when its stream, its copy engine, its waits and the host allow. It is worked out,
not measured, so a busy machine, whose threads wake late, cannot change a verdict. More than one fix can be right. A
wrong cause fails with why it does not fit that case's evidence. The evidence the learner reads is structural (a
hazard message, spans on the host lane, which lanes overlap, the memory peak), the same on a busy machine.

What this is not: a test of Task 2.2's pipeline (lab02.py) or of which waits a schedule needs (Task 2.3).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from ...devices import Link, pipeline
from ...devices.hazards import HazardError
from ...ledger import OutOfMemoryError
from ...trace import Trace
from .grading import grader, sim_device

CAUSES = ("data_wait", "reuse_wait", "pageable", "shared_stream", "one_buffer")
FIX_KEYS = ("waits", "buffers", "pinned", "streams")
TARGET = 1.25  # a fixed run may take at most this many times a perfect pipeline's time (healthy: 1.0; broken: 1.4-4)
PAGEABLE_SLOWDOWN = 2.0  # the sim's default: a copy from pageable memory runs this many times slower
CHUNK_FLOATS = 256 * 1024  # 1 MiB chunks ...
CHUNK_BYTES = CHUNK_FLOATS * 4
LINK = Link(bandwidth=0.25e9, latency=10e-6)  # ... on a slow link: about 4 ms a copy, so threads keep up
TINY_FLOATS = 16  # the strict simulator checks the order of accesses, not their timing: tiny chunks do
LANES = ("h2d", "compute", "d2h")
HEALTHY = {"waits": pipeline.WAITS, "buffers": 2, "pinned": True, "streams": 3}


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    broken: dict  # the settings that differ from HEALTHY (with its buffers, when the case uses 3)
    num_chunks: int = 8
    kernel: float = 1.0  # the kernel's time, in copy times
    room: int = 4  # chunk buffers the device's memory holds (both ways together)


CASES = (
    Case("data_wait", {"waits": pipeline.WAITS - {"compute_after_h2d"}}),
    Case("shared_stream", {"streams": 1, "buffers": 3}, kernel=2.0, room=6),
    Case("reuse_wait", {"waits": pipeline.WAITS - {"h2d_after_compute"}, "buffers": 3}, num_chunks=6, room=6),
    Case("pageable", {"pinned": False}),
    Case("one_buffer", {"buffers": 1}),
    Case("reuse_wait", {"waits": pipeline.WAITS - {"compute_after_d2h"}}, kernel=0.5),
    Case("pageable", {"pinned": False, "buffers": 3}, num_chunks=6, kernel=2.0, room=6),
    Case("data_wait", {"waits": pipeline.WAITS - {"d2h_after_compute"}, "buffers": 3}, num_chunks=6, kernel=2.0,
         room=6),
    Case("shared_stream", {"streams": 2}, num_chunks=6, kernel=0.5),
    Case("one_buffer", {"buffers": 1}, num_chunks=6, kernel=2.0, room=6),
)

EXAMPLES = (  # the lab's worked runs, not graded
    Case("reuse_wait", {"waits": pipeline.WAITS - {"h2d_after_compute"}, "buffers": 3}, room=6),
    Case("one_buffer", {"buffers": 1}, kernel=0.5),
)


class _Streams:
    """The device as the pipeline sees it, with its three stages' streams spread over `count` streams: 1 puts them
    all on the default stream, 2 puts both copies on one stream and compute on another, 3 gives each its own."""

    def __init__(self, dev, count: int):
        self._dev, self._count, self._made = dev, count, {}

    def stream(self, stage: str):
        name = "default" if self._count == 1 else "copy" if self._count == 2 and stage != "compute" else stage
        if name == "default":
            return self._dev.default_stream
        if name not in self._made:
            self._made[name] = self._dev.stream(name)
        return self._made[name]

    def __getattr__(self, attribute: str):
        return getattr(self._dev, attribute)


def _double(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, 2, out=out)


def _settings(case: Case) -> dict:
    return {**HEALTHY, **case.broken}


def _run(settings: dict, case: Case, strict: bool) -> tuple[str | None, Trace | None, int]:
    """Run the pipeline once: (the HazardError's message or None, the trace or None, the device memory peak).
    Strict: tiny chunks on the strict simulator; otherwise the case's chunks, link and kernel, in model time."""
    floats = TINY_FLOATS if strict else CHUNK_FLOATS
    with sim_device(strict=strict, h2d=LINK, d2h=LINK, memory_bytes=case.room * floats * 4) as dev:
        chunks_in = [dev.host_empty(floats, pinned=settings["pinned"]).fill_(k + 1) for k in range(case.num_chunks)]
        chunks_out = [dev.host_empty(floats, pinned=settings["pinned"]).fill_(-1) for _ in chunks_in]
        try:
            pipeline.overlapped(_Streams(dev, settings["streams"]), chunks_in, chunks_out, _double,
                                None if strict else kernel_seconds(case), settings["buffers"], settings["waits"])
        except HazardError as err:
            return str(err), None, dev.ledger.peak("device")
        wrong = [k for k, (x, y) in enumerate(zip(chunks_in, chunks_out, strict=True)) if not torch.equal(2 * x, y)]
        assert not wrong, f"chunk {wrong[0]} came back wrong with no HazardError: {settings}"  # the runtime's bug
        return None, None if strict else dev.trace, dev.ledger.peak("device")


def kernel_seconds(case: Case) -> float:
    return case.kernel * LINK.seconds(CHUNK_BYTES)


def perfect_s(case: Case) -> float:
    """A perfect pipeline's time: the first chunk's three stages, then the slowest stage once per other chunk."""
    copy = LINK.seconds(CHUNK_BYTES)
    return 2 * copy + kernel_seconds(case) + (case.num_chunks - 1) * max(copy, kernel_seconds(case))


def run_time(trace: Trace) -> float:
    """From the first op's start to the last op's end, on the device's three lanes."""
    spans = [s for lane in LANES for s in trace.on(lane)]
    return max(s.end for s in spans) - min(s.start for s in spans)


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the strict simulator's message, or the run's trace and memory peak."""
    settings = _settings(case)
    error, _, _ = _run(settings, case, strict=True)
    trace, peak = (None, None) if error else _run(settings, case, strict=False)[1:]
    return {"error": error, "trace": trace, "peak_bytes": peak, "num_chunks": case.num_chunks,
            "chunk_bytes": CHUNK_BYTES, "link": LINK.bandwidth, "kernel_s": kernel_seconds(case),
            "perfect_s": perfect_s(case), "limits": {"device_bytes": case.room * CHUNK_BYTES}}


def example(number: int) -> dict:
    """One of the runs the lab shows before the task (cases the grader does not use)."""
    return run_of(EXAMPLES[number])


def _chunks_named(error: str) -> list[int]:
    """The chunk numbers of the two ops the checker's message names ('h2d 2', 'compute 0', ...)."""
    return [int(k) for k in re.findall(r"'(?:h2d|compute|d2h) (\d+)'", error)]


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` is not the cause of this case, from what its evidence shows."""
    error, trace = run["error"], run["trace"]
    if error:
        if named not in ("data_wait", "reuse_wait"):
            return (f"the strict simulator stopped the run at a hazard: {error.split(': nothing orders')[0]}. "
                    "A race is not a matter of speed: something uses a buffer that nothing orders it after")
        later, earlier = _chunks_named(error)[:2]
        if named == "data_wait":
            return (f"the checker names chunk {later} and chunk {earlier}: two chunks that share a buffer, the later "
                    "one touching it while the earlier one may still use it, not one chunk's data used too early")
        return (f"the checker names chunk {later} twice: one chunk's work touched its buffer before that chunk's "
                "own earlier stage was ordered before it; no buffer passed from one chunk to another")
    if named in ("data_wait", "reuse_wait"):
        return (f"the strict simulator ran all {case.num_chunks} chunks with no HazardError: every wait the buffers "
                f"need is there; the run is slow ({run_time(trace) / run['perfect_s']:.1f} times a perfect "
                "pipeline's time), not racing")
    blocked, chunks = len(trace.on("host")), run["peak_bytes"] / CHUNK_BYTES
    copies = [s for s in trace.on("h2d") + trace.on("d2h") if s.nbytes]
    rate = sum(s.nbytes for s in copies) / sum(s.duration for s in copies) / 1e9
    paired = sum(h.overlaps(d) for h in trace.on("h2d") for d in trace.on("d2h"))
    if named == "pageable":
        return (f"the trace's 'host' lane is empty (no copy blocked the host) and the copies ran at {rate:.2f} GB/s, "
                f"the pinned link's {LINK.bandwidth / 1e9:.2f}: the host chunks are pinned")
    if case.cause == "pageable":
        return (f"the trace's 'host' lane holds {blocked} spans where a copy blocked the host, and the copies ran at "
                f"{rate:.2f} GB/s against the pinned link's {LINK.bandwidth / 1e9:.2f}")
    if named == "shared_stream":
        return (f"{paired} H2D copies overlapped a D2H copy: the two copies run on streams of their own; device "
                f"memory peaked at {chunks:g} chunk buffers")
    return (f"device memory peaked at {chunks:g} chunk buffers ({chunks / 2:g} each way), yet no two of the device's "
            f"spans overlapped ({paired} H2D copies overlapped a D2H copy)")


def _apply(fix: dict, case: Case, number: int) -> dict:
    """The case's settings with the learner's changes, refused when a value is not a setting the pipeline has."""
    unknown = sorted(set(fix) - set(FIX_KEYS))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix may change only "
                         f"{', '.join(map(repr, FIX_KEYS))}")
    settings = {**_settings(case), **fix}
    waits = settings["waits"]
    assert isinstance(waits, (set, frozenset)) and waits <= pipeline.WAITS, (
        f"case {number}: waits {waits!r}: give a set of rule names from {sorted(pipeline.WAITS)}")
    buffers = settings["buffers"]
    assert isinstance(buffers, int) and not isinstance(buffers, bool) and buffers >= 1, (
        f"case {number}: buffers {buffers!r}: the device buffers each way, a whole number from 1")
    assert isinstance(settings["pinned"], bool), f"case {number}: pinned {settings['pinned']!r}: True or False"
    assert settings["streams"] in (1, 2, 3), (
        f"case {number}: streams {settings['streams']!r}: the three stages run on 1, 2 or 3 streams")
    return dict(settings, waits=frozenset(waits))


def model_schedule(settings: dict, case: Case) -> dict[tuple[str, int], tuple[float, float]]:
    """(stage, chunk) -> (start, end) in model time: the run the sim keeps on an idle machine. The host issues chunk
    by chunk, stage by stage, as `pipeline.overlapped` does; an op starts once its stream's previous op, its copy
    engine (one per direction), the waits in `settings` and the host allow; a copy from pageable memory runs
    PAGEABLE_SLOWDOWN times slower and the host waits for it."""
    copy = LINK.seconds(CHUNK_BYTES) * (1.0 if settings["pinned"] else PAGEABLE_SLOWDOWN)
    seconds = {"h2d": copy, "compute": kernel_seconds(case), "d2h": copy}
    count, waits, reuse = settings["streams"], settings["waits"], settings["buffers"]
    stream_of = {stage: 0 if count == 1 else stage if count == 3 or stage == "compute" else "copy" for stage in LANES}
    after = {"h2d": [("compute", reuse, "h2d_after_compute")],
             "compute": [("h2d", 0, "compute_after_h2d"), ("d2h", reuse, "compute_after_d2h")],
             "d2h": [("compute", 0, "d2h_after_compute")]}
    stream_free: dict = {}
    engine_free = {"h2d": 0.0, "d2h": 0.0}
    host, spans = 0.0, {}
    for k in range(case.num_chunks):
        for stage in LANES:
            ready = [spans[(other, k - back)][1] for other, back, rule in after[stage] if rule in waits and k >= back]
            start = max([host, stream_free.get(stream_of[stage], 0.0), engine_free.get(stage, 0.0), *ready])
            end = start + seconds[stage]
            spans[(stage, k)] = (start, end)
            stream_free[stream_of[stage]] = end
            if stage in engine_free:
                engine_free[stage] = end
                if not settings["pinned"]:
                    host = end
    return spans


def model_time(settings: dict, case: Case) -> float:
    """The run's time in model time: from the first op's start to the last op's end."""
    return max(end for _, end in model_schedule(settings, case).values())


def _fixed(settings: dict, case: Case, number: int, fix: dict) -> None:
    """Grade the fix: clean on the strict simulator, within the device's memory, and within TARGET of a perfect
    pipeline's time in model time."""
    try:
        error, _, _ = _run(settings, case, strict=True)
    except OutOfMemoryError:
        raise AssertionError(
            f"case {number}: with {fix} the pipeline needs {2 * settings['buffers']} chunk buffers of "
            f"{CHUNK_BYTES / 2**20:g} MiB; the device holds {case.room} (limits['device_bytes'] = "
            f"{case.room * CHUNK_BYTES:,})") from None
    assert error is None, f"case {number}: with {fix} the strict simulator still stops at a hazard: {error}"
    slower = model_time(settings, case) / perfect_s(case)
    if slower <= TARGET:
        return
    spans = model_schedule(settings, case)
    hidden = sum(any(min(h[1], c[1]) > max(h[0], c[0]) for c in (spans[("compute", j)] for j in range(case.num_chunks)))
                 for h in (spans[("h2d", k)] for k in range(case.num_chunks)))
    blocked = 0 if settings["pinned"] else 2 * case.num_chunks
    raise AssertionError(
        f"case {number} ({case.cause}, rightly): with {fix} the run takes {slower:.2f} times a perfect pipeline's time "
        f"(at most {TARGET}): {hidden} of its {case.num_chunks} H2D copies overlap a compute, and "
        f"{blocked} copies block the host")


@grader("2.6", nothing_to_refuse=(
    "no runtime function diagnoses a pipeline; the fix is graded by running the grader's own pipeline with it"
))
def diagnose(fn: Callable) -> str:
    """fn(run) -> (cause, fix), for each case."""
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(dict(run, limits=dict(run["limits"])))
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_pipeline returned {answer!r}; return (cause, fix), e.g. ('pageable', "
            "{'pinned': True})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the fix is a {type(fix).__name__}; return a dict of changes"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run)}")
        _fixed(_apply(fix, case, number), case, number, fix)
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each fix ran clean on the strict "
            f"simulator in the device's memory, within {TARGET} times a perfect pipeline's time in model time")
