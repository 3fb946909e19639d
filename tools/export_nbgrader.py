"""Write an nbgrader course folder from the lab solutions, for instructors who grade on a JupyterHub with nbgrader.

For each lab, `<course>/source/<lab>/<lab>.ipynb` is the solution notebook with nbgrader's cell metadata:

- a cell holding `# BEGIN SOLUTION Task N.M` ... `# END SOLUTION` is a solution cell (`task-N_M-answer`): nbgrader's
  `generate_assignment` replaces the region with its own stub (`raise NotImplementedError()`), as `make labs` does;
- a check cell `check.task("N.M", fn)` becomes a locked autograder test (`task-N_M`, one point) calling
  `check.graded_task("N.M", fn)`, which prints the same one-line verdict and raises unless it is PASS, so that
  `nbgrader autograde` scores the task and the verdict is the feedback the student reads.

Every other cell is left as it is. The folder gets an `nbgrader_config.py` naming the course.
Then, in the folder: `nbgrader generate_assignment lab01_memory`, release, collect, `nbgrader autograde lab01_memory`.

This is an exporter, not a grader: nbgrader grades. `python -m minioffload.course.grade` grades a folder of
submissions without nbgrader or a JupyterHub.

Usage: python tools/export_nbgrader.py COURSE_DIR [LAB ...]   (LAB: names such as lab01, default: all)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
REGION = re.compile(r"^\s*# BEGIN SOLUTION Task (?P<task>(?:\d+|C)\.\d+)\s*$", re.MULTILINE)
CHECK = re.compile(r'^check\.task\("(?P<task>(?:\d+|C)\.\d+)",', re.MULTILINE)


def grade_id(task: str) -> str:
    """nbgrader's name for Task N.M's check cell (its ids allow letters, digits, '_' and '-' only)."""
    return "task-" + task.replace(".", "_")


def _metadata(grade_id: str, solution: bool, graded: bool) -> dict:
    meta = {"grade": graded, "grade_id": grade_id, "locked": graded, "schema_version": 3, "solution": solution,
            "task": False}
    if graded:
        meta["points"] = 1
    return meta


def convert(solution: Path) -> nbformat.NotebookNode:
    """The solution notebook with nbgrader's metadata on its answer and check cells (outputs dropped)."""
    nb = nbformat.read(solution, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        answers, checks = REGION.findall(cell.source), CHECK.findall(cell.source)
        if answers and checks:
            raise ValueError(f"{solution.name}: a cell holds both an answer and a check; nbgrader needs them apart")
        if len(checks) > 1:
            raise ValueError(f"{solution.name}: one check per cell (tasks {checks}), so that each scores alone")
        if answers:
            cell.metadata["nbgrader"] = _metadata(f"{grade_id(answers[0])}-answer", solution=True, graded=False)
        elif checks:
            cell.source = CHECK.sub(lambda m: f'check.graded_task("{m["task"]}",', cell.source)
            cell.metadata["nbgrader"] = _metadata(grade_id(checks[0]), solution=False, graded=True)
    return nb


def export(course: Path, labs: list[Path]) -> list[str]:
    """Write the course folder; returns the assignment names."""
    names = []
    for solution in labs:
        folder = course / "source" / solution.stem
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(convert(solution), folder / solution.name)
        names.append(solution.stem)
    (course / "nbgrader_config.py").write_text(  # generate_assignment enters each assignment in the gradebook
        "# written by tools/export_nbgrader.py\n"
        "c = get_config()  # noqa: F821\n"
        'c.CourseDirectory.course_id = "minioffload"\n')
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("course", type=Path, help="the nbgrader course folder to write (made if missing)")
    parser.add_argument("labs", nargs="*", help="labs to export (lab01, capstone or a solution's path), default: all")
    args = parser.parse_args()
    every = sorted(SOLUTIONS.glob("lab*.ipynb")) + sorted(SOLUTIONS.glob("capstone_*.ipynb"))
    chosen = [s for s in every if not args.labs or any(s.stem.startswith(Path(a).stem[:5]) for a in args.labs)]
    if not chosen:
        print(f"no lab matches {args.labs}; the labs are {', '.join(s.stem for s in every)}", file=sys.stderr)
        return 1
    for name in export(args.course, chosen):
        print(f"wrote {args.course / 'source' / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
