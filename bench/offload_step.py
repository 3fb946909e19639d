"""How much of an offloaded training step's copying hides behind compute and the CPU update.

A small GPT trains with OffloadAdam on the simulated device (2 GB/s each way by default: set --link-gbps
for a faster, PCIe-like ratio). Each measured step records its phases in the trace: forward and backward
(lane compute), gradient copies (d2h, issued from backward hooks), the CPU Adam (cpu), weight uploads
(h2d). Rounds alternate the setups (interleaved), medians reported.

Headline (bench/results/offload_step.json), from this run's rows for the default subgroup size:
    hidden_transfer_fraction   share of D2H + H2D busy time during which compute or the CPU update also ran
    step_over_sum_of_phases    step wall time / (forward + backward + cpu + d2h + h2d busy times): below 1
                               means phases overlapped
    delayed_update_speedup     step time without / with the one-step delayed update (DPU)
On CUDA (`--device cuda`, the default when a GPU is visible) the same rows run on the GPU with a ~86M GPT,
plus torchao's CPUOffloadOptimizer when torchao is installed: `step_vs_torchao` (ours / theirs, at most 1.0
is the target) goes to bench/results/offload_step_cuda.json; it is null without torchao.

    python bench/offload_step.py [--quick]
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

from minioffload import models  # noqa: E402
from minioffload.device import Link, device  # noqa: E402
from minioffload.offload import OffloadAdam  # noqa: E402
from minioffload.trace import Trace  # noqa: E402


def busy_where(trace: Trace, lanes: set[str], unless: set[str]) -> float:
    """Seconds in which a lane of `lanes` is busy and no lane of `unless` is."""
    points = sorted({t for s in trace.spans for t in (s.start, s.end)})
    total = 0.0
    for a, b in zip(points, points[1:], strict=False):
        mid = (a + b) / 2
        active = {s.lane for s in trace.spans if s.start <= mid < s.end}
        if active & lanes and not active & unless:
            total += b - a
    return total


def torchao_offload(params, lr):
    """torchao's CPUOffloadOptimizer (fused CPU AdamW, gradients offloaded), or None without torchao."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        try:
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
        except ImportError:
            return None
    return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, fused=True, lr=lr)


