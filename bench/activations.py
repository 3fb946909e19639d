"""Activation policies on the simulated device (or a GPU): step time and the device memory activations hold, per policy.

One step is a forward and a backward of a GPT whose activations dominate its memory (long sequences, a narrow
model), on a sim device whose link is fast enough that the model (predict/activation_cost.py) predicts the offload
copies hide entirely under compute. With `--device cuda` the same steps run on this machine's GPU and its real link,
and the model is given that GPU's measured fp32 matmul rate and pinned copy bandwidth: on a GPU this narrow a model
computes far faster than its activations cross the link, so the figures say how much offloading costs there, beside
what the model predicts for it. Contenders, interleaved in one process: keep, recompute, selective,
offload, offload_input. Per run: wall time, and the peak of what the device holds beyond the weights during
the step (the ledger: saved tensors counted while autograd holds them, copies in flight, tensors fetched back).
Not counted: what recompute and offload_input's forward, run again in backward, saves through checkpoint's own
hooks (about one block more at the peak), so their reductions are upper bounds.

Headline (bench/results/activations.json; activations_cuda.json with --device cuda): each figure the median of 3
runs (median of 7 rounds each), with the runs' spread:
    offload_overhead        offload step time / keep step time            (target <= 1.10)
    offload_peak_reduction  keep's activation peak / offload's            (target >= 3)
plus recompute's two figures, and per policy the model's predicted added time and device bytes per block.

    python bench/activations.py [--quick] [--runs N] [--device sim|cuda]
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

from minioffload.devices import Link, device  # noqa: E402
from minioffload.machine import measure as hardware
from minioffload.machine import profiles  # noqa: E402
from minioffload.model.activations import POLICIES, Activations  # noqa: E402
from minioffload.model.gpt import GPT, GPTConfig  # noqa: E402
from minioffload.predict import activation_cost
from minioffload.train.batches import BatchUploads  # noqa: E402

VOCAB = 64
POOL_BYTES = 512 << 20  # room for every block's saved tensors (about 40 MiB each here)


def held_peak(dev, since: int) -> int:
    """The most the device held during the events after index `since`, less what it held before them."""
    events = dev.ledger.history[since:]
    start = events[0].used - events[0].delta if events else dev.ledger.used("device")
    return max([start, *(e.used for e in events if e.tier == "device")]) - start


def make_run(policy: str, cfg: GPTConfig, batch_size: int, link: Link | None):
    """One policy on a device of its own: the sim with `link`, or (link None) the GPU."""
    dev = device("sim", h2d=link, d2h=link, memory_bytes=16 << 30) if link is not None else device("cuda")
    torch.manual_seed(0)
    model = dev.place(GPT(cfg))
    Activations(model.blocks, policy, dev, pool_bytes=POOL_BYTES)  # pinned once, reused every step
    generator = torch.Generator().manual_seed(0)
    uploads = BatchUploads(dev, 1)  # the sim: the batch as drawn; a GPU: up from a pinned buffer, not blocking

    def count_saved(tensor):  # (on a GPU every saved tensor of this model is on the device)
        return dev.adopt(tensor, "saved") if tensor.numel() >= 1024 else tensor

    def one_step() -> dict:
        x = torch.randint(0, VOCAB, (batch_size, cfg.block_size), generator=generator)
        uploads.send([(x,)])
        since = len(dev.ledger.history)
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(count_saved, lambda t: t):  # outside a policy's own hooks
            x, = uploads.get(0)
            _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        dev.synchronize()
        seconds = time.perf_counter() - start
        peak = held_peak(dev, since)
        model.zero_grad(set_to_none=True)
        return {"step_s": seconds, "peak_bytes": peak}

    return one_step, dev


def measure(cfg: GPTConfig, batch_size: int, link: Link | None, rounds: int) -> dict[str, list[dict]]:
    """One run: every policy on a device of its own, interleaved rounds."""
    runs, devices = {}, []
    for policy in POLICIES:
        runs[policy], dev = make_run(policy, cfg, batch_size, link)
        devices.append(dev)
    try:
        return interleaved(runs, rounds=rounds)
    finally:
        for dev in devices:
            dev.close()


def gpu_figures() -> tuple[float, float, float]:
    """This GPU's fp32 matmul FLOP/s (the fastest of 5 products of 4096 x 4096 matrices, with torch's settings: no
    TF32 unless the process turned it on) and its pinned copy bandwidth each way (bytes/s, 64 MiB copies): the model's
    peak and link."""
    a, b = torch.randn(4096, 4096, device="cuda"), torch.randn(4096, 4096, device="cuda")
    torch.mm(a, b)  # warm-up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    with device("cuda") as dev:
        h2d, d2h = (hardware.copy_bandwidth(dev, [64 << 20], True, direction)[0]["bytes_per_s"]
                    for direction in ("h2d", "d2h"))
    return 2 * 4096**3 / best, h2d, d2h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of 3 rounds (under a minute)")
    parser.add_argument("--runs", type=common.positive(int), default=3,
                        help="independent runs; each headline figure is their median, with their spread")
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim",
                        help="the simulated GPU, or this machine's CUDA GPU (results in activations_cuda.json)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU and a CUDA build of torch (this torch sees none): use --device "
                     "sim")
    rounds, run_count = (3, 1) if args.quick else (7, args.runs)
    batch_size = 8
    cfg = GPTConfig(vocab_size=VOCAB, block_size=256, n_layer=8, n_head=4, n_embd=128)
    if args.device == "sim":
        # compute on one core, so that the sim's copies (real memcpys on its stream threads) have the other, as a
        # GPU's copy engines are apart from its SMs; on 2 cores, compute on both would make every copy steal from it
        torch.set_num_threads(1)
        link = Link(bandwidth=20e9, latency=10e-6)  # fast: the model predicts every offload copy hidden
        flops, link_GBps = hardware.matmul_flops(dtype=torch.float32), link.bandwidth / 1e9
        hw = profiles.probe().replace(peak_flops_fp32=flops, link_h2d=link.bandwidth, link_d2h=link.bandwidth,
                                      link_latency=link.latency)
    else:
        link = None
        flops, h2d, d2h = gpu_figures()
        link_GBps = min(h2d, d2h) / 1e9
        hw = profiles.probe().replace(peak_flops_fp32=flops, link_h2d=h2d, link_d2h=d2h, shared_host=False)
    print(f"activation policies: a {cfg.n_layer}-block GPT, {batch_size} x {cfg.block_size} tokens, hidden "
          f"{cfg.n_embd}; {args.device} link {link_GBps:g} GB/s; {run_count} runs of {rounds} interleaved rounds")
    block = activation_cost.BlockShape(cfg.block_size, batch_size, cfg.n_embd, cfg.n_head, value_bytes=4)
    predicted = activation_cost.policy_costs(block, hw, mfu=1.0)
    rows, per_run = [], []
    for run in range(run_count):
        results = measure(cfg, batch_size, link, rounds)
        keep = stats([r["step_s"] for r in results["keep"]])["median"]
        keep_peak = stats([r["peak_bytes"] for r in results["keep"]])["median"]
        figures = {}
        print(f"run {run + 1}: {'policy':<15}{'step ms':>9}{'(min-max)':>16}{'x keep':>8}{'peak MiB':>10}"
              f"{'keep/peak':>10}{'model +ms/block':>17}")
        for policy in POLICIES:
            times = stats([r["step_s"] for r in results[policy]])
            peaks = stats([r["peak_bytes"] for r in results[policy]])
            row = {"run": run, "policy": policy, "step_s": times, "peak_bytes": peaks,
                   "time_vs_keep": times["median"] / keep, "peak_reduction": keep_peak / max(peaks["median"], 1),
                   "model_extra_s_per_block": predicted[policy].extra_s,
                   "model_device_bytes_per_block": predicted[policy].device_bytes}
            rows.append(row)
            figures[policy] = row
            spread = f"({times['min'] * 1e3:.1f}-{times['max'] * 1e3:.1f})"
            print(f"       {policy:<15}{times['median'] * 1e3:>9.1f}{spread:>16}{row['time_vs_keep']:>8.2f}"
                  f"{peaks['median'] / 2**20:>10.1f}{row['peak_reduction']:>10.1f}"
                  f"{predicted[policy].extra_s * 1e3:>17.2f}")
        per_run.append(figures)

    def across_runs(policy: str, key: str) -> dict:
        return stats([figures[policy][key] for figures in per_run])

    headline = {"offload_overhead": across_runs("offload", "time_vs_keep"),
                "offload_peak_reduction": across_runs("offload", "peak_reduction"),
                "recompute_overhead": across_runs("recompute", "time_vs_keep"),
                "recompute_peak_reduction": across_runs("recompute", "peak_reduction"),
                "offload_link_to_hide_GBps": activation_cost.offload_hidden_link(block, hw, mfu=1.0) / 1e9}
    over, down = headline["offload_overhead"], headline["offload_peak_reduction"]
    print(f"offload: {over['median']:.2f}x keep's step time ({over['min']:.2f}-{over['max']:.2f} over {run_count} "
          f"runs; target <= 1.10), {down['median']:.1f}x less held ({down['min']:.1f}-{down['max']:.1f}; target >= 3)")
    config = {"model": vars(cfg), "batch_size": batch_size, "link_GBps": link_GBps, "rounds": rounds,
              "runs": run_count, "pool_bytes": POOL_BYTES, "torch_threads": 1, "matmul_flops_fp32": flops}
    if args.device == "cuda":  # the sim's file keeps its keys as they were
        config.update(device="cuda", torch_threads=torch.get_num_threads())
    name = "activations" if args.device == "sim" else "activations_cuda"
    print(f"wrote {write(name, rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
