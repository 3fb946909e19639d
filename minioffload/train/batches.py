"""The training loop's micro-batches on their way to the device: pinned host buffers, a copy stream, an event each.

    uploads = BatchUploads(dev, micro_batches=4)
    uploads.send(drawn)            # at a step's start: its micro-batches [(x, y), ...], every copy queued at once
    x, y = uploads.get(k)          # before micro-batch k's forward: compute waits for its copy (the host does not)

Why: on a GPU, `tensor.to("cuda")` from pageable memory is a synchronous copy. The host waits for it, behind all the
compute already queued, so it loses its run-ahead at every micro-batch. Here each micro-batch is written into pinned
host buffers and copied up on a copy stream ("h2d batch") into device buffers, both made at the first step and
reused by every later one. The copies wait for the compute that last read those device buffers
(`dev.stream_waits_for_compute`), the forward waits for its copy (`dev.compute_waits_for`, on the device), and the
host waits only before rewriting a pinned buffer whose last copy has not run (it has: that was a step ago).

Where the device's compute reads host memory as it is (the sim: `dev.to_device(t)` is `t` itself), the drawn tensors
are used as they are: no buffers, no copies, and the sim's trace and step times stay what they were.

What this is not: a data loader (no worker processes, no reading ahead from disk); the loop draws the batches.
"""

from __future__ import annotations

import torch


class BatchUploads:
    """`micro_batches` (inputs, targets) pairs per step on the device. `direct`: use the drawn tensors as they
    are (None: when `dev.to_device` hands a host tensor back unchanged, as the sim does)."""

    def __init__(self, dev, micro_batches: int, direct: bool | None = None):
        self.dev = dev
        if direct is None:
            probe = torch.zeros(1, dtype=torch.long)
            direct = dev.to_device(probe) is probe
        self.direct = direct
        self.stream = None if direct else dev.stream("h2d batch")
        self._drawn: list[tuple[torch.Tensor, ...]] = []
        self._host: list[tuple[torch.Tensor, ...]] = []  # per micro-batch: pinned host buffers
        self._device: list[tuple[torch.Tensor, ...]] = []  # per micro-batch: device buffers
        self._copied: list = [None] * micro_batches  # per micro-batch: the event after its last copy

    def send(self, drawn: list[tuple[torch.Tensor, ...]]) -> None:
        """Queue the copies of this step's micro-batches; returns without waiting for them."""
        if len(drawn) != len(self._copied):
            raise ValueError(f"BatchUploads was made for {len(self._copied)} micro-batches per step, got {len(drawn)}: "
                             "make it with the step's number of micro-batches")
        self._drawn = drawn
        if self.direct:
            return
        if not self._host:  # the first step: buffers shaped as its batches, for every step
            self._host = [tuple(self.dev.host_empty(tuple(t.shape), t.dtype) for t in pair) for pair in drawn]
            self._device = [tuple(self.dev.empty(tuple(t.shape), t.dtype, name="batch") for t in pair)
                            for pair in drawn]
        for index, (pair, pinned) in enumerate(zip(drawn, self._host, strict=True)):
            if [(t.shape, t.dtype) for t in pair] != [(b.shape, b.dtype) for b in pinned]:
                raise ValueError(f"micro-batch {index} is {[tuple(t.shape) for t in pair]}, and its buffers were "
                                 f"made for {[tuple(b.shape) for b in pinned]}: every step's batches have one shape")
            if self._copied[index] is not None:
                self._copied[index].synchronize()  # its last copy has read the pinned buffers
            self.dev.uses(f"the host writing micro-batch {index}", writes=list(pinned))  # checked by the strict sim
            for buffer, tensor in zip(pinned, pair, strict=True):
                buffer.copy_(tensor)
        # the last step's forward and backward read the device buffers (and the first step's were just allocated)
        self.dev.stream_waits_for_compute(self.stream)
        for index in range(len(drawn)):
            for target, source in zip(self._device[index], self._host[index], strict=True):
                self.dev.copy(target, source, self.stream, name="h2d batch")
            copied = self.dev.event()
            copied.record(self.stream)
            self._copied[index] = copied

    def get(self, index: int) -> tuple[torch.Tensor, ...]:
        """Micro-batch `index` of the last `send`, for compute to read: work queued from now on waits for its copy."""
        if self.direct:
            return self._drawn[index]
        self.dev.compute_waits_for(self._copied[index])
        tensors = self._device[index]
        self.dev.uses(f"the forward of micro-batch {index}", reads=list(tensors))  # checked by the strict sim
        return tensors
