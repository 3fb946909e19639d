"""The device side of the hybrid update (chapter 5): device memory for it, and the queued work per step.

    path = DevicePath(dev, subgroups)      # allocates, or raises OutOfMemoryError with nothing held
    path.take_grad(slot)                   # backward's hook: the gradient stays on the device
    path.prefetch(sub)                     # from backward, once a streamed subgroup's gradients exist: state in
    path.queue(work, coef, hyper)          # returns at once; the device streams do the rest
    path.cancel()                          # before the host state changes (a checkpoint loaded): prefetch dropped
    path.weights_written                   # the next forward waits for this event
    path.wait()                            # the host waits: weights written, streamed state home again

Resident subgroups keep their state and a gradient buffer on the device (16 B/param). Streamed ones take scratch sets
in turn over three streams: state in (h2d) -> device Adam -> state out (d2h), so one subgroup's state travels while
another's is updated. How many sets: `scratch_sets` (predict/hybrid_split.py), from the link and the device Adam's
rate (on the sim; 3, the model's most, on a GPU): with two, the link idles whenever the device Adam is as long as a
copy. The state of the first streamed subgroups whose gradients exist goes in during backward, on a link direction
that is idle then (the CPU path's uploads come after the update), not after the clip coefficient.

What this is not: the choice of subgroups or the model of the split (predict/hybrid_split.py), nor the optimizer
(offload.OffloadAdam builds the work list: each subgroup with its slots, gradients and Adam runs).
"""

from __future__ import annotations

from ..kernels.device_adam import device_adam
from ..layout import STATE, Where
from ..predict.hybrid_split import scratch_sets


