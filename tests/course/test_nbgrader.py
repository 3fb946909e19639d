"""The labs on nbgrader: a lab exported by tools/export_nbgrader.py goes through nbgrader's generate_assignment and
autograde; a submission with one planted wrong answer scores every task but that one, and the student's feedback
is the verdict line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from export_nbgrader import convert, export, grade_id  # noqa: E402

LAB = ROOT / "exercises" / "solutions" / "lab01_memory.ipynb"
PLANTED = "1.3"  # the largest model a GPU holds, answered as if every placement cost 16 B/param
WRONG_ANSWER = '    return hw.device_memory / 16, "params"'


def nbgrader(course: Path, *args: str) -> None:
    # nbgrader runs alembic's command to make its gradebook: the environment's scripts must be on the PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_the_export_marks_each_answer_and_each_check():
    nb = convert(LAB)
    marked = [c.metadata["nbgrader"] for c in nb.cells if "nbgrader" in c.metadata]
    tasks = sorted(set(re.findall(r'check\.task\("(\d+\.\d+)"', LAB.read_text().replace('\\"', '"'))))
    assert [m["grade_id"] for m in marked if m["grade"]] == [grade_id(t) for t in tasks]
    assert [m["grade_id"] for m in marked if m["solution"]] == [f"{grade_id(t)}-answer" for t in tasks]
    assert all(m["points"] == 1 and m["locked"] for m in marked if m["grade"])
    assert not any("check.task(" in c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
def test_generate_and_autograde_score_a_planted_mistake(tmp_path):
    course = tmp_path / "course"
    (assignment,) = export(course, [LAB])
    nbgrader(course, "generate_assignment", assignment, "--force")
    released = nbformat.read(course / "release" / assignment / LAB.name, as_version=4)
    assert "BEGIN SOLUTION" not in "".join(c.source for c in released.cells)  # nbgrader stripped the answers

    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in convert(LAB).cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    for cell in released.cells:  # a student who answered every task, one of them wrongly
        name = cell.metadata.get("nbgrader", {}).get("grade_id")
        if name in answers:
            cell.source = answers[name]
            if name == f"{grade_id(PLANTED)}-answer":
                cell.source = re.sub(r"(# BEGIN SOLUTION Task [\d.]+\n).*?(\n\s*# END SOLUTION)",
                                     lambda m: m[1] + WRONG_ANSWER + m[2], cell.source, flags=re.DOTALL)
    submitted = course / "submitted" / "alice" / assignment
    submitted.mkdir(parents=True)
    nbformat.write(released, submitted / LAB.name)
    nbgrader(course, "autograde", assignment, "--create")

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        submission = gradebook.find_submission(assignment, "alice")
        scores = {g.name: g.score for nb in submission.notebooks for g in nb.grades}
        total, most = submission.score, submission.max_score
    assert scores[grade_id(PLANTED)] == 0 and most == len(scores) >= 5
    assert total == most - 1, scores
    graded = nbformat.read(course / "autograded" / "alice" / assignment / LAB.name, as_version=4)
    feedback = {c.metadata["nbgrader"]["grade_id"]: "".join(o.get("text", "") for o in c.outputs)
                for c in graded.cells if c.metadata.get("nbgrader", {}).get("grade")}
    assert feedback[grade_id(PLANTED)].startswith(f"FAIL Task {PLANTED}: ")
    assert all(line.startswith("PASS Task ") for name, line in feedback.items() if name != grade_id(PLANTED))
