"""Everything that needs a GPU, in one go: the `gpu` tests and every benchmark in --quick mode.

Run on a CUDA machine (`python bench/gpu_check.py`); writes under $OUT (or bench/results/gpu/):
    machine.json       torch/CUDA versions, the GPU's name and memory
    gpu_tests.txt      pytest's output for the tests marked `gpu`
    bench_NAME.txt     each benchmark's table; the JSON it writes is copied beside it
    summary.json       exit code and seconds of every step
Each step has its own time limit so the whole stays under 8 minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu")
BUDGET_S = 8 * 60


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "cuda": torch.version.cuda, "cores": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return info


def step(name: str, argv: list[str], limit_s: float, log: Path) -> dict:
    start = time.perf_counter()
    try:
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        code, text = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as err:
        code, text = "timeout", f"{err.stdout or ''}{err.stderr or ''}\n[stopped after {limit_s:.0f} s]"
    log.write_text(text if isinstance(text, str) else text.decode())
    row = {"step": name, "exit": code, "seconds": round(time.perf_counter() - start, 1)}
    print(f"{name:<24} exit={code!s:<8} {row['seconds']:>6.1f} s")
    return row


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    started, started_wall = time.perf_counter(), time.time()
    (OUT / "machine.json").write_text(json.dumps(machine(), indent=2))
    rows = [step("gpu tests", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-q",
                               "tests"], 180, OUT / "gpu_tests.txt")]
    for bench in sorted((ROOT / "bench").glob("*.py")):
        if bench.name in ("gpu_check.py", "common.py", "step_model.py"):  # step_model: the sim device only
            continue
        left = BUDGET_S - (time.perf_counter() - started)
        if left < 20:
            rows.append({"step": bench.stem, "exit": "skipped: out of time"})
            continue
        rows.append(step(bench.stem, [sys.executable, str(bench), "--quick"], min(120, left),
                         OUT / f"bench_{bench.stem}.txt"))
        for result in (ROOT / "bench" / "results").glob(f"{bench.stem}*.json"):  # NAME.json, NAME_cuda.json
            if result.stat().st_mtime >= started_wall:
                shutil.copy(result, OUT / result.name)
    (OUT / "summary.json").write_text(json.dumps(rows, indent=2))
    # pytest exits 5 when no test is marked `gpu` yet: that is not a failure of this check.
    failed = [r for r in rows if r.get("exit") not in (0, 5)]
    print(f"wrote {OUT}; {len(failed)} step(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
