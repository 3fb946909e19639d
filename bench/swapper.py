"""The NVMe swapper against fio, and the pipelined NVMe update against its slowest stage.

1. Sequential write and read of one file, O_DIRECT, the same directory, file size and block size: fio (its best
   of libaio at queue depth 16 and psync with as many jobs as our workers) and the Swapper (writes include
   fsync and the index commit; reads unverified, then verified). Interleaved rounds, medians.
2. OffloadAdam with its state on NVMe: the update phase (step() until every write is durable) against each of
   its stages run alone: reading every subgroup's state, the CPU Adam over all of them, writing them back.

Headline (bench/results/swapper.json):
    read_vs_fio, write_vs_fio        Swapper bandwidth / fio's best in the same run (target >= 0.9)
    pipeline_over_slowest_stage      pipelined update / max(read, update, write alone) (target <= 1.15)

    python bench/swapper.py [--quick] [--dir bench/.swap]      (fio: `make fio` installs it where it can)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import stats, write  # noqa: E402

from minioffload.adam import adam_fused  # noqa: E402
from minioffload.device import device  # noqa: E402
from minioffload.nvme import Swapper  # noqa: E402
from minioffload.nvme_tune import measure  # noqa: E402
from minioffload.offload import OffloadAdam  # noqa: E402
from minioffload.paths import usable_directory  # noqa: E402
from minioffload.pinned import aligned_empty  # noqa: E402


def fio(path: Path, rw: str, size: int, block: int, engine: str, jobs: int) -> float | None:
    """fio's bandwidth in GB/s for one sequential pass, or None without fio."""
    if not shutil.which("fio"):
        return None
    per_job = size // jobs
    argv = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={block}", f"--size={per_job}",
            "--direct=1", f"--ioengine={engine}", f"--numjobs={jobs}", f"--offset_increment={per_job}",
            "--group_reporting", "--output-format=json", "--end_fsync=1" if rw == "write" else "--invalidate=1"]
    if engine == "libaio":
        argv.append("--iodepth=16")
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["io_bytes"] / (side["runtime"] / 1e3) / 1e9 if side["runtime"] else None


def swapper_pass(directory: Path, data: torch.Tensor, back: torch.Tensor, block: int, workers: int) -> dict:
    plain = measure(directory, data, back, block_size=block, workers=workers)
    checked = measure(directory, data, back, block_size=block, workers=workers, verify=True)
    return {**plain, "read_verified_GBps": checked["read_GBps"]}


