"""The graders' tests in one pattern: a right answer passes, each plausible mistake fails with the named message,
and a stub says TODO. Each tests/course/test_check*.py lists its answers and mistakes and takes its tests from here:

    REFERENCE = {"2.3": needed_waits, ...}                              # task -> a right answer
    WRONG = [("2.3", all_four_waits, "which the pipeline does not need"), ...]   # (task, mistake, phrase in its FAIL)
    test_reference_passes = reference_passes(REFERENCE)
    test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
    test_stub_is_todo = stubs_are_todo(REFERENCE)
    test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("2.2", "2.3"))

Each factory returns one parametrized test function; pytest collects it under the name it is bound to. A module
whose answers or mistakes are built on the runtime functions a task rebuilds (which a learner may not call) names
those tasks in BUILT_ON_THE_RUNTIME; they are graded with `refuse=False` (tests/course/test_refuse.py tests the
refusal itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from minioffload.course import check


def stub(*args, **kwargs):
    """A learner's function before they start: the lab's `raise NotImplementedError`."""
    raise NotImplementedError("Task")


def assert_passes(task_id: str, fn: Callable, refuse: bool = True) -> check.Verdict:
    verdict = check.grade(task_id, fn, refuse)
    assert verdict.passed, str(verdict)
    assert str(verdict).startswith(f"PASS Task {task_id}: "), str(verdict)
    return verdict


def assert_fails(task_id: str, fn: Callable, phrase: str, refuse: bool = True) -> check.Verdict:
    """The verdict is FAIL and its reason contains `phrase` (what a learner needs to read to fix it)."""
    verdict = check.grade(task_id, fn, refuse)
    assert verdict.status == "FAIL" and phrase in verdict.detail, str(verdict)
    return verdict


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__).strip("<>")


def reference_passes(reference: dict[str, Callable], built_on_the_runtime: Iterable[str] = ()) -> Callable:
    built = set(built_on_the_runtime)

    @pytest.mark.parametrize("task_id", sorted(reference))
    def test(task_id):
        assert_passes(task_id, reference[task_id], refuse=task_id not in built)
    return test


def mistakes_fail(wrong: list[tuple[str, Callable, str]], built_on_the_runtime: Iterable[str] = ()) -> Callable:
    built = set(built_on_the_runtime)

    @pytest.mark.parametrize("task_id, fn, phrase", wrong,
                             ids=[f"{task}-{n}-{_name(fn)}" for n, (task, fn, _) in enumerate(wrong)])
    def test(task_id, fn, phrase):
        assert_fails(task_id, fn, phrase, refuse=task_id not in built)
    return test


def stubs_are_todo(reference: dict[str, Callable]) -> Callable:
    @pytest.mark.parametrize("task_id", sorted(reference))
    def test(task_id):
        verdict = check.grade(task_id, stub)
        assert verdict.status == "TODO", str(verdict)
    return test


def same_verdict_every_run(reference: dict[str, Callable], task_ids: Iterable[str],
                           built_on_the_runtime: Iterable[str] = ()) -> Callable:
    """nbval compares the check lines in strict mode: the same answer must print the same line."""
    built = set(built_on_the_runtime)

    @pytest.mark.parametrize("task_id", sorted(task_ids))
    def test(task_id):
        refuse = task_id not in built
        first, second = (check.grade(task_id, reference[task_id], refuse) for _ in range(2))
        assert first.passed and str(first) == str(second)
    return test
