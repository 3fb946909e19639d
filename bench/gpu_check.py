"""Everything that needs a GPU, in one go, within 7 minutes: the `gpu` tests, `doctor` on the machine (CUDA seen,
locked-memory limit, host memory), a sharded run (`train --shard` under torchrun, NCCL, one rank per GPU) and the
GPU benchmarks in --quick mode.

    python bench/gpu_check.py            # on a CUDA machine; writes $OUT (or bench/results/gpu/)
    python bench/gpu_check.py --dry-run  # on a CPU machine: what it would run, the files, the budget

It runs from a plain copy of the repository with the machine's own python (torch, CuPy, Numba, xxhash, pytest and
hypothesis present; the project need not be installed: PYTHONPATH points here). It writes exactly two files:
    gpu_check.json   the machine, every step (exit code, seconds, time limit) and the JSON each benchmark wrote
    gpu_check.log    the tail of every step's output (longer tails for failures)
Only the test files that hold `gpu` tests are collected (others import packages a GPU image may lack). CPU-only
benchmarks (Adam, swapper, the step model on the sim) are not run on GPU time. Each step has its own time limit.
torchao, for offload_step's comparison, is used when importable (a wheel can be installed with pip --no-deps from a
file carried in the repository; the GPU machine reaches no registry).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 7 * 60
TEST_LIMIT_S = 90
DOCTOR_LIMIT_S = 30
SHARD_LIMIT_S = 60
# benchmark -> time limit (s): the GPU ones, in --quick sizes that fit a 16-core, 128 GB machine
BENCHES = {"copy_bandwidth": 40, "offload_step": 75, "hybrid": 90}


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
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in path.read_text())


def _text(data) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")  # a timeout hands back bytes


def run_step(name: str, argv: list[str], limit_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
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
    steps = [("gpu tests", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-q",
                            *gpu_test_files()], TEST_LIMIT_S),
             ("doctor", [sys.executable, "-m", "minioffload", "doctor", "--no-measure"], DOCTOR_LIMIT_S)]
    if cuda:
        import tempfile

        import torch
        ranks = str(max(1, torch.cuda.device_count()))
        steps.append(("sharded train (NCCL)", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks,
                                               "-m", "minioffload", "train", "--shard", "--device", "cuda", "--model",
                                               "small", "--steps", "5", "--eval-every", "5", "--no-progress",
                                               "--out-dir", tempfile.mkdtemp()], SHARD_LIMIT_S))
        steps += [(name, [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick"], limit)
                  for name, limit in BENCHES.items()]
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on a CPU machine: list the steps, run the tests "
                        "(they skip without CUDA), skip the benchmarks, and report the files and the budget")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    if not info["cuda_available"] and not args.dry_run:
        print("no CUDA GPU visible: run with --dry-run to check the plan on this machine")
        return 2
    steps = plan(info["cuda_available"])
    budget = sum(limit for _, _, limit in steps) + (0 if info["cuda_available"] else sum(BENCHES.values()))
    print(f"{len(steps)} step(s); time limits add up to {budget} s (budget {BUDGET_S} s); "
          f"test files: {', '.join(gpu_test_files())}")
    if budget > BUDGET_S:
        print(f"the steps' limits exceed the {BUDGET_S} s budget: lower them")
        return 2
    started_wall = time.time()
    rows = [run_step(name, argv, limit) for name, argv, limit in steps]
    if not info["cuda_available"]:
        rows += [{"step": name, "exit": "skipped: needs CUDA", "seconds": 0, "limit_s": limit, "output": ""}
                 for name, limit in BENCHES.items()]
    results = {}
    for path in sorted((ROOT / "bench" / "results").glob("*_cuda.json")):  # what the benchmarks wrote this run
        if path.stat().st_mtime >= started_wall:
            results[path.stem] = json.loads(path.read_text())
    log = []
    for row in rows:
        output = row.pop("output")
        keep = 4000 if row["exit"] not in (0, 5) else 800  # pytest's 5: no test selected
        log.append(f"===== {row['step']}: exit {row['exit']}, {row['seconds']} s\n{output[-keep:]}\n")
    (out / "gpu_check.log").write_text("".join(log))
    (out / "gpu_check.json").write_text(json.dumps({"machine": info, "steps": rows, "results": results}, indent=2))
    files = sorted(p.name for p in out.iterdir())
    failed = [r["step"] for r in rows if r["exit"] not in (0, 5) and not str(r["exit"]).startswith("skipped")]
    print(f"wrote {out}: {len(files)} file(s) ({', '.join(files)}); "
          f"{sum(r['seconds'] for r in rows):.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
