"""Grader for Lab 9's Task 9.3: the planner's exact part, how many blocks take each activation policy and how many of
the optimizer's subgroups are updated on the device, for the least added time within the memory left. Tasks 9.1 and
9.2: lab09.py and lab09_objective.py.

The learner's `best_policies(problem)` is checked against plan_milp: on problems built to catch a mistake each (a
greedy choice block by block, one policy for every block, a host budget, a budget met exactly, nothing that fits, the
hybrid split, a shared host, an offloaded set in flight), then on seeded random problems against `brute_force`
(every policy for every block), infeasible ones included, then on problems too large for brute force against `solve`
(the MILP), where the search has a time limit: one that tries every policy for every block would run for hours. Each
answer must fit (`problem.fits`), name every block once, and add no more time than the optimum. Verdicts carry
counts, never timings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager

from ...planner.milp import BRUTE_FORCE_LIMIT, Option, Problem, brute_force, solve
from .grading import grader

RANDOM_SMALL = 120
RANDOM_LARGE = 8
LARGE_TIME_LIMIT_S = 10.0  # for all the large problems together; counting blocks per policy takes a fraction of 1

KEEP, SELECTIVE, RECOMPUTE = Option("keep", 10.0, 0.0, 0.0), Option("selective", 5.0, 0.0, 0.1), \
    Option("recompute", 1.0, 0.0, 1.0)
OFFLOAD = Option("offload", 0.0, 10.0, 2.0)
NAMED = (  # (what it catches, the problem)
    ("greedy", Problem(2, (KEEP, SELECTIVE, RECOMPUTE, OFFLOAD), device_budget=10.0)),
    ("greedy", Problem(2, (KEEP, SELECTIVE, RECOMPUTE), device_budget=10.0)),
    ("one policy", Problem(4, (Option("keep", 10.0, 0.0, 0.0), Option("recompute", 1.0, 0.0, 0.3)), 23.0)),
    ("host", Problem(3, (KEEP, Option("offload", 0.0, 10.0, 0.05), Option("recompute", 2.0, 0.0, 0.5)), 12.0,
                     host_budget=10.0)),
    ("exact", Problem(3, (KEEP, SELECTIVE), device_budget=20.0)),
    ("nothing", Problem(2, (KEEP, Option("recompute", 4.0, 0.0, 0.3)), device_budget=7.0)),
    ("nothing", Problem(2, (Option("offload", 0.0, 6.0, 0.1),), device_budget=1.0, host_budget=11.0)),
    ("split", Problem(1, (RECOMPUTE,), 100.0, subgroups=4, max_resident=4, resident_bytes=5.0, cpu_s=1.0,
                      device_s=0.5)),
    ("split", Problem(1, (RECOMPUTE,), 100.0, subgroups=4, max_resident=4, resident_bytes=5.0, cpu_s=1.0,
                      device_s=0.5, shared=True)),
    ("split", Problem(2, (KEEP, RECOMPUTE), 21.0, subgroups=4, max_resident=4, resident_bytes=5.0, cpu_s=1.0,
                      device_s=0.5)),
    ("in flight", Problem(4, (KEEP, Option("offload", 0.0, 10.0, 0.1, in_flight_bytes=10.0)), device_budget=31.0)),
)


def random_problem(rng: random.Random, blocks: tuple[int, int], options: tuple[int, int]) -> Problem:
    scale = rng.choice([1.0, 1e9])  # bytes near 1 and near a GB
    opts = tuple(Option(f"p{i}", scale * rng.choice([0, rng.uniform(0, 10)]),
                        scale * rng.choice([0, rng.uniform(0, 5)]), rng.uniform(0, 2),
                        scale * rng.choice([0, 0, rng.uniform(0, 8)]))
                 for i in range(rng.randint(*options)))
    n = rng.randint(*blocks)
    groups = rng.randint(1, 6)
    return Problem(n, opts, scale * rng.uniform(0, 8 * n), rng.choice([math.inf, scale * rng.uniform(0, 3 * n)]),
                   groups, rng.randint(0, groups), scale * rng.uniform(0, 5), rng.uniform(0, 1), rng.uniform(0, 1),
                   rng.random() < 0.5)


@functools.lru_cache(maxsize=1)
def small_cases() -> tuple:
    """(problem, brute force's answer) for the named problems and small random ones."""
    rng = random.Random(93)
    problems = [p for _, p in NAMED] + [random_problem(rng, (1, 4), (1, 5)) for _ in range(RANDOM_SMALL)]
    return tuple((p, brute_force(p)) for p in problems)


@functools.lru_cache(maxsize=1)
def large_cases() -> tuple:
    """(problem, the MILP's answer) for problems brute force refuses (5^9 assignments and more)."""
    rng = random.Random(930)
    problems = [random_problem(rng, (9, 14), (5, 5)) for _ in range(RANDOM_LARGE)]
    return tuple((p, solve(p)) for p in problems)


class _TooSlow(BaseException):  # not an Exception: a learner's `except Exception` must not swallow it
    pass


@contextmanager
def _time_limit(seconds: float):
    """Interrupt the learner's search after `seconds` (on the main thread, where signals arrive; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _in_flight(problem: Problem, counts: dict) -> float:
    return sum(getattr(o, "in_flight_bytes", 0.0) for o in problem.options if counts.get(o.name))


def _used(problem: Problem, counts: dict, resident: int) -> tuple[float, float]:
    device = sum(o.device_bytes * counts.get(o.name, 0) for o in problem.options) + resident * problem.resident_bytes
    return device + _in_flight(problem, counts), sum(o.host_bytes * counts.get(o.name, 0) for o in problem.options)


def _greedy(problem: Problem) -> dict | None:
    """Block by block, the policy adding the least time among those with which the blocks so far fit (no split)."""
    counts: dict[str, int] = {}
    for _ in range(problem.num_blocks):
        fits = [o for o in problem.options if problem.fits({**counts, o.name: counts.get(o.name, 0) + 1}, 0)]
        if not fits:
            return None
        best = min(fits, key=lambda o: (o.extra_s, o.device_bytes))
        counts[best.name] = counts.get(best.name, 0) + 1
    return counts


def _shown(counts: dict | None, resident: int = 0) -> str:
    if counts is None:
        return "None"
    return f"counts {dict(sorted(counts.items()))}" + (f", resident {resident}" if resident else "")


def _answer(problem: Problem, got, call: str) -> tuple[dict, int] | None:
    """The learner's (counts without zeros, resident), or None; a malformed answer fails here."""
    if got is None:
        return None
    counts, resident = getattr(got, "counts", None), getattr(got, "resident", None)
    if not isinstance(counts, dict) or isinstance(resident, bool) or not isinstance(resident, int):
        raise AssertionError(f"{call} returned {got!r:.100}; expected a plan_milp.Solution(counts, resident, "
                             "objective) or None")
    names = {o.name for o in problem.options}
    if set(counts) - names:
        raise AssertionError(f"{call} counts blocks under {sorted(set(counts) - names)}; the options are "
                             f"{sorted(names)}: key the counts by Option.name")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in counts.values()):
        raise AssertionError(f"{call} returned counts {counts}; expected whole numbers of blocks >= 0")
    if sum(counts.values()) != problem.num_blocks:
        raise AssertionError(f"{call} returned counts {counts} for {sum(counts.values())} blocks; the problem has "
                             f"{problem.num_blocks}: every block takes exactly one policy")
    if not 0 <= resident <= problem.max_resident:
        raise AssertionError(f"{call} returned resident {resident}; it must be in [0, max_resident = "
                             f"{problem.max_resident}]")
    return {k: v for k, v in counts.items() if v}, resident


