"""The step model against the simulated device: predicted vs measured step time for every configuration the
chapters run.

A small GPT trains on the sim device (2 GB/s link unless a row says otherwise). Each configuration is timed
for a few steps, interleaved with the others, and keeps its fastest step; the device computes on one core
(COMPUTE_THREADS). Both as bench/plan_accuracy.py does, for the reasons given there: a shared machine only ever
slows a step down, and a compute thread on every core waits for the cores the host's work holds. The prediction
uses `profiles.probe()` (this machine's measured figures) and one calibration: the model FLOP/s utilisation (mfu) of
forward + backward, measured here on "compute only" contenders (forward and backward, no optimizer; one per model
dtype: a CPU runs bf16 models at a very different share of its matmul peak) in the same run. Everything else (link,
CPU Adam, host passes, disk, the overlaps) comes from the profile and the model's rules.

Headline (bench/results/step_model.json), over the offloaded configurations (the calibration row excluded):
    median_relative_error   median of |predicted - measured| / measured   (target <= 0.10)
    worst_relative_error    the largest                                     (target <= 0.25)

    python bench/step_model.py [--quick]
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
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import Link, device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.machine import profiles
from minioffload.model import gpt as models
from minioffload.nvme.swapper import Swapper  # noqa: E402
from minioffload.predict import stepmodel  # noqa: E402

PRESET, BATCH, BLOCK = "medium", 2, 64
COMPUTE_THREADS = 1  # the sim device computes on one core; the host's work has the other (see the docstring)
# name -> (options of OffloadAdam, or None for compute only / "device" for torch's AdamW on the device;
#          link GB/s, model dtype)
SETUPS = {
    "compute only": (None, 2.0, torch.float32),
    "compute only, bf16": (None, 2.0, torch.bfloat16),
    "on device (torch AdamW)": ("device", 2.0, torch.float32),
    "offload, 4M subgroups": ({}, 2.0, torch.float32),
    "offload, 1M subgroups": ({"subgroup_numel": 1 << 20}, 2.0, torch.float32),
    "offload, 256K subgroups": ({"subgroup_numel": 1 << 18}, 2.0, torch.float32),
    "offload, clipping": ({"max_grad_norm": 1.0}, 2.0, torch.float32),
    "offload, bf16 model": ({}, 2.0, torch.bfloat16),
    "offload, 8 GB/s link": ({}, 8.0, torch.float32),
    "delayed update": ({"delay_updates_after": 0}, 2.0, torch.float32),
    "hybrid, stride 3": ({"stride": 3, "subgroup_numel": 1 << 20}, 2.0, torch.float32),
    "hybrid, gpu_fraction 0.5": ({"gpu_fraction": 0.5, "subgroup_numel": 1 << 20}, 2.0, torch.float32),
    "NVMe tier": ({"nvme": True, "subgroup_numel": 1 << 20}, 2.0, torch.float32),
}


def config_of(options, model_mfu: float) -> stepmodel.StepConfig:
    if options == "device":
        return stepmodel.StepConfig(optimizer_on="device", mfu=model_mfu)
    options = dict(options)  # OffloadAdam's keywords, and nvme: its NVMe tier (a Swapper)
    return stepmodel.StepConfig(optimizer_on="nvme" if options.pop("nvme", False) else "host", mfu=model_mfu,
                                **options)


def make_run(options, link_gbps: float, dtype: torch.dtype, scratch: Path, swappers: list):
    """One training step as a function, its device and its workload; a Swapper it makes joins `swappers`."""
    text = models.load_text()
    tokenizer = models.CharTokenizer(text)
    data = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(0)
    config = models.GPTConfig.preset(PRESET, tokenizer.vocab_size, block_size=BLOCK)
    link = Link(bandwidth=link_gbps * 1e9)
    dev = device("sim", h2d=link, d2h=link)
    model = dev.place(models.GPT(config).to(dtype))
    opt = None
    if options == "device":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    elif options is not None:
        options = dict(options)
        swapper = None
        if options.pop("nvme", False):
            (scratch / "swap").mkdir()
            swapper = Swapper(scratch / "swap")
            swappers.append(swapper)
        opt = OffloadAdam(model.parameters(), dev, lr=1e-3, swapper=swapper, **options)
    generator = torch.Generator().manual_seed(0)

    def one_step() -> dict:
        x, y = models.batches(data, BLOCK, BATCH, generator)
        dev.trace.clear()
        dev.synchronize()
        start = time.perf_counter()
        with dev.trace.span("compute", "forward"):
            _, loss = model(x, y)
        with dev.trace.span("compute", "backward"):
            loss.backward()
        if opt is not None:
            with dev.trace.span("compute" if options == "device" else "host", "step"):
                opt.step()
            opt.zero_grad()
        else:
            model.zero_grad()
        dev.synchronize()
        return {"wall_s": time.perf_counter() - start,
                **{f"{lane}_s": dev.trace.busy(lane) for lane in ("compute", "cpu", "d2h", "h2d")}}

    work = stepmodel.Workload.of(model, BATCH * BLOCK, "fp32" if dtype == torch.float32 else "mixed_bf16")
    return one_step, dev, work


def one_run(rounds: int) -> tuple[list[dict], dict, profiles.Hardware, stepmodel.Workload]:
    """Probe this machine, time every configuration (interleaved), predict each: rows and headline of one run."""
    profiles.probe.cache_clear()  # each run measures its own figures
    hw = profiles.probe()
    runs, devices, works, swappers = {}, [], {}, []
    with common.scratch() as scratch:
        for name, (options, gbps, dtype) in SETUPS.items():
            runs[name], dev, works[name] = make_run(options, gbps, dtype, Path(scratch), swappers)
            devices.append(dev)
        results = interleaved(runs, rounds, warmup=2)
        for dev in devices:
            dev.close()
        for swapper in swappers:  # its writes land before the directory goes
            swapper.close()
    measured = {name: min(m["wall_s"] for m in rows) for name, rows in results.items()}  # the fastest step
    mfu = {}  # per model dtype: the share of peak FLOP/s forward + backward reach here
    for name in ("compute only", "compute only, bf16"):
        work = works[name]
        mfu[work.precision] = 6 * work.num_params * work.tokens / (hw.peak_flops(work.precision) * measured[name])
    rows = []
    for name, (options, gbps, _dtype) in SETUPS.items():
        profile = hw if gbps == 2.0 else hw.replace(link_h2d=gbps * 1e9, link_d2h=gbps * 1e9,
                                                    link_theoretical=gbps * 1e9)
        row = {"configuration": name, "wall_s": stats([m["wall_s"] for m in results[name]]),
               "measured_s": measured[name],
               "lanes_measured_s": {k: statistics.median(m[k] for m in results[name]) for k in results[name][0]}}
        if options is not None:
            pred = stepmodel.predict(works[name], profile, config_of(options, mfu[works[name].precision]))
            row.update(stepmodel.compare(pred, measured[name]))
            row.update({"bound": pred.bound, "busy_predicted_s": pred.busy, "exposed_predicted_s": pred.exposed})
        rows.append(row)
    errors = {row["configuration"]: row["relative_error"] for row in rows if "relative_error" in row}
    headline = {"median_relative_error": statistics.median(errors.values()),
                "worst_relative_error": max(errors.values()), "worst_configuration": max(errors, key=errors.get),
                "configurations": len(errors), "calibrated_mfu": mfu["fp32"], "calibrated_mfu_bf16": mfu["mixed_bf16"]}
    return rows, headline, hw, works["compute only"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of 3 rounds (about a minute)")
    parser.add_argument("--runs", type=common.positive(int), default=3,
                        help="independent runs; the headline is their median")
    args = parser.parse_args()
    torch.set_num_threads(COMPUTE_THREADS)
    rounds, count = (3, 1) if args.quick else (7, args.runs)
    runs = [one_run(rounds) for _ in range(count)]
    rows, _, hw, work = sorted(runs, key=lambda run: run[1]["median_relative_error"])[len(runs) // 2]  # median run
    print(f"step model vs the sim device: {work.num_params / 1e6:.1f}M-param GPT, {work.tokens} tokens per step, "
          f"{rounds} interleaved rounds per run, {count} run(s); the median run's rows:")
    print(f"{'configuration':<28}{'predicted ms':>13}{'measured ms':>12}{'ratio':>7}  bound")
    for row in rows:
        shown = f"{row['predicted_s'] * 1e3:>13.1f}" if "predicted_s" in row else f"{'(calibration)':>13}"
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else ""
        print(f"{row['configuration']:<28}{shown}{row['measured_s'] * 1e3:>12.1f}{ratio:>7}  {row.get('bound', '')}")
    per_run = [headline for _, headline, _, _ in runs]
    headline = {key: stats([h[key] for h in per_run]) for key in ("median_relative_error", "worst_relative_error",
                                                                 "calibrated_mfu", "calibrated_mfu_bf16")}
    headline = {"median_relative_error": headline["median_relative_error"]["median"],
                "worst_relative_error": headline["worst_relative_error"]["median"],
                "spread": headline, "worst_configuration": [h["worst_configuration"] for h in per_run],
                "configurations": per_run[0]["configurations"], "runs": count,
                "targets": {"median_relative_error": 0.10, "worst_relative_error": 0.25}}
    def each(key: str) -> str:
        return ", ".join(f"{h[key]:.3f}" for h in per_run)

    print(f"headline (median of {count} run(s)): median_relative_error={headline['median_relative_error']:.3f} "
          f"(runs: {each('median_relative_error')}), worst_relative_error={headline['worst_relative_error']:.3f} "
          f"(runs: {each('worst_relative_error')}); worst: {', '.join(headline['worst_configuration'])}")
    config = {"preset": PRESET, "batch_size": BATCH, "block_size": BLOCK, "rounds": rounds, "quick": args.quick,
              "profile": {r["figure"]: r["value"] for r in hw.table()}}
    print(f"wrote {write('step_model', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
