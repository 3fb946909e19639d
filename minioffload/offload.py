"""OffloadAdam: AdamW with fp32 master weights and moments in pinned host memory, updated on the CPU.

    opt = OffloadAdam(model.parameters(), dev, lr=1e-3, subgroup_numel=1 << 20)
    loss.backward()          # each gradient is copied to the host on a copy stream as soon as it is ready
    opt.step()               # per subgroup: CPU Adam, then the new weights go back on another copy stream
    opt.zero_grad()

The flow of one step (every arrow a span in `dev.trace`):
  backward -> post-accumulate-grad hook -> D2H of that gradient into pinned staging (device gradient
  released) -> step(): wait for each subgroup's copies, add them into its fp32 gradient -> global norm
  for clipping -> CPU Adam (chapter 3) on the subgroup -> its weights (in the model's dtype) H2D on a copy
  stream while the CPU updates the next subgroup -> the next forward waits for the last copy, not earlier.

Parameters are packed into subgroups of about `subgroup_numel` elements: one flat pinned buffer each for
the fp32 master weights, exp_avg, exp_avg_sq and gradient, so the CPU Adam runs one call per subgroup.
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
(DPU): step() hands the CPU Adam to a background thread and returns, so the update overlaps the next
forward and backward; its weights are sent at the following step(). The price is staleness: the gradient
of iteration t is computed on the weights of update t-2, not t-1 (ZeRO-Offload starts DPU after a few
dozen synchronous steps, when gradients change slowly). The update thread owns the fp32 gradient, master
and moment buffers while it runs: every host read of them (accumulating a micro-batch, zero_grad with
gradients pending, state_dict, master_weights) waits for it first. Its weights leave from upload buffers
of their own, because the gradient staging is refilled by the next backward while they wait. Call
`flush()` at the end of training to send the last update's weights.

With `gpu_fraction` or `stride` (chapter 5, hybrid.py) some subgroups are updated on the device instead:
their gradients stay there, their state either lives there (`gpu_fraction`) or is copied in and out
around a device-side Adam (`stride`) while the CPU updates the other subgroups.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import hybrid
from .adam import adam_fused
from .device_path import DevicePath
from .gradnorm import sum_of_squares
from .nvme_tier import STATE, NvmeTier


@dataclass
class _Slot:
    """Where one parameter lives inside its subgroup's flat buffers."""

    param: torch.nn.Parameter
    group: dict
    subgroup: _Subgroup
    offset: int
    numel: int
    step: int = 0
    pending: list = field(default_factory=list)  # (event, staging view) of copies not yet added in
    has_grad: bool = False  # a gradient arrived since the last step

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset: self.offset + self.numel]


@dataclass
class _Subgroup:
    numel: int
    where: str = "cpu"  # "cpu": updated on the host; "resident": state and update on the device; "streamed":
    #                    state on the host, copied to the device, updated there, copied back
    slots: list[_Slot] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (numel,) pinned host tensor


