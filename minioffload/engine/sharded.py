"""The sharded step of OffloadAdam (chapter 10): what a rank does differently when it owns only some subgroups.

    sharded = ShardedSteps(packing, grads)     # with `shard=` (a sharding.Shard)
    backward   `gather_grad` holds a subgroup's gradients on the device until the last arrives and its turn has come;
               `reduce` packs them into one buffer, sums it into the owner (a reduce), and only the owner copies it to
               its host staging
    step       `reduce_the_rest` checks that every rank reduced as often, tells each which parameters got a gradient
               on any rank, and all-reduces the gradients kept on the device;
               `interleave` yields this rank's subgroups to update, receiving the others' weights in between;
               `send_subgroup` uploads one subgroup in one copy and broadcasts it; `write_weights` puts received
               weights into the model (streamed ones into this rank's home)

Every rank issues the same reduces in the same order, as DDP's buckets do: collectives issued in different orders
on different ranks hang (NCCL) or sum the wrong buffers, and gradients can complete in different orders on different
ranks (hooks firing in another order, a parameter unused by one rank's batch). The order is backward's: the last
subgroup first (subgroups follow the parameters, backward meets them in reverse); a subgroup complete before its turn
waits on the device. A subgroup is complete when every parameter of it that this backward reaches has its gradient:
at its first gradient hook, each backward asks autograd which parameters it will reach (as DDP does with
find_unused_parameters), so each backward reduces every subgroup once on every rank, with zeros for the
parameters a rank's batch did not use. At step() one small gather tells every rank which parameters got a gradient
on any rank: those are updated everywhere, as one process would.

Not built for: reentrant activation checkpointing (`use_reentrant=True`), which runs a backward inside the backward;
the runtime's own checkpointing is non-reentrant.

engine/sharding.py holds the collectives and the shard map; engine/optimizer.py the rest of the step.

What this is not: a collective (sharding.py) or the update (engine/optimizer.py).
"""

from __future__ import annotations

import torch

from ..layout import Slot, Subgroup
from .gradients import GradientPath
from .packing import Packing
from .sharding import WeightGather


