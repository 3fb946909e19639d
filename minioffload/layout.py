"""How OffloadAdam lays out what it updates: parameters packed into subgroups of flat buffers.

    subgroups, slots = pack(optimizer.param_groups, subgroup_numel, skip=kept)
    slot = slots[param]; slot.view(slot.subgroup.buffers["master"])   # the parameter's part of a buffer

A subgroup holds about `subgroup_numel` elements of consecutive parameters: one flat fp32 buffer for each
name in STATE (master weights and Adam's moments) and one for the gradient, so that one Adam call, one copy
and one disk read serve all of them. `Where` says where a subgroup is updated; `device_subgroups` picks them.
Staging buffers (gradients in, 16-bit weights out) are kept apart, keyed by (kind, dtype); `held()` lists
every host buffer of a subgroup by a printable name.

What this is not: memory (the engine allocates the buffers; engine/device_path.py and engine/nvme_tier.py bind theirs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .options import Placement, check_field, check_split

if TYPE_CHECKING:  # annotations only: the models of memory and time use this module without torch
    import torch

STATE = ("master", "exp_avg", "exp_avg_sq")  # fp32, what a checkpoint holds per parameter
STATE_BYTES_PER_PARAM = 4 * len(STATE)


class Where(str, enum.Enum):
    """Where a subgroup's update runs. A str that prints as its value, so `sub.where == "cpu"` holds."""

    CPU = "cpu"  # state in host memory, updated by the CPU Adam
    RESIDENT = "resident"  # state and update on the device, for good (gpu_fraction)
    STREAMED = "streamed"  # state on the host, copied to the device, updated there, copied back (stride)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(eq=False)
class Slot:
    """Where one parameter lives inside its subgroup's flat buffers, and its update's bookkeeping."""

    param: torch.nn.Parameter
    group: dict  # its param group (lr, betas, ...)
    subgroup: Subgroup
    offset: int
    numel: int
    step: int = 0
    pending: list = field(default_factory=list)  # (event, staging view) of gradient copies not yet added in
    has_grad: bool = False  # a gradient arrived since the last step
    bucket: object = None  # its gradient bucket (engine/buckets.py) when gradients leave in buckets

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's elements of a subgroup buffer, flat."""
        return flat[self.offset: self.offset + self.numel]

    def shaped(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's elements of a subgroup buffer, in the parameter's shape."""
        return self.view(flat).view(self.param.shape)


@dataclass(eq=False)
class Subgroup:
    numel: int
    where: Where = Where.CPU
    slots: list[Slot] = field(default_factory=list)
    owner: int = 0  # the rank that holds its state and runs its update (engine/sharding.py); 0 with one rank
    arrived: int = 0  # sharded: gradients that arrived in the current backward
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # STATE names and "grad" -> flat fp32 tensor
    # (kind, dtype) -> flat tensor in the parameters' dtype: kind "staging" (gradients arrive, 16-bit weights
    # leave) or "upload" (a delayed update's weights wait)
    staging: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)
    weights: torch.Tensor | None = None  # its parameters' device memory as one flat tensor (one upload), or None
    buckets: list = field(default_factory=list)  # its gradient buckets (engine/buckets.py), or [] for a copy per tensor
    spare: dict[str, torch.Tensor] = field(default_factory=dict)  # the speculative update's second set of STATE

    def held(self) -> dict[str, torch.Tensor]:
        """Every buffer of this subgroup, by a printable name ("master", ..., "staging torch.bfloat16")."""
        return {**self.buffers, **{f"{kind} {dtype}": t for (kind, dtype), t in self.staging.items()},
                **{f"spare {name}": t for name, t in self.spare.items()}}


def pack(param_groups: list[dict], subgroup_numel: int, skip: set = frozenset()
         ) -> tuple[list[Subgroup], dict[torch.nn.Parameter, Slot]]:
    """Pack the trainable parameters of `param_groups` in order into subgroups (a new one starts when the next
    parameter would take the current past `subgroup_numel`). A parameter listed twice (tied) gets one slot;
    frozen ones and those in `skip` none."""
    subgroups: list[Subgroup] = []
    slots: dict[torch.nn.Parameter, Slot] = {}
    for group in param_groups:
        for p in group["params"]:
            if not p.requires_grad or p in slots or p in skip:
                continue
            if not subgroups or (subgroups[-1].numel and subgroups[-1].numel + p.numel() > subgroup_numel):
                subgroups.append(Subgroup(0))
            current = subgroups[-1]
            slot = Slot(p, group, current, current.numel, p.numel())
            current.slots.append(slot)
            current.numel += p.numel()
            slots[p] = slot
    return subgroups, slots


def pack_sizes(numels: list[int], subgroup_numel: int) -> list[int]:
    """The sizes of the subgroups `pack` makes of parameters of `numels` elements (for the models of memory
    and time, which know sizes, not tensors)."""
    sizes: list[int] = []
    for numel in numels:
        if not sizes or (sizes[-1] and sizes[-1] + numel > subgroup_numel):
            sizes.append(0)
        sizes[-1] += numel
    return sizes


def shard_owners(sizes: list[int], ranks: int) -> list[int]:
    """The rank that owns each subgroup of `sizes` elements: in order, each goes to the rank holding the fewest
    elements so far (ties: the lowest rank). Deterministic, so every rank computes the same map; no rank holds
    more than the fairest share plus one subgroup."""
    check_field(Placement, "ranks", ranks)
    held = [0] * ranks
    owners = []
    for size in sizes:
        rank = min(range(ranks), key=lambda r: (held[r], r))
        owners.append(rank)
        held[rank] += size
    return owners


def device_subgroups(count: int, gpu_fraction: float | None = None, stride: int | None = None
                     ) -> tuple[list[int], list[int]]:
    """Indices of the subgroups updated on the device: (resident, streamed) out of `count` subgroups.

    gpu_fraction f: the last round(f * count) are resident. stride k: subgroups k-1, 2k-1, ... are streamed
    (every k-th, counting from 1), so stride 1 streams all of them and stride 3 a third."""
    check_split(gpu_fraction, stride)
    return split_indices(count, gpu_fraction, stride)


def split_indices(count: int, gpu_fraction: float | None, stride: int | None) -> tuple[list[int], list[int]]:
    """`device_subgroups` for a split already checked (an OffloadOptions' own)."""
    if gpu_fraction is not None:
        resident = round(gpu_fraction * count)
        return list(range(count - resident, count)), []
    if stride is not None:
        return [], list(range(stride - 1, count, stride))
    return [], []


def runs(sub: Subgroup, slots: list[Slot]) -> list[list[Slot]]:
    """Group a subgroup's `slots` (those with a gradient this step) into runs one Adam call can update: the whole
    subgroup when every parameter has one, with the same step count and group; else one run per parameter."""
    if len(slots) == len(sub.slots) and len({(s.step, id(s.group)) for s in slots}) == 1:
        return [sub.slots]
    return [[s] for s in slots]
