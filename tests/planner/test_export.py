"""minioffload.planner.export: the DeepSpeed configs pass DeepSpeed's own config classes (and a wrong one does not), the
FSDP2 code shards and trains the course GPT on the CPU as an unsharded AdamW step does, the torchao code compiles
and runs with a stand-in for torchao, and `unsupported` names what each system cannot express."""

import copy
import dataclasses
import itertools
import json
import re
import sys
import types

import pytest
import torch

from minioffload.model.gpt import GPT, GPTConfig
from minioffload.planner import export
from minioffload.planner.export import to_deepspeed_config as _to_deepspeed_config
from minioffload.planner.export import unsupported
from minioffload.planner.export_code import to_fsdp2_code, to_torchao_code
from minioffload.planner.plan import ModelSpec, Plan

SPEC = ModelSpec.of_preset("tiny")
LR = 3e-3  # the tests' learning rate (an export takes the user's)


def to_deepspeed_config(plan, *args, **kwargs):
    return _to_deepspeed_config(plan, *args, lr=LR, **kwargs)


def make_plan(**changes) -> Plan:
    plan = Plan(model=SPEC, hardware="h100-sxm", precision="mixed_bf16", micro_batch=2, grad_accum=4,
                optimizer_on="host", params_on="device", activations=("keep",) * SPEC.n_layer, step_s=0.1,
                memory={"device": 1 << 20, "host": 1 << 20, "nvme": 0})
    return dataclasses.replace(plan, **changes)


RESIDENT = make_plan(optimizer_on="device", precision="fp32")
HOST = make_plan()
NVME = make_plan(optimizer_on="nvme", memory={"device": 1 << 20, "host": 1 << 20, "nvme": 1 << 30})
STREAMED_HOST = make_plan(params_on="host", prefetch=1)
STREAMED_NVME = make_plan(optimizer_on="nvme", params_on="nvme", prefetch=2, activations=("recompute", "offload"),
                          memory={"device": 1 << 20, "host": 1 << 20, "nvme": 1 << 30})
ACTIVATIONS_OFFLOADED = make_plan(activations=("offload_input", "offload_input"))
HYBRID = make_plan(gpu_fraction=0.25)
DELAYED = make_plan(delay=True, activations=("selective", "recompute"))
PLANS = {"resident": RESIDENT, "host": HOST, "nvme": NVME, "streamed_host": STREAMED_HOST,
         "streamed_nvme": STREAMED_NVME, "activations_offloaded": ACTIVATIONS_OFFLOADED, "hybrid": HYBRID,
         "delayed": DELAYED}


# ------------------------------------------------------------------------------------------------------ DeepSpeed

@pytest.fixture(scope="module")
def ds():
    """DeepSpeed's config classes (a dev dependency: pyproject's `dev` extra installs it)."""
    from deepspeed.runtime import config
    from deepspeed.runtime.swap_tensor import aio_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return types.SimpleNamespace(DeepSpeedConfig=config.DeepSpeedConfig, DeepSpeedZeroConfig=DeepSpeedZeroConfig,
                                 get_aio_config=aio_config.get_aio_config, AIO_KEYS=set(aio_config.AIO_DEFAULT_DICT))


@pytest.mark.parametrize("name", PLANS)
def test_deepspeed_accepts_each_config(ds, name):
    plan = PLANS[name]
    cfg = to_deepspeed_config(plan, nvme_path="/local_nvme")
    json.dumps(cfg)  # a JSON config
    zero = ds.DeepSpeedZeroConfig(**cfg["zero_optimization"])  # pydantic, extra="forbid": no unknown key passes
    parsed = ds.DeepSpeedConfig(cfg)  # the whole config, as deepspeed.initialize reads it (world size 1 here)
    assert parsed.zero_config == zero
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) \
        == (plan.micro_batch * plan.grad_accum, plan.micro_batch, plan.grad_accum)
    assert parsed.bfloat16_config.enabled == (plan.precision == "mixed_bf16")
    assert not parsed.float16_config.enabled
    if "aio" in cfg:  # DeepSpeed reads the keys it knows and ignores the rest: all of ours must be known
        assert set(cfg["aio"]) <= ds.AIO_KEYS
        assert parsed.aio_config == ds.get_aio_config(cfg)
        assert {k: parsed.aio_config[k] for k in cfg["aio"]} == cfg["aio"]
    checkpointing = parsed.activation_checkpointing_config
    assert checkpointing.cpu_checkpointing == any(p.startswith("offload") for p in plan.activations)
    assert cfg["_minioffload"]["unsupported"] == unsupported(plan, "deepspeed")


