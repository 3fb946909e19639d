"""Grader for Lab 12's diagnosis task (12.3): a run refused by its host budget, its cause named from the pinned
buffers it had made, and the one setting that makes it fit.

Each case is a run meant to keep host memory a bounded cache (chapter 12: the blocks' weights streamed from NVMe, the
optimizer state and the gradients on the drive) that `pinned.HostBudget` refused. The evidence is what the runtime's
allocations were, in the order it makes them, by owner, up to the refused one, with the refusal's message
(`pinned.OutOfHostBudget`, the runtime's own). The buffers and their sizes are the ones `memory.streamed_bytes` and
`memory.engine_bytes` count: per block of a host home, per subgroup of gradients kept in host memory, and the few
working sets, gradient sets, bounce and write buffers sized by the largest subgroup or block. One setting was left
wrong in each run:

    grads_on_host        the gradients stayed in host memory (grads_on="host"): an fp32 sum and a bf16 staging buffer
                         per subgroup, 6 B/param. Fix: {"grads_on": "nvme"}
    home_on_host         the streamer's home stayed in host memory (home="host"): a bf16 copy of every block,
                         2 B/param. Fix: {"home": "nvme"}
    subgroups_too_large  everything is on the drive, but the subgroups are so large that the sets sized by one of them
                         pass the budget. Fix: {"subgroup_numel": the largest power of two with which the run fits}

The fix is graded by the pinned bytes of the run with it; a wrong cause fails with why it does not fit the evidence.
The cases are built by hand so that the last buffer asked for, or the largest single one, does not always point at the
cause: the budget is filled by what the owners add up to. Deterministic: the same cases, the same verdicts.

What this is not: a test of the calculator, nor of HostBudget itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...pinned import OutOfHostBudget
from ...predict.shapes import ModelSpec
from .grading import grader

CAUSES = ("grads_on_host", "home_on_host", "subgroups_too_large")
PREFETCH, WRITE_BUFFERS, SETS = 1, 2, 3  # the streamer's depth and write buffers; working sets and gradient sets
STATE_BYTES, GRAD_BYTES, MODEL_BYTES = 12, 4, 2


@dataclasses.dataclass(frozen=True)
class Setup:
    """The settings a run used (hidden from the learner: the evidence shows their effect)."""

    model: ModelSpec
    budget: int
    subgroup_numel: int
    home: str = "nvme"
    grads_on: str = "nvme"

    def with_fix(self, fix: dict) -> Setup:
        return dataclasses.replace(self, **fix)


def subgroups(setup: Setup) -> list[int]:
    """The parameters packed into subgroups of `subgroup_numel` (the last one short)."""
    full, rest = divmod(setup.model.num_params, setup.subgroup_numel)
    return [setup.subgroup_numel] * full + ([rest] if rest else [])


def allocations(setup: Setup) -> list[tuple[str, int]]:
    """(owner, bytes) of every pinned buffer the run makes, in order: the streamer's, then the optimizer's."""
    model, sizes = setup.model, subgroups(setup)
    block, largest = model.block_params * MODEL_BYTES, max(sizes)
    out = []
    if setup.home == "host":
        out += [("weights home", block)] * model.n_layer
    else:
        out += [("bounce buffer", block)] * (PREFETCH + 1)
    if setup.grads_on == "host":
        for numel in sizes:
            out += [("gradient sum", GRAD_BYTES * numel), ("gradient staging", MODEL_BYTES * numel)]
    working = (STATE_BYTES + (GRAD_BYTES if setup.grads_on == "nvme" else 0)) * largest
    out += [("working set", working)] * SETS
    if setup.grads_on == "nvme":
        out += [("gradient set", (GRAD_BYTES + MODEL_BYTES) * largest)] * SETS
    if setup.home == "nvme":
        out += [("write buffer", block)] * WRITE_BUFFERS  # made by the first update
    return out


def pinned_bytes(setup: Setup) -> int:
    """The sum of `allocations`, counted without listing them (a tiny subgroup makes millions)."""
    model = setup.model
    block, largest = model.block_params * MODEL_BYTES, min(setup.subgroup_numel, model.num_params)
    spills = setup.grads_on == "nvme"
    total = model.n_layer * block if setup.home == "host" else (PREFETCH + 1 + WRITE_BUFFERS) * block
    total += 0 if spills else (GRAD_BYTES + MODEL_BYTES) * model.num_params
    total += SETS * (STATE_BYTES + (GRAD_BYTES if spills else 0)) * largest
    return total + (SETS * (GRAD_BYTES + MODEL_BYTES) * largest if spills else 0)


def fits(setup: Setup) -> bool:
    return pinned_bytes(setup) <= setup.budget


def evidence(setup: Setup) -> dict:
    """What the learner sees of a refused run: the budget, the model, the subgroup size, the pinned buffers made before
    the refusal (owner, bytes) in order, the refused one, and the refusal's message."""
    held, made = 0, []
    for owner, nbytes in allocations(setup):
        if held + nbytes > setup.budget:
            return {"budget": setup.budget, "model": setup.model, "subgroup_numel": setup.subgroup_numel,
                    "pinned": made, "refused": (owner, nbytes),
                    "message": str(OutOfHostBudget(nbytes, held, setup.budget))}
        held += nbytes
        made.append((owner, nbytes))
    raise ValueError("this run fits its budget: no refusal to diagnose")


GB = 10 ** 9


