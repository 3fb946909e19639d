"""A plan in other systems' terms: what each cannot express of it, and the DeepSpeed config that comes closest.
The FSDP2 and torchao code that come closest are written by planner/export_code.py.

    config = to_deepspeed_config(plan, world_size=1, lr=3e-4)   # a dict: json.dump it (lr: your model's)
    unsupported(plan, "fsdp2")            # what of the plan that system cannot express, a sentence each

Where each part of the plan goes:

    plan                      DeepSpeed                          FSDP2 (torch)                  torchao
    weights streamed          ZeRO-3 offload_param cpu | nvme    CPUOffloadPolicy               -
    optimizer host | nvme     offload_optimizer cpu | nvme       CPUOffloadPolicy (host only)   CPUOffloadOptimizer
    gpu_fraction              offload_optimizer.ratio (ZeRO-3)   -                              -
    delay                     -                                  -                              -
    prefetch                  stage3_prefetch_bucket_size,       set_modules_to_forward_/       -
                              stage3_max_live_parameters         backward_prefetch
    subgroup_numel            sub_group_size (ZeRO-3)            -                              -
    activations               activation_checkpointing           torch.utils.checkpoint, save_on_cpu
    NVMe I/O                  aio (block_size, threads)          -                              -

The stage: 0 with everything on the GPU; ZeRO-Offload (stage 2, offload_optimizer cpu) for an optimizer in host
memory beside resident weights; ZeRO-3 (ZeRO-Infinity) when the weights are streamed, the optimizer state lives on
NVMe (stage 2 would keep it in host memory) or part of the update runs on the GPU (DeepSpeed's partial offload,
`ratio`, is ZeRO-3's alone). `unsupported` names the rest, and each export carries those sentences: the DeepSpeed
config under its "_minioffload" key (DeepSpeed reads no key it does not know), the code as comments at its top.

What this is not: a runner. It writes configs and source text and runs none of them, imports neither DeepSpeed,
torchao nor torch.distributed, and checks nothing against a machine (doctor.py does that for the plan itself), nor
promises the other system the plan's speed: their schedules are not the runtime's. tests/planner/test_export.py
validates the DeepSpeed configs with DeepSpeed's own config classes and runs the FSDP2 code on the CPU.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..nvme.swapper import Swapper
from ..units import format_bytes
from .plan import Plan

SYSTEMS = ("deepspeed", "fsdp2", "torchao")
RECOMPUTED = ("recompute", "selective", "offload_input")  # the policies that run a block's forward again
TO_HOST = ("offload", "offload_input")  # the policies that move saved activations to host memory
LINEARS_PER_BLOCK = 4  # ModelSpec's block: qkv, the attention's projection, the MLP's two
SWAP_TENSORS = 4  # what DeepSpeed's NVMe optimizer swapper moves per subgroup: fp32 master, exp_avg, exp_avg_sq, grad
BLOCK_SIZE = inspect.signature(Swapper).parameters["block_size"].default
WORKERS = inspect.signature(Swapper).parameters["workers"].default
WEIGHT_DECAY = inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
INTRA_OP_SINCE = (0, 16, 4)  # DeepSpeed's aio "thread_count" is "intra_op_parallelism" from this release on


# ----------------------------------------------------------------------------------------------- what is missing

def unsupported(plan: Plan, system: str) -> list[str]:
    """The plan's choices that `system` ("deepspeed", "fsdp2" or "torchao") cannot express, a sentence each, saying
    what the export does instead. Empty when the export is the plan."""
    gaps = {"deepspeed": _deepspeed_gaps, "fsdp2": _fsdp2_gaps, "torchao": _torchao_gaps}
    if system not in gaps:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    return gaps[system](plan)


def _blocks(plan: Plan, policies: tuple[str, ...]) -> str:
    """The blocks whose policy is one of `policies`, runs folded: "blocks 0-3, 7"."""
    runs: list[list[int]] = []
    for i, policy in enumerate(plan.activations):
        if policy in policies:
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return ("block " if len(runs) == 1 and runs[0][0] == runs[0][1] else "blocks ") + text


def _delay(name: str) -> str:
    return (f"The one-step delayed update (plan.delay, ZeRO-Offload's DPU): {name} has no such setting, so this "
            "export updates synchronously and the CPU's optimizer step stays on the critical path of every step.")


def _torch_activation_gaps(plan: Plan) -> list[str]:
    """What torch's own tools (checkpoint, save_on_cpu), which the FSDP2 and torchao code use, do differently."""
    gaps = []
    if "offload_input" in plan.activations:
        gaps.append(f"Offloading a recomputed block's input ('offload_input', {_blocks(plan, ('offload_input',))}): "
                    "torch.utils.checkpoint keeps the input it saves on the GPU, so those blocks are recomputed "
                    "with their inputs held in device memory.")
    if "offload" in plan.activations:
        gaps.append(f"The 'offload' policy ({_blocks(plan, ('offload',))}) is torch.autograd.graph.save_on_cpu "
                    "here: it copies every tensor the block saves to the host, the weights it saves included, and "
                    "copies each back when the backward reaches it, with no prefetch ahead of the backward.")
    return gaps


