"""Streamed weights on the simulated device: how much fetch time compute hides, and how large a model trains.

Part 1, hiding fetches. Training steps (forward, backward, OffloadAdam) of a GPT whose blocks take about as long
to copy up as to compute: the sim's link is set from a measured forward of one block so that fetching a block
takes half its forward (the step model says such a link hides every fetch at depth >= 1 but the first block's,
which nothing computes before). Contenders, interleaved in one process: the weights resident on the device, and
streamed from pinned host memory at prefetch depth 0, 1 and 2, and from NVMe (a swapper in a temporary
directory) at depth 2. Per contender and step: the step time, the time its weight copies took (the h2d spans),
and the time the compute waited for them (on the sim the compute is the host thread, which blocks in
`compute_waits_for` until a block has landed). The share of fetch time not hidden by compute is

    exposed_fetch_fraction = compute's wait for fetches / fetch time               (target at depth 2: <= 0.15)

beside the step model's prediction. The whole step costs more than that wait: the hooks' host work, and on the
sim fresh pages and cold caches for weights that were just copied (a resident model's weights stay in the CPU's
caches); `step_cost_over_fetch` = (step streamed - step resident) / fetch time reports it.

Part 2, the largest model trained. A 48-block GPT trains (OffloadAdam, recompute, prefetch 2) on a sim device
with a tenth of its weights' bytes; the losses of 3 steps must equal those of the same model on a large device.
    weights_over_device = weights / device memory                                  (target >= 4)

Part 3, why a 16-bit model keeps a rounded copy at home: the time to round one block's fp32 master to bf16 on the
CPU (what producing the compute copy on the way up would add to every fetch) beside the time to copy the rounded
block up a PCIe Gen4 link (25 GB/s): rounding per fetch would cost more than the fetch.

Headline (bench/results/streaming.json): part 1's figures are the median of 3 runs (median of 7 rounds each),
with the runs' spread; the step model's predicted exposed fraction for each depth sits beside the measured one.

    python bench/streaming.py [--quick] [--runs N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import Link, device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.model.activations import Activations  # noqa: E402
from minioffload.model.gpt import GPT, GPTConfig  # noqa: E402
from minioffload.model.streaming import ParamStreamer  # noqa: E402
from minioffload.nvme.swapper import Swapper  # noqa: E402

VOCAB, BATCH = 64, 4
PCIE4 = 25e9  # B/s, a Gen4 x16 link's achieved pinned bandwidth (machine/profiles.py's pcie4_achieved)
CONTENDERS = {"resident": None, "host, depth 0": ("host", 0), "host, depth 1": ("host", 1),
              "host, depth 2": ("host", 2), "nvme, depth 2": ("nvme", 2)}


def gpt(n_layer: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=n_layer, n_head=4, n_embd=256, dropout=0.0))


def block_forward_s(model: GPT) -> float:
    """The median forward time of one block on this CPU (the link is set from it)."""
    x = torch.randn(BATCH, model.cfg.block_size, model.cfg.n_embd)
    times = []
    with torch.no_grad():
        for _ in range(9):
            start = time.perf_counter()
            model.blocks[0](x)
            times.append(time.perf_counter() - start)
    return stats(times)["median"]


def make_run(setting, link: Link, n_layer: int, disk: Path):
    """One contender: a device of its own, and a function that runs one training step on it."""
    dev = device("sim", h2d=link, d2h=link, memory_bytes=8 << 30)
    model, swapper, streamer = gpt(n_layer), None, None
    if setting is None:
        dev.place(model)
    else:
        home, depth = setting
        if home == "nvme":
            swapper = Swapper(tempfile.mkdtemp(dir=disk))
        streamer = ParamStreamer(model, dev, prefetch=depth, home=home, swapper=swapper)
        waits = streamer._compute_waits

        def timed_wait(block):  # the sim's compute (the host) blocks here until the block has landed
            start = time.perf_counter()
            waits(block)
            waited[0] += time.perf_counter() - start
        streamer._compute_waits = timed_wait
    waited = [0.0]
    opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=1 << 20, streamer=streamer)
    generator = torch.Generator().manual_seed(0)

    def one_step() -> dict:
        x = torch.randint(0, VOCAB, (BATCH, model.cfg.block_size), generator=generator)
        first, waited[0] = len(dev.trace.spans), 0.0
        start = time.perf_counter()
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        dev.synchronize()
        seconds = time.perf_counter() - start
        fetch = sum(s.end - s.start for s in dev.trace.spans[first:] if s.name.startswith("h2d block"))
        return {"step_s": seconds, "fetch_s": fetch, "wait_s": waited[0]}

    def close() -> None:
        dev.close()
        if swapper is not None:
            swapper.close()

    return one_step, close


def hiding(link: Link, n_layer: int, rounds: int, disk: Path) -> dict[str, list[dict]]:
    runs, closers = {}, []
    for name, setting in CONTENDERS.items():
        runs[name], close = make_run(setting, link, n_layer, disk)
        closers.append(close)
    try:
        return interleaved(runs, rounds=rounds)
    finally:
        for close in closers:
            close()


def largest(n_layer: int, ratio: int, link: Link) -> dict:
    """Train a model `ratio` times the device's memory, streamed, and the same model on a large device."""
    losses = {}
    for name in ("streamed", "large device"):
        model = gpt(n_layer)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        capacity = weights // ratio if name == "streamed" else 8 << 30
        with device("sim", h2d=link, d2h=link, memory_bytes=capacity) as dev:
            streamer = None
            if name == "streamed":
                streamer = ParamStreamer(model, dev, prefetch=2)
            else:
                dev.place(model)
            Activations(model.blocks, "recompute", dev)
            opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=1 << 20, streamer=streamer)
            generator = torch.Generator().manual_seed(0)
            losses[name] = []
            for _ in range(3):
                x = torch.randint(0, VOCAB, (BATCH, model.cfg.block_size), generator=generator)
                _, loss = model(x, torch.roll(x, -1, dims=1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
            dev.synchronize()
            if name == "streamed":
                peak, device_bytes = dev.ledger.peak("device"), capacity
    return {"n_layer": n_layer, "weights_bytes": weights, "device_bytes": device_bytes, "device_peak_bytes": peak,
            "weights_over_device": weights / device_bytes, "losses": losses["streamed"],
            "losses_equal": losses["streamed"] == losses["large device"]}


def rounding(model: GPT) -> dict:
    """Round one block's fp32 master to bf16 on the CPU, against copying the rounded block up a Gen4 link."""
    numel = sum(p.numel() for p in model.blocks[0].parameters())
    master, rounded = torch.randn(numel), torch.empty(numel, dtype=torch.bfloat16)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        rounded.copy_(master)
        times.append(time.perf_counter() - start)
    round_s, fetch_s = stats(times)["median"], 2 * numel / PCIE4
    return {"block_params": numel, "round_s": round_s, "pcie4_fetch_s": fetch_s, "round_over_fetch": round_s / fetch_s}


def predicted_exposed(n_layer: int, link: Link, forward_s: float) -> dict[int, float | None]:
    """The step model's exposed fetch fraction per depth, for this shape, link and measured block forward."""
    from minioffload.machine import profiles
    from minioffload.predict import stepmodel

    model = gpt(n_layer)
    work = stepmodel.Workload.of(model, tokens=BATCH * model.cfg.block_size, precision="fp32")
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    flops = 2 * block_params * BATCH * model.cfg.block_size / forward_s  # what this CPU does, as the model's peak
    hw = profiles.probe().replace(peak_flops_fp32=flops, peak_flops_bf16=flops, link_h2d=link.bandwidth,
                                  link_d2h=link.bandwidth, link_latency=link.latency)
    out = {}
    for depth in (0, 1, 2):
        config = stepmodel.StepConfig(params_on="host", prefetch=depth, mfu=1.0)
        out[depth] = stepmodel.predict(work, hw, config).exposed_fetch_fraction
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of 3 rounds and a smaller large model")
    parser.add_argument("--runs", type=common.positive(int), default=3,
                        help="independent runs; each headline figure is their median, with their spread")
    args = parser.parse_args()
    rounds, run_count, n_layer, big_layers, ratio = (3, 1, 6, 24, 5) if args.quick else (7, args.runs, 12, 48, 10)
    torch.set_num_threads(1)  # compute on one core; the sim's copies (real memcpys on stream threads) on the other
    model = gpt(n_layer)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    forward_s = block_forward_s(model)
    link = Link(bandwidth=block_bytes / (0.5 * forward_s), latency=10e-6)  # a block's fetch: half its forward
    print(f"streamed weights: a {n_layer}-block GPT (hidden {model.cfg.n_embd}, {block_bytes / 2**20:.1f} MiB per "
          f"block), {BATCH} x {model.cfg.block_size} tokens; a block's forward {forward_s * 1e3:.2f} ms, so the sim "
          f"link is {link.bandwidth / 1e9:.2f} GB/s; {run_count} runs of {rounds} interleaved rounds")
    predicted = predicted_exposed(n_layer, link, forward_s)
    rows, per_run = [], []
    with tempfile.TemporaryDirectory() as disk:
        for run in range(run_count):
            results = hiding(link, n_layer, rounds, Path(disk))
            resident = stats([r["step_s"] for r in results["resident"]])["median"]
            print(f"run {run + 1}: {'weights':<16}{'step ms':>9}{'(min-max)':>16}{'fetch ms':>10}{'wait ms':>9}"
                  f"{'exposed':>9}{'model':>7}{'step cost':>11}")
            figures = {}
            for name, setting in CONTENDERS.items():
                times = stats([r["step_s"] for r in results[name]])
                fetch = stats([r["fetch_s"] for r in results[name]])
                wait = stats([r["wait_s"] for r in results[name]])
                exposed = wait["median"] / fetch["median"] if fetch["median"] else None
                cost = (times["median"] - resident) / fetch["median"] if fetch["median"] else None
                model_says = predicted.get(setting[1]) if setting else None
                row = {"run": run, "weights": name, "step_s": times, "fetch_s": fetch, "wait_s": wait,
                       "exposed_fetch_fraction": exposed, "model_exposed_fetch_fraction": model_says,
                       "step_cost_over_fetch": cost}
                rows.append(row)
                figures[name] = row
                spread = f"({times['min'] * 1e3:.1f}-{times['max'] * 1e3:.1f})"
                print(f"       {name:<16}{times['median'] * 1e3:>9.1f}{spread:>16}{fetch['median'] * 1e3:>10.1f}"
                      f"{wait['median'] * 1e3:>9.1f}{'' if exposed is None else f'{exposed:.2f}':>9}"
                      f"{'' if model_says is None else f'{model_says:.2f}':>7}"
                      f"{'' if cost is None else f'{cost:.2f}':>11}")
            per_run.append(figures)
    print(f"training a {big_layers}-block GPT on a device with 1/{ratio} of its weights' bytes ...")
    big = largest(big_layers, ratio, link)
    cost = rounding(model)

    def across_runs(name: str, key: str = "exposed_fetch_fraction") -> dict:
        return stats([figures[name][key] for figures in per_run])

    headline = {"exposed_fetch_fraction": across_runs("host, depth 2"),
                "exposed_fetch_fraction_depth0": across_runs("host, depth 0"),
                "exposed_fetch_fraction_depth1": across_runs("host, depth 1"),
                "exposed_fetch_fraction_nvme": across_runs("nvme, depth 2"),
                "model_exposed_fetch_fraction": predicted.get(2),
                "step_cost_over_fetch": across_runs("host, depth 2", "step_cost_over_fetch"),
                "weights_over_device": big["weights_over_device"], "largest_losses_equal": big["losses_equal"],
                "round_over_fetch_pcie4": cost["round_over_fetch"]}
    exposed = headline["exposed_fetch_fraction"]
    print(f"depth 2: {exposed['median']:.2f} of the fetch time exposed ({exposed['min']:.2f}-{exposed['max']:.2f} "
          f"over {run_count} runs; target <= 0.15; the model says {predicted.get(2):.2f}); the whole step costs "
          f"{headline['step_cost_over_fetch']['median']:.2f} of the fetch time more than resident weights'")
    print(f"largest: {big['weights_bytes'] / 2**20:.0f} MiB of weights trained on {big['device_bytes'] / 2**20:.1f} "
          f"MiB ({big['weights_over_device']:.1f}x; target >= 4; peak {big['device_peak_bytes'] / 2**20:.1f} MiB), "
          f"losses {'equal to' if big['losses_equal'] else 'DIFFERENT from'} the large device's")
    print(f"rounding a block to bf16 on the CPU: {cost['round_s'] * 1e3:.2f} ms, {cost['round_over_fetch']:.1f}x its "
          "copy up a PCIe Gen4 link: the rounded copy is kept at home")
    config = {"n_layer": n_layer, "n_embd": model.cfg.n_embd, "block_size": model.cfg.block_size, "batch": BATCH,
              "block_bytes": block_bytes, "block_forward_s": forward_s, "link_GBps": link.bandwidth / 1e9,
              "rounds": rounds, "runs": run_count, "torch_threads": 1, "largest": big, "rounding": cost}
    print(f"wrote {write('streaming', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
