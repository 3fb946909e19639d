"""A plan as Python source for FSDP2 and for torchao: the code that comes closest to it, with what that system
cannot express of the plan (export.unsupported) as comments at its top.

    code = to_fsdp2_code(plan)            # apply_plan(model), make_optimizer(model, lr), train_step(...)
    code = to_torchao_code(plan)          # the same three functions around torchao's CPUOffloadOptimizer

What this is not: a runner. It writes source text and runs none of it (tests/planner/test_export.py runs the FSDP2
code on the CPU); the DeepSpeed config and the sentences of what each system cannot express are planner/export.py's.
"""

from __future__ import annotations

import textwrap

from ..model.streamed_blocks import BLOCK_PATHS
from .export import WEIGHT_DECAY, unsupported
from .plan import Plan

_SELECTIVE = '''
_ATTENTION = {getattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)}


def _attention_policy(ctx, op, *args, **kwargs):
    """'selective': recompute the attention kernels, save every other result."""
    recompute = getattr(op, "overloadpacket", op) in _ATTENTION
    return CheckpointPolicy.PREFER_RECOMPUTE if recompute else CheckpointPolicy.PREFER_SAVE


def _recompute_attention():
    return create_selective_checkpoint_contexts(_attention_policy)
'''

_RUN = {  # the wrapped forward of each policy but 'keep': its lines, and what it does
    "offload": (["with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):",
                 "    return forward(*args, **kwargs)"],
                "saved tensors go to host memory and come back for the backward"),
    "selective": (["return checkpoint(forward, *args, use_reentrant=False, context_fn=_recompute_attention, **kwargs)"],
                  "the backward recomputes the attention core"),
    "recompute": (["return checkpoint(forward, *args, use_reentrant=False, **kwargs)"],
                  "the backward recomputes the block"),
}


def _activation_code(plan: Plan) -> str:
    """The helper that wraps each block's forward for its policy, with the branches this plan's policies take."""
    used = [p for p in _RUN if p in plan.activations or (p == "recompute" and "offload_input" in plan.activations)]
    if not used:
        return ""
    rows = ["", "", "def _activations(block, policy, pin_memory=True):",
            '    """Wrap the forward of `block` for its activation policy (keep: as it is)."""',
            '    if policy == "keep":', "        return", "    forward = block.forward"]
    for i, policy in enumerate(used):
        body, why = _RUN[policy]
        names = "recompute, and offload_input (its input stays on the GPU)" if policy == "recompute" else policy
        if len(used) == 1:
            indent = "    "
            rows.append(f"    # {names}: {why}")
        else:
            indent = "        "
            test = "else:" if i == len(used) - 1 else f"{'if' if i == 0 else 'elif'} policy == \"{policy}\":"
            rows.append(f"    {test}  # {names}: {why}")
        rows += [f"{indent}def run(*args, **kwargs):"] + [f"{indent}    {line}" for line in body]
    rows.append("    block.forward = run")
    return (_SELECTIVE if "selective" in used else "") + "\n".join(rows) + "\n"


# The exported code finds a model's blocks where minioffload's find_blocks looks (model/streamed_blocks.py)
_FIND_BLOCKS = f'''

BLOCK_PATHS = {BLOCK_PATHS!r}


def find_blocks(model):
    """The model's transformer blocks in order: the first of BLOCK_PATHS that names a non-empty ModuleList (the
    course's GPT, Hugging Face's GPT-2, Llama, Mistral, Qwen2 and BERT); other models name theirs (blocks=...)."""
    for path in BLOCK_PATHS:
        blocks = model
        for name in path.split("."):
            blocks = getattr(blocks, name, None)
        if isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)) and len(blocks) > 0:
            return list(blocks)
    raise ValueError(f"cannot find the blocks of {{type(model).__name__}} at {{', '.join(BLOCK_PATHS)}}: pass "
                     "apply_plan(model, blocks=[...]), the modules the model runs one after another")
'''

_TRAIN_STEP = '''

def train_step(model, optimizer, micro_batches, loss_of=lambda model, batch: model(*batch)[1]):
    """One optimizer step over the GRAD_ACCUM micro-batches (MICRO_BATCH sequences each); `loss_of(model, batch)`
    is the loss of one (the course GPT's `model(idx, targets)[1]` unless given). Returns the mean loss."""
    total = 0.0
    for batch in micro_batches:
{forward}
        (loss / len(micro_batches)).backward(){sum_note}
        total += loss.detach()
{clip}    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / len(micro_batches)
'''