def test_deepspeed_stage_and_offload_follow_the_plan(ds):
    def zero(plan):
        return ds.DeepSpeedZeroConfig(**to_deepspeed_config(plan)["zero_optimization"])

    assert zero(RESIDENT).stage == 0 and zero(RESIDENT).offload_optimizer is None
    host = zero(HOST)  # ZeRO-Offload
    assert host.stage == 2 and host.offload_optimizer.device == "cpu" and host.offload_param is None
    nvme = zero(NVME)  # ZeRO-2 keeps an "nvme" optimizer in host memory: its NVMe swapper is ZeRO-3's
    assert nvme.stage == 3 and nvme.offload_optimizer.device == "nvme" and nvme.offload_param is None
    assert str(nvme.offload_optimizer.nvme_path) == "/local_nvme"
    assert nvme.offload_optimizer.pipeline and nvme.offload_optimizer.buffer_count == 12
    assert nvme.sub_group_size == NVME.subgroup_numel
    streamed = zero(STREAMED_HOST)
    assert streamed.stage == 3 and streamed.offload_param.device == "cpu" and streamed.offload_optimizer.device == "cpu"
    assert streamed.prefetch_bucket_size == SPEC.block_params
    assert streamed.max_live_parameters == 2 * SPEC.block_params
    infinity = zero(STREAMED_NVME)  # ZeRO-Infinity
    assert infinity.offload_param.device == "nvme" and infinity.offload_optimizer.device == "nvme"
    assert infinity.prefetch_bucket_size == 2 * SPEC.block_params and infinity.offload_param.max_in_cpu == 0


def test_deepspeed_nvme_param_buffers_hold_the_largest_tensor(ds):
    """DeepSpeed's parameter swapper puts one tensor (its rank's partition) in each buffer and refuses a larger one."""
    model = GPT(GPTConfig.preset("tiny", vocab_size=SPEC.vocab))
    largest = max(p.numel() for p in model.parameters())
    for world_size in (1, 3):
        params = to_deepspeed_config(STREAMED_NVME, world_size)["zero_optimization"]["offload_param"]
        assert params["buffer_size"] >= -(-largest // world_size)
    assert params["buffer_count"] == export.LINEARS_PER_BLOCK * (STREAMED_NVME.prefetch + 2) + 2


def test_deepspeed_ratio_is_the_cpu_share(ds):
    """DeepSpeed's `ratio` is the share of subgroups updated on the CPU (ZeRO-3 puts subgroup i on the CPU when
    i >= int((1 - ratio) * n)); the plan's gpu_fraction is the GPU's share."""
    cfg = to_deepspeed_config(HYBRID)
    zero = ds.DeepSpeedZeroConfig(**cfg["zero_optimization"])
    assert zero.stage == 3 and zero.offload_optimizer.ratio == pytest.approx(0.75)
    n = 16
    on_gpu = sum(1 for i in range(n) if not i >= int((1 - zero.offload_optimizer.ratio) * n))
    assert on_gpu == HYBRID.gpu_fraction * n


def test_deepspeed_refuses_a_wrong_config(ds):
    """The validation above can fail: the same classes refuse these mistakes."""
    good = to_deepspeed_config(HYBRID)
    ds.DeepSpeedZeroConfig(**good["zero_optimization"])
    typo = copy.deepcopy(good)
    typo["zero_optimization"]["sub_group_sise"] = typo["zero_optimization"].pop("sub_group_size")
    with pytest.raises(ValueError, match="sub_group_sise"):
        ds.DeepSpeedZeroConfig(**typo["zero_optimization"])
    stage2 = copy.deepcopy(good)  # partial offload is ZeRO-3's alone: the reason a hybrid plan gets stage 3
    stage2["zero_optimization"]["stage"] = 2
    with pytest.raises(ValueError, match="Partial offloading"):
        ds.DeepSpeedZeroConfig(**stage2["zero_optimization"])
    disk = copy.deepcopy(to_deepspeed_config(STREAMED_NVME))
    disk["zero_optimization"]["offload_param"]["device"] = "disk"
    with pytest.raises(ValueError):
        ds.DeepSpeedConfig(disk)
    batch = copy.deepcopy(good)
    batch["train_batch_size"] += 1
    with pytest.raises(AssertionError, match="train_batch"):
        ds.DeepSpeedConfig(batch)


def test_deepspeed_batch_counts_every_gpu(ds, monkeypatch):
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda *args, **kwargs: 4)
    parsed = ds.DeepSpeedConfig(to_deepspeed_config(HOST, world_size=4))
    assert parsed.world_size == 4 and parsed.train_batch_size == 4 * HOST.micro_batch * HOST.grad_accum
    with pytest.raises(AssertionError):
        ds.DeepSpeedConfig(to_deepspeed_config(HOST, world_size=1))  # its batch is one GPU's
    with pytest.raises(ValueError, match="world_size"):
        to_deepspeed_config(HOST, world_size=0)
    four_ranks = dataclasses.replace(HOST, ranks=4)  # a plan made for 4 ranks: its config counts them all
    assert ds.DeepSpeedConfig(to_deepspeed_config(four_ranks)).train_batch_size == parsed.train_batch_size


