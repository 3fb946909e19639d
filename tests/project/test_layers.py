"""The layer contracts (.importlinter) hold, catch a violation, and no module imports another in a cycle."""

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True, timeout=300)


def test_the_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, bad_import, contract", [
    ("layout", "from . import course", "The runtime never imports the course"),
    ("engine/optimizer", "from ..devices import sim", "The engine imports no device backend"),
    ("engine/gradients", "from ..nvme import swapper", "The engine imports no device backend"),
    ("engine/weights", "from ..model import gpt", "The engine imports no device backend"),
    ("trace", "from .predict import memory", "Layers:"),
    ("predict/memory", "from ..engine import optimizer", "Layers:"),
])
def test_a_violation_breaks_its_contract(tmp_path, module, bad_import, contract):
    shutil.copytree(ROOT / "minioffload", tmp_path / "minioffload", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    with open(tmp_path / "minioffload" / f"{module}.py", "a") as f:
        f.write(f"\n{bad_import}  # noqa\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    # "NAME BROKEN", or "NAME BROKEN (1 ignored import)" for a contract with an exception
    broken = [line for line in result.stdout.splitlines() if "BROKEN" in line.split()]
    assert any(line.startswith(contract) for line in broken), result.stdout  # names fit one line: keep them short


def test_a_new_module_must_be_given_a_layer(tmp_path):
    shutil.copytree(ROOT / "minioffload", tmp_path / "minioffload", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    (tmp_path / "minioffload" / "newcomer.py").write_text('"""A module no layer lists."""\n')
    result = lint(tmp_path)
    assert result.returncode != 0 and "newcomer" in result.stdout


def test_no_module_imports_another_in_a_cycle():
    graph = grimp.build_graph("minioffload")
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != module and graph.chain_exists(importer=imported, imported=module):
                cycles.append(f"{module} -> {imported} -> ... -> {module}")
    assert not cycles, "\n".join(cycles)


def test_the_front_door_exports_the_runtime():
    code = ("import minioffload.devices, minioffload.train.loop\n"  # submodules first: device() unshadowed
            "from minioffload import Ledger, OffloadAdam, OffloadOptions, Swapper, TrainConfig, device\n"
            "assert callable(device) and device.__module__ == 'minioffload.devices'\n"
            "assert OffloadAdam.__name__ == 'OffloadAdam' and Swapper.__name__ == 'Swapper'\n"
            "import minioffload\n"
            "try:\n    minioffload.Nothing\nexcept AttributeError as err:\n    print(err)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "has no attribute 'Nothing'" in result.stdout


def test_the_top_level_shows_the_architecture():
    entries = [p.name for p in (ROOT / "minioffload").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 25, sorted(entries)
    packages = {p.name for p in (ROOT / "minioffload").iterdir() if (p / "__init__.py").is_file()}
    assert {"kernels", "devices", "nvme", "model", "predict", "machine", "engine", "train", "planner", "cli",
            "course"} <= packages


def test_the_engine_is_composed_not_inherited():
    """OffloadAdam is a torch Optimizer and nothing else; no module outside the engine reaches into its privates."""
    import re

    import torch

    from minioffload.engine.optimizer import OffloadAdam

    assert OffloadAdam.__bases__ == (torch.optim.Optimizer,)
    private = re.compile(r"\b(opt|optimizer|engine)\._[a-z]")
    outside = [p for p in (ROOT / "minioffload").rglob("*.py") if "engine" not in p.parts]
    reaching = [f"{p.relative_to(ROOT)}:{n}" for p in outside
                for n, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert not reaching, reaching
