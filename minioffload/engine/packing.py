"""What every part of the engine reads: the device and its two copy streams, the subgroups and each parameter's
slot in them, and who else holds the weights (a streamer) or the state (other ranks).

    packing = Packing(dev, subgroups, slots, streamer=None, shard=None)
    packing.on_cpu()          # the subgroups this process updates with the CPU Adam
    packing.master(slot)      # a parameter's fp32 master, in its shape (a view of its subgroup's buffer)
    packing.staging(slot)     # its pinned staging in the model's dtype: gradients arrive, 16-bit weights leave

And the loss scale (`LossScale`): the one number the gradient path, the speculative update and the step share.

What this is not: the packing itself (layout.pack decides which parameter goes where) or any buffer's allocation
(buffers.py); the parts receive a Packing and own what they add to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Slot, Subgroup, Where


@dataclass(eq=False)
class Packing:
    dev: object  # a minioffload Device
    subgroups: list[Subgroup]
    slots: dict[torch.nn.Parameter, Slot]  # each offloaded parameter's place, in param_groups order
    streamer: object | None = None  # a ParamStreamer: the blocks' weights live at home between uses
    shard: object | None = None  # a Shard: this rank owns some subgroups, the others pass through it
    d2h: object = None  # the copy streams every part issues on: gradients down, weights up
    h2d: object = None
    index: dict[int, int] = field(default_factory=dict)  # id(subgroup) -> its position

    def __post_init__(self) -> None:
        self.d2h = self.d2h or self.dev.stream("offload d2h")
        self.h2d = self.h2d or self.dev.stream("offload h2d")
        self.index = {id(sub): i for i, sub in enumerate(self.subgroups)}

    def mine(self, sub: Subgroup) -> bool:
        """Does this process hold the subgroup's state and run its update? (Always, without a shard.)"""
        return self.shard is None or sub.owner == self.shard.rank

    def on_cpu(self) -> list[Subgroup]:
        return [sub for sub in self.subgroups if sub.where == Where.CPU and self.mine(sub)]

    def streamed(self, slot: Slot) -> bool:
        return self.streamer is not None and self.streamer.streams(slot.param)

    def master(self, slot: Slot) -> torch.Tensor:
        return slot.shaped(slot.subgroup.buffers["master"])

    def staging(self, slot: Slot) -> torch.Tensor:
        """Pinned host memory for this parameter in the model's dtype: its gradient arrives here (and, without
        delayed updates, its 16-bit weights leave from here)."""
        return slot.shaped(slot.subgroup.staging["staging", slot.param.dtype])


@dataclass
class LossScale:
    """fp16's loss scale: fixed, or dynamic (torch's GradScaler policy: halve on an overflow, double after
    `growth_interval` clean steps)."""

    scale: float
    dynamic: bool
    growth_interval: int
    clean_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def of(cls, loss_scale, growth_interval: int) -> LossScale:
        dynamic = loss_scale == "dynamic"
        return cls(2.0**16 if dynamic else float(loss_scale or 1.0), dynamic, growth_interval)

    @property
    def on(self) -> bool:
        """Are gradients checked for overflow? (With any scale but 1, or a dynamic one.)"""
        return self.scale != 1.0 or self.dynamic

    def skipped(self) -> None:
        self.skipped_steps += 1
        self.scale *= 0.5
        self.clean_steps = 0

    def clean(self) -> None:
        if self.dynamic:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2.0
