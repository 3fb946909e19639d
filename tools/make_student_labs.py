"""Generate the student labs in exercises/ from the reference solutions in exercises/solutions/.

In a solution notebook, each answer sits between two marker lines:

    # BEGIN SOLUTION Task 1.2
    ...the reference answer...
    # END SOLUTION

The student copy replaces each region, markers included, with
`raise NotImplementedError("Task 1.2")` at the marker's indentation, and drops every output, so
a learner starts from a clean notebook whose check cells print TODO.

Usage: python tools/make_student_labs.py [--check]   (--check: exit 1 if a copy is out of date)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION Task (?P<task>\d+\.\d+)\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a student copy is out of date")
    args = parser.parse_args()
    stale = []
    for solution in sorted(SOLUTIONS.glob("lab*.ipynb")):
        text = nbformat.writes(student_notebook(solution)) + "\n"
        target = student_path(solution)
        if target.exists() and target.read_text() == text:
            continue
        if args.check:
            stale.append(target.relative_to(ROOT))
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}; run `make labs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
