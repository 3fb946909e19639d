"""The one-step delayed parameter update (ZeRO-Offload's DPU) of OffloadAdam: its thread and its unsent weights.

    delayed = DelayedUpdate(after=10)
    if delayed.due(updates): delayed.submit(update_all, ...)   # step() returns; the CPU Adam runs on
    ...                                                         # the next forward and backward run meanwhile
    uploaded = delayed.send(dev, h2d)   # next step(): join the update, send the weights it left

The update thread returns the slots it updated; their new weights wait in upload buffers of their own
(`stash`), because the gradient staging is refilled by the backward that runs beside it. While it runs it
owns the fp32 gradient, master and moment buffers: the engine calls `join()` before any host read of them.

What this is not: the update itself (offload.OffloadAdam), nor the policy of when to start (the option
`delay_updates_after`, options.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..layout import Slot


def upload_buffer(slot: Slot) -> torch.Tensor:
    """Where this parameter's new weights (in its dtype) wait to be sent."""
    return slot.shaped(slot.subgroup.staging["upload", slot.param.dtype])


class DelayedUpdate:
    def __init__(self, after: int):
        self.after = after
        self._thread = ThreadPoolExecutor(1, "offload-update")
        self._job: Future | None = None  # the update in flight; its result: the slots it updated
        self.unsent: list[Slot] = []  # slots whose new weights wait in their upload buffers

    def due(self, updates: int) -> bool:
        """Is update number `updates` (counting from 1) a delayed one?"""
        return updates > self.after

    def submit(self, update: Callable[..., list[Slot]], *args) -> None:
        self._job = self._thread.submit(update, *args)

    def join(self) -> None:
        """Wait for the update in flight, if one is (re-raising its error); its slots join the unsent."""
        if self._job is not None:
            job, self._job = self._job, None
            self.unsent += job.result()

    def close(self) -> None:
        """Wait for the update in flight, then stop the worker thread."""
        try:
            self.join()
        finally:
            self._thread.shutdown(wait=True)

    @staticmethod
    def stash(slot: Slot) -> None:
        """Round a slot's fp32 master into its upload buffer (on the CPU, nearest even)."""
        upload_buffer(slot).copy_(slot.shaped(slot.subgroup.buffers["master"]))

    def send(self, dev, h2d):
        """Join the update and queue its weights on the `h2d` stream; the event after them, or None."""
        self.join()
        if not self.unsent:
            return None
        dev.stream_waits_for_compute(h2d)  # backward may still read the weights these overwrite
        for slot in self.unsent:
            dev.copy(slot.param.data, upload_buffer(slot), h2d, name="h2d weights")
        self.unsent = []
        sent = dev.event()
        sent.record(h2d)
        return sent