def _deepspeed_gaps(plan: Plan) -> list[str]:
    gaps = []
    if plan.delay:
        gaps.append(_delay("DeepSpeed") + " (ZenFlow, zero_optimization.zenflow, overlaps a CPU update of the "
                    "less important gradients with the next steps: another algorithm, not set here.)")
    if _stage(plan) == 2:
        gaps.append(f"The subgroup size ({plan.subgroup_numel:,} elements): ZeRO-Offload (stage 2) steps each "
                    "rank's whole partition with CPU Adam; sub_group_size applies to ZeRO-3 only.")
    if plan.params_on != "device":
        gaps.append("The plan keeps the embeddings and the final LayerNorm on the GPU and streams the blocks; "
                    "ZeRO-3 offloads every parameter of stage3_param_persistence_threshold elements or more, the "
                    "embeddings included, and fetches them when they are used.")
    if "offload" in plan.activations:
        gaps.append(f"The 'offload' policy ({_blocks(plan, ('offload',))}), saved activations moved to the host "
                    "without recomputing: DeepSpeed has no such setting; its nearest, cpu_checkpointing, "
                    "recomputes the block with its input kept in host memory, so checkpoint those blocks.")
    if "selective" in plan.activations:
        gaps.append(f"Selective recomputation ({_blocks(plan, ('selective',))}): DeepSpeed recomputes a whole "
                    "checkpointed call; checkpoint those blocks whole, or only their attention core in the model.")
    if set(plan.activations) & {"recompute", "selective"} and set(plan.activations) & set(TO_HOST):
        gaps.append("cpu_checkpointing is one switch for every checkpointed call: the inputs of the recomputed "
                    f"{_blocks(plan, ('recompute', 'selective'))} move to host memory as well.")
    return gaps


def _fsdp2_gaps(plan: Plan) -> list[str]:
    gaps = []
    homes = [what for what, on in (("the weights", plan.params_on), ("the optimizer state", plan.optimizer_on))
             if on == "nvme"]
    if homes:
        nvme, host = plan.memory.get("nvme"), plan.memory.get("host")
        more = f" ({format_bytes(nvme)} more host memory than the plan's {format_bytes(host)})" if nvme and host \
            else ""
        gaps.append(f"The NVMe home of {' and '.join(homes)}: FSDP2 offloads to host memory only "
                    f"(CPUOffloadPolicy), so they stay in host memory here{more}.")
    if plan.params_on == "device" and plan.optimizer_on != "device":
        gaps.append("Weights resident on the GPU beside an offloaded optimizer: CPUOffloadPolicy moves parameters, "
                    "gradients and the optimizer step to the host together, so this code streams the weights "
                    "from host memory block by block as well.")
    if plan.gpu_fraction:
        gaps.append(f"The hybrid update (gpu_fraction {plan.gpu_fraction:.2f}, that share of the optimizer's "
                    "subgroups updated on the GPU): FSDP2 updates each parameter where its shard lives, so with "
                    "CPUOffloadPolicy all of them are updated on the CPU.")
    if plan.delay:
        gaps.append(_delay("FSDP2"))
    if plan.optimizer_on != "device":
        gaps.append(f"The subgroup size ({plan.subgroup_numel:,} elements): torch's AdamW steps each sharded "
                    "parameter whole; there is no subgroup to set.")
    return gaps + _torch_activation_gaps(plan)


