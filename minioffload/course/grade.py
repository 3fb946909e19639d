"""Grade a class: execute every submitted lab notebook in a folder and write one CSV row per student.

    python -m minioffload.course.grade SUBMISSIONS_DIR --out grades.csv [--timeout 600] [--jobs 1]

WARNING: this executes the students' code, with your permissions, on your machine. Run it in a container or a
throwaway virtual machine that holds no secrets and has the course installed (`pip install -e ".[course,book]"`).

Where the student's name comes from (the two layouts may be mixed in one folder):

    SUBMISSIONS_DIR/alice/lab01_memory.ipynb     a notebook in a folder: the student is the first folder below
                                                 SUBMISSIONS_DIR (any deeper folders are ignored)
    SUBMISSIONS_DIR/alice_lab01_memory.ipynb     a notebook directly in SUBMISSIONS_DIR: the student is the file's
                                                 stem up to `_labNN` or `_capstone` ("alice"), or the whole
                                                 stem if it has none

A notebook's lab is read from its check cells (`check.task("1.2", fn)`), not from its file name. Each notebook
is executed from the top in its own folder by a fresh `python3` kernel, as "Run All" does: it stops at the first
cell that raises, and a notebook gets `--timeout` seconds in all. A task's grade is the verdict its check cell
printed (PASS, FAIL or TODO); ERROR when that cell printed none, because the notebook stopped or timed out before
it, or the check cell was deleted. The reason goes to the `notes` column; the other notebooks still grade.

The CSV: `student`, one column per task of every lab found (1.1, 1.2, ..., 2.1, ...), `total` (the number of
PASS), `notes`. A blank cell: the student handed in no notebook of that lab.

It is not a sandbox and not an anti-cheating tool: a student who edits a check cell to print "PASS" gets PASS.
Compare a suspicious submission's check cells with the student copy, or re-run its functions with
`check.grade(task_id, fn)`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from tqdm import tqdm

from .check import GRADERS

CHECK_CALL = re.compile(r'check\.task\(\s*["\'](?P<task>(?:\d+|C)\.\d+)["\']')
VERDICT = re.compile(r"^(?P<status>PASS|FAIL|TODO) Task (?P<task>(?:\d+|C)\.\d+):")
FLAT_NAME = re.compile(r"^(?P<student>.+?)[_\-. ]+(?:lab\d+|capstone)", re.IGNORECASE)
STATUSES = ("PASS", "FAIL", "TODO", "ERROR")


class GradingError(ValueError):
    """Bad input: the folder is missing or holds no notebook."""


@dataclass
class Submission:
    path: Path
    student: str
    tasks: list[str] = field(default_factory=list)  # the lab's task ids (its check cells and its graders)
    note: str = ""  # why it cannot be graded (unreadable, not a lab), when it cannot


@dataclass
class Graded:
    student: str
    verdicts: dict[str, str]  # task id -> PASS / FAIL / TODO / ERROR
    note: str = ""


def task_key(task_id: str) -> tuple[int, int]:
    """Tasks by lab, the capstone's (C.M) after every lab's."""
    lab, number = task_id.split(".")
    return (10**6 if lab == "C" else int(lab), int(number))


def student_of(path: Path, folder: Path) -> str:
    """The student a submitted notebook belongs to (see the module's docstring for the two layouts)."""
    parts = path.relative_to(folder).parts
    if len(parts) > 1:
        return parts[0]
    match = FLAT_NAME.match(path.stem)
    return match["student"] if match else path.stem


def lab_tasks(nb: nbformat.NotebookNode) -> list[str]:
    """Every task of the lab(s) whose check cells the notebook holds: those cells' ids and the graders' ids."""
    called = {m["task"] for cell in nb.cells if cell.cell_type == "code" for m in CHECK_CALL.finditer(cell.source)}
    labs = {task.split(".")[0] for task in called}
    registered = {task for task in GRADERS if task.split(".")[0] in labs}
    return sorted(called | registered, key=task_key)


def find_submissions(folder: Path) -> list[Submission]:
    """Every notebook under `folder` (not in hidden folders such as .ipynb_checkpoints), with its student."""
    if not folder.is_dir():
        raise GradingError(f"{folder}: no such folder (give the folder that holds the submitted notebooks)")
    paths = sorted(p for p in folder.rglob("*.ipynb")
                   if not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not paths:
        raise GradingError(f"{folder}: no notebook (*.ipynb) in it or its subfolders")
    found = []
    for path in paths:
        sub = Submission(path, student_of(path, folder))
        try:
            sub.tasks = lab_tasks(nbformat.read(path, as_version=4))
        except Exception as err:  # a corrupt or non-notebook file: a note, and the others still grade
            sub.note = f"{path.name}: not a readable notebook ({type(err).__name__}: {err})"
        else:
            if not sub.tasks:
                sub.note = f"{path.name}: no check.task(...) cell, so not a lab notebook: not graded"
        found.append(sub)
    return found


def verdicts_printed(nb: nbformat.NotebookNode) -> dict[str, str]:
    """{task id: PASS/FAIL/TODO} from the first line each check cell printed (the last such cell wins)."""
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        called = {m["task"] for m in CHECK_CALL.finditer(cell.source)}
        text = "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")
        for line in text.splitlines():
            match = VERDICT.match(line)
            if match and match["task"] in called:
                found[match["task"]] = match["status"]
    return found


def _stopped_at(nb: nbformat.NotebookNode) -> str:
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {index} raised {out.get('ename')}: {out.get('evalue')}"
    return "a cell raised"


async def execute(sub: Submission, timeout: float) -> Graded:
    """Run one submission from the top and read its verdicts; a task without one is ERROR, with the reason."""
    if sub.note:
        return Graded(sub.student, {}, sub.note)
    nb = nbformat.read(sub.path, as_version=4)
    for cell in nb.cells:  # the outputs handed in are not evidence: only what this run prints counts
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # nbclient's own limit is per cell: give it slack, so that the limit on the whole notebook is the one that acts
    client = NotebookClient(nb, timeout=timeout + 60, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(sub.path.parent)}})
    run = asyncio.ensure_future(client.async_execute())
    done, _ = await asyncio.wait({run}, timeout=timeout)
    if not done:  # stop it: cancelling the run shuts its kernel down, whatever the run raises on the way out
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    err = run.exception() if done else None
    if not done or isinstance(err, CellTimeoutError):
        note = f"timed out after {timeout:g} s"
    elif isinstance(err, CellExecutionError):
        note = f"stopped: {_stopped_at(nb)}"
    elif isinstance(err, DeadKernelError):
        note = f"the kernel died ({err})"
    elif err is not None:  # the kernel did not start, ...: this notebook's row says so, the others go on
        note = f"could not execute ({type(err).__name__}: {err})"
    else:
        note = ""
    printed = verdicts_printed(nb)
    verdicts = {task: printed.get(task, "ERROR") for task in sub.tasks}
    if not note and "ERROR" in verdicts.values():
        missing = [task for task, status in verdicts.items() if status == "ERROR"]
        note = f"no verdict printed for Task {', '.join(missing)} (check cell missing or changed?)"
    return Graded(sub.student, verdicts, f"{sub.path.name}: {note}" if note else "")