def _clip(plan: Plan) -> str:
    """train_step's clipping line, as the plan clips (its max_grad_norm), or nothing."""
    if plan.options.max_grad_norm is None:
        return ""
    return f"    torch.nn.utils.clip_grad_norm_(model.parameters(), {plan.options.max_grad_norm!r})  # the plan clips\n"


def _comment(lines: list[str], width: int = 116) -> str:
    out = []
    for line in lines:
        if not line:
            out.append("#")
            continue
        bullet = line.startswith("- ")
        out += textwrap.wrap(line, width - 2, initial_indent="# ", subsequent_indent="#   " if bullet else "# ",
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def _header(plan: Plan, system: str, usage: str) -> list[str]:
    gaps = unsupported(plan, system)
    names = {"fsdp2": "FSDP2", "torchao": "torchao"}
    lines = [f"{names[system]} for a minioffload plan (minioffload.planner.export_code): {plan.describe()}.",
             f"The model: {plan.model}; activations {plan.activations_line()}; planned for {plan.hardware}.",
             usage, ""]
    if gaps:
        lines += [f"What {names[system]} cannot express of this plan (the code does as said):"]
        lines += [f"- {gap}" for gap in gaps]
    else:
        lines += [f"{names[system]} expresses every choice of this plan."]
    return lines


def _constants(plan: Plan, **more) -> str:
    rows = [f"MICRO_BATCH = {plan.micro_batch}  # sequences per forward and backward",
            f"GRAD_ACCUM = {plan.grad_accum}  # micro-batches per optimizer step"]
    rows += [f"{name} = {value!r}  # {why}" for name, (value, why) in more.items()]
    return "\n".join(rows)


def _policies(plan: Plan) -> str:
    return f"POLICIES = {tuple(plan.activations)!r}  # the plan's activation policy, block by block"


def _imports(plan: Plan, extra: list[str]) -> str:
    rows = list(extra)
    if "selective" in plan.activations:
        rows.append("from torch.utils.checkpoint import CheckpointPolicy, checkpoint, "
                    "create_selective_checkpoint_contexts")
    elif set(plan.activations) & {"recompute", "offload_input"}:
        rows.append("from torch.utils.checkpoint import checkpoint")
    return "\n".join(["import torch", *sorted(rows)])


def to_fsdp2_code(plan: Plan) -> str:
    """Python source that shards a model as `plan` says with FSDP2 (torch.distributed.fsdp.fully_shard): a
    `fully_shard` per block and one for the root, with CPUOffloadPolicy when the optimizer is offloaded, bf16
    MixedPrecisionPolicy for "mixed_bf16", the prefetch depth through set_modules_to_forward_prefetch and
    set_modules_to_backward_prefetch, and each block's activation policy with torch's checkpoint and
    save_on_cpu. It defines apply_plan, make_optimizer and train_step; the comments at its top say what FSDP2
    cannot express of the plan."""
    offload = plan.optimizer_on != "device"
    streamed = offload or plan.params_on != "device"
    usage = ("Run under torchrun after torch.distributed.init_process_group: model = apply_plan(model); "
             "optimizer = make_optimizer(model, lr=<your model's learning rate>); then train_step(model, optimizer, "
             "micro_batches) per step (a Hugging Face model: with loss_of=lambda model, batch: model(**batch).loss).")
    policy = "CPUOffloadPolicy(pin_memory=pin_memory)" if offload else "OffloadPolicy()"
    mixed = ("MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
             if plan.precision == "mixed_bf16" else "MixedPrecisionPolicy()")
    fsdp = "from torch.distributed.fsdp import " + ", ".join(
        sorted({"CPUOffloadPolicy" if offload else "OffloadPolicy", "MixedPrecisionPolicy", "fully_shard"}))
    prefetch = plan.prefetch if plan.params_on != "device" else (1 if streamed else 0)
    where = (", which CPUOffloadPolicy keeps in host memory with their gradients:\n    the step runs on the CPU"
             if offload else " on the GPU")
    acts = any(p != "keep" for p in plan.activations)
    body = f'''

def apply_plan(model, blocks=None, mesh=None, pin_memory=True):
    """Shard `model` as the plan says; `blocks`: its transformer blocks in order (find_blocks(model) unless given).
    `pin_memory=False` where host memory cannot be pinned (no CUDA). Returns the model."""
    blocks = list(find_blocks(model) if blocks is None else blocks)
    if len(blocks) != len(POLICIES):
        raise ValueError(f"the plan has {{len(POLICIES)}} blocks, this model {{len(blocks)}}")
    options = dict(mesh=mesh, reshard_after_forward={streamed!r}, offload_policy={policy},
                   mp_policy={mixed})
    for block, policy in zip(blocks, POLICIES):
        {"_activations(block, policy, pin_memory)" if acts else "pass  # every block keeps its activations"}
        fully_shard(block, **options)
    fully_shard(model, **options)  # the root: the embeddings, the final norm and the head
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + PREFETCH])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - PREFETCH):i][::-1])
    return model


def make_optimizer(model, lr, weight_decay={WEIGHT_DECAY!r}):
    """torch's AdamW over the sharded parameters{where}."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
'''
    train = _TRAIN_STEP.format(
        forward="        loss = loss_of(model, batch)",
        sum_note=("  # reduce-scattered each time: the gradients add up in host memory" if offload else ""),
        clip=_clip(plan))
    code = "\n".join([
        _comment(_header(plan, "fsdp2", usage)),
        _imports(plan, [fsdp]), "",
        _constants(plan, PREFETCH=(prefetch, "blocks whose weights are fetched ahead of the one computing")),
        _policies(plan),
        _activation_code(plan),
    ]) + _FIND_BLOCKS + body + train
    return _tidy(code)


def to_torchao_code(plan: Plan) -> str:
    """Python source for a single GPU with torchao's CPUOffloadOptimizer (`from torchao.optim import
    CPUOffloadOptimizer`; its signature: params, optimizer_class, *, offload_gradients, minimal_size, **kwargs
    for the optimizer): the optimizer offloaded to host memory, each block's activation policy with torch's
    checkpoint and save_on_cpu, bf16 autocast for "mixed_bf16". It defines apply_plan, make_optimizer and
    train_step; the comments at its top say what torchao cannot express of the plan."""
    offload = plan.optimizer_on != "device"
    acts = any(p != "keep" for p in plan.activations)
    usage = ("One GPU (torchao's offload is single-GPU): model = apply_plan(model.cuda()); "
             "optimizer = make_optimizer(model, lr=<your model's learning rate>); then train_step(model, optimizer, "
             "micro_batches) per step (a Hugging Face model: with loss_of=lambda model, batch: model(**batch).loss).")
    if offload:
        make = ("CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=OFFLOAD_GRADIENTS,\n"
                "                               fused=True, lr=lr, weight_decay=weight_decay)")
        what = ("with its state, the parameters' copy and the update in host memory.\n    Build it after loading "
                "the weights: it copies them")
    else:
        make = "torch.optim.AdamW(model.parameters(), fused=True, lr=lr, weight_decay=weight_decay)"
        what = "on the GPU: the plan offloads nothing, so torchao's offload is not needed"
    body = f'''

def apply_plan(model, blocks=None, pin_memory=True):
    """Set each block's activation policy; `blocks`: the transformer blocks in order (find_blocks(model) unless
    given). The weights stay where the model is (on the GPU). Returns the model."""
    blocks = list(find_blocks(model) if blocks is None else blocks)
    if len(blocks) != len(POLICIES):
        raise ValueError(f"the plan has {{len(POLICIES)}} blocks, this model {{len(blocks)}}")
    for block, policy in zip(blocks, POLICIES):
        {"_activations(block, policy, pin_memory)" if acts else "pass  # every block keeps its activations"}
    return model


def make_optimizer(model, lr, weight_decay={WEIGHT_DECAY!r}):
    """AdamW {what}."""
    return {make}
'''
    forward = "        loss = loss_of(model, batch)"
    if plan.precision == "mixed_bf16":
        forward = ("        with torch.autocast(\"cuda\", dtype=torch.bfloat16):  # bf16 compute, fp32 weights\n"
                   "            loss = loss_of(model, batch)")
    train = _TRAIN_STEP.format(forward=forward, sum_note="", clip="" if offload else _clip(plan))
    more = {}
    if offload:
        more["OFFLOAD_GRADIENTS"] = (plan.grad_accum == 1, "frees GPU gradients; breaks gradient accumulation")
    code = "\n".join([
        _comment(_header(plan, "torchao", usage)),
        _imports(plan, ["from torchao.optim import CPUOffloadOptimizer"] if offload else []), "",
        _constants(plan, **more),
        _policies(plan),
        _activation_code(plan),
    ]) + _FIND_BLOCKS + body + train
    return _tidy(code)


def _tidy(code: str) -> str:
    """Two blank lines at most, one newline at the end."""
    while "\n\n\n\n" in code:
        code = code.replace("\n\n\n\n", "\n\n\n")
    return code.strip("\n") + "\n"
