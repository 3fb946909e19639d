"""Past host memory: a GPT whose training state is many times the pinned host budget and the device's memory trains,
on the simulated device, with its weights, gradients and optimizer state on one (throttled) drive, and the same
losses and master weights, bit for bit, as the run that keeps everything in memory.

The model: 24 blocks, 128 wide, context 32, bf16 weights (fp32 masters), a character vocabulary. The state counted
is ZeRO's 16 B/param (bf16 weights and gradients, fp32 master and moments).
  in memory   resident weights on a device large enough, OffloadAdam's state and gradients in pinned host memory,
              every activation kept: the reference
  off-memory  the blocks' weights streamed from the drive (one ahead), the state and the gradients on it
              (grads_on="nvme", 3 pinned sets), activations recomputed, on a sim device of `device_bytes`, the whole
              run inside a pinned host budget (pinned.HostBudget: a buffer past it is refused, not counted after)
Both take the same batches: 2 micro-batches of 2 x 32 tokens per step, clipping to norm 1. One Swapper holds the
weights' and the state's files, throttled to `--drive-mbps` (reads and writes share it, as one drive's link), so the
drive is the step's bound and what it moves is measured: `step_over_io_bound` = the step / (bytes read + written in
it / the drive's rate). The planner's step (planner/search.step_seconds, this machine's figures, the compute rate
measured on the in-memory run, the drive's rate) is its prediction: `model_relative_error`.

Headline (bench/results/capacity.json), each the median of the runs with their spread:
    state_over_host_budget   16 B/param x params / the pinned budget                 (target >= 8)
    state_over_device        the same / the sim device's memory                      (target >= 40)
    bit_equal                losses and masters equal to the in-memory run's, in every run (target true)
    host_peak_over_budget    the pinned peak measured / the budget                   (target <= 1.0)
    step_over_io_bound       the timed steps' median / the drive's bound for them    (target <= 1.2)
    model_relative_error     |predicted - measured| / measured, the median step      (target <= 0.15)

    python bench/capacity.py [--quick] [--runs 3] [--drive-mbps 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import stats, write  # noqa: E402

from minioffload.devices import device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.machine import profiles  # noqa: E402
from minioffload.model.activations import Activations  # noqa: E402
from minioffload.model.gpt import GPT, GPTConfig  # noqa: E402
from minioffload.model.streaming import ParamStreamer  # noqa: E402
from minioffload.nvme.swapper import Swapper  # noqa: E402
from minioffload.pinned import HostBudget  # noqa: E402
from minioffload.planner import search as planner  # noqa: E402
from minioffload.planner.plan import Plan  # noqa: E402
from minioffload.predict.shapes import ModelSpec  # noqa: E402

SHAPE = dict(vocab_size=65, block_size=32, n_layer=24, n_head=4, n_embd=128, dropout=0.0)
BATCH, ACCUM, STEPS, LR = 2, 2, 4, 1e-3  # the first step is not timed
SUBGROUP = 1 << 15
DEVICE_BYTES = 1_800_000
STATE_BYTES_PER_PARAM = 16
TARGETS = {"state_over_host_budget": 8, "state_over_device": 40, "host_peak_over_budget": 1.0,
           "step_over_io_bound": 1.2, "model_relative_error": 0.15}
AT_MOST = ("host_peak_over_budget", "step_over_io_bound", "model_relative_error")  # the others: at least


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    shape = (BATCH, SHAPE["block_size"])
    return [[(torch.randint(0, SHAPE["vocab_size"], shape, generator=g),
              torch.randint(0, SHAPE["vocab_size"], shape, generator=g)) for _ in range(ACCUM)] for _ in range(STEPS)]


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**SHAPE)).to(torch.bfloat16)


def train(net, dev, opt, data, drain=None) -> tuple[list[float], list[float], float, float]:
    """The steps: losses, each step's seconds, the forward+backward seconds of the first (untimed) step, and when
    (on the trace's clock) the second step began; `drain()`, if given, runs before it (untimed)."""
    losses, seconds, compute, timed_from = [], [], 0.0, 0.0
    for step, micro_batches in enumerate(data):
        if step == 1:
            if drain is not None:
                drain()  # the first step's requests done: what starts from here is the timed steps'
            timed_from = dev.trace.now()
        start, total = time.perf_counter(), 0.0
        for x, y in micro_batches:
            x, y = dev.to_device(x), dev.to_device(y)
            _, loss = net(x, y)
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        if step == 0:
            compute = time.perf_counter() - start
        opt.step()
        opt.zero_grad()
        dev.synchronize()
        losses.append(total)
        seconds.append(time.perf_counter() - start)
    return losses, seconds, compute, timed_from


def in_memory(data) -> dict:
    net = model()
    with device("sim") as dev:
        dev.place(net)
        opt = OffloadAdam(net.parameters(), dev, lr=LR, subgroup_numel=SUBGROUP, max_grad_norm=1.0)
        losses, seconds, compute, _ = train(net, dev, opt, data)
        masters = [m.clone() for m in opt.master_weights()]
        opt.close()
    return {"losses": losses, "masters": masters, "compute_s": compute, "step_s": seconds[1:]}


def off_memory(data, drive: Path, budget: int, drive_bps: float) -> dict:
    net = model()
    swapper = Swapper(drive, max_bandwidth=drive_bps)
    with device("sim", memory_bytes=DEVICE_BYTES) as dev:
        swapper.trace = dev.trace
        with HostBudget(budget) as pinned:  # the run: a pinned buffer past the budget is refused
            streamer = ParamStreamer(net, dev, prefetch=1, home="nvme", swapper=swapper)
            Activations(net.blocks, "recompute", dev)
            opt = OffloadAdam(net.parameters(), dev, lr=LR, subgroup_numel=SUBGROUP, max_grad_norm=1.0,
                              swapper=swapper, streamer=streamer, grads_on="nvme", grad_buffers=3)
            losses, seconds, _, timed_from = train(net, dev, opt, data, swapper.drain)
            opt.nvme.drain()
            swapper.drain()
            timed_until = dev.trace.now()
        masters = [m.clone() for m in opt.master_weights()]  # read back from the drive to compare: not the run's
        opt.close()
    swapper.close()
    # the timed steps' drive bytes, by when each request started (the first step fetches a little more; the masters'
    # read-back is not the run's)
    moved = [s.nbytes for s in dev.trace.spans
             if s.lane in ("nvme_read", "nvme_write") and timed_from <= s.start < timed_until]
    return {"losses": losses, "masters": masters, "step_s": seconds[1:], "peak": pinned.peak,
            "drive_bytes_per_step": sum(moved) / (STEPS - 1), "device_peak": dev.ledger.peak("device")}


def predicted_step(compute_s: float, drive_bps: float) -> float:
    """The planner's step for the off-memory run's configuration, with the compute rate the in-memory run measured
    (its first step's forward and backward) and the drive's rate."""
    spec = ModelSpec(SHAPE["n_layer"], SHAPE["n_embd"], SHAPE["n_head"], SHAPE["vocab_size"], SHAPE["block_size"])
    flops = 6 * spec.num_params * BATCH * ACCUM * SHAPE["block_size"] / compute_s
    hw = profiles.probe().replace(peak_flops_bf16=flops, nvme_read=drive_bps, nvme_write=drive_bps)
    limits = planner.Limits(batch=BATCH * ACCUM, precision="mixed_bf16", mfu=1.0, block_overhead_s=0.0)
    plan = Plan(spec, hw.name, "mixed_bf16", BATCH, ACCUM, "nvme", "nvme", ("recompute",) * SHAPE["n_layer"], 1,
                SUBGROUP, grads_on="nvme")
    return planner.step_seconds(plan, hw, limits)


def one_run(drive_bps: float) -> dict:
    data = batches()
    reference = in_memory(data)
    params = sum(m.numel() for m in reference["masters"])
    state = STATE_BYTES_PER_PARAM * params
    budget = state // 10
    with common.scratch() as scratch:
        run = off_memory(data, Path(scratch), budget, drive_bps)
    equal = run["losses"] == reference["losses"] and all(
        torch.equal(a, b) for a, b in zip(run["masters"], reference["masters"], strict=True))
    step = statistics.median(run["step_s"])
    io_bound = run["drive_bytes_per_step"] / drive_bps
    predicted = predicted_step(reference["compute_s"], drive_bps)
    return {"params": params, "state_bytes": state, "host_budget_bytes": budget, "device_bytes": DEVICE_BYTES,
            "state_over_host_budget": state / budget, "state_over_device": state / DEVICE_BYTES, "bit_equal": equal,
            "host_peak_bytes": run["peak"], "host_peak_over_budget": run["peak"] / budget,
            "device_peak_bytes": run["device_peak"], "drive_bytes_per_step": run["drive_bytes_per_step"],
            "step_s": step, "in_memory_step_s": statistics.median(reference["step_s"]), "io_bound_s": io_bound,
            "step_over_io_bound": step / io_bound, "predicted_step_s": predicted,
            "model_relative_error": abs(predicted - step) / step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run")
    parser.add_argument("--runs", type=common.positive(int), default=3,
                        help="independent runs; each headline figure is their median, with their spread")
    parser.add_argument("--drive-mbps", type=common.positive(float), default=150.0,
                        help="the drive's throttle, MB/s, reads and writes together (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # compute on one core; the swapper's and the copies' threads on the other
    count, drive_bps = (1 if args.quick else args.runs), args.drive_mbps * 1e6
    rows = []
    for index in range(count):
        row = one_run(drive_bps)
        rows.append(row)
        print(f"run {index + 1}: step {row['step_s']:.2f} s (in memory {row['in_memory_step_s']:.3f} s), drive bound "
              f"{row['io_bound_s']:.2f} s ({row['drive_bytes_per_step'] / 1e6:.0f} MB a step), predicted "
              f"{row['predicted_step_s']:.2f} s; pinned peak {row['host_peak_bytes'] / 1e6:.1f} MB of a "
              f"{row['host_budget_bytes'] / 1e6:.1f} MB budget; bit-equal {row['bit_equal']}")
    first = rows[0]
    print(f"a {first['params'] / 1e6:.1f}M-param GPT, {first['state_bytes'] / 1e6:.0f} MB of state "
          f"({STATE_BYTES_PER_PARAM} B/param), a {DEVICE_BYTES / 1e6:.1f} MB sim device, a drive of "
          f"{args.drive_mbps:g} MB/s; {count} run(s)")
    figures = ("state_over_host_budget", "state_over_device", "host_peak_over_budget", "step_over_io_bound",
               "model_relative_error")
    spread = {name: stats([row[name] for row in rows]) for name in figures}
    headline = {**{name: values["median"] for name, values in spread.items()},
                "bit_equal": all(row["bit_equal"] for row in rows), "runs": count, "spread": spread,
                "targets": {**TARGETS, "bit_equal": True}}
    for name in figures:
        at_most = name in AT_MOST
        median = spread[name]["median"]
        met = median <= TARGETS[name] if at_most else median >= TARGETS[name]
        print(f"  {name:<24} {median:8.3f} [{spread[name]['min']:.3f}, {spread[name]['max']:.3f}]  target "
              f"{'<=' if at_most else '>='} {TARGETS[name]}: {'met' if met else 'MISSED'}")
    equal = headline["bit_equal"]
    print(f"  {'bit_equal':<24} {equal!s:>8}  target true: {'met' if equal else 'MISSED'}")
    config = {"shape": SHAPE, "batch": BATCH, "grad_accum": ACCUM, "steps": STEPS, "subgroup_numel": SUBGROUP,
              "device_bytes": DEVICE_BYTES, "drive_bytes_per_s": drive_bps, "quick": args.quick}
    print(f"wrote {write('capacity', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
