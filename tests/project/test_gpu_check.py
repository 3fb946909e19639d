"""bench/gpu_check.py: the plan a GPU machine will run, checked on this one (a dry run), and how it brings torchao
(the machine's own, a carried wheel, or none) with fake wheels built here: no network, no real torchao."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_only_files_with_gpu_tests_are_collected():
    files = gpu_check.gpu_test_files()
    assert "tests/devices/test_device.py" in files and "tests/engine/test_hybrid.py" in files
    # these import packages a GPU machine's image lacks (nbformat, bs4): never collected there
    assert "tests/course/test_labs.py" not in files and "tests/book/test_book_html.py" not in files


def test_the_plan_fits_the_budget_and_runs_only_gpu_benchmarks():
    steps = gpu_check.plan(cuda=True)
    assert sum(limit for _, _, limit in steps) + gpu_check.TORCHAO_LIMIT_S == gpu_check.budget_s() <= gpu_check.BUDGET_S
    assert gpu_check.BUDGET_S <= 7 * 60
    names = [name for name, _, _ in steps]
    assert names[:3] == ["gpu tests", "sharded train (NCCL)", "doctor"]  # correctness first, then the benchmarks
    benches = {Path(argv[1]).stem: argv for name, argv, _ in steps if name not in names[:3]}
    assert list(benches) == list(gpu_check.BENCHES) and "adam" not in benches and "step_model" not in benches
    for name, argv in benches.items():
        assert "--quick" in argv
        if name in gpu_check.TAKES_DEVICE:
            assert argv[argv.index("--device") + 1] == "cuda"
        else:
            assert "--device" not in argv
    sharded = next(argv for name, argv, _ in steps if name == "sharded train (NCCL)")
    assert "torch.distributed.run" in sharded and "--shard" in sharded
    assert sharded[sharded.index("--device") + 1] == "cuda"
    tests = steps[0][1]
    assert f"faulthandler_timeout={gpu_check.FAULTHANDLER_S}" in tests
    assert gpu_check.FAULTHANDLER_S < gpu_check.TEST_LIMIT_S


def test_no_tests_collected_fails_on_a_gpu_only():
    row = {"step": "gpu tests", "exit": 5}
    assert gpu_check.step_failed(row, cuda=True) and not gpu_check.step_failed(row, cuda=False)
    assert not gpu_check.step_failed({"step": "hybrid", "exit": "skipped: needs CUDA"}, cuda=False)
    assert gpu_check.step_failed({"step": "doctor", "exit": "timeout"}, cuda=False)


def test_every_feature_of_chapters_2_to_12_has_a_cuda_test_or_run():
    covered = gpu_check.coverage(gpu_check.collected_gpu_tests())
    assert sorted(covered) == list(range(2, 13))
    missing = [(chapter, feature) for chapter, features in covered.items() for feature, target in features.items()
               if target is None]
    assert not missing
    # a target that names no test is caught, not taken as covered
    assert gpu_check.coverage([])[7]["every activation policy, dropout, a pool, GPU lagging"] is None


@pytest.mark.slow
def test_a_dry_run_writes_two_files_and_decodes_a_timeout(tmp_path):
    out, no_wheels = tmp_path / "out", tmp_path / "no_wheels"
    no_wheels.mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--wheel-dir",
                             str(no_wheels)], cwd=ROOT, capture_output=True, text=True,
                            env={"OUT": str(out), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    report = json.loads((out / "gpu_check.json").read_text())
    torchao = report["torchao"]
    assert f"torchao: {torchao['status']}" in result.stdout
    # this venv may or may not have torchao; with no wheel offered, it is never "installed from wheel"
    assert torchao["status"] in ("found", "missing")
    if torchao["status"] == "missing":
        assert "make wheels" in torchao["reason"] and torchao["wheel"] is None
    assert {row["step"] for row in report["steps"]} == {"gpu tests", "doctor", *gpu_check.BENCHES}
    assert next(r for r in report["steps"] if r["step"] == "doctor")["exit"] == 0
    row = gpu_check.run_step("sleeper", [sys.executable, "-c", "print('started', flush=True); "
                                         "import time; time.sleep(30)"], limit_s=2)
    assert row["exit"] == "timeout" and "b'" not in row["output"] and "started" in row["output"]


def fake_torchao_wheel(folder: Path, version: str, init_body: str = "",
                       optim_module: str = "torchao/optim/__init__.py") -> Path:
    """A minimal installable wheel named torchao: enough for pip and for the probe's import, nothing of torchao."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"torchao-{version}-py3-none-any.whl"
    info = f"torchao-{version}.dist-info"
    files = {
        "torchao/__init__.py": f"__version__ = {version!r}\n{init_body}\n",
        optim_module: "class CPUOffloadOptimizer:\n    pass\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torchao\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def without_machine_torchao(monkeypatch):
    """The machine's python lacks torchao (whatever this venv holds); probes of an installed folder stay real."""
    real_probe = gpu_check.probe_torchao

    def probe(extra_path, timeout_s):
        if extra_path is None:
            return {"ok": False, "error": "ModuleNotFoundError: No module named 'torchao'"}
        return real_probe(extra_path, timeout_s)

    monkeypatch.setattr(gpu_check, "probe_torchao", probe)


def test_the_machines_own_torchao_is_used_and_no_wheel_is_installed(tmp_path, monkeypatch):
    fake_torchao_wheel(tmp_path / "wheels", "0.17.0")
    monkeypatch.setattr(gpu_check, "probe_torchao",
                        lambda extra_path, timeout_s: {"ok": True, "version": "0.12.0", "import_path": "torchao.optim"})
    monkeypatch.setattr(gpu_check, "install_wheel", lambda *args: pytest.fail("installed over a working torchao"))
    report, bench_path = gpu_check.setup_torchao(tmp_path / "wheels", str(tmp_path / "target"))
    assert report["status"] == "found" and report["version"] == "0.12.0" and report["wheel"] is None
    assert bench_path is None


def test_without_torchao_or_a_wheel_it_is_missing_and_says_how_to_bring_one(tmp_path, monkeypatch):
    without_machine_torchao(monkeypatch)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "numpy-2.0.0-py3-none-any.whl").write_bytes(b"not torchao")
    report, bench_path = gpu_check.setup_torchao(tmp_path / "wheels", str(tmp_path / "target"))
    assert report["status"] == "missing" and bench_path is None
    assert "No module named 'torchao'" in report["reason"] and "make wheels" in report["reason"]