def make_run(kind: str, preset: str, optimizer: str, subgroup_numel: int, link: Link, batch_size: int,
             block_size: int, delay: int | None = None):
    """One training step as a function (for `interleaved`), its device, and the model's size; None when the
    optimizer is torchao's and torchao is missing."""
    text = models.load_text()
    tokenizer = models.CharTokenizer(text)
    data = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(0)
    config = models.GPTConfig.preset(preset, tokenizer.vocab_size, block_size=block_size)
    dev = device("sim", h2d=link, d2h=link) if kind == "sim" else device("cuda")
    model = dev.place(models.GPT(config))  # on CUDA, moved to the GPU too
    if optimizer == "torchao":
        opt = torchao_offload(model.parameters(), lr=1e-3)
        if opt is None:
            dev.close()
            return None
    else:
        opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=subgroup_numel, delay_updates_after=delay)
    generator = torch.Generator().manual_seed(0)

    def one_step() -> dict:
        x, y = (dev.to_device(t) for t in models.batches(data, block_size, batch_size, generator))
        dev.trace.clear()
        dev.synchronize()
        start = time.perf_counter()
        _, loss = dev.timed("forward", lambda: model(x, y))
        dev.timed("backward", loss.backward)
        opt.step()  # with delayed updates, the CPU Adam runs on into the next step's forward and backward
        opt.zero_grad()
        dev.synchronize()
        wall = time.perf_counter() - start
        trace = dev.trace
        transfers = trace.busy("d2h") + trace.busy("h2d")
        exposed = busy_where(trace, {"d2h", "h2d"}, {"compute", "cpu"})
        phases = sum(trace.busy(lane) for lane in ("compute", "cpu", "d2h", "h2d"))
        return {"wall_s": wall, "transfer_s": transfers, "exposed_transfer_s": exposed, "sum_of_phases_s": phases,
                "compute_s": trace.busy("compute"), "cpu_s": trace.busy("cpu")}

    return one_step, dev, model.num_params()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    parser.add_argument("--link-gbps", type=common.positive(float), default=2.0,
                        help="sim link bandwidth each way, GB/s")
    parser.add_argument("--device", choices=("auto", "sim", "cuda"), default="auto",
                        help="auto: cuda when a GPU is visible, else sim")
    args = parser.parse_args()
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "sim")
    rounds = 3 if args.quick else 7
    preset, batch_size, block_size = ("medium", 8, 128) if kind == "sim" else ("gpt2-small-ish", 16, 256)
    link = Link(bandwidth=args.link_gbps * 1e9)
    # name -> (optimizer, subgroup size, delayed after); the first row gives the headline
    setups = {"default (4M)": ("ours", 1 << 22, None), "1M": ("ours", 1 << 20, None),
              "256K": ("ours", 1 << 18, None), "4M, delayed": ("ours", 1 << 22, 0)}
    if kind == "cuda":
        setups["torchao"] = ("torchao", 0, None)
    runs, devices = {}, []
    for name, (optimizer, numel, delay) in setups.items():
        made = make_run(kind, preset, optimizer, numel, link, batch_size, block_size, delay)
        if made is None:
            print(f"{name}: torchao is not installed, row left out (pip install torchao)")
            continue
        runs[name], dev, num_params = made
        devices.append(dev)
    results = interleaved(runs, rounds)
    for dev in devices:
        dev.close()

    rows = []
    print(f"offloaded step of a {num_params / 1e6:.1f}M-parameter GPT on the {kind} device"
          f"{f' ({args.link_gbps:g} GB/s link)' if kind == 'sim' else ''}, {rounds} interleaved rounds, medians")
    print(f"{'setup':<14}{'step ms':>9}{'compute':>9}{'cpu':>8}{'copies':>8}{'exposed':>9}{'hidden':>8}"
          f"{'step/sum':>10}")
    for name, measured in results.items():
        med = {k: stats([m[k] for m in measured])["median"] for k in measured[0]}
        hidden = 1 - med["exposed_transfer_s"] / med["transfer_s"] if med["transfer_s"] else None
        over_sum = med["wall_s"] / med["sum_of_phases_s"] if med["sum_of_phases_s"] else None
        optimizer, numel, delay = setups[name]
        row = {"setup": name, "optimizer": optimizer, "subgroup_numel": numel, "delay_updates_after": delay,
               "params": num_params, **{k: stats([m[k] for m in measured]) for k in measured[0]},
               "hidden_transfer_fraction": hidden, "step_over_sum_of_phases": over_sum}
        rows.append(row)
        print(f"{name:<14}{med['wall_s'] * 1e3:>9.1f}{med['compute_s'] * 1e3:>9.1f}{med['cpu_s'] * 1e3:>8.1f}"
              f"{med['transfer_s'] * 1e3:>8.1f}{med['exposed_transfer_s'] * 1e3:>9.1f}"
              f"{'' if hidden is None else f'{hidden:.2f}':>8}{'' if over_sum is None else f'{over_sum:.2f}':>10}")
    wall = {row["setup"]: row["wall_s"]["median"] for row in rows}
    default = rows[0]
    headline = {"hidden_transfer_fraction": default["hidden_transfer_fraction"],
                "step_over_sum_of_phases": default["step_over_sum_of_phases"],
                "delayed_update_speedup": wall["default (4M)"] / wall["4M, delayed"],
                "step_vs_torchao": wall["default (4M)"] / wall["torchao"] if "torchao" in wall else None,
                "device": kind, "link_GBps": args.link_gbps if kind == "sim" else None}
    print("headline:", ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in headline.items()))
    config = {"preset": preset, "batch_size": batch_size, "block_size": block_size, "rounds": rounds,
              "quick": args.quick}
    print(f"wrote {write('offload_step' if kind == 'sim' else 'offload_step_cuda', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
