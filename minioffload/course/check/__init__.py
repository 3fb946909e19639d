"""One-line verdicts for lab tasks and chapter check cells.

`task("1.2", fn)` runs the grader registered for Task 1.2 against the learner's function and prints
exactly one line: PASS with what was checked, FAIL with the first mismatch, or TODO while the
function still raises NotImplementedError. When the learner's code raised, the FAIL line is followed by
the frames of the traceback that are the learner's (not the grader's, the runtime's or a library's) and
the exception. `expect(claim, ok, detail)` does the same for a chapter's own check cells. Graders live
next to this file, one module per lab.

This is not a test framework: a grader raises AssertionError with a reason a learner can act on. A grader
never holds a task's solution: it checks the learner's function by what it does, against the runtime, torch
or invariants, so that reading a grader does not give the answer away.
"""

# the lab modules register their graders in grading.GRADERS when imported
from . import (  # noqa: F401
    capstone,
    capstone_zero3,
    lab01,
    lab02,
    lab02_diagnose,
    lab02_pool,
    lab03,
    lab03_diagnose,
    lab03_kernel,
    lab04,
    lab04_clip,
    lab04_diagnose,
    lab05,
    lab05_diagnose,
    lab06,
    lab06_commit,
    lab06_diagnose,
    lab06_pipeline,
    lab07,
    lab07_diagnose,
    lab07_hooks,
    lab08,
    lab08_diagnose,
    lab08_fetch,
    lab09,
    lab09_diagnose,
    lab09_objective,
    lab09_search,
    lab10,
    lab10_diagnose,
    lab10_gather,
    lab10_reduce,
    lab11,
    lab11_diagnose,
    lab11_latest,
    lab11_paths,
    lab12,
    lab12_diagnose,
)
from .grading import (
    GRADERS,
    MAX_FRAMES,
    NotPassed,
    Verdict,
    expect,
    grade,
    graded_task,
    grader,
    learner_traceback,
    sim_device,
    target,
    task,
)

__all__ = ["GRADERS", "MAX_FRAMES", "NotPassed", "Verdict", "expect", "grade", "graded_task", "grader",
           "learner_traceback", "sim_device", "target", "task"]
