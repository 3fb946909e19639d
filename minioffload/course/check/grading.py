"""The grading machinery: the registry of graders, verdicts, and the lines a check cell prints.

The lab modules (lab01.py ...) register their graders here with `@grader("1.2")`; the package's __init__ imports
them all and re-exports `task`, `expect` and `grade` (see its docstring). A module of its own so that the lab
modules import it and not the package that imports them (no import cycle).
"""

from __future__ import annotations

import sysconfig
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .refuse import CalledTheRuntime, refusing

GRADERS: dict[str, Callable[[Callable], str]] = {}
REBUILDS: dict[str, tuple[str, ...]] = {}  # {task id: the runtime functions the task rebuilds, refused while graded}
NOTHING_TO_REFUSE: dict[str, str] = {}  # {task id: why the runtime holds no function this task rebuilds}


def grader(task_id: str, rebuilds: tuple[str, ...] = (), nothing_to_refuse: str = "") -> Callable:
    """Register `fn(learner_fn) -> detail` as the grader of `task_id`; it raises AssertionError to fail.

    `rebuilds`: the runtime functions ('minioffload.layout.shard_owners') the task asks the learner to write again;
    while the grader runs, the learner's code may not call them (refuse.py). A task without one says why in
    `nothing_to_refuse` (it is a variant the runtime does not contain, or a figure no function computes)."""
    if bool(rebuilds) == bool(nothing_to_refuse):
        raise ValueError(f"Task {task_id}: name the runtime functions it rebuilds, or say why there are none")

    def register(fn: Callable[[Callable], str]) -> Callable[[Callable], str]:
        if task_id in GRADERS:
            raise ValueError(f"Task {task_id} has a grader already")
        GRADERS[task_id] = fn
        if rebuilds:
            REBUILDS[task_id] = tuple(rebuilds)
        else:
            NOTHING_TO_REFUSE[task_id] = nothing_to_refuse
        return fn
    return register


@dataclass(frozen=True)
class Verdict:
    task_id: str
    status: str  # "PASS", "FAIL" or "TODO"
    detail: str
    traceback: str = ""  # when the learner's code raised: its own frames and the exception, else ""

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def __str__(self) -> str:
        line = f"{self.status} Task {self.task_id}: {self.detail}"
        return f"{line}\n{self.traceback}" if self.traceback else line


# Frames in these folders are not the learner's: the minioffload package (graders, runtime) and Python's and the
# installed libraries' own files.
_NOT_LEARNERS = tuple({Path(__file__).resolve().parents[2],
                       *(Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
                         if (p := sysconfig.get_paths().get(key)))})
MAX_FRAMES = 4  # of the learner's frames, the innermost ones shown


def _is_learners(filename: str) -> bool:
    if filename.startswith("<"):  # "<frozen ...>" is Python's; "<string>", "<stdin>": code the learner ran
        return not filename.startswith("<frozen")
    path = Path(filename).resolve()
    return not any(path.is_relative_to(folder) for folder in _NOT_LEARNERS)


def _notebook_cells() -> dict[str, int]:
    """{file name of a cell's compiled code: its execution count} in a Jupyter kernel, else {}.

    IPython compiles each cell into a file of its own under a temporary folder (/tmp/ipykernel_<pid>/<hash>.py);
    a learner knows the cell as In[n], which is how IPython's own tracebacks name it."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    return dict(getattr(getattr(shell, "compile", None), "_filename_map", None) or {})


def _named_as_cells(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames with a notebook cell's temporary file name replaced by 'Cell In[n]' (line numbers are the cell's)."""
    cells = _notebook_cells()
    return [traceback.FrameSummary(f"Cell In[{cells[f.filename]}]", f.lineno, f.name, lookup_line=False,
                                   line=f.line, end_lineno=f.end_lineno, colno=f.colno, end_colno=f.end_colno)
            if f.filename in cells else f for f in frames]


def learner_traceback(err: BaseException) -> str:
    """The traceback of `err` cut to the learner's frames (the innermost MAX_FRAMES), then the exception. In a
    notebook a cell's frames are named as IPython names them, 'Cell In[n]', with the cell's line numbers."""
    frames = _named_as_cells([f for f in traceback.extract_tb(err.__traceback__) if _is_learners(f.filename)])
    shown = traceback.StackSummary.from_list(frames[-MAX_FRAMES:]).format()
    skipped = [f"  ... {len(frames) - MAX_FRAMES} earlier frame(s) of yours\n"] if len(frames) > MAX_FRAMES else []
    head = "Traceback (your code only, most recent call last):\n" if frames else ""
    return (head + "".join(skipped + shown) + "".join(traceback.format_exception_only(type(err), err))).rstrip("\n")


