"""Weights that live off the device: each block's weights come up just before the block runs and go once it is done.

    streamer = ParamStreamer(model, dev, prefetch=2)                  # streams model.blocks; the rest is placed
    opt = OffloadAdam(model.parameters(), dev, streamer=streamer)     # new weights go to the home, not the device
    loss = model(x, y)[1]; loss.backward(); opt.step()                # every fetch and release happens in hooks

Where a streamed weight lives between uses (`home`), always in the model's dtype:
    host   pinned host memory, a tensor per parameter. With OffloadAdam on an fp32 model it is the optimizer's fp32
           master itself (no second copy); on a 16-bit model it is the master rounded, a second host copy kept on
           purpose: rounding at every fetch would put a CPU pass in front of every block, twice a step
    nvme   a key per parameter in chapter 6's `Swapper`: a fetch reads the block into a pinned bounce buffer, then
           copies it up; each optimizer step writes the rounded weights back

One block's life in a step (block i, prefetch depth k):
    forward pre-hook     it must be on the device: fetched now if it is not (the compute waits for its copies),
                         then the blocks of the next k uses are prefetched on a copy stream
    forward hook         released, unless one of the next k uses needs it (the last blocks turn into the backward)
    its output's grad    its backward is next: fetched again (and the next k prefetched)
    its input's grad     its backward is done: released
A release frees the storage but keeps the tensors (`dev.free_storage`), so the views of a weight autograd saved in
the forward see the weights again when they come back: the backward reads what the forward read. A recomputed
forward (chapter 7's recompute policies) runs inside the block's backward, when it is already on the device.

The order of uses is recorded on the first pass (forward and backward) and prefetching follows it from then on; a
pass that departs from it (an evaluation pass, a changed model) fetches on demand while the order is recorded
again, as DeepSpeed's trace-based prefetcher does. The first pass prefetches nothing.

`budget_bytes` bounds the streamed weights on the device at once: a block and its k prefetches must fit (checked
before anything moves); a prefetch that would not fit is left for later. Parameters outside the blocks
(embeddings, the tied head, the last norm) and any parameter a block shares stay on the device (`resident`).

What this is not: parameters sharded across GPUs (chapter 10), nor the choice of depth and budget (chapter 9).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .units import format_bytes

HOMES = ("host", "nvme")
_ALIGN = 4096  # bounce-buffer offsets: the swapper reads with O_DIRECT


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to stream: `model.blocks`, run one after another (the course's GPT, nanoGPT-style models)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
        return list(blocks)
    raise ValueError(f"cannot find the blocks of {type(model).__name__}: ParamStreamer streams `model.blocks`, "
                     "an nn.ModuleList of blocks called one after another; pass blocks=[...] to name them")


@dataclass(eq=False)
class _Block:
    index: int
    params: list[nn.Parameter]  # streamed: this block's alone
    names: list[str]
    nbytes: int
    state: str = "home"  # home | reading (nvme: into `bounce`) | device (its copies queued, `arrived` after them)
    arrived: object = None
    in_use: int = 0  # computing: a forward between its hooks, or a backward between its two gradient hooks
    backward: bool = False  # fetched for its backward (a recomputed forward inside it is not a new use)
    reads: list = field(default_factory=list)
    bounce: torch.Tensor | None = None


def _split(model: nn.Module, modules: list[nn.Module]) -> tuple[list[_Block], list[nn.Parameter]]:
    """Each block's own parameters, and those that stay on the device (outside every block, or shared)."""
    block_of: dict[int, set[int]] = {}
    for index, module in enumerate(modules):
        for sub in module.modules():
            block_of.setdefault(id(sub), set()).add(index)
    owners: dict[nn.Parameter, set[int]] = {}
    names: dict[nn.Parameter, str] = {}
    seen: set[int] = set()
    for prefix, root in [("", model), *((f"blocks.{i}.", m) for i, m in enumerate(modules))]:
        for module_name, sub in root.named_modules(prefix=prefix.rstrip(".")):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            for name, p in sub._parameters.items():
                if p is not None:
                    owners.setdefault(p, set()).update(block_of.get(id(sub), {-1}))
                    names.setdefault(p, f"{module_name}.{name}" if module_name else name)
    for p in owners:
        if p.numel() and not p.is_meta and not p.untyped_storage().nbytes():
            raise ValueError(f"parameter {names[p]} has no memory: it is streamed already (remove() the other "
                             "ParamStreamer first)")
    blocks = []
    for index in range(len(modules)):
        params = [p for p, where in owners.items() if where == {index}]
        blocks.append(_Block(index, params, [names[p] for p in params],
                             sum(p.numel() * p.element_size() for p in params)))
    resident = [p for p, where in owners.items() if len(where) > 1 or where == {-1}]
    return blocks, resident


