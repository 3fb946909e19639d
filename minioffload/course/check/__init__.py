"""One-line verdicts for lab tasks and chapter check cells.

`task("1.2", fn)` runs the grader registered for Task 1.2 against the learner's function and prints
exactly one line: PASS with what was checked, FAIL with the first mismatch, or TODO while the
function still raises NotImplementedError. `expect(claim, ok, detail)` does the same for a chapter's
own check cells. Graders live next to this file, one module per lab.

This is not a test framework: a grader raises AssertionError with a reason a learner can act on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

GRADERS: dict[str, Callable[[Callable], str]] = {}


def grader(task_id: str) -> Callable:
    """Register `fn(learner_fn) -> detail` as the grader of `task_id`; it raises AssertionError to fail."""
    def register(fn: Callable[[Callable], str]) -> Callable[[Callable], str]:
        if task_id in GRADERS:
            raise ValueError(f"Task {task_id} has a grader already")
        GRADERS[task_id] = fn
        return fn
    return register


@dataclass(frozen=True)
class Verdict:
    task_id: str
    status: str  # "PASS", "FAIL" or "TODO"
    detail: str

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def __str__(self) -> str:
        return f"{self.status} Task {self.task_id}: {self.detail}"


def grade(task_id: str, fn: Callable) -> Verdict:
    """Run Task `task_id`'s grader on `fn` and return its verdict (never raises for a wrong answer)."""
    if task_id not in GRADERS:
        raise ValueError(f"no grader for Task {task_id!r}; known tasks: {', '.join(sorted(GRADERS))}")
    if not callable(fn):
        return Verdict(task_id, "FAIL", f"expected your function, got {type(fn).__name__}")
    try:
        return Verdict(task_id, "PASS", GRADERS[task_id](fn))
    except NotImplementedError:
        return Verdict(task_id, "TODO", "not done yet: replace `raise NotImplementedError` with your code")
    except AssertionError as err:
        return Verdict(task_id, "FAIL", str(err) or "a check failed")
    except Exception as err:  # a learner's bug is a verdict, not a traceback
        return Verdict(task_id, "FAIL", f"your function raised {type(err).__name__}: {err}")


@contextmanager
def sim_device(**options):
    """A sim device for a grader, closed afterwards without letting an error at close hide the real failure."""
    from ..device import device

    dev = device("sim", **options)
    try:
        yield dev
    finally:
        try:
            dev.close()
        except Exception:  # the run's own error, if any, is already on its way up
            pass


def task(task_id: str, fn: Callable) -> None:
    """Grade and print one line. Returns None so a notebook cell shows only that line."""
    print(grade(task_id, fn))


def expect(claim: str, ok: bool, detail: str = "") -> None:
    """A chapter's check cell: print 'PASS claim (detail)' or 'FAIL claim (detail)' on one line."""
    print(f"{'PASS' if ok else 'FAIL'} {claim}" + (f" ({detail})" if detail else ""))


from . import lab01, lab02, lab02_pool, lab03, lab04, lab04_clip, lab05, lab06, lab06_commit, lab06_pipeline  # noqa: E402,F401  (registers the graders)
