"""Graders for Lab 2, "Moving bytes": the double-buffered pipeline, its wait rules, overlap (2.2-2.5).

Task 2.1 (the slot pool) is graded in lab02_pool.py.

The pipeline graders run the learner's code on the simulated device with jitter and with one stage
made slow at a time (the H2D link, the kernel, the D2H link). A slow stage makes each missing wait
show up as a wrong chunk in every trial, not one trial in three; the trace of the failed run then
says which rule was broken. Verdicts carry counts and sizes, never timings, so they are the same on
every run.

No grader here holds a task's answer. Which waits a schedule needs (2.3) is what the strict simulator's hazard
checker finds when a wait is left out of `pipeline.overlapped`; the makespan (2.5) is what the runtime's list
scheduler (predict/schedule.py) makes of the rules, stated as operations and their dependencies.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from ...devices import Link, pipeline
from ...devices.hazards import HazardError
from ...pinned import aligned_empty
from ...predict.schedule import Plan, schedule
from ...trace import Span, Trace
from .grading import grader, sim_device

# ---------------------------------------------------------------------------------------------
# Task 2.2: the double-buffered pipeline

NUM_CHUNKS, CHUNK_FLOATS = 8, 64 * 1024  # 8 chunks of 256 KiB: a copy takes ~0.13 ms at 2 GB/s
CHUNK_BYTES = CHUNK_FLOATS * 4
SLOW_STAGE = 1e-3  # s per chunk for the stage a scenario slows down
SLOW_LINK = Link(bandwidth=CHUNK_BYTES / SLOW_STAGE, latency=10e-6)
JITTER = 2e-4  # s: each stream op starts up to this late
SEEDS = (0, 1)
STRUCTURE_KERNEL_SECONDS = 2e-4  # the jitter-free run: compute about as long as a copy


def _double(x: torch.Tensor, out: torch.Tensor) -> None:
    """The grader's kernel. Inputs are distinct per chunk, so a stale buffer gives a wrong result."""
    torch.mul(x, 2, out=out)


def _slow_double(x: torch.Tensor, out: torch.Tensor) -> None:
    """A slow kernel that reads its input only at the end, as a long kernel's last loads would."""
    time.sleep(SLOW_STAGE)
    torch.mul(x, 2, out=out)


# (name, device options, kernel): one stage slow per scenario, so each wait's hazard is exposed
SCENARIOS = (
    ("slow H2D", {"h2d": SLOW_LINK}, _double),
    ("slow kernel", {}, _slow_double),
    ("slow D2H", {"d2h": SLOW_LINK}, _double),
)

RULES = {  # wait -> (what the trace shows when it is missing, as a format string over chunk k)
    "compute_after_h2d": "compute of chunk {k} started before its H2D copy finished",
    "d2h_after_compute": "the D2H copy of chunk {k} started before its compute finished",
    "h2d_after_compute": "the H2D copy of chunk {k2} overwrote input buffer {b} before compute of chunk {k} "
                         "was done reading it",
    "compute_after_d2h": "compute of chunk {k2} overwrote output buffer {b} before the D2H copy of chunk {k} "
                         "was done reading it",
}
WAIT_HINT = {
    "compute_after_h2d": "compute.wait(arrived[k]) before launching chunk k",
    "d2h_after_compute": "d2h.wait(computed[k]) before copying chunk k out",
    "h2d_after_compute": "h2d.wait(computed[k - 2]) before copying chunk k into a reused input buffer",
    "compute_after_d2h": "compute.wait(departed[k - 2]) before chunk k writes a reused output buffer",
}


