"""Labs: student copies are generated from the solutions, every stub says TODO, every solution passes."""

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from make_student_labs import strip_solutions, student_path  # noqa: E402

SOLUTIONS = sorted((ROOT / "exercises" / "solutions").glob("lab*.ipynb")) + sorted(
    (ROOT / "exercises" / "solutions").glob("capstone_*.ipynb"))
CHECK_CALL = re.compile(r'check\.task\("((?:\d+|C)\.\d+)"')  # labs' tasks N.M, the capstone's C.M


def verdicts(path: Path, execute: bool = True) -> dict[str, str]:
    """{task id: the one line its check cell printed}: after executing the lab notebook, or as stored in it."""
    nb = nbformat.read(path, as_version=4)
    if execute:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
                       ).execute()
    found = {}
    for cell in nb.cells:
        match = CHECK_CALL.search(cell.source) if cell.cell_type == "code" else None
        if match:
            lines = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream").splitlines()
            assert len(lines) == 1, f"Task {match[1]}'s check cell printed {lines!r}, not one line"
            found[match[1]] = lines[0]
    return found


def test_there_is_a_lab_with_at_least_three_tasks():
    assert SOLUTIONS, "no lab solutions found"
    for solution in SOLUTIONS:
        sources = "\n".join(c.source for c in nbformat.read(solution, as_version=4).cells)
        assert len(set(CHECK_CALL.findall(sources))) >= 3, solution.name


def test_every_lab_from_lab_2_has_a_graded_diagnosis_task():
    """A task headed "## Task N.M (diagnosis): ..." whose check cell grades it, in every lab from Lab 2 on."""
    from minioffload.course.check import GRADERS

    heading = re.compile(r"^#{2,3}\s+Task (\d+\.\d+) \(diagnosis\)", re.MULTILINE)
    for solution in SOLUTIONS:
        if solution.name.startswith(("lab01", "capstone_")):  # the capstone: one design built from the labs
            continue
        cells = nbformat.read(solution, as_version=4).cells
        diagnoses = {t for c in cells if c.cell_type == "markdown" for t in heading.findall(c.source)}
        checked = {t for c in cells if c.cell_type == "code" for t in CHECK_CALL.findall(c.source)}
        assert diagnoses & checked & set(GRADERS), f"{solution.name} has no graded diagnosis task"


def test_student_copies_are_up_to_date():
    result = subprocess.run([sys.executable, "tools/make_student_labs.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_solution_passes_and_every_stub_is_todo(solution):
    """The solution's verdicts as stored: `make test` executes every solution under nbval, which fails unless each
    check cell prints its stored line again (so no check cell may be left out of that comparison). The student copy
    is executed here."""
    cells = nbformat.read(solution, as_version=4).cells
    unchecked = [c.source[:40] for c in cells if CHECK_CALL.search(c.source) and c.cell_type == "code"
                 and "nbval-ignore-output" in c.metadata.get("tags", [])]
    assert not unchecked, f"check cells nbval does not compare: {unchecked}"
    solved, stubbed = verdicts(solution, execute=False), verdicts(student_path(solution))
    assert solved.keys() == stubbed.keys() and len(solved) >= 3
    for task_id in solved:
        assert solved[task_id].startswith(f"PASS Task {task_id}: "), solved[task_id]
        assert stubbed[task_id].startswith(f"TODO Task {task_id}: "), stubbed[task_id]


def test_strip_solutions_replaces_each_region_at_its_indentation():
    source = "def f(x):\n    # BEGIN SOLUTION Task 3.2\n    y = x\n    return y\n    # END SOLUTION\n\nf(1)"
    assert strip_solutions(source) == 'def f(x):\n    raise NotImplementedError("Task 3.2")\n\nf(1)'
    assert strip_solutions("a = 1") == "a = 1"


@pytest.mark.parametrize("source, problem", [
    ("# BEGIN SOLUTION Task 1.1\nx = 1", "has no END SOLUTION"),
    ("x = 1\n# END SOLUTION", "END SOLUTION without a BEGIN"),
    ("# BEGIN SOLUTION Task 1.1\n# BEGIN SOLUTION Task 1.2\n# END SOLUTION", "inside Task 1.1"),
])
def test_malformed_markers_are_refused(source, problem):
    with pytest.raises(ValueError, match=problem):
        strip_solutions(source)


def test_a_book_lab_page_is_the_student_copy_with_a_preamble_and_not_executed():
    from make_student_labs import book_notebook, student_notebook

    solution = SOLUTIONS[0]
    page, student = book_notebook(solution), student_notebook(solution)
    assert page.metadata["mystnb"] == {"execution_mode": "off"}
    assert page.cells[0].source.startswith("# Lab ")
    preamble = page.cells[1].source
    assert "make lab" in preamble and f"exercises/{solution.name}" in preamble
    assert f"exercises/solutions/{solution.name}" in preamble and "**Task " in preamble
    code = [c.source for c in page.cells if c.cell_type == "code"]
    assert code == [c.source for c in student.cells if c.cell_type == "code"]
    assert all(not c.outputs for c in page.cells if c.cell_type == "code")