def test_deepspeed_takes_the_users_lr_and_clips_as_the_plan():
    cfg = to_deepspeed_config(HOST)
    assert cfg["optimizer"]["params"]["lr"] == LR and cfg["gradient_clipping"] == HOST.options.max_grad_norm == 1.0
    with pytest.raises(TypeError, match="lr"):
        _to_deepspeed_config(HOST)  # no default: the course GPTs' rate would be far too large for a 70B model
    with pytest.raises(ValueError, match="positive learning rate"):
        _to_deepspeed_config(HOST, lr=0.0)
    assert "clip" in " ".join(unsupported(HOST, "torchao")).lower()
    assert "clip_grad_norm_(model.parameters(), 1.0)" in to_fsdp2_code(HOST)


def test_deepspeed_aio_follows_the_swapper_and_the_release():
    aio = to_deepspeed_config(NVME, block_size=1 << 18, workers=8, queue_depth=16)["aio"]
    assert aio["block_size"] == 1 << 18 and aio["intra_op_parallelism"] == 8 and aio["queue_depth"] == 16
    old = to_deepspeed_config(NVME, deepspeed_version="0.15.0")["aio"]  # before 0.16.4 the key was thread_count
    assert old["thread_count"] == export.WORKERS and "intra_op_parallelism" not in old
    assert "intra_op_parallelism" in to_deepspeed_config(NVME, deepspeed_version="0.16.4")["aio"]
    assert "aio" not in to_deepspeed_config(HOST)
    assert "_minioffload" not in to_deepspeed_config(HOST, comments=False)


# ------------------------------------------------------------------------------------------------- unsupported