def test_the_newest_wheel_is_installed_offline_into_a_private_folder(tmp_path, monkeypatch):
    without_machine_torchao(monkeypatch)
    # 0.9.0 would fail to import: picking it by string order ("0.9" > "0.17") would show here
    fake_torchao_wheel(tmp_path / "wheels", "0.9.0", init_body="raise RuntimeError('the old one')")
    fake_torchao_wheel(tmp_path / "wheels", "0.17.0")
    target = tmp_path / "target"
    report, bench_path = gpu_check.setup_torchao(tmp_path / "wheels", str(target))
    assert report["status"] == "installed from wheel", report
    assert (report["version"], report["import_path"]) == ("0.17.0", "torchao.optim")
    assert report["wheel"] == "torchao-0.17.0-py3-none-any.whl" and report["reason"] is None
    assert bench_path == str(target) and (target / "torchao" / "optim" / "__init__.py").exists()


def test_an_older_torchao_is_found_at_its_prototype_import_path(tmp_path):
    wheel = fake_torchao_wheel(tmp_path / "wheels", "0.7.0",
                               optim_module="torchao/prototype/low_bit_optim/__init__.py")
    assert gpu_check.install_wheel(wheel, str(tmp_path / "target"), timeout_s=60) is None
    probe = gpu_check.probe_torchao(str(tmp_path / "target"), timeout_s=60)
    assert probe == {"ok": True, "version": "0.7.0", "import_path": "torchao.prototype.low_bit_optim"}


def test_a_wheel_that_does_not_import_with_this_torch_is_recorded_and_left_off_the_path(tmp_path, monkeypatch):
    without_machine_torchao(monkeypatch)
    fake_torchao_wheel(tmp_path / "wheels", "0.17.0", init_body="raise RuntimeError('built for torch 2.11')")
    report, bench_path = gpu_check.setup_torchao(tmp_path / "wheels", str(tmp_path / "target"))
    assert report["status"] == "missing" and bench_path is None
    assert report["wheel"] == "torchao-0.17.0-py3-none-any.whl"
    assert "does not import" in report["reason"] and "built for torch 2.11" in report["reason"]


def test_a_wheel_pip_cannot_install_is_recorded(tmp_path, monkeypatch):
    without_machine_torchao(monkeypatch)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torchao-0.17.0-py3-none-any.whl").write_bytes(b"truncated download")
    report, bench_path = gpu_check.setup_torchao(tmp_path / "wheels", str(tmp_path / "target"))
    assert report["status"] == "missing" and bench_path is None
    assert report["reason"].startswith("torchao-0.17.0-py3-none-any.whl: pip install failed")


def test_only_the_benchmark_steps_see_the_installed_torchao(tmp_path, monkeypatch):
    show_path = [sys.executable, "-c", "import os; print('path=' + os.environ['PYTHONPATH'])"]
    bench = next(iter(gpu_check.BENCHES))
    private = str(tmp_path / "private_torchao")
    monkeypatch.setattr(gpu_check, "machine", lambda: {"cuda_available": True})
    monkeypatch.setattr(gpu_check, "plan", lambda cuda: [("doctor", show_path, 30), (bench, show_path, 30)])
    monkeypatch.setattr(gpu_check, "setup_torchao", lambda wheel_dir, target: (
        {"status": "installed from wheel", "version": "0.17.0", "import_path": "torchao.optim",
         "wheel": "torchao-0.17.0-py3-none-any.whl", "reason": None}, private))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    assert gpu_check.main() == 0
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    doctor_part, bench_part = log.split(f"===== {bench}:")
    assert private in bench_part and private not in doctor_part.split("===== doctor:")[1]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["torchao"]["status"] == "installed from wheel"
    assert os.pathsep.join([str(ROOT), private]) in bench_part
