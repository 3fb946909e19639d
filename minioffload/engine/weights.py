"""Where OffloadAdam's weights live on the device, and how new ones go up.

OffloadAdam inherits these methods:
    `_flatten_weights`  at construction, a CPU-updated subgroup's parameters become views of one flat device tensor
                        (`sub.weights`), so its new weights go up in one copy instead of one per tensor
    `_upload`           after the update: flat subgroups in one copy each, the others tensor by tensor (streamed
                        weights to their home instead)
    `_send_weights`     one flat subgroup's weights from a master (its own, or a speculated one), rounded to the
                        model's dtype in its pinned staging first when that is not fp32
engine/optimizer.py holds the rest of the optimizer.

What this is not: usable alone (a mixin of OffloadAdam, reading its dev, h2d, streamer, subgroups, ...).
"""

from __future__ import annotations

import torch

from ..layout import Slot, Subgroup
from ..ledger import OutOfMemoryError


class WeightUploads:
    """OffloadAdam's device-weight methods (see the module docstring)."""

    def _flatten_weights(self, sub: Subgroup) -> None:
        """Give the subgroup's parameters one flat piece of device memory (their views), so its new weights go up
        in one copy. Left as they are when they mix dtypes or some are streamed (those go up one by one). Costs one
        subgroup of device memory for a moment (without it, the subgroup is left as it is): its old memory is freed once
        the flat one holds the values."""
        dtypes = {s.param.dtype for s in sub.slots}
        if len(dtypes) > 1 or self.shard is not None or any(self._streamed(s) for s in sub.slots):
            return
        try:
            sub.weights = self.dev.empty(sub.numel, dtypes.pop(), name="param")
        except OutOfMemoryError:  # no room for the moment's extra subgroup: its weights go up tensor by tensor
            return
        for slot in sub.slots:
            view = slot.shaped(sub.weights)
            view.copy_(slot.param.detach())
            self.dev.memory.forget(slot.param)  # counted once: the old memory goes when nothing holds it
            slot.param.data = view  # the model's modules hold the same Parameter, now a view of the flat memory

    def _upload(self, slots: list[Slot], whole: bool = False) -> None:
        """The new weights of `slots` up to the device: a flat subgroup in one copy when all its slots are given, or
        with `whole` (the step's update: a parameter without a gradient still holds its master, rounded)."""
        if slots:
            self.dev.stream_waits_for_compute(self.h2d)  # never overwrite weights that queued compute still reads
            if self.streamer is not None:
                self.streamer.quiesce()  # no copy up is reading a home
        given = {id(s) for s in slots}
        together = [sub for sub in dict.fromkeys(s.subgroup for s in slots)
                    if (whole or all(id(s) in given for s in sub.slots)) and not any(map(self._streamed, sub.slots))]
        for sub in together:  # a flat one in one copy, others tensor by tensor
            self._send_weights(sub, sub.buffers["master"], wait_for_compute=False)
        sent = {id(sub) for sub in together}
        for slot in slots:
            if id(slot.subgroup) in sent:
                continue
            master = self._master(slot)
            if self._streamed(slot):  # its home takes the new weights; the next fetch brings them up
                self.streamer.set_weights(slot.param, master)
                continue
            if slot.param.dtype == torch.float32:
                source = master
            else:
                self._staging_free(slot.subgroup)
                source = self._staging(slot)
                source.copy_(master)  # round to the model's dtype (nearest even), on the CPU
            self.dev.copy(slot.param.data, source, self.h2d, name="h2d weights")

    def _staging_free(self, sub: Subgroup) -> dict:
        """Wait until no copy still reads `sub`'s staging (the host is about to round new weights into it); the map
        of id(subgroup) -> the event after the last copy from its staging."""
        staged = self.__dict__.setdefault("_staged", {})
        before = staged.pop(id(sub), None)
        if before is not None:
            before.synchronize()
        return staged

    def _send_weights(self, sub: Subgroup, master: torch.Tensor, wait_for_compute: bool = True) -> None:
        """A subgroup's weights from `master` (its fp32 master, or a speculated one) up: a flat one in one copy,
        others tensor by tensor; rounded to the model's dtype in its staging first when that is not fp32."""
        if wait_for_compute:
            self.dev.stream_waits_for_compute(self.h2d)
        pieces = [(sub.weights, master, slice(0, sub.numel))] if sub.weights is not None else [
            (slot.param.data, slot.shaped(master), slice(slot.offset, slot.offset + slot.numel)) for slot in sub.slots]
        staged = self._staging_free(sub)  # a copy may still read the staging we are about to overwrite
        for weights, source, span in pieces:
            if weights.dtype != torch.float32:
                staging = sub.staging["staging", weights.dtype][span].view(weights.shape)
                staging.copy_(source)  # round to nearest even, on the CPU
                source = staging
                staged[id(sub)] = None
            self.dev.copy(weights, source, self.h2d, name="h2d weights")
        if id(sub) in staged:
            staged[id(sub)] = self.dev.event()
            staged[id(sub)].record(self.h2d)
