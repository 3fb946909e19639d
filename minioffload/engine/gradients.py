"""The gradient path of OffloadAdam: from backward's hook to the coefficient every gradient is multiplied by.

    grads = GradientPath(packing, loss_scale, delayed)
    grads.offload(slot)                     # backward's hook, for a subgroup the CPU updates: the gradient leaves
    grads.add_pending(slot)                 # its copies have landed: added into the subgroup's fp32 gradient
    grads.finite(speculations, on_device)   # loss scaling: any inf or NaN skips the step
    coef, norm = grads.clip_coefficient(speculations, on_device)

A gradient leaves the device as soon as it is ready, in its own copy or, with `bucket_numel`, gathered into its
bucket, which leaves in one copy once full (buckets.py); the device gradient is freed after its copy. With
`max_in_flight` (bytes; OffloadAdam sets one streamed block's gradients, or its largest subgroup's) the host waits
for the oldest copies whenever more device gradients than that wait for theirs: a link (or a GPU) slower than the
host would otherwise pile them up on the device until an allocation fails. The device then holds at most that and the
next gradient, made before its hook can wait: what the planner counts. Copied
gradients are added into the subgroup's fp32 buffer once their copy has landed, so micro-batches accumulate on the
host, never on the device. The coefficient is 1/scale times the clip factor from the global L2 norm, per-subgroup
partial sums added in subgroup order; a speculative update (speculative.py) took its subgroups' partial sums and
overflow flags during backward, and these use them. The gradients kept on the device are checked and measured on
the device, one host sync per check for all of them (not one per tensor).

What this is not: the hook's dispatch (engine/optimizer.py sends a sharded rank's gradients to sharded.py and a
device-updated subgroup's to device_path.py) or the update.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from ..kernels.gradnorm import sum_of_squares
from ..layout import Slot
from .packing import LossScale, Packing


class GradientPath:
    def __init__(self, packing: Packing, loss_scale: LossScale, delayed=None, max_in_flight: int | None = None):
        self.packing, self.loss_scale = packing, loss_scale
        self.delayed = delayed  # a DelayedUpdate that may still be reading the fp32 gradients, or None
        self.max_in_flight = max_in_flight  # bytes of device gradients whose copies may be pending at once (None: any)
        self._in_flight: deque = deque()  # (event after a gradient's copy, the gradient's bytes), oldest first

    def offload(self, slot: Slot) -> None:
        """backward's hook for a parameter the CPU updates: its gradient leaves the device now."""
        dev, param, bucket = self.packing.dev, slot.param, slot.bucket
        if bucket is None or not bucket.arrived:
            self.add_pending(slot)  # a previous micro-batch's copy must be added in before its staging is reused
        grad, param.grad = param.grad.contiguous(), None  # the device gradient goes once its copy is done
        dev.adopt(grad, "grad")  # autograd made it on the device: count it there until it is freed
        slot.has_grad = True
        if bucket is not None:  # into the bucket's device memory; the bucket leaves in one copy once full
            if bucket.take(slot, grad, dev):
                bucket.send(dev, self.packing.d2h, slot.subgroup.staging["staging", bucket.dtype])
            return
        staging = self.packing.staging(slot)
        dev.stream_waits_for_compute(self.packing.d2h)
        dev.copy(staging, grad, self.packing.d2h, name="d2h grad")
        dev.keep_alive(grad, self.packing.d2h)  # its memory is not reused before the copy has read it
        done = dev.event()
        done.record(self.packing.d2h)
        slot.pending.append((done, staging))
        if self.max_in_flight is not None:
            self._in_flight.append((done, grad.numel() * grad.element_size()))
            self._bound_in_flight()

    def _bound_in_flight(self) -> None:
        """The host waits for the oldest gradient copies until at most `max_in_flight` bytes of device gradients wait
        for theirs (the one just issued may exceed it alone)."""
        while len(self._in_flight) > 1 and sum(nbytes for _, nbytes in self._in_flight) > self.max_in_flight:
            oldest, _ = self._in_flight[0]
            if not oldest.query():  # landed already: nothing to wait for
                oldest.synchronize()
            self._in_flight.popleft()

    def add_pending(self, slot: Slot) -> None:
        """Add the slot's copied gradients (its bucket's, with buckets) into the subgroup's fp32 gradient."""
        holder = slot if slot.bucket is None else slot.bucket
        if holder.pending and self.delayed:
            self.delayed.join()  # the delayed update may still be reading the gradient buffer
        for done, staging in holder.pending:
            done.synchronize()  # never read an in-flight copy
            self.packing.dev.uses("the CPU adding a staged gradient", reads=[staging])
            holder.view(slot.subgroup.buffers["grad"]).add_(staging.reshape(-1).float())
        holder.pending.clear()

    def send_partial_buckets(self) -> None:
        """Buckets some of whose parameters got no gradient in the last backward leave now (zeros for those)."""
        for sub in self.packing.subgroups:
            for bucket in sub.buckets:
                if bucket.arrived:
                    bucket.send(self.packing.dev, self.packing.d2h, sub.staging["staging", bucket.dtype])

    def finite(self, speculations: dict, on_device: list[torch.Tensor]) -> bool:
        """One flag from every subgroup and the gradients `on_device`: is any gradient inf or NaN? (Only checked
        with loss scaling on.) `speculations`: id(subgroup) -> what a speculative update found, or {}."""
        if not self.loss_scale.on:
            return True
        finite = all(speculations[id(sub)].finite if id(sub) in speculations
                     else bool(torch.isfinite(sub.buffers["grad"]).all()) for sub in self.packing.on_cpu())
        finite = finite and _all_finite(on_device)
        shard = self.packing.shard
        return finite if shard is None else shard.all_true(finite)  # sharded: skip on every rank or none

    def clip_coefficient(self, max_norm: float | None, speculations: dict, on_device: list[torch.Tensor]
                         ) -> tuple[float, float | None]:
        """What multiplies every gradient before the update, and the global L2 norm before clipping (None with
        clipping off): 1/scale, times the clip factor computed from the norm (per-subgroup partial sums, one
        combine) as clip_grad_norm_ does."""
        shard = self.packing.shard
        divide = self.loss_scale.scale * (shard.world if shard is not None else 1)  # ranks' sum -> their mean
        if max_norm is None:  # no clipping: skip a pass over every gradient
            return 1.0 / divide, None
        if shard is None:  # one pass, no temporaries; a speculative update took its subgroup's part already
            specs = speculations
            squares = sum(specs[id(sub)].squares if id(sub) in specs else sum_of_squares(sub.buffers["grad"])
                          for sub in self.packing.on_cpu())
        else:  # the owners' partial sums, added in the same order as one process adds them
            squares = shard.sum_in_order({self.packing.index[id(sub)]: sum_of_squares(sub.buffers["grad"])
                                          for sub in self.packing.on_cpu()}, len(self.packing.subgroups))
        squares += sum(_squares(on_device))
        norm = math.sqrt(squares) / divide
        return min(1.0, max_norm / (norm + 1e-6)) / divide, norm


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """No inf or NaN in any of the device `grads`: one flag per tensor on the device, one host sync."""
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(grad).all() for grad in grads]).all())


def _squares(grads: list[torch.Tensor]) -> list[float]:
    """Each device gradient's sum of squares, in one host sync: its fp32 L2 norm (one fused pass, no temporary; a
    16-bit gradient through an fp32 copy), squared in float64. (`sum(dtype=torch.float64)` would copy the whole
    tensor to float64 first.) The per-tensor norms are those torch's clip_grad_norm_ takes."""
    if not grads:
        return []
    norms = torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads])
    return [norm * norm for norm in norms.tolist()]
