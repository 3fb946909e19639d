"""Time each chapter and lab solution on this machine, and write the table of `book/instructors.md` from it.

Each notebook is executed with nbclient, in its own folder, by the `python3` kernel of the environment the tests
use (the Makefile's NUMBA_CACHE_DIR, JUPYTER_PLATFORM_DIRS and PYDEVD_DISABLE_FILE_VALIDATION), `--repeat`
times in interleaved rounds (A B C A B C ...). A time is the wall clock from starting the kernel to shutting it
down: what a reader waits for after "Restart and run all". The results go to `bench/results/notebook_times.json`
in the benchmarks' format (machine, config, rows with median/min/max, headline), and the tool rewrites the
table between the `% notebook-times: begin` and `% notebook-times: end` lines of `book/instructors.md` from that
file, so the page's figures have one source. `--page-only` rewrites the table from the JSON without executing.

For the labs it also times each task: the execution time of the cells from a task's heading to the next heading of
its level (its statement, example, solution and check cell), from the timestamps the kernel records, and writes a
second table (between `% task-times: begin` and `% task-times: end`) that says which tasks build and which
diagnose. It is not a benchmark of the runtime (bench/ does that), and its reading and working times are estimates,
derived from word counts and the solutions' lines of code by the rates below, and labelled as estimates on the page.

Usage: python tools/time_notebooks.py [--repeat 3] [NOTEBOOK ...]   (default: every chapter and lab solution;
       named notebooks are measured again and the other rows of the JSON kept)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))
from common import interleaved, machine, positive, run, stats  # noqa: E402
from make_student_labs import BEGIN as SOLUTION_BEGIN  # noqa: E402
from make_student_labs import END as SOLUTION_END  # noqa: E402
from make_student_labs import TASK_HEADING  # noqa: E402

CHAPTERS = ROOT / "book" / "chapters"
SOLUTIONS = ROOT / "exercises" / "solutions"
OUT = ROOT / "bench" / "results" / "notebook_times.json"
PAGE = ROOT / "book" / "instructors.md"
BEGIN, END = "% notebook-times: begin", "% notebook-times: end"
TASKS_BEGIN, TASKS_END = "% task-times: begin", "% task-times: end"
ENV = {"NUMBA_CACHE_DIR": str(ROOT / ".cache" / "numba"), "JUPYTER_PLATFORM_DIRS": "1",
       "PYDEVD_DISABLE_FILE_VALIDATION": "1"}  # as the Makefile exports them for nbval

# The estimates' rates (assumptions, printed on the page next to the estimates).
WORDS_PER_MINUTE = 150  # careful reading of technical prose with equations, figures and tables
MINUTES_PER_CODE_CELL = 0.5  # reading a code cell and its output
MINUTES_PER_SOLUTION_LINE = 2  # writing one line of a task's answer, with the thinking it takes
MINUTES_PER_CHECK_ROUND = 10  # running a task's check, reading a FAIL and fixing it, once

CHECK_CALL = re.compile(r'check\.task\("((?:\d+|C)\.\d+)"')  # labs' tasks N.M, the capstone's C.M


def lab_solutions() -> list[Path]:
    """The lab solutions in the order a learner meets them: Labs 1 to 11, then the capstone."""
    return sorted(SOLUTIONS.glob("lab*.ipynb")) + sorted(SOLUTIONS.glob("capstone_*.ipynb"))


def task_order(task: str) -> tuple[float, int]:
    """Sort key of a task id: by lab, the capstone's (C.M) last."""
    lab, number = task.split(".")
    return (float("inf") if lab == "C" else int(lab), int(number))


def counts(path: Path) -> dict:
    """What a reader has to get through: words of prose, code cells, and (labs) graded tasks."""
    nb = nbformat.read(path, as_version=4)
    words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    code = [c for c in nb.cells if c.cell_type == "code"]
    tasks = {task for c in code for task in CHECK_CALL.findall(c.source)}
    return {"words": words, "code_cells": len(code), "tasks": len(tasks)}