def _misfit(problem: Problem, counts: dict, resident: int) -> str:
    device, host = _used(problem, counts, resident)
    if device > problem.device_budget * (1 + 1e-9):
        parts = []
        if resident and problem.resident_bytes:
            parts.append(f"{resident} resident subgroups x {problem.resident_bytes:,.6g}: each subgroup updated on the "
                         "device keeps its state and gradient there")
        if _in_flight(problem, counts):
            parts.append(f"{_in_flight(problem, counts):,.6g} in flight: each option in use with in_flight_bytes "
                         "holds them once, an offloaded set on its way to the host")
        of_which = f" (of which {'; '.join(parts)})" if parts else ""
        return (f"it holds {device:,.6g} bytes on the device{of_which}, over the device budget "
                f"{problem.device_budget:,.6g}")
    return (f"its offloaded activations need {host:,.6g} bytes of pinned host memory, over the host budget "
            f"{problem.host_budget:,.6g}: offload and offload_input free the device by filling the host")


def _best_for(problem: Problem, counts: dict, resident: int) -> bool:
    """Whether (counts, resident) is optimal for `problem` (a variant of the one asked: what a mistake optimises)."""
    best = brute_force(problem) if len(problem.options) ** problem.num_blocks * (problem.max_resident + 1) \
        <= BRUTE_FORCE_LIMIT else solve(problem)
    return best is not None and problem.fits(counts, resident) and \
        problem.objective(counts, resident) <= best.objective * (1 + 1e-6) + 1e-9


