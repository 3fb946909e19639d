"""Gradients on NVMe (`grads_on="nvme"`): each subgroup's fp32 gradient passes through a few pinned sets and waits
on the drive for the update, so host memory holds a bounded pool instead of 4 B/param of gradient plus staging.

    spill = GradientSpill(packing, grads, weights, tier, sets=2, clips=True)
    spill.hold(slot)        # backward's hook, before a slot's gradient leaves: its subgroup gets a set
    spill.finish()          # step(): every gradient on the drive; per subgroup its part of the norm and overflow flag
    spill.lend_staging(sub) # the update: a set's staging rounds `sub`'s new 16-bit weights for their upload
    spill.discard()         # zero_grad() without a step: this step's gradients are dropped

A set holds one subgroup's fp32 gradient and a staging buffer per dtype, sized for the largest subgroup. While a
subgroup holds a set, the gradient path (gradients.py) copies its gradients into the set's staging and adds them into
the set's fp32 sum exactly as it does with a gradient buffer of the subgroup's own. A subgroup all of whose gradients
have come in and landed is written to the drive when the next subgroup asks for a set (never waiting for a copy in a
hook), so its write runs while the gradients of the next ones come in. When a subgroup needs a set and none is free,
the set used longest ago is written to the drive (its copies added in first) and handed over. A subgroup that comes
back in the same step (another micro-batch, or a parameter of it used again) reads its partial sum back while its new
gradients are copied into the staging (the read is waited for before they are added in). So gradient accumulation
works through the drive: each extra micro-batch costs a read and a write of 4 B/param. Accumulating on the device in
the model's dtype instead would save that traffic but round every partial sum to 8 bits; this way the sums are the
in-memory engine's, bit for bit (the same fp32 additions in the same order).

Clipping and loss scaling need every gradient before any update: each write records its subgroup's sum of squares
and overflow flag, the last write being the final one, so the step reads no gradient twice. The update reads each
subgroup's gradient with its state through the NVMe tier (nvme_tier.py, `extra=("grad",)`).

What this is not: the copies and the additions (gradients.py), the update (optimizer.py), or the drive (a Swapper).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import torch

from ..kernels.gradnorm import sum_of_squares
from ..layout import Subgroup


@dataclass
class SubgroupGradient:
    """What the step needs of one subgroup's final gradient without reading it: the names the speculative update's
    records use, so the gradient path's overflow check and clip norm take either."""

    squares: float | None = 0.0  # its part of the clip norm (None with clipping off)
    finite: bool = True  # no inf/NaN in it (checked with loss scaling only)