def _host_chunks() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pinned input chunks with values distinct across all chunks, and pinned output chunks."""
    chunks_in, chunks_out = [], []
    for k in range(NUM_CHUNKS):
        chunk = aligned_empty(CHUNK_BYTES).view(torch.float32)  # (CHUNK_FLOATS,) fp32, pinned
        torch.arange(k * CHUNK_FLOATS + 1, (k + 1) * CHUNK_FLOATS + 1, dtype=torch.float32, out=chunk)
        chunks_in.append(chunk)
        chunks_out.append(aligned_empty(CHUNK_BYTES).view(torch.float32))
    return chunks_in, chunks_out


SENTINEL = -1.0  # output chunks are filled with this before each run: "never copied back"


def _describe(got: torch.Tensor, expected: list[torch.Tensor], k: int) -> str:
    """What a wrong output chunk holds, in words: nothing, zeros, another chunk's result, a mix."""
    if torch.all(got == SENTINEL):
        return "never came back (its output is untouched)"
    if torch.all(got == 0):
        return "came back as zeros (a buffer read before anything was written to it)"
    for j, other in enumerate(expected):
        if j != k and torch.equal(got, other):
            when = "an earlier" if j < k else "a later"
            return f"came back holding chunk {j}'s result ({when} chunk that shares its buffers)"
    wrong = int((got != expected[k]).sum())
    return f"came back with {wrong} of {got.numel()} values wrong (a buffer read while it was being written)"


def _broken_rules(trace: Trace, buffers: int = 2) -> list[tuple[str, str]]:
    """Rules the trace shows broken, as (wait name, sentence). Spans on each lane are taken in start
    order as chunks 0, 1, ...; an empty list when the lanes do not hold one span per chunk."""
    lanes = {lane: sorted(trace.on(lane), key=lambda s: s.start) for lane in ("h2d", "compute", "d2h")}
    if any(len(spans) != NUM_CHUNKS for spans in lanes.values()):
        return []
    h2d, compute, d2h = lanes["h2d"], lanes["compute"], lanes["d2h"]
    broken: list[tuple[str, str]] = []

    def check(name: str, later: Span, earlier: Span, **where) -> None:
        if later.start < earlier.end and name not in {b[0] for b in broken}:
            broken.append((name, RULES[name].format(**where)))

    for k in range(NUM_CHUNKS):
        check("compute_after_h2d", compute[k], h2d[k], k=k)
        check("d2h_after_compute", d2h[k], compute[k], k=k)
        if k + buffers < NUM_CHUNKS:
            check("h2d_after_compute", h2d[k + buffers], compute[k], k=k, k2=k + buffers, b=k % buffers)
            check("compute_after_d2h", compute[k + buffers], d2h[k], k=k, k2=k + buffers, b=k % buffers)
    return broken


def _first_wrong(chunks_out: list[torch.Tensor], expected: list[torch.Tensor]) -> int | None:
    return next((k for k, (got, want) in enumerate(zip(chunks_out, expected, strict=True))
                 if not torch.equal(got, want)), None)


def _run_pipeline(fn: Callable, kernel: Callable, kernel_seconds: float | None, what: str,
                  **options) -> tuple[Trace, int]:
    """Run fn on a fresh sim device; check every chunk; return the trace and the device memory peak."""
    chunks_in, chunks_out = _host_chunks()
    expected = pipeline.reference(chunks_in, _double)  # the slow kernel computes the same
    for chunk in chunks_out:
        chunk.fill_(SENTINEL)
    # not strict: this grader lets a missing wait run (with jitter) to name it from the trace in the lab's words;
    # the strict sim's hazard checker would stop at the first unordered copy with the streams' names instead
    with sim_device(strict=False, **options) as dev:
        fn(dev, chunks_in, chunks_out, kernel, kernel_seconds)
        k = _first_wrong(chunks_out, expected)
        if k is not None:
            dev.synchronize()
            if _first_wrong(chunks_out, expected) is None:
                raise AssertionError(f"{what}: the results were not all there when your function returned, but "
                                     "were a moment later: end with dev.synchronize() so the host waits for "
                                     "every D2H copy")
            problem = _describe(chunks_out[k], expected, k)
            broken = _broken_rules(dev.trace)
            if broken:
                name, sentence = broken[0]
                hint = f"the trace shows {sentence}: add the wait {name!r} ({WAIT_HINT[name]})"
            else:
                hint = ("probably a missing wait; check each of "
                        + ", ".join(f"{name!r}" for name in sorted(pipeline.WAITS)))
            raise AssertionError(f"{what}: chunk {k} {problem}, expected 2 * input; {hint}")
        peak = dev.ledger.peak("device")
    return dev.trace, peak


