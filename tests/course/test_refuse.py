"""Graders refuse delegation: a learner's function that calls the runtime function its task rebuilds FAILs, and
saying so; the graders' own calls to those functions still work, and everything is put back afterwards."""

import pytest

from minioffload import layout
from minioffload.course import check
from minioffload.course.check.grading import NOTHING_TO_REFUSE, REBUILDS
from minioffload.course.check.refuse import resolve
from minioffload.layout import shard_owners  # the function itself, as a notebook's `from ... import` holds it
from minioffload.predict import activation_cost

DELEGATED = "called the runtime's"


def test_every_task_names_what_it_rebuilds_or_why_nothing():
    assert set(REBUILDS) | set(NOTHING_TO_REFUSE) == set(check.GRADERS)
    assert not set(REBUILDS) & set(NOTHING_TO_REFUSE)
    for names in REBUILDS.values():
        for name in names:
            resolve(name)  # raises when a name no longer points at a runtime function


def _delegator(name: str):
    """A planted solution that hands its work to the runtime function `name`, looked up when it is called (as a
    learner's `layout.shard_owners(...)` is)."""
    def delegate(*args, **kwargs):
        holder, attr, _ = resolve(name)
        return getattr(holder, attr)(*args, **kwargs)
    return delegate


def _task_order(task_id: str) -> tuple[int, ...]:
    """Sort key: Task 9.3 before 10.2, and the capstone's C.1 after every numbered lab's tasks."""
    return tuple(int(part) if part.isdigit() else 1_000 for part in task_id.split("."))


@pytest.mark.parametrize("task_id", sorted(REBUILDS, key=_task_order))
def test_a_solution_that_calls_the_rebuilt_function_fails_saying_so(task_id):
    for name in REBUILDS[task_id]:
        verdict = check.grade(task_id, _delegator(name))
        assert verdict.status == "FAIL" and DELEGATED in verdict.detail, (name, str(verdict))
        assert name.removeprefix("minioffload.") in verdict.detail
    for name in REBUILDS[task_id]:  # every guard is gone again
        assert not hasattr(resolve(name)[2], "refuses_learners"), name


def test_the_issues_example_fails_through_a_module_and_through_an_imported_name():
    assert "shard_owners" in check.grade("10.1", lambda sizes, ranks: layout.shard_owners(sizes, ranks)).detail
    verdict = check.grade("10.1", lambda sizes, ranks: shard_owners(sizes, ranks))
    assert verdict.status == "FAIL" and DELEGATED in verdict.detail
    assert shard_owners is layout.shard_owners and not hasattr(shard_owners, "refuses_learners")


def test_a_refusal_the_learner_swallows_still_fails():
    def owners(sizes, ranks):
        try:
            return layout.shard_owners(sizes, ranks)
        except Exception:
            return largest_first(sizes, ranks)
    verdict = check.grade("10.1", owners)
    assert verdict.status == "FAIL" and DELEGATED in verdict.detail


def test_a_function_the_grader_compares_with_is_refused_to_the_learner_only():
    def choose(costs, budget):
        best = activation_cost.best_policy(None, None, budget, costs=costs)
        return best.policy if best else None
    verdict = check.grade("7.3", choose)
    assert verdict.status == "FAIL" and "best_policy" in verdict.detail
    solved = check.grade("7.3", lambda costs, budget: min(
        (c for c in costs.values() if c.device_bytes <= budget), key=lambda c: (c.extra_s, c.device_bytes),
        default=None) and min((c for c in costs.values() if c.device_bytes <= budget),
                              key=lambda c: (c.extra_s, c.device_bytes)).policy)
    assert solved.passed, str(solved)  # the grader's own calls to best_policy went through meanwhile


def largest_first(sizes, ranks):
    held, out = [0] * ranks, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(ranks), key=lambda r: (held[r], r))
        out[index] = rank
        held[rank] += sizes[index]
    return out


def test_an_honest_solution_still_passes_while_the_guards_are_up():
    verdict = check.grade("10.1", largest_first)
    assert verdict.passed, str(verdict)
