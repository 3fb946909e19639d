"""How much of an offloaded training step's copying hides behind compute and the CPU update, what the
speculative update buys, and how close the step comes to the step model's lower bound.

A small GPT trains with OffloadAdam on the simulated device (2 GB/s each way by default). Each measured step
records its phases in the trace: forward and backward (lane compute), gradient copies (d2h, issued from backward
hooks, per tensor or per bucket), the CPU Adam (cpu), weight uploads (h2d, one per subgroup). Rounds alternate the
setups (interleaved), medians reported; `--runs 3` repeats the whole run: the rows are the median run's (by
hidden fraction), each headline figure its median over the runs, with the spread beside it.

Two groups of rows:
  overlap       the ~10M GPT at batch 8 x 128 tokens, all cores to everything (compute-bound on the sim): the
                synchronous step, bucketed copies, the speculative update, and both; smaller subgroups; the delayed
                update; and "compute only" (no optimizer), which calibrates the step model's compute rate
  update-heavy  a PaddedStack (model/gpt.py: 10 linear layers, ~10.5M parameters) whose forward and backward take
                modelled times on the device, sleeping instead of using the host's cores as a GPU would: backward
                as long as the synchronous CPU update measured just before (forward half that), so that backward
                and the update take similar time; synchronous vs speculative. The CPU Adam gets
                one core (numba threads 1) and the device's host-side work (its real part of forward and backward,
                the hooks; torch threads 1) the other: on two cores they would otherwise take turns. Both still
                share the host's DRAM, which the device's real work would not touch on a GPU. (A real
                model's compute on the sim runs on the same cores as the CPU Adam, and the two only slow each other.)

Headline (bench/results/offload_step.json):
    hidden_transfer_fraction        share of D2H + H2D busy time during which compute or the CPU update also ran,
                                    for the engine with this issue's options (speculative + buckets); target 0.85
    hidden_transfer_fraction_synchronous   the same for the synchronous default
    speculative_speedup             update-heavy: synchronous step / speculative step; target 1.3
    step_over_model_bound           measured step / the step model's lower bound (stepmodel: the busiest resource)
                                    for the same configuration, the headline row; target 1.15
    step_over_sum_of_phases, delayed_update_speedup   as before
On CUDA (`--device cuda`, the default when a GPU is visible) the overlap rows run on the GPU with a ~86M GPT,
the update-heavy rows with the same PaddedStack (all cores to everything), plus torchao's CPUOffloadOptimizer when
torchao is importable: `step_vs_torchao` (ours / theirs, at most 1.0 is
the target) goes to bench/results/offload_step_cuda.json; it is null without torchao.

    python bench/offload_step.py [--quick] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numba
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import Link, device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.machine import profiles
from minioffload.model import gpt as models
from minioffload.options import OffloadOptions  # noqa: E402
from minioffload.predict import stepmodel  # noqa: E402
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


@dataclass(frozen=True)
class Setup:
    optimizer: str  # "ours", "torchao", or "none" (forward and backward only: the compute calibration)
    options: dict = field(default_factory=dict)  # OffloadAdam's options
    group: str = "overlap"  # "overlap" or "update-heavy"


M = 1 << 20
OVERLAP = {  # the first row is the synchronous default; HEADLINE is this configuration
    "4M subgroups": Setup("ours"),
    "1M subgroups": Setup("ours", {"subgroup_numel": M}),
    "256K subgroups": Setup("ours", {"subgroup_numel": M // 4}),
    "1M, buckets": Setup("ours", {"subgroup_numel": M, "bucket_numel": M}),
    "1M, speculative": Setup("ours", {"subgroup_numel": M, "speculative": True}),
    "1M, speculative + buckets": Setup("ours", {"subgroup_numel": M, "speculative": True, "bucket_numel": M}),
    "4M, delayed": Setup("ours", {"delay_updates_after": 0}),
    "compute only": Setup("none"),
}
HEADLINE = "1M, speculative + buckets"
PADDED_WIDTH, PADDED_LAYERS = 1024, 10  # update-heavy: ~10.5M parameters in 10 linear layers
LAYER = PADDED_WIDTH * (PADDED_WIDTH + 1)  # one layer's weight and bias: a subgroup each
UPDATE_HEAVY = {
    "update-heavy, synchronous": Setup("ours", {"subgroup_numel": LAYER}, "update-heavy"),
    "update-heavy, speculative": Setup("ours", {"subgroup_numel": LAYER, "speculative": True}, "update-heavy"),
}
SIZES = {"overlap": (8, 128), "update-heavy": (4, 1)}  # batch, block (tokens) on the sim


def make_run(kind: str, preset: str, setup: Setup, link: Link, batch_size: int, block_size: int,
             pads: tuple[float, float] = (0.0, 0.0)):
    """One training step as a function (for `interleaved`), its device, and the model's workload; None when the
    optimizer is torchao's and torchao is missing. Update-heavy: the PaddedStack, its forward and backward taking
    `pads` seconds on the device (sleeping: no host core)."""
    text = models.load_text()
    tokenizer = models.CharTokenizer(text)
    data = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(0)
    dev = device("sim", h2d=link, d2h=link) if kind == "sim" else device("cuda")
    if setup.group == "update-heavy":
        model = dev.place(models.PaddedStack(PADDED_WIDTH, PADDED_LAYERS, *pads))
        inputs = dev.to_device(torch.randn(batch_size, PADDED_WIDTH, generator=torch.Generator().manual_seed(0)))
        model_loss = lambda x, y: (None, model(inputs).square().mean())  # noqa: E731
    else:
        model = dev.place(models.GPT(models.GPTConfig.preset(preset, tokenizer.vocab_size, block_size=block_size)))
        model_loss = model
    opt = None
    if setup.optimizer == "torchao":
        opt = torchao_offload(model.parameters(), lr=1e-3)
        if opt is None:
            dev.close()
            return None
    elif setup.optimizer == "ours":
        opt = OffloadAdam(model.parameters(), dev, lr=1e-3, **{"subgroup_numel": 1 << 22, **setup.options})
    generator = torch.Generator().manual_seed(0)

    def one_step() -> dict:
        threads = torch.get_num_threads(), numba.get_num_threads()
        if setup.group == "update-heavy" and kind == "sim":  # CPU Adam on one core, the device's host work on the other
            torch.set_num_threads(1)
            numba.set_num_threads(1)
        try:
            return timed_step()
        finally:
            torch.set_num_threads(threads[0])
            numba.set_num_threads(threads[1])

    def timed_step() -> dict:
        x, y = (dev.to_device(t) for t in models.batches(data, block_size, batch_size, generator))
        dev.trace.clear()
        dev.synchronize()
        start = time.perf_counter()
        _, loss = dev.timed("forward", lambda: model_loss(x, y))
        dev.timed("backward", loss.backward)
        if opt is not None:
            opt.step()  # with delayed updates, the CPU Adam runs on into the next step's forward and backward
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=True)
        dev.synchronize()
        wall = time.perf_counter() - start
        trace = dev.trace
        transfers = trace.busy("d2h") + trace.busy("h2d")
        exposed = busy_where(trace, {"d2h", "h2d"}, {"compute", "cpu"})
        phases = sum(trace.busy(lane) for lane in ("compute", "cpu", "d2h", "h2d"))
        return {"wall_s": wall, "transfer_s": transfers, "exposed_transfer_s": exposed, "sum_of_phases_s": phases,
                "compute_s": trace.busy("compute"), "cpu_s": trace.busy("cpu"),
                "copies": sum(1 for span in trace.spans if span.lane in ("d2h", "h2d"))}

    work = stepmodel.Workload.of(model, batch_size * (1 if setup.group == "update-heavy" else block_size), "fp32")
    return one_step, dev, work


def cpu_update_s(kind: str, setup: Setup, link: Link, batch_size: int) -> float:
    """The synchronous CPU update's time (s, median of 5 steps) of an update-heavy setup with no padding: what the
    padded forward and backward are sized from."""
    step, dev, _ = make_run(kind, "", setup, link, batch_size, 1)
    seconds = sorted(step()["cpu_s"] for _ in range(6))[1:][2]  # the first step compiles; the median of the rest
    dev.close()
    return seconds


def lower_bound(setup: Setup, work, hw, mfu: float) -> float | None:
    """The step model's lower bound (s) for an overlap row on the sim, or None (no optimizer, or not modelled)."""
    if setup.optimizer != "ours":
        return None
    options = OffloadOptions(**{"subgroup_numel": 1 << 22, **setup.options})
    return stepmodel.predict(work, hw, stepmodel.StepConfig(options=options, mfu=mfu)).lower_bound_s