def _wait_named_by(err: HazardError) -> str:
    """The pipeline's wait whose absence the hazard checker's message describes: what acted, then what it was not
    ordered after ("the d2h copy ... reads X, which <compute> may still write": d2h_after_compute)."""
    acted, _, unordered = str(err).partition(", which ")
    for copy, after_compute, compute_after in (("the d2h copy", "d2h_after_compute", "compute_after_d2h"),
                                               ("the h2d copy", "h2d_after_compute", "compute_after_h2d")):
        if copy in acted:
            return after_compute
        if copy in unordered:
            return compute_after
    return ""


def _strict_run(fn: Callable) -> None:
    """Run fn once on the strict sim, whose hazard checker holds it to a device that runs behind the host: a missing
    wait raises there in every run, where the jittered trials catch it only when the timing exposes it (not on a
    busy machine, whose slow host thread lets every copy finish first)."""
    chunks_in, chunks_out = _host_chunks()
    try:
        with sim_device(strict=True) as dev:
            fn(dev, chunks_in, chunks_out, _double, None)
            dev.synchronize()
    except HazardError as err:
        wait = _wait_named_by(err)
        hint = f"add the wait {wait!r} ({WAIT_HINT[wait]})" if wait else "a wait is missing"
        raise AssertionError(f"on a device that runs behind the host, your pipeline lets the streams race: {hint}. "
                             f"The checker: {err}") from None


@grader("2.2", rebuilds=("minioffload.devices.pipeline.overlapped", "minioffload.devices.pipeline.single_buffer"))
def double_buffered(fn: Callable) -> str:
    """fn(dev, chunks_in, chunks_out, kernel, kernel_seconds): overlapped(..., buffers=2), by hand."""
    _strict_run(fn)
    trials = 0
    for seed in SEEDS:
        for name, options, kernel in SCENARIOS:
            trials += 1
            _run_pipeline(fn, kernel, None, f"trial {trials} ({name}, jitter, seed {seed})",
                          jitter=JITTER, seed=seed, **options)
    trace, peak = _run_pipeline(fn, _double, STRUCTURE_KERNEL_SECONDS, "the run without jitter")
    lanes = {lane: trace.on(lane) for lane in ("h2d", "compute", "d2h")}
    for lane, spans in lanes.items():
        assert len(spans) == NUM_CHUNKS, (
            f"the trace has {len(spans)} {lane!r} spans for {NUM_CHUNKS} chunks; expected one per chunk "
            f"({'dev.copy' if lane != 'compute' else 'dev.launch'} once per chunk)")
    short = [s for s in lanes["compute"] if s.duration < 0.99 * STRUCTURE_KERNEL_SECONDS]  # float rounding
    assert not short, (f"{len(short)} compute spans are shorter than kernel_seconds: pass it on as "
                       "dev.launch(..., duration=kernel_seconds)")
    # the buffers first: their count does not depend on the timing, the overlap does
    buffers = peak / CHUNK_BYTES
    assert peak <= 4 * CHUNK_BYTES, (
        f"device memory peaked at {buffers:g} chunk buffers; expected at most 4 (two in, two out): allocate "
        "the buffers once, before the loop, and reuse them")
    assert any(h.overlaps(c) for h in lanes["h2d"] for c in lanes["compute"]), (
        "results are right, but no H2D copy overlapped any compute: with one stream, or one buffer each way, "
        "chunk k+1 cannot arrive while chunk k is computed; use separate h2d/compute/d2h streams and two "
        "buffers each way, and wait only on the events the rules need")
    return (f"{trials} jittered trials correct (slow H2D, slow kernel, slow D2H); h2d overlapped compute; "
            f"peak {buffers:g} buffers")


