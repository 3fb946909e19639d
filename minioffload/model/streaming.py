"""Weights that live off the device: each block's weights come up just before the block runs and go once it is done.

    streamer = ParamStreamer(model, dev, prefetch=2)                  # streams its blocks; the rest is placed
    opt = OffloadAdam(model.parameters(), dev, streamer=streamer)     # new weights go to the home, not the device
    loss = model(x, y)[1]; loss.backward(); opt.step()                # every fetch and release happens in hooks

Where a streamed weight lives between uses (`home`), always in the model's dtype:
    host   pinned host memory, one tensor per block. With OffloadAdam on an fp32 model it is the optimizer's fp32
           master itself (no second copy: the block's copy is made from the master's runs); on a 16-bit model it is
           the master rounded, a second host copy kept on purpose: rounding at every fetch would put a CPU pass in
           front of every block, twice a step (bench/streaming.py measures it)
    nvme   a key per block in chapter 6's `Swapper`: a fetch reads the block into a pinned bounce buffer, then copies
           it up; each optimizer step writes the rounded weights back

One block's life in a step (block i, prefetch depth k):
    forward pre-hook     it must be on the device: fetched now if it is not (the compute waits for its copies),
                         then the blocks of the next k uses are prefetched on a copy stream
    forward hook         released, unless one of the next k uses needs it (the last blocks turn into the backward)
    its output's grad    its backward is next: fetched again (and the next k prefetched)
    its input's grad     its backward is done: released
A block's parameters are views of one device storage, so it comes up in one allocation and one copy per home
piece, and goes in one free. A release frees that storage but keeps the tensors (`dev.free_storage`), so the views
of a weight autograd saved in the forward see the weights again when they come back: the backward reads what the
forward read. A recomputed
forward (chapter 7's recompute policies) runs inside the block's backward, when it is already on the device.

The order of uses is recorded on the first pass (forward and backward) and prefetching follows it from then on; a
pass that departs from it (an evaluation pass, a changed model) fetches on demand while the order is recorded
again, as DeepSpeed's trace-based prefetcher does. The first pass prefetches nothing.

A released weight has no memory on the device (its storage is empty), so reading it directly is not possible:
`model.state_dict()` (and so `torch.save`, DCP and `minioffload.checkpoint`) gives every streamed weight's value at
home instead, as a host tensor, and `model.load_state_dict()` writes them home; `streamer.weights()` gives them by
name.

`budget_bytes` bounds the streamed weights on the device at once: a block and its k prefetches must fit (checked
before anything moves); a prefetch that would not fit is left for later. The blocks are the model's stack as
`find_blocks` finds it (the course GPT's `blocks`; Hugging Face's `transformer.h`, `model.layers`, `encoder.layer`) or
the modules given as `blocks=`. Parameters outside the blocks
(embeddings, the tied head, the last norm) and any parameter a block shares stay on the device (`resident`).

What this is not: parameters sharded across GPUs (chapter 10), nor the choice of depth and budget (chapter 9).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import nn

from ..units import format_bytes
from .streamed_blocks import _Block, find_blocks, plan
from .streamed_state import state_dict_hooks

__all__ = ["HOMES", "ParamStreamer", "find_blocks", "plan"]

HOMES = ("host", "nvme")
WRITE_BUFFERS = 2  # nvme: pinned buffers new weights are written home from (one filling while one is written)


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
        # prefetch across the end of a pass into the next; off when an optimizer changes the weights between
        # passes (OffloadAdam turns it off and has the next pass's first blocks prefetched after its update)
        self.wraps = True
        self._pos, self._recording = 0, []
        self._where = {id(p): (block, i) for block in self.blocks for i, p in enumerate(block.params)}
        self._bounces: list[torch.Tensor] = []  # nvme: free pinned buffers a read lands in before its copy up
        self._landing: deque = deque()  # nvme: (event after the copy up, its bounce buffer), oldest first
        self._writing: dict[int, tuple] = {}  # nvme: block index -> (its buffer, its new weights), being assembled
        self._written: dict[int, set[int]] = {}  # nvme: block index -> which of its parameters are in
        self._writes: list = []  # nvme: (future, buffer) of blocks being written home, oldest first
        self._spare_writes: list[torch.Tensor] = []  # nvme: pinned buffers no write reads, for the next block's
        self._write_buffers = 0  # nvme: how many were made
        for block in self.blocks:
            self._make_home(block)
        if self.swapper is not None:
            # one per block the budget can hold at once (each block coming up holds one until its copy has landed),
            # so a read never waits for a buffer while a copy up is still running
            sizes = [block.nbytes for block in self.blocks if block.params]
            count = min(len(sizes), max(1, self.budget_bytes // min(sizes)))
            self._bounces = [self.dev.host_empty(max(sizes), torch.uint8) for _ in range(count)]
        dev.place(to_place)
        self._hooks = [hook for block, module in zip(self.blocks, modules, strict=True)
                       for hook in [*self._register(block, module), *state_dict_hooks(self, block, module)]]

    # homes ------------------------------------------------------------------------------------
    def _make_home(self, block: _Block) -> None:
        """Copy the block's weights into one pinned host tensor (or the swapper), and make every parameter a view
        of one device storage, freed: from now on the block comes up in one copy and goes in one free."""
        if not block.params:
            return
        home = self.dev.host_empty(block.numel, block.dtype)
        for p, offset in zip(block.params, block.offsets, strict=True):
            home[offset:offset + p.numel()].copy_(p.detach().reshape(-1).cpu())
        flat = self.dev.empty(block.numel, block.dtype, name=f"block {block.index}")  # a moment, to make views
        for p, offset in zip(block.params, block.offsets, strict=True):
            self.dev.free_storage(p)  # its own memory goes (from the ledger too, if it was placed)
            p.data = flat[offset:offset + p.numel()].view(p.shape)
        self.dev.free_storage(flat)
        block.flat = flat
        if self.swapper is not None:
            self.swapper.write(self._key(block), home).result()
        else:
            block.segments = [(0, home)]

    @staticmethod
    def _key(block: _Block) -> str:
        return f"weights/block{block.index}"

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
            if block.params:
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
        ahead = min(self.prefetch, n if self.wraps else n - self._pos)
        return [self.order[(self._pos + j) % n][1] for j in range(ahead)]

    def _ensure(self, block: _Block) -> None:
        if block.state == "home":
            self._start(block, demand=True)
        if block.state == "reading":
            self._land(block)
        self._compute_waits(block)
        if block.params:
            self.dev.uses(f"block {block.index}'s {'backward' if block.backward else 'forward'}", reads=[block.flat])

    def _compute_waits(self, block: _Block) -> None:
        if block.params:
            self.dev.compute_waits_for(block.arrived)  # the block's compute reads the weights once they have landed

    def _prefetch(self) -> None:
        for index in self.upcoming():
            block = self.blocks[index]
            if block.state == "home" and not self._start(block, demand=False):
                return  # no room yet: a release will make some
            if block.state == "reading" and block.read.done():
                self._land(block)

    def _start(self, block: _Block, demand: bool, evict: bool = True, budget: bool = True) -> bool:
        """Reserve room and start bringing `block` up (host: its copy; nvme: its read). A prefetch that does not
        fit returns False; a demand fetch makes room by letting prefetched blocks go."""
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
        if self.swapper is None or not block.params:
            self._land(block)
            return True
        block.bounce = self._take_bounce()
        block.read = self.swapper.read(self._key(block), into=self._in_bounce(block))
        block.state = "reading"
        return True

    def _take_bounce(self) -> torch.Tensor:
        """A free bounce buffer: those whose copy up has landed come back first (asked, not waited for); only when
        none is free does the host wait, for the oldest copy."""
        while self._landing and (not self._bounces or self._landing[0][0].query()):
            landed, bounce = self._landing.popleft()
            landed.synchronize()  # at once when query() said so
            self._bounces.append(bounce)
        if not self._bounces:
            raise RuntimeError("every bounce buffer holds a block still being read: more blocks in flight than the "
                               "streaming budget holds")
        return self._bounces.pop()

    @staticmethod
    def _in_bounce(block: _Block) -> torch.Tensor:
        return block.bounce[:block.nbytes].view(block.dtype)

    def _land(self, block: _Block) -> None:
        """Give the block its device memory back and queue its copy up on the copy stream."""
        block.state = "device"
        if not block.params:
            return
        if block.read is not None:
            block.read.result()  # raises the swapper's error, naming the key
            block.read = None
            segments = [(0, self._in_bounce(block))]
        else:
            segments = block.segments
        self.dev.restore_storage(block.flat, f"streamed block {block.index}")
        self.dev.stream_waits_for_compute(self.h2d)  # memory compute freed may be handed out again: after its reads
        for offset, host in segments:
            self.dev.copy(block.flat[offset:offset + host.numel()], host, self.h2d, name=f"h2d block {block.index}")
        block.arrived = self.dev.event()
        block.arrived.record(self.h2d)
        if block.bounce is not None:  # free again once the copy up has read it
            self._landing.append((block.arrived, block.bounce))
            block.bounce = None

    # releases ---------------------------------------------------------------------------------
    def _release_unless_next(self, block: _Block) -> None:
        if not block.in_use and block.index not in self.upcoming():
            self._release(block)

    def _release(self, block: _Block) -> None:
        if block.state == "reading":
            self._land(block)  # its read must finish before the bounce buffer is reused
        if block.state != "device":
            return
        block.state = "home"
        self.device_bytes -= block.nbytes
        if not block.params:
            return
        self.dev.compute_waits_for(block.arrived)  # its copies are done before its memory is freed
        self.dev.free_storage(block.flat)

    # the optimizer's side -----------------------------------------------------------------------
    def streams(self, param: nn.Parameter) -> bool:
        return id(param) in self._where

    def host_value(self, param: nn.Parameter) -> torch.Tensor:
        """The weights of a streamed parameter as they are at home (nvme: read into a new host tensor)."""
        block, i = self._where[id(param)]
        if self.swapper is None:
            return self._host_view(block, i)
        for future, _ in self._writes:  # a write home still in flight holds the newest weights
            future.result()
        value = self.dev.host_empty(block.numel, block.dtype)
        self.swapper.read(self._key(block), into=value).result()
        return value[block.offsets[i]:block.offsets[i] + param.numel()].view(param.shape)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every streamed weight as it is at home, by its name in the model (host tensors; nvme: read now)."""
        return {block.names[i]: self.host_value(p) for block in self.blocks for i, p in enumerate(block.params)}

    def _host_view(self, block: _Block, i: int) -> torch.Tensor:
        """Parameter i of `block` in the host segment that holds it."""
        start, p = block.offsets[i], block.params[i]
        for offset, host in block.segments:
            if offset <= start < offset + host.numel():
                return host[start - offset:start - offset + p.numel()].view(p.shape)
        raise AssertionError(f"no home holds {block.names[i]}")

    def share_home(self, param: nn.Parameter, tensor: torch.Tensor) -> bool:
        """Let `tensor` (pinned, contiguous, same shape and dtype: an fp32 master) be `param`'s home instead of its
        copy in the block's home. Only with a host home; returns whether it was taken. A block whose every
        parameter is shared lets its own copy go."""
        block, i = self._where[id(param)]
        if self.swapper is not None or tensor.dtype != block.dtype or tensor.shape != param.shape:
            return False
        self.quiesce()
        tensor.copy_(self._host_view(block, i))
        start, end = block.offsets[i], block.offsets[i] + param.numel()
        pieces = []
        for offset, host in block.segments:  # cut [start, end) out of the segments, then put the tensor there
            if offset < start:
                pieces.append((offset, host[:min(host.numel(), start - offset)]))
            if offset + host.numel() > end:
                cut = max(0, end - offset)
                pieces.append((offset + cut, host[cut:]))
        block.segments = _merged([(o, h) for o, h in pieces if h.numel()] + [(start, tensor.reshape(-1))])
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
            if block.state == "device" and block.params:
                block.arrived.synchronize()
            self._release(block)

    def set_weights(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Write new weights (any float dtype: rounded to the model's) home. Call `quiesce()` first; with an nvme
        home, `updated()` after the last one."""
        block, i = self._where[id(param)]
        if self.swapper is None:
            home = self._host_view(block, i)
            if home.data_ptr() != value.data_ptr():
                home.copy_(value.view(home.shape))
            return
        if block.index not in self._writing:
            raw = self._write_buffer()
            self._writing[block.index] = (raw, raw[:block.nbytes].view(block.dtype))
            self._written[block.index] = set()
        start = block.offsets[i]
        self._writing[block.index][1][start:start + param.numel()].copy_(value.reshape(-1))
        self._written[block.index].add(i)
        if len(self._written[block.index]) == len(block.params):
            self._write_home(block)

    def _write_buffer(self) -> torch.Tensor:
        """A pinned buffer (bytes, the largest block's) for a block's new weights: a spare one, else the one the oldest
        write home has finished with (waited for). A new one only while every buffer is being filled, so the update
        holds WRITE_BUFFERS however many blocks there are (pinned memory is slow to make: they are kept and reused)."""
        if not self._spare_writes and self._write_buffers >= WRITE_BUFFERS and self._writes:
            future, buffer = self._writes.pop(0)
            future.result()
            self._spare_writes.append(buffer)
        if self._spare_writes:
            return self._spare_writes.pop()
        self._write_buffers += 1
        return self.dev.host_empty(max(block.nbytes for block in self.blocks), torch.uint8)

    def _write_home(self, block: _Block) -> None:
        """nvme: write the block's new weights; parameters the update did not touch keep what is on the disk."""
        (raw, buffer), done = self._writing.pop(block.index), self._written.pop(block.index)
        if len(done) < len(block.params):
            old = self.dev.host_empty(block.numel, block.dtype)
            self.swapper.read(self._key(block), into=old).result()
            for i, p in enumerate(block.params):
                if i not in done:
                    buffer[block.offsets[i]:block.offsets[i] + p.numel()].copy_(
                        old[block.offsets[i]:block.offsets[i] + p.numel()])
        in_flight = []
        for future, spare in self._writes:  # those done give their buffers back (a failed one is raised here)
            if future.done():
                future.result()
                self._spare_writes.append(spare)
            else:
                in_flight.append((future, spare))
        self._writes = [*in_flight, (self.swapper.write(self._key(block), buffer), raw)]

    def updated(self) -> None:
        """The update is over: the last writes home go (and are checked), and the next pass's first blocks are
        prefetched."""
        for index in list(self._writing):
            self._write_home(self.blocks[index])
        for future, buffer in self._writes:
            future.result()
            self._spare_writes.append(buffer)
        self._writes.clear()
        if self.order is not None and self._pos == len(self.order):
            self._pos = 0  # the next pass begins: its first blocks can come now
        self._prefetch()


def _merged(segments: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """Segments sorted by offset; neighbours that are also neighbours in host memory become one (one copy)."""
    out: list[tuple[int, torch.Tensor]] = []
    for offset, host in sorted(segments, key=lambda seg: seg[0]):
        if out:
            last_offset, last = out[-1]
            adjacent = last_offset + last.numel() == offset and last.dtype == host.dtype
            if adjacent and last.untyped_storage()._cdata == host.untyped_storage()._cdata and \
                    last.storage_offset() + last.numel() == host.storage_offset():
                out[-1] = (last_offset, last.as_strided((last.numel() + host.numel(),), (1,), last.storage_offset()))
                continue
        out.append((offset, host))
    return out
