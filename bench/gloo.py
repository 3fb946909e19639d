"""What one collective costs between 2 processes on this machine (gloo, loopback): its fixed cost and its bandwidth.

The step model charges a collective `collective_latency + bytes sent / interconnect` (predict/stepmodel.py); on the
simulated device the ranks are processes on one machine and gloo carries their collectives. Both figures are taken
here the way the runtime meets them: an all-reduce of one value (nothing but the fixed cost) and a broadcast of
16 MiB of fp32 (the bytes a rank sends, shards.ring_bytes, over its time less the fixed cost). Rounds alternate the
two; each figure is the median of 3 runs, with the spread.

Headline (bench/results/gloo.json):
    collective_latency_s      seconds per collective of a few bytes
    interconnect_bytes_per_s  a 16 MiB broadcast's bytes sent per rank (shards.ring_bytes) per second beyond the fixed
                              cost

    python bench/gloo.py [--runs N]

`distributed.py` measures both again beside its own runs and gives them to the step model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import stats, write  # noqa: E402

BROADCAST_BYTES = 16 << 20
SMALL_CALLS, BIG_CALLS = 200, 10


def _rank_main() -> None:
    """Under torchrun: time the two collectives; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    one, big = torch.zeros(1), torch.zeros(BROADCAST_BYTES // 4)
    small, large = [], []
    for round_ in range(3):  # round 0 warms up
        for _ in range(SMALL_CALLS // 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(one)
            if round_:
                small.append(time.perf_counter() - start)
        for _ in range(BIG_CALLS // 2):
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(big, src=0)
            if round_:
                large.append(time.perf_counter() - start)
    latency = statistics.median(small)
    from minioffload.predict.shards import ring_bytes

    # the step model's count of what one rank sends in it, over the time beyond the fixed cost
    bandwidth = ring_bytes("broadcast", BROADCAST_BYTES, 2) / max(statistics.median(large) - latency, 1e-9)
    if dist.get_rank() == 0:
        print(json.dumps({"collective_latency_s": latency, "interconnect_bytes_per_s": bandwidth}))
    dist.destroy_process_group()


def measure() -> dict:
    """One measurement: 2 processes under torchrun; {"collective_latency_s", "interconnect_bytes_per_s"}."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--rank-main"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise RuntimeError(f"the gloo measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=common.positive(int), default=3, help="runs; the headline is their median")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        _rank_main()
        return 0
    rows = [measure() for _ in range(args.runs)]
    keys = ("collective_latency_s", "interconnect_bytes_per_s")
    spread = {key: stats([row[key] for row in rows]) for key in keys}
    headline = {key: spread[key]["median"] for key in keys}
    headline.update(runs=args.runs, spread=spread)
    print(f"gloo between 2 processes on this machine, {args.runs} run(s): "
          f"collective latency {headline['collective_latency_s'] * 1e6:.0f} us "
          f"[{spread['collective_latency_s']['min'] * 1e6:.0f}, {spread['collective_latency_s']['max'] * 1e6:.0f}], "
          f"16 MiB broadcast {headline['interconnect_bytes_per_s'] / 1e9:.2f} GB/s "
          f"[{spread['interconnect_bytes_per_s']['min'] / 1e9:.2f}, "
          f"{spread['interconnect_bytes_per_s']['max'] / 1e9:.2f}]")
    config = {"broadcast_bytes": BROADCAST_BYTES, "small_calls": SMALL_CALLS, "big_calls": BIG_CALLS}
    print(f"wrote {write('gloo', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
