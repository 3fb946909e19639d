"""Generate the student labs in exercises/ from the reference solutions in exercises/solutions/.

In a solution notebook, each answer sits between two marker lines:

    # BEGIN SOLUTION Task 1.2
    ...the reference answer...
    # END SOLUTION

The student copy replaces each region, markers included, with
`raise NotImplementedError("Task 1.2")` at the marker's indentation, and drops every output, so
a learner starts from a clean notebook whose check cells print TODO.

With --book it writes the book's lab pages instead: book/labs/labNN_*.ipynb and capstone_*.ipynb (git-ignored, made
by `make book` and `make book-stored`), each a student copy that opens with a block saying what the lab practises, how
to open it in JupyterLab and where the solutions are, and that Jupyter Book does not execute (`mystnb.execution_mode`).
It does not grade anything, and it never edits a solution.

Usage: python tools/make_student_labs.py [--check] [--book] [LAB ...]
       (--check: exit 1 if a copy is out of date; LAB: solution files or names such as lab02 or capstone,
        default: all)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
BOOK = ROOT / "book"
BOOK_LABS = BOOK / "labs"
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION Task (?P<task>(?:\d+|C)\.\d+)\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
TASK_HEADING = re.compile(r"^#{2,3}\s+Task (?P<task>(?:\d+|C)\.\d+)(?P<title>.*)$", re.MULTILINE)


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace every marked region in one cell's source with a NotImplementedError stub."""
    out, inside = [], None
    for number, line in enumerate(source.splitlines(), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if inside:
                raise ValueError(f"{where}, line {number}: BEGIN SOLUTION inside Task {inside}'s region")
            inside = begin["task"]
            out.append(f'{begin["indent"]}raise NotImplementedError("Task {inside}")')
        elif end:
            if not inside:
                raise ValueError(f"{where}, line {number}: END SOLUTION without a BEGIN SOLUTION")
            inside = None
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: Task {inside}'s region has no END SOLUTION")
    return "\n".join(out)


def student_notebook(solution_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(solution_path, as_version=4)
    for index, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)  # run timestamps: they would make every re-run a change
        if cell.cell_type != "code":
            continue
        cell.source = strip_solutions(cell.source, f"{solution_path.name} cell {index}")
        cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    return nb


def student_path(solution_path: Path) -> Path:
    return solution_path.parent.parent / solution_path.name


def book_path(solution_path: Path) -> Path:
    return BOOK_LABS / solution_path.name


CAPSTONE_CHAPTERS = (4, 8, 10)  # the chapters whose pieces the capstone lab puts together


def lab_number(solution_path: Path) -> int | None:
    """NN of labNN_*.ipynb; None for the capstone (capstone_*.ipynb), which goes with several chapters."""
    if solution_path.name.startswith("capstone_"):
        return None
    match = re.match(r"lab(\d+)_", solution_path.name)
    if not match:
        raise ValueError(f"{solution_path.name}: a lab's file name starts with labNN_ (lab01_memory.ipynb) or "
                         "capstone_")
    return int(match[1])


def _chapter_link(number: int) -> str:
    chapter = sorted((BOOK / "chapters").glob(f"{number:02d}_*.ipynb"))
    return f"[Chapter {number}](../chapters/{chapter[0].name})" if chapter else f"Chapter {number}"


def tasks_practised(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """(task id, title) for each `## Task N.M: title` heading of the lab, in order."""
    found = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            found += [(m["task"], m["title"].strip(" :")) for m in TASK_HEADING.finditer(cell.source)]
    return found


def book_preamble(solution_path: Path, nb: nbformat.NotebookNode) -> str:
    """The block a lab page opens with: what it practises, how to open it, where the solutions are."""
    number = lab_number(solution_path)
    tasks = tasks_practised(nb)
    if not tasks:
        raise ValueError(f"{solution_path.name}: no `## Task N.M: title` heading, so the book page cannot say "
                         "what the lab practises; give each task such a heading")
    if number is None:
        chapters = [_chapter_link(n) for n in CAPSTONE_CHAPTERS]
        whose, companion = "the capstone's", f" It puts together {', '.join(chapters[:-1])} and {chapters[-1]}."
    else:
        chapter = sorted((BOOK / "chapters").glob(f"{number:02d}_*.ipynb"))
        whose = f"Lab {number}'s"
        companion = f" It goes with {_chapter_link(number)}." if chapter else ""
    lines = [
        "```{admonition} How to work on this lab",
        ":class: tip",
        f"This page shows {whose} tasks and the code you start from; nothing on it has been run.{companion}",
        "The lab practises:",
        "",
        *[f"- **Task {task}**: {title}" for task, title in tasks],
        "",
        "To work on it, run `make lab` in the repository's root folder, then open "
        f"`exercises/{solution_path.name}` in JupyterLab and run the cells from the top: each check cell "
        "prints `PASS`, `FAIL` with the reason, or `TODO` while the task's function still raises "
        "`NotImplementedError`.",
        "",
        f"Instructors: the reference solutions are in `exercises/solutions/{solution_path.name}`; "
        "[For instructors](../instructors.md) says how to grade a class.",
        "```",
    ]
    return "\n".join(lines)


def book_notebook(solution_path: Path) -> nbformat.NotebookNode:
    """The student copy as a book page: the preamble under its title, and never executed by Jupyter Book."""
    nb = student_notebook(solution_path)
    preamble = nbformat.v4.new_markdown_cell(book_preamble(solution_path, nb), id="lab-preamble")
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and first.source.startswith("# "):
        title, _, rest = first.source.partition("\n")
        first.source = rest.lstrip("\n")
        nb.cells[:0] = [nbformat.v4.new_markdown_cell(title, id="lab-title"), preamble]
    else:
        nb.cells.insert(0, preamble)
    nb.cells = [cell for cell in nb.cells if cell.source.strip() or cell.cell_type == "code"]
    nb.metadata["mystnb"] = {"execution_mode": "off"}
    nbformat.validator.normalize(nb)
    return nb


def selected(names: list[str]) -> list[Path]:
    solutions = sorted(SOLUTIONS.glob("lab*.ipynb")) + sorted(SOLUTIONS.glob("capstone_*.ipynb"))
    if not names:
        return solutions
    chosen = []
    for name in names:
        stem = Path(name).stem
        matches = [s for s in solutions if s.stem == stem or s.stem.startswith(stem + "_")]
        if not matches:
            raise SystemExit(f"no lab solution matches {name!r} in {SOLUTIONS.relative_to(ROOT)}; "
                             f"known: {', '.join(s.stem for s in solutions)}")
        chosen += matches
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated copy is out of date")
    parser.add_argument("--book", action="store_true", help="write the book's lab pages in book/labs/ instead")
    parser.add_argument("labs", nargs="*", help="solution files or lab names (lab02); default: every lab")
    args = parser.parse_args()
    make, where = (book_notebook, book_path) if args.book else (student_notebook, student_path)
    stale = []
    for solution in selected(args.labs):
        text = nbformat.writes(make(solution)) + "\n"
        target = where(solution)
        if target.exists() and target.read_text() == text:
            continue
        if args.check:
            stale.append(target.relative_to(ROOT))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}; run `make labs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
