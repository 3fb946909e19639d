"""Streamed parameters on paper (chapter 8): the largest GPT each machine trains with its blocks' weights in host
memory or on NVMe, and three published setups checked against our model.

    for fit in largest_fits(): print(fit)          # per preset and home, prefetch depth 2: shape, bytes, step
    for v in published_setups(): print(v)          # SynergyScale, ZeRO-Infinity, Fuyou: fits? where? how fast?
    v.assumptions                                  # where our model departs from the paper

Models come from one shape family, GPT-3's (Brown et al. 2020, Table 2.1: n_layer, d_model and heads per size;
vocabulary 50257, context 2048, biases, a tied head). Between the table's rows the depth is interpolated linearly in
d_model; beyond 175B (d_model 12288) the family is extrapolated at 175B's aspect ratio, n_layer = d_model / 128,
with heads of 128: those shapes are ours, not trained models.

A model fits when `memory.streamed_bytes` puts its device and host bytes within the profile's (the profiles have no
NVMe capacity: taken as unbounded), with every block recomputed in backward on one sequence of 2048 tokens per
device. The "host" home keeps the optimizer on the CPU with its state in host memory; the "nvme" home puts the
optimizer's state on NVMe as well. Step times are `stepmodel.predict`'s for that one sequence.

What this is not: a planner (it tries the two homes and depths 2, 1, 0, nothing else), nor a reproduction of the
papers: each verdict lists the assumptions where our model departs from the setup it checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..machine import profiles
from ..machine.profiles import Hardware
from ..units import GB, GiB
from . import memory
from .shapes import CONTEXT, GPT3, VOCAB, Shape, shape, shape_for  # noqa: F401  (chapter 8 reads them here)
from .stepmodel import Prediction, StepConfig, predict

SUBGROUP = 1 << 26  # the optimizer's subgroup size in these predictions (coarser than the engine's default)


def needed_bytes(model: Shape, params_on: str, prefetch: int, precision: str = "mixed_bf16",
                 sequences: int = 1) -> dict[str, int]:
    """Bytes per tier (memory.streamed_bytes) of `model` with every block recomputed, `sequences` of 2048 tokens."""
    acts = memory.activation_bytes(model.n_layer, CONTEXT, sequences, model.d_model, model.n_head, "recompute",
                                   4 if precision == "fp32" else 2, model.fused_attention)
    return memory.streamed_bytes(model.num_params, model.n_layer, model.resident_params, params_on, prefetch,
                                 precision, nvme=params_on == "nvme", activations=acts, subgroup_numel=SUBGROUP)


def _over(needed: dict[str, int], hw: Hardware) -> list[str]:
    return [tier for tier, capacity in (("device", hw.device_memory), ("host", hw.host_memory))
            if needed[tier] > capacity]


def step(model: Shape, hw: Hardware, params_on: str, prefetch: int, precision: str = "mixed_bf16",
         tokens: int = CONTEXT) -> Prediction:
    """stepmodel.predict of `model` streamed from `params_on` at depth `prefetch` (the optimizer's state on NVMe with
    the "nvme" home), every block recomputed."""
    config = StepConfig(optimizer_on="nvme" if params_on == "nvme" else "host", params_on=params_on,
                        prefetch=prefetch, subgroup_numel=SUBGROUP)
    return predict(model.workload(tokens, precision), hw, config)


@dataclass(frozen=True)
class Fit:
    """The largest model of the family that fits `hardware` with its blocks at home in `params_on` (None: not
    even the smallest), its bytes per tier and its predicted step."""

    hardware: str
    params_on: str
    prefetch: int
    model: Shape | None
    needed: dict[str, int] | None
    prediction: Prediction | None

    def __str__(self) -> str:
        if self.model is None:
            return f"{self.hardware:<10} params on {self.params_on:<5}: nothing fits"
        p = self.prediction
        device, host = self.needed["device"] / GB, self.needed["host"] / GB
        return (f"{self.hardware:<10} params on {self.params_on:<5}: {str(self.model):<22} device {device:6.1f} GB, "
                f"host {host:7.1f} GB, step {p.step_s:7.2f} s ({p.bound}; exposed fetch "
                f"{p.exposed_fetch_fraction:.0%})")


def largest_fit(hw: Hardware, params_on: str, prefetch: int = 2, precision: str = "mixed_bf16") -> Fit:
    best, d = None, 768
    while not _over(needed_bytes(shape(d), params_on, prefetch, precision), hw):
        best, d = shape(d), d + 128
    if best is None:
        return Fit(hw.name, params_on, prefetch, None, None, None)
    return Fit(hw.name, params_on, prefetch, best, needed_bytes(best, params_on, prefetch, precision),
               step(best, hw, params_on, prefetch, precision))


def largest_fits(prefetch: int = 2) -> list[Fit]:
    """`largest_fit` for every preset (profiles.PRESETS, then PAPER_PRESETS) and both homes."""
    machines = [*profiles.PRESETS.values(), *profiles.PAPER_PRESETS.values()]
    return [largest_fit(hw, home, prefetch) for hw in machines for home in ("host", "nvme")]


# ---------------------------------------------------------------------------------------------------
# Published setups


@dataclass(frozen=True)
class Verdict:
    """A published setup on paper: the family's model closest to the claimed size on `hardware`; where it fits
    (`params_on` and `prefetch`: the first of host at depth 2, 1, 0, then nvme at 2, 1, 0 that fits; when none
    does, nvme at the deepest depth whose device bytes fit, else at depth 0), its bytes against the capacities, and
    its predicted step (predicted whether it fits or not)."""

    setup: str
    claimed_params: float
    hardware: Hardware
    model: Shape
    fits: bool
    params_on: str
    prefetch: int
    needed: dict[str, int]
    over: tuple[str, ...]  # tiers that do not hold what is needed
    prediction: Prediction
    tokens: int
    assumptions: tuple[str, ...]

    def __str__(self) -> str:
        hw, n, p = self.hardware, self.needed, self.prediction
        where = f"fits with params on {self.params_on}" if self.fits else \
            f"does not fit ({', '.join(self.over)} over) even with params on {self.params_on}"
        return (f"{self.setup}: {self.model}, {where}, depth {self.prefetch}: device {n['device'] / GB:.1f} of "
                f"{hw.device_memory / GB:.0f} GB, host {n['host'] / GB:.0f} of {hw.host_memory / GB:.0f} GB, nvme "
                f"{n['nvme'] / GB:.0f} GB; step {p.step_s:.1f} s for {self.tokens} tokens, bound by {p.bound}, "
                f"exposed fetch {p.exposed_fetch_fraction:.0%}")


def check(setup: str, claimed_params: float, hw: Hardware, assumptions, precision: str = "mixed_bf16",
          gpus: int = 1) -> Verdict:
    """Our model's verdict on `claimed_params` trained on `hw` (with `gpus` data-parallel devices folded into it,
    each holding the whole window and one sequence)."""
    model = shape_for(claimed_params)
    tries = [(home, k, needed_bytes(model, home, k, precision)) for home in ("host", "nvme") for k in (2, 1, 0)]
    fitting = [t for t in tries if not _over(t[2], hw)]
    device_fits = [t for t in tries[3:] if "device" not in _over(t[2], hw)]
    home, k, needed = (fitting or device_fits or tries[-1:])[0]
    over = tuple(_over(needed, hw))
    tokens = gpus * CONTEXT
    return Verdict(setup, claimed_params, hw, model, not over, home, k, needed, over,
                   step(model, hw, home, k, precision, tokens), tokens, tuple(assumptions))


def _scaled(hw: Hardware, figures: tuple[str, ...], times: int, name: str, why: str) -> Hardware:
    changes = {f: type(getattr(hw, f))(getattr(hw, f) * times) for f in figures}
    sources = {**hw.sources, **{f: f"{hw.sources[f]}; x {times}: {why}" for f in figures}}
    return dataclasses.replace(hw, name=name, description=f"{hw.description}; {why}", sources=sources, **changes)


_HOST = ("host_memory", "host_bandwidth", "cpu_adam_rate", "nvme_read", "nvme_write", "cores")
_DEVICES = ("peak_flops_bf16", "peak_flops_fp32", "device_adam_rate", "link_theoretical", "link_h2d", "link_d2h")
COMMON = ("batch size not modelled from the paper: one sequence of 2048 tokens per GPU, every block recomputed",
          "our CPU Adam rate is the profile's estimate (80% of host bandwidth / 28 B per parameter)",
          "our engine keeps every gradient in host memory (fp32 buffer + staging: 6 B/param), with the NVMe tier too",
          "activations stay on the device (recomputed); none go to host memory or NVMe")


def published_setups() -> list[Verdict]:
    """SynergyScale's 114.41B on one A100-80GB, ZeRO-Infinity's 1T on one DGX-2, Fuyou's 175B on one RTX 4090."""
    a100 = _scaled(profiles.preset("a100-sxm"), _HOST, 8, "a100-sxm + DGX A100 host",
                   "one GPU given the whole node's host")
    dgx2 = _scaled(_scaled(profiles.preset("v100-dgx2"), _HOST, 16, "dgx-2", "the node's host"), _DEVICES, 16,
                   "dgx-2", "the node's 16 GPUs as one device")
    rtx = dataclasses.replace(profiles.preset("rtx4090"), name="rtx4090 + 256 GiB", host_memory=256 * GiB,
                              sources={**profiles.preset("rtx4090").sources, "host_memory":
                                       "the setup as Fuyou's 175B result is usually quoted: one RTX 4090 with 256 GB "
                                       "of host memory (DIMMs: taken as GiB)"})
    return [
        check("SynergyScale 114.41B on one A100-80GB", 114.41e9, a100, [
            "the paper's host is not in our references: the A100 is given a whole DGX A100-like host (2 TiB, two "
            "EPYC 7742 sockets, eight NVMe drives); one GPU's share of that node has 8x less",
            "the model is our family's closest shape, not the paper's",
            "SynergyScale chooses what to offload automatically and splits work over several streams; we stream "
            "every block and update on the CPU", *COMMON]),
        check("ZeRO-Infinity 1T on one DGX-2", 1e12, dgx2, [
            "the node as one device: 16 V100s' FLOPs, links, host and drives summed (ZeRO-3 data parallel; each GPU "
            "reads 1/16 of a block over its own link); the all-gather over NVSwitch is not modelled; each GPU holds "
            "the whole window of blocks",
            "V100 has no bf16: fp16 mixed precision (the same bytes)",
            "the 1T shape is extrapolated beyond GPT-3 175B (n_layer = d_model / 128), not the paper's",
            "ZeRO-Infinity's memory-centric tiling splits a block's large operators; our window holds whole blocks",
            "ZeRO-Infinity offloads gradients to NVMe and activation checkpoints to host memory",
            "DGX-2 NVMe rates are estimates", *COMMON], precision="mixed_fp16", gpus=16),
        check("Fuyou 175B on one RTX 4090 with 256 GB of host memory", 175e9, rtx, [
            "host memory 256 GB, as the result is usually quoted (Fuyou's paper may use a larger host); the rest "
            "is our rtx4090 workstation preset",
            "one NVMe drive (a Samsung 990 PRO); Fuyou spreads its I/O over several SSDs",
            "Fuyou overlaps its out-of-core CPU Adam with backward and swaps activations to SSD; we update after "
            "backward and keep activations on the device",
            "GPT-3 175B's shape from its table", *COMMON]),
    ]
