"""The book prints the runtime's source as it is today: every `inspect.getsource` cell's stored output matches."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "notebook_sources.py"


def check(*notebooks: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--check", *map(str, notebooks)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})


def test_every_printed_source_is_the_current_one():
    result = check(*sorted([*ROOT.glob("book/chapters/*.ipynb"), *ROOT.glob("exercises/solutions/*.ipynb")]))
    assert result.returncode == 0, (result.stdout + result.stderr
                                    + "\nrefresh them with: .venv/bin/python tools/notebook_sources.py NOTEBOOK...")


def test_a_stale_source_is_caught(tmp_path):
    chapter = ROOT / "book/chapters/04_optimizer_offload.ipynb"
    nb = json.loads(chapter.read_text())
    cell = next(c for c in nb["cells"] if "getsource(GradientPath.add_pending)" in "".join(c["source"]))
    cell["outputs"][0]["text"] = ["    def _add_pending(self, slot):  # yesterday's code\n"]
    stale = tmp_path / chapter.name
    stale.write_text(json.dumps(nb))
    result = check(stale)
    assert result.returncode == 1 and "getsource(GradientPath.add_pending)" in result.stdout, result.stdout
