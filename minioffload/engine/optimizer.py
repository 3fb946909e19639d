"""OffloadAdam: AdamW with fp32 master weights and moments in pinned host memory, updated on the CPU.

    dev.place(model)
    opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=1 << 20)   # options: options.py
    loss.backward()          # each gradient is copied to the host on a copy stream as soon as it is ready
    opt.step()               # per subgroup: CPU Adam, then the new weights go back on another copy stream
    opt.zero_grad()

After backward no offloaded parameter has a `.grad` on the device, so `torch.nn.utils.clip_grad_norm_` over the model
clips nothing. Clip with `max_grad_norm=` (inside step()), or, in a loop that clips on its own between backward and
step() (Hugging Face's Trainer, Lightning: minioffload/integrations/), with `opt.clip_grad_norm_(max_norm)`: it gathers
the step's gradients on the host then and there, returns their norm, and the coming step() uses its coefficient.

The flow of one step (every arrow a span in `dev.trace`):
  backward -> post-accumulate-grad hook -> D2H of that gradient into pinned staging (device gradient
  released) -> step(): wait for each subgroup's copies, add them into its fp32 gradient -> global norm
  for clipping -> CPU Adam (chapter 3) on the subgroup -> its weights (in the model's dtype) H2D on a copy
  stream while the CPU updates the next subgroup -> the next forward waits for the last copy, not earlier.

The step reads top to bottom here; the parts it calls each get what they need when they are made:
  packing.py      the device, its copy streams, the subgroups and slots every part reads, and the loss scale
  buffers.py      the memory made at construction (pinned state and staging, the device path, the NVMe tier)
  gradients.py    the gradient path: hook -> copy (or bucket) -> accumulation; overflow check and clip coefficient
  weights.py      the device weights: one flat tensor per subgroup, the uploads, the event the forward waits for
  speculative.py  the speculative update          delayed.py     the one-step delayed update
  device_path.py  the hybrid update's device side nvme_tier.py   the NVMe tier
  sharded.py      a rank's sharded step           state.py       the checkpoint (state_dict, load_state_dict)

Parameters are packed into subgroups of about `subgroup_numel` elements: one flat pinned buffer each for
the fp32 master weights, exp_avg, exp_avg_sq and gradient, so the CPU Adam runs one call per subgroup. On the
device a subgroup's parameters become views of one flat tensor, so its new weights go up in one copy. With
`bucket_numel` (engine/buckets.py) gradients leave in buckets of consecutive parameters, one copy each, instead of one
copy per tensor.
Gradients accumulate on the host across micro-batches (each backward's gradient is offloaded and added
in fp32), so accumulation never holds a device gradient between backward passes.

fp16 models need loss scaling: with `loss_scale="dynamic"`, call `opt.scale_loss(loss).backward()`; a
step whose gradients overflow is skipped for every subgroup (no state touched) and the scale halves; after
`growth_interval` clean steps it doubles (torch's GradScaler policy). `state_dict()` holds the fp32
master weights, moments and step counts, so a loaded checkpoint continues bit for bit.

Parameters smaller than `min_offload_numel` elements (biases, norms) can stay on the device with a torch
AdamW there: offloading them costs a copy each way for a few bytes. They join the clipping norm and the
overflow check like the others.

With `delay_updates_after=n`, steps after the first n run ZeRO-Offload's one-step delayed parameter update
(DPU, engine/delayed.py): step() hands the CPU Adam to a background thread and returns, so the update overlaps the
next forward and backward; its weights are sent at the following step(). The price is staleness: the
gradient of iteration t is computed on the weights of update t-2, not t-1. Call `flush()` at the end of
training to send the last update's weights.

With `speculative=True` (engine/speculative.py) each subgroup's CPU Adam starts during backward, as soon as its
last gradient has arrived, out of place; step() keeps it when clipping, an overflow or a changed setting did not
change what the synchronous step computes, and redoes it otherwise: the same weights, bit for bit, sooner.

With `gpu_fraction` or `stride` (chapter 5, predict/hybrid_split.py) some subgroups are updated on the device instead:
their gradients stay there, their state either lives there (`gpu_fraction`) or is copied in and out
around a device-side Adam (`stride`) while the CPU updates the other subgroups.

With `streamer=` (a `ParamStreamer`, chapter 8) the blocks' weights live off the device between uses: their
gradients leave as any other, and their new weights go to the streamer's home instead of up the link (an fp32
model's home is the master itself). Delayed updates and hybrid splits need the weights on the device: refused.

With `shard=` (a `Shard`, chapter 10, engine/sharding.py) each of N ranks owns about 1/N of the subgroups: a subgroup's
gradients are summed into its owner when its last one arrives, only the owner holds its state and updates it, and
its new weights are broadcast from there. Gradients are averaged over the ranks (the coefficient takes 1/N). With
streamed weights too, every rank keeps the whole weights at home (the masters are sharded, so none is a home) and a
subgroup holding streamed weights is broadcast in host memory, into every rank's home. The hybrid split and delayed
updates are refused with a shard (not built for it).
"""

