"""Everything that needs a GPU, in one go, within 7 minutes: the `gpu` tests (a CUDA test for every feature of
chapters 2-12, with the GPU kept busy so it lags the host as in training), `doctor` on the machine (CUDA seen,
locked-memory limit, host memory), a sharded run (`train --shard` under torchrun, NCCL, one rank per GPU) and the
GPU benchmarks in --quick mode.

    python bench/gpu_check.py            # on a CUDA machine; writes $OUT (or bench/results/gpu/)
    python bench/gpu_check.py --dry-run  # on a CPU machine: what it would run, what covers each chapter, the budget

The plan is refused before anything runs if its steps' time limits add up to more than the budget, or if a chapter's
feature has no CUDA test or run (FEATURES). On a GPU, pytest's "no tests collected" is a failure (the tests were
meant to run), and the tests run with a faulthandler timeout, so a deadlock prints every thread's stack.

It runs from a plain copy of the repository with the machine's own python (torch, CuPy, Numba, xxhash, pytest and
hypothesis present; the project need not be installed: PYTHONPATH points here). It writes exactly two files:
    gpu_check.json   the machine, every step (exit code, seconds, time limit) and the JSON each benchmark wrote
    gpu_check.log    the tail of every step's output (longer tails for failures)
Only the test files that hold `gpu` tests are collected (others import packages a GPU image may lack). CPU-only
benchmarks (Adam, swapper, the step model on the sim) are not run on GPU time. Each step has its own time limit.
torchao, for offload_step's comparison with its CPUOffloadOptimizer: used when the machine's python imports it;
otherwise the newest torchao wheel in bench/wheels (`make wheels` downloads it where PyPI is reachable; the GPU
session carries the folder, since that machine reaches no registry) is installed with pip into a private folder
that only the benchmark steps see. gpu_check.json says which happened, or why torchao is missing; a torchao that
will not import is left off their path (offload_step leaves its row out), never a reason to fail the check.
It does not download anything, install into the machine's python, or decide what the benchmarks measure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 420  # 7 minutes, with room in a session's 15 to start the machine and read the results
TEST_LIMIT_S = 90  # 55 s on an H200 (2026-12-04)
FAULTHANDLER_S = 60  # a test stuck this long prints every thread's stack (a deadlock names itself)
DOCTOR_LIMIT_S = 15
SHARD_LIMIT_S = 35
TORCHAO_LIMIT_S = 20  # probe the machine's python, install the wheel, probe again: all three together
WHEEL_DIR = ROOT / "bench" / "wheels"
# benchmark -> time limit (s): the GPU ones, in --quick sizes that fit a 16-core, 128 GB machine
BENCHES = {"copy_bandwidth": 15, "offload_step": 60, "hybrid": 35, "streaming": 60, "activations": 30,
           "checkpoint": 60}
TAKES_DEVICE = {"offload_step", "hybrid", "streaming", "activations", "checkpoint"}  # `--device cuda` is passed
# chapter -> what of it runs on the GPU -> the test (file::name prefix) or step that runs it there
TRAIN = "tests/train/test_train_cuda.py::test_on_cuda_train_each_feature_as_on_the_sim"
RESUME = "tests/train/test_checkpoint_async.py::test_on_cuda_a_resumed_train_run_continues_as_the_uninterrupted_one"
FEATURES = {
    2: {"copies, streams and events": "tests/devices/test_device.py::test_",
        "pinned buffers of our own, bounded spans, timing events": "tests/devices/test_cuda_backend.py::test_gpu_",
        "copy bandwidth, pinned and pageable": "copy_bandwidth"},
    3: {"the CPU Adam inside an offloaded step": "offload_step"},
    4: {"speculative update and gradient buckets, GPU lagging":
        "tests/engine/test_offload_speculative.py::test_on_cuda_every_variant_trains_like_the_synchronous_step",
        "train end to end with the offloaded optimizer": f"{TRAIN}[offloaded optimizer]",
        "kept small parameters, one sync per check": "tests/engine/test_device_gradients.py::test_gpu_",
        "clipping through the optimizer (clip_grad_norm_), GPU lagging":
        "tests/engine/test_clip_grad_norm.py::test_on_cuda_"},
    5: {"hybrid split, stride and fraction": "tests/engine/test_hybrid.py::test_on_cuda_every_split",
        "the CuPy Adam kernel": "tests/engine/test_hybrid.py::test_the_cupy_kernel_matches_torch_fused_adamw",
        "train end to end with a hybrid update": f"{TRAIN}[hybrid update, dynamic]"},
    6: {"the optimizer's state on NVMe": f"{TRAIN}[NVMe optimizer tier]"},
    7: {"every activation policy, dropout, a pool, GPU lagging":
        "tests/model/test_activations.py::test_on_cuda_every_policy_trains_like_keep",
        "activation policies timed": "activations"},
    8: {"streamed weights from host and NVMe homes, GPU lagging":
        "tests/model/test_streaming.py::test_on_cuda_streaming_trains_like_resident_weights",
        "train end to end with weights streamed from NVMe": f"{TRAIN}[streamed weights from NVMe]",
        "a Hugging Face Llama streamed, activations offloaded, GPU lagging (skips without transformers)":
        "tests/model/test_hf_models.py::test_on_cuda_",
        "streaming timed": "streaming"},
    9: {"the machine probed (CUDA, pinned memory limit)": "doctor"},
    10: {"sharded offload over NCCL": "sharded train (NCCL)"},
    11: {"async checkpoint, resumed": f"{RESUME}[lazy async]",
         "DCP checkpoint, resumed": f"{RESUME}[torch.distributed.checkpoint]",
         "checkpoints timed": "checkpoint"},
    12: {"gradients on NVMe through a few pinned sets": f"{TRAIN}[gradients on NVMe]"},
}


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
            "cores": os.cpu_count(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return info


def gpu_test_files() -> list[str]:
    """The test files that hold a test marked `gpu`, relative to the repository."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in path.read_text())


