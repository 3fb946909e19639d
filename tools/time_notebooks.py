"""Time each chapter and lab solution on this machine, and write the table of `book/instructors.md` from it.

Each notebook is executed with nbclient, in its own folder, by the `python3` kernel of the environment the tests
use (the Makefile's NUMBA_CACHE_DIR, JUPYTER_PLATFORM_DIRS and PYDEVD_DISABLE_FILE_VALIDATION), `--repeat`
times in interleaved rounds (A B C A B C ...). A time is the wall clock from starting the kernel to shutting it
down: what a reader waits for after "Restart and run all". The results go to `bench/results/notebook_times.json`
in the benchmarks' format (machine, config, rows with median/min/max, headline), and the tool rewrites the
table between the `% notebook-times: begin` and `% notebook-times: end` lines of `book/instructors.md` from that
file, so the page's figures have one source. `--page-only` rewrites the table from the JSON without executing.

It is not a benchmark of the runtime (bench/ does that), and its reading and working times are estimates, derived
from word and task counts by the rates below and labelled as estimates on the page.

Usage: python tools/time_notebooks.py [--repeat 3] [NOTEBOOK ...]   (default: every chapter and lab solution)
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
from common import interleaved, machine, positive, run, stats  # noqa: E402

CHAPTERS = ROOT / "book" / "chapters"
SOLUTIONS = ROOT / "exercises" / "solutions"
OUT = ROOT / "bench" / "results" / "notebook_times.json"
PAGE = ROOT / "book" / "instructors.md"
BEGIN, END = "% notebook-times: begin", "% notebook-times: end"
ENV = {"NUMBA_CACHE_DIR": str(ROOT / ".cache" / "numba"), "JUPYTER_PLATFORM_DIRS": "1",
       "PYDEVD_DISABLE_FILE_VALIDATION": "1"}  # as the Makefile exports them for nbval

# The estimates' rates (assumptions, printed on the page next to the estimates).
WORDS_PER_MINUTE = 150  # careful reading of technical prose with equations, figures and tables
MINUTES_PER_CODE_CELL = 0.5  # reading a code cell and its output
MINUTES_PER_TASK = 30  # writing one lab task, running its check and fixing it until it passes

CHECK_CALL = re.compile(r'check\.task\("(\d+\.\d+)"')


def counts(path: Path) -> dict:
    """What a reader has to get through: words of prose, code cells, and (labs) graded tasks."""
    nb = nbformat.read(path, as_version=4)
    words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    code = [c for c in nb.cells if c.cell_type == "code"]
    tasks = {task for c in code for task in CHECK_CALL.findall(c.source)}
    return {"words": words, "code_cells": len(code), "tasks": len(tasks)}


def execute(path: Path, timeout: int) -> dict:
    """Execute one notebook in its folder (outputs discarded) and return its wall time in seconds."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return {"seconds": time.perf_counter() - start}


def kind(path: Path) -> str:
    return "lab" if path.resolve().is_relative_to(SOLUTIONS) else "chapter"


def estimate_minutes(row: dict) -> dict:
    reading = row["words"] / WORDS_PER_MINUTE + row["code_cells"] * MINUTES_PER_CODE_CELL
    working = row["tasks"] * MINUTES_PER_TASK if row["kind"] == "lab" else 0.0
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
        f"working is {MINUTES_PER_TASK} min per graded task.",
    ]
    return "\n".join(lines)


def rewrite_page(page: Path, table: str) -> None:
    text = page.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{page}: needs one '{BEGIN}' line and one '{END}' line after it, around the table")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    page.write_text(f"{before}{BEGIN}\n{table}\n{END}{after}")


def page_table(page: Path) -> str:
    """The table currently between the markers of `page` (what a test compares with `render`)."""
    text = page.read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def measure(notebooks: list[Path], repeat: int, timeout: int) -> dict:
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    names = {str(p.resolve().relative_to(ROOT)): p for p in notebooks}
    runs = interleaved({name: (lambda p=p: execute(p, timeout)) for name, p in names.items()},
                       rounds=repeat, warmup=0)
    rows = [{"notebook": name, "kind": kind(path), "seconds": stats([r["seconds"] for r in runs[name]]),
             **counts(path)} for name, path in names.items()]
    headline = {f"{k}s_seconds": sum(r["seconds"]["median"] for r in rows if r["kind"] == k)
                for k in ("chapter", "lab")}
    return {"machine": machine(), "config": {"repeat": repeat, "timeout": timeout, "kernel": "python3", "env": ENV},
            "rows": rows, "headline": headline}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: book/chapters/*.ipynb and the lab solutions")
    parser.add_argument("--repeat", type=positive(int), default=3, help="runs of each notebook (default 3)")
    parser.add_argument("--timeout", type=positive(int), default=600, help="seconds per cell (default 600)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    parser.add_argument("--page", type=Path, default=PAGE, help=f"default {PAGE.relative_to(ROOT)}")
    parser.add_argument("--page-only", action="store_true", help="rewrite the page's table from --out, run nothing")
    args = parser.parse_args()
    if not args.page_only:
        notebooks = args.notebooks or sorted(CHAPTERS.glob("*.ipynb")) + sorted(SOLUTIONS.glob("lab*.ipynb"))
        missing = [str(p) for p in notebooks if not p.is_file()]
        if missing:
            raise ValueError(f"no such notebook: {', '.join(missing)}")
        results = measure(notebooks, args.repeat, args.timeout)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    results = json.loads(args.out.read_text()) if args.out.exists() else None
    rewrite_page(args.page, render(results))
    print(f"wrote the table in {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
