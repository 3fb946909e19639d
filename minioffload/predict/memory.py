"""Byte accounting for training: where every byte of a model's training state lives.

Pure bookkeeping (nothing here allocates real memory):

* `footprint(precision, optimizer, placement)`: bytes per parameter on each tier (device, host,
  nvme) for weights, gradients, master weights and optimizer state. Mixed-precision Adam gives the
  classic 2 + 2 + 4 + 4 + 4 = 16 B/param of ZeRO (Rajbhandari et al., 2020).
* `activation_bytes_per_layer(...)`: activation memory of one GPT block, from Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models" (2022); block_activations.py counts it term by term,
  and other layouts (Llama's RMSNorm, SwiGLU, grouped-query attention) the same way.
* `engine_bytes(...)`: what `OffloadAdam` holds on each tier, exactly, subgroup by subgroup.
* `streamed_bytes(...)`, `activation_bytes(...)`: each tier with the blocks' weights streamed (chapter 8), and
  the activations a stack of blocks holds under one of chapter 7's policies.

`Ledger` (named tiers with capacities, an out-of-memory error that says what to change, a history) lives in
ledger.py and the units in units.py; both are importable from here, as chapter 1 does.

What this is not: a profiler. It counts what a plan says will be resident, not what an allocator
does (no fragmentation, no CUDA context, no temporary buffers). Later chapters compare it with the
real allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import device_subgroups, pack_sizes
from ..ledger import Allocation, Event, Ledger, OutOfMemoryError  # noqa: F401  (chapters import them from here)
from ..options import OffloadOptions, Placement, check_run, settings
from ..units import GB, GiB, MiB, format_bytes  # noqa: F401
from ..units import require_positive as _require_positive
from .shards import shard_owners

PRECISIONS = ("fp32", "mixed_fp16", "mixed_bf16", "bf16")
OPTIMIZERS = ("adam", "adamw", "sgd_momentum")
PLACEMENTS = ("device", "optimizer_cpu", "optimizer_nvme", "params_cpu", "params_nvme")
TIERS = ("device", "host", "nvme")

# Bytes per value of the weights the model computes with, per precision.
_MODEL_BYTES = {"fp32": 4, "mixed_fp16": 2, "mixed_bf16": 2, "bf16": 2}
# Bytes per value of what the optimizer updates (master weights) and keeps (its state).
_MASTER_BYTES = {"fp32": 4, "mixed_fp16": 4, "mixed_bf16": 4, "bf16": 2}
# How many state tensors of the parameter's size each optimizer keeps.
_STATE_COUNT = {"adam": 2, "adamw": 2, "sgd_momentum": 1}
_STATE_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
                "sgd_momentum": ("momentum",)}


def _require(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class Part:
    """One component of the training state: `bytes_per_param` bytes per parameter on `tier`."""

    name: str  # "weights", "grads", "master", "exp_avg", ...
    tier: str  # one of TIERS
    bytes_per_param: int


@dataclass(frozen=True)
class Footprint:
    """Bytes per parameter of a training setup, split into parts and tiers."""

    precision: str
    optimizer: str
    placement: str
    parts: tuple[Part, ...]

    def per_param(self, tier: str | None = None) -> int:
        """Bytes per parameter on `tier`, or on all tiers together when `tier` is None."""
        if tier is not None:
            _require(tier, TIERS, "tier")
        return sum(p.bytes_per_param for p in self.parts if tier is None or p.tier == tier)

    def bytes(self, num_params: float, tier: str | None = None) -> int:
        """Total bytes for a model of `num_params` parameters (on one tier, or on all)."""
        _require_positive(num_params, "num_params")
        return int(round(num_params)) * self.per_param(tier)

    def by_tier(self) -> dict[str, int]:
        return {tier: self.per_param(tier) for tier in TIERS}

    def table(self) -> str:
        """A small text table: one row per part, then the total per tier."""
        lines = [f"{'part':<12}{'tier':<8}{'B/param':>8}"]
        lines += [f"{p.name:<12}{p.tier:<8}{p.bytes_per_param:>8}" for p in self.parts]
        lines.append("-" * 28)
        lines += [f"{'total':<12}{t:<8}{b:>8}" for t, b in self.by_tier().items() if b]
        return "\n".join(lines)


def footprint(precision: str = "mixed_bf16", optimizer: str = "adam", placement: str = "device",
              delay: bool = False, speculative: bool = False, grads_on: str = "host") -> Footprint:
    """Bytes per parameter of weights, grads, master weights and optimizer state, per tier.

    precision: "fp32" (everything fp32), "mixed_fp16"/"mixed_bf16" (16-bit weights and grads, fp32
        master weights and state), "bf16" (everything bf16, no master copy).
    optimizer: "adam"/"adamw" (two states) or "sgd_momentum" (one).
    placement:
        "device"         everything on the GPU;
        "optimizer_cpu"  ZeRO-Offload: the GPU keeps the weights it computes with; gradients, master
                         weights and state live in pinned host memory, and the update runs on the CPU;
        "optimizer_nvme" ZeRO-Infinity for the optimizer: as above, but master weights and state on
                         NVMe (host memory holds the gradients that stream through);
        "params_cpu"     the weights live in host memory too and are streamed to the GPU layer by
                         layer: nothing is resident per parameter on the device (a working set of a
                         few layers is, which this per-parameter count leaves out);
        "params_nvme"    ZeRO-Infinity in full: weights and optimizer state on NVMe, streamed through
                         host memory; the host keeps only the gradients.
    delay: the one-step delayed update (chapter 4): new weights wait in upload buffers of their own.
    speculative: the speculative update (chapter 4): a second set of master weights and state ("spare") that the
        update writes into during backward, until validation keeps it.
    grads_on: "nvme" (with the state on NVMe, chapter 12): the fp32 gradients wait on the drive (two versions), and
        host memory holds no gradient per parameter (their few pinned sets are per subgroup: `engine_bytes`).

    Offloaded placements count what minioffload's engine (`OffloadAdam`) allocates, not the textbook
    minimum: gradients arrive in a pinned staging buffer in the model's dtype and are summed into an fp32
    buffer ("grads": 4 B, "staging": 2 or 4 B), so a bf16 model holds 4 + 2 + 12 = 18 B/param of pinned host
    memory and an fp32 one 20, where ZeRO's count (2 B of gradient) gives 14 and 16. On NVMe the swapper
    keeps the previous version of every file until the new one is durable ("previous": 2x the state).
    `engine_bytes` adds what is not per parameter (working sets, device scratch).

    The "master" part is the copy of the weights the optimizer updates. It is absent when the model
    already computes in the optimizer's dtype on the same tier (fp32 or bf16 on the device).
    """
    _require(precision, PRECISIONS, "precision")
    _require(optimizer, OPTIMIZERS, "optimizer")
    _require(placement, PLACEMENTS, "placement")
    if grads_on not in ("host", "nvme"):
        raise ValueError(f"grads_on must be 'host' or 'nvme', got {grads_on!r}")
    if grads_on == "nvme" and placement not in ("optimizer_nvme", "params_nvme"):
        raise ValueError(f"grads_on='nvme' keeps the gradients beside the optimizer's state on NVMe: placement "
                         f"'optimizer_nvme' or 'params_nvme', got {placement!r}")
    for name, on in (("the delayed update", delay), ("the speculative update", speculative)):
        if on and placement != "optimizer_cpu":
            raise ValueError(f"{name} runs with placement 'optimizer_cpu' only (the engine refuses it with the NVMe "
                             f"tier and streamed weights), got placement {placement!r}")

    model_b, master_b = _MODEL_BYTES[precision], _MASTER_BYTES[precision]
    weights_tier = {"params_cpu": "host", "params_nvme": "nvme"}.get(placement, "device")
    state_tier = {"device": "device", "optimizer_cpu": "host", "optimizer_nvme": "nvme", "params_cpu": "host",
                  "params_nvme": "nvme"}[placement]

    parts = [Part("weights", weights_tier, model_b)]
    if placement == "device":
        parts.append(Part("grads", "device", model_b))
    elif grads_on == "nvme":  # summed in a few pinned sets (per subgroup, not per parameter), then on the drive
        parts += [Part("grads", "nvme", 4), Part("previous grads", "nvme", 4)]
    else:  # the engine's gradient path: staging in the model's dtype, summed into an fp32 buffer
        parts += [Part("grads", "host", 4), Part("staging", "host", model_b)]
    needs_master = model_b != master_b or state_tier != weights_tier or placement == "params_nvme"
    if needs_master:
        parts.append(Part("master", state_tier, master_b))
    parts += [Part(name, state_tier, master_b) for name in _STATE_NAMES[optimizer]]
    assert len(_STATE_NAMES[optimizer]) == _STATE_COUNT[optimizer]
    if state_tier == "nvme":  # two slot files per key: the last durable version stays until the next commits
        parts.append(Part("previous", "nvme", master_b * (1 + _STATE_COUNT[optimizer])))
    if delay:
        parts.append(Part("upload", "host", model_b))
    if speculative:
        parts.append(Part("spare", "host", master_b * (1 + _STATE_COUNT[optimizer])))
    return Footprint(precision, optimizer, placement, tuple(parts))


def engine_bytes(numels: list[int], precision: str = "mixed_bf16", placement: Placement | None = None,
                 options: OffloadOptions | None = None, scratch_sets: int = 3, **fields) -> dict[str, int]:
    """Bytes `OffloadAdam` holds on each tier for parameters of `numels` elements, exactly: the per-parameter
    parts of `footprint` plus what is per subgroup (the NVMe tier's working sets, the hybrid path's scratch).
    Its settings are a `placement` (the optimizer on the "host" or "nvme", `ranks`) and `options` (options.py), or
    their fields as keywords: engine_bytes(numels, optimizer_on="nvme", subgroup_numel=1 << 20).

    device: the weights, and for hybrid updates (gpu_fraction, stride) the resident subgroups' state and gradient
    (16 B/param) and `scratch_sets` sets of the largest streamed subgroup (state and gradient, 16 B/param each): 3 on
    a GPU, on the sim what `hybrid.scratch_sets` answers for its link (`DevicePath.sets`). host: pinned memory (with
    the delayed update, the upload buffers; with `speculative`, a second set of state for every CPU subgroup; with
    grads_on="nvme", no gradient per parameter but `grad_buffers` sets of the largest subgroup's).
    nvme: the swapper's files (two versions of each subgroup's state, padded to 4 KiB). Refuses what the engine
    refuses (options.check_run); the kept small parameters of `min_offload_numel` are not modelled.

    `ranks` > 1: the state sharded (shards.shard_owners), weights replicated: device bytes are each rank's, host and
    nvme bytes the rank's that owns the most elements (every rank's own share of the host must hold its shard).
    """
    _require(precision, PRECISIONS, "precision")
    placement, options = settings(placement, options, **fields)
    check_run(placement, options)
    ranks, nvme = placement.ranks, placement.optimizer_on == "nvme"
    model_b = _MODEL_BYTES[precision]
    sizes = pack_sizes(list(numels), options.subgroup_numel)
    resident, streamed = device_subgroups(len(sizes), options.gpu_fraction, options.stride)
    on_cpu = [n for i, n in enumerate(sizes) if i not in set(resident) | set(streamed)]
    if ranks != 1:
        owners = shard_owners(sizes, ranks)
        heaviest = max(range(ranks), key=lambda r: sum(n for n, o in zip(sizes, owners, strict=True) if o == r))
        on_cpu = [n for n, o in zip(sizes, owners, strict=True) if o == heaviest]
    state = 3 * 4  # fp32 master, exp_avg, exp_avg_sq
    device = sum(numels) * model_b + 16 * sum(sizes[i] for i in resident)
    device += scratch_sets * 16 * max((sizes[i] for i in streamed), default=0)
    host = state * sum(sizes[i] for i in streamed)  # streamed subgroups keep their state on the host
    grads_on_nvme = placement.grads_on == "nvme"
    per_cpu_param = ((0 if grads_on_nvme else 4 + model_b) + (model_b if options.delayed else 0)
                     + (0 if nvme else state) + (state if options.speculative else 0))
    host += per_cpu_param * sum(on_cpu)
    disk = 0
    if nvme and on_cpu:
        # the working sets (with gradients on NVMe, each reads the gradient too); the files, padded to 4 KiB, two
        # versions of each
        host += options.nvme_buffers * (state + (4 if grads_on_nvme else 0)) * max(on_cpu)
        files = 3 + (1 if grads_on_nvme else 0)
        disk = sum(2 * files * (-(-4 * n // 4096) * 4096) for n in on_cpu)
    if grads_on_nvme and on_cpu:  # the gradients' pinned sets: fp32 sum and staging of the largest subgroup
        host += options.grad_buffers * (4 + model_b) * max(on_cpu)
    return {"device": device, "host": host, "nvme": disk}


def max_params_that_fit(capacity_bytes: float, fp: Footprint, tier: str = "device") -> float:
    """The largest parameter count whose per-parameter state on `tier` fits in `capacity_bytes`.

    Returns infinity when the placement keeps nothing per parameter on that tier.
    """
    _require_positive(capacity_bytes, "capacity_bytes")
    per_param = fp.per_param(tier)
    return float("inf") if per_param == 0 else capacity_bytes / per_param


def activation_bytes_per_layer(
    seq_len: int,
    batch_size: int,
    hidden: int,
    num_heads: int,
    checkpointing: bool = False,
    flash_attention: bool = False,
) -> int:
    """Bytes of activations one GPT block keeps for its backward pass (16-bit activations).

    From Korthikanti et al. 2022, eq. (1), one device, no tensor or sequence parallelism:

        s*b*h * (34 + 5*a*s/h)      = 34*s*b*h + 5*a*s^2*b

    with s = seq_len, b = batch_size, h = hidden, a = num_heads. The 34*s*b*h term counts the
    inputs kept by the QKV, attention-output and MLP matmuls, the GeLU, both layer norms and the
    1-byte dropout masks; the 5*a*s^2*b term counts the softmax output, its dropout mask and the
    dropped-out scores (2 + 1 + 2 bytes per attention score).

    flash_attention: a fused attention kernel recomputes the scores in backward, so the a*s^2
        term disappears (it keeps O(s) softmax statistics instead, ignored here).
    checkpointing: full activation checkpointing keeps only the block's input, 2*s*b*h bytes,
        and recomputes the rest during backward.
    """
    for value, what in ((seq_len, "seq_len"), (batch_size, "batch_size"), (hidden, "hidden"),
                        (num_heads, "num_heads")):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if hidden % num_heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by num_heads ({num_heads})")
    s, b, h, a = seq_len, batch_size, hidden, num_heads
    if checkpointing:
        return 2 * s * b * h
    attention_scores = 0 if flash_attention else 5 * a * s * s * b
    return 34 * s * b * h + attention_scores


ACTIVATION_POLICIES = ("keep", "recompute", "selective", "offload", "offload_input")  # chapter 7's


def activation_bytes(num_layers: int, seq_len: int, batch_size: int, hidden: int, num_heads: int,
                     policy: str = "keep", value_bytes: int = 2, fused_attention: bool = False) -> int:
    """Activations on the device at the start of backward, for a stack of `num_layers` blocks under one policy:
    every block but one holds what the policy keeps, and the block in backward holds its whole set again
    (recomputed or brought back): (num_layers - 1) x held + keep. Per block, with chapter 7's policies:

        keep           Korthikanti et al.'s count (activation_bytes_per_layer)
        recompute      the block's input, 2 s b h
        selective      all but the attention scores (the count without the a s^2 term)
        offload        nothing: the saved tensors wait in host memory (not counted here)
        offload_input  nothing: the input waits in host memory

    `value_bytes`: 2 for 16-bit activations (the formula's), 4 for fp32 (twice the bytes). `fused_attention`: the
    attention kernel keeps no scores (torch's scaled_dot_product_attention, flash attention): keep and the block in
    backward drop the a s^2 term, and selective holds what keep holds.
    """
    _require(policy, ACTIVATION_POLICIES, "activation policy")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if value_bytes not in (2, 4):
        raise ValueError(f"value_bytes must be 2 (16-bit) or 4 (fp32), got {value_bytes!r}")
    shape = (seq_len, batch_size, hidden, num_heads)
    keep = activation_bytes_per_layer(*shape, flash_attention=fused_attention)
    held = {"keep": keep, "recompute": activation_bytes_per_layer(*shape, checkpointing=True),
            "selective": activation_bytes_per_layer(*shape, flash_attention=True)}.get(policy, 0)
    return ((num_layers - 1) * held + keep) * value_bytes // 2


def streamed_bytes(num_params: float, num_layers: int, resident_params: float = 0, params_on: str = "host",
                   prefetch: int = 1, precision: str = "mixed_bf16", nvme: bool = False, activations: int = 0,
                   subgroup_numel: int = 1 << 22, grads_on: str = "host", grad_buffers: int = 3) -> dict[str, int]:
    """Bytes on each tier when the blocks' weights are streamed (chapter 8) from their home `params_on` ("host" or
    "nvme"), `prefetch` blocks ahead, with the optimizer offloaded (its state on NVMe when `nvme`). The model is
    `num_layers` equal blocks plus `resident_params` outside them (embeddings, tied head, final norm).

    device: the resident weights, the window of prefetch + 1 blocks' weights, one block's gradients in flight
        (model dtype), and `activations` (bytes, e.g. from `activation_bytes`).
    host: the offloaded optimizer's per-parameter bytes (`footprint` with "optimizer_cpu" or "optimizer_nvme"),
        the NVMe tier's three working sets of `subgroup_numel` (when `nvme`), and with the "host" home one copy of
        the blocks in the model's dtype (none when the master already is in that dtype: fp32).
        With the "nvme" home, the pinned bounce buffers fetches read into: one per block of the window (prefetch + 1,
        at the default budget), and two buffers new weights are written home from.
    nvme: the optimizer's files (when `nvme`) and, with the "nvme" home, the blocks in the model's dtype.
    With `grads_on="nvme"` (and `nvme`) the gradients' per-parameter bytes move from host to drive, and the host
    holds `grad_buffers` sets of a subgroup's fp32 gradient and staging instead (the working sets read it too).

    Not counted: alignment padding, the buffers of writes in flight, what `engine_bytes` adds for hybrid updates.
    """
    if params_on not in ("host", "nvme"):
        raise ValueError(f"params_on must be 'host' or 'nvme' (where streamed blocks live; footprint() counts "
                         f"weights resident on the device), got {params_on!r}")
    _require(precision, PRECISIONS, "precision")
    _require_positive(num_params, "num_params")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not 0 <= resident_params < num_params:
        raise ValueError(f"resident_params must be in [0, num_params), got {resident_params!r} of {num_params!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (blocks fetched ahead), got {prefetch!r}")
    if activations < 0:
        raise ValueError(f"activations must be a number of bytes >= 0, got {activations!r}")
    model_b = _MODEL_BYTES[precision]
    block = (num_params - resident_params) / num_layers
    spills = grads_on == "nvme"
    optimizer = footprint(precision, "adam", "optimizer_nvme" if nvme else "optimizer_cpu", grads_on=grads_on)
    device = resident_params * model_b + (prefetch + 2) * block * model_b + activations  # window + grads
    host = num_params * optimizer.per_param("host")
    disk = num_params * optimizer.per_param("nvme")
    if nvme:
        subgroup = min(subgroup_numel, num_params)
        host += 3 * (4 + 4 * _STATE_COUNT["adam"] + (4 if spills else 0)) * subgroup
        host += grad_buffers * (4 + model_b) * subgroup if spills else 0
    home = (num_params - resident_params) * model_b
    if params_on == "nvme":
        disk += home
        # model/streaming.py's bounce buffers, and the two its update writes new weights home from
        host += (min(prefetch + 1, num_layers) + 2) * block * model_b
    elif model_b != _MASTER_BYTES[precision]:
        host += home
    return {"device": round(device), "host": round(host), "nvme": round(disk)}


# ---------------------------------------------------------------------------------------------
# Reference sizes used by chapter 1: parameter counts, and GPUS (name -> memory as sold, decimal GB, from the
# hardware table in machine/profiles.py)

MODELS = {
    "GPT-2 124M": 124e6,
    "GPT-2 1.5B": 1.5e9,
    "GPT-3 6.7B": 6.7e9,
    "GPT-3 13B": 13e9,
    "OPT-30B": 30e9,  # GPT-3 has no 30B or 66B model; OPT (Zhang et al., 2022) has
    "OPT-66B": 66e9,
    "GPT-3 175B": 175e9,
}


def __getattr__(name: str):
    # GPUS is read from the hardware table (machine/profiles.py imports this module, so it is built on first use)
    if name == "GPUS":
        from ..machine.profiles import PRESETS

        return {f"{label} {PRESETS[key].device_memory / GB:.0f} GB": PRESETS[key].device_memory
                for label, key in (("H100", "h100-sxm"), ("H200", "h200"))}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def first_placement_that_fits(num_params: float, device_bytes: float, precision: str = "mixed_bf16",
                              optimizer: str = "adam", host_bytes: float | None = None) -> str | None:
    """The least offloaded placement (in PLACEMENTS order) whose resident state fits.

    Counts per-parameter state only (no activations, no working set). `host_bytes=None` means host
    memory is not a constraint; NVMe is taken as unbounded. None when nothing fits.
    """
    _require_positive(device_bytes, "device_bytes")
    if host_bytes is not None:
        _require_positive(host_bytes, "host_bytes")
    for placement in PLACEMENTS:
        fp = footprint(precision, optimizer, placement)
        fits_device = fp.bytes(num_params, "device") <= device_bytes
        fits_host = host_bytes is None or fp.bytes(num_params, "host") <= host_bytes
        if fits_device and fits_host:
            return placement
    return None