def _text(data) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")  # a timeout hands back bytes


def _python_path(*extra: str | None) -> str:
    return os.pathsep.join(filter(None, [*extra, os.environ.get("PYTHONPATH")]))


# Prints torchao's version and the module CPUOffloadOptimizer was imported from: torchao.optim in recent releases,
# torchao.prototype.low_bit_optim in older ones; bench/offload_step.py tries the same two, in this order.
_PROBE = """
import json, torchao
try:
    from torchao.optim import CPUOffloadOptimizer
    import_path = "torchao.optim"
except ImportError:
    from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
    import_path = "torchao.prototype.low_bit_optim"
print(json.dumps({"version": torchao.__version__, "import_path": import_path}))
"""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def probe_torchao(extra_path: str | None, timeout_s: float) -> dict:
    """Whether this python imports torchao and its CPUOffloadOptimizer, `extra_path` first on its path. A fresh
    interpreter each time: a failed import must not linger in this process."""
    env = {**os.environ, "PYTHONPATH": _python_path(extra_path)}
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                                timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"importing torchao took over {timeout_s:.0f} s"}
    if result.returncode != 0:
        return {"ok": False, "error": _last_line(result.stderr)}
    try:
        return {"ok": True, **json.loads(_last_line(result.stdout))}
    except json.JSONDecodeError:
        return {"ok": False, "error": f"unexpected output from the torchao probe: {_last_line(result.stdout)}"}


def _version_key(wheel: Path) -> tuple[int, ...]:
    version = wheel.name.split("-")[1]  # name-version-tags.whl
    return tuple(int(part) for part in re.findall(r"\d+", version))


def newest_wheel(wheel_dir: Path) -> Path | None:
    wheels = sorted(wheel_dir.glob("torchao-*.whl"), key=_version_key)
    return wheels[-1] if wheels else None


def install_wheel(wheel: Path, target: str, timeout_s: float) -> str | None:
    """pip-installs `wheel` alone into `target` (no dependencies, no index: the GPU machine reaches no registry).
    Returns None on success, else what went wrong."""
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile",
            "--no-cache-dir", "--disable-pip-version-check", "--target", target, str(wheel)]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return f"pip install took over {timeout_s:.0f} s"
    return None if result.returncode == 0 else f"pip install failed: {_last_line(result.stderr + result.stdout)}"


