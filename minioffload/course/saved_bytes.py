"""What each block of a model keeps for backward, measured on the simulated device's ledger as chapter 7 counts it:
a forward under saved-tensor hooks that adopt every tensor autograd saves into the ledger, the whole storage once
(views of one storage count once; the parameters, placed on the device first, are not activations), attributed to
the block whose forward saved it. The appendix sets it beside the formula (predict/block_activations.py).

    blocks = model.model.layers                            # a Hugging Face Llama's decoder layers
    saved = saved_bytes(model, blocks, lambda: model(**inputs).loss)
    saved.per_block[0], saved.shared, saved.outside         # bytes

What this is not: the runtime's policies (model/activations.py), nor a profiler of the allocator: it counts what
autograd keeps, not the temporaries a forward frees as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..devices import device


@dataclass(frozen=True)
class SavedBytes:
    """Bytes autograd kept after one forward, from the device's ledger.

    per_block: each block's own (storages no other block saved). shared: storages more than one block saved (a
    Llama's rotary cos/sin tables, made once per forward), counted once, in the first block that saved them.
    outside: what the rest of the forward saved (embeddings, final norm, head, loss). tensors: per block, the
    (shape, dtype, storage bytes) of each storage it saved, in the order it saved them."""

    per_block: tuple[int, ...]
    shared: int
    outside: int
    tensors: tuple[tuple[tuple[tuple[int, ...], torch.dtype, int], ...], ...] = field(repr=False, default=())


def saved_bytes(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], forward: Callable[[], object],
                min_numel: int = 1024, memory_bytes: int = 16 << 30) -> SavedBytes:
    """Run `forward()` (one forward pass of `model`, returning what keeps its graph alive: the loss) on a fresh
    simulated device with `model` placed on it, and count what autograd saves: each saved storage of at least
    `min_numel` elements (chapter 7's 1024: smaller ones stay on the device under every policy; 1 counts all) once,
    in the block of `blocks` whose forward saved it first. `memory_bytes`: the simulated device's capacity (a
    ledger's limit, not memory taken)."""
    current: list[int | None] = [None]
    seen: dict[int, set[int | None]] = {}  # storage address -> the blocks that saved it
    first: dict[int, tuple[int | None, int]] = {}  # storage address -> (the block that saved it first, its bytes)
    listed: dict[int | None, list] = {}

    with device("sim", memory_bytes=memory_bytes) as dev:
        dev.place(model)
        ledger = dev.ledger

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if t.numel() < min_numel or (address not in first and dev.is_device(t)):  # small, or a parameter
                return t
            seen.setdefault(address, set()).add(current[0])
            if address not in first:
                whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)  # the storage, not the view
                dev.adopt(whole, "saved")
                first[address] = (current[0], storage.nbytes())
                listed.setdefault(current[0], []).append((tuple(t.shape), t.dtype, storage.nbytes()))
            return t

        adopted = [0] * len(blocks)  # the ledger's growth during each block's forward
        marks: list[int] = [0]

        def enter(i: int) -> None:
            current[0], marks[0] = i, ledger.used("device")

        def leave(i: int) -> None:
            adopted[i] += ledger.used("device") - marks[0]
            current[0] = None

        hooks = []
        for i, block in enumerate(blocks):
            hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: enter(i)))
            hooks.append(block.register_forward_hook(lambda m, a, o, i=i: leave(i)))
        before = ledger.used("device")
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                kept = forward()
            total = ledger.used("device") - before
        finally:
            for hook in hooks:
                hook.remove()
        shared = {address for address, owners in seen.items() if len(owners - {None}) > 1}
        per_block = list(adopted)
        for address in shared:  # counted apart, once
            owner, nbytes = first[address]
            if owner is not None:
                per_block[owner] -= nbytes
        shared_bytes = sum(first[address][1] for address in shared)
        del kept
    return SavedBytes(tuple(per_block), shared_bytes, total - sum(per_block) - shared_bytes,
                      tuple(tuple(listed.get(i, ())) for i in range(len(blocks))))