# ---------------------------------------------------------------------------------------------
# Task 2.3: which waits a schedule needs

SAFETY_RUNS = ((NUM_CHUNKS, 2), (4, 4))  # (num_chunks, buffers) run on the jittery sim with the learner's answer
HAZARD_FLOATS = 16  # the strict sim checks the order of accesses, not their timing: tiny chunks do


def hazard(num_chunks: int, buffers: int, waits: frozenset[str]) -> str | None:
    """Run pipeline.overlapped with `waits` on the strict sim, whose hazard checker stops at the first access a
    GPU could run in the wrong order (vector clocks, not timing: the same answer every run); its message, or None."""
    with sim_device(strict=True) as dev:
        chunks_in = [dev.host_empty(HAZARD_FLOATS).fill_(k) for k in range(num_chunks)]
        chunks_out = [dev.host_empty(HAZARD_FLOATS) for _ in range(num_chunks)]
        try:
            pipeline.overlapped(dev, chunks_in, chunks_out, _double, None, buffers=buffers, waits=waits)
        except HazardError as err:
            return str(err)
    return None


def needed_by_hazards(num_chunks: int, buffers: int) -> dict[str, str]:
    """The rules the pipeline needs, each with what the strict sim reports when it is left out."""
    found = {}
    for rule in sorted(pipeline.WAITS):
        message = hazard(num_chunks, buffers, pipeline.WAITS - {rule})
        if message is not None:
            found[rule] = message
    return found


def _overlapped_with(waits: frozenset[str], buffers: int, num_chunks: int) -> Callable:
    def run(dev, chunks_in, chunks_out, kernel, kernel_seconds):
        pipeline.overlapped(dev, chunks_in[:num_chunks], chunks_out[:num_chunks], kernel, kernel_seconds,
                            buffers=buffers, waits=waits)
    return run


@grader("2.3", nothing_to_refuse=(
    "the runtime's pipeline uses every wait; no runtime function says which ones a schedule needs"
))
def needed_waits(fn: Callable) -> str:
    """fn(num_chunks, buffers) -> the subset of pipeline.WAITS the overlapped pipeline needs."""
    cases, fewest = 0, len(pipeline.WAITS)
    for num_chunks in range(1, 7):
        for buffers in range(1, 8):
            got = fn(num_chunks, buffers)
            assert isinstance(got, (set, frozenset)), f"needed_waits returned {got!r}; return a set of rule names"
            unknown = set(got) - pipeline.WAITS
            assert not unknown, f"unknown rule names {sorted(unknown)}; the rules are {sorted(pipeline.WAITS)}"
            needed = needed_by_hazards(num_chunks, buffers)
            call = f"needed_waits({num_chunks}, {buffers}) returned {sorted(got)}"
            missing, extra = sorted(needed.keys() - got), sorted(set(got) - needed.keys())
            if missing:
                raise AssertionError(f"{call}, without {missing[0]!r}: pipeline.overlapped with your waits on the "
                                     f"strict simulator stops at a hazard: {needed[missing[0]]}")
            if extra:
                raise AssertionError(f"{call}, with {extra[0]!r}, which the pipeline does not need here: without "
                                     f"it, pipeline.overlapped with num_chunks={num_chunks} and buffers={buffers} "
                                     "runs with no hazard on the strict simulator, and an unneeded wait only "
                                     "costs time")
            fewest = min(fewest, len(needed))
            cases += 1
    for num_chunks, buffers in SAFETY_RUNS:
        waits = frozenset(fn(num_chunks, buffers))
        run = _overlapped_with(waits, buffers, num_chunks)
        for name, options, kernel in SCENARIOS:
            _check_slice(run, kernel, num_chunks,
                         f"overlapped({num_chunks} chunks, buffers={buffers}, waits=your answer), {name}",
                         jitter=JITTER, seed=0, **options)
    runs = len(SAFETY_RUNS) * len(SCENARIOS)
    return (f"{cases} (num_chunks, buffers) cases match; your waits kept {runs} jittered runs correct; "
            f"{fewest} rules suffice when no buffer is reused")