def test_unsupported_names_what_each_system_lacks():
    for system in ("fsdp2", "torchao", "deepspeed"):
        assert any("delayed update" in gap for gap in unsupported(DELAYED, system)), system
        assert not any("delayed update" in gap for gap in unsupported(HOST, system)), system
    assert any("NVMe" in gap for gap in unsupported(NVME, "torchao"))
    assert any("NVMe" in gap for gap in unsupported(STREAMED_NVME, "fsdp2"))
    assert not any("NVMe" in gap for gap in unsupported(STREAMED_NVME, "deepspeed"))
    for system in ("fsdp2", "torchao"):
        assert any("gpu_fraction" in gap for gap in unsupported(HYBRID, system))
    assert not any("gpu_fraction" in gap for gap in unsupported(HYBRID, "deepspeed"))  # its `ratio`
    assert any("Streamed weights" in gap for gap in unsupported(STREAMED_HOST, "torchao"))
    assert any("accumulation" in gap for gap in unsupported(HOST, "torchao"))
    assert not any("accumulation" in gap for gap in unsupported(make_plan(grad_accum=1), "torchao"))
    assert any("'offload' policy" in gap for gap in unsupported(STREAMED_NVME, "deepspeed"))
    assert any("Selective" in gap for gap in unsupported(DELAYED, "deepspeed"))
    assert any("offload_input" in gap for gap in unsupported(ACTIVATIONS_OFFLOADED, "fsdp2"))
    assert any("ZeRO-3 only" in gap for gap in unsupported(HOST, "deepspeed"))
    for system in export.SYSTEMS:  # a plan that offloads nothing is every system's own
        assert unsupported(RESIDENT, system) == []
    with pytest.raises(ValueError, match="fsdp2"):
        unsupported(HOST, "megatron")


def _comment_text(code: str) -> str:
    """The comment lines of `code` joined back into running text."""
    lines = [line[1:].strip() for line in code.splitlines() if line.startswith("#")]
    return " ".join(line[2:] if line.startswith("- ") else line for line in lines)


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("system", ["fsdp2", "torchao"])
def test_code_carries_its_gaps(name, system):
    plan = PLANS[name]
    code = (to_fsdp2_code if system == "fsdp2" else to_torchao_code)(plan)
    text = re.sub(r"\s+", " ", _comment_text(code))
    for gap in unsupported(plan, system):
        assert gap in text


# ------------------------------------------------------------------------------------------------------- the code

def test_every_code_compiles():
    policies = ("keep", "recompute", "selective", "offload", "offload_input")
    homes = (("device", "device"), ("host", "device"), ("nvme", "device"), ("host", "host"), ("nvme", "nvme"))
    for acts, (optimizer_on, params_on), precision in itertools.product(
            itertools.product(policies, repeat=2), homes, ("fp32", "mixed_bf16")):
        plan = make_plan(activations=acts, optimizer_on=optimizer_on, params_on=params_on, precision=precision,
                         prefetch=1 if params_on != "device" else 0)
        for make in (to_fsdp2_code, to_torchao_code):
            compile(make(plan), "<plan>", "exec")


def test_fsdp2_code_uses_the_api():
    code = to_fsdp2_code(STREAMED_NVME)
    assert "offload_policy=CPUOffloadPolicy(pin_memory=pin_memory)" in code and "fully_shard(model, **options)" in code
    assert "PREFETCH = 2" in code and "set_modules_to_forward_prefetch" in code
    assert "param_dtype=torch.bfloat16" in code
    resident = to_fsdp2_code(RESIDENT)
    assert "CPUOffloadPolicy" not in resident and "reshard_after_forward=False" in resident


def test_torchao_code_uses_its_signature():
    code = to_torchao_code(HOST)
    assert "from torchao.optim import CPUOffloadOptimizer" in code
    assert "CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=OFFLOAD_GRADIENTS" in code
    assert "OFFLOAD_GRADIENTS = False" in code and "fused=True" in code
    assert "OFFLOAD_GRADIENTS = True" in to_torchao_code(make_plan(grad_accum=1))
    assert 'torch.autocast("cuda", dtype=torch.bfloat16)' in code
    assert "import torchao" not in to_torchao_code(RESIDENT) and "from torchao" not in to_torchao_code(RESIDENT)


def _batches(plan: Plan, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    shape = (plan.micro_batch, SPEC.seq_len)
    return [(torch.randint(0, SPEC.vocab, shape, generator=generator),
             torch.randint(0, SPEC.vocab, shape, generator=generator)) for _ in range(plan.grad_accum)]


def _reference_step(model, batches, max_grad_norm=None) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=export.WEIGHT_DECAY)
    loss = sum(model(*batch)[1] for batch in batches) / len(batches)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@pytest.fixture(scope="module")
