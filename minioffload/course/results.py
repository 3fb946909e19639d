"""The benchmarks' recorded results: bench/results/NAME.json of this repository, the measured figures a chapter
quotes (read, never typed). Found next to the package, so a notebook opened from any folder reads the same file.

What this is not: a benchmark (bench/NAME.py measures and writes these files) or a cache of a chapter's own runs.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def load(name: str) -> dict:
    """The recorded run of bench/NAME.py: {"machine", "config", "rows", "headline"}."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in RESULTS.glob("*.json"))) or "none"
        raise FileNotFoundError(f"{path} does not exist: run `python bench/{name}.py` to record it "
                                f"(recorded: {known})")
    return json.loads(path.read_text())