async def grade_all(subs: list[Submission], timeout: float, jobs: int,
                    progress: Callable[[Graded], None] = lambda g: None) -> list[Graded]:
    """Execute the submissions, at most `jobs` at a time; results in the order of `subs`."""
    limit = asyncio.Semaphore(jobs)

    async def one(sub: Submission) -> Graded:
        async with limit:
            graded = await execute(sub, timeout)
        progress(graded)
        return graded

    return list(await asyncio.gather(*(one(sub) for sub in subs)))


def table(graded: Iterable[Graded]) -> tuple[list[str], list[dict[str, str]]]:
    """The CSV's header and one row per student (their notebooks merged; the first verdict of a task wins)."""
    graded = list(graded)
    tasks = sorted({task for g in graded for task in g.verdicts}, key=task_key)
    rows: dict[str, dict[str, str]] = {}
    for g in graded:
        row = rows.setdefault(g.student, {"student": g.student, "notes": ""})
        for task, status in g.verdicts.items():
            if task in row:
                g.note = "; ".join(filter(None, [g.note, f"Task {task} handed in twice: the first one graded"]))
            else:
                row[task] = status
        row["notes"] = "; ".join(filter(None, [row["notes"], g.note]))
    for row in rows.values():
        row["total"] = str(sum(row.get(task) == "PASS" for task in tasks))
    return ["student", *tasks, "total", "notes"], [rows[name] for name in sorted(rows)]


def write_csv(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)


def grade(folder: Path, out: Path, timeout: float = 600, jobs: int = 1, show_progress: bool = True) -> list[dict]:
    """Grade every notebook under `folder` into the CSV `out`; returns its rows."""
    subs = find_submissions(folder)
    if not out.parent.is_dir():  # say so now, not after an hour of grading
        raise GradingError(f"{out}: its folder {out.parent} does not exist (create it, or give another --out)")
    with tqdm(total=len(subs), unit="notebook", desc="grading", disable=not show_progress) as bar:
        def progress(graded: Graded) -> None:
            bar.set_postfix_str(graded.student)
            bar.update()
        graded = asyncio.run(grade_all(subs, timeout, jobs, progress))
    header, rows = table(graded)
    write_csv(out, header, rows)
    return rows


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above zero")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minioffload.course.grade",
        description="Grade a folder of submitted lab notebooks into a CSV (one row per student, one column per "
                    "task). WARNING: it executes the students' code; run it in a container or a throwaway VM.",
        epilog="Layouts: DIR/alice/lab01_memory.ipynb (the student is the folder) or DIR/alice_lab01_memory.ipynb "
               "(the student is the stem up to _labNN). Grades: PASS, FAIL, TODO, or ERROR when the check cell "
               "printed no verdict (the notebook raised before it or timed out: see the notes column).")
    parser.add_argument("folder", type=Path, help="the folder of submitted notebooks")
    parser.add_argument("--out", type=Path, default=Path("grades.csv"), help="the CSV to write (default grades.csv)")
    parser.add_argument("--timeout", type=_positive(float), default=600,
                        help="seconds each notebook may run in all (default 600)")
    parser.add_argument("--jobs", type=_positive(int), default=1, help="notebooks executed at once (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        rows = grade(args.folder, args.out, args.timeout, args.jobs, show_progress=not args.quiet)
    except GradingError as err:
        print(f"grade: error: {err}", file=sys.stderr)
        return 2
    errors = sum(bool(row["notes"]) for row in rows)
    print(f"wrote {args.out}: {len(rows)} student(s)" + (f", {errors} with notes (see the notes column)"
                                                         if errors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
