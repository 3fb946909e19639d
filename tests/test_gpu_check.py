"""bench/gpu_check.py: the plan a GPU machine will run, checked on this one (a dry run)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_only_files_with_gpu_tests_are_collected():
    files = gpu_check.gpu_test_files()
    assert "tests/test_device.py" in files and "tests/test_hybrid.py" in files
    # these import packages a GPU machine's image lacks (nbformat, bs4): never collected there
    assert "tests/test_labs.py" not in files and "tests/test_book_html.py" not in files


def test_the_plan_fits_the_budget_and_runs_only_gpu_benchmarks():
    steps = gpu_check.plan(cuda=True)
    assert sum(limit for _, _, limit in steps) <= gpu_check.BUDGET_S
    runs = ("gpu tests", "doctor", "sharded train (NCCL)")
    benches = [Path(argv[1]).stem for name, argv, _ in steps if name not in runs]
    assert benches == list(gpu_check.BENCHES) and "adam" not in benches and "step_model" not in benches
    assert all("--quick" in argv for name, argv, _ in steps if name not in runs)
    sharded = next(argv for name, argv, _ in steps if name == "sharded train (NCCL)")
    assert "torch.distributed.run" in sharded and "--shard" in sharded
    assert sharded[sharded.index("--device") + 1] == "cuda"


def test_a_dry_run_writes_two_files_and_decodes_a_timeout(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {row["step"] for row in report["steps"]} == {"gpu tests", "doctor", *gpu_check.BENCHES}
    assert next(r for r in report["steps"] if r["step"] == "doctor")["exit"] == 0
    row = gpu_check.run_step("sleeper", [sys.executable, "-c", "print('started', flush=True); "
                                         "import time; time.sleep(30)"], limit_s=2)
    assert row["exit"] == "timeout" and "b'" not in row["output"] and "started" in row["output"]
