"""The sharded half of OffloadAdam (chapter 10): what a rank does differently when it owns only some subgroups.

OffloadAdam inherits these methods; they run only with `shard=` (a sharding.Shard):
    backward   `_gather_grad` holds a subgroup's gradients on the device until the last arrives; `_reduce` packs them
               into one buffer, sums it into the owner (a reduce), and only the owner copies it to its host staging
    step       `_reduce_the_rest` sends subgroups left incomplete and the gradients kept on the device (all-reduce);
               `_interleave` yields this rank's subgroups to update, receiving the others' weights in between;
               `_send_subgroup` uploads one subgroup in one copy and broadcasts it; `_write_weights` puts received
               weights into the model (streamed ones into this rank's home)
engine/sharding.py holds the collectives and the shard map; engine/optimizer.py the rest of the optimizer.

What this is not: usable alone (a mixin of OffloadAdam, reading its attributes: dev, shard, subgroups, _index, ...).
"""

from __future__ import annotations

import torch

from ..layout import Slot, Subgroup
from .sharding import WeightGather, settings_of


class ShardedSteps:
    """OffloadAdam's methods for a rank of a sharded run (see the module docstring)."""

    def _share_out(self) -> None:
        """Sharded: every rank checks that all run the same settings, then takes its subgroups."""
        mixed = [i for i, sub in enumerate(self.subgroups) if len({s.param.dtype for s in sub.slots}) > 1]
        if mixed:
            raise ValueError(f"sharded offload sends each subgroup as one buffer, and subgroups {mixed} mix dtypes: "
                             "cast the model to one dtype")
        self.shard.check_same(settings_of(self))
        for sub, owner in zip(self.subgroups, self.shard.assign([sub.numel for sub in self.subgroups]), strict=True):
            sub.owner = owner


    def _gather_grad(self, slot: Slot) -> None:
        """Sharded: a gradient waits on the device until its subgroup is complete; then the subgroup goes."""
        self.dev.adopt(slot.param.grad, "grad")
        slot.has_grad = True
        slot.subgroup.arrived += 1
        if slot.subgroup.arrived == len(slot.subgroup.slots):
            self._reduce(slot.subgroup)

    def _reduce(self, sub: Subgroup) -> None:
        """Pack a subgroup's gradients into one buffer, sum it into the owner, which copies it to the host."""
        index = self._index[id(sub)]
        grads = [s.param.grad if s.param.grad is not None else torch.zeros_like(s.param) for s in sub.slots]
        flat = self.dev.adopt(torch.cat([grad.reshape(-1) for grad in grads]), "grad bucket")
        for s in sub.slots:
            s.param.grad = None
        sub.arrived = 0
        with self.dev.trace.span("net", f"reduce {index}", flat.numel() * flat.element_size()):
            self.shard.reduce(flat, index)
        if not self._mine(sub):
            return
        for s in sub.slots:
            self._add_pending(s)  # the previous micro-batch's copy is added in before the staging is reused
        staging = sub.staging["staging", flat.dtype]
        self.dev.stream_waits_for_compute(self.d2h)
        self.dev.copy(staging, flat, self.d2h, name="d2h grad")
        self.dev.keep_alive(flat, self.d2h)
        done = self.dev.event()
        done.record(self.d2h)
        for s in sub.slots:
            s.pending.append((done, self._staging(s)))


    def _reduce_the_rest(self) -> None:
        """Sharded: subgroups some of whose parameters got no gradient, and the gradients kept on the device."""
        for sub in self.subgroups:
            if sub.arrived:
                self._reduce(sub)
        for p in self.kept:
            if p.grad is not None:
                with self.dev.trace.span("net", "all-reduce kept", p.grad.numel() * p.grad.element_size()):
                    self.shard.all_reduce(p.grad, "the gradients kept on the device")


    def _interleave(self, own, fresh_ids: set, gather: WeightGather):
        """Sharded: yield this rank's subgroups to update, in order; between them, receive the other ranks'
        weights, so that every rank issues the same broadcasts in the same order."""
        own = iter(own)
        for index, sub in enumerate(self.subgroups):
            if not any(id(s) in fresh_ids for s in sub.slots):
                continue  # no gradient on any rank: unchanged everywhere
            if self._mine(sub):
                yield next(own)
            else:
                gather.receive(index, sub.numel, sub.slots[0].param.dtype, sub.slots, self._via_host(sub))
        if next(own, None) is not None:  # resumed once more: the NVMe tier writes the last subgroup back
            raise RuntimeError("a subgroup of this rank was left out of the update: the shard map and the "
                               "subgroups disagree")

    def _via_host(self, sub: Subgroup) -> bool:
        """Sharded: a subgroup with streamed weights travels in host memory (their homes are there)."""
        return any(self._streamed(slot) for slot in sub.slots)

    def _send_subgroup(self, sub: Subgroup, gather: WeightGather) -> None:
        """Sharded: the subgroup's new weights up in one copy, then broadcast from this rank to the others (in
        host memory when it holds streamed weights)."""
        dtype = sub.slots[0].param.dtype
        source = sub.buffers["master"]
        if dtype != torch.float32:
            source = sub.staging["staging", dtype]
            source.copy_(sub.buffers["master"])  # round to the model's dtype, on the CPU
        if self._via_host(sub):
            flat = self.dev.host_empty(sub.numel, dtype)
            flat.copy_(source)  # its own buffer: the state's may be reused (NVMe tier) before the broadcast ends
            gather.send(self._index[id(sub)], flat, sub.slots, on_host=True)
            return
        flat = self.dev.empty(sub.numel, dtype, "weights in flight")
        self.dev.stream_waits_for_compute(self.h2d)
        self.dev.copy(flat, source, self.h2d, name="h2d weights")
        landed = self.dev.event()
        landed.record(self.h2d)
        self.dev.compute_waits_for(landed)  # the broadcast reads it (on the sim the host waits here)
        gather.send(self._index[id(sub)], flat, sub.slots)

    def _write_weights(self, slots: list[Slot], flat: torch.Tensor) -> None:
        """Sharded: a subgroup's broadcast weights into the model: streamed ones home, the others on the device."""
        on_host = not self.dev.is_device(flat)
        if on_host and any(not self._streamed(slot) for slot in slots):
            self.dev.stream_waits_for_compute(self.h2d)
        for slot in slots:
            value = slot.shaped(flat)
            if self._streamed(slot):
                self.streamer.set_weights(slot.param, value)
            elif on_host:
                self.dev.copy(slot.param.data, value, self.h2d, name="h2d weights")
            else:
                slot.param.data.copy_(value)  # on the compute stream: the next forward reads it after this