def _case(cause: str, size: float, budget_gb: float, subgroup_numel: int = 1 << 22) -> tuple[str, Setup]:
    model = ModelSpec.of_params(size)
    wrong = {"grads_on_host": {"grads_on": "host"}, "home_on_host": {"home": "host"},
             "subgroups_too_large": {}}[cause]
    return cause, Setup(model, int(budget_gb * GB), subgroup_numel, **wrong)


CASES = (
    _case("grads_on_host", 13e9, 16),  # refused among the gradient sums
    _case("home_on_host", 13e9, 16),  # refused among the homes
    _case("subgroups_too_large", 13e9, 16, 1 << 28),
    _case("grads_on_host", 1.3e9, 8.2, 1 << 24),  # the sums fit; a working set, the largest buffer, is refused
    _case("home_on_host", 6.7e9, 13.12),  # the homes fit; a gradient set is refused
    _case("subgroups_too_large", 175e9, 64, 1 << 30),
)
EXAMPLE = _case("grads_on_host", 2.7e9, 12, 1 << 23)  # the lab's worked case, not graded


def largest_subgroup_that_fits(setup: Setup) -> int | None:
    """The largest power of two subgroup_numel with which `setup` fits its budget (None if none does)."""
    numel = 1 << 34
    while numel >= 1:
        if fits(setup.with_fix({"subgroup_numel": numel})):
            return numel
        numel //= 2
    return None


@contextmanager
def example() -> Iterator[dict]:
    """The lab's worked case (one the grader does not use)."""
    yield evidence(EXAMPLE[1])


def by_owner(buffers: list[tuple[str, int]]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for owner, nbytes in buffers:
        totals[owner] = totals.get(owner, 0) + nbytes
    return totals


def _why_not(named: str, seen: dict) -> str:
    totals = by_owner(seen["pinned"])
    biggest = max(totals, key=totals.get)
    share = f"{totals[biggest] / seen['budget']:.0%} of the budget"
    if named == "grads_on_host":
        return ("no buffer is a gradient sum or staging of a subgroup: the gradients already pass through a few "
                f"gradient sets on their way to the drive; '{biggest}' holds {share}")
    if named == "home_on_host":
        return (f"no buffer is a weights home: the blocks come from the drive through bounce buffers; '{biggest}' "
                f"holds {share}")
    return (f"the sets sized by one subgroup (working sets, gradient sets) are not what filled the budget: '{biggest}' "
            f"holds {share}, whatever the subgroup size; the refused buffer is only the last one asked for")


def _grade_fix(fix, setup: Setup, number: int) -> None:
    keys = {"grads_on_host": "grads_on", "home_on_host": "home", "subgroups_too_large": "subgroup_numel"}
    assert isinstance(fix, dict) and len(fix) == 1 and set(fix) <= set(keys.values()), (
        f"case {number}: the fix is {fix!r:.80}; return one setting as a dict: {{'grads_on': 'nvme'}}, "
        "{'home': 'nvme'} or {'subgroup_numel': n}")
    (key, value), = fix.items()
    if key in ("grads_on", "home") and value != "nvme":
        raise AssertionError(f"case {number}: the fix {fix!r} keeps it in host memory; the fix moves it to 'nvme'")
    if key == "subgroup_numel" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise AssertionError(f"case {number}: the fix {fix!r}: subgroup_numel is a positive int")
    fixed, cause = setup.with_fix(fix), setup_cause(setup)
    if not fits(fixed):
        raise AssertionError(f"case {number} ({cause}, rightly): with {fix!r} the run still pins "
                             f"{pinned_bytes(fixed):,} bytes, over its budget of {setup.budget:,}")
    if key != keys[cause]:
        raise AssertionError(f"case {number} ({cause}, rightly): with {fix!r} the run fits, with "
                             f"{setup.budget - pinned_bytes(fixed):,} bytes to spare, but what filled the budget "
                             f"stays in host memory: fix the cause ({keys[cause]!r}), not the sets around it")
    if key == "subgroup_numel":
        most = largest_subgroup_that_fits(setup)
        assert value == most, (
            f"case {number} (subgroups_too_large, rightly): {value:,} fits, but a subgroup of {most:,} (the largest "
            "power of two that fits) does too; smaller subgroups cost a file and an update call each")


def setup_cause(setup: Setup) -> str:
    return next(cause for cause, s in CASES + (EXAMPLE,) if s == setup)


@grader("12.3", nothing_to_refuse=(
    "no runtime function diagnoses a refused run; the fix is graded by the pinned bytes of the run with it"))
def diagnose(fn: Callable) -> str:
    """fn(evidence) -> (cause, fix) for each case."""
    for number, (cause, setup) in enumerate(CASES, 1):
        seen = evidence(setup)
        given = dict(seen, pinned=list(seen["pinned"]))
        answer = fn(given)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_refusal returned {answer!r:.80}; return (cause, fix), e.g. "
            "('home_on_host', {'home': 'nvme'})")
        named, fix = answer
        assert named in CAUSES, f"case {number}: the cause {named!r} is not one of {', '.join(map(repr, CAUSES))}"
        if named != cause:
            raise AssertionError(f"case {number}: not '{named}': {_why_not(named, seen)}")
        _grade_fix(fix, setup, number)
    sizes = sorted(setup.model.num_params for _, setup in CASES)
    return (f"{len(CASES)} refused runs, {sizes[0] / 1e9:.1f}B to {sizes[-1] / 1e9:.0f}B parameters: each cause "
            f"named ({', '.join(CAUSES)}), and with each fix the "
            "run fits its budget (the largest subgroup that fits, where the subgroups were too large)")