def _exactly(problem: Problem, solution) -> bool:
    """Whether `solution` uses a budget to the byte (within the tolerance problem.fits allows)."""
    device, host = _used(problem, solution.counts, solution.resident)
    return math.isclose(device, problem.device_budget, rel_tol=1e-9) or math.isclose(host, problem.host_budget,
                                                                                    rel_tol=1e-9)


def _swapped(problem: Problem, counts: dict, resident: int) -> float:
    """The objective with the two updates combined the other way (added where they overlap, or overlapped)."""
    extra = problem.objective(counts, resident) - problem.update_s(resident)
    other = (problem.subgroups - resident) * problem.cpu_s, resident * problem.device_s
    return extra + (max(other) if problem.shared else sum(other))


def _close(declared, value: float) -> bool:
    number = isinstance(declared, (int, float)) and not isinstance(declared, bool)
    return number and math.isclose(declared, value, rel_tol=1e-6, abs_tol=1e-12)


def _worse_hint(problem: Problem, counts: dict, resident: int, want, declared) -> str:
    if counts == _greedy(problem) and counts != want.counts:
        return ("that is the greedy answer, each block in turn taking the cheapest policy that fits in what is left: "
                "an early block's cheap choice can leave the others only costly ones. Search the counts of blocks "
                "per policy, all of them")
    if _exactly(problem, want):
        return ("the optimum uses a budget exactly, and a plan that uses exactly the budget fits: problem.fits "
                "compares with <=")
    if len(counts) == 1 and len(want.counts) > 1:
        return ("one policy for every block: mixing them (some blocks keep, the others recompute) can fit where "
                "keeping everything does not, for less time than recomputing everything")
    if resident == 0 and want.resident:
        return ("no subgroup updated on the device: with max_resident > 0, r subgroups on the device shorten the "
                "update (problem.update_s(r)), for resident_bytes each of device memory: try every r")
    extra = problem.objective(counts, resident) - problem.update_s(resident)
    if _close(declared, extra) and problem.update_s(resident) > 0:
        return ("you ranked by the policies' time alone: the objective adds the update's length, "
                "problem.update_s(resident), which the subgroups on the device shorten (problem.objective)")
    if _close(declared, _swapped(problem, counts, resident)) or (declared is None and _best_for(
            dataclasses.replace(problem, shared=not problem.shared), counts, resident)):
        if problem.shared:
            return ("you ranked as if the two updates overlapped: on a shared host (problem.shared, the simulated "
                    "device) the device's update runs on the CPU's cores, so the two add up (problem.update_s)")
        return ("you ranked as if the two updates added up: on a GPU the CPU's and the device's updates overlap, "
                "and the update takes the longer of the two (problem.update_s)")
    return "search every count of blocks per policy and every resident in [0, max_resident]"