class DevicePath:
    def __init__(self, dev, subgroups: list, sets: int | None = None):
        self.dev = dev
        self.scratch: list[dict] = []
        self.done: list = []  # events of the last queue(): weights written; streamed state home again
        self._turn = 0  # the scratch set the next streamed subgroup takes, in turn
        self._fetched: dict[int, dict] = {}  # id(subgroup) -> its scratch buffers, state in flight or arrived
        resident = [sub for sub in subgroups if sub.where == Where.RESIDENT]
        largest = max((sub.numel for sub in subgroups if sub.where == Where.STREAMED), default=0)
        self.sets = (sets or _sets_for(dev, largest)) if largest else 0
        # one allocation: a split that does not fit raises here, before anything is held or moved
        flat = dev.empty(4 * (sum(sub.numel for sub in resident) + self.sets * largest),
                         name="optimizer state on the device")
        parts = iter(flat.split([sub.numel for sub in resident for _ in range(4)] + [largest] * 4 * self.sets))
        for sub in resident:
            sub.buffers = {name: next(parts) for name in (*STATE, "grad")}
            sub.buffers["exp_avg"].zero_()  # device memory from empty() is uninitialised on a GPU: the moments
            sub.buffers["exp_avg_sq"].zero_()  # start at zero (the master is copied in, the gradient gathered)
        if largest:
            self.scratch = [{name: next(parts) for name in (*STATE, "grad")} for _ in range(self.sets)]
            self.state_in, self.state_out = dev.stream("state h2d"), dev.stream("state d2h")
            dev.stream_waits_for_compute(self.state_in)  # the scratch is compute's new memory (allocated above)
        self.gpu = dev.stream("device adam")

    @property
    def weights_written(self):
        return self.done[0] if self.done else None

    def take_grad(self, slot) -> None:
        """backward's hook for a parameter updated on the device: its gradient stays (torch accumulates there); once
        the subgroup's gradients all exist, a streamed subgroup's state starts in, during backward."""
        slot.has_grad = True
        if all(s.has_grad for s in slot.subgroup.slots):
            self.prefetch(slot.subgroup)

    def prefetch(self, sub) -> None:
        """Queue a streamed subgroup's state in now (from backward), when a scratch set is free for it; else (or for
        a resident one) nothing: queue() brings it."""
        if sub.where == Where.STREAMED and id(sub) not in self._fetched and len(self._fetched) < self.sets:
            self._fetch(sub)

    def _fetch(self, sub) -> dict:
        """Queue `sub`'s state into the next scratch set on the state-in stream; its buffers there."""
        scratch = self.scratch[self._turn % self.sets]
        self._turn += 1
        for waits in (scratch.get("free"), *self.done[1:]):  # its last user done; last step's state home
            if waits is not None:
                self.state_in.wait(waits)
        buffers = {name: scratch[name][:sub.numel] for name in (*STATE, "grad")}
        for name in STATE:
            self.dev.copy(buffers[name], sub.buffers[name], self.state_in, name=f"h2d {name}")
        buffers["arrived"] = self.dev.event()
        buffers["arrived"].record(self.state_in)
        buffers["set"] = scratch
        self._fetched[id(sub)] = buffers
        return buffers

    def cancel(self) -> None:
        """Drop the prefetched state before the host changes its own (a checkpoint loaded). The host waits for each
        copy in: it reads the pinned state the host is about to write. A skipped step or a zero_grad() need not
        cancel: the state they leave is the state brought in."""
        for buffers in self._fetched.values():
            buffers["arrived"].synchronize()
        self._fetched.clear()

    def queue(self, work: list[tuple], coef: float, hyper: dict) -> None:
        """Queue the update of each (subgroup, slots, gradients, Adam runs) in `work`; returns at once. Subgroups
        whose state is in already go first, so that every set is released in the order sets are taken."""
        dev, streamed = self.dev, False
        work = sorted(work, key=lambda item: id(item[0]) not in self._fetched)  # stable: prefetched first
        for sub, slots, grads, runs in work:
            if sub.where == Where.STREAMED:
                buffers = self._fetched.pop(id(sub), None) or self._fetch(sub)
                self._fetched.pop(id(sub), None)
                scratch, streamed = buffers["set"], True
                self.gpu.wait(buffers["arrived"])
            else:
                buffers = sub.buffers
            dev.stream_waits_for_compute(self.gpu)  # backward wrote the gradients
            for grad in grads:
                dev.keep_alive(grad, self.gpu)  # the update reads them after this function has dropped them
            dev.launch(self.gpu, _adam, buffers, slots, grads, runs, coef, hyper,
                       name=f"device adam {sub.numel / 1e6:.2f}M",
                       duration=sub.numel / dev.adam_rate if dev.adam_rate else None)  # modelled on the sim
            if sub.where == Where.STREAMED:
                updated = dev.event()
                updated.record(self.gpu)
                self.state_out.wait(updated)
                for name in STATE:
                    dev.copy(sub.buffers[name], buffers[name], self.state_out, name=f"d2h {name}")
                scratch["free"] = dev.event()
                scratch["free"].record(self.state_out)
        self.done = [dev.event()]
        self.done[0].record(self.gpu)
        if streamed:
            self.done.append(dev.event())
            self.done[1].record(self.state_out)

    def wait(self) -> None:
        """The host waits for the device path: its weights written and its state back in host memory."""
        for event in self.done:
            event.synchronize()


def _adam(buffers: dict, slots: list, grads: list, runs: list, coef: float, hyper: dict) -> None:
    """On the device stream: gather the gradients into the flat buffer, Adam, write the weights."""
    flat = buffers["grad"]
    for slot, grad in zip(slots, grads, strict=True):
        slot.view(flat).copy_(grad.reshape(-1))
    if coef != 1.0:
        flat.mul_(coef)
    for run in runs:
        span = slice(run[0].offset, run[-1].offset + run[-1].numel)
        device_adam(buffers["master"][span], flat[span], buffers["exp_avg"][span],
                           buffers["exp_avg_sq"][span], step=run[0].step, **hyper[id(run[0].group)])
    for slot in slots:
        slot.param.data.copy_(slot.shaped(buffers["master"]))


def _sets_for(dev, numel: int) -> int:
    """Scratch sets for streamed subgroups of up to `numel` elements: the model's answer where the device models its
    link and Adam (the sim), else 3 (the most the model ever asks for)."""
    links, rate = getattr(dev, "links", None), getattr(dev, "adam_rate", None)
    if not links or not rate:
        return 3
    return scratch_sets(numel, min(link.bandwidth for link in links.values()), rate,
                               max(link.latency for link in links.values()))