from __future__ import annotations

import collections

import torch

from .. import layout
from ..kernels.adam import adam_fused
from ..layout import Slot, Subgroup, Where
from ..options import OffloadOptions, Placement, check_run
from . import buffers, state
from .delayed import DelayedUpdate
from .grad_spill import GradientSpill
from .gradients import GradientPath
from .packing import LossScale, Packing
from .sharded import ShardedSteps
from .sharding import settings_of
from .speculative import SpeculativeUpdate
from .weights import WeightUploads

HYPER = ("lr", "betas", "eps", "weight_decay")  # what each param group gives the update


class OffloadAdam(torch.optim.Optimizer):
    """AdamW whose state lives in pinned host memory and whose update runs on the CPU.

    `dev` is a minioffload device (devices/) holding the model's parameters (`dev.place(model)`). lr, betas,
    eps and weight_decay are torch's AdamW settings (per param group, as in torch). How the state is offloaded
    and updated is an `OffloadOptions` (options.py): pass one as `options=`, or its fields as keywords
    (`subgroup_numel=`, `max_grad_norm=`, `stride=`, ...). `swapper`: a `Swapper` (nvme/) for the NVMe tier.
    `streamer`: the `ParamStreamer` (model/streaming.py) of the model, when its weights are streamed.
    `shard`: a `Shard` (engine/sharding.py): this rank owns and updates only its share of the subgroups.
    """

    def __init__(self, params, dev, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, options: OffloadOptions | None = None,
                 swapper=None, streamer=None, shard=None, grads_on: str = "host", **option_fields):
        options = (options or OffloadOptions()).replace(**option_fields)
        # the run's rules, in the words every entry point uses (options.py); a shard of one rank still runs the
        # sharded step, so it is held to the rules of several
        check_run(Placement(optimizer_on="nvme" if swapper is not None else "host",
                            params_on="host" if streamer is not None else "device",
                            ranks=max(2, shard.world) if shard is not None else 1, grads_on=grads_on), options)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not trainable:
            raise ValueError("OffloadAdam got no parameter that requires a gradient; pass model.parameters()")
        streamed = {p for p in trainable if streamer is not None and streamer.streams(p)}
        if not all(dev.is_device(p) for p in trainable if p not in streamed):
            raise ValueError("every parameter must be on the device before OffloadAdam takes it: call "
                             "dev.place(model) first (or stream it: ParamStreamer)")
        self.dev, self.options, self.swapper, self.streamer, self.shard = dev, options, swapper, streamer, shard
        self._closed = False
        self.last_grad_norm: float | None = None  # before clipping, unscaled; None when clipping is off
        # what clip_grad_norm_() found for the coming step(): "gathered" (speculations, finite), "clipped" (coef, norm).
        # Changed in place, never rebound: a wrapper that forwards attribute reads (Lightning's) shares it
        self._this_step: dict = {}
        self.loss_scale = LossScale.of(options.loss_scale, options.growth_interval)
        self.updates = 0  # steps not skipped
        self.delayed = DelayedUpdate(options.delay_updates_after) if options.delayed else None
        # the small parameters kept on the device, updated there by torch's AdamW
        self.kept = list(dict.fromkeys(p for p in trainable
                                       if p.numel() < options.min_offload_numel and p not in streamed))
        self.kept_optimizer, self._kept_groups = _device_optimizer(self.param_groups, self.kept)
        self.packing = Packing(dev, *layout.pack(self.param_groups, options.subgroup_numel, set(self.kept)),
                               streamer=streamer, shard=shard)
        # device gradients waiting for their copies to the host, held to what the planner counts: one streamed block's
        # (memory.streamed_bytes), or the largest subgroup's the CPU updates (planner/search.py's _problem)
        if streamer is not None:
            in_flight = max((block.nbytes for block in streamer.blocks), default=None)
        else:
            grad_bytes = collections.Counter()
            for slot in self.packing.slots.values():
                grad_bytes[id(slot.subgroup)] += slot.numel * slot.param.element_size()
            in_flight = max((grad_bytes[id(sub)] for sub in self.packing.on_cpu()), default=None)
        self.grads = GradientPath(self.packing, self.loss_scale, self.delayed, in_flight)
        self.weights = WeightUploads(self.packing)
        self.sharded = ShardedSteps(self.packing, self.grads) if shard is not None else None
        if self.sharded is not None:  # every rank checks that all run the same settings, then takes its subgroups
            self.sharded.share_out(settings_of(options, self.param_groups, self.packing.slots.values(),
                                               self.packing.subgroups, swapper is not None))
        if streamer is not None:
            streamer.wraps = False  # the blocks change at step(): it prefetches the next pass after the update
        spills = grads_on == "nvme" and bool(self.packing.on_cpu())
        self.device_path, self.nvme = buffers.allocate(self.packing, options, self.weights, swapper, spills)
        self.spill = (GradientSpill(self.packing, self.grads, self.weights, self.nvme, options.grad_buffers,
                                    options.clips) if spills else None)
        if streamer is not None and self.nvme is None and shard is None:
            buffers.share_homes(self.packing)
        self.speculative = (SpeculativeUpdate(self.packing, self.loss_scale, self.grads, self.weights, options)
                            if options.speculative else None)
        self._grad_hooks = [slot.param.register_post_accumulate_grad_hook(self._on_grad)
                            for slot in self.packing.slots.values()]

    @property
    def subgroups(self) -> list[Subgroup]:
        return self.packing.subgroups

    @property
    def scale(self) -> float:
        return self.loss_scale.scale

    @property
    def skipped_steps(self) -> int:
        return self.loss_scale.skipped_steps

    @property
    def clean_steps(self) -> int:
        return self.loss_scale.clean_steps

    @property
    def speculation(self) -> dict[str, int]:
        """Subgroups whose speculated update was kept, redone (clipped, or a setting changed), or taken back."""
        return self.speculative.counts if self.speculative is not None else {"kept": 0, "redone": 0, "taken back": 0}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale (1.0 unless loss scaling is on)."""
        return loss * self.scale if self.scale != 1.0 else loss

    # backward -----------------------------------------------------------------------------------
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """backward's post-accumulate-grad hook: where each gradient goes as soon as it is ready."""
        slot = self.packing.slots[param]
        if "clipped" in self._this_step:  # the norm clip_grad_norm_() returned would not hold; its gradient stays put
            raise RuntimeError("a backward ran after clip_grad_norm_() and before step(): call clip_grad_norm_() after "
                               "the step's last backward (or zero_grad() to drop the step)")
        if self.sharded is not None:  # held until its subgroup is complete, then summed into the subgroup's owner
            return self.sharded.gather_grad(slot)
        if self.speculative is not None:  # before anything is queued for a gradient that comes too late
            self.speculative.refuse_a_late_backward(slot.subgroup)
        if param.grad is None:  # reached with no gradient (or another hook took it away): nothing to move
            return
        self.dev.adopt(param.grad, "grad")  # autograd made it on the device: counted there until it is freed
        # backward read these weights and wrote this gradient (on a GPU, as queued work that copies must wait for)
        self.dev.uses(f"backward of a {tuple(param.shape)} parameter", reads=[param.data], writes=[param.grad])
        if slot.subgroup.where != Where.CPU:  # updated on the device: the gradient stays there
            return self.device_path.take_grad(slot)
        if self.spill is not None:  # gradients on NVMe: the subgroup gets a pinned set to gather them in
            self.spill.hold(slot)
        self.grads.offload(slot)  # down the link into pinned staging (or into its bucket)
        if self.speculative is not None:  # the subgroup's update may start now, during backward
            self.speculative.arrived(slot.subgroup, slot)

    # step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError("OffloadAdam.step() after close(): the parameters no longer send it their gradients; "
                               "make a new optimizer (load_state_dict carries the state over)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        speculations, finite = self._gather()  # (already done when clip_grad_norm_() ran)
        clipped = self._this_step.get("clipped")
        self._this_step.clear()
        if not finite:  # overflow: skip this step everywhere,
            self.loss_scale.skipped()  # touch no state, lower the scale
            self.zero_grad()  # (and speculated weights are taken back)
            self.next_forward_waits()
            return loss
        coef, self.last_grad_norm = clipped or self.grads.clip_coefficient(self.options.max_grad_norm, speculations,
                                                                           self._device_grads())
        fresh = [slot for slot in self.packing.slots.values() if slot.has_grad]
        for slot in fresh:
            slot.has_grad = False
            slot.step += 1
        hyper = {id(g): {k: g[k] for k in HYPER} for g in self.param_groups}
        self.updates += 1
        self._update_on_device(coef, fresh, hyper)  # queued on device streams: runs beside the CPU update below
        if self.delayed and self.delayed.due(self.updates):
            # the thread gets everything it reads now: a scheduler may change the LR before it runs
            self.delayed.submit(self._update_all, coef, fresh, hyper, False)
        else:
            self._update_all(coef, fresh, hyper, True)
        self._update_kept(coef)
        if self.speculative is not None:
            self.speculative.end()
        self.loss_scale.clean()
        self.next_forward_waits()
        return loss

    def _gather(self) -> tuple[dict, bool]:
        """The step's gradients, every one in its subgroup's fp32 buffer (or measured on the drive): a delayed update's
        weights sent, a rank's share reduced, the speculative updates joined, partial buckets sent, the spill finished,
        every copy added in. Returns (speculations: what they or the spill measured, finite: no overflow). Once per
        step: clip_grad_norm_() gathers early, and step() then takes what it found."""
        if "gathered" in self._this_step:
            return self._this_step["gathered"]
        self._send_delayed_weights()  # a delayed update from the last step: its weights go up now
        if self.sharded is not None:
            self.sharded.reduce_the_rest(self.kept)
        speculations = self.speculative.join() if self.speculative is not None else {}  # begun during backward
        self.grads.send_partial_buckets()
        if self.spill is not None:  # every gradient to the drive; what the check and the norm need, per subgroup
            speculations = self.spill.finish()
        for slot in self.packing.slots.values():
            self.grads.add_pending(slot)
        self._this_step["gathered"] = speculations, self.grads.finite(speculations, self._device_grads())
        return self._this_step["gathered"]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the coming step() to the global L2 norm `max_norm`, as torch.nn.utils.clip_grad_norm_
        does, and return their norm before clipping (unscaled; a 0-dim fp32 tensor, inf or NaN when they overflowed:
        step() then skips). Call it after the step's last backward; `float("inf")` measures without clipping."""
        if norm_type != 2.0:
            raise ValueError(f"OffloadAdam clips by the L2 norm only, not norm_type={norm_type}: pass norm_type=2")
        if not max_norm >= 0:  # NaN too
            raise ValueError(f"max_norm must be >= 0 (float('inf') measures without clipping), got {max_norm}")
        if self.options.max_grad_norm is not None:
            raise ValueError(f"this OffloadAdam clips inside step() (max_grad_norm={self.options.max_grad_norm}): "
                             "clip in one place: build it without max_grad_norm, or have the loop not clip "
                             "(TrainingArguments(max_grad_norm=0), Lightning's gradient_clip_val=None)")
        if "clipped" in self._this_step:
            raise RuntimeError("clip_grad_norm_() ran already in this step: clip once between the last backward and "
                               "step() (its norm stands until then)")
        if self.spill is not None:
            raise ValueError("with grads_on='nvme' each gradient is measured as it goes to the drive, during backward: "
                             "clip with OffloadAdam(max_grad_norm=...) instead of clip_grad_norm_()")
        speculations, _ = self._gather()
        measured = {key: spec for key, spec in speculations.items() if spec.squares is not None}  # without clipping
        coef, norm = self.grads.clip_coefficient(max_norm, measured, self._device_grads())  # speculation skips it
        self._this_step["clipped"] = coef, norm
        return torch.tensor(norm, dtype=torch.float32)

    def _update_all(self, coef: float, fresh: list[Slot], hyper: dict, send: bool) -> list[Slot]:
        """CPU Adam over every subgroup; `send`: each subgroup's weights go up while the next one updates,
        else (delayed) they are rounded into the upload buffers for the next step() to send."""
        fresh_ids = {id(slot) for slot in fresh}
        if self.streamer is not None:
            self.streamer.quiesce()  # no copy up reads a home (an fp32 master) that Adam is about to write
        if not send and self.weights.uploaded is not None:
            self.weights.uploaded.synchronize()  # the previous weights must have left the upload buffers
        subgroups = self.packing.on_cpu()
        if self.nvme is not None or self.shard is not None:  # only those with a gradient
            subgroups = [sub for sub in subgroups if any(id(s) in fresh_ids for s in sub.slots)]
        if self.nvme is not None:  # each subgroup's state is read from disk just before and written after
            subgroups = self.nvme.visit(subgroups)
        gather = None
        if self.sharded is not None:  # the others' weights are received in order, between this rank's updates
            gather = self.sharded.gather()
            subgroups = self.sharded.interleave(subgroups, fresh_ids, gather)
        for sub in subgroups:
            slots = [s for s in sub.slots if id(s) in fresh_ids]
            if self.speculative is not None and self.speculative.commit(sub, coef, slots, hyper):
                sub.buffers["grad"].zero_()  # updated during backward, and its weights went up
                continue
            self._update(sub, coef, slots, hyper)
            if gather is not None:
                self.sharded.send_subgroup(sub, gather)
            elif send:
                if self.spill is not None:  # its new 16-bit weights are rounded in a set of the spill's
                    self.spill.lend_staging(sub)
                self.weights.upload(slots, whole=True)
            else:
                for slot in slots:
                    DelayedUpdate.stash(slot)
            sub.buffers["grad"].zero_()
        if gather is not None:
            gather.finish()
        if self.spill is not None:
            self.spill.end_step()
        if send:
            self.weights.sent()
        if self.streamer is not None:
            self.streamer.updated()
        return fresh

    def _update(self, sub: Subgroup, coef: float, slots: list[Slot], hyper: dict) -> None:
        """CPU Adam on the subgroup's `slots` (those that got a gradient), with `hyper`: group id -> lr etc."""
        buffers = sub.buffers
        if coef != 1.0:
            buffers["grad"].mul_(coef)
        with self.dev.trace.span("cpu", f"adam {sub.numel / 1e6:.2f}M", 28 * sub.numel):
            for run in layout.runs(sub, slots):
                first, last = run[0], run[-1]
                span = slice(first.offset, last.offset + last.numel)
                group = hyper[id(first.group)]
                adam_fused(buffers["master"][span], buffers["grad"][span], buffers["exp_avg"][span],
                           buffers["exp_avg_sq"][span], step=first.step, lr=group["lr"], beta1=group["betas"][0],
                           beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"])

    def _update_on_device(self, coef: float, fresh: list[Slot], hyper: dict) -> None:
        """Queue the device path of the hybrid update (engine/device_path.py); returns at once."""
        if self.device_path is None:
            return
        fresh_ids, work = {id(slot) for slot in fresh}, []
        for sub in self.subgroups:
            slots = [s for s in sub.slots if id(s) in fresh_ids] if sub.where != Where.CPU else []
            if slots:
                grads = [slot.param.grad for slot in slots]  # the launched update holds them until it has run
                for slot in slots:
                    slot.param.grad = None  # consumed, as offloaded gradients are: the next backward starts afresh
                work.append((sub, slots, grads, layout.runs(sub, slots)))
        self.device_path.queue(work, coef, hyper)

    def _update_kept(self, coef: float) -> None:
        """The small parameters kept on the device: torch's AdamW there, with the same coefficient."""
        if self.kept_optimizer is None:
            return
        for p in self.kept:
            if p.grad is not None and coef != 1.0:
                p.grad.mul_(coef)
        for inner, outer in zip(self.kept_optimizer.param_groups, self._kept_groups, strict=True):
            inner.update({k: outer[k] for k in HYPER})  # follow LR schedules
        with self.dev.trace.span("compute", "adam (kept on device)"):
            self.kept_optimizer.step()

    def _device_grads(self) -> list[torch.Tensor]:
        """The gradients that stay on the device: kept small parameters, and subgroups updated there."""
        params = [*self.kept, *(slot.param for slot in self.packing.slots.values() if slot.subgroup.where != Where.CPU)]
        return [p.grad for p in params if p.grad is not None]

    # the weights the next forward reads -----------------------------------------------------------
    def _send_delayed_weights(self) -> None:
        if self.delayed:
            self.weights.uploaded = self.delayed.send(self.dev, self.packing.h2d) or self.weights.uploaded

    def next_forward_waits(self) -> None:
        """The next forward reads the new weights, not the old: the compute stream waits for the last upload and
        the device path's writes."""
        self.weights.forward_waits()
        if self.device_path is not None and self.device_path.weights_written is not None:
            self.dev.compute_waits_for(self.device_path.weights_written)

    def flush(self) -> None:
        """Finish a delayed update and send its weights, so the model holds the latest ones (call it at the
        end of training, before evaluating or saving the model). Without delayed updates: nothing to do."""
        self._send_delayed_weights()
        self.next_forward_waits()

    def join_update(self) -> None:
        """The host waits for a delayed update still running behind step() (it owns the host state meanwhile)."""
        if self.delayed:
            self.delayed.join()

    def quiesce(self) -> None:
        """The host waits for all update work: the delayed or speculative update joined, the device path done."""
        self.join_update()
        if self.speculative is not None:
            self.speculative.join()
        if self.device_path is not None:
            self.device_path.wait()

    def close(self) -> None:
        """Wait for all update work, then take the gradient hooks off the parameters: the optimizer is done.

        The hooks hold the optimizer, and they live on autograd's side of the parameters, where Python's garbage
        collector cannot see the cycle parameter -> hook -> optimizer -> parameter: an optimizer never closed lives,
        with every host buffer it allocated, as long as its model does. Closing first waits, so that no copy still
        reads or writes the optimizer's memory once it is freed."""
        if self._closed:
            return
        self.quiesce()
        self.dev.synchronize()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        for worker in (self.delayed, self.speculative):  # their threads stop now, not when the collector frees them
            if worker is not None:
                worker.close()
        self._closed = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._this_step.clear()  # the step is dropped, its norm with it
        for p in [*self.kept, *self.packing.slots]:
            p.grad = None
        if self.speculative is not None and self.speculative.speculations:
            self.speculative.discard()  # zero_grad without step(): the speculated weights are taken back
        self.grads.send_partial_buckets()
        if self.spill is not None:  # this step's gradients, in the spill's sets and on the drive, are dropped
            self.spill.discard()
            for slot in self.packing.slots.values():
                slot.has_grad = False
            return
        if not any(slot.has_grad or slot.pending or (slot.bucket and slot.bucket.pending)
                   for slot in self.packing.slots.values()):
            return  # nothing arrived since step() consumed the gradients (and zeroed their buffers)
        for slot in self.packing.slots.values():
            self.grads.add_pending(slot)  # waits for the copies (and a delayed update) before the buffers change
            slot.has_grad = False
        for sub in self.packing.on_cpu():
            sub.buffers["grad"].zero_()

    # the state, read and restored (engine/state.py) -------------------------------------------------
    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 master copy of each trainable parameter, in the order the optimizer holds them."""
        return state.master_weights(self)

    def pinned_bytes(self) -> int:
        """The pinned host memory the optimizer holds: its subgroups' buffers, the NVMe tier's working sets and the
        gradients' sets, each storage counted once (device-held buffers left out)."""
        return state.pinned_bytes(self)

    def read_state(self, *names: str) -> dict:
        """NVMe tier: {id(subgroup): {name: a fresh host tensor read from the disk}} ({} without the tier)."""
        return state.read_state(self, *names)

    def state_dict(self) -> dict:
        """Hyper-parameters, loss-scale state, and per parameter (in param_groups order) its step count, fp32
        master weights and moments, as CPU tensors (see engine/state.py)."""
        return state.save(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()` of an OffloadAdam over the same model; refuses (changing nothing) a
        checkpoint of another model (see engine/state.py)."""
        state.load(self, state_dict)


def _device_optimizer(param_groups: list[dict], kept: list) -> tuple[torch.optim.AdamW | None, list[dict]]:
    """torch's AdamW over the parameters `kept` on the device, one group per outer group that has some."""
    kept = set(kept)
    outer = [g for g in param_groups if any(p in kept for p in g["params"])]
    if not outer:
        return None, []
    groups = [{"params": [p for p in g["params"] if p in kept]} for g in outer]
    return torch.optim.AdamW(groups, foreach=False), outer
