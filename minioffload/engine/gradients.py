"""The gradient half of OffloadAdam: from backward's hook to the coefficient every gradient is multiplied by.

OffloadAdam inherits these methods:
    backward   `_offload_grad` (the post-accumulate-grad hook): a gradient leaves the device as soon as it is ready,
               in its own copy or, with `bucket_numel`, gathered into its bucket, which leaves in one copy once
               full (buckets.py); the device gradient is freed after its copy; gradients of subgroups updated on the
               device stay there. `_add_pending` adds a copied gradient into the subgroup's fp32 buffer once its copy
               has landed (micro-batches accumulate there, never on the device).
    step       `_grads_finite` (loss scaling: any inf or NaN skips the step) and `_clip_coefficient` (1/scale times
               the clip factor from the global L2 norm, per-subgroup partial sums added in subgroup order);
               `scale_loss` for the caller's backward.
engine/optimizer.py holds the rest of the optimizer; a speculative update (engine/speculative.py) takes each subgroup's
partial sum and overflow flag during backward, and these use them.

What this is not: usable alone (a mixin of OffloadAdam, reading its dev, options, subgroups, shard, ...).
"""

from __future__ import annotations

import math

import torch

from ..kernels.gradnorm import sum_of_squares
from ..layout import Slot, Where


class GradientPath:
    """OffloadAdam's gradient methods (see the module docstring)."""

    def _offload_grad(self, param: torch.nn.Parameter) -> None:
        slot = self._slots[param]
        if self.shard is not None:
            return self._gather_grad(slot)
        if slot.subgroup.where != Where.CPU:  # updated on the device: the gradient stays (torch accumulates)
            self.dev.adopt(param.grad, "grad")
            slot.has_grad = True
            if all(s.has_grad for s in slot.subgroup.slots):
                self.device_path.prefetch(slot.subgroup)  # a streamed subgroup's state starts in, during backward
            return
        bucket = slot.bucket
        if bucket is None or not bucket.arrived:
            self._add_pending(slot)  # a previous micro-batch's copy must be added in before its staging is reused
        grad, param.grad = param.grad.contiguous(), None  # the device gradient goes once its copy is done
        self.dev.adopt(grad, "grad")  # autograd made it on the device: count it there until it is freed
        slot.has_grad = True
        if bucket is not None:  # into the bucket's device memory; the bucket leaves in one copy once full
            if bucket.take(slot, grad, self.dev):
                bucket.send(self.dev, self.d2h, slot.subgroup.staging["staging", bucket.dtype])
            return self._arrived(slot.subgroup, slot)
        staging = self._staging(slot)
        self.dev.stream_waits_for_compute(self.d2h)
        self.dev.copy(staging, grad, self.d2h, name="d2h grad")
        self.dev.keep_alive(grad, self.d2h)  # its memory is not reused before the copy has read it
        done = self.dev.event()
        done.record(self.d2h)
        slot.pending.append((done, staging))
        self._arrived(slot.subgroup, slot)

    def _add_pending(self, slot: Slot) -> None:
        """Add the slot's copied gradients (its bucket's, with buckets) into the subgroup's fp32 gradient."""
        holder = slot if slot.bucket is None else slot.bucket
        if holder.pending:
            self._join_update()  # the delayed update may still be reading the gradient buffer
        for done, staging in holder.pending:
            done.synchronize()  # never read an in-flight copy
            holder.view(slot.subgroup.buffers["grad"]).add_(staging.reshape(-1).float())
        holder.pending.clear()

    def _send_partial_buckets(self) -> None:
        """Buckets some of whose parameters got no gradient in the last backward leave now (zeros for those)."""
        for sub in self.subgroups:
            for bucket in sub.buckets:
                if bucket.arrived:
                    bucket.send(self.dev, self.d2h, sub.staging["staging", bucket.dtype])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale (1.0 unless loss scaling is on)."""
        return loss * self.scale if self.scale != 1.0 else loss

    def _device_grads(self) -> list[torch.Tensor]:
        """The gradients that stay on the device: kept small parameters, and subgroups updated there."""
        params = [*self.kept, *(slot.param for slot in self._slots.values() if slot.subgroup.where != Where.CPU)]
        return [p.grad for p in params if p.grad is not None]

    def _grads_finite(self) -> bool:
        """One flag from every subgroup: is any gradient inf or NaN? (Only checked with loss scaling on.)"""
        if self.scale == 1.0 and not self.dynamic:
            return True
        specs = self._speculations  # a speculative update checked its subgroup already
        finite = all(specs[id(sub)].finite if id(sub) in specs else bool(torch.isfinite(sub.buffers["grad"]).all())
                     for sub in self._on_cpu())
        finite = finite and all(bool(torch.isfinite(grad).all()) for grad in self._device_grads())
        return finite if self.shard is None else self.shard.all_true(finite)  # sharded: skip on every rank or none

    def _clip_coefficient(self) -> float:
        """What multiplies every gradient before the update: 1/scale, times the clip factor computed from the
        global L2 norm (per-subgroup partial sums, one combine) as clip_grad_norm_ does."""
        if self.options.max_grad_norm is None:  # no clipping: skip a pass over every gradient
            self.last_grad_norm = None
            return 1.0 / (self.scale * (self.shard.world if self.shard is not None else 1))
        if self.shard is None:  # one pass, no temporaries; a speculative update took its subgroup's part already
            specs = self._speculations
            squares = sum(specs[id(sub)].squares if id(sub) in specs else sum_of_squares(sub.buffers["grad"])
                          for sub in self._on_cpu())
        else:  # the owners' partial sums, added in the same order as one process adds them
            squares = self.shard.sum_in_order({self._index[id(sub)]: sum_of_squares(sub.buffers["grad"])
                                               for sub in self._on_cpu()}, len(self.subgroups))
        squares += sum(float(grad.double().square().sum()) for grad in self._device_grads())
        divide = self.scale * (self.shard.world if self.shard is not None else 1)  # ranks' sum -> their mean
        self.last_grad_norm = math.sqrt(squares) / divide
        return min(1.0, self.options.max_grad_norm / (self.last_grad_norm + 1e-6)) / divide
