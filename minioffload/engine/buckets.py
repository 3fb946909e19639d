"""Gradient buckets: gradients leave the device a bucket at a time, in one copy each, not one copy per tensor.

    buckets = make_buckets(sub.slots, bucket_numel)   # consecutive slots of one dtype, about bucket_numel elements
    if bucket.take(slot, grad, dev):                   # the gradient copied into the bucket's device memory
        bucket.send(dev, d2h, staging)                 # full: one D2H copy; its device memory goes after the copy

Why: every copy pays a fixed cost (the link's latency, a driver call; on the simulated device a Python call and
a stream handoff too), and a transformer's gradients are many small tensors (biases, norms) beside a few large
ones. DeepSpeed gathers gradients into buckets the same way before it moves them. The price is one
device-to-device copy of every gradient: cheap on a GPU, whose memory is tens of times faster than the link, but a
host memcpy on the simulated device, where "device memory" is host memory.

A bucket holds consecutive parameters of one subgroup in one dtype, so its gradients land in one contiguous range
of the subgroup's pinned staging: one copy out, one add into the fp32 gradient. A parameter larger than a bucket
is copied out on its own, as is a tensor that would be alone in its bucket (nothing to gather).

What this is not: the gradient hook or the accumulation into the fp32 gradient (engine/optimizer.py calls these).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Bucket:
    offset: int  # where its elements start in the subgroup's buffers
    numel: int
    dtype: torch.dtype
    slots: list = field(default_factory=list)
    device: torch.Tensor | None = None  # its device memory while gradients gather, None between backward passes
    arrived: set = field(default_factory=set)  # ids of the slots whose gradient it holds
    pending: list = field(default_factory=list)  # (event, staging range) of copies not yet added in

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket's range of a flat subgroup buffer."""
        return flat[self.offset: self.offset + self.numel]

    def take(self, slot, grad: torch.Tensor, dev) -> bool:
        """Copy `grad` (slot's gradient, on the device) into the bucket, on the compute stream that made it;
        True when the bucket is full."""
        if self.device is None:
            self.device = dev.empty(self.numel, self.dtype, name="grad bucket")
        start = slot.offset - self.offset
        self.device[start: start + slot.numel].copy_(grad.reshape(-1))
        self.arrived.add(id(slot))
        return len(self.arrived) == len(self.slots)

    def send(self, dev, stream, staging: torch.Tensor) -> None:
        """One D2H copy of the bucket into its range of the subgroup's `staging`, on `stream`. Parameters whose
        gradient never came (unused this backward) send zeros."""
        for slot in self.slots:
            if id(slot) not in self.arrived:
                start = slot.offset - self.offset
                self.device[start: start + slot.numel].zero_()
        target = self.view(staging)
        dev.stream_waits_for_compute(stream)
        dev.copy(target, self.device, stream, name="d2h grad bucket")
        dev.keep_alive(self.device, stream)  # freed below, reused by nothing before the copy has read it
        done = dev.event()
        done.record(stream)
        self.pending.append((done, target))
        self.device = None
        self.arrived.clear()


def make_buckets(slots: list, bucket_numel: int) -> list[Bucket]:
    """Cut one subgroup's `slots` (in offset order) into buckets of consecutive slots of one dtype, each of at most
    `bucket_numel` elements, and point each slot at its bucket (`slot.bucket`). A slot that would be alone in its
    bucket (a large one, or the last of its dtype) gets none: it is copied out directly."""
    buckets: list[Bucket] = []
    for slot in slots:
        last = buckets[-1] if buckets else None
        if last is None or last.dtype != slot.param.dtype or last.numel + slot.numel > bucket_numel:
            last = Bucket(slot.offset, 0, slot.param.dtype)
            buckets.append(last)
        last.slots.append(slot)
        last.numel += slot.numel
    buckets = [b for b in buckets if len(b.slots) > 1]  # a tensor alone goes straight out: no gather to pay for
    for bucket in buckets:
        for slot in bucket.slots:
            slot.bucket = bucket
    return buckets
