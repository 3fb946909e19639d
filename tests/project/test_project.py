"""The project's own files: dependency lists agree, the README's commands are the ones CI runs."""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _normalise(spec: str) -> str:
    return spec.replace(" ", "").lower().replace("_", "-")


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["course"] + extras["book"] + extras["dev"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = [s for s in pip_section if not s.startswith("-e")]
    assert sorted(map(_normalise, listed)) == sorted(map(_normalise, wanted))
    assert "-e ." in pip_section, "environment.yml must install the package itself"


def test_readme_shows_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make book" in readme and "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_makefile_installs_the_cpu_torch_by_default():
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_SPEC ?= torch==2.13.0" in makefile


def _time_notebooks():
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import time_notebooks

    return time_notebooks


def test_the_instructors_page_shows_the_times_the_tool_measured():
    """The table in book/instructors.md is the one tools/time_notebooks.py renders from its JSON, for every
    chapter and lab (run `python tools/time_notebooks.py` after adding or changing one)."""
    import json

    tool = _time_notebooks()
    assert tool.OUT.exists(), f"{tool.OUT.relative_to(ROOT)} is missing: run `python tools/time_notebooks.py`"
    results = json.loads(tool.OUT.read_text())
    timed = sorted(row["notebook"] for row in results["rows"])
    wanted = sorted(str(p.relative_to(ROOT)) for p in [*tool.CHAPTERS.glob("*.ipynb"), *tool.lab_solutions()])
    assert timed == wanted, "the times are not for every chapter and lab: run `python tools/time_notebooks.py`"
    assert tool.page_table(tool.PAGE) == tool.render(results), (
        "book/instructors.md's table is not the JSON's: run `python tools/time_notebooks.py --page-only`")
    assert tool.page_table(tool.PAGE, tool.TASKS_BEGIN, tool.TASKS_END) == tool.render_tasks(results), (
        "book/instructors.md's table of tasks is not the JSON's: run `python tools/time_notebooks.py --page-only`")


def test_the_timed_tasks_are_the_labs_tasks():
    """Each lab's row lists the tasks its solution has now, with their kind (run the tool on a lab after changing
    its tasks: `python tools/time_notebooks.py exercises/solutions/labNN_*.ipynb`)."""
    import json

    import nbformat

    tool = _time_notebooks()
    for row in json.loads(tool.OUT.read_text())["rows"]:
        if row["kind"] == "lab":
            sections = tool.task_sections(nbformat.read(ROOT / row["notebook"], as_version=4))
            assert {task: t["kind"] for task, t in row["task_rows"].items()} == {
                task: s["kind"] for task, s in sections.items()}, f"{row['notebook']}: timed before its tasks changed"


def test_the_times_table_changes_with_the_times():
    tool = _time_notebooks()
    row = {"notebook": "book/chapters/01_x.ipynb", "kind": "chapter", "seconds": {"median": 12, "min": 11, "max": 14},
           "words": 3000, "code_cells": 20, "tasks": 0}
    results = {"machine": {"cores": 2, "cpu": "cpu", "python": "3", "torch": "2", "cuda": None},
               "config": {"repeat": 3}, "rows": [row], "headline": {"chapters_seconds": 12, "labs_seconds": 0}}
    table = tool.render(results)
    assert "| 12 [11, 14] |" in table and "Not measured" in tool.render(None)
    row["seconds"] = {"median": 30, "min": 29, "max": 31}
    assert tool.render(results) != table


def test_the_tasks_table_says_what_each_task_is_and_changes_with_its_answer():
    tool = _time_notebooks()
    task = {"title": "fetches that do not hide", "kind": "diagnose", "words": 300, "solution_lines": 10,
            "seconds": {"median": 0.5, "min": 0.4, "max": 0.9}}
    row = {"notebook": "exercises/solutions/lab08_x.ipynb", "kind": "lab", "seconds": {"median": 5, "min": 5, "max": 6},
           "words": 3000, "code_cells": 20, "tasks": 1, "task_rows": {"8.4": task}}
    results = {"machine": {"cores": 2, "cpu": "cpu", "python": "3", "torch": "2", "cuda": None},
               "config": {"repeat": 3}, "rows": [row], "headline": {"chapters_seconds": 0, "labs_seconds": 5}}
    table = tool.render_tasks(results)
    assert "| 8.4 | fetches that do not hide | diagnose | 0.5 [0.4, 0.9] | 10 | 32 |" in table, table
    assert "1 diagnose" in table and "estimate" in table
    task["solution_lines"] = 20
    assert "| 20 | 52 |" in tool.render_tasks(results)
    assert f"{tool.estimate_minutes(row)['working']:.0f}" == "52"
