"""The hybrid CPU-GPU update: update-phase time against gpu_fraction and stride, and the model's prediction.

A flat model (equal parameter tensors, one per subgroup) gets a gradient from a cheap backward; each round
times the update phase (OffloadAdam.step() until the device is idle) for the CPU-only update and every split,
interleaved. The model of chapter 5: the CPU updates r_c params/s (measured here, from the CPU-only rows), the
dynamic device path r_g = link bandwidth / 12 B per param (its Adam, `adam_rate`, is faster); the best
fraction is r_g / (r_c + r_g) and the best speedup (r_c + r_g) / r_c.

On the sim device the CPU Adam runs on one thread (`--cpu-threads`), leaving the second core to the sim's
own copies and device-side Adam, which are real work on this machine too. On CUDA the same sweep runs with
the GPU's real link and torch's fused Adam.

Headline (bench/results/hybrid.json):
    best_speedup_vs_cpu_only   CPU-only update phase / the best stride's (the dynamic path; the target)
    predicted_speedup          (r_c + r_g) / r_c
    model_relative_error       |best measured update phase - predicted| / predicted, at the measured r_c
    best_static_speedup        the same for gpu_fraction (state kept on the device: no copies, more memory)

    measured_device_rate       params / the stride-1 update phase: the device path's real rate here
    model_relative_error_measured_rates   the same error when the model uses that measured rate

    python bench/hybrid.py [--quick] [--link-gbps 2] [--cpu-threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload import layout  # noqa: E402
from minioffload.devices import Link, device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.kernels.adam import set_threads  # noqa: E402
from minioffload.machine import measure as hardware
from minioffload.predict import hybrid_split  # noqa: E402


def make_run(kind: str, link: Link, tensors: int, numel: int, split: dict):
    dev = device("sim", h2d=link, d2h=link) if kind == "sim" else device("cuda")
    torch.manual_seed(0)
    params = dev.place([torch.nn.Parameter(torch.randn(numel) * 0.02) for _ in range(tensors)])  # moved on CUDA
    opt = OffloadAdam(params, dev, lr=1e-3, subgroup_numel=numel, **split)
    weights = dev.to_device(torch.linspace(0.5, 1.5, numel))

    def one_update() -> dict:
        sum((p * weights).sum() for p in params).backward()  # every gradient: `weights`, cheaply
        dev.synchronize()  # the gradient copies of backward are not part of the update phase
        start = time.perf_counter()
        opt.step()
        dev.synchronize()
        seconds = time.perf_counter() - start
        opt.zero_grad()
        return {"update_s": seconds}

    return one_update, dev


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a smaller model (under a minute)")
    parser.add_argument("--link-gbps", type=common.positive(float), default=2.0,
                        help="sim link bandwidth each way, GB/s")
    parser.add_argument("--cpu-threads", type=common.positive(int), default=1, help="threads of the CPU Adam (sim)")
    parser.add_argument("--device", choices=("auto", "sim", "cuda"), default="auto")
    args = parser.parse_args()
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "sim")
    rounds = 3 if args.quick else 7
    tensors, numel = (12, 1 << 19) if args.quick else (24, 1 << 20)
    if kind == "cuda":  # long enough to time on a GPU server; every split holds its own pinned state (~20 B/param)
        tensors, numel = (24, 1 << 21) if args.quick else (48, 1 << 22)
    else:
        set_threads(args.cpu_threads)
    link = Link(bandwidth=args.link_gbps * 1e9)
    splits = {"cpu only": {}, **{f"stride {k}": {"stride": k} for k in (1, 2, 3, 4, 6)},
              **{f"fraction {f:g}": {"gpu_fraction": f} for f in (0.25, 0.5, 0.75, 1.0)}}
    runs, devices = {}, []
    for name, split in splits.items():
        runs[name], dev = make_run(kind, link, tensors, numel, split)
        devices.append(dev)
    results = interleaved(runs, rounds)
    for dev in devices:
        dev.close()

    params = tensors * numel
    medians = {name: stats([m["update_s"] for m in measured])["median"] for name, measured in results.items()}
    cpu_only = medians["cpu only"]
    cpu_rate = params / cpu_only
    device_rate = hybrid_split.link_rate(args.link_gbps * 1e9) if kind == "sim" else None
    if kind == "cuda":  # the model's r_g from this GPU's link, measured: a pinned 256 MiB copy each way
        with device("cuda") as dev:
            link_bytes_per_s = min(hardware.copy_bandwidth(dev, [256 << 20], True, direction)[0]["bytes_per_s"]
                                   for direction in ("h2d", "d2h"))
        device_rate = hybrid_split.link_rate(link_bytes_per_s)
    predicted = hybrid_split.best_split(cpu_rate, device_rate)
    rows = []
    print(f"update phase of {params / 1e6:.1f}M params in {tensors} subgroups on the {kind} device"
          f"{f' ({args.link_gbps:g} GB/s link, CPU Adam on {args.cpu_threads} thread(s))' if kind == 'sim' else ''}, "
          f"{rounds} interleaved rounds, medians")
    print(f"{'split':<14}{'device share':>13}{'update ms':>11}{'speedup':>9}{'model ms':>10}")
    for name, split in splits.items():
        resident, streamed = layout.device_subgroups(tensors, split.get("gpu_fraction"), split.get("stride"))
        share = (len(resident) + len(streamed)) / tensors
        rate = device_rate if streamed else (dev.adam_rate if kind == "sim" else float("inf"))
        model_s = hybrid_split.update_time(share, params, cpu_rate, rate) if share else cpu_only
        row = {"split": name, **split, "device_share": share, "update_s": stats([m["update_s"] for m in
                                                                                 results[name]]),
               "speedup_vs_cpu_only": cpu_only / medians[name], "model_update_s": model_s}
        rows.append(row)
        print(f"{name:<14}{share:>13.2f}{medians[name] * 1e3:>11.1f}{row['speedup_vs_cpu_only']:>9.2f}"
              f"{model_s * 1e3:>10.1f}")
    strides = [row for row in rows if "stride" in row]
    static = [row for row in rows if "gpu_fraction" in row]
    best = max(strides, key=lambda row: row["speedup_vs_cpu_only"])
    predicted_s = cpu_only / predicted["speedup"]
    measured_device_rate = params / medians["stride 1"]
    with_measured = cpu_only / hybrid_split.best_split(cpu_rate, measured_device_rate)["speedup"]
    headline = {"best_speedup_vs_cpu_only": best["speedup_vs_cpu_only"], "best_stride": best["stride"],
                "predicted_speedup": predicted["speedup"], "predicted_fraction": predicted["fraction"],
                "predicted_stride": hybrid_split.nearest_stride(predicted["fraction"]),
                "model_relative_error": abs(best["update_s"]["median"] - predicted_s) / predicted_s,
                "measured_device_rate": measured_device_rate,
                "model_relative_error_measured_rates": abs(best["update_s"]["median"] - with_measured) / with_measured,
                "best_static_speedup": max(row["speedup_vs_cpu_only"] for row in static),
                "cpu_rate_params_per_s": cpu_rate, "device_rate_params_per_s": device_rate, "device": kind,
                "link_GBps": args.link_gbps if kind == "sim" else link_bytes_per_s / 1e9}
    print("headline:", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    config = {"tensors": tensors, "numel": numel, "rounds": rounds, "quick": args.quick,
              "cpu_threads": args.cpu_threads if kind == "sim" else None}
    print(f"wrote {write('hybrid' if kind == 'sim' else 'hybrid_cuda', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