def _torchao_gaps(plan: Plan) -> list[str]:
    gaps = []
    if plan.optimizer_on == "device":
        return _torch_activation_gaps(plan)  # nothing offloaded: torch's AdamW on the GPU is the plan
    if plan.params_on != "device":
        gaps.append(f"Streamed weights (their home: {plan.params_on}): CPUOffloadOptimizer offloads the optimizer "
                    "alone, so every weight stays on the GPU and there is no prefetch to set.")
    if plan.optimizer_on == "nvme":
        gaps.append("The optimizer state's NVMe home: CPUOffloadOptimizer keeps it in host memory.")
    if plan.options.max_grad_norm is not None:
        gaps.append(f"Clipping the gradients to norm {plan.options.max_grad_norm:g}: CPUOffloadOptimizer does not "
                    "support it, so this code trains unclipped.")
    if plan.gpu_fraction:
        gaps.append(f"The hybrid update (gpu_fraction {plan.gpu_fraction:.2f}): CPUOffloadOptimizer updates on "
                    "the CPU all but the tensors smaller than its minimal_size (4096 elements by default); no share "
                    "of the rest can be updated on the GPU.")
    if plan.delay:
        gaps.append(_delay("CPUOffloadOptimizer"))
    if plan.grad_accum > 1:
        gaps.append(f"Gradients summed in host memory over the {plan.grad_accum} micro-batches: offload_gradients="
                    "True frees each GPU gradient after copying it (a copy, not a sum), which gradient "
                    "accumulation breaks, so the gradients stay on the GPU here and go to the host once a step.")
    if plan.precision == "mixed_bf16":
        gaps.append("bf16 weights on the GPU with fp32 masters on the host: CPUOffloadOptimizer keeps its host "
                    "copy and state in the parameters' dtype, so this code keeps fp32 weights on the GPU (twice "
                    "their bytes) under bf16 autocast; a bf16 model would give bf16 masters and state instead.")
    gaps.append(f"The subgroup size ({plan.subgroup_numel:,} elements): the host optimizer steps each parameter "
                "whole; there is no subgroup to set.")
    return gaps + _torch_activation_gaps(plan)


# ------------------------------------------------------------------------------------------------------ DeepSpeed

