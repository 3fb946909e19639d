"""The speculative update of OffloadAdam (chapter 4): each subgroup's CPU Adam starts while backward still runs.

    speculative = SpeculativeUpdate(packing, loss_scale, grads, weights, options)   # with `speculative=True`
    backward  when a subgroup's gradients of the step's last backward (`backwards_per_step`) have all been sent,
              `arrived` hands it to one worker thread, which waits for its copies, adds them into the fp32
              gradient, takes its part of the clip norm and its overflow flag, runs Adam with the coefficient a clean,
              unclipped step has (1 / loss scale) *out of place* (`adam_fused_into`: the pre-step state stays), and
              uploads the new weights. The link and the CPU work while the device is still in backward.
    step      `join` waits for the worker. With the global norm and the overflow flag known,
              `commit` keeps a subgroup's speculated update (its new state swapped in, nothing copied) when its
              coefficient was the right one and its step counts, hyper-parameters and gradient are the ones the
              synchronous step would use; otherwise the step redoes it from the pre-step state, as the synchronous
              step does, and uploads again. An overflow skips the step: the device gets its old weights back.
So the result is bit for bit the synchronous step's, in every case; only the time differs.

Why: synchronously the CPU Adam and the uploads wait for the whole backward and the norm, and the device waits for
them; SuperOffload (ASPLOS 2026) starts each subgroup's update as its gradients arrive and validates afterwards.
The step then takes about max(backward, update) + the last subgroup's update, not backward + update.

Memory: the pre-step state has to survive until validation. Two exact ways to keep it:
    a saved copy   copy master, exp_avg and exp_avg_sq aside, then update in place: 12 B/param more host memory,
                   and 24 B/param more memory traffic per step (the copy's read and write)
    a second set   (this module) the update writes its result into a second set of state buffers and a commit swaps
                   the sets: the same 12 B/param, no copy; but the CPU reads each line it writes and has not read
                   (12 B/param), and on our machines the out-of-place pass takes about 2x the in-place one
Undoing Adam from the new state and the gradient would need no memory, but is not exact in floating point.

An extra backward after a subgroup speculated (more micro-batches than `backwards_per_step`) would run on weights
already changed: it raises, the device gets its old weights back, and the optimizer state is untouched.

What this is not: the gradient path or the uploads (it calls gradients.py and weights.py for them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import torch

from .. import layout
from ..kernels.adam import adam_fused_into
from ..kernels.gradnorm import sum_of_squares
from ..layout import STATE, Subgroup
from ..options import OffloadOptions
from .gradients import GradientPath
from .packing import LossScale, Packing
from .weights import WeightUploads


@dataclass
class Speculation:
    """What one subgroup's speculative update assumed and found."""

    coef: float  # the coefficient it used: 1 / loss scale
    steps: tuple[int, ...]  # each slot's step count it used
    hyper: tuple  # each run's (lr, betas, eps, weight_decay)
    squares: float | None = None  # its part of the clip norm (None with clipping off)
    finite: bool = True  # no inf/NaN in its gradient (checked with loss scaling only)
    ran: bool = False  # Adam ran and its weights went up