def _raised_by_learner(err: BaseException) -> bool:
    """Whether the innermost frame of err's traceback is the learner's (an `assert` in their own code)."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and _is_learners(frames[-1].filename)


def _crashed(task_id: str, err: Exception) -> Verdict:
    frames = traceback.extract_tb(err.__traceback__)
    if any(_is_learners(f.filename) for f in frames) or isinstance(err, TypeError):  # TypeError: fn's signature
        return Verdict(task_id, "FAIL", f"your function raised {type(err).__name__}: {err}", learner_traceback(err))
    # no frame of the learner's: the check itself (or the runtime it runs) failed; the whole traceback says where
    return Verdict(task_id, "FAIL", f"the check raised {type(err).__name__}: {err}, outside your code (from what your "
                   "function returned, or a fault of the check's own: the whole traceback follows)",
                   "".join(traceback.format_exception(err)).rstrip("\n"))


def grade(task_id: str, fn: Callable, refuse: bool = True) -> Verdict:
    """Run Task `task_id`'s grader on `fn` and return its verdict (never raises for a wrong answer).

    `refuse=False` lets `fn` call the runtime functions the task rebuilds: for the graders' own tests, whose right
    answers and planted mistakes are built on the runtime. A learner's check cell (`task`) always refuses."""
    if task_id not in GRADERS:
        raise ValueError(f"no grader for Task {task_id!r}; known tasks: {', '.join(sorted(GRADERS))}")
    if not callable(fn):
        return Verdict(task_id, "FAIL", f"expected your function, got {type(fn).__name__}")
    refused: list[str] = []
    try:
        with refusing(REBUILDS.get(task_id, ()) if refuse else (), fn, grade.__code__, _is_learners, refused):
            detail = GRADERS[task_id](fn)
        if refused:  # raised in the learner's code and swallowed there
            raise CalledTheRuntime(refused[0])
        return Verdict(task_id, "PASS", detail)
    except NotImplementedError:
        return Verdict(task_id, "TODO", "not done yet: replace `raise NotImplementedError` with your code")
    except CalledTheRuntime as err:
        return _delegated(task_id, err.name)
    except AssertionError as err:
        if refused:  # the refusal turned into another failure on its way out
            return _delegated(task_id, refused[0])
        if _raised_by_learner(err):  # an assert of the learner's own, not a grader's verdict
            return _crashed(task_id, err)
        return Verdict(task_id, "FAIL", str(err) or "a check failed")
    except Exception as err:  # a learner's bug is a verdict, with the learner's frames only
        if refused:
            return _delegated(task_id, refused[0])
        return _crashed(task_id, err)


def _delegated(task_id: str, name: str) -> Verdict:
    return Verdict(task_id, "FAIL", f"your function called the runtime's `{name}`, which this task asks you to write "
                   "yourself: compute it in your own code (the runtime's version is yours to read after the lab)")


@contextmanager
def sim_device(**options):
    """A sim device for a grader, closed afterwards without letting an error at close hide the real failure."""
    from ...devices import device

    dev = device("sim", **options)
    try:
        yield dev
    finally:
        try:
            dev.close()
        except Exception:  # the run's own error, if any, is already on its way up
            pass


def task(task_id: str, fn: Callable) -> None:
    """Grade and print one line (and the learner's frames when their code raised). Returns None so a notebook
    cell shows only that."""
    print(grade(task_id, fn))


class NotPassed(AssertionError):
    """A task's verdict was FAIL or TODO (raised by `graded_task`, for autograders that score a cell by whether it
    raises)."""


def graded_task(task_id: str, fn: Callable) -> None:
    """`task`, for nbgrader's autograde (and any grader that scores a cell by whether it raises): the same line is
    printed, then NotPassed is raised unless the verdict is PASS, so the cell scores nothing."""
    verdict = grade(task_id, fn)
    print(verdict)
    if not verdict.passed:
        raise NotPassed(f"Task {task_id}: {verdict.status}")


def _timed(timed: bool) -> str:
    # a verdict on a time measured on this (shared) machine: another process can flip it, so nbval compares the line
    # sanitized ("timed" in tests/nbval_sanitize.cfg) while the reader still sees the verdict
    return " (timed)" if timed else ""


def expect(claim: str, ok: bool, detail: str = "", timed: bool = False) -> None:
    """A chapter's check cell: print 'PASS claim (detail)' or 'FAIL claim (detail)' on one line. `timed`: the verdict
    rests on a time measured here, which a busy machine can change (the line says so)."""
    print(f"{'PASS' if ok else 'FAIL'}{_timed(timed)} {claim}" + (f" ({detail})" if detail else ""))


def target(claim: str, value: float, goal: float, met: bool, detail: str = "", timed: bool = False) -> None:
    """A chapter's check of a stated target, on one line: 'MET claim (value against goal)', or
    'MISSED: value against goal: claim' when `met` is False. The threshold is the target itself, never a looser one.
    `timed` as for `expect`."""
    against = f"{value:.2f} against {goal:.2f}"
    if met:
        print(f"MET{_timed(timed)} {claim} ({against}" + (f"; {detail})" if detail else ")"))
    else:
        print(f"MISSED{_timed(timed)}: {against}: {claim}" + (f" ({detail})" if detail else ""))
