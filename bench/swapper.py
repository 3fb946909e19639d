"""The NVMe swapper against fio, the pipelined NVMe update against its slowest stage, multi-path NVMe and the
cache-friendly update order.

1. Sequential write and read of one file, O_DIRECT, the same directory, file size and block size: fio (its best
   of libaio at queue depth 16 and psync with as many jobs as our workers) and the Swapper (writes include
   fsync and the index commit; reads unverified, then verified). Interleaved rounds, medians.
2. OffloadAdam with its state on NVMe: the update phase (step() until every write is durable) against each of
   its stages run alone: reading every subgroup's state, the CPU Adam over all of them, writing them back (with
   nvme_order="forward", which reads every subgroup, as the stages alone do).
3. Multi-path: the same state (subgroups of fp32) written and read back through (a) the fast path alone, (b) the
   slow path alone, (c) both as a MultiPathSwapper that measured their bandwidths. This machine has one drive, so
   both paths are directories on it, throttled in software (Swapper(max_bandwidth=...)) below what the drive gives:
   by default the fast one to half of the drive's slower direction (measured first), the slow one to a quarter,
   so that the two together still fit in the drive, as two drives would. Interleaved rounds, medians.
4. The order: OffloadAdam on NVMe, "forward" against "alternate", stepped in turn on equal subgroups; the bytes
   read per step after the first, against the model (nvme_tier.reads_avoided_fraction).

Headline (bench/results/swapper.json):
    read_vs_fio, write_vs_fio        Swapper bandwidth / fio's best in the same run (target >= 0.9)
    pipeline_over_slowest_stage      pipelined update / max(read, update, write alone) (target <= 1.15)
    multipath_speedup                time(fast path alone) / time(both paths), writing and reading the same state
    multipath_target                 0.9 x (B_fast + B_slow) / B_fast, each path's bandwidth measured alone here
    nvme_bytes_saved_by_order        1 - bytes read per step with "alternate" / with "forward" (measured)
    nvme_bytes_saved_predicted       reads_avoided_fraction(subgroups, sets): the model, from the host cache size

    python bench/swapper.py [--quick] [--dir bench/.swap] [--fast-bandwidth B] [--slow-bandwidth B]
    (fio: `make fio` installs it where it can; bandwidths in bytes/s)
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

from minioffload.devices import device  # noqa: E402
from minioffload.engine.nvme_tier import reads_avoided_fraction  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.kernels.adam import adam_fused  # noqa: E402
from minioffload.nvme.multipath import MultiPathSwapper  # noqa: E402
from minioffload.nvme.swapper import Swapper  # noqa: E402
from minioffload.nvme.tune import measure  # noqa: E402
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
        opt = OffloadAdam(params, dev, lr=1e-3, subgroup_numel=numel, swapper=swap, nvme_order="forward")
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


def multipath(directory: Path, size: int, rounds: int, block: int, workers: int, fast_bandwidth: float | None,
              slow_bandwidth: float | None) -> dict:
    """Part 3: the same state through the fast path, the slow path, and both; seconds per write+read round."""
    probe = aligned_empty(64 << 20, pin=False)
    probe.copy_(torch.randint(0, 256, probe.shape, dtype=torch.uint8))
    (directory / "drive").mkdir()
    probes = [measure(directory / "drive", probe, aligned_empty(64 << 20, pin=False), block_size=block,
                      workers=workers) for _ in range(2)]  # the better of two: the first may meet a cold drive
    drive = {k: max(p[k] for p in probes) for k in probes[0]}
    slower_direction = min(drive["write_GBps"], drive["read_GBps"]) * 1e9
    fast_bandwidth = fast_bandwidth or slower_direction / 2
    slow_bandwidth = slow_bandwidth or slower_direction / 4
    subgroups, numel = 24, size // 4 // 24 // 1024 * 1024
    state = [aligned_empty(numel * 4, pin=False).view(torch.float32) for _ in range(subgroups)]
    for tensor in state:
        tensor.copy_(torch.randn(numel))
    back = [aligned_empty(numel * 4, pin=False).view(torch.float32) for _ in range(subgroups)]

    def path(name: str, bandwidth: float) -> Swapper:
        (directory / name).mkdir()
        return Swapper(directory / name, block_size=block, workers=workers, max_bandwidth=bandwidth)

    swappers = {"fast alone": MultiPathSwapper([path("fast", fast_bandwidth)], bandwidths=[1]),
                "slow alone": MultiPathSwapper([path("slow", slow_bandwidth)], bandwidths=[1]),
                "both": MultiPathSwapper([path("both_fast", fast_bandwidth), path("both_slow", slow_bandwidth)])}

    def round_trip(swap: MultiPathSwapper) -> dict:
        start = time.perf_counter()
        for future in [swap.write(f"subgroup{i}/state", t) for i, t in enumerate(state)]:
            future.result()
        written = time.perf_counter()
        for future in [swap.read(f"subgroup{i}/state", into=b) for i, b in enumerate(back)]:
            future.result()
        return {"write_s": written - start, "read_s": time.perf_counter() - written,
                "total_s": time.perf_counter() - start}

    try:
        runs = common.interleaved({name: (lambda s=swap: round_trip(s)) for name, swap in swappers.items()}, rounds)
    finally:
        for swap in swappers.values():
            swap.close()
    if not all(torch.equal(a, b) for a, b in zip(state, back, strict=True)):
        raise RuntimeError("multi-path: a tensor read back differs from the one written")
    seconds = {name: stats([r["total_s"] for r in rows])["median"] for name, rows in runs.items()}
    placed = swappers["both"].assignment(subgroups)
    nbytes = 2 * subgroups * numel * 4  # written and read
    return {"drive": drive, "fast_bandwidth": fast_bandwidth, "slow_bandwidth": slow_bandwidth,
            "subgroups": subgroups, "numel": numel, "measured_bandwidths": swappers["both"].bandwidths,
            "subgroups_per_path": [placed.count(p) for p in range(2)],
            "seconds": {name: {k: stats([r[k] for r in rows]) for k in rows[0]} for name, rows in runs.items()},
            "GBps_alone": {name: nbytes / seconds[name] / 1e9 for name in ("fast alone", "slow alone")},
            "speedup": seconds["fast alone"] / seconds["both"],
            "target": 0.9 * (1 + seconds["fast alone"] / seconds["slow alone"])}  # 0.9 (B_fast + B_slow) / B_fast


def order_saving(directory: Path, subgroups: int, numel: int, steps: int) -> dict:
    """Part 4: bytes read per step by the NVMe tier, "forward" and "alternate" stepped in turn."""
    torch.manual_seed(0)
    start_weights = [torch.randn(numel) * 0.02 for _ in range(subgroups)]
    target = torch.linspace(-1, 1, numel)
    with device("sim") as dev:
        runs = {}
        for order in ("forward", "alternate"):
            (directory / order).mkdir()
            params = [torch.nn.Parameter(w.clone()) for w in start_weights]
            dev.place(params)
            swap = Swapper(directory / order, block_size=1 << 20)
            runs[order] = {"params": params, "swap": swap, "steps": [], "seconds": [],
                           "opt": OffloadAdam(params, dev, lr=1e-3, subgroup_numel=numel, swapper=swap,
                                              nvme_order=order)}
        for _ in range(steps):
            for run in runs.values():
                sum(((p - target) ** 2).mean() for p in run["params"]).backward()
                dev.synchronize()
                start = time.perf_counter()
                run["opt"].step()
                run["opt"].nvme.drain()  # the update phase ends when its last write is durable
                dev.synchronize()
                run["seconds"].append(time.perf_counter() - start)
                run["opt"].zero_grad()
                run["steps"].append(vars(run["opt"].nvme.last_visit).copy())
        masters = [run["opt"].master_weights() for run in runs.values()]
        same = all(torch.equal(a, b) for a, b in zip(*masters, strict=True))
        sets = len(runs["alternate"]["opt"].nvme.sets)
        for run in runs.values():
            run["swap"].close()
    read = {order: sum(s["bytes_read"] for s in run["steps"][1:]) for order, run in runs.items()}
    return {"subgroups": subgroups, "numel": numel, "sets": sets, "steps": steps, "same_weights": same,
            "per_step": {order: run["steps"] for order, run in runs.items()},
            "update_seconds": {order: stats(run["seconds"][1:]) for order, run in runs.items()},
            "saved": 1 - read["alternate"] / read["forward"],
            "predicted": reads_avoided_fraction(subgroups, sets)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller files, fewer rounds (under a minute)")
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent / ".swap"),
                        help="a directory on the disk to measure (default bench/.swap, created and emptied)")
    parser.add_argument("--block-size", type=common.positive(int), default=1 << 20)
    parser.add_argument("--workers", type=common.positive(int), default=4)
    parser.add_argument("--fast-bandwidth", type=common.positive(float), default=None,
                        help="multi-path: the fast path's throttle in bytes/s (default: half the drive's slower way)")
    parser.add_argument("--slow-bandwidth", type=common.positive(float), default=None,
                        help="multi-path: the slow path's throttle in bytes/s (default: a quarter of it)")
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
        paths = multipath(directory, size // 4 if args.quick else size, rounds, args.block_size, args.workers,
                          args.fast_bandwidth, args.slow_bandwidth)
        order = order_saving(directory, subgroups, numel // 2, 4 if args.quick else 6)
    finally:
        for path in directory.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            else:
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
    print(f"multi-path, {paths['subgroups']} subgroups x {paths['numel'] * 4 >> 20} MiB written then read; drive "
          f"{paths['drive']['write_GBps']:.2f} GB/s write, {paths['drive']['read_GBps']:.2f} read; throttles: fast "
          f"{paths['fast_bandwidth'] / 1e9:.2f}, slow {paths['slow_bandwidth'] / 1e9:.2f} GB/s")
    for name, figures in paths["seconds"].items():
        total = figures["total_s"]
        print(f"  {name:<12}{total['median'] * 1e3:>8.0f} ms (min {total['min'] * 1e3:.0f}, max "
              f"{total['max'] * 1e3:.0f})")
    print(f"  both: measured bandwidths {', '.join(f'{b / 1e9:.2f}' for b in paths['measured_bandwidths'])} GB/s, "
          f"subgroups per path {paths['subgroups_per_path']}")
    print(f"order, {order['subgroups']} subgroups x {order['numel'] / 1e6:.1f}M params, {order['sets']} sets: bytes "
          f"read per step saved {order['saved']:.3f} (model {order['predicted']:.3f}); update phase "
          f"{order['update_seconds']['forward']['median'] * 1e3:.0f} ms forward, "
          f"{order['update_seconds']['alternate']['median'] * 1e3:.0f} ms alternate; same weights: "
          f"{order['same_weights']}")
    headline = {"write_vs_fio": ours["write_GBps"] / fio_median["write"] if fio_median["write"] else None,
                "read_vs_fio": ours["read_GBps"] / fio_median["read"] if fio_median["read"] else None,
                "pipeline_over_slowest_stage": piped["step"]["median"] / slowest,
                "swapper_write_GBps": ours["write_GBps"], "swapper_read_GBps": ours["read_GBps"],
                "fio_write_GBps": fio_median["write"], "fio_read_GBps": fio_median["read"],
                "multipath_speedup": paths["speedup"], "multipath_target": paths["target"],
                "nvme_bytes_saved_by_order": order["saved"], "nvme_bytes_saved_predicted": order["predicted"]}
    print("headline:", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    config = {"file_bytes": size, "block_size": args.block_size, "workers": args.workers, "rounds": rounds,
              "quick": args.quick, "subgroups": subgroups, "numel": numel}
    result_rows = [{"kind": "sequential", **r} for r in rows] + [{"kind": "fio best", **fio_best},
                                                                 {"kind": "pipeline", **piped},
                                                                 {"kind": "multipath", **paths},
                                                                 {"kind": "order", **order}]
    print(f"wrote {write('swapper', result_rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