def plan(model: nn.Module, prefetch: int, budget_bytes: int | None, device_free: int | None,
         blocks: Sequence[nn.Module] | None = None, placed=lambda p: False):
    """What streaming `model` needs, checked (ValueError naming the numbers; nothing changes): its blocks, the
    parameters that stay on the device, the budget (default: the largest window of a block and its `prefetch`
    next ones) and that window. `device_free`: the device's free bytes (None: unbounded); `placed(p)`: is p on
    the device already. Works on a model built on the meta device (sizes only)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (blocks fetched ahead; 0 fetches on demand), got {prefetch!r}")
    modules = list(blocks) if blocks is not None else find_blocks(model)
    if not modules:
        raise ValueError("blocks is empty: name at least one module to stream")
    streamed, resident = _split(model, modules)
    sizes = [block.nbytes for block in streamed]
    windows = [sum(sizes[i:i + prefetch + 1]) for i in range(len(sizes))]
    first = max(range(len(sizes)), key=windows.__getitem__)
    window = windows[first]
    if budget_bytes is None:
        budget_bytes = window
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if budget_bytes < window:
        last = min(first + prefetch, len(sizes) - 1)
        raise ValueError(f"budget_bytes={budget_bytes:,} ({format_bytes(budget_bytes)}) is smaller than a block and "
                         f"its prefetch: blocks {first}..{last} need {window:,} bytes ({format_bytes(window)}) at "
                         f"prefetch={prefetch}. Raise budget_bytes to at least {window:,}, or lower prefetch")
    stays = sum(p.numel() * p.element_size() for p in resident if not placed(p))
    if device_free is not None and stays + budget_bytes > device_free:
        raise ValueError(f"the device has {format_bytes(device_free)} free; the parameters that stay there need "
                         f"{format_bytes(stays)} and the streamed window {format_bytes(budget_bytes)}: lower "
                         "budget_bytes or prefetch, or use a device with more memory")
    return streamed, resident, budget_bytes, window


class _Mark(torch.autograd.Function):
    """Identity in the forward; calls `callback` when the gradient of its outputs arrives in the backward."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class ParamStreamer:
    """Stream the weights of `model`'s blocks (`blocks`, default `find_blocks(model)`) from `home` to `dev`,
    `prefetch` blocks ahead, holding at most `budget_bytes` of them on the device (default: what the largest
    block and its prefetches need). Places every other parameter on `dev`. Refuses bad input before anything
    moves."""

    def __init__(self, model: nn.Module, dev, *, prefetch: int = 1, budget_bytes: int | None = None,
                 home: str = "host", swapper=None, blocks: Sequence[nn.Module] | None = None):
        if home not in HOMES:
            raise ValueError(f"home must be one of {', '.join(map(repr, HOMES))}, got {home!r}")
        if (home == "nvme") != (swapper is not None):
            raise ValueError("home='nvme' needs swapper=Swapper(directory), and only it takes one")
        modules = list(blocks) if blocks is not None else find_blocks(model)
        self.blocks, self.resident, self.budget_bytes, self.window_bytes = plan(
            model, prefetch, budget_bytes, dev.ledger.free_bytes("device"), modules,
            placed=lambda p: dev.is_device(p))
        self.dev, self.prefetch, self.home_kind, self.swapper = dev, prefetch, home, swapper
        to_place = [p for p in self.resident if not dev.is_device(p)]
        # everything is checked: now the weights move
        self.h2d = dev.stream("stream weights h2d")
        self.device_bytes = self.peak_bytes = 0  # streamed weights on the device (counting reads in flight)
        self.fetches = self.reorders = 0
        self.order: list[tuple[bool, int]] | None = None  # recorded uses: (backward?, block index)
        self._pos, self._recording = 0, []
        self._home: dict[nn.Parameter, torch.Tensor] = {}
        self._bounces: list[torch.Tensor] = []
        self._writes: list = []  # nvme: (future, buffer) of weights being written back
        self._names = {id(p): name for block in self.blocks for p, name in zip(block.params, block.names, strict=True)}
        self._fill_homes()
        dev.place(to_place)
        self._hooks = [hook for block, module in zip(self.blocks, modules, strict=True)
                       for hook in self._register(block, module)]

    # homes ------------------------------------------------------------------------------------
    def _fill_homes(self) -> None:
        """Copy each streamed weight to its home, then free it on the device (a host tensor gets no memory)."""
        for block in self.blocks:
            for p, name in zip(block.params, block.names, strict=True):
                value = p.detach().cpu() if p.device.type != "cpu" else p.detach()
                home = self.dev.host_empty(tuple(p.shape), p.dtype)
                home.copy_(value)
                if self.swapper is not None:
                    self.swapper.write(self._key(name), home).result()
                else:
                    self._home[p] = home
                self.dev.free_storage(p)
        if self.swapper is not None:
            largest = max(self._layout(block)[1] for block in self.blocks)
            self._bounces = [self.dev.host_empty(largest, torch.uint8) for _ in range(self.prefetch + 2)]

    @staticmethod
    def _key(name: str) -> str:
        return f"weights/{name}"

    @staticmethod
    def _layout(block: _Block) -> tuple[list[int], int]:
        """nvme: each parameter's offset in a bounce buffer (O_DIRECT-aligned), and the buffer's size."""
        offsets, end = [], 0
        for p in block.params:
            offsets.append(end)
            end += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        return offsets, max(end, _ALIGN)

    # hooks ------------------------------------------------------------------------------------
    def _register(self, block: _Block, module: nn.Module) -> list:
        def before(_, args):
            if block.backward:
                return None  # a recomputed forward inside its backward: already here
            self._end_stale_backwards()
            self._use(block, backward=False)
            if not torch.is_grad_enabled():
                return None
            return self._mark(args, lambda: self._backward_done(block))  # its input's grad: its backward is done

        def after(_, args, output):
            if block.backward:
                return None
            block.in_use -= 1
            self._release_unless_next(block)
            if not torch.is_grad_enabled():
                return None
            return self._mark(output, lambda: self._use(block, backward=True))  # its output's grad: backward next

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    @staticmethod
    def _mark(value, callback):
        """`value` (a tensor or a tuple) with `callback` run when the gradient of its tensors arrives."""
        items = value if isinstance(value, tuple) else (value,)
        marked = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not marked:
            return None
        outputs = _Mark.apply(callback, *(items[i] for i in marked))
        items = list(items)
        for i, out in zip(marked, outputs, strict=True):
            items[i] = out
        return tuple(items) if isinstance(value, tuple) else items[0]

    def _backward_done(self, block: _Block) -> None:
        block.in_use -= 1
        block.backward = False
        self._release_unless_next(block)

    def _end_stale_backwards(self) -> None:
        """A forward starts while a block is still marked in its backward: that backward never told its end (its
        input needed no gradient), so it is over."""
        for block in self.blocks:
            if block.backward:
                self._backward_done(block)

    def remove(self) -> None:
        """Take the hooks away and put every streamed weight back on the device, as `dev.place` would (it must
        fit); the optimizer must not be used after this."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.quiesce()
        for block in self.blocks:
            self._start(block, demand=True, evict=False, budget=False)
            if block.state == "reading":
                self._land(block)
            self.dev.compute_waits_for(block.arrived)
            block.state = "resident"

    # uses: record the order, fetch, prefetch --------------------------------------------------
    def _use(self, block: _Block, backward: bool) -> None:
        self._observe((backward, block.index))
        block.in_use += 1
        block.backward = backward
        self._ensure(block)
        self._prefetch()

    def _observe(self, use: tuple[bool, int]) -> None:
        if self.order is not None:
            if self._pos == len(self.order):
                self._pos = 0  # a new pass
            if self.order[self._pos] == use:
                self._pos += 1
                return
            self.order, self._recording = None, []  # departed from the recorded order: record it again
            self.reorders += 1
        if self._recording and use == self._recording[0]:
            self.order, self._pos, self._recording = self._recording, 1, []  # a whole pass: the order to follow
            return
        self._recording.append(use)

    def upcoming(self) -> list[int]:
        """The blocks of the next `prefetch` uses, as the recorded order predicts ([] while recording)."""
        if self.order is None:
            return []
        n = len(self.order)
        return [self.order[(self._pos + j) % n][1] for j in range(min(self.prefetch, n))]

    def _ensure(self, block: _Block) -> None:
        if block.state == "home":
            self._start(block, demand=True)
        if block.state == "reading":
            self._land(block)
        self._compute_waits(block)

    def _compute_waits(self, block: _Block) -> None:
        self.dev.compute_waits_for(block.arrived)  # the block's compute reads the weights once they have landed

    def _prefetch(self) -> None:
        for index in self.upcoming():
            block = self.blocks[index]
            if block.state == "home" and not self._start(block, demand=False):
                return  # no room yet: a release will make some
            if block.state == "reading" and all(read.done() for read in block.reads):
                self._land(block)

    def _start(self, block: _Block, demand: bool, evict: bool = True, budget: bool = True) -> bool:
        """Reserve room and start bringing `block` up (host: its copies; nvme: its reads). A prefetch that does
        not fit returns False; a demand fetch makes room by letting prefetched blocks go."""
        if budget and self.device_bytes + block.nbytes > self.budget_bytes:
            if not demand:
                return False
            for other in self.blocks:
                if evict and other.state != "home" and not other.in_use and other is not block:
                    self._release(other)
                    if self.device_bytes + block.nbytes <= self.budget_bytes:
                        break
            else:
                raise RuntimeError(f"block {block.index} ({format_bytes(block.nbytes)}) does not fit the streaming "
                                   f"budget ({format_bytes(self.budget_bytes)}) beside the blocks in use: "
                                   f"{[b.index for b in self.blocks if b.in_use]}; raise budget_bytes")
        self.device_bytes += block.nbytes
        self.peak_bytes = max(self.peak_bytes, self.device_bytes)
        self.fetches += 1
        if self.swapper is None:
            self._land(block)
            return True
        if not self._bounces:
            raise RuntimeError("every bounce buffer is in use: more blocks in flight than prefetch + 2")
        block.bounce = self._bounces.pop()
        offsets, _ = self._layout(block)
        block.reads = [self.swapper.read(self._key(name), into=self._bounce_view(block, p, offset))
                       for p, name, offset in zip(block.params, block.names, offsets, strict=True)]
        block.state = "reading"
        return True

    @staticmethod
    def _bounce_view(block: _Block, p: nn.Parameter, offset: int) -> torch.Tensor:
        nbytes = p.numel() * p.element_size()
        return block.bounce[offset:offset + nbytes].view(p.dtype).view(p.shape)

    def _land(self, block: _Block) -> None:
        """Give the block's weights their memory back and queue their copies up on the copy stream."""
        if self.swapper is not None:
            for read in block.reads:
                read.result()  # raises the swapper's error, naming the key
            offsets, _ = self._layout(block)
            sources = [self._bounce_view(block, p, o) for p, o in zip(block.params, offsets, strict=True)]
            block.reads = []
        else:
            sources = [self._home[p] for p in block.params]
        for p, name in zip(block.params, block.names, strict=True):
            self.dev.restore_storage(p, f"streamed {name}")
        self.dev.stream_waits_for_compute(self.h2d)  # memory compute freed may be handed out again: after its reads
        for p, source in zip(block.params, sources, strict=True):
            self.dev.copy(p.data, source, self.h2d, name=f"h2d block {block.index}")
        block.arrived = self.dev.event()
        block.arrived.record(self.h2d)
        block.state = "device"

    # releases ---------------------------------------------------------------------------------
    def _release_unless_next(self, block: _Block) -> None:
        if not block.in_use and block.index not in self.upcoming():
            self._release(block)

    def _release(self, block: _Block) -> None:
        if block.state == "reading":
            self._land(block)  # its reads must finish before the bounce buffer is reused
        if block.state != "device":
            return
        self.dev.compute_waits_for(block.arrived)  # its copies are done before its memory is freed
        if block.bounce is not None:
            block.arrived.synchronize()  # the bounce buffer is read by the copies until they land
            self._bounces.append(block.bounce)
            block.bounce = None
        for p in block.params:
            self.dev.free_storage(p)
        self.device_bytes -= block.nbytes
        block.state = "home"

    # the optimizer's side -----------------------------------------------------------------------
    def streams(self, param: nn.Parameter) -> bool:
        return id(param) in self._names

    def host_value(self, param: nn.Parameter) -> torch.Tensor:
        """The weights of a streamed parameter as they are at home (nvme: read into a new host tensor)."""
        if self.swapper is None:
            return self._home[param]
        value = self.dev.host_empty(tuple(param.shape), param.dtype)
        self.swapper.read(self._key(self._names[id(param)]), into=value).result()
        return value

    def share_home(self, param: nn.Parameter, tensor: torch.Tensor) -> bool:
        """Let `tensor` (pinned, same shape and dtype: an fp32 master) be `param`'s home instead of a copy of it.
        Only with a host home; returns whether it was taken."""
        home = self._home.get(param)
        if home is None or tensor.dtype != home.dtype or tensor.shape != home.shape:
            return False
        self.quiesce()
        tensor.copy_(home)
        self._home[param] = tensor
        return True

    def quiesce(self) -> None:
        """Before the homes change: every copy up has landed, and the blocks on the device (now stale) are
        released. No block may be computing."""
        for block in self.blocks:
            if block.in_use:
                raise RuntimeError(f"block {block.index} is computing (a forward or backward has not finished): "
                                   "update the weights between steps")
            if block.state == "reading":
                self._land(block)
            if block.state == "device":
                block.arrived.synchronize()
                self._release(block)

    def set_weights(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Write new weights (any float dtype; rounded to the model's) home. Call `quiesce()` first."""
        if self.swapper is None:
            home = self._home[param]
            if home.data_ptr() != value.data_ptr():
                home.copy_(value.view(home.shape))
            return
        self._writes = [(f, b) for f, b in self._writes if not f.done()]
        while len(self._writes) >= 2:  # two writes in flight: the rounding of the next overlaps the disk
            self._writes.pop(0)[0].result()
        buffer = self.dev.host_empty(tuple(param.shape), param.dtype)
        buffer.copy_(value.view(param.shape))
        self._writes.append((self.swapper.write(self._key(self._names[id(param)]), buffer), buffer))

    def updated(self) -> None:
        """The update is over: check the writes home, and prefetch the next pass's first blocks."""
        for future, _ in self._writes:
            future.result()
        self._writes.clear()
        self._prefetch()
