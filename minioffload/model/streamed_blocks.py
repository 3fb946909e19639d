"""Which weights a ParamStreamer streams, and whether they fit: the blocks, each block's layout in one storage,
the parameters that stay on the device, and the budget check (model/streaming.py uses it; train's preflight runs it on
a meta model before anything exists).

What this is not: the moving of weights (model/streaming.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..units import format_bytes

# Where models keep their stack of blocks: the course GPT and nanoGPT-style models (`blocks`), Hugging Face's GPT-2
# (`transformer.h`), Llama, Mistral and Qwen (`model.layers`), BERT (`bert.encoder.layer`), each also as the bare
# base model (`h`, `layers`, `encoder.layer`)
BLOCK_PATHS = ("blocks", "transformer.h", "model.layers", "h", "layers", "encoder.layer", "bert.encoder.layer")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to stream, run one after another: the first of BLOCK_PATHS that names a non-empty
    nn.ModuleList (or nn.Sequential) of `model`."""
    for path in BLOCK_PATHS:
        blocks = model
        for name in path.split("."):
            blocks = getattr(blocks, name, None)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
            return list(blocks)
    raise ValueError(f"cannot find the blocks of {type(model).__name__}: looked for an nn.ModuleList at "
                     f"{', '.join(BLOCK_PATHS)}; pass blocks=[...] to name the modules called one after another")


@dataclass(eq=False)
class _Block:
    index: int
    params: list[nn.Parameter]  # streamed: this block's alone, all of one dtype
    names: list[str]
    offsets: list[int]  # where each parameter starts in the block's flat storage (elements)
    numel: int
    dtype: torch.dtype
    flat: torch.Tensor | None = None  # on the device: one storage every parameter of the block is a view of
    segments: list = field(default_factory=list)  # host: (offset, 1-D pinned tensor) pieces that make up the block
    state: str = "home"  # home | reading (nvme: into `bounce`) | device (its copies queued, `arrived` after them)
    arrived: object = None
    in_use: int = 0  # computing: a forward between its hooks, or a backward between its two gradient hooks
    backward: bool = False  # fetched for its backward (a recomputed forward inside it is not a new use)
    read: object = None  # nvme: the future of the read into `bounce`
    bounce: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


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
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"block {index} mixes dtypes {sorted(map(str, dtypes))}: streaming moves a block as "
                             "one piece of memory; cast the model to one dtype")
        offsets = [sum(q.numel() for q in params[:i]) for i in range(len(params))]
        blocks.append(_Block(index, params, [names[p] for p in params], offsets, sum(p.numel() for p in params),
                             params[0].dtype if params else torch.float32))
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
