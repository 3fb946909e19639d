"""Graders for Lab 11, Tasks 11.3 and 11.4: subgroups spread over storage paths in proportion to their bandwidth, and
the alternating visit order with the reads it needs (see lab11.py for the lab's other tasks).

Task 11.3 is graded by what a split must do whatever its code, on hand-made and seeded random cases: one path index
per subgroup; each path's bytes within one subgroup (the largest) of its fair share, total x bandwidth / summed
bandwidth; every path whose fair share exceeds the largest subgroup used; the same answer every time and the inputs
unchanged; and a path of zero or negative bandwidth (or no path at all) refused with a ValueError that names it. The
grader holds no split of its own: when an answer breaks a property and equals what a plausible mistake gives, the
verdict names the mistake.

Task 11.4 is graded against a brute-force simulation: a host memory that keeps the last `cached` subgroups visited
(the least recently used one leaves when another comes in) runs the learner's visit orders step after step, and
counts the subgroups that had to be read; `reads_needed` must give that count.
"""

from __future__ import annotations

import functools
import numbers
import random
import re
from collections import OrderedDict
from collections.abc import Callable

from .grading import grader

RANDOM_CASES = 300
HAND_CASES = (  # (subgroup sizes in bytes, bandwidths in GB/s); the first ones each catch one mistake of MISTAKES
    ([], [2.0]), ([7], [1.0]), ([5] * 8, [1.0, 1.0]), ([3, 2, 3], [4.0, 1.0]), ([5] * 12, [3.0, 1.0]),
    ([1, 5, 1, 5], [2.0, 3.0]), ([5, 1, 5, 5], [1.0, 3.0, 1.0]), ([1, 1, 3, 1, 3], [2.0, 4.0, 1.0]),
    ([1, 1], [1.0, 1.0, 3.0]), ([2, 3, 3], [1.0, 1.0, 3.0]), ([100, 1, 1, 1, 1], [1.0, 1.0]), ([1] * 20, [100.0, 1.0]),
    ([12 << 16] * 31 + [12 * 384], [6.5, 2.0]), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2.5, 1.5, 1.0]),
)
REFUSED = (  # (bandwidths, the index of the path to name, what is wrong with it)
    ([3.0, 1.5, 0.0], 2, "zero"), ([2.0, -1.0, 4.0], 1, "negative"), ([], None, "none"),
)