def one_run(kind: str, rounds: int, link_gbps: float) -> tuple[list[dict], dict, int]:
    """Time every setup (interleaved within its group); rows, headline and the model's size, for one run."""
    preset = "medium" if kind == "sim" else "gpt2-small-ish"
    setups = dict(OVERLAP)
    if kind == "cuda":
        setups = {name: setup for name, setup in setups.items() if setup.optimizer != "none"}
        setups["torchao"] = Setup("torchao")
    setups.update(UPDATE_HEAVY)
    results, works, num_params = {}, {}, 0
    pads = (0.0, 0.0)
    for group in ("overlap", "update-heavy"):
        batch_size, block_size = SIZES[group] if kind == "sim" or group == "update-heavy" else (16, 256)
        link = Link(bandwidth=link_gbps * 1e9)
        mine = {name: setup for name, setup in setups.items() if setup.group == group}
        if group == "update-heavy" and mine:  # backward as long as the synchronous CPU update, forward half
            update_s = cpu_update_s(kind, next(iter(mine.values())), link, batch_size)
            pads = (update_s / 2, update_s)
        runs, devices = {}, []
        for name, setup in mine.items():
            made = make_run(kind, preset, setup, link, batch_size, block_size, pads)
            if made is None:
                print(f"{name}: torchao is not installed, row left out (pip install torchao)")
                continue
            runs[name], dev, works[name] = made
            num_params = works[name].num_params
            devices.append(dev)
        if runs:
            results.update(interleaved(runs, rounds, warmup=2))
        for dev in devices:
            dev.close()

    median = {name: {k: stats([m[k] for m in measured])["median"] for k in measured[0]}
              for name, measured in results.items()}
    hw = mfu = None
    if kind == "sim":  # the step model's lower bound, calibrated on "compute only" as bench/step_model.py does
        hw = profiles.probe().replace(link_h2d=link_gbps * 1e9, link_d2h=link_gbps * 1e9,
                                      link_theoretical=link_gbps * 1e9)
        work = works["compute only"]
        mfu = min(1.0, 6 * work.num_params * work.tokens / (hw.peak_flops("fp32") * median["compute only"]["wall_s"]))
    rows = []
    for name, measured in results.items():
        med, setup = median[name], setups[name]
        hidden = 1 - med["exposed_transfer_s"] / med["transfer_s"] if med["transfer_s"] else None
        over_sum = med["wall_s"] / med["sum_of_phases_s"] if med["sum_of_phases_s"] else None
        bound = lower_bound(setup, works[name], hw, mfu) if hw is not None and setup.group == "overlap" else None
        rows.append({"setup": name, "group": setup.group, "optimizer": setup.optimizer, "options": setup.options,
                     "subgroup_numel": setup.options.get("subgroup_numel", 1 << 22),
                     "params": works[name].num_params, **{k: stats([m[k] for m in measured]) for k in measured[0]},
                     "hidden_transfer_fraction": hidden, "step_over_sum_of_phases": over_sum,
                     "model_lower_bound_s": bound, "step_over_model_bound": med["wall_s"] / bound if bound else None})
    row = {r["setup"]: r for r in rows}
    wall = {name: med["wall_s"] for name, med in median.items()}
    first = next(iter(OVERLAP))
    headline = {"hidden_transfer_fraction": row[HEADLINE]["hidden_transfer_fraction"],
                "update_heavy_pads_s": list(pads),
                "hidden_transfer_fraction_synchronous": row[first]["hidden_transfer_fraction"],
                "speculative_speedup": (wall["update-heavy, synchronous"] / wall["update-heavy, speculative"]
                                        if "update-heavy, speculative" in wall else None),
                "step_over_model_bound": row[HEADLINE]["step_over_model_bound"],
                "step_over_sum_of_phases": row[first]["step_over_sum_of_phases"],
                "delayed_update_speedup": wall[first] / wall["4M, delayed"],
                "step_vs_torchao": wall[HEADLINE] / wall["torchao"] if "torchao" in wall else None,
                "calibrated_mfu": mfu}
    return rows, headline, num_params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of 3 rounds (under two minutes)")
    parser.add_argument("--runs", type=common.positive(int), default=1,
                        help="independent runs; each headline figure is its median over the runs, with the spread")
    parser.add_argument("--link-gbps", type=common.positive(float), default=2.0,
                        help="sim link bandwidth each way for the overlap rows, GB/s")
    parser.add_argument("--device", choices=("auto", "sim", "cuda"), default="auto",
                        help="auto: cuda when a GPU is visible, else sim")
    args = parser.parse_args()
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "sim")
    rounds, count = (3, 1) if args.quick else (7, args.runs)
    runs = [one_run(kind, rounds, args.link_gbps) for _ in range(count)]
    key = "hidden_transfer_fraction"
    rows, headline, num_params = sorted(runs, key=lambda run: run[1][key])[len(runs) // 2]  # the median run

    print(f"offloaded step of a {num_params / 1e6:.1f}M-parameter GPT on the {kind} device, {rounds} interleaved "
          f"rounds per run, {count} run(s); the median run's rows (medians over its rounds):")
    print(f"{'setup':<28}{'step ms':>9}{'compute':>9}{'cpu':>8}{'copies':>8}{'exposed':>9}{'hidden':>8}"
          f"{'n copies':>9}{'step/bound':>11}")
    for row in rows:
        med = {k: row[k]["median"] for k in ("wall_s", "compute_s", "cpu_s", "transfer_s", "exposed_transfer_s",
                                             "copies")}
        hidden, bound = row["hidden_transfer_fraction"], row["step_over_model_bound"]
        print(f"{row['setup']:<28}{med['wall_s'] * 1e3:>9.1f}{med['compute_s'] * 1e3:>9.1f}{med['cpu_s'] * 1e3:>8.1f}"
              f"{med['transfer_s'] * 1e3:>8.1f}{med['exposed_transfer_s'] * 1e3:>9.1f}"
              f"{'' if hidden is None else f'{hidden:.2f}':>8}{med['copies']:>9.0f}"
              f"{'' if bound is None else f'{bound:.2f}':>11}")
    spread = {name: stats([h[name] for _, h, _ in runs]) for name in headline
              if all(isinstance(h[name], float) for _, h, _ in runs)}
    headline = {**headline, **{name: values["median"] for name, values in spread.items()},  # each: its median run
                "device": kind, "link_GBps": args.link_gbps if kind == "sim" else None, "runs": count,
                "spread": spread, "targets": {"hidden_transfer_fraction": 0.85, "speculative_speedup": 1.3,
                                              "step_over_model_bound": 1.15}}
    print("headline:", ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in headline.items() if k not in ("spread", "targets")))
    for name, values in spread.items():
        print(f"  {name}: median {values['median']:.3f}, runs {values['min']:.3f}..{values['max']:.3f}")
    config = {"preset": "medium" if kind == "sim" else "gpt2-small-ish", "sizes": SIZES, "rounds": rounds,
              "quick": args.quick, "padded_stack": {"width": PADDED_WIDTH, "layers": PADDED_LAYERS}}
    print(f"wrote {write('offload_step' if kind == 'sim' else 'offload_step_cuda', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