def _stage(plan: Plan) -> int:
    if plan.optimizer_on == "device":
        return 0
    if plan.params_on != "device" or plan.optimizer_on == "nvme" or plan.gpu_fraction:
        return 3
    return 2


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def to_deepspeed_config(plan: Plan, world_size: int | None = None, *, lr: float, nvme_path: str = "/local_nvme",
                        weight_decay: float = WEIGHT_DECAY, block_size: int = BLOCK_SIZE, workers: int = WORKERS,
                        queue_depth: int = 8, deepspeed_version: str | None = None, comments: bool = True) -> dict:
    """The DeepSpeed config (a dict for `json.dump` or `deepspeed.initialize(config=...)`) closest to `plan` on
    `world_size` GPUs (default: the plan's ranks), each running the plan's micro-batch. The NVMe homes go under
    `nvme_path`.

    The "aio" section is the NVMe tier's I/O: `block_size` bytes per request and `workers` threads splitting each
    tensor (the Swapper's settings, nvme_tune.tune's best row); `queue_depth` requests in flight per thread, which
    the Swapper's one synchronous read or write per worker does not have (8 is DeepSpeed's default). DeepSpeed
    before 0.16.4 names the threads "thread_count": give `deepspeed_version` for such a release.

    Derived numbers: stage3_prefetch_bucket_size is `prefetch` blocks' parameters and stage3_max_live_parameters
    the window of prefetch + 1 blocks; offload_param's NVMe buffers hold one tensor each, the largest
    (an embedding, or an MLP weight) split over `world_size`, one per Linear weight of prefetch + 2 blocks (the
    Swapper's bounce buffers) and the two embeddings, and max_in_cpu is 0 (the plan caches no weights in host
    memory); offload_optimizer's NVMe buffers are the four tensors a subgroup moves times the tier's working sets
    (the plan's options' nvme_buffers: one reading, one updating, one writing), read and written in a pipeline as
    the tier does, and fast_init stays off (its fp16 buffers would have to hold a whole subgroup). `ratio`,
    DeepSpeed's share of subgroups updated on the CPU, is 1 - gpu_fraction.
    The "optimizer" section is AdamW with `lr` (yours: no default, since the course GPTs' rate would be far too large
    for the models a plan is usually for) and torch's other defaults: with offload DeepSpeed builds its CPU Adam from
    it, which its partial offload (`ratio`) requires. "gradient_clipping" is the plan's `max_grad_norm`.
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a positive learning rate (your model's), got {lr!r}")
    world_size = plan.ranks if world_size is None else world_size  # default: the ranks the plan was made for
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (GPUs, each running the plan), got {world_size!r}")
    spec, stage = plan.model, _stage(plan)
    config: dict = {
        "train_batch_size": plan.micro_batch * plan.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": weight_decay}},
    }
    if plan.options.max_grad_norm is not None:  # the plan clips (and the step model prices the pass)
        config["gradient_clipping"] = plan.options.max_grad_norm
    if plan.precision == "mixed_bf16":
        config["bf16"] = {"enabled": True}
    zero: dict = {"stage": stage}
    if stage:
        zero.update(overlap_comm=True, contiguous_gradients=True)
        optimizer = {"device": "nvme" if plan.optimizer_on == "nvme" else "cpu", "pin_memory": True}
        if plan.optimizer_on == "nvme":
            optimizer.update(nvme_path=nvme_path, buffer_count=SWAP_TENSORS * plan.options.nvme_buffers,
                             pipeline_read=True, pipeline_write=True, fast_init=False)
        if plan.gpu_fraction:
            optimizer["ratio"] = round(1.0 - plan.gpu_fraction, 6)
        zero["offload_optimizer"] = optimizer
    if stage == 3:
        zero["sub_group_size"] = plan.subgroup_numel
        if plan.params_on != "device":
            params = {"device": "cpu" if plan.params_on == "host" else "nvme", "pin_memory": True}
            if plan.params_on == "nvme":
                largest = max(spec.vocab, spec.seq_len, 4 * spec.d_model) * spec.d_model
                params.update(nvme_path=nvme_path, buffer_count=LINEARS_PER_BLOCK * (plan.prefetch + 2) + 2,
                              buffer_size=math.ceil(largest / world_size), max_in_cpu=0)
            zero["offload_param"] = params
            zero["stage3_prefetch_bucket_size"] = plan.prefetch * spec.block_params
            zero["stage3_max_live_parameters"] = (plan.prefetch + 1) * spec.block_params
    config["zero_optimization"] = zero
    if "nvme" in (plan.optimizer_on, plan.params_on) and stage == 3:
        old = deepspeed_version is not None and _version(deepspeed_version) < INTRA_OP_SINCE
        config["aio"] = {"block_size": block_size, "queue_depth": queue_depth,
                         "thread_count" if old else "intra_op_parallelism": workers,
                         "single_submit": False, "overlap_events": True}
    checkpointed = [p for p in plan.activations if p in RECOMPUTED or p in TO_HOST]
    if checkpointed:
        config["activation_checkpointing"] = {
            "partition_activations": False,  # splits activations over model-parallel ranks; the plan has none
            "cpu_checkpointing": any(p in TO_HOST for p in plan.activations),
            "contiguous_memory_optimization": False, "number_checkpoints": len(checkpointed),
            "synchronize_checkpoint_boundary": False, "profile": False}
    if comments:
        notes = [f"minioffload plan: {plan.describe()}; {spec}; activations {plan.activations_line()}."]
        if checkpointed:
            notes.append("The model code checkpoints " + _blocks(plan, RECOMPUTED + TO_HOST)
                         + " with deepspeed.checkpointing.checkpoint: the activation_checkpointing section says how, "
                         "the model code which blocks.")
        config["_minioffload"] = {"notes": notes, "unsupported": unsupported(plan, "deepspeed")}
    return config
