"""Sharded offload on 2 ranks against 1, on this machine: `train --shard` under torchrun, gloo, one sim per rank.

Both runs train the same GPT with the same micro-batch per rank, so the 2-rank run does twice the work per step
(as data parallelism does); each rank's figures come from its own trace (summary.json's `per_rank`). Runs
alternate (1, 2, 1, 2, ...) so that a slow spell of the machine hits both.

Headline (bench/results/distributed.json), median of 3 runs with their spread:
    per_rank_link_bytes_ratio   bytes over each rank's own link per step, 2 ranks / 1 rank      (target <= 0.55)
    update_phase_ratio          each rank's CPU update time per step, 2 ranks / 1 rank (half the state each)
    step_model_error            |predicted - measured| / measured for the 2-rank step           (target <= 0.2)
The step model gets this machine's profile (profiles.probe: the sim's link, the host's Adam rate, its per-call
costs), gloo's fixed cost per collective and bandwidth measured in the same round (gloo.py), and the FLOP/s forward
and backward reached in the 1-rank run of the same round. Every rank of both runs computes on one thread (torchrun's
setting for several ranks), so that the calibration computes as each rank of the 2-rank run does.

    python bench/distributed.py [--quick] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import gloo  # noqa: E402
from common import stats, write  # noqa: E402

from minioffload.machine import profiles
from minioffload.model.gpt import GPT, CharTokenizer, GPTConfig, load_text  # noqa: E402
from minioffload.predict import stepmodel  # noqa: E402

PRESET, BLOCK, BATCH, SUBGROUP = "medium", 64, 4, 1 << 20


def run_ranks(ranks: int, steps: int, out_dir: Path) -> dict:
    """One `train --shard` run on `ranks` processes; rank 0's summary.json."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "minioffload",
               "train", "--shard", "--device", "sim", "--model", PRESET, "--block-size", str(BLOCK),
               "--batch-size", str(BATCH), "--steps", str(steps), "--eval-every", str(10 * steps),
               "--subgroup-numel", str(SUBGROUP), "--no-progress", "--out-dir", str(out_dir)]
    # every rank computes on one thread: what torchrun sets for several ranks, set for one rank too, so that the
    # 1-rank run the model is calibrated on computes as each rank of the 2-rank run does
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{ranks}-rank run failed:\n{done.stderr[-3000:]}")
    return json.loads((out_dir / "summary.json").read_text())


def predict(one: dict, ranks: int, net: dict) -> float:
    """The step model's step for `ranks` ranks, with the FLOP/s the 1-rank run's forward and backward reached and
    gloo's figures `net` (gloo.measure)."""
    tok = CharTokenizer(load_text())
    model = GPT(GPTConfig.preset(PRESET, tok.vocab_size, block_size=BLOCK))
    work = stepmodel.Workload.of(model, tokens=BATCH * BLOCK, precision="fp32")
    flops = 6 * work.num_params * work.tokens / one["per_rank"][0]["compute_s"]
    hw = profiles.probe(interconnect=net["interconnect_bytes_per_s"]).replace(
        peak_flops_fp32=flops, collective_latency=net["collective_latency_s"])
    config = stepmodel.StepConfig(subgroup_numel=SUBGROUP, max_grad_norm=1.0, mfu=1.0, ranks=ranks)
    return stepmodel.predict(work, hw, config).step_s


def one_round(steps: int) -> dict:
    with common.scratch() as scratch:
        one = run_ranks(1, steps, Path(scratch) / "one")
        two = run_ranks(2, steps, Path(scratch) / "two")
    net = gloo.measure()
    link_1 = one["per_rank"][0]["link_bytes_per_step"]
    links_2 = [rank["link_bytes_per_step"] for rank in two["per_rank"]]
    update_1 = one["per_rank"][0]["cpu_update_s"]
    updates_2 = [rank["cpu_update_s"] for rank in two["per_rank"]]
    measured_2 = max(rank["step_median_s"] for rank in two["per_rank"])
    predicted_2, predicted_1 = predict(one, 2, net), predict(one, 1, net)
    return {"link_bytes_1": link_1, "link_bytes_2": links_2,
            "per_rank_link_bytes_ratio": max(links_2) / link_1,
            "update_s_1": update_1, "update_s_2": updates_2, "update_phase_ratio": max(updates_2) / update_1,
            "step_s_1": one["per_rank"][0]["step_median_s"], "step_s_2": measured_2,
            "predicted_s_1": predicted_1, "predicted_s_2": predicted_2,
            "step_model_error": abs(predicted_2 - measured_2) / measured_2,
            "step_model_error_1": abs(predicted_1 - one["per_rank"][0]["step_median_s"])
            / one["per_rank"][0]["step_median_s"],
            "interconnect_bytes_2": [rank["net_bytes_per_step"] for rank in two["per_rank"]],
            "optimizer_host_bytes_1": one["per_rank"][0]["optimizer_host_bytes"],
            "optimizer_host_bytes_2": [rank["optimizer_host_bytes"] for rank in two["per_rank"]],
            "num_params": one["num_params"], **{f"gloo_{key}": value for key, value in net.items()},
            "phases_1": _phases(one), "phases_2": _phases(two)}


def _phases(summary: dict) -> dict:
    """Rank 0's phase times per step (seconds), for reading where a prediction misses."""
    return {key: value for key, value in summary.items() if key.endswith("_s") and isinstance(value, (int, float))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer steps")
    parser.add_argument("--runs", type=common.positive(int), default=3, help="rounds; the headline is their median")
    args = parser.parse_args()
    steps, runs = (4, 1) if args.quick else (8, args.runs)
    rows = [one_round(steps) for _ in range(runs)]
    keys = ("per_rank_link_bytes_ratio", "update_phase_ratio", "step_model_error", "step_model_error_1")
    spread = {key: stats([row[key] for row in rows]) for key in keys}
    headline = {key: spread[key]["median"] for key in keys}
    headline.update(runs=runs, spread=spread, targets={"per_rank_link_bytes_ratio": 0.55, "step_model_error": 0.2})
    print(f"GPT '{PRESET}' ({rows[0]['num_params']:,} parameters, context {BLOCK}, batch {BATCH} per rank), "
          f"sim device per rank, gloo, {steps} steps, {runs} round(s)")
    print(f"{'round':>5} {'link 1 rank':>12} {'link 2 ranks (each)':>22} {'update 1/2 ms':>15} "
          f"{'step 1/2 ms':>13} {'model 1/2 ms':>13}")
    for i, r in enumerate(rows):
        each = ", ".join(f"{b / 1e6:.1f}" for b in r["link_bytes_2"])
        print(f"{i:>5} {r['link_bytes_1'] / 1e6:>10.1f}MB {each:>20}MB "
              f"{r['update_s_1'] * 1e3:>6.1f}/{max(r['update_s_2']) * 1e3:<7.1f} "
              f"{r['step_s_1'] * 1e3:>6.0f}/{r['step_s_2'] * 1e3:<6.0f} "
              f"{r['predicted_s_1'] * 1e3:>6.0f}/{r['predicted_s_2'] * 1e3:<6.0f}")
    print("headline (median, [min, max]): " + ", ".join(
        f"{k}={spread[k]['median']:.3f} [{spread[k]['min']:.3f}, {spread[k]['max']:.3f}]" for k in keys))
    config = {"preset": PRESET, "block_size": BLOCK, "batch_per_rank": BATCH, "subgroup_numel": SUBGROUP,
              "steps": steps, "quick": args.quick}
    print(f"wrote {write('distributed', rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
