"""What the step model predicts: the work of one optimizer step (`Workload`) and the runtime configuration that runs
it (`StepConfig`), each validated with the engine's rules and messages. predict/stepmodel.py re-exports both.

    work = Workload(num_params=7e9, tokens=8 * 4096, num_tensors=291)
    config = StepConfig(delay=True)            # OffloadAdam with the delayed update
    config = StepConfig(ranks=8)               # 8 ranks: the optimizer state sharded, weights replicated
    config = StepConfig(bucket_numel=1 << 20, speculative=True)  # bucketed gradient copies, updates during backward

What this is not: the model of the step (predict/stepmodel.py builds and schedules its operations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..options import OffloadOptions
from .memory import PRECISIONS
from .shards import _check_ranks

PARAMS_ON = ("device", "host", "nvme")  # where the blocks' weights live (StepConfig.params_on)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains: `num_params` over `tokens` tokens (batch x sequence x accumulation),
    in `precision`; `num_tensors` parameter tensors (each gradient one copy out, paying a copy's latency, unless
    bucketed; the new weights go up one copy per subgroup)."""

    num_params: int
    tokens: int
    precision: str = "mixed_bf16"
    num_tensors: int = 1
    recompute: bool = False  # full activation checkpointing: one more forward during backward
    num_layers: int = 1  # transformer blocks, of equal size: streamed parameters travel block by block
    resident_params: int = 0  # parameters outside the blocks (embeddings, tied head, final norm): never streamed

    def __post_init__(self) -> None:
        for name in ("num_params", "tokens", "num_tensors", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not value >= 1:
                raise ValueError(f"{name} must be at least 1, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if isinstance(self.resident_params, bool) or not 0 <= self.resident_params < self.num_params:
            raise ValueError(f"resident_params must be in [0, num_params) (the blocks hold the rest), got "
                             f"{self.resident_params!r} of {self.num_params}")

    @property
    def block_params(self) -> float:
        """Parameters of one block."""
        return (self.num_params - self.resident_params) / self.num_layers

    @property
    def model_bytes(self) -> int:
        """Bytes per value of the weights and gradients the device computes with."""
        return 4 if self.precision == "fp32" else 2

    def subgroups(self, numel: int) -> list[tuple[int, int]]:
        """(params, tensors) per subgroup: parameters packed in order into subgroups of about `numel`, tensors of
        equal size (the model knows counts, not shapes)."""
        per_tensor = self.num_params / self.num_tensors
        per_group = max(1, min(self.num_tensors, int(numel // per_tensor) or 1))
        out, left = [], self.num_tensors
        while left > 0:
            tensors = min(per_group, left)
            out.append((round(tensors * per_tensor), tensors))
            left -= tensors
        return out

    @classmethod
    def of(cls, model, tokens: int, precision: str | None = None, recompute: bool = False) -> Workload:
        """The workload of a torch model: its trainable parameters and tensors, its dtype unless given; its blocks
        from `model.blocks` when it has them (a course GPT), else one block of everything."""
        params = [p for p in model.parameters() if p.requires_grad]
        if precision is None:
            precision = "fp32" if params[0].dtype.itemsize == 4 else "mixed_bf16"
        num_params, blocks = sum(p.numel() for p in params), getattr(model, "blocks", None)
        if not blocks:
            return cls(num_params, tokens, precision, len(params), recompute)
        in_blocks = sum(p.numel() for p in blocks.parameters() if p.requires_grad)
        return cls(num_params, tokens, precision, len(params), recompute, len(blocks), num_params - in_blocks)


def pack_buckets(sizes: Sequence[float], bucket_numel: int) -> list[list[float]]:
    """Tensor sizes, in order, packed as the engine packs a subgroup's gradients (buckets.make_buckets): consecutive
    tensors in buckets of at most `bucket_numel` elements; a tensor larger than that is a bucket of its own."""
    buckets: list[list[float]] = []
    filled = 0.0
    for size in sizes:
        if not buckets or filled + size > bucket_numel:
            buckets.append([])
            filled = 0.0
        buckets[-1].append(size)
        filled += size
    return buckets


@dataclass(frozen=True)
class StepConfig:
    """The runtime configuration to predict. `offload=False`: everything on the device (torch's AdamW there).
    Otherwise OffloadAdam with the options of the same names; `nvme`: its NVMe tier; `clip`: max_grad_norm set.

    `ranks`: processes, one device each, each running its own micro-batch of `Workload.tokens`. Weights and
    gradients are replicated on every device; with offload the optimizer state is sharded (each rank owns whole
    subgroups, shards.shard_owners), without it the ranks are plain data parallel (gradients all-reduced).

    `bucket_numel`: gradients leave in buckets of about that many elements (one copy each) instead of one copy per
    tensor. `speculative`: each subgroup's CPU update starts as soon as its gradients are on the host, during
    backward; the model predicts the common case, where the validation after backward redoes nothing. The
    engine's `backwards_per_step` is not modelled: `Workload.tokens` is one backward (with several, only the
    last one's share would overlap a speculative update)."""

    offload: bool = True
    subgroup_numel: int = 1 << 22
    delay: bool = False
    gpu_fraction: float | None = None
    stride: int | None = None
    nvme: bool = False
    clip: bool = False
    mfu: float = 0.4  # model FLOP/s utilisation of forward and backward
    params_on: str = "device"  # the blocks' weights: resident ("device"), or streamed from "host" or "nvme"
    prefetch: int = 1  # streamed: blocks fetched ahead of the one computing (0: on demand)
    ranks: int = 1  # processes (one device and one share of a host each)
    bucket_numel: int | None = None  # elements per gradient bucket (one D2H copy each); None: one copy per tensor
    speculative: bool = False  # each subgroup's CPU update starts when its gradients arrive, during backward

    def __post_init__(self) -> None:
        _check_ranks(self.ranks)
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if self.params_on not in PARAMS_ON:
            raise ValueError(f"params_on must be one of {', '.join(map(repr, PARAMS_ON))}, got {self.params_on!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (blocks fetched ahead; 0 fetches on demand), got "
                             f"{self.prefetch!r}")
        options = self.options  # the engine's rules, with its messages (options.py)
        offload_only = [{"delay_updates_after": "delay"}.get(name, name) for name in options.offload_only()]
        if not self.offload and (offload_only or self.nvme):
            named = [*offload_only, *(["nvme"] if self.nvme else [])]
            are = "is an option" if len(named) == 1 else "are options"
            raise ValueError(f"{', '.join(named)} {are} of the offloaded optimizer; set offload=True or drop "
                             f"{'it' if len(named) == 1 else 'them'}")
        if self.streamed and not self.offload:
            raise ValueError(f"params_on={self.params_on!r} streams weights that the CPU optimizer updates; set "
                             "offload=True or params_on='device'")
        if self.streamed and (self.delay or self.gpu_fraction is not None or self.stride is not None):
            raise ValueError(f"params_on={self.params_on!r} is modelled with the synchronous CPU update only; drop "
                             "delay, gpu_fraction and stride, or set params_on='device'")
        if self.nvme:
            options.check_nvme()
        if self.ranks > 1 and self.streamed:
            raise ValueError(f"params_on={self.params_on!r} with ranks={self.ranks}: the sharded engine keeps every "
                             "weight on each rank's device and does not stream them; set params_on='device' or "
                             "ranks=1")
        if self.ranks > 1 and (self.delay or self.gpu_fraction is not None or self.stride is not None):
            raise ValueError(f"delay, gpu_fraction and stride with ranks={self.ranks}: the sharded engine runs the "
                             "synchronous CPU update (train's shard); drop them, or set ranks=1")
        if self.speculative and self.ranks > 1:
            raise ValueError(f"speculative with ranks={self.ranks}: the sharded engine updates after every rank's "
                             "gradients are reduced, not during backward; set speculative=False or ranks=1")
        if self.speculative and self.streamed:
            raise ValueError(f"speculative with params_on={self.params_on!r}: streamed weights are modelled with the "
                             "synchronous CPU update only; set speculative=False or params_on='device'")

    @property
    def streamed(self) -> bool:
        return self.params_on != "device"

    @property
    def options(self) -> OffloadOptions:
        """The engine's options this configuration predicts."""
        return OffloadOptions(subgroup_numel=self.subgroup_numel, max_grad_norm=1.0 if self.clip else None,
                              delay_updates_after=0 if self.delay else None, gpu_fraction=self.gpu_fraction,
                              stride=self.stride, bucket_numel=self.bucket_numel, speculative=self.speculative)

    @classmethod
    def of(cls, options: OffloadOptions, offload: bool = True, nvme: bool = False, mfu: float = 0.4,
           params_on: str = "device", prefetch: int = 1, ranks: int = 1) -> StepConfig:
        """The configuration of an engine built with `options` (its delayed update counted from the start; its
        backwards_per_step not modelled: see the class's docstring)."""
        return cls(offload=offload, subgroup_numel=options.subgroup_numel, delay=options.delayed,
                   gpu_fraction=options.gpu_fraction, stride=options.stride, nvme=nvme,
                   clip=options.max_grad_norm is not None, mfu=mfu, params_on=params_on, prefetch=prefetch,
                   ranks=ranks, bucket_numel=options.bucket_numel, speculative=options.speculative)