def _check_slice(run: Callable, kernel: Callable, num_chunks: int, what: str, **options) -> None:
    """Run `run` on the first num_chunks chunks and compare those with the reference."""
    chunks_in, chunks_out = _host_chunks()
    expected = pipeline.reference(chunks_in[:num_chunks], _double)
    for chunk in chunks_out:
        chunk.fill_(SENTINEL)
    with sim_device(strict=False, **options) as dev:  # not strict: see _run_pipeline
        run(dev, chunks_in, chunks_out, kernel, None)
    k = _first_wrong(chunks_out[:num_chunks], expected)
    assert k is None, f"{what}: chunk {k} {_describe(chunks_out[k], expected, k)}, expected 2 * input"


# ---------------------------------------------------------------------------------------------
# Task 2.4: overlap from spans

HAND_MADE = [  # (spans, what they show)
    ([], "no spans"),
    ([("h2d", 0.0, 1.0)], "one span"),
    ([("h2d", 0.0, 2.0), ("h2d", 1.0, 3.0)], "one lane, overlapping spans"),
    ([("h2d", 0.0, 1.0), ("compute", 1.0, 2.0)], "two lanes, touching"),
    ([("h2d", 0.0, 1.0), ("compute", 0.0, 1.0)], "two lanes, the same interval"),
    ([("h2d", 0.0, 2.0), ("compute", 1.0, 3.0)], "two lanes, half overlapping"),
    ([("h2d", 0.0, 4.0), ("compute", 1.0, 2.0), ("d2h", 1.5, 3.0)], "three lanes, nested"),
    ([("h2d", 0.0, 1.0), ("h2d", 0.5, 2.0), ("compute", 0.75, 1.25)], "a lane overlapping itself and another"),
    ([("h2d", 0.0, 1.0), ("compute", 5.0, 6.0)], "two lanes with a gap"),
    ([("h2d", 0.0, 0.0), ("compute", 0.0, 1.0)], "a zero-length span"),
]
RANDOM_SETS = 200


def _reference_overlap(spans: list[tuple[str, float, float]]) -> float:
    return Trace(spans=[Span(lane, "span", start, end) for lane, start, end in spans]).overlap_fraction()


def _random_spans(rng: random.Random) -> list[tuple[str, float, float]]:
    spans = []
    for _ in range(rng.randint(1, 12)):
        start = rng.uniform(0, 10)
        spans.append((rng.choice(("h2d", "compute", "d2h")), start, start + rng.uniform(0, 3)))
    return spans


@grader("2.4", rebuilds=("minioffload.trace.Trace.overlap_fraction", "minioffload.trace.union_length"))
def overlap_fraction(fn: Callable) -> str:
    """fn(spans) with spans a list of (lane, start, end) -> the overlap fraction, as Trace computes it."""
    for spans, what in HAND_MADE:
        expected = _reference_overlap(spans)
        got = fn(list(spans))
        assert isinstance(got, (int, float)) and abs(got - expected) <= 1e-9, (
            f"{what}: overlap_fraction({spans}) returned {got!r}, expected {expected:.4g} (time with two or more "
            "*lanes* busy over time with any lane busy; spans on one lane never overlap each other)")
    rng = random.Random(2)
    for _ in range(RANDOM_SETS):
        spans = _random_spans(rng)
        expected = _reference_overlap(spans)
        got = fn(list(spans))
        assert isinstance(got, (int, float)) and abs(got - expected) <= 1e-9, (
            f"random spans {[(lane, round(s, 3), round(e, 3)) for lane, s, e in spans]}: returned {got!r}, "
            f"expected {expected:.6g}")
    return f"{len(HAND_MADE)} hand-made and {RANDOM_SETS} random span sets match Trace.overlap_fraction"


