"""Streamed weights on the simulated device (or a GPU): how much fetch time compute hides, how large a model trains.

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

With `--device cuda` (results in streaming_cuda.json) the same three parts run on this machine's GPU: its link is
what it is (measured, for the step model), so part 1's GPT is wider (hidden 768, 8 x 256 tokens) to give a block's
forward about a fetch's time over PCIe; the compute's wait for a block is timed by CUDA events around it on the
compute stream (the host does not wait there); part 2 cannot shrink the GPU, so the streamer's budget is a tenth (a
fifth with --quick) of the weights and the ledger's peak says what the device held; part 3 also times the rounded
block's copy up this link.

    python bench/streaming.py [--quick] [--runs N] [--device sim|cuda]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import Link, device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.machine import measure as hardware  # noqa: E402
from minioffload.model.activations import Activations  # noqa: E402
from minioffload.model.gpt import GPT, GPTConfig  # noqa: E402
from minioffload.model.streaming import ParamStreamer  # noqa: E402
from minioffload.nvme.swapper import Swapper  # noqa: E402
from minioffload.train.batches import BatchUploads  # noqa: E402

VOCAB, BATCH = 64, 4
SHAPE = dict(block_size=64, n_head=4, n_embd=256)  # the sim's GPT, and part 2's on either device
PCIE4 = 25e9  # B/s, a Gen4 x16 link's achieved pinned bandwidth (machine/profiles.py's pcie4_achieved)
CONTENDERS = {"resident": None, "host, depth 0": ("host", 0), "host, depth 1": ("host", 1),
              "host, depth 2": ("host", 2), "nvme, depth 2": ("nvme", 2)}


@dataclass(frozen=True)
class Setup:
    """Part 1's device and GPT: the sim with the small GPT, or a GPU with a wider one (its block's forward then takes
    about as long as its fetch up a PCIe link)."""

    kind: str = "sim"
    shape: tuple = tuple(SHAPE.items())
    batch: int = BATCH

    @classmethod
    def cuda(cls) -> Setup:
        return cls("cuda", tuple(dict(block_size=256, n_head=12, n_embd=768).items()), 8)

    def device(self, link: Link):
        return device("sim", h2d=link, d2h=link, memory_bytes=8 << 30) if self.kind == "sim" else device("cuda")


def gpt(n_layer: int, shape: tuple = tuple(SHAPE.items())) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=n_layer, dropout=0.0, **dict(shape)))


def block_forward_s(model: GPT, setup: Setup = Setup()) -> float:
    """The median forward time of one block on this CPU (the link is set from it), or on the GPU."""
    if setup.kind == "cuda":
        return _gpu_block_forward_s(model, setup.batch)
    x = torch.randn(BATCH, model.cfg.block_size, model.cfg.n_embd)
    times = []
    with torch.no_grad():
        for _ in range(9):
            start = time.perf_counter()
            model.blocks[0](x)
            times.append(time.perf_counter() - start)
    return stats(times)["median"]


def _gpu_block_forward_s(model: GPT, batch: int) -> float:
    block = copy.deepcopy(model.blocks[0]).cuda()
    x = torch.randn(batch, model.cfg.block_size, model.cfg.n_embd, device="cuda")
    times = []
    with torch.no_grad():
        for _ in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            block(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return stats(times[3:])["median"]  # after a warm-up


def make_run(setting, link: Link, n_layer: int, disk: Path, setup: Setup = Setup()):
    """One contender: a device of its own, and a function that runs one training step on it."""
    dev = setup.device(link)
    model, swapper, streamer = gpt(n_layer, setup.shape), None, None
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

        def gpu_timed_wait(block):  # a GPU's compute stream stalls between these events; the host goes on
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            waits(block)
            end.record()
            gpu_waits.append((start, end))
        streamer._compute_waits = timed_wait if setup.kind == "sim" else gpu_timed_wait
    waited, gpu_waits = [0.0], []
    opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=1 << 20, streamer=streamer)
    generator = torch.Generator().manual_seed(0)
    uploads = BatchUploads(dev, 1)  # the sim: the batch as drawn; a GPU: up from a pinned buffer, not blocking

    def one_step() -> dict:
        x = torch.randint(0, VOCAB, (setup.batch, model.cfg.block_size), generator=generator)
        uploads.send([(x,)])
        first, waited[0] = len(dev.trace.spans), 0.0
        start = time.perf_counter()
        x, = uploads.get(0)
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        dev.synchronize()
        seconds = time.perf_counter() - start
        fetch = sum(s.end - s.start for s in dev.trace.spans[first:] if s.name.startswith("h2d block"))
        if gpu_waits:
            waited[0] = sum(began.elapsed_time(ended) for began, ended in gpu_waits) / 1e3
            gpu_waits.clear()
        return {"step_s": seconds, "fetch_s": fetch, "wait_s": waited[0]}

    def close() -> None:
        dev.close()
        if swapper is not None:
            swapper.close()

    return one_step, close


def hiding(link: Link, n_layer: int, rounds: int, disk: Path, setup: Setup = Setup()) -> dict[str, list[dict]]:
    runs, closers = {}, []
    for name, setting in CONTENDERS.items():
        runs[name], close = make_run(setting, link, n_layer, disk, setup)
        closers.append(close)
    try:
        return interleaved(runs, rounds=rounds)
    finally:
        for close in closers:
            close()


def largest(n_layer: int, ratio: int, link: Link, kind: str = "sim") -> dict:
    """Train a model `ratio` times the device's memory, streamed, and the same model on a large device. A GPU's
    memory cannot shrink: there the streamer's budget is 1/ratio of the weights (`device_bytes`), and both runs use
    the whole GPU."""
    losses = {}
    for name in ("streamed", "large device"):
        model = gpt(n_layer)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        capacity = weights // ratio if name == "streamed" else 8 << 30
        sim = kind == "sim"
        with (device("sim", h2d=link, d2h=link, memory_bytes=capacity) if sim else device("cuda")) as dev:
            streamer = None
            if name == "streamed":
                streamer = ParamStreamer(model, dev, prefetch=2, budget_bytes=None if sim else capacity)
            else:
                dev.place(model)
            Activations(model.blocks, "recompute", dev)
            opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=1 << 20, streamer=streamer)
            generator = torch.Generator().manual_seed(0)
            losses[name] = []
            for _ in range(3):
                x = dev.to_device(torch.randint(0, VOCAB, (BATCH, model.cfg.block_size), generator=generator))
                _, loss = model(x, torch.roll(x, -1, dims=1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
            dev.synchronize()
            if name == "streamed":
                peak, device_bytes = dev.ledger.peak("device"), capacity
    out = {"n_layer": n_layer, "weights_bytes": weights, "device_bytes": device_bytes, "device_peak_bytes": peak,
           "weights_over_device": weights / device_bytes, "losses": losses["streamed"],
           "losses_equal": losses["streamed"] == losses["large device"]}
    if not sim:  # a different kernel choice for the streamed weights' addresses may round differently
        out["losses_max_abs_difference"] = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    return out


def rounding(model: GPT, kind: str = "sim") -> dict:
    """Round one block's fp32 master to bf16 on the CPU, against copying the rounded block up a Gen4 link (and, on a
    GPU, up this machine's link, timed)."""
    numel = sum(p.numel() for p in model.blocks[0].parameters())
    master, rounded = torch.randn(numel), torch.empty(numel, dtype=torch.bfloat16)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        rounded.copy_(master)
        times.append(time.perf_counter() - start)
    round_s, fetch_s = stats(times)["median"], 2 * numel / PCIE4
    out = {"block_params": numel, "round_s": round_s, "pcie4_fetch_s": fetch_s, "round_over_fetch": round_s / fetch_s}
    if kind == "cuda":
        with device("cuda") as dev:
            link_s = hardware.copy_bandwidth(dev, [2 * numel // 4 * 4], True, "h2d", repeats=15)[0]["seconds"]
        out.update(link_fetch_s=link_s, round_over_link_fetch=round_s / link_s)
    return out


def predicted_exposed(n_layer: int, link: Link, forward_s: float, setup: Setup = Setup()) -> dict[int, float | None]:
    """The step model's exposed fetch fraction per depth, for this shape, link and measured block forward."""
    from minioffload.machine import profiles
    from minioffload.predict import stepmodel

    model, batch = gpt(n_layer, setup.shape), setup.batch
    work = stepmodel.Workload.of(model, tokens=batch * model.cfg.block_size, precision="fp32")
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    flops = 2 * block_params * batch * model.cfg.block_size / forward_s  # what this CPU does, as the model's peak
    hw = profiles.probe().replace(peak_flops_fp32=flops, peak_flops_bf16=flops, link_h2d=link.bandwidth,
                                  link_d2h=link.bandwidth, link_latency=link.latency)
    if setup.kind == "cuda":  # a GPU computes apart from the host (the sim's profile shares the host's cores)
        hw = hw.replace(shared_host=False)
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
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim",
                        help="the simulated GPU, or this machine's CUDA GPU (results in streaming_cuda.json)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU and a CUDA build of torch (this torch sees none): use --device "
                     "sim")
    rounds, run_count, n_layer, big_layers, ratio = (3, 1, 6, 24, 5) if args.quick else (7, args.runs, 12, 48, 10)
    setup = Setup() if args.device == "sim" else Setup.cuda()
    if setup.kind == "sim":
        torch.set_num_threads(1)  # compute on one core; the sim's copies (real memcpys on stream threads) on the other
    model = gpt(n_layer, setup.shape)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    forward_s = block_forward_s(model, setup)
    if setup.kind == "sim":
        link = Link(bandwidth=block_bytes / (0.5 * forward_s), latency=10e-6)  # a block's fetch: half its forward
    else:  # the GPU's own link, measured for the step model
        with device("cuda") as dev:
            measured = hardware.copy_bandwidth(dev, [block_bytes], True, "h2d")[0]["bytes_per_s"]
        link = Link(bandwidth=measured, latency=10e-6)
    print(f"streamed weights: a {n_layer}-block GPT (hidden {model.cfg.n_embd}, {block_bytes / 2**20:.1f} MiB per "
          f"block), {setup.batch} x {model.cfg.block_size} tokens; a block's forward {forward_s * 1e3:.2f} ms, "
          f"{'so the sim link is' if setup.kind == 'sim' else 'the GPU link measured at'} "
          f"{link.bandwidth / 1e9:.2f} GB/s; {run_count} runs of {rounds} interleaved rounds")
    predicted = predicted_exposed(n_layer, link, forward_s, setup)
    rows, per_run = [], []
    with tempfile.TemporaryDirectory() as disk:
        for run in range(run_count):
            results = hiding(link, n_layer, rounds, Path(disk), setup)
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
    big = largest(big_layers, ratio, link, setup.kind)
    cost = rounding(model, setup.kind)

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
    if setup.kind == "cuda":
        headline.update(round_over_fetch_this_link=cost["round_over_link_fetch"],
                        largest_losses_max_abs_difference=big["losses_max_abs_difference"])
    exposed = headline["exposed_fetch_fraction"]
    print(f"depth 2: {exposed['median']:.2f} of the fetch time exposed ({exposed['min']:.2f}-{exposed['max']:.2f} "
          f"over {run_count} runs; target <= 0.15; the model says {predicted.get(2):.2f}); the whole step costs "
          f"{headline['step_cost_over_fetch']['median']:.2f} of the fetch time more than resident weights'")
    print(f"largest: {big['weights_bytes'] / 2**20:.0f} MiB of weights trained on {big['device_bytes'] / 2**20:.1f} "
          f"MiB ({big['weights_over_device']:.1f}x; target >= 4; peak {big['device_peak_bytes'] / 2**20:.1f} MiB), "
          f"losses {'equal to' if big['losses_equal'] else 'DIFFERENT from'} the large device's")
    print(f"rounding a block to bf16 on the CPU: {cost['round_s'] * 1e3:.2f} ms, {cost['round_over_fetch']:.1f}x its "
          "copy up a PCIe Gen4 link: the rounded copy is kept at home")
    config = {"n_layer": n_layer, "n_embd": model.cfg.n_embd, "block_size": model.cfg.block_size, "batch": setup.batch,
              "block_bytes": block_bytes, "block_forward_s": forward_s, "link_GBps": link.bandwidth / 1e9,
              "rounds": rounds, "runs": run_count, "torch_threads": 1, "largest": big, "rounding": cost}
    if setup.kind == "cuda":  # the sim's file keeps its keys as they were
        config.update(device="cuda", torch_threads=torch.get_num_threads())
    print(f"wrote {write('streaming' if setup.kind == 'sim' else 'streaming_cuda', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