def pipeline(directory: Path, subgroups: int, numel: int, block: int, workers: int, rounds: int) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel) * 0.02) for _ in range(subgroups)]
    weights = torch.linspace(0.5, 1.5, numel)
    with device("sim") as dev, Swapper(directory, block_size=block, workers=workers) as swap:
        dev.place(params)
        opt = OffloadAdam(params, dev, lr=1e-3, subgroup_numel=numel, swapper=swap)
        steps = []
        for _ in range(rounds + 1):
            sum((p * weights).sum() for p in params).backward()
            dev.synchronize()
            start = time.perf_counter()
            opt.step()
            opt.nvme.drain()  # the update phase ends when its last write is durable
            dev.synchronize()
            steps.append(time.perf_counter() - start)
            opt.zero_grad()
        # each stage alone, over the same subgroups and buffers
        sets = [{name: aligned_empty(numel * 4, pin=False).view(torch.float32) for name in opt.nvme.sets[0]}
                for _ in range(subgroups)]
        grad = torch.full((numel,), 1e-3)

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        def read_all():
            for f in [swap.read(opt.nvme.key(sub, name), into=sets[i][name])
                      for i, sub in enumerate(opt.subgroups) for name in sets[i]]:
                f.result()

        def update_all():
            for s in sets:
                adam_fused(s["master"], grad, s["exp_avg"], s["exp_avg_sq"], step=1000, lr=1e-3)

        def write_all():
            for f in [swap.write(f"alone{i}/{name}", t) for i, s in enumerate(sets) for name, t in s.items()]:
                f.result()

        stages = {"read": [], "update": [], "write": []}
        for _ in range(rounds):
            stages["read"].append(timed(read_all))
            stages["update"].append(timed(update_all))
            stages["write"].append(timed(write_all))
    return {"step": stats(steps[1:]), **{k: stats(v) for k, v in stages.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller files, fewer rounds (under a minute)")
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent / ".swap"),
                        help="a directory on the disk to measure (default bench/.swap, created and emptied)")
    parser.add_argument("--block-size", type=common.positive(int), default=1 << 20)
    parser.add_argument("--workers", type=common.positive(int), default=4)
    args = parser.parse_args()
    directory = usable_directory(args.dir, "--dir")
    directory.mkdir(parents=True, exist_ok=True)
    size = (256 << 20) if args.quick else (1 << 30)
    rounds = 2 if args.quick else 3
    data = aligned_empty(size, pin=False)
    data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    back = aligned_empty(size, pin=False)
    fio_file = directory / "fio.dat"
    rows, fio_best = [], {"write": [], "read": []}
    try:
        for _ in range(rounds):
            for rw in ("write", "read"):
                figures = [fio(fio_file, rw, size, args.block_size, engine, jobs)
                           for engine, jobs in (("libaio", 1), ("psync", args.workers))]
                figures = [f for f in figures if f is not None]
                fio_best[rw].append(max(figures) if figures else None)
            rows.append(swapper_pass(directory, data, back, args.block_size, args.workers))
        ours = {k: stats([r[k] for r in rows])["median"] for k in rows[0]}
        fio_median = {rw: stats(v)["median"] if None not in v else None for rw, v in fio_best.items()}
        subgroups, numel = (6, 1 << 21) if args.quick else (8, 1 << 22)
        piped = pipeline(directory, subgroups, numel, args.block_size, args.workers, rounds)
    finally:
        for path in directory.iterdir():
            path.unlink()
    slowest = max(piped[k]["median"] for k in ("read", "update", "write"))
    print(f"{size >> 20} MiB file, {args.block_size >> 10} KiB blocks, {args.workers} workers, O_DIRECT, "
          f"{rounds} interleaved rounds, medians")
    print(f"{'':<22}{'write GB/s':>12}{'read GB/s':>12}")
    print(f"{'fio (best)':<22}{fio_median['write'] or float('nan'):>12.2f}{fio_median['read'] or float('nan'):>12.2f}")
    print(f"{'Swapper':<22}{ours['write_GBps']:>12.2f}{ours['read_GBps']:>12.2f}")
    print(f"{'Swapper, verified':<22}{'':>12}{ours['read_verified_GBps']:>12.2f}")
    print(f"pipelined NVMe update, {subgroups} subgroups x {numel / 1e6:.1f}M params: step "
          f"{piped['step']['median'] * 1e3:.0f} ms; alone: read {piped['read']['median'] * 1e3:.0f}, update "
          f"{piped['update']['median'] * 1e3:.0f}, write {piped['write']['median'] * 1e3:.0f} ms")
    headline = {"write_vs_fio": ours["write_GBps"] / fio_median["write"] if fio_median["write"] else None,
                "read_vs_fio": ours["read_GBps"] / fio_median["read"] if fio_median["read"] else None,
                "pipeline_over_slowest_stage": piped["step"]["median"] / slowest,
                "swapper_write_GBps": ours["write_GBps"], "swapper_read_GBps": ours["read_GBps"],
                "fio_write_GBps": fio_median["write"], "fio_read_GBps": fio_median["read"]}
    print("headline:", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    config = {"file_bytes": size, "block_size": args.block_size, "workers": args.workers, "rounds": rounds,
              "quick": args.quick, "subgroups": subgroups, "numel": numel}
    result_rows = [{"kind": "sequential", **r} for r in rows] + [{"kind": "fio best", **fio_best},
                                                                 {"kind": "pipeline", **piped}]
    print(f"wrote {write('swapper', result_rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