def _check(problem: Problem, got, want, call: str) -> None:
    answer = _answer(problem, got, call)
    if answer is None:
        if want is not None:
            greedy = " (the greedy choice, block by block, finds nothing here)" if _greedy(problem) is None else ""
            equal = " A plan that uses exactly the budget fits (problem.fits compares with <=)." \
                if _exactly(problem, want) else ""
            raise AssertionError(f"{call} returned None, but {_shown(want.counts, want.resident)} fits and adds "
                                 f"{want.objective:.6g} s{greedy}.{equal}")
        return
    counts, resident = answer
    if not problem.fits(counts, resident):
        nothing = " Nothing fits this problem: return None." if want is None else ""
        raise AssertionError(f"{call} returned {_shown(counts, resident)}, which does not fit: "
                             f"{_misfit(problem, counts, resident)}.{nothing}")
    value = problem.objective(counts, resident)
    declared = getattr(got, "objective", None)
    if want is not None and value > want.objective * (1 + 1e-6) + 1e-9:
        raise AssertionError(f"{call} returned {_shown(counts, resident)}, adding {value:.6g} s; "
                             f"{_shown(want.counts, want.resident)} fits and adds {want.objective:.6g} s: "
                             f"{_worse_hint(problem, counts, resident, want, declared)}")
    if isinstance(declared, bool) or not isinstance(declared, (int, float)) or \
            not math.isclose(declared, value, rel_tol=1e-6, abs_tol=1e-9):
        shared = ""
        if _close(declared, _swapped(problem, counts, resident)):
            shared = " On a shared host (problem.shared) the CPU's and the device's updates add up: they run on the " \
                     "same cores." if problem.shared else " On a GPU the two updates overlap: the longer one counts."
        raise AssertionError(f"{call} returned {_shown(counts, resident)} with objective {declared!r:.40}; "
                             f"problem.objective(counts, resident) gives {value:.6g} s: the policies' added time and "
                             f"the update's length.{shared}")


def _describe(problem: Problem) -> str:
    options = ", ".join(f"{o.name}({o.device_bytes:.3g}, {o.host_bytes:.3g}, {o.extra_s:.3g} s)"
                        for o in problem.options)
    budgets = f"device {problem.device_budget:.4g}" + (f", host {problem.host_budget:.4g}"
                                                       if math.isfinite(problem.host_budget) else "")
    split = (f", {problem.subgroups} subgroups (up to {problem.max_resident} on the device"
             f"{', shared host' if problem.shared else ''})") if problem.max_resident else ""
    return f"best_policies(<{problem.num_blocks} blocks; {options}; {budgets}{split}>)"


@grader("9.3", rebuilds=("minioffload.planner.milp.solve", "minioffload.planner.milp.brute_force"))
def best_policies(fn: Callable) -> str:
    """fn(problem: plan_milp.Problem) -> plan_milp.Solution with the least objective that fits, or None."""
    small = small_cases()
    for problem, want in small:
        _check(problem, fn(problem), want, _describe(problem))
    large = large_cases()
    try:
        with _time_limit(LARGE_TIME_LIMIT_S):
            answers = [fn(problem) for problem, _ in large]
    except _TooSlow:
        raise AssertionError(f"on {len(large)} problems of 9 to 14 blocks and 5 policies, your search ran past "
                             f"{LARGE_TIME_LIMIT_S:.0f} s: trying every policy for every block is 5^n assignments. "
                             "The blocks are equal, so count blocks per policy instead (itertools."
                             "combinations_with_replacement), or write the MILP (scipy.optimize.milp)") from None
    for (problem, want), got in zip(large, answers, strict=True):
        _check(problem, got, want, _describe(problem))
    infeasible = sum(want is None for _, want in small) + sum(want is None for _, want in large)
    return (f"{len(small) + len(large)} problems ({len(NAMED)} built to catch a mistake each, {RANDOM_SMALL} small "
            f"random ones against brute_force, {len(large)} of 9-14 blocks against the MILP; {infeasible} with "
            "nothing that fits): every answer fits and adds the least time")
