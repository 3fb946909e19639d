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
    wanted = sorted(str(p.relative_to(ROOT)) for p in [*tool.CHAPTERS.glob("*.ipynb"), *tool.SOLUTIONS.glob("lab*")])
    assert timed == wanted, "the times are not for every chapter and lab: run `python tools/time_notebooks.py`"
    assert tool.page_table(tool.PAGE) == tool.render(results), (
        "book/instructors.md's table is not the JSON's: run `python tools/time_notebooks.py --page-only`")


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
