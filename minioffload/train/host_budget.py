"""What a training run pins in host memory, counted before it starts, and the refusal when that passes its budget.

    need = pinned_need(config, shape, on_sim)   # {"optimizer": ..., "activations": ..., ...} bytes
    refuse_over_budget(config, need)            # ValueError naming each part and what to change

A run's pinned memory is, in parts: the optimizer's (OffloadAdam's fp32 gradients, staging and state, or with the
state on NVMe its working sets: predict/memory.py's `engine_bytes`; with the weights streamed from the host,
`streamed_bytes`, which adds their home; in fp32 the optimizer's masters are that home, made from the streamer's
own pinned copy, so for a moment at setup both are pinned), the activations the offload policies send to
the host (each such block's saved tensors, or its input for offload_input), and the batches staged for their copy to
a GPU. On the simulated device the count is what the run measures at its peak, byte for byte (tests/train). The run
itself is held to the budget by `pinned.HostBudget` (train.loop): a pinned buffer past it is refused as it is asked
for, and the summary reports the measured peak beside the budget.

What this is not: a cache. Everything counted here stays pinned for the whole run; a budget below it is refused,
not worked around. Not counted yet, so refused with a budget (TrainConfig): weights streamed from NVMe (the
streamer's bounce and write buffers) and lazy checkpoints (their host copies).
"""

from __future__ import annotations

import torch

from ..predict import memory
from ..predict.activation_cost import BlockShape
from ..units import format_bytes

PRECISION = {"fp32": "fp32", "bf16": "mixed_bf16"}  # TrainConfig's precision -> the memory model's


def pinned_need(config, shape: torch.nn.Module, on_sim: bool) -> dict[str, int]:
    """Pinned host bytes `config`'s run holds, by part, for `shape` (the model, on the meta device)."""
    precision = PRECISION[config.precision]
    value_bytes = 4 if config.precision == "fp32" else 2
    need = {"optimizer": 0, "setup": 0, "activations": 0, "batches": 0}
    if config.offload and config.params_on == "host":  # the optimizer, and the blocks' home beside it
        blocks = shape.blocks
        block_params = sum(p.numel() for p in blocks[0].parameters())
        need["optimizer"] = memory.streamed_bytes(
            shape.num_params(), len(blocks), shape.num_params() - len(blocks) * block_params, "host",
            config.prefetch, precision, nvme=config.nvme_dir is not None,
            subgroup_numel=config.optimizer.subgroup_numel)["host"]
        if config.precision == "fp32":  # the masters are made from the streamer's pinned home, then become it
            need["setup"] = len(blocks) * block_params * 4
    elif config.offload:  # sharded: the heaviest rank's share (a budget is one process's)
        numels = [p.numel() for p in shape.parameters()]
        need["optimizer"] = memory.engine_bytes(numels, precision, config.placement, config.optimizer)["host"]
    names = config.activations.split(",")
    names = names * len(shape.blocks) if len(names) == 1 else names
    gpt = shape.cfg
    block = BlockShape(config.block_size, config.batch_size, gpt.n_embd, gpt.n_head, value_bytes)
    # offload sends every saved tensor: Korthikanti et al.'s count, plus what it leaves out, each LayerNorm's mean and
    # reciprocal deviation (two LayerNorms a block, fp32, one value per token each)
    norm_stats = 2 * 2 * 4 * config.batch_size * config.block_size
    sent = {"offload": block.saved_bytes() + norm_stats, "offload_input": block.input_bytes()}
    need["activations"] = sum(sent.get(name, 0) for name in names)
    if not on_sim:  # the sim uses each batch as drawn; a GPU's are staged in pinned buffers (int64 inputs, targets)
        need["batches"] = 2 * 8 * config.batch_size * config.block_size * config.grad_accum
    return need


def peak(need: dict[str, int]) -> int:
    """The most of `need` pinned at once: the setup's copy is gone before the first activation or batch is pinned."""
    return need["optimizer"] + max(need["setup"], need["activations"] + need["batches"])


def refuse_over_budget(config, need: dict[str, int]) -> None:
    """ValueError when the peak of `need` passes `config.host_budget` (None: no budget)."""
    total = peak(need)
    if config.host_budget is None or total <= config.host_budget:
        return
    parts = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in need.items() if nbytes)
    raise ValueError(
        f"TrainConfig.host_budget={format_bytes(config.host_budget)} is below what this run pins, "
        f"{format_bytes(total)} ({parts}). Raise host_budget, or pin less: the optimizer's state on NVMe "
        "(nvme_dir) with small subgroups (subgroup_numel) and fewer working sets (nvme_buffers), activations "
        "recomputed instead of offloaded, a smaller batch_size")