def task_sections(nb) -> dict[str, dict]:
    """{task id: its title, kind, the indices of its cells, its statement's words and its answer's lines of code}.

    A task's cells run from its heading to the next heading of the same or a higher level. Its kind: "diagnose"
    when the heading says "(diagnosis)", else "build" ("build, optional" when it says "(optional)")."""
    sections, current = {}, None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            if current is not None:
                current["cells"].append(index)
            continue
        for chunk in re.split(r"(?m)^(?=#{1,3}\s)", cell.source):  # a heading may sit inside a cell
            heading = re.match(r"(#{1,3})\s", chunk)
            found = TASK_HEADING.match(chunk.splitlines()[0]) if heading else None
            if found:
                title = found["title"].strip(" :")
                kind = ("diagnose" if "(diagnosis)" in title else
                        "build, optional" if "(optional)" in title else "build")
                current = sections[found["task"]] = {
                    "title": re.sub(r"^\((diagnosis|optional)\):?\s*", "", title), "kind": kind,
                    "level": len(heading[1]), "cells": [], "words": 0, "solution_lines": 0}
            elif heading and current and len(heading[1]) <= current["level"]:
                current = None
            if current is not None:
                if index not in current["cells"]:
                    current["cells"].append(index)
                current["words"] += len(chunk.split())
    for cell in nb.cells:  # the answers' lines, wherever their cells sit
        inside = None
        for line in cell.source.splitlines() if cell.cell_type == "code" else ():
            begin = SOLUTION_BEGIN.match(line)
            if begin:
                inside = begin["task"]
            elif SOLUTION_END.match(line):
                inside = None
            elif inside in sections and line.strip() and not line.strip().startswith("#"):
                sections[inside]["solution_lines"] += 1
    return sections