def cpu_mesh(tmp_path_factory):
    """A one-process gloo group and its CPU mesh: FSDP2 runs on the CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("plan", [
    make_plan(precision="fp32", params_on="host", prefetch=1, grad_accum=2, activations=("recompute", "offload")),
    make_plan(precision="fp32", grad_accum=2, activations=("selective", "offload_input")),
    dataclasses.replace(RESIDENT, grad_accum=2)], ids=["streamed", "resident_weights", "nothing_offloaded"])
def test_fsdp2_code_trains_as_an_unsharded_step(cpu_mesh, plan):
    """The code runs: sharded (with CPUOffloadPolicy where the plan offloads), each block's policy, the prefetch
    set, two micro-batches summed; the step equals torch's AdamW on an unsharded copy."""
    namespace: dict = {}
    exec(compile(to_fsdp2_code(plan), "<plan>", "exec"), namespace)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=SPEC.vocab))
    reference = copy.deepcopy(model)
    namespace["apply_plan"](model, mesh=cpu_mesh, pin_memory=False)
    optimizer = namespace["make_optimizer"](model, lr=LR)
    batches = _batches(plan)
    loss = namespace["train_step"](model, optimizer, batches)
    assert loss.item() == pytest.approx(_reference_step(reference, batches, plan.options.max_grad_norm), rel=1e-6)
    for (name, sharded), plain in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert type(sharded).__name__ == "DTensor" and sharded.device.type == "cpu"
        torch.testing.assert_close(sharded.full_tensor(), plain, msg=name)


def test_torchao_code_runs_with_a_stand_in(monkeypatch):
    """torchao is not a dependency: a stand-in with CPUOffloadOptimizer's signature runs the code's logic."""
    made = {}

    def cpu_offload_optimizer(params, optimizer_class, *, offload_gradients=False, minimal_size=4096, **kwargs):
        made.update(optimizer_class=optimizer_class, offload_gradients=offload_gradients, kwargs=kwargs)
        kwargs.pop("fused")  # torch's fused AdamW on the CPU tensors torchao would make
        return optimizer_class(params, **kwargs)

    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.optim", types.SimpleNamespace(CPUOffloadOptimizer=cpu_offload_optimizer))
    plan = make_plan(precision="fp32", grad_accum=2, activations=("offload", "selective"))
    namespace: dict = {}
    exec(compile(to_torchao_code(plan), "<plan>", "exec"), namespace)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=SPEC.vocab))
    reference = copy.deepcopy(model)
    optimizer = namespace["make_optimizer"](namespace["apply_plan"](model, pin_memory=False), lr=LR)
    assert made["optimizer_class"] is torch.optim.AdamW and made["offload_gradients"] is False
    batches = _batches(plan, seed=1)
    loss = namespace["train_step"](model, optimizer, batches)
    assert loss.item() == pytest.approx(_reference_step(reference, batches), rel=1e-6)
    for mine, plain in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, plain)


@pytest.mark.parametrize("export_code", [to_fsdp2_code, to_torchao_code], ids=["fsdp2", "torchao"])
def test_the_exported_code_finds_a_hugging_face_models_blocks(export_code, monkeypatch):
    hf_models = pytest.importorskip("hf_models")
    stacks = {"llama": lambda m: m.model.layers, "gpt2": lambda m: m.transformer.h,
              "bert": lambda m: m.bert.encoder.layer}
    models = {family: hf_models.tiny(family) for family in stacks}  # first: transformers looks for torchao
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))  # only its import runs here
    monkeypatch.setitem(sys.modules, "torchao.optim", types.SimpleNamespace(CPUOffloadOptimizer=None))
    namespace: dict = {}
    exec(compile(export_code(make_plan(precision="fp32", activations=("recompute", "keep"))), "<plan>", "exec"),
         namespace)
    for family, model in models.items():
        assert namespace["find_blocks"](model) == list(stacks[family](model))
    with pytest.raises(ValueError, match="pass apply_plan"):
        namespace["find_blocks"](torch.nn.Linear(2, 2))
