"""Graders for Lab 10, "More than one GPU": the shard map, which rank owns each subgroup (10.1).

Task 10.2 (a subgroup's gradients summed into its owner and copied to its pinned staging) is graded in
lab10_reduce.py, Task 10.3 (a block's weights gathered from shards before it runs) in lab10_gather.py; both run
their ranks on threads (lab10_ranks.py). Importing this module registers all three.

Task 10.1 asks for a map the engine does not use: the subgroups placed largest first, each on the rank holding the
fewest elements so far (the engine takes them in their given order, `layout.shard_owners`). It is checked on
hand-made cases and seeded random ones (sizes equal, uniform, heavy-tailed; more ranks than subgroups; one rank)
against the engine's map applied to the subgroups sorted largest first, and by what the map must do whatever its
code: name a rank for each subgroup, give every rank one when there are enough, keep the heaviest and lightest rank
within one subgroup of each other, and give the same answer every time without changing its input. When an answer
equals what a plausible mistake gives, the verdict names it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from ...layout import shard_owners
from .grading import grader

RANDOM_CASES = 300
HAND_CASES = (  # (sizes, ranks)
    ([], 2), ([7], 1), ([5, 5, 5, 5], 2), ([10, 1, 1, 1], 2), ([1, 10, 1, 1, 1], 3), ([3, 3, 3], 3), ([4, 4], 4),
    ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2), ([2, 1, 1, 2], 2), ([1, 2, 3, 4, 5, 6], 3), ([6, 5, 4, 3, 2, 1], 2),
)


def _random_case(rng: random.Random) -> tuple[list[int], int]:
    ranks = rng.choice([1, 2, 2, 3, 4, 4, 5, 8])
    count = rng.randint(0, 40)
    kind = rng.choice(["equal", "uniform", "heavy", "engine"])
    if kind == "equal":
        size = rng.randint(1, 1 << 20)
        sizes = [size] * count
    elif kind == "uniform":
        sizes = [rng.randint(1, 1000) for _ in range(count)]
    elif kind == "heavy":
        sizes = [int(rng.paretovariate(1.2) * 100) for _ in range(count)]
    else:  # as the engine packs: full subgroups of one size, some parameters larger, a short last one
        full = 1 << rng.randint(8, 22)
        sizes = [rng.choice([full, full, full, full * rng.randint(2, 5)]) for _ in range(count)]
        if sizes:
            sizes[-1] = rng.randint(1, full)
    return sizes, ranks


@functools.lru_cache(maxsize=1)
def cases() -> tuple:
    rng = random.Random(1010)
    return tuple((list(sizes), ranks) for sizes, ranks in HAND_CASES) + tuple(
        _random_case(rng) for _ in range(RANDOM_CASES))


def loads(sizes: list[int], owners: list[int], ranks: int) -> list[int]:
    held = [0] * ranks
    for size, rank in zip(sizes, owners, strict=True):
        held[rank] += size
    return held


def _placed_in(order: list[int], sizes: list[int], ranks: int) -> list[int]:
    """The engine's in-order rule applied to the subgroups taken in `order`, as owners in the given order."""
    out = [0] * len(sizes)
    for index, rank in zip(order, shard_owners([sizes[i] for i in order], ranks), strict=True):
        out[index] = rank
    return out


def largest_first(sizes: list[int], ranks: int, later_first: bool = False) -> list[int]:
    """The map Task 10.1 asks for: the engine's rule on the subgroups sorted largest first (equal sizes: the one
    given first, or the one given later with `later_first`, a mistake)."""
    return _placed_in(sorted(range(len(sizes)), key=lambda i: (-sizes[i], -i if later_first else i)), sizes, ranks)


def _round_robin(sizes, ranks):
    return [i % ranks for i in range(len(sizes))]


def _count_largest_first(sizes, ranks):
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    out = [0] * len(sizes)
    for position, index in enumerate(order):
        out[index] = position % ranks
    return out


def _ties_to_highest(sizes, ranks):
    # the map with the ranks numbered backwards: the same loads, each tie won by the highest rank
    return [ranks - 1 - owner for owner in largest_first(sizes, ranks)]


def _smallest_first(sizes, ranks):
    return _placed_in(sorted(range(len(sizes)), key=lambda i: sizes[i]), sizes, ranks)


