"""What the step model predicts: the work of one optimizer step (`Workload`) and the runtime configuration that runs
it (`StepConfig`: a `Placement` and `OffloadOptions`, options.py, checked by the settings' one table of rules).
predict/stepmodel.py re-exports both.

    work = Workload(num_params=7e9, tokens=8 * 4096, num_tensors=291)
    config = StepConfig(delay_updates_after=0)          # OffloadAdam with the delayed update
    config = StepConfig(ranks=8)                        # 8 ranks: the optimizer state sharded, weights replicated
    config = StepConfig(optimizer_on="nvme", max_grad_norm=1.0)   # the NVMe tier, gradients clipped
    config = StepConfig(bucket_numel=1 << 20, speculative=True)  # bucketed gradient copies, updates during backward
    config = StepConfig(placement, options, mfu=0.5)    # the settings of a run, as they are

What this is not: the model of the step (predict/stepmodel.py builds and schedules its operations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..options import OffloadOptions, Placement, check_model, settings
from .memory import PRECISIONS


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
        where model.streamed_blocks.find_blocks finds them (a course GPT, a Hugging Face GPT-2, Llama or BERT), else
        one block of everything."""
        from ..model.streamed_blocks import find_blocks

        params = [p for p in model.parameters() if p.requires_grad]
        if precision is None:
            precision = "fp32" if params[0].dtype.itemsize == 4 else "mixed_bf16"
        num_params = sum(p.numel() for p in params)
        try:
            blocks = find_blocks(model)
        except ValueError:
            return cls(num_params, tokens, precision, len(params), recompute)
        in_blocks = sum(p.numel() for p in {id(p): p for b in blocks for p in b.parameters() if p.requires_grad}
                        .values())
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


@dataclass(frozen=True, init=False)
class StepConfig:
    """The runtime configuration to predict: where the state lives (`placement`: the optimizer on the "device",
    torch's AdamW there, or offloaded to the "host" or "nvme"; the blocks' weights resident or streamed; `ranks`) and
    how OffloadAdam runs (`options`: its subgroups, clipping when max_grad_norm is set, the delayed, hybrid or
    speculative update, gradient buckets), with `mfu`, the model FLOP/s utilisation of forward and backward.
    Keywords name fields of either: StepConfig(optimizer_on="nvme", subgroup_numel=1 << 20).

    With `ranks` > 1 each rank is one process with one device, running its own micro-batch of `Workload.tokens`.
    Weights and gradients are replicated on every device; offloaded, the optimizer state is sharded (each rank owns
    whole subgroups, shards.shard_owners); on the device the ranks are plain data parallel (gradients all-reduced).

    `bucket_numel`: gradients leave in buckets of about that many elements (one copy each) instead of one copy per
    tensor. `speculative`: each subgroup's CPU update starts as soon as its gradients are on the host, during
    backward; the model predicts the common case, where the validation after backward redoes nothing. Not modelled:
    `backwards_per_step` (`Workload.tokens` is one backward; with several, only the last one's share would overlap a
    speculative update), when a delayed update starts (it is counted from the first step), min_offload_numel, loss
    scaling and the NVMe tier's order."""

    placement: Placement
    options: OffloadOptions
    mfu: float = 0.4

    def __init__(self, placement: Placement | None = None, options: OffloadOptions | None = None, mfu: float = 0.4,
                 **fields):
        placement, options = settings(placement, options, **fields)
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "mfu", mfu)
        if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
        check_model(placement, options)

    def replace(self, **fields) -> StepConfig:
        """A copy with `fields` (mfu, or fields of the placement or the options) changed, checked."""
        return StepConfig(self.placement, self.options, **{"mfu": self.mfu, **fields})