def setup_torchao(wheel_dir: Path, target: str, limit_s: float = TORCHAO_LIMIT_S) -> tuple[dict, str | None]:
    """Makes torchao importable for the benchmarks if it can. Returns the report for gpu_check.json (status
    "found", "installed from wheel" or "missing", with the reason) and the folder to put on the benchmarks'
    PYTHONPATH (None: nothing to add)."""
    deadline = time.perf_counter() + limit_s
    report = {"status": "missing", "version": None, "import_path": None, "wheel": None, "reason": None}
    here = probe_torchao(None, deadline - time.perf_counter())
    if here["ok"]:
        return {**report, "status": "found", "version": here["version"], "import_path": here["import_path"]}, None
    wheel = newest_wheel(wheel_dir)
    if wheel is None:
        report["reason"] = (f"this python does not import torchao ({here['error']}) and {wheel_dir} holds no "
                            "torchao-*.whl: run `make wheels` where PyPI is reachable, then carry bench/wheels")
        return report, None
    report["wheel"] = wheel.name
    failure = install_wheel(wheel, target, deadline - time.perf_counter())
    if failure:
        report["reason"] = f"{wheel.name}: {failure}"
        return report, None
    installed = probe_torchao(target, deadline - time.perf_counter())
    if not installed["ok"]:
        report["reason"] = (f"{wheel.name} installed but does not import with this torch ({installed['error']}): "
                            "download a torchao built for it (TORCHAO_SPEC=torchao==VERSION make wheels)")
        return report, None
    return {**report, "status": "installed from wheel", "version": installed["version"],
            "import_path": installed["import_path"]}, target


def run_step(name: str, argv: list[str], limit_s: float, extra_path: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": _python_path(str(ROOT), extra_path),
           "NUMBA_CACHE_DIR": str(ROOT / ".cache" / "numba")}
    start = time.perf_counter()
    try:
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit_s, env=env)
        code, text = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as err:
        code, text = "timeout", f"{_text(err.stdout)}{_text(err.stderr)}\n[stopped after {limit_s:.0f} s]"
    row = {"step": name, "exit": code, "seconds": round(time.perf_counter() - start, 1), "limit_s": limit_s,
           "output": text}
    print(f"{name:<16} exit={code!s:<8} {row['seconds']:>6.1f} s (limit {limit_s:.0f} s)")
    return row


def plan(cuda: bool) -> list[tuple[str, list[str], float]]:
    """The steps, in order: correctness first (tests, the sharded run), then the machine, then the benchmarks."""
    steps = [("gpu tests", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-q", "-rfEs",
                            "-o", f"faulthandler_timeout={FAULTHANDLER_S}", *gpu_test_files()], TEST_LIMIT_S)]
    if cuda:
        import torch
        ranks = str(max(1, torch.cuda.device_count()))
        steps.append(("sharded train (NCCL)", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks,
                                               "-m", "minioffload", "train", "--shard", "--device", "cuda", "--model",
                                               "small", "--steps", "5", "--eval-every", "5", "--no-progress",
                                               "--out-dir", tempfile.mkdtemp()], SHARD_LIMIT_S))
    steps.append(("doctor", [sys.executable, "-m", "minioffload", "doctor", "--no-measure"], DOCTOR_LIMIT_S))
    if cuda:
        steps += [(name, [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick",
                          *(["--device", "cuda"] if name in TAKES_DEVICE else [])], limit)
                  for name, limit in BENCHES.items()]
    return steps


def budget_s() -> float:
    """What the plan on a GPU may take at most: every step's limit and torchao's setup."""
    return TEST_LIMIT_S + SHARD_LIMIT_S + DOCTOR_LIMIT_S + TORCHAO_LIMIT_S + sum(BENCHES.values())


