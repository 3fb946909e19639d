"""Where OffloadAdam's weights live on the device, and how new ones go up.

    weights = WeightUploads(packing)
    weights.flatten(sub)                   # at construction: a subgroup's parameters become views of one tensor
    weights.upload(slots, whole=True)      # after the update: flat subgroups in one copy each, others one by one
    weights.send(sub, master)              # one subgroup from a master (its own, or a speculated one)
    weights.sent(); weights.forward_waits()   # the event after the last upload; the next forward waits for it

A CPU-updated subgroup's parameters become views of one flat device tensor (`sub.weights`), so its new weights go up
in one copy instead of one per tensor. A weight in a 16-bit dtype is rounded into the subgroup's pinned staging
first; before the host rounds new weights into a staging buffer, it waits until no copy still reads it. Streamed
weights (a streamer's) go to their home instead of up the link.

What this is not: the update (engine/optimizer.py) or the staging's allocation (buffers.py).
"""

from __future__ import annotations

import torch

from ..layout import Slot, Subgroup
from ..ledger import OutOfMemoryError
from .packing import Packing


class WeightUploads:
    def __init__(self, packing: Packing):
        self.packing = packing
        self.uploaded = None  # the event after the last upload: the next forward waits for it
        self.staged: dict = {}  # id(subgroup) -> the event after the last copy from its staging

    def flatten(self, sub: Subgroup) -> None:
        """Give the subgroup's parameters one flat piece of device memory (their views), so its new weights go up
        in one copy. Left as they are when they mix dtypes or some are streamed (those go up one by one). Costs one
        subgroup of device memory for a moment (without it, the subgroup is left as it is): its old memory is freed
        once the flat one holds the values."""
        dev = self.packing.dev
        dtypes = {s.param.dtype for s in sub.slots}
        if len(dtypes) > 1 or self.packing.shard is not None or any(map(self.packing.streamed, sub.slots)):
            return
        try:
            sub.weights = dev.empty(sub.numel, dtypes.pop(), name="param")
        except OutOfMemoryError:  # no room for the moment's extra subgroup: its weights go up tensor by tensor
            return
        for slot in sub.slots:
            view = slot.shaped(sub.weights)
            view.copy_(slot.param.detach())
            dev.memory.forget(slot.param)  # counted once: the old memory goes when nothing holds it
            slot.param.data = view  # the model's modules hold the same Parameter, now a view of the flat memory

    def upload(self, slots: list[Slot], whole: bool = False) -> None:
        """The new weights of `slots` up to the device: a flat subgroup in one copy when all its slots are given, or
        with `whole` (the step's update: a parameter without a gradient still holds its master, rounded)."""
        dev, h2d, streamer = self.packing.dev, self.packing.h2d, self.packing.streamer
        if slots:
            dev.stream_waits_for_compute(h2d)  # never overwrite weights that queued compute still reads
            if streamer is not None:
                streamer.quiesce()  # no copy up is reading a home
        given = {id(s) for s in slots}
        together = [sub for sub in dict.fromkeys(s.subgroup for s in slots)
                    if (whole or all(id(s) in given for s in sub.slots))
                    and not any(map(self.packing.streamed, sub.slots))]
        for sub in together:  # a flat one in one copy, others tensor by tensor
            self.send(sub, sub.buffers["master"], wait_for_compute=False)
        sent = {id(sub) for sub in together}
        for slot in slots:
            if id(slot.subgroup) in sent:
                continue
            master = self.packing.master(slot)
            if self.packing.streamed(slot):  # its home takes the new weights; the next fetch brings them up
                streamer.set_weights(slot.param, master)
                continue
            if slot.param.dtype == torch.float32:
                source = master
            else:
                self.staging_free(slot.subgroup)
                source = self.packing.staging(slot)
                source.copy_(master)  # round to the model's dtype (nearest even), on the CPU
            dev.copy(slot.param.data, source, h2d, name="h2d weights")

    def staging_free(self, sub: Subgroup) -> None:
        """Wait until no copy still reads `sub`'s staging (the host is about to round new weights into it)."""
        before = self.staged.pop(id(sub), None)
        if before is not None:
            before.synchronize()

    def send(self, sub: Subgroup, master: torch.Tensor, wait_for_compute: bool = True) -> None:
        """A subgroup's weights from `master` (its fp32 master, or a speculated one) up: a flat one in one copy,
        others tensor by tensor; rounded to the model's dtype in its staging first when that is not fp32."""
        dev, h2d = self.packing.dev, self.packing.h2d
        if wait_for_compute:
            dev.stream_waits_for_compute(h2d)
        pieces = [(sub.weights, master, slice(0, sub.numel))] if sub.weights is not None else [
            (slot.param.data, slot.shaped(master), slice(slot.offset, slot.offset + slot.numel)) for slot in sub.slots]
        self.staging_free(sub)  # a copy may still read the staging we are about to overwrite
        rounded = False
        for weights, source, span in pieces:
            if weights.dtype != torch.float32:
                staging = sub.staging["staging", weights.dtype][span].view(weights.shape)
                staging.copy_(source)  # round to nearest even, on the CPU
                source, rounded = staging, True
            dev.copy(weights, source, h2d, name="h2d weights")
        if rounded:
            self.staged[id(sub)] = dev.event()
            self.staged[id(sub)].record(h2d)

    def sent(self):
        """Record (and return) the event after every upload queued so far."""
        self.uploaded = self.packing.dev.event()
        self.uploaded.record(self.packing.h2d)
        return self.uploaded

    def forward_waits(self) -> None:
        """The next forward reads the new weights, not the old: the compute stream waits for the last upload."""
        if self.uploaded is not None:
            self.packing.dev.compute_waits_for(self.uploaded)
