"""CPU Adam, every version side by side: ours (NumPy reference, in-place, fused Numba, mixed single
pass), torch's three fp32 implementations, DeepSpeed's CPU Adam when installed, and the 7-stream
roofline, at several sizes and thread counts. Within each (size, threads), the fused contenders run
interleaved with each other, then the ones that allocate temporaries every step, interleaved too.

Headline (bench/results/adam.json), speed ratios from this run's medians at the largest size, most threads
(above 1 means ours is faster):
    fused_vs_torch_fused      torch AdamW(fused=True) time / adam_fused time
    fused_vs_deepspeed        DeepSpeedCPUAdam time / adam_fused time (null when deepspeed is not installed)
    mixed_vs_torch_composed   (upcast grad, torch fused step, downcast weights) time / adam_mixed time
    min_roofline_fraction     the lowest (28 B/param / time) / roofline over adam_fused and adam_mixed rows

DeepSpeed is optional: `pip install deepspeed ninja py-cpuinfo` adds it (its CPU op builds on first use,
about a minute); without it the row says "not installed".

    python bench/adam.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.kernels import adam
from minioffload.kernels.lowp import from_bits  # noqa: E402
from minioffload.machine import measure as hardware  # noqa: E402  (hardware._seven_streams: the roofline kernel)

FAST = ("adam_fused", "torch_fused", "deepspeed", "adam_mixed", "torch_three_pass", "roofline")
SLOW = ("adam_ref", "adam_inplace", "torch_default", "torch_foreach")
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
BYTES = {"fp32": 28, "mixed": 28, "three_pass": 40}  # bytes per parameter each kind must move


def deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # ImportError, or its op failing to build
        return None, f"not installed ({type(err).__name__})"
    return DeepSpeedCPUAdam, "installed"


def zeros(n: int) -> torch.Tensor:
    """NumPy-allocated memory for every contender's arrays, torch's optimizer state included: NumPy asks
    the kernel for transparent huge pages on large arrays and torch's allocator does not, a 10% difference
    in streaming speed here that must not decide the comparison."""
    return torch.from_numpy(np.zeros(n, np.float32))


def contenders(n: int, threads: int) -> tuple[dict, dict]:
    """Callables that each run one optimizer step on n parameters, and each one's bytes per parameter."""
    rng = np.random.default_rng(0)
    param = rng.standard_normal(n, dtype=np.float32)
    grad = (rng.standard_normal(n, dtype=np.float32) * 1e-2).astype(np.float32)
    exp_avg, exp_avg_sq = np.zeros(n, np.float32), np.zeros(n, np.float32)
    steps = {"count": 0}

    def ours(fn):
        def run():
            steps["count"] += 1
            fn(param, grad, exp_avg, exp_avg_sq, step=steps["count"], **HYPER)
        return run

    def torch_opt(**options):
        p = torch.nn.Parameter(torch.from_numpy(param.copy()))
        p.grad = torch.from_numpy(grad)
        opt = torch.optim.AdamW([p], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], **options)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": zeros(n), "exp_avg_sq": zeros(n)}
        return opt.step

    runs = {"adam_ref": ours(adam.adam_ref), "adam_inplace": ours(adam.adam_inplace),
            "adam_fused": ours(adam.adam_fused),
            "torch_default": torch_opt(foreach=False), "torch_foreach": torch_opt(foreach=True),
            "torch_fused": torch_opt(fused=True)}
    kinds = dict.fromkeys(runs, "fp32")

    cls, _ = deepspeed_adam()
    if cls is not None:
        p = torch.nn.Parameter(torch.from_numpy(param.copy()))
        p.grad = torch.from_numpy(grad)
        opt = cls([p], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
        opt.state[p] = {"step": 0, "exp_avg": zeros(n), "exp_avg_sq": zeros(n)}
        runs["deepspeed"] = opt.step
        kinds["deepspeed"] = "fp32"

    # mixed precision: bf16 gradient in, bf16 weights out, fp32 master and state
    grad_bf16 = from_bits(np.empty(n, np.uint16), "bf16")
    grad_bf16.copy_(torch.from_numpy(grad))
    weights_bf16 = from_bits(np.empty(n, np.uint16), "bf16")
    master = torch.from_numpy(param.copy())
    m16, v16 = zeros(n), zeros(n)
    mixed_steps = {"count": 0}

    def mixed():
        mixed_steps["count"] += 1
        adam.adam_mixed(master, grad_bf16, m16, v16, weights_bf16, dtype="bf16", step=mixed_steps["count"], **HYPER)

    composed_master = torch.nn.Parameter(torch.from_numpy(param.copy()))
    composed_master.grad = zeros(n)
    composed_opt = torch.optim.AdamW([composed_master], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                                     fused=True)
    composed_opt.state[composed_master] = {"step": torch.tensor(0.0), "exp_avg": zeros(n), "exp_avg_sq": zeros(n)}

    def three_pass():
        composed_master.grad.copy_(grad_bf16)  # pass 1: upcast the gradient (read 2 B, write 4 B)
        composed_opt.step()  # pass 2: fused fp32 step (28 B)
        weights_bf16.copy_(composed_master.detach())  # pass 3: downcast the weights (read 4 B, write 2 B)

    runs.update(adam_mixed=mixed, torch_three_pass=three_pass)
    kinds.update(adam_mixed="mixed", torch_three_pass="three_pass")
    # the roofline: Adam's 4-read, 3-write traffic with no arithmetic, timed in the same rounds
    streams = [np.ones(n, np.float32) for _ in range(4)]
    runs["roofline"] = lambda: hardware._seven_streams(*streams)
    kinds["roofline"] = "fp32"
    return runs, kinds


def timed(fn):
    def run() -> dict:
        start = time.perf_counter()
        fn()
        return {"seconds": time.perf_counter() - start}
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10M parameters only, 3 rounds (under a minute)")
    args = parser.parse_args()
    sizes = [10_000_000] if args.quick else [10_000_000, 50_000_000, 100_000_000]
    thread_counts = sorted({1, numba.config.NUMBA_NUM_THREADS})
    rounds = 3 if args.quick else 5
    _, deepspeed_status = deepspeed_adam()
    print(f"CPU Adam, {rounds} interleaved rounds per group, medians; DeepSpeedCPUAdam: {deepspeed_status}")

    rows = []
    for n in sizes:
        for threads in thread_counts:
            adam.set_threads(threads)
            torch.set_num_threads(threads)
            runs, kinds = contenders(n, threads)
            # The versions that allocate temporaries every step (page faults, the kernel zeroing fresh memory)
            # slow down whatever runs next to them, up to 2x here; so the fused contenders, which the headline
            # compares, are interleaved among themselves, and the allocating ones in a second group.
            results = {}
            for group in (FAST, SLOW):
                results.update(interleaved({name: timed(runs[name]) for name in group if name in runs}, rounds))
            roofline = 28 * n / stats([r["seconds"] for r in results["roofline"]])["median"]
            print(f"\n{n / 1e6:.0f}M params, {threads} thread(s): roofline {roofline / 1e9:.1f} GB/s "
                  f"({28 * n / roofline:.3f} s for 28 B/param)")
            print(f"{'version':<18}{'median s':>10}{'min':>8}{'max':>8}{'Mparams/s':>11}{'GB/s':>7}{'roofline':>9}")
            for name, runs_of in results.items():
                s = stats([r["seconds"] for r in runs_of])
                useful = BYTES[kinds[name]] * n / s["median"]
                row = {"params": n, "threads": threads, "version": name, "kind": kinds[name], "seconds": s,
                       "params_per_s": n / s["median"], "bytes_per_param": BYTES[kinds[name]],
                       "GB_per_s": useful / 1e9, "roofline_GB_per_s": roofline / 1e9,
                       "roofline_fraction": useful / roofline}
                rows.append(row)
                print(f"{name:<18}{s['median']:>10.4f}{s['min']:>8.4f}{s['max']:>8.4f}{n / s['median'] / 1e6:>11.0f}"
                      f"{row['GB_per_s']:>7.1f}{row['roofline_fraction']:>9.2f}")
            del runs, results

    def median(version, n, threads):
        row = next((r for r in rows if (r["version"], r["params"], r["threads"]) == (version, n, threads)), None)
        return None if row is None else row["seconds"]["median"]

    n, threads = max(sizes), max(thread_counts)
    fused = median("adam_fused", n, threads)
    deepspeed = median("deepspeed", n, threads)
    headline = {
        "at": {"params": n, "threads": threads},
        "fused_vs_torch_fused": median("torch_fused", n, threads) / fused,
        "fused_vs_deepspeed": None if deepspeed is None else deepspeed / fused,
        "mixed_vs_torch_composed": median("torch_three_pass", n, threads) / median("adam_mixed", n, threads),
        "min_roofline_fraction": min(r["roofline_fraction"] for r in rows
                                     if r["version"] in ("adam_fused", "adam_mixed")),
        "min_roofline_fraction_fused_fp32": min(r["roofline_fraction"] for r in rows if r["version"] == "adam_fused"),
        "min_roofline_fraction_mixed": min(r["roofline_fraction"] for r in rows if r["version"] == "adam_mixed"),
        "deepspeed": deepspeed_status,
    }
    print("\nheadline:", ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    config = {"sizes": sizes, "threads": thread_counts, "rounds": rounds, "quick": args.quick, "hyper": HYPER}
    print(f"wrote {write('adam', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