def collected_gpu_tests() -> list[str]:
    """The node ids of the `gpu` tests (collected, not run: on a CPU machine they would skip)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-q",
                             "--collect-only", *gpu_test_files()], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": _python_path(str(ROOT))}, timeout=120)
    return [line.strip() for line in result.stdout.splitlines() if "::" in line]


def coverage(tests: list[str]) -> dict[int, dict[str, str | None]]:
    """chapter -> feature -> what runs it on the GPU (a test id or a step), or None where nothing does."""
    steps = {"doctor", "sharded train (NCCL)", *BENCHES}
    return {chapter: {feature: (target if target in steps else next((t for t in tests if t.startswith(target)), None))
                      for feature, target in features.items()}
            for chapter, features in FEATURES.items()}


def step_failed(row: dict, cuda: bool) -> bool:
    """pytest's 5 ("no tests collected") fails on a GPU, where the tests were meant to run; skipped steps do not."""
    if str(row["exit"]).startswith("skipped"):
        return False
    return row["exit"] != 0 and not (row["exit"] == 5 and not cuda)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on a CPU machine: list the steps, run the tests "
                        "(they skip without CUDA), skip the benchmarks, and report the files and the budget")
    parser.add_argument("--wheel-dir", type=Path, default=WHEEL_DIR,
                        help="where to look for a torchao wheel when this python lacks torchao (default: %(default)s)")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    if not info["cuda_available"] and not args.dry_run:
        print("no CUDA GPU visible: run with --dry-run to check the plan on this machine")
        return 2
    steps = plan(info["cuda_available"])
    budget = budget_s()
    print(f"{len(steps)} step(s) here; on a GPU the time limits add up to {budget:.0f} s (budget {BUDGET_S} s); "
          f"test files: {', '.join(gpu_test_files())}")
    if budget > BUDGET_S:
        print(f"the steps' limits exceed the {BUDGET_S} s budget: lower them")
        return 2
    covered = coverage(collected_gpu_tests())
    for chapter, features in covered.items():
        for feature, target in features.items():
            print(f"  chapter {chapter:>2}  {feature:<58} {target or 'NOTHING RUNS IT ON A GPU'}")
    missing = [f"chapter {c}: {f}" for c, features in covered.items() for f, t in features.items() if t is None]
    if missing:
        print(f"no CUDA test or run for {'; '.join(missing)}: add one (marked gpu) or fix FEATURES")
        return 2
    started_wall = time.time()
    torchao_dir = tempfile.mkdtemp(prefix="gpu_check_torchao_")
    started = time.perf_counter()
    torchao, bench_path = setup_torchao(args.wheel_dir, torchao_dir)
    torchao["seconds"] = round(time.perf_counter() - started, 1)
    print(f"torchao: {torchao['status']}" + "".join(f", {key} {torchao[key]}" for key in
                                                  ("version", "import_path", "wheel", "reason") if torchao[key]))
    try:
        rows = [run_step(name, argv, limit, bench_path if name in BENCHES else None) for name, argv, limit in steps]
    finally:
        shutil.rmtree(torchao_dir, ignore_errors=True)
    if not info["cuda_available"]:
        rows += [{"step": name, "exit": "skipped: needs CUDA", "seconds": 0, "limit_s": limit, "output": ""}
                 for name, limit in BENCHES.items()]
    results = {}
    for path in sorted((ROOT / "bench" / "results").glob("*_cuda.json")):  # what the benchmarks wrote this run
        if path.stat().st_mtime >= started_wall:
            results[path.stem] = json.loads(path.read_text())
    log = [f"===== torchao: {json.dumps(torchao)}\n"]
    for row in rows:
        output = row.pop("output")
        keep = 4000 if row["exit"] not in (0, 5) else 800  # pytest's 5: no test selected
        log.append(f"===== {row['step']}: exit {row['exit']}, {row['seconds']} s\n{output[-keep:]}\n")
    (out / "gpu_check.log").write_text("".join(log))
    (out / "gpu_check.json").write_text(json.dumps({"machine": info, "torchao": torchao, "steps": rows,
                                                       "coverage": covered, "results": results}, indent=2))
    files = sorted(p.name for p in out.iterdir())
    failed = [r["step"] for r in rows if step_failed(r, info["cuda_available"])]
    print(f"wrote {out}: {len(files)} file(s) ({', '.join(files)}); "
          f"{sum(r['seconds'] for r in rows):.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