def _cell_seconds(cell) -> float:
    """How long a code cell ran, from the timestamps the kernel recorded in its metadata (0 for markdown)."""
    from datetime import datetime

    stamps = cell.metadata.get("execution", {})
    if "iopub.execute_input" not in stamps or "shell.execute_reply" not in stamps:
        return 0.0
    start, end = (datetime.fromisoformat(stamps[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - start).total_seconds()


def execute(path: Path, timeout: int) -> dict:
    """Execute one notebook in its folder (outputs discarded): its wall time in seconds, and each task's."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    tasks = {task: sum(_cell_seconds(nb.cells[i]) for i in section["cells"])
             for task, section in task_sections(nb).items()}
    return {"seconds": seconds, "tasks": tasks}


def kind(path: Path) -> str:
    return "lab" if path.resolve().is_relative_to(SOLUTIONS) else "chapter"


def task_minutes(task: dict) -> float:
    """A learner's time on one task (an estimate): its statement read, its answer written, one round of fixing."""
    return (task["words"] / WORDS_PER_MINUTE + task["solution_lines"] * MINUTES_PER_SOLUTION_LINE
            + MINUTES_PER_CHECK_ROUND)


def estimate_minutes(row: dict) -> dict:
    reading = row["words"] / WORDS_PER_MINUTE + row["code_cells"] * MINUTES_PER_CODE_CELL
    working = sum(task_minutes(t) for t in row.get("task_rows", {}).values()) if row["kind"] == "lab" else 0.0
    return {"reading": reading, "working": working}


def render(results: dict | None) -> str:
    """The page's table (Markdown) for a results dict as the tool writes it, or what to run when there is none."""
    if results is None:
        return (f"Not measured yet: run `python tools/time_notebooks.py` (it writes "
                f"`{OUT.relative_to(ROOT)}` and this table).")
    m, config = results["machine"], results["config"]
    lines = [
        f"Measured on {m['cores']} cores ({m['cpu']}), Python {m['python']}, torch {m['torch']}, "
        f"{'CUDA device ' + m['cuda'] if m['cuda'] else 'no GPU (the simulated device)'}: each notebook executed "
        f"{'once' if config['repeat'] == 1 else str(config['repeat']) + ' times'} from a fresh kernel; seconds as "
        f"median [min, max].",
        "",
        "| notebook | executes in (s) | reading (estimate, min) | working on the tasks (estimate, min) |",
        "| --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        est, sec = estimate_minutes(row), row["seconds"]
        work = f"{est['working']:.0f} ({row['tasks']} tasks)" if row["kind"] == "lab" else ""
        lines.append(f"| `{row['notebook']}` | {sec['median']:.0f} [{sec['min']:.0f}, {sec['max']:.0f}] "
                     f"| {est['reading']:.0f} | {work} |")
    head = results["headline"]
    lines += [
        "",
        f"In all: the chapters execute in {head['chapters_seconds']:.0f} s and the lab solutions in "
        f"{head['labs_seconds']:.0f} s (sums of medians). The estimates are not measurements: reading is "
        f"{WORDS_PER_MINUTE} words of prose a minute plus {MINUTES_PER_CODE_CELL} min per code cell; "
        f"working is the sum of the lab's tasks' estimates in the table below.",
    ]
    return "\n".join(lines)


def render_tasks(results: dict | None) -> str:
    """The page's table of tasks: what each asks, whether it builds or diagnoses, how long its solution's cells
    ran, and the estimate of a learner's time on it."""
    if results is None:
        return "Not measured yet: run `python tools/time_notebooks.py`."
    lines = ["| task | what it asks | kind | its cells execute in (s) | answer (lines of code) | "
             "learner's time (estimate, min) |", "| --- | --- | --- | --- | --- | --- |"]
    for row in results["rows"]:
        for task, t in sorted(row.get("task_rows", {}).items(), key=lambda kv: task_order(kv[0])):
            sec = t["seconds"]
            lines.append(f"| {task} | {t['title']} | {t['kind']} | {sec['median']:.1f} [{sec['min']:.1f}, "
                         f"{sec['max']:.1f}] | {t['solution_lines']} | {task_minutes(t):.0f} |")
    kinds = [t["kind"] for row in results["rows"] for t in row.get("task_rows", {}).values()]
    lines += ["", f"{len(kinds)} tasks: {kinds.count('build') + kinds.count('build, optional')} build a piece "
              f"({kinds.count('build, optional')} of them optional), {kinds.count('diagnose')} diagnose a run that "
              "went wrong. A task's cells are its statement, example, solution and check, timed from the "
              "timestamps the kernel records (median [min, max] of the runs above). The learner's time is an "
              "estimate, not a measurement (no class has been timed yet): the statement read at "
              f"{WORDS_PER_MINUTE} words a minute, {MINUTES_PER_SOLUTION_LINE} min per line of the reference "
              f"answer's code, and {MINUTES_PER_CHECK_ROUND} min for one round of reading a FAIL and fixing it."]
    return "\n".join(lines)


def rewrite_page(page: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    text = page.read_text()
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{page}: needs one '{begin}' line and one '{end}' line after it, around the table")
    before, rest = text.split(begin, 1)
    _, after = rest.split(end, 1)
    page.write_text(f"{before}{begin}\n{table}\n{end}{after}")


def page_table(page: Path, begin: str = BEGIN, end: str = END) -> str:
    """The table currently between the markers of `page` (what a test compares with `render`)."""
    text = page.read_text()
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def measure(notebooks: list[Path], repeat: int, timeout: int) -> dict:
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    names = {str(p.resolve().relative_to(ROOT)): p for p in notebooks}
    runs = interleaved({name: (lambda p=p: execute(p, timeout)) for name, p in names.items()},
                       rounds=repeat, warmup=0)
    rows = []
    for name, path in names.items():
        row = {"notebook": name, "kind": kind(path), "seconds": stats([r["seconds"] for r in runs[name]]),
               **counts(path)}
        if row["kind"] == "lab":
            sections = task_sections(nbformat.read(path, as_version=4))
            row["task_rows"] = {task: {**{k: v for k, v in section.items() if k not in ("cells", "level")},
                                       "seconds": stats([r["tasks"][task] for r in runs[name]])}
                                for task, section in sections.items()}
        rows.append(row)
    return {"machine": machine(), "config": {"repeat": repeat, "timeout": timeout, "kernel": "python3", "env": ENV},
            "rows": rows, "headline": headline(rows)}


def headline(rows: list[dict]) -> dict:
    return {f"{k}s_seconds": sum(r["seconds"]["median"] for r in rows if r["kind"] == k) for k in ("chapter", "lab")}


def merged(old: dict, new: dict) -> dict:
    """`old` with the rows `new` measured again put in their place (in the order of notebooks on disk)."""
    rows = {r["notebook"]: r for r in old["rows"]} | {r["notebook"]: r for r in new["rows"]}
    rows = [rows[name] for name in sorted(rows, key=lambda n: (not n.startswith("book"), "capstone" in n, n))]
    return {**new, "rows": rows, "headline": headline(rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="default: book/chapters/*.ipynb, the lab solutions and the capstone's")
    parser.add_argument("--repeat", type=positive(int), default=3, help="runs of each notebook (default 3)")
    parser.add_argument("--timeout", type=positive(int), default=600, help="seconds per cell (default 600)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    parser.add_argument("--page", type=Path, default=PAGE, help=f"default {PAGE.relative_to(ROOT)}")
    parser.add_argument("--page-only", action="store_true", help="rewrite the page's table from --out, run nothing")
    args = parser.parse_args()
    if not args.page_only:
        notebooks = args.notebooks or sorted(CHAPTERS.glob("*.ipynb")) + lab_solutions()
        missing = [str(p) for p in notebooks if not p.is_file()]
        if missing:
            raise ValueError(f"no such notebook: {', '.join(missing)}")
        results = measure(notebooks, args.repeat, args.timeout)
        if args.notebooks and args.out.exists():
            results = merged(json.loads(args.out.read_text()), results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    results = json.loads(args.out.read_text()) if args.out.exists() else None
    rewrite_page(args.page, render(results))
    rewrite_page(args.page, render_tasks(results), TASKS_BEGIN, TASKS_END)
    print(f"wrote the tables in {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