class ShardedSteps:
    def __init__(self, packing: Packing, grads: GradientPath):
        self.packing, self.grads = packing, grads
        self.shard = packing.shard
        self.backward_id: int | None = None  # autograd's id of the backward the hooks belong to
        self.expected: list[int] = []  # by subgroup: the gradients that backward brings
        self.left = 0  # reduces that backward has still to issue (the next: `_turn()`)
        self.backwards = 0  # backwards since the last step that issued their reduces

    def share_out(self, settings: dict) -> None:
        """Every rank checks that all run the same `settings` (sharding.settings_of), then takes its subgroups."""
        subgroups = self.packing.subgroups
        mixed = [i for i, sub in enumerate(subgroups) if len({s.param.dtype for s in sub.slots}) > 1]
        if mixed:
            raise ValueError(f"sharded offload sends each subgroup as one buffer, and subgroups {mixed} mix dtypes: "
                             "cast the model to one dtype")
        self.shard.check_same(settings)
        for sub, owner in zip(subgroups, self.shard.assign([sub.numel for sub in subgroups]), strict=True):
            sub.owner = owner

    def gather_grad(self, slot: Slot) -> None:
        """backward's hook: a gradient waits on the device until its subgroup is complete and its turn has come; then
        the subgroup goes, and each complete one after it in the order."""
        if slot.param.grad is not None:  # (None: backward reached the parameter with an undefined gradient)
            self.packing.dev.adopt(slot.param.grad, "grad")
            slot.has_grad = True
        self._begin(torch._C._current_graph_task_id())
        slot.subgroup.arrived += 1
        while self.left and self._turn().arrived == self.expected[self.left - 1]:
            self.reduce(self._turn())
            self.left -= 1

    def _begin(self, backward_id: int) -> None:
        """At a backward's first gradient: how many gradients it brings to each subgroup (autograd knows which
        parameters' accumulation it will run; a parameter this rank's batch did not use gets none)."""
        if backward_id == self.backward_id:
            return
        self._finish_round()
        # torch's private hooks into the running backward, as torch's own register_multi_grad_hook uses them
        reached = {id(slot): torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(slot.param).node)
                   for slot in self.packing.slots.values()}
        self.expected = [sum(reached[id(s)] for s in sub.slots) for sub in self.packing.subgroups]
        self.backward_id, self.left = backward_id, len(self.packing.subgroups)
        self.backwards += 1

    def _turn(self) -> Subgroup:
        """The subgroup whose reduce is next: the last subgroup first (backward's order)."""
        return self.packing.subgroups[self.left - 1]

    def _finish_round(self) -> None:
        """Reduce, in turn, the subgroups the last backward left waiting because it stopped midway (an error the
        caller caught): what they hold goes, zeros for the rest."""
        while self.left:
            self.reduce(self._turn())
            self.left -= 1

    def reduce(self, sub: Subgroup) -> None:
        """Pack a subgroup's gradients into one buffer, sum it into the owner, which copies it to the host."""
        dev, d2h = self.packing.dev, self.packing.d2h
        index = self.packing.index[id(sub)]
        grads = [s.param.grad if s.param.grad is not None else torch.zeros_like(s.param) for s in sub.slots]
        flat = dev.adopt(torch.cat([grad.reshape(-1) for grad in grads]), "grad bucket")
        for s in sub.slots:
            s.param.grad = None
        sub.arrived = 0
        with dev.trace.span("net", f"reduce {index}", flat.numel() * flat.element_size()):
            self.shard.reduce(flat, index)
        if not self.packing.mine(sub):
            return
        for s in sub.slots:
            self.grads.add_pending(s)  # the previous micro-batch's copy is added in before the staging is reused
        staging = sub.staging["staging", flat.dtype]
        dev.stream_waits_for_compute(d2h)
        dev.copy(staging, flat, d2h, name="d2h grad")
        dev.keep_alive(flat, d2h)
        done = dev.event()
        done.record(d2h)
        for s in sub.slots:
            s.pending.append((done, self.packing.staging(s)))

    def reduce_the_rest(self, kept: list[torch.nn.Parameter]) -> None:
        """At step(), on every rank: check that every rank reduced for as many backwards; mark each parameter that got
        a gradient on any rank (`slot.has_grad`: it is updated everywhere); all-reduce the gradients of the parameters
        `kept` on the device that got one on any rank (zeros from a rank where it got none)."""
        self._finish_round()
        slots = list(self.packing.slots.values())
        everyone = self.shard.gather_ints([self.backwards, *(int(s.has_grad) for s in slots),
                                           *(int(p.grad is not None) for p in kept)],
                                          "which parameters got a gradient on each rank")
        counts = [row[0] for row in everyone]
        if len(set(counts)) > 1:
            raise ValueError(f"since the last step the ranks ran {counts} backward passes (by rank) that reached an "
                             "offloaded parameter: every rank must run the same number of backwards per step, each "
                             "reaching at least one parameter the optimizer offloads")
        self.backwards = 0
        for k, slot in enumerate(slots):
            slot.has_grad = any(row[1 + k] for row in everyone)
        for k, p in enumerate(kept):
            if not any(row[1 + len(slots) + k] for row in everyone):
                continue  # no gradient on any rank: AdamW skips it everywhere
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused by this rank's batch: it adds nothing to the others'
            with self.packing.dev.trace.span("net", "all-reduce kept", p.grad.numel() * p.grad.element_size()):
                self.shard.all_reduce(p.grad, "the gradients kept on the device")

    def gather(self) -> WeightGather:
        """Where the step's new weights meet: sent from each owner, received by the others, in subgroup order."""
        return WeightGather(self.shard, self.packing.dev, self.write_weights, in_flight=2 * self.shard.world)

    def interleave(self, own, fresh_ids: set, gather: WeightGather):
        """Yield this rank's subgroups `own` to update, in order; between them, receive the other ranks' weights,
        so that every rank issues the same broadcasts in the same order."""
        own = iter(own)
        for index, sub in enumerate(self.packing.subgroups):
            if not any(id(s) in fresh_ids for s in sub.slots):
                continue  # no gradient on any rank: unchanged everywhere
            if self.packing.mine(sub):
                yield next(own)
            else:
                gather.receive(index, sub.numel, sub.slots[0].param.dtype, sub.slots, self._via_host(sub))
        if next(own, None) is not None:  # resumed once more: the NVMe tier writes the last subgroup back
            raise RuntimeError("a subgroup of this rank was left out of the update: the shard map and the "
                               "subgroups disagree")

    def _via_host(self, sub: Subgroup) -> bool:
        """A subgroup with streamed weights travels in host memory (their homes are there)."""
        return any(map(self.packing.streamed, sub.slots))

    def send_subgroup(self, sub: Subgroup, gather: WeightGather) -> None:
        """The subgroup's new weights up in one copy, then broadcast from this rank to the others (in host memory
        when it holds streamed weights)."""
        dev, h2d = self.packing.dev, self.packing.h2d
        dtype = sub.slots[0].param.dtype
        source = sub.buffers["master"]
        if dtype != torch.float32:
            source = sub.staging["staging", dtype]
            source.copy_(sub.buffers["master"])  # round to the model's dtype, on the CPU
        if self._via_host(sub):
            flat = dev.host_empty(sub.numel, dtype)
            flat.copy_(source)  # its own buffer: the state's may be reused (NVMe tier) before the broadcast ends
            gather.send(self.packing.index[id(sub)], flat, sub.slots, on_host=True)
            return
        flat = dev.empty(sub.numel, dtype, "weights in flight")
        dev.stream_waits_for_compute(h2d)
        dev.copy(flat, source, h2d, name="h2d weights")
        landed = dev.event()
        landed.record(h2d)
        dev.compute_waits_for(landed)  # the broadcast reads it (on the sim the host waits here)
        gather.send(self.packing.index[id(sub)], flat, sub.slots)

    def write_weights(self, slots: list[Slot], flat: torch.Tensor) -> None:
        """A subgroup's broadcast weights into the model: streamed ones home, the others on the device."""
        dev, h2d, streamer = self.packing.dev, self.packing.h2d, self.packing.streamer
        on_host = not dev.is_device(flat)
        if on_host and any(not self.packing.streamed(slot) for slot in slots):
            dev.stream_waits_for_compute(h2d)
        for slot in slots:
            value = slot.shaped(flat)
            if self.packing.streamed(slot):
                streamer.set_weights(slot.param, value)
            elif on_host:
                dev.copy(slot.param.data, value, h2d, name="h2d weights")
            else:
                slot.param.data.copy_(value)  # on the compute stream: the next forward reads it after this
