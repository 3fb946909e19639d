"""Host<->device copy bandwidth, pinned against pageable, on this machine's device.

On a CUDA machine this measures the real link (PCIe or NVLink-C2C); without one it measures the
simulated device, whose figures follow its link model (2 GB/s, pageable 2x slower) and only check the
plumbing. Pinned and pageable copies of each size run interleaved in one process.

Headline (bench/results/copy_bandwidth.json; copy_bandwidth_cuda.json on a GPU), from this run's rows at the
largest size:
    pinned_h2d_GBps, pinned_d2h_GBps, pinned_over_pageable_h2d, pinned_over_pageable_d2h

    python bench/copy_bandwidth.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import device  # noqa: E402
from minioffload.machine import measure as hardware  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds (under a minute)")
    args = parser.parse_args()
    sizes = [1 << 20, 64 << 20] if args.quick else [1 << 16, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    rounds = 3 if args.quick else 5
    with device("auto") as dev:
        contenders = {(direction, pinned): (lambda d=direction, p=pinned: {
            r["bytes"]: r["bytes_per_s"] for r in hardware.copy_bandwidth(dev, sizes, p, d, repeats=3)})
            for direction in ("h2d", "d2h") for pinned in (True, False)}
        results = interleaved(contenders, rounds)
        kind = dev.kind
    rows = [{"direction": d, "pinned": p, "bytes": n, "bytes_per_s": stats([run[n] for run in runs])}
            for (d, p), runs in results.items() for n in sizes]
    rate = {(r["direction"], r["pinned"], r["bytes"]): r["bytes_per_s"]["median"] for r in rows}
    big = max(sizes)
    headline = {"device": kind,
                "pinned_h2d_GBps": rate["h2d", True, big] / 1e9, "pinned_d2h_GBps": rate["d2h", True, big] / 1e9,
                "pinned_over_pageable_h2d": rate["h2d", True, big] / rate["h2d", False, big],
                "pinned_over_pageable_d2h": rate["d2h", True, big] / rate["d2h", False, big],
                # on the sim these read back its own model (SimDevice.pageable_slowdown), not a measurement
                "what_it_measures": "the sim's link model and pageable_slowdown parameter (plumbing check)"
                if kind == "sim" else "this GPU's link"}
    print(f"copy bandwidth on the {kind} device, {rounds} interleaved rounds (median GB/s [min, max])")
    print(f"{'direction':<10}{'memory':<10}" + "".join(f"{size_label(n):>22}" for n in sizes))
    for (d, p) in results:
        cells = [next(r["bytes_per_s"] for r in rows if (r["direction"], r["pinned"], r["bytes"]) == (d, p, n))
                 for n in sizes]
        print(f"{d:<10}{'pinned' if p else 'pageable':<10}" + "".join(
            f"{c['median'] / 1e9:>8.2f} [{c['min'] / 1e9:5.2f},{c['max'] / 1e9:6.2f}]" for c in cells))
    print("headline:", ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    name = "copy_bandwidth" if kind == "sim" else "copy_bandwidth_cuda"  # a GPU's figures beside the sim's
    print(f"wrote {write(name, rows, headline, {'sizes': sizes, 'rounds': rounds, 'quick': args.quick})}")
    return 0


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


if __name__ == "__main__":
    sys.exit(common.run(main))