# ---------------------------------------------------------------------------------------------
# Task 2.5: predict the makespan from the rules

def scheduled_makespan(num_chunks: int, buffers: int, h2d: float, compute: float, d2h: float) -> float:
    """The lab's rules as a plan: one op per chunk and stage on its stream (a stream runs in order), depending on
    the ops its waits name; the runtime's list scheduler (predict/schedule.py, the step model's) places each op as early
    as those allow. Returns when the last D2H op ends."""
    plan = Plan()
    ops: dict[str, list[int]] = {"h2d": [], "compute": [], "d2h": []}

    def earlier(stage: str, k: int) -> int | None:  # chunk k's op of `stage`; none before chunk 0
        return ops[stage][k] if k >= 0 else None

    for k in range(num_chunks):
        ops["h2d"].append(plan.add("h2d", f"h2d {k}", h2d, [earlier("compute", k - buffers)], stream="h2d"))
        ops["compute"].append(plan.add("compute", f"compute {k}", compute,
                                       [ops["h2d"][k], earlier("d2h", k - buffers)], stream="compute"))
        ops["d2h"].append(plan.add("d2h", f"d2h {k}", d2h, [ops["compute"][k]], stream="d2h"))
    schedule(plan, resource_of=lambda lane: lane)
    return max((plan.ops[i].end for i in ops["d2h"]), default=0.0)


def _makespan_hint(got: float, num_chunks: int, h2d: float, compute: float, d2h: float) -> str:
    """What an answer outside the bounds every schedule keeps shows (invariants, not the answer)."""
    ideal = h2d + compute + d2h + (num_chunks - 1) * max(h2d, compute, d2h)  # a buffer per chunk: nothing waits
    if got < ideal * (1 - 1e-9):
        return (f"; no schedule is shorter than {ideal:g}, the first chunk's three stages plus the busiest stream's "
                "other chunks: a rule that makes an op wait is missing")
    if got > num_chunks * (h2d + compute + d2h) * (1 + 1e-9):
        return "; that is longer than running every op one after another: an op waits for more than its rules"
    return ""


STAGE_TIMES = ((1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 3.0, 1.0), (1.0, 1.0, 2.0), (0.5, 2.0, 0.25),
               (3.0, 0.5, 3.0))


@grader("2.5", rebuilds=("minioffload.predict.schedule.schedule",))
def pipeline_makespan(fn: Callable) -> str:
    """fn(num_chunks, buffers, h2d, compute, d2h) -> seconds until the last D2H ends."""
    cases = 0
    for times in STAGE_TIMES:
        for num_chunks in range(1, 9):
            for buffers in range(1, 5):
                expected = scheduled_makespan(num_chunks, buffers, *times)
                got = fn(num_chunks, buffers, *times)
                assert isinstance(got, (int, float)) and abs(got - expected) <= 1e-9 * max(1.0, expected), (
                    f"pipeline_makespan({num_chunks}, {buffers}, h2d={times[0]}, compute={times[1]}, "
                    f"d2h={times[2]}) returned {got!r}, expected {expected:g}"
                    + (_makespan_hint(got, num_chunks, *times) if isinstance(got, (int, float)) else ""))
                cases += 1
    one, two = fn(8, 1, 1.0, 1.0, 1.0), fn(8, 2, 1.0, 1.0, 1.0)
    return (f"{cases} cases match; 8 chunks with equal stages take {one:g} stage times with 1 buffer, "
            f"{two:g} with 2 (serial: 24)")