def _contiguous(sizes, ranks):
    total, out, before = sum(sizes), [], 0
    for size in sizes:
        out.append(min(ranks - 1, before * ranks // total) if total else 0)
        before += size
    return out


MISTAKES = (  # (what it is, the map it gives), most specific first
    ("that is round robin (subgroup i to rank i % ranks, in some order): it ignores the sizes, so a rank that drew "
     "the large subgroups holds far more optimizer state than the others. Balance elements: largest first, each "
     "subgroup to the rank holding the fewest so far", _round_robin),
    ("that balances the number of subgroups per rank, not their elements: each subgroup goes to the rank holding the "
     "fewest elements so far", _count_largest_first),
    ("ties go to the lowest rank: among the ranks holding equally few elements, take the one with the smallest "
     "number, so that every rank computes the same map", _ties_to_highest),
    ("that is the engine's map, the subgroups taken in their given order: a large subgroup that comes late lands on "
     "a rank already holding a full share. Take them largest first", shard_owners),
    ("the subgroups were taken smallest first: the large ones come last and pile up; take them largest first",
     _smallest_first),
    ("among subgroups of equal size, take the one given first (the lower index): every rank must derive the same "
     "map from the same list", functools.partial(largest_first, later_first=True)),
    ("contiguous ranges of subgroups by cumulative size: take the subgroups largest first, each to the rank holding "
     "the fewest elements so far", _contiguous),
)


def _call(sizes, ranks) -> str:
    shown = repr(sizes) if len(sizes) <= 12 else f"[{', '.join(map(str, sizes[:12]))}, ... ({len(sizes)} sizes)]"
    return f"owners({shown}, {ranks})"


def _valid(got, sizes: list[int], ranks: int, call: str) -> list[int]:
    if not isinstance(got, (list, tuple)) or len(got) != len(sizes):
        raise AssertionError(f"{call} returned {got!r:.100}; expected a list of {len(sizes)} ranks, one per subgroup")
    for index, rank in enumerate(got):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
            raise AssertionError(f"{call} gives subgroup {index} to {rank!r:.40}; expected a rank in 0..{ranks - 1}")
    return list(got)


def _property_broken(sizes: list[int], got: list[int], ranks: int) -> str:
    held = loads(sizes, got, ranks)
    idle = [r for r in range(ranks) if r not in got]
    if len(sizes) >= ranks and idle:
        who = f"rank {idle[0]} owns" if len(idle) == 1 else f"ranks {idle} own"
        return (f"{who} no subgroup, though there are {len(sizes)} subgroups for {ranks} ranks: an idle "
                "rank holds no optimizer state and updates nothing while the others work")
    if sizes and max(held) - min(held) > max(sizes):
        return (f"the ranks hold {held} elements: the heaviest exceeds the lightest by {max(held) - min(held)}, more "
                f"than the largest subgroup ({max(sizes)}); the fewest-so-far rule never lets that happen")
    return ""


def _hint(sizes: list[int], got: list[int], ranks: int) -> str:
    """What the answer's mistake is: every listed mistake that gives this map (on a small case several can), or how
    the map is made."""
    if got != largest_first(sizes, ranks):
        named = [what for what, mistake in MISTAKES if got == mistake(sizes, ranks)]
        if named:
            return " Or: ".join(named)
    return ("largest first (equal sizes: the one given first), each subgroup goes to the rank holding the fewest "
            "elements so far, ties to the lowest rank")


def _heaviest(sizes: list[int], owners: list[int], ranks: int) -> int:
    return max(loads(sizes, owners, ranks)) if sizes else 0


@grader("10.1", rebuilds=("minioffload.layout.shard_owners",))
def shard_map(fn: Callable) -> str:
    """fn(sizes, ranks) -> the owner rank of each subgroup of `sizes` elements."""
    for sizes, ranks in cases():
        call = _call(sizes, ranks)
        given = list(sizes)
        got = _valid(fn(given, ranks), sizes, ranks, call)
        if given != sizes:
            raise AssertionError(f"{call} changed its list of sizes (to {given[:12]!r}...): the engine's subgroups "
                                 "keep their order; work on a copy")
        want = largest_first(sizes, ranks)
        if got != want:
            broken = _property_broken(sizes, got, ranks)
            held = loads(sizes, got, ranks)
            shown = f"{got}" if len(got) <= 12 else f"{got[:12]}... (loads {held})"
            expected = f"{want}" if len(want) <= 12 else f"{want[:12]}... (loads {loads(sizes, want, ranks)})"
            raise AssertionError(f"{call} returned {shown}; the largest-first map is {expected}: "
                                 f"{broken + '; ' if broken else ''}{_hint(sizes, got, ranks)}")
        again = fn(list(sizes), ranks)
        if list(again) != got:
            raise AssertionError(f"{call} returned {got} and then {list(again)}: every rank computes the map on its "
                                 "own, so it must be the same every time (no randomness, no state kept between calls)")
    spread = sum(len(s) >= r > 1 for s, r in cases())
    heavier = [(_heaviest(s, largest_first(s, r), r), _heaviest(s, shard_owners(s, r), r)) for s, r in cases()]
    lighter, worse = sum(mine < engine for mine, engine in heavier), sum(mine > engine for mine, engine in heavier)
    return (f"{len(cases())} lists of subgroup sizes ({len(HAND_CASES)} by hand, {RANDOM_CASES} random, 1 to 8 ranks): "
            f"your map is the largest-first map; in the {spread} with at least as many subgroups as ranks (and more "
            "than one rank) every rank owns some, and the heaviest rank holds at most the lightest's elements plus the "
            f"largest subgroup. Against the engine's in-order map, its heaviest rank is lighter in {lighter} cases "
            f"and heavier in {worse}")


from . import lab10_gather, lab10_reduce  # noqa: E402, F401  (their graders: Tasks 10.2 and 10.3)