class SpeculativeUpdate:
    def __init__(self, packing: Packing, loss_scale: LossScale, grads: GradientPath, weights: WeightUploads,
                 options: OffloadOptions):
        self.packing, self.loss_scale, self.grads, self.weights = packing, loss_scale, grads, weights
        self.max_grad_norm, self.backwards_per_step = options.max_grad_norm, options.backwards_per_step
        self.speculations: dict[int, Speculation] = {}  # id(subgroup) -> this step's speculation
        self._landed: dict[int, set[int]] = {}  # id(subgroup) -> ids of slots whose gradient came in this backward
        self._backwards: dict[int, int] = {}  # id(subgroup) -> backward passes that completed it since the step
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="speculative adam")
        self._futures: list = []
        # Numba's thread count is per thread: read it on the thread that sets the optimizer up and calls step()
        # (where the user or the course sets it), never in a backward hook (on a GPU, autograd's own thread, at the
        # default), so that the worker's passes, and so the norm's partial sums, match the step's own
        self.numba_threads = numba.get_num_threads()
        # subgroups whose speculated update was kept, redone (clipped, or a setting changed), or taken back (overflow)
        self.counts = {"kept": 0, "redone": 0, "taken back": 0}
        for sub in packing.on_cpu():  # the second set of state: 12 B/param of pinned host memory
            sub.spare = {name: packing.dev.host_empty(sub.numel) for name in STATE}

    def refuse_a_late_backward(self, sub: Subgroup) -> None:
        """Backward hook, before the slot's gradient leaves: a gradient for a subgroup already speculated on means
        more backwards than declared. Refused before its copy is queued, so the worker never reads a staging buffer
        that a new copy is filling."""
        if id(sub) in self.speculations:
            self.discard()
            raise RuntimeError(f"a backward ran after the speculative update of its last one "
                               f"(backwards_per_step={self.backwards_per_step}): set backwards_per_step to "
                               "the micro-batches per step. The device has its old weights back and the optimizer "
                               "state is unchanged; call zero_grad() and run the step again")

    def arrived(self, sub: Subgroup, slot) -> None:
        """Backward hook, after the slot's gradient left: count it; speculate when the subgroup is complete."""
        key = id(sub)
        landed = self._landed.setdefault(key, set())
        if id(slot) in landed:  # a new backward pass began before this subgroup completed the last one
            landed.clear()
        landed.add(id(slot))
        if len(landed) < len(sub.slots):
            return
        landed.clear()
        self._backwards[key] = self._backwards.get(key, 0) + 1
        if self._backwards[key] != self.backwards_per_step:
            return
        # from backward's thread: its uploads follow what backward queued
        self.packing.dev.stream_waits_for_compute(self.packing.h2d)
        steps = tuple(s.step + 1 for s in sub.slots)
        runs = layout.runs(sub, sub.slots)
        hyper = tuple(tuple(run[0].group[k] for k in ("lr", "betas", "eps", "weight_decay")) for run in runs)
        spec = Speculation(1.0 / self.loss_scale.scale, steps, hyper)
        self.speculations[key] = spec
        self._futures.append(self._worker.submit(self._speculate, sub, spec, self.numba_threads))

    def _speculate(self, sub: Subgroup, spec: Speculation, threads: int) -> None:
        """On the worker thread: gather the gradient, measure it, update out of place, upload."""
        numba.set_num_threads(threads)  # as many as the step's own passes: the norm's partial sums then agree
        for slot in sub.slots:
            self.grads.add_pending(slot)
        grad = sub.buffers["grad"]
        if self.max_grad_norm is not None:
            spec.squares = sum_of_squares(grad)
        if self.loss_scale.on:
            spec.finite = bool(torch.isfinite(grad).all())
        if not spec.finite:
            return  # the step will be skipped: nothing to update
        old, new = sub.buffers, sub.spare
        with self.packing.dev.trace.span("cpu", f"adam {sub.numel / 1e6:.2f}M (speculative)", 28 * sub.numel):
            for run, (lr, betas, eps, decay) in zip(layout.runs(sub, sub.slots), spec.hyper, strict=True):
                span = slice(run[0].offset, run[-1].offset + run[-1].numel)
                adam_fused_into(old["master"][span], grad[span], old["exp_avg"][span], old["exp_avg_sq"][span],
                                new["master"][span], new["exp_avg"][span], new["exp_avg_sq"][span],
                                grad_scale=spec.coef, step=run[0].step + 1, lr=lr, beta1=betas[0], beta2=betas[1],
                                eps=eps, weight_decay=decay)
        self.weights.send(sub, new["master"], wait_for_compute=False)
        spec.ran = True

    def join(self) -> dict[int, Speculation]:
        """Wait for the worker; the speculations of this step by id(subgroup). A worker's error is raised here."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
        return self.speculations

    def close(self) -> None:
        """Wait for the worker, then stop its thread (no backward submits to it once the hooks are off)."""
        try:
            self.join()
        finally:
            self._worker.shutdown(wait=True)

    def commit(self, sub: Subgroup, coef: float, slots: list, hyper: dict) -> bool:
        """Keep `sub`'s speculated update if it is what the synchronous step would compute now (the new state
        swapped in); False: the caller updates it."""
        spec = self.speculations.get(id(sub))
        if spec is None or not spec.ran:
            return False
        runs = layout.runs(sub, slots)
        now = tuple(tuple(hyper[id(run[0].group)][k] for k in ("lr", "betas", "eps", "weight_decay")) for run in runs)
        if (coef != spec.coef or len(slots) != len(sub.slots) or spec.hyper != now
                or spec.steps != tuple(s.step for s in sub.slots)):
            self.counts["redone"] += 1
            return False  # redone from the pre-step state, which the speculation left as it was
        for name in STATE:  # the speculated state becomes the state; the old one the next spare
            sub.buffers[name], sub.spare[name] = sub.spare[name], sub.buffers[name]
        self.counts["kept"] += 1
        return True

    def discard(self) -> None:
        """Drop this step's speculations: the device gets back the weights of the state that stays, and the next
        forward reads those."""
        self.join()
        for sub in self.packing.subgroups:
            if self.speculations.get(id(sub)) is not None and self.speculations[id(sub)].ran:
                self.weights.send(sub, sub.buffers["master"])
                self.counts["taken back"] += 1
        self.weights.sent()
        self.weights.forward_waits()
        self._forget()  # (maybe on autograd's thread, from refuse_a_late_backward: the thread count stays)

    def end(self) -> None:
        """The step is over (called from step(), on the caller's thread): the next backward starts counting afresh,
        with the caller's Numba thread count as it is now."""
        self._forget()
        self.numba_threads = numba.get_num_threads()

    def _forget(self) -> None:
        self.speculations, self._landed, self._backwards = {}, {}, {}
