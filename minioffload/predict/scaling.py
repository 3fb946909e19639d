"""Sharded offload on paper: the step model's prediction at 1, 2, 4, 8 ranks, and what the papers report at N GPUs.

    rows = scaling(work, profiles.preset("8xh100-sxm"))             # one row per rank count
    rows[-1]["speedup"], rows[-1]["efficiency"]                      # tokens/s over one rank's; over the ideal
    capacity(profiles.preset("8xh100-sxm"), ranks=8)                 # the largest model the sharded state fits
    PUBLISHED                                                        # what the papers report, with their keys

Each rank runs its own micro-batch (`work.tokens` per rank), so the job's tokens per step grow with the ranks; the
optimizer state is sharded (each rank's link, cores and drive carry 1/N of it), weights and gradients replicated
(options.Placement's `ranks`). So efficiency can pass 1: a step bound by the CPU update gets shorter as the shards
shrink, while each rank still trains its own micro-batch.

What this is not: a measurement (the engine's sharded runs are), nor a model of more than one node's topology: every
rank pair is taken at the profile's `interconnect`.
"""

from __future__ import annotations

from ..machine.profiles import Hardware
from ..options import Placement, check_field
from .memory import PRECISIONS
from .stepmodel import StepConfig, Workload, predict

# Multi-GPU offload figures the papers report, with their citation keys in book/references.bib. They
# are capacities, not throughput: neither paper gives tokens/s at N GPUs. Both systems shard or stream the
# weights too (ZeRO-3 style), which this sharding (weights replicated) does not: compare with `capacity`.
PUBLISHED = (
    {"system": "ZeRO-Infinity", "key": "rajbhandari2021zeroinfinity", "gpus": 16, "hardware": "v100-dgx2",
     "params": 1e12, "kind": "capacity", "figure": "fine-tunes 1T parameters on one DGX-2 (NVMe offload)"},
    {"system": "SynergyScale", "key": "sun-synergyscale", "gpus": 1, "hardware": "A100 80 GB", "params": 114.41e9,
     "kind": "capacity", "figure": "114.41B parameters on one 80 GB A100 (SynergyScale)"},
    {"system": "SynergyScale", "key": "sun-synergyscale", "gpus": 8, "hardware": "A100 80 GB", "params": 547.77e9,
     "kind": "capacity", "figure": "547.77B parameters on eight A100s (SynergyScale)"},
)


def scaling(work: Workload, hw: Hardware, ranks_list: tuple[int, ...] = (1, 2, 4, 8),
            config: StepConfig | None = None) -> list[dict]:
    """Per rank count: the predicted step ("step_s"), tokens/s of the job ("tokens_per_s") and per GPU
    ("tokens_per_s_per_gpu"), the speedup over one rank and the efficiency (speedup / ranks), the bytes over one
    rank's host link ("link_bytes", D2H + H2D) and over the interconnect ("interconnect_bytes", sent per rank), and the
    bound resource. `config` (default: optimizer offload) is predicted with each `ranks`."""
    config = config or StepConfig()
    if not ranks_list:
        raise ValueError("ranks_list must name at least one rank count, e.g. (1, 2, 4, 8)")
    one = predict(work, hw, config.replace(ranks=1))
    rows = []
    for ranks in ranks_list:
        p = one if ranks == 1 else predict(work, hw, config.replace(ranks=ranks))
        tokens_per_s = ranks * work.tokens / p.step_s
        speedup = tokens_per_s / (work.tokens / one.step_s)
        rows.append({"ranks": ranks, "step_s": p.step_s, "tokens_per_s": tokens_per_s,
                     "tokens_per_s_per_gpu": tokens_per_s / ranks, "speedup": speedup, "efficiency": speedup / ranks,
                     "link_bytes": p.link_bytes, "interconnect_bytes": p.interconnect_bytes, "bound": p.bound})
    return rows


def capacity(hw: Hardware, ranks: int = 1, precision: str = "mixed_bf16") -> float:
    """The largest parameter count whose weights fit each device (model dtype; activations and working buffers not
    counted: an upper bound) and whose offloaded state fits each rank's host share (fp32 gradient, model-dtype
    staging and 12 B/param of Adam state, 1/ranks of it per rank)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    check_field(Placement, "ranks", ranks)
    model_bytes = 4 if precision == "fp32" else 2
    return min(hw.device_memory / model_bytes, hw.host_memory * ranks / (4 + model_bytes + 12))
