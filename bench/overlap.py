"""How well the chunk pipeline hides copies behind compute on the simulated device.

Contenders, run interleaved in one process: `serial`, `single_buffer`, `overlapped` with 2 buffers
(double-buffered) and with 3. Per run: wall time, the busiest lane's busy time, and their ratio
(1.0 = perfect overlap: the pipeline takes exactly as long as its busiest stage). Copy and compute
per chunk take about the same time (8 MiB over the 2 GB/s sim link ~ 4.2 ms; compute padded to 4 ms).

Headline (bench/results/overlap.json), from the rows of this run:
    overlap_ratio       median makespan / busiest-lane time of the double-buffered pipeline
    speedup_vs_serial   median serial time / median double-buffered time
plus the same two figures for three buffers.

    python bench/overlap.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import (
    device,  # noqa: E402
    pipeline,  # noqa: E402
)


def scale_and_shift(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, 3, out=out).add_(1)


def run_once(version, chunks: int, numel: int, kernel_seconds: float) -> dict:
    with device("sim") as dev:
        chunks_in = [dev.host_empty(numel) for _ in range(chunks)]
        for k, chunk in enumerate(chunks_in):
            chunk.fill_(k)
        chunks_out = [dev.host_empty(numel) for _ in range(chunks)]
        dev.trace.clear()
        start = time.perf_counter()
        version(dev, chunks_in, chunks_out, scale_and_shift, kernel_seconds)
        wall = time.perf_counter() - start
        lane, busy = dev.trace.busiest_lane()
        correct = all(torch.equal(o, r) for o, r in
                      zip(chunks_out, pipeline.reference(chunks_in, scale_and_shift), strict=True))
        return {"wall_s": wall, "makespan_s": dev.trace.makespan(), "busiest_lane": lane, "busiest_s": busy,
                "overlap_fraction": dev.trace.overlap_fraction(), "correct": correct}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and chunks (under a minute)")
    args = parser.parse_args()
    chunks, rounds = (16, 3) if args.quick else (32, 7)
    numel, kernel_seconds = 2 << 20, 0.004
    versions = {"serial": pipeline.serial, "single_buffer": pipeline.single_buffer,
                "overlapped_2": functools.partial(pipeline.overlapped, buffers=2),
                "overlapped_3": functools.partial(pipeline.overlapped, buffers=3)}
    contenders = {name: functools.partial(run_once, fn, chunks, numel, kernel_seconds) for name, fn in versions.items()}
    results = interleaved(contenders, rounds)

    rows = []
    for name, runs in results.items():
        rows.append({"version": name, "rounds": len(runs), "correct": all(r["correct"] for r in runs),
                     "wall_s": stats([r["wall_s"] for r in runs]),
                     "busiest_s": stats([r["busiest_s"] for r in runs]),
                     "ratio": stats([r["makespan_s"] / r["busiest_s"] for r in runs]),
                     "overlap_fraction": stats([r["overlap_fraction"] for r in runs])})
    by = {row["version"]: row for row in rows}
    serial = by["serial"]["wall_s"]["median"]
    headline = {
        "overlap_ratio": by["overlapped_2"]["ratio"]["median"],
        "speedup_vs_serial": serial / by["overlapped_2"]["wall_s"]["median"],
        "overlap_ratio_3_buffers": by["overlapped_3"]["ratio"]["median"],
        "speedup_vs_serial_3_buffers": serial / by["overlapped_3"]["wall_s"]["median"],
        "ideal_ratio": (chunks + 2) / chunks,  # fill and drain: two stages' worth of time no schedule hides
        "all_correct": all(row["correct"] for row in rows),
    }

    print(f"chunk pipeline on the sim device: {chunks} chunks of {numel * 4 >> 20} MiB, compute "
          f"{kernel_seconds * 1e3:g} ms per chunk, {rounds} interleaved rounds (median [min, max])")
    print(f"{'version':<15}{'wall ms':>22}{'ratio':>22}{'vs serial':>11}{'correct':>9}")
    for row in rows:
        w, r = row["wall_s"], row["ratio"]
        print(f"{row['version']:<15}{w['median'] * 1e3:>8.1f} [{w['min'] * 1e3:5.1f},{w['max'] * 1e3:6.1f}]"
              f"{r['median']:>10.3f} [{r['min']:.3f},{r['max']:.3f}]{serial / w['median']:>10.2f}x"
              f"{str(row['correct']):>9}")
    print("headline:", ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    path = write("overlap", rows, headline, {"chunks": chunks, "numel": numel, "kernel_seconds": kernel_seconds,
                                              "rounds": rounds, "quick": args.quick})
    print(f"wrote {path}")
    return 0 if headline["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(common.run(main))