class GradientSpill:
    def __init__(self, packing, grads, weights, tier, sets: int, clips: bool):
        self.packing, self.grads, self.weights, self.tier, self.clips = packing, grads, weights, tier, clips
        dev, subgroups = packing.dev, packing.on_cpu()
        largest = max(sub.numel for sub in subgroups)
        dtypes = {slot.param.dtype for sub in subgroups for slot in sub.slots}
        self.sets = [{"grad": dev.host_empty(largest), **{dtype: dev.host_empty(largest, dtype) for dtype in dtypes}}
                     for _ in range(sets)]
        self.holder: list[Subgroup | None] = [None] * sets  # the subgroup each set holds, or None
        self._writes: list[list] = [[] for _ in range(sets)]  # per set: its last write to the drive, in flight
        self._reading: list = [None] * sets  # per set: the read of its subgroup's partial sum, in flight
        self._arrived: list[set] = [set() for _ in range(sets)]  # per set: ids of the slots whose gradient came in
        self._borrower: list[Subgroup | None] = [None] * sets  # per set: whose upload its staging last fed
        self._used = [0] * sets  # per set: when a subgroup last asked for it (the oldest is written out first)
        self._clock = self._lent = 0
        self.on_disk: set[int] = set()  # id(subgroup): part of this step's gradient is on the drive
        self.records: dict[int, SubgroupGradient] = {}  # id(subgroup) -> its gradient's squares and flag
        self.bytes_read = self.bytes_written = 0
        # Numba's threads are per thread, and a hook may run on autograd's: the norm's partial sums use the count of
        # the thread that made the optimizer (and calls step()), as the in-memory engine's do
        self.numba_threads = numba.get_num_threads()

    # backward ----------------------------------------------------------------------------------------
    def hold(self, slot) -> None:
        """`slot`'s subgroup holds a set (its partial sum read back from the drive if it left one there this step);
        the slot's gradient from an earlier micro-batch may be added into it (gradients.py) once that read is in."""
        sub = slot.subgroup
        self._clock += 1
        held = next((i for i, other in enumerate(self.holder) if other is sub), None)
        if held is not None:
            self._used[held] = self._clock
            self._arrived[held].add(id(slot))
            if slot.pending:  # its last copy is about to be added into the sum: the sum must be there
                self._read_in(held)
            return
        self._write_out_complete()
        index = self._oldest(free=True)
        if index is None:  # every set held: the oldest goes to the drive now, and this subgroup waits for it
            index = self._oldest(free=False)
            self._write_out(index)
        self._settle(index)
        grad = self.sets[index]["grad"][:sub.numel]
        if id(sub) in self.on_disk:  # read while its gradients come in: waited for before they are added in
            self._reading[index] = self.tier.swapper.read(self.tier.key(sub, "grad"), into=grad)
            self.bytes_read += grad.numel() * 4
        else:
            grad.zero_()
        sub.buffers["grad"] = grad
        for dtype in {slot.param.dtype for slot in sub.slots}:
            sub.staging["staging", dtype] = self.sets[index][dtype][:sub.numel]
        self.holder[index], self._used[index], self._arrived[index] = sub, self._clock, {id(slot)}
        if self._oldest(free=True) is None and len(self.sets) > 1:
            # keep a set free: the oldest other one goes to the drive while this subgroup's gradients come in
            self._write_out(self._oldest(free=False))

    def _write_out_complete(self) -> None:
        """Every held subgroup whose slots have all arrived and whose copies have landed (asked, not waited for) goes
        to the drive now, so its set is free again well before it is needed."""
        for index, sub in enumerate(self.holder):
            if sub is not None and len(self._arrived[index]) == len(sub.slots) and all(
                    done.query() for slot in sub.slots for done, _ in slot.pending):
                self._write_out(index)

    def _oldest(self, free: bool) -> int | None:
        """The set asked for longest ago among the free (or the held) ones; None if there is none."""
        sets = [i for i, held in enumerate(self.holder) if (held is None) == free]
        return min(sets, key=self._used.__getitem__, default=None)

    def _settle(self, index: int) -> None:
        """The set is free to be overwritten: its write is on the drive and no upload reads its staging."""
        writes, self._writes[index] = self._writes[index], []
        for future in writes:
            future.result()
        borrower, self._borrower[index] = self._borrower[index], None
        if borrower is not None:
            self.weights.staging_free(borrower)

    def _read_in(self, index: int) -> None:
        """The partial sum being read into the set is there."""
        reading, self._reading[index] = self._reading[index], None
        if reading is not None:
            reading.result()

    def _write_out(self, index: int) -> None:
        """The set's subgroup: its copies added in, its sum measured and written to the drive; the set let go."""
        sub = self.holder[index]
        self._read_in(index)
        for slot in sub.slots:
            self.grads.add_pending(slot)  # waits for the copies into the staging
        grad = sub.buffers.pop("grad")
        for dtype in {slot.param.dtype for slot in sub.slots}:
            del sub.staging["staging", dtype]
        record = SubgroupGradient(squares=None)
        threads = numba.get_num_threads()
        numba.set_num_threads(self.numba_threads)
        try:
            if self.clips:
                record.squares = sum_of_squares(grad)
            if self.grads.loss_scale.on:
                record.finite = bool(torch.isfinite(grad).all())
        finally:
            numba.set_num_threads(threads)
        self.records[id(sub)] = record
        # scratch: a crash loses the step anyway, so no fsync and no index commit of its own (Swapper.write)
        self._writes[index] = [self.tier.swapper.write(self.tier.key(sub, "grad"), grad, durable=False)]
        self.bytes_written += grad.numel() * 4
        self.on_disk.add(id(sub))
        self.holder[index] = None

    # step ------------------------------------------------------------------------------------------
    def finish(self) -> dict[int, SubgroupGradient]:
        """Every held gradient written out and every write on the drive; per subgroup (all of them, a subgroup with
        no gradient this step as zeros would measure) what the overflow check and the clip norm need."""
        for index, held in enumerate(self.holder):
            if held is not None:
                self._write_out(index)
        for index in range(len(self.sets)):
            writes, self._writes[index] = self._writes[index], []
            for future in writes:
                future.result()
        return {id(sub): self.records.get(id(sub), SubgroupGradient(squares=0.0 if self.clips else None))
                for sub in self.packing.on_cpu()}

    def lend_staging(self, sub: Subgroup) -> None:
        """During the update (every gradient on the drive): the next set's staging takes `sub`'s rounded weights."""
        index, self._lent = self._lent % len(self.sets), self._lent + 1
        self._settle(index)
        for dtype in {slot.param.dtype for slot in sub.slots}:
            sub.staging["staging", dtype] = self.sets[index][dtype][:sub.numel]
        self._borrower[index] = sub

    def end_step(self) -> None:
        """The step has updated every subgroup: the next one starts with no gradient anywhere."""
        for sub in self.packing.on_cpu():
            sub.staging.clear()  # lent staging: the set's borrower record still guards the upload in flight
        self.on_disk.clear()
        self.records.clear()

    def discard(self) -> None:
        """zero_grad() without a step: copies in flight waited for, this step's gradients dropped."""
        for index, sub in enumerate(self.holder):
            if sub is None:
                continue
            self._read_in(index)  # no read may still be filling the set
            for slot in sub.slots:
                holder = slot if slot.bucket is None else slot.bucket
                for done, _ in holder.pending:
                    done.synchronize()  # the staging is reused only once nothing writes it
                holder.pending.clear()
            del sub.buffers["grad"]
            sub.staging.clear()
            self.holder[index] = None
        for index in range(len(self.sets)):
            self._settle(index)
        self.on_disk.clear()
        self.records.clear()