class OffloadAdam(torch.optim.Optimizer):
    """AdamW whose state lives in pinned host memory and whose update runs on the CPU.

    `dev` is a minioffload device (sim or cuda) holding the model's parameters. `max_grad_norm` clips by
    the global norm (like `torch.nn.utils.clip_grad_norm_`) before the update; None turns clipping off.
    `loss_scale`: None, a fixed number, or "dynamic" (fp16). `min_offload_numel`: smaller parameters stay on
    the device. `delay_updates_after`: the one-step delayed update after that many steps. `gpu_fraction` or
    `stride`: the hybrid update of chapter 5 (see hybrid.py).
    """

    def __init__(self, params, dev, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, subgroup_numel: int = 1 << 22,
                 max_grad_norm: float | None = None, loss_scale: str | float | None = None,
                 growth_interval: int = 2000, min_offload_numel: int = 0, delay_updates_after: int | None = None,
                 gpu_fraction: float | None = None, stride: int | None = None, swapper=None, nvme_buffers: int = 3):
        if subgroup_numel < 1:
            raise ValueError(f"subgroup_numel must be at least 1, got {subgroup_numel}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or None to turn clipping off), got {max_grad_norm}")
        if not (loss_scale is None or loss_scale == "dynamic" or (isinstance(loss_scale, (int, float))
                                                                   and loss_scale > 0)):
            raise ValueError(f"loss_scale must be None, 'dynamic' or a positive number, got {loss_scale!r}")
        if delay_updates_after is not None:
            if isinstance(delay_updates_after, bool) or not isinstance(delay_updates_after, int) \
                    or delay_updates_after < 0:
                raise ValueError("delay_updates_after must be None (no delayed update) or the number of "
                                 f"synchronous steps before it starts (an int >= 0), got {delay_updates_after!r}")
            if min_offload_numel > 0:
                raise ValueError("delay_updates_after needs every parameter offloaded: the device-side AdamW of "
                                 "min_offload_numel would race with the next forward; set min_offload_numel=0")
        hybrid.check_split(gpu_fraction, stride)
        if delay_updates_after is not None and (gpu_fraction or stride):
            raise ValueError("delay_updates_after and a hybrid update (gpu_fraction, stride) do not combine: the "
                             "device-side update would race with the next forward; choose one")
        if swapper is not None and (delay_updates_after is not None or gpu_fraction or stride):
            raise ValueError("the NVMe tier (swapper=) does not combine with delayed or hybrid updates yet; "
                             "choose one")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not trainable:
            raise ValueError("OffloadAdam got no parameter that requires a gradient; pass model.parameters()")
        placements = {"device" if dev.is_device(p) else "host" for p in trainable}
        if placements != {"device"}:
            raise ValueError("every parameter must be on the device before OffloadAdam takes it: call "
                             "dev.adopt(p) for each (sim) or model.to('cuda') (cuda)")
        self.dev, self.subgroup_numel, self.max_grad_norm = dev, subgroup_numel, max_grad_norm
        self.d2h, self.h2d = dev.stream("offload d2h"), dev.stream("offload h2d")
        self.gpu_fraction, self.stride = gpu_fraction, stride
        self.swapper, self.nvme_buffers, self.nvme = swapper, nvme_buffers, None
        self.last_grad_norm: float | None = None  # before clipping, unscaled; None when clipping is off
        self.dynamic = loss_scale == "dynamic"
        self.scale = 2.0**16 if self.dynamic else float(loss_scale or 1.0)
        self.growth_interval, self.clean_steps, self.skipped_steps = growth_interval, 0, 0
        self._uploaded = None  # event after the last H2D: the next forward waits for it
        self.delay_updates_after, self.updates = delay_updates_after, 0  # updates: steps not skipped
        self._update_thread = ThreadPoolExecutor(1, "offload-update") if delay_updates_after is not None else None
        self._job: Future | None = None  # the delayed update in flight; its result: the slots it updated
        self._unsent: list[_Slot] = []  # slots whose new weights wait in the upload buffers
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        self.subgroups: list[_Subgroup] = []
        self.kept = list(dict.fromkeys(p for p in trainable if p.numel() < min_offload_numel))  # stay on device
        self._device_opt, self._kept_groups = self._device_optimizer()
        self._pack()
        for slot in self._slots.values():
            slot.param.register_post_accumulate_grad_hook(self._offload_grad)

    # layout -------------------------------------------------------------------------------------
    def _device_optimizer(self):
        """torch's AdamW over the parameters kept on the device, one group per outer group that has some."""
        kept = set(self.kept)
        outer = [g for g in self.param_groups if any(p in kept for p in g["params"])]
        if not outer:
            return None, []
        groups = [{"params": [p for p in g["params"] if p in kept]} for g in outer]
        return torch.optim.AdamW(groups, foreach=False), outer

    def _pack(self) -> None:
        current = None
        kept = set(self.kept)
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or p in self._slots or p in kept:
                    continue  # frozen, the same (tied) parameter listed twice, or small enough to stay
                if current is None or (current.numel and current.numel + p.numel() > self.subgroup_numel):
                    current = _Subgroup(0)
                    self.subgroups.append(current)
                slot = _Slot(p, group, current, current.numel, p.numel())
                current.slots.append(slot)
                current.numel += p.numel()
                self._slots[p] = slot
        resident, streamed = hybrid.device_subgroups(len(self.subgroups), self.gpu_fraction, self.stride)
        for index in resident:
            self.subgroups[index].where = "resident"
        for index in streamed:
            self.subgroups[index].where = "streamed"
        # first: a split that does not fit fails here, before anything moves
        self.device_path = DevicePath(self.dev, self.subgroups) if resident or streamed else None
        for sub in self.subgroups:
            if sub.where == "resident":
                for slot in sub.slots:
                    slot.view(sub.buffers["master"]).copy_(slot.param.detach().reshape(-1))
                continue
            if sub.where == "streamed":  # state on the host; gradients and the update on the device
                sub.buffers = {name: self.dev.host_empty(sub.numel) for name in STATE}
                sub.buffers["exp_avg"].zero_()
                sub.buffers["exp_avg_sq"].zero_()
                for slot in sub.slots:
                    slot.view(sub.buffers["master"]).copy_(slot.param.detach().reshape(-1).float().cpu())
                continue
            dtypes = {s.param.dtype for s in sub.slots}
            on_host = ("grad",) if self.swapper is not None else (*STATE, "grad")  # NVMe: the state goes to disk
            host = {name: self.dev.host_empty(sub.numel) for name in on_host}
            for name in on_host[1:]:
                host[name].zero_()  # the moments start at zero; the gradient accumulates from zero
            host["grad"].zero_()
            for dtype in dtypes:  # staging: gradients arrive here, and 16-bit weights leave from here
                host[f"staging {dtype}"] = self.dev.host_empty(sub.numel, dtype)
                if self.delay_updates_after is not None:  # ... except with delayed updates: weights wait here
                    host[f"upload {dtype}"] = self.dev.host_empty(sub.numel, dtype)
            sub.buffers = host
            if self.swapper is None:
                for slot in sub.slots:
                    slot.view(host["master"]).copy_(slot.param.detach().reshape(-1).float().cpu())
        if self.swapper is not None and self._on_cpu():
            self.nvme = NvmeTier(self.swapper, self.dev, self.h2d, self._on_cpu(), self.nvme_buffers)
            for sub in self._on_cpu():
                self.nvme.store(sub, lambda views, sub=sub: self._initial_state(sub, views))

    @staticmethod
    def _initial_state(sub: _Subgroup, views: dict) -> None:
        for slot in sub.slots:
            slot.view(views["master"]).copy_(slot.param.detach().reshape(-1).float().cpu())
        views["exp_avg"].zero_()
        views["exp_avg_sq"].zero_()

    def _staging(self, slot: _Slot, kind: str = "staging") -> torch.Tensor:
        """Pinned host memory for this parameter in the model's dtype: `staging` for its gradient (and its
        weights, without delayed updates), `upload` for the weights a delayed update left to send."""
        return slot.view(slot.subgroup.buffers[f"{kind} {slot.param.dtype}"]).view(slot.param.shape)

    # backward: gradients leave the device as soon as they are ready ----------------------------
    def _offload_grad(self, param: torch.nn.Parameter) -> None:
        slot = self._slots[param]
        if slot.subgroup.where != "cpu":  # updated on the device: the gradient stays (torch accumulates into it)
            if not self.dev.is_device(param.grad):
                self.dev.adopt(param.grad, "grad")
            slot.has_grad = True
            return
        self._add_pending(slot)  # a previous micro-batch's copy must be added in before its staging is reused
        grad, param.grad = param.grad.contiguous(), None  # the device gradient goes once its copy is done
        self.dev.adopt(grad, "grad")  # autograd made it on the device: count it there until it is freed
        staging = self._staging(slot)
        self.dev.stream_waits_for_compute(self.d2h)
        self.dev.copy(staging, grad, self.d2h, name="d2h grad")
        if grad.is_cuda:
            grad.record_stream(self.d2h.stream)  # keep the allocator from reusing it during the copy
        done = self.dev.event()
        done.record(self.d2h)
        slot.pending.append((done, staging))
        slot.has_grad = True

    def _add_pending(self, slot: _Slot) -> None:
        if slot.pending:
            self._wait_for_update()  # the delayed update may still be reading the gradient buffer
        for done, staging in slot.pending:
            done.synchronize()  # never read an in-flight copy
            slot.view(slot.subgroup.buffers["grad"]).add_(staging.reshape(-1).float())
        slot.pending.clear()

    # step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._send_delayed_weights()  # a delayed update from the last step: its weights go up now
        for slot in self._slots.values():
            self._add_pending(slot)
        if not self._grads_finite():  # overflow: skip this step everywhere, touch no state, lower the scale
            self.skipped_steps += 1
            self.scale *= 0.5
            self.clean_steps = 0
            self.zero_grad()
            self._next_forward_waits()
            return loss
        coef = self._clip_coefficient()
        fresh = [slot for slot in self._slots.values() if slot.has_grad]
        for slot in fresh:
            slot.has_grad = False
        hyper = {id(g): {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in self.param_groups}
        self.updates += 1
        self._update_on_device(coef, fresh, hyper)  # queued on device streams: runs beside the CPU update below
        if self.delay_updates_after is not None and self.updates > self.delay_updates_after:
            # the thread gets everything it reads now: a scheduler may change the LR before it runs
            self._job = self._update_thread.submit(self._update_all, coef, fresh, hyper, False)
        else:
            self._update_all(coef, fresh, hyper, True)
        self._update_kept(coef)
        if self.dynamic:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2.0
        self._next_forward_waits()
        return loss

    def _update_all(self, coef: float, fresh: list[_Slot], hyper: dict, send: bool) -> list[_Slot]:
        """CPU Adam over every subgroup; `send`: each subgroup's weights go up while the next one updates,
        else (delayed) they are rounded into the upload buffers for the next step() to send."""
        fresh_ids = {id(slot) for slot in fresh}
        if not send and self._uploaded is not None:
            self._uploaded.synchronize()  # the previous weights must have left the upload buffers
        subgroups = self._on_cpu()
        if self.nvme is not None:  # each subgroup's state is read from disk just before and written after
            subgroups = self.nvme.visit([sub for sub in subgroups if any(id(s) in fresh_ids for s in sub.slots)])
        for sub in subgroups:
            slots = [s for s in sub.slots if id(s) in fresh_ids]
            self._update(sub, coef, slots, hyper)
            if send:
                self._upload(slots)
            else:
                for slot in slots:
                    self._staging(slot, "upload").copy_(self._master(slot))
            sub.buffers["grad"].zero_()
        if send:
            self._uploaded = self.dev.event()
            self._uploaded.record(self.h2d)
        return fresh

    def _update_on_device(self, coef: float, fresh: list[_Slot], hyper: dict) -> None:
        """Queue the device path of the hybrid update (device_path.py); returns at once."""
        if self.device_path is None:
            return
        fresh_ids, work = {id(slot) for slot in fresh}, []
        for sub in self.subgroups:
            slots = [s for s in sub.slots if id(s) in fresh_ids] if sub.where != "cpu" else []
            if slots:
                grads = [slot.param.grad for slot in slots]  # the launched update holds them until it has run
                for slot in slots:
                    slot.param.grad = None  # consumed, as offloaded gradients are: the next backward starts afresh
                work.append((sub, slots, grads, self._runs(sub, slots)))
        self.device_path.queue(work, coef, hyper)

    def _wait_for_device(self) -> None:
        if self.device_path is not None:
            self.device_path.wait()

    def _wait_for_update(self) -> None:
        """Join the delayed update, if one runs (re-raising its error); its weights join the unsent."""
        if self._job is not None:
            job, self._job = self._job, None
            self._unsent += job.result()

    def _send_delayed_weights(self) -> None:
        self._wait_for_update()
        if self._unsent:
            self.dev.stream_waits_for_compute(self.h2d)  # backward may still read the weights these overwrite
            for slot in self._unsent:
                self.dev.copy(slot.param.data, self._staging(slot, "upload"), self.h2d, name="h2d weights")
            self._unsent = []
            self._uploaded = self.dev.event()
            self._uploaded.record(self.h2d)

    def _next_forward_waits(self) -> None:
        for event in [self._uploaded, self.device_path and self.device_path.weights_written]:
            if event is not None:
                self.dev.compute_waits_for(event)  # the next forward reads the new weights, not the old

    def flush(self) -> None:
        """Finish a delayed update and send its weights, so the model holds the latest ones (call it at the
        end of training, before evaluating or saving the model). Without delayed updates: nothing to do."""
        self._send_delayed_weights()
        self._next_forward_waits()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale (1.0 unless loss scaling is on)."""
        return loss * self.scale if self.scale != 1.0 else loss

    def _on_cpu(self) -> list[_Subgroup]:
        return [sub for sub in self.subgroups if sub.where == "cpu"]

    def _device_grads(self) -> list[torch.Tensor]:
        """The gradients that stay on the device: kept small parameters, and subgroups updated there."""
        params = [*self.kept, *(slot.param for slot in self._slots.values() if slot.subgroup.where != "cpu")]
        return [p.grad for p in params if p.grad is not None]

    def _grads_finite(self) -> bool:
        """One flag from every subgroup: is any gradient inf or NaN? (Only checked with loss scaling on.)"""
        if self.scale == 1.0 and not self.dynamic:
            return True
        return all(bool(torch.isfinite(sub.buffers["grad"]).all()) for sub in self._on_cpu()) and all(
            bool(torch.isfinite(grad).all()) for grad in self._device_grads())

    def _clip_coefficient(self) -> float:
        """What multiplies every gradient before the update: 1/scale, times the clip factor computed from the
        global L2 norm (per-subgroup partial sums, one combine) as clip_grad_norm_ does."""
        if self.max_grad_norm is None:  # no clipping: skip a pass over every gradient
            self.last_grad_norm = None
            return 1.0 / self.scale
        squares = sum(sum_of_squares(sub.buffers["grad"]) for sub in self._on_cpu())  # one pass, no temporaries
        squares += sum(float(grad.double().square().sum()) for grad in self._device_grads())
        self.last_grad_norm = math.sqrt(squares) / self.scale
        return min(1.0, self.max_grad_norm / (self.last_grad_norm + 1e-6)) / self.scale

    def _update(self, sub: _Subgroup, coef: float, slots: list[_Slot], hyper: dict) -> None:
        """CPU Adam on the subgroup's `slots` (those that got a gradient), with `hyper`: group id -> lr etc."""
        buffers = sub.buffers
        if coef != 1.0:
            buffers["grad"].mul_(coef)
        runs = self._runs(sub, slots)
        with self.dev.trace.span("cpu", f"adam {sub.numel / 1e6:.2f}M", 28 * sub.numel):
            for run in runs:
                first, last = run[0], run[-1]
                span = slice(first.offset, last.offset + last.numel)
                group = hyper[id(first.group)]
                adam_fused(buffers["master"][span], buffers["grad"][span], buffers["exp_avg"][span],
                           buffers["exp_avg_sq"][span], step=first.step, lr=group["lr"], beta1=group["betas"][0],
                           beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"])

    @staticmethod
    def _runs(sub: _Subgroup, slots: list[_Slot]) -> list[list[_Slot]]:
        """Count a step for each slot; group them into runs that one Adam call can update: the whole
        subgroup when every parameter has a gradient, the same step count and group; else one per parameter."""
        for s in slots:
            s.step += 1
        if len(slots) == len(sub.slots) and len({(s.step, id(s.group)) for s in slots}) == 1:
            return [sub.slots]
        return [[s] for s in slots]

    def _update_kept(self, coef: float) -> None:
        """The small parameters kept on the device: torch's AdamW there, with the same coefficient."""
        if self._device_opt is None:
            return
        for p in self.kept:
            if p.grad is not None and coef != 1.0:
                p.grad.mul_(coef)
        for inner, outer in zip(self._device_opt.param_groups, self._kept_groups, strict=True):
            inner.update({k: outer[k] for k in ("lr", "betas", "eps", "weight_decay")})  # follow LR schedules
        with self.dev.trace.span("compute", "adam (kept on device)"):
            self._device_opt.step()

    def _master(self, slot: _Slot) -> torch.Tensor:
        return slot.view(slot.subgroup.buffers["master"]).view(slot.param.shape)

    def _upload(self, slots: list[_Slot]) -> None:
        if slots:
            self.dev.stream_waits_for_compute(self.h2d)  # never overwrite weights that queued compute still reads
        for slot in slots:
            master = self._master(slot)
            if slot.param.dtype == torch.float32:
                source = master
            else:
                source = self._staging(slot)
                source.copy_(master)  # round to the model's dtype (nearest even), on the CPU
            self.dev.copy(slot.param.data, source, self.h2d, name="h2d weights")

    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 master copy of each trainable parameter, in the order the optimizer holds them."""
        self._wait_for_update()
        self._wait_for_device()
        on_disk = self._read_state("master")  # NVMe tier: copies read from the disk
        return [slot.view(on_disk[id(slot.subgroup)]["master"]).view(slot.param.shape) if id(slot.subgroup) in on_disk
                else self._master(slot) for slot in self._slots.values()]

    def _read_state(self, *names: str) -> dict:
        """NVMe tier: {id(subgroup): {name: a fresh host tensor read from the disk}} ({} without the tier)."""
        if self.nvme is None:
            return {}
        self.nvme.drain()
        out = {}
        for sub in self._on_cpu():
            out[id(sub)] = {name: self.dev.host_empty(sub.numel) for name in names}
            for name in names:
                self.swapper.read(self.nvme.key(sub, name), into=out[id(sub)][name]).result()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in [*self.kept, *self._slots]:
            p.grad = None
        if not any(slot.has_grad or slot.pending for slot in self._slots.values()):
            return  # nothing arrived since step() consumed the gradients (and zeroed their buffers)
        for slot in self._slots.values():
            self._add_pending(slot)  # waits for the copies (and a delayed update) before the buffers change
            slot.has_grad = False
        for sub in self._on_cpu():
            sub.buffers["grad"].zero_()

    # checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Hyper-parameters, loss-scale state, and per parameter (in param_groups order) its step count,
        fp32 master weights and moments, as CPU tensors. With a delayed update in flight it waits for it;
        the weights it has not sent yet are listed (`unsent`), so that a checkpoint loaded together with
        the model's own state_dict (whose weights are one update behind) continues bit for bit."""
        self._wait_for_update()
        self._wait_for_device()
        unsent = {id(slot) for slot in self._unsent}
        on_disk = self._read_state(*STATE)
        state = {}
        for index, slot in enumerate(self._slots.values()):
            buffers = on_disk.get(id(slot.subgroup), slot.subgroup.buffers)
            state[index] = {"step": slot.step, "shape": tuple(slot.param.shape),
                            **{name: slot.view(buffers[name]).to("cpu", copy=True) for name in STATE}}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups,
                "loss_scale": {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped_steps},
                "updates": self.updates,
                "unsent": [i for i, slot in enumerate(self._slots.values()) if id(slot) in unsent],
                "kept_shapes": [tuple(p.shape) for p in self.kept],
                "kept": None if self._device_opt is None else self._device_opt.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()` of an OffloadAdam over the same model; refuses (changing nothing) a
        checkpoint of another model. The model's weights are set to the masters, rounded to their dtype,
        except those a delayed update had not sent when the checkpoint was taken: with delayed updates on,
        they are sent at the next step(), as they would have been (load the model's state_dict as well)."""
        self._wait_for_update()
        self._wait_for_device()
        slots = list(self._slots.values())
        saved = state_dict.get("state", {})
        if len(saved) != len(slots) or len(state_dict.get("param_groups", [])) != len(self.param_groups):
            raise ValueError(f"checkpoint holds {len(saved)} parameters in {len(state_dict.get('param_groups', []))} "
                             f"groups; this optimizer has {len(slots)} in {len(self.param_groups)}: "
                             "is it from another model?")
        for index, slot in enumerate(slots):
            if tuple(saved[index]["shape"]) != tuple(slot.param.shape):
                raise ValueError(f"checkpoint parameter {index} has shape {tuple(saved[index]['shape'])}, this "
                                 f"model's has {tuple(slot.param.shape)}: is it from another model?")
        kept_shapes = [tuple(shape) for shape in state_dict.get("kept_shapes", [])]
        if kept_shapes != [tuple(p.shape) for p in self.kept]:
            raise ValueError(f"checkpoint keeps {len(kept_shapes)} small parameters on the device, this optimizer "
                             f"{len(self.kept)} (or their shapes differ): same model and min_offload_numel?")
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved_group)
        positions = {id(slot): index for index, slot in enumerate(slots)}
        for index, slot in enumerate(slots):
            slot.step = saved[index]["step"]
            if self.nvme is None or slot.subgroup.where != "cpu":
                for name in STATE:
                    slot.view(slot.subgroup.buffers[name]).copy_(saved[index][name])
        if self.nvme is not None:  # NVMe tier: each subgroup's state goes to the disk and its weights up
            for sub in self.nvme.visit(self._on_cpu()):
                for slot in sub.slots:
                    for name in STATE:
                        slot.view(sub.buffers[name]).copy_(saved[positions[id(slot)]][name])
                self._upload(sub.slots)
        if self._device_opt is not None:
            self._device_opt.load_state_dict(state_dict["kept"])
        scale = state_dict["loss_scale"]
        self.scale, self.clean_steps, self.skipped_steps = scale["scale"], scale["clean_steps"], scale["skipped"]
        self.updates = state_dict.get("updates", 0)
        unsent = set(state_dict.get("unsent", [])) if self.delay_updates_after is not None else set()
        self._unsent = [slot for index, slot in enumerate(slots) if index in unsent]
        if self._unsent and self._uploaded is not None:
            self._uploaded.synchronize()  # an earlier upload may still read the upload buffers
        for slot in self._unsent:
            self._staging(slot, "upload").copy_(self._master(slot))
        if self.nvme is None:
            self._upload([slot for index, slot in enumerate(slots)
                          if index not in unsent and slot.subgroup.where == "cpu"])
        for slot in slots:
            if slot.subgroup.where != "cpu":  # updated on the device: its weights are written directly
                slot.param.data.copy_(self._master(slot))
        self._uploaded = self.dev.event()
        self._uploaded.record(self.h2d)
        self._next_forward_waits()