def _random_case(rng: random.Random) -> tuple[list[int], list[float]]:
    paths = rng.choice([1, 2, 2, 2, 3, 3, 4, 5])
    bandwidths = [round(rng.choice([rng.uniform(0.2, 8.0), rng.choice([1.0, 2.0, 3.5, 7.0])]), 2)
                  for _ in range(paths)]
    count = rng.randint(0, 40)
    kind = rng.choice(["equal", "uniform", "heavy", "engine"])
    if kind == "equal":
        sizes = [rng.randint(1, 1 << 20)] * count
    elif kind == "uniform":
        sizes = [rng.randint(1, 1000) for _ in range(count)]
    elif kind == "heavy":
        sizes = [1 + int(rng.paretovariate(1.2) * 100) for _ in range(count)]
    else:  # as the engine packs: full subgroups of 12 bytes a parameter, some larger, a short last one
        full = 12 << rng.randint(8, 20)
        sizes = [rng.choice([full, full, full, full * rng.randint(2, 5)]) for _ in range(count)]
        if sizes:
            sizes[-1] = 12 * rng.randint(1, full // 12)
    return sizes, bandwidths


@functools.lru_cache(maxsize=1)
def cases() -> tuple:
    rng = random.Random(113)
    return tuple((list(s), list(b)) for s, b in HAND_CASES) + tuple(_random_case(rng) for _ in range(RANDOM_CASES))


def _is_index(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def loads(sizes: list[int], paths: list[int], count: int) -> list[int]:
    held = [0] * count
    for size, path in zip(sizes, paths, strict=True):
        held[path] += size
    return held


def fair_shares(sizes: list[int], bandwidths: list[float]) -> list[float]:
    total, summed = sum(sizes), sum(bandwidths)
    return [total * b / summed for b in bandwidths]


# plausible mistakes, to name them when an answer equals one (ties to the lowest index, as a learner would write)
def _round_robin(sizes, bandwidths):
    return [i % len(bandwidths) for i in range(len(sizes))]


def _greedy(sizes, bandwidths, score):
    held, out = [0.0] * len(bandwidths), []
    for size in sizes:
        path = min(range(len(bandwidths)), key=lambda p: (score(held[p], size, bandwidths[p]), p))
        out.append(path)
        held[path] += size
    return out


def _fewest_bytes(sizes, bandwidths):
    return _greedy(sizes, bandwidths, lambda held, size, bw: held)


def _fastest_only(sizes, bandwidths):
    return [max(range(len(bandwidths)), key=lambda p: (bandwidths[p], -p))] * len(sizes)


def _lowest_ratio_before(sizes, bandwidths):
    return _greedy(sizes, bandwidths, lambda held, size, bw: held / bw)


def _earliest_finish(sizes, bandwidths):
    return _greedy(sizes, bandwidths, lambda held, size, bw: (held + size) / bw)


MISTAKES = (  # (what it is, the split it gives), most specific first
    ("that is round robin (subgroup i to path i % paths): it ignores the bandwidths, so the slow path gets as many "
     "bytes as the fast one and the step waits for it", _round_robin),
    ("each subgroup went to the path holding the fewest bytes: that balances bytes, not time; a path twice as fast "
     "should hold twice the bytes", _fewest_bytes),
    ("every subgroup went to the fastest path: the others' bandwidth is wasted", _fastest_only),
    ("each subgroup went to the path with the fewest bytes per bandwidth before it: a path that starts at 0 gets the "
     "first subgroup whatever its speed, and a path can end far from its share; compare the shares after adding "
     "this subgroup", _lowest_ratio_before),
    ("each subgroup went to the path that would finish it first: that can push a fast path more than a subgroup past "
     "its share; measure each path against its fair share of the bytes so far, this subgroup included",
     _earliest_finish),
)
GENERIC = ("give each subgroup, in order, to the path furthest below its fair share of the bytes so far (this "
           "subgroup's bytes included), ties to the lowest index")


def _call(sizes, bandwidths) -> str:
    shown = repr(sizes) if len(sizes) <= 10 else f"[{', '.join(map(str, sizes[:10]))}, ... ({len(sizes)} sizes)]"
    return f"assign_paths({shown}, {bandwidths})"


BY_COUNT = ("the split gives each path its share of the number of subgroups, not of their bytes: these subgroups "
            "differ in size, and a path's time is its bytes over its bandwidth (counting subgroups is right only "
            "when they are all one size)")


def _hint(sizes, bandwidths, got) -> str:
    named = next((what for what, mistake in MISTAKES if got == mistake(sizes, bandwidths)), None)
    if named:
        return named
    counts = [got.count(p) for p in range(len(bandwidths))]
    if all(abs(c - f) < 1 for c, f in zip(counts, fair_shares([1] * len(sizes), bandwidths), strict=True)):
        return BY_COUNT
    return GENERIC


def _property_broken(sizes, bandwidths, got) -> str:
    held, fair = loads(sizes, got, len(bandwidths)), fair_shares(sizes, bandwidths)
    largest = max(sizes, default=0)
    idle = [p for p in range(len(bandwidths)) if fair[p] > largest and p not in got]
    if idle:
        p = idle[0]
        return (f"path {p} got no subgroup, though its fair share ({fair[p]:,.1f} bytes) exceeds the largest "
                f"subgroup ({largest:,})")
    worst = max(range(len(bandwidths)), key=lambda p: abs(held[p] - fair[p]))
    if abs(held[worst] - fair[worst]) > largest + 1e-9 * sum(sizes):
        side = "over" if held[worst] > fair[worst] else "under"
        return (f"the paths hold {held} bytes against fair shares {[round(f, 1) for f in fair]}: path {worst} is "
                f"{abs(held[worst] - fair[worst]):,.1f} bytes {side} its share, more than the largest subgroup "
                f"({largest:,})")
    return ""


def _refuses(fn: Callable, bandwidths: list[float], index: int | None, what: str) -> None:
    call = f"assign_paths([4, 4, 4], {bandwidths})"
    problem = {"zero": f"path {index} has bandwidth 0: it would never finish its share",
               "negative": f"path {index} has a negative bandwidth", "none": "there is no path"}[what]
    try:
        got = fn([4, 4, 4], list(bandwidths))
    except ValueError as err:
        if index is not None and not re.search(rf"\b{index}\b", str(err)):
            raise AssertionError(f"{call} raised ValueError({str(err)!r:.100}), which does not name the path: say "
                                 f"which one (path {index}) and what is wrong, so that the user can fix it") from None
        return
    except NotImplementedError:
        raise
    except Exception as err:
        raise AssertionError(f"{call} raised {type(err).__name__}: {err}; {problem}: refuse it with a ValueError "
                             "that names it, before any subgroup is placed") from None
    raise AssertionError(f"{call} returned {got!r:.60}; {problem}: raise a ValueError that names it")


@grader("11.3", nothing_to_refuse=(
    "a variant: the runtime places subgroups by count (nvme.multipath.chairman_assignment), the task by bytes"))
def assign_paths(fn: Callable) -> str:
    """fn(subgroup_sizes, bandwidths) -> the path index of each subgroup."""
    for sizes, bandwidths in cases():
        call = _call(sizes, bandwidths)
        given_sizes, given_bw = list(sizes), list(bandwidths)
        got = fn(given_sizes, given_bw)
        if not isinstance(got, (list, tuple)) or len(got) != len(sizes) or not all(
                _is_index(p) and 0 <= p < len(bandwidths) for p in got):
            raise AssertionError(f"{call} returned {got!r:.100}; expected a list of {len(sizes)} path indices in "
                                 f"0..{len(bandwidths) - 1}, one per subgroup")
        if given_sizes != sizes or given_bw != bandwidths:
            raise AssertionError(f"{call} changed its arguments: work on copies; the caller's subgroups and paths "
                                 "keep their order")
        got = [int(p) for p in got]
        broken = _property_broken(sizes, bandwidths, got)
        if broken:
            raise AssertionError(f"{call}: {broken}; {_hint(sizes, bandwidths, got)}")
        again = fn(list(sizes), list(bandwidths))
        if list(again) != got:
            raise AssertionError(f"{call} returned {got} and then {list(again)}: a resumed run must find each "
                                 "subgroup's files on the same path, so the split must be the same every time (no "
                                 "randomness, no state kept between calls)")
    for bandwidths, index, what in REFUSED:
        _refuses(fn, bandwidths, index, what)
    several = sum(len(b) > 1 and len(s) > 0 for s, b in cases())
    return (f"{len(cases())} splits ({len(HAND_CASES)} by hand, {RANDOM_CASES} random, 1 to 5 paths; {several} with "
            "several paths): each path's bytes within the largest subgroup of its fair share, every path whose share "
            "exceeds a subgroup used, the same answer every time; zero, negative and no bandwidths refused, naming "
            "the path")


# ---------------------------------------------------------------------------------------------
# Task 11.4: the alternating order, and the reads a step needs

ORDER_CASES = tuple((n, cached) for n in (0, 1, 2, 3, 5, 8, 12) for cached in sorted({0, 1, 2, 3, n - 1, n, n + 2})
                    if cached >= 0)
STEPS = 6


def simulated_reads(orders: list[list[int]], cached: int) -> list[int]:
    """Per step, the subgroups read: a host memory keeps the last `cached` subgroups visited (least recently used
    out first), and a subgroup not in it is read."""
    held: OrderedDict[int, None] = OrderedDict()
    reads = []
    for order in orders:
        count = 0
        for sub in order:
            if sub in held:
                held.move_to_end(sub)
            else:
                count += 1
                held[sub] = None
                if len(held) > cached:
                    held.popitem(last=False)
        reads.append(count)
    return reads


def _order_problem(n: int, step: int, order: list[int], before: list[int] | None) -> str:
    if step == 0:
        return "" if order == list(range(n)) else (
            f"step 0 visits {order}; expected the subgroups in their own order, {list(range(n))} (the first step "
            "has nothing in host memory to start from)")
    if order == before[::-1]:
        return ""
    if order == before:
        return (f"step {step} visits the subgroups in the same order as step {step - 1} ({order}): the ones the last "
                "step left in host memory are its last ones, and this order meets them last, after they were pushed "
                "out; visit them first")
    return (f"step {step} visits {order} after step {step - 1} visited {before}: each step visits the subgroups in "
            "the reverse of the previous step's order, so that it starts with the ones still in host memory")


@grader("11.4", rebuilds=(
    "minioffload.engine.nvme_tier.NvmeTier._order",
    "minioffload.engine.nvme_tier.reads_avoided_fraction",
))
def order_and_reads(fn: Callable) -> str:
    """fn(n, step, cached) -> (visit_order(n, step), reads_needed(n, step, cached))."""
    for n, cached in ORDER_CASES:
        orders = []
        for step in range(STEPS):
            got = fn(n, step, cached)
            if not isinstance(got, tuple) or len(got) != 2:
                raise AssertionError(f"the check's function returned {got!r:.80} for (n={n}, step={step}, "
                                     f"cached={cached}); expected the pair (visit_order(n, step), "
                                     "reads_needed(n, step, cached))")
            order, reads = got
            call = f"visit_order({n}, {step})"
            if not isinstance(order, (list, tuple, range)) or sorted(order) != list(range(n)):
                raise AssertionError(f"{call} returned {order!r:.80}; expected each of the subgroups 0..{n - 1} "
                                     "once, in the order the step visits them")
            order = list(order)
            problem = _order_problem(n, step, order, orders[-1] if orders else None)
            if problem:
                raise AssertionError(f"{call}: {problem}")
            orders.append(order)
            want = simulated_reads(orders, cached)[-1]
            call = f"reads_needed({n}, {step}, cached={cached})"
            if not _is_index(reads) or reads != want:
                if step == 0 and n and reads == n - min(cached, n):
                    hint = "at step 0 nothing is in host memory yet: every subgroup is read"
                elif cached > n and reads == n - cached:
                    hint = (f"there are only {n} subgroups: with room for more, all of them are in host memory and "
                            "none is read (a count is never negative)")
                elif step and reads == n and want < n:
                    hint = ("that is what the same order every step reads; the alternating order starts with the "
                            "subgroups still in host memory and does not read them")
                else:
                    hint = (f"a host memory that keeps the last {cached} subgroups visited, run through steps 0 to "
                            f"{step} of your order, reads {want}")
                raise AssertionError(f"{call} returned {reads!r:.40}; expected {want}: {hint}")
    largest = max(n for n, _ in ORDER_CASES)
    return (f"{len(ORDER_CASES)} cases of up to {largest} subgroups and room for 0 to {largest + 2} in host memory, "
            f"steps 0 to {STEPS - 1}: each step visits every subgroup once, in the reverse of the previous step's "
            "order, and reads_needed matches a simulated host memory holding the last subgroups visited")
