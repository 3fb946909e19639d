"""What happens to a block's activations between its forward and its backward: one policy per block.

    acts = Activations(model.blocks, "offload", dev)     # or a list, one policy per block
    loss.backward()                                        # offloaded activations come back ahead of their block
    acts.remove()                                          # the blocks as they were

    keep           autograd keeps every saved tensor on the device (the default: fastest, most memory)
    recompute      torch's non-reentrant checkpoint: only the block's input is kept; the forward runs again
                   in backward (a forward's FLOPs more)
    selective      only the attention core (softmax(q k^T) v, whose saved tensors grow with T^2) is recomputed
                   (Korthikanti et al., 2022); needs a block whose `attn` has a `core(q, k, v)` (our GPT's)
    offload        saved-tensor hooks: pack copies each saved tensor to pinned host memory on a copy stream
                   (D2H) and lets the device copy go; in backward, the first unpack of block i brings block i's
                   tensors back (H2D) and starts block i-1's, so the next block's copies run under this one's
                   backward; a block's forward waits until every earlier block's set but the last has left, so
                   the device holds at most two sets however slow the link
    offload_input  recompute, with the block's inputs (all checkpoint keeps) sent to the host as offload sends its
                   saved tensors

Parameters are never offloaded (their storage is the model's), nor saved tensors under `min_numel` elements.
The policies that run a block again (recompute, selective, offload_input) are torch's checkpoint, so they take any
call signature and give the same gradients under `torch.autograd.grad`, double backward and inputs that need no
gradient; the replay draws the device's random numbers of the forward too. A forward that is never
backpropagated (a skipped loss, an evaluation with grad on) leaves nothing behind: its offloaded tensors are
forgotten with its graph.
Host memory comes from a bounded pinned arena (`pool_bytes`) or, without a bound, one pinned buffer per tensor.
The same code runs on the simulated device and on CUDA: every order between the streams is an event.

What this is not: the choice of policy per block (chapter 9's planner), nor activations on NVMe.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

POLICIES = ("keep", "recompute", "selective", "offload", "offload_input")


@dataclass(eq=False)
class _Packed:
    """One offloaded saved tensor: its host copy and the events that order the copies."""

    host: torch.Tensor
    left: object  # event after the D2H copy
    device: torch.Tensor | None = None  # the copy back, once fetched
    arrived: object = None  # event after the H2D copy


class _Arena:
    """Pinned host memory for offloaded activations: `capacity` bytes, handed out in order and reused once every
    block's tensors have come back (None: a pinned buffer per tensor, no bound)."""

    def __init__(self, dev, capacity: int | None):
        self.dev, self.capacity, self.used = dev, capacity, 0
        self.buffer = None if capacity is None else dev.host_empty(capacity, torch.uint8)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self.buffer is None:
            return self.dev.host_empty(tuple(shape), dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // 64) * 64  # 64-byte aligned for every dtype
        if start + nbytes > self.capacity:
            raise MemoryError(f"the pinned pool for offloaded activations holds {self.capacity:,} bytes and this "
                              f"step's activations need more (at least {start + nbytes:,}): give Activations a "
                              "larger pool_bytes, or offload fewer blocks")
        self.used = start + nbytes
        return self.buffer[start:start + nbytes].view(dtype).view(shape)


class Activations:
    """Apply `policy` (a name from POLICIES, or one per block) to `blocks` (modules called one after another, like
    `model.blocks` or `find_blocks(model)`, model/streamed_blocks.py). Refuses bad input before changing anything."""

    def __init__(self, blocks: Sequence[torch.nn.Module], policy: str | Sequence[str], dev,
                 pool_bytes: int | None = None, min_numel: int = 1024):
        blocks = list(blocks)
        policies = [policy] * len(blocks) if isinstance(policy, str) else list(policy)
        unknown = sorted({name for name in policies if name not in POLICIES})
        if unknown:
            raise ValueError(f"unknown activation policy {', '.join(map(repr, unknown))}; choose from "
                             f"{', '.join(POLICIES)}")
        if len(policies) != len(blocks):
            raise ValueError(f"{len(policies)} policies for {len(blocks)} blocks: give one per block, or one name")
        if len({id(block) for block in blocks}) != len(blocks):
            raise ValueError("a module appears more than once in blocks: give each block once (a block shared by "
                             "several layers takes one policy, applied once)")
        for index, (block, name) in enumerate(zip(blocks, policies, strict=True)):
            if name == "selective" and not callable(getattr(getattr(block, "attn", None), "core", None)):
                raise ValueError(f"block {index} has no attn.core(q, k, v) to recompute alone (selective needs "
                                 "the course's GPT blocks); use recompute for it")
            if name != "keep" and getattr(block, "gradient_checkpointing", False):
                raise ValueError(f"block {index} checkpoints itself already (a Hugging Face model after "
                                 "gradient_checkpointing_enable()): turn that off (gradient_checkpointing_disable(); "
                                 "activation_checkpointing_disable() in transformers 5) and let the policy decide, or "
                                 "give the block 'keep'")
            if "forward" in vars(block):
                raise ValueError(f"block {index} already has a policy applied: remove() the other Activations first")
        if pool_bytes is not None and (isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int)
                                       or pool_bytes < 1):
            raise ValueError(f"pool_bytes must be a positive int (or None: a buffer per tensor), got {pool_bytes!r}")
        self.dev, self.blocks, self.policies, self.min_numel = dev, blocks, policies, min_numel
        offloads = any(name in ("offload", "offload_input") for name in policies)
        self.d2h = dev.stream("activations d2h") if offloads else None
        self.h2d = dev.stream("activations h2d") if offloads else None
        self.arena = _Arena(dev, pool_bytes) if offloads else None
        # the offloading block's weights, by storage object, not address (a streamed weight, chapter 8, keeps its
        # storage, not its address); read at each forward: an optimizer may have moved them since (OffloadAdam puts
        # a model's weights in one flat buffer), and a weight saved through a stale set was copied out and back
        self._weights: set[int] = set()
        # block -> its packed tensors not yet fetched, by weak reference: the graph that saved them holds them, and
        # a forward never backpropagated drops them with its graph
        self._waiting: dict[int, list[weakref.ref]] = {}
        self._last_left = None  # event after the last D2H copy issued
        self._leaving: list = []  # per offloading block's forward, in order: the event after its set's last copy
        self._patched: list[tuple[torch.nn.Module, str]] = []
        for index, (block, name) in enumerate(zip(blocks, policies, strict=True)):
            self._install(index, block, name)

    def _install(self, index: int, block: torch.nn.Module, name: str) -> None:
        forward = block.forward  # the class's bound method
        if name == "keep":
            return
        dev = self.dev
        if name == "recompute":
            def run(*args, **kwargs):
                return checkpoint(_replaying(dev, forward), *args, use_reentrant=False, **kwargs)
        elif name == "selective":
            core = block.attn.core
            block.attn.core = lambda q, k, v: checkpoint(_replaying(dev, core), q, k, v, use_reentrant=False)
            self._patched.append((block.attn, "core"))
            return
        elif name == "offload":
            def run(*args, **kwargs):
                self._one_set_in_flight()
                self._weights = {p.untyped_storage()._cdata for p in block.parameters()}
                with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(index, t),
                                                               lambda packed: self._unpack(index, packed)):
                    out = forward(*args, **kwargs)
                self._set_leaves()
                return out
        else:  # offload_input: checkpoint saves only the inputs, and saves them through these hooks
            def run(*args, **kwargs):
                if not torch.is_grad_enabled():
                    return forward(*args, **kwargs)
                self._one_set_in_flight()
                with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(index, t, force=True),
                                                               lambda packed: self._unpack(index, packed)):
                    out = checkpoint(_replaying(dev, forward), *args, use_reentrant=False, **kwargs)
                self._set_leaves()
                return out
        block.forward = run
        self._patched.append((block, "forward"))

    def remove(self) -> None:
        """Put every block back as it was."""
        for module, attribute in self._patched:
            delattr(module, attribute)
        self._patched.clear()

    # offload: pack in forward, fetch ahead in backward ------------------------------------------------------
    def _one_set_in_flight(self) -> None:
        """Before an offloading block's forward: every offloaded block's set but the last has left the device (the
        host waits for its last copy). The device then holds at most two sets, the one whose copy runs beside this
        forward and the one this forward makes, as the planner counts; without the wait, a forward that outruns the
        link would pile sets up on the device, as many as the copies lag behind."""
        while len(self._leaving) > 1:
            self._leaving.pop(0).synchronize()

    def _set_leaves(self) -> None:
        """After an offloading block's forward: its set's last copy (the event after it) is the one to wait for."""
        if self._last_left is not None and (not self._leaving or self._leaving[-1] is not self._last_left):
            self._leaving.append(self._last_left)

    def _pack(self, index: int, tensor: torch.Tensor, force: bool = False):
        if tensor.device != self.dev.torch_device or tensor.numel() == 0:
            return tensor  # not device memory (fused attention saves 0-dim CPU tensors), or nothing: nothing to move
        if not force and (tensor.numel() < self.min_numel or tensor.untyped_storage()._cdata in self._weights):
            return tensor  # weights stay the model's; small tensors are not worth a copy
        if not self._pending():
            self._reuse_arena()
        source = (tensor if tensor.is_contiguous() else tensor.contiguous()).detach()  # bytes, not a graph node
        # a storage saved twice (a ReLU's output is also the next Linear's input) is counted once, and its write by
        # the forward declared once: the first save's copy may be reading it by the second
        first_save = not self.dev.is_device(source)
        self.dev.adopt(source, f"activation {index}")  # autograd made it on the device: counted until its storage goes
        if first_save:
            self.dev.uses(f"block {index}'s forward", writes=[source])
        try:
            host = self.arena.take(source.shape, source.dtype)
        except MemoryError as err:
            waiting = sum(packed.host.nbytes for refs in self._waiting.values() for ref in refs
                          if (packed := ref()) is not None)
            raise MemoryError(f"{err}. Of the pool, {waiting:,} bytes hold saved tensors still waiting for a "
                              "backward: this forward's, and those of any earlier forward whose graph is still "
                              "referenced (drop it, `del loss`, before the next forward)") from None
        self.dev.stream_waits_for_compute(self.d2h)  # compute wrote it
        self.dev.copy(host, source, self.d2h, name=f"d2h activation {index}")
        self.dev.keep_alive(source, self.d2h)  # freed once the copy has read it
        left = self.dev.event()
        left.record(self.d2h)
        self._last_left = left
        packed = _Packed(host, left)
        self._waiting.setdefault(index, []).append(weakref.ref(packed))
        return packed

    def _unpack(self, index: int, packed):
        if not isinstance(packed, _Packed):
            return packed
        if packed.device is None:
            self._fetch(index)  # not prefetched (the last block's backward comes first): now
        self._fetch(index - 1)  # the block whose backward comes next: under this one's
        self.dev.compute_waits_for(packed.arrived)
        self.dev.uses(f"block {index}'s backward", reads=[packed.device])
        return packed.device

    def _pending(self) -> bool:
        """Whether an offloaded tensor still waits to come back for a graph that is alive."""
        for index in list(self._waiting):
            alive = [ref for ref in self._waiting[index] if ref() is not None]
            if alive:
                self._waiting[index] = alive
            else:
                del self._waiting[index]
        return bool(self._waiting)

    def _fetch(self, index: int) -> None:
        waiting = [packed for packed in (ref() for ref in self._waiting.pop(index, [])) if packed is not None]
        if not waiting:
            return
        # the host waits for every D2H so far, not only these tensors': their own have landed in host memory, the
        # memory the others read may be handed out again (dev.empty below), and at the turn into the backward the
        # last block's set is not on the device twice (once leaving, once coming back). The copies below are
        # issued after the wait, so they are ordered after the D2H copies without a stream wait
        self._last_left.synchronize()
        for packed in waiting:
            packed.device = self.dev.empty(tuple(packed.host.shape), packed.host.dtype, name=f"activation {index}")
        # the memory just allocated may be what a later block's backward, still queued on a GPU, has freed: the
        # copies into it wait for the compute issued so far (this block's backward is not issued yet: they overlap)
        self.dev.stream_waits_for_compute(self.h2d)
        for packed in waiting:
            self.dev.copy(packed.device, packed.host, self.h2d, name=f"h2d activation {index}")
            packed.arrived = self.dev.event()
            packed.arrived.record(self.h2d)

    def _reuse_arena(self) -> None:
        """Every block's tensors are back: the arena starts over (the H2D copies that read it came before the
        compute that the next D2H copies wait for)."""
        if self.arena is not None:
            self.arena.used = 0


def _replaying(dev, fn: Callable) -> Callable:
    """`fn`, whose later calls (checkpoint's recomputation in backward) draw the device's random numbers of its first
    (checkpoint restores the CPU's and CUDA's default generators itself; the sim's device generator is its own), and
    leave the device's generator as they found it."""
    first: list[torch.Tensor] = []

    def call(*args, **kwargs):
        if not first:
            first.append(dev.get_rng_state())
            return fn(*args, **kwargs)
        now = dev.get_rng_state()
        dev.set_rng_state(first[0])
        try:
            return fn(*args, **kwargs)
        finally:
            dev.set_rng_state(now)

    return call
