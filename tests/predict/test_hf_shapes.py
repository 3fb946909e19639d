"""ModelSpec of Hugging Face models: parameter counts and tensor order against models built from configs, the published
Llama-3-8B, the refusals; the activation formula of a modern block against what autograd saves, on the sim's ledger;
a Llama spec through the step model and the planner."""

import dataclasses
import json
from importlib.resources import files

import pytest
import torch

from minioffload.machine import profiles
from minioffload.planner import search as planner
from minioffload.predict import memory
from minioffload.predict.activation_cost import BlockShape
from minioffload.predict.block_activations import saved_terms
from minioffload.predict.shapes import LLAMA_LAYOUT, ModelSpec, tensor_numels
from minioffload.units import GB

LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
              "rope_theta": 500000.0}

def _hf():
    """tests/hf_models.py: tiny transformers models built from configs; the test skips without transformers."""
    return pytest.importorskip("hf_models")


MODELS = [("gpt2", {}), ("llama", {}), ("bert", {}), ("llama", {"num_key_value_heads": 1}),
          ("llama", {"tie_word_embeddings": True}), ("llama", {"attention_bias": True, "mlp_bias": True}),
          ("gpt2", {"n_inner": 50}), ("bert", {"type_vocab_size": 3, "intermediate_size": 40})]


@pytest.mark.parametrize("family,overrides", MODELS)
def test_from_config_counts_the_built_models_parameters_in_their_order(family, overrides):
    hf = _hf()
    model = hf.tiny(family, **overrides)
    spec = ModelSpec.from_config(model.config)
    numels = [p.numel() for p in model.parameters()]
    assert spec.num_params == sum(numels)
    assert tensor_numels(spec) == numels and spec.num_tensors == len(numels)
    assert ModelSpec.from_config(json.loads(model.config.to_json_string())) == spec  # a config.json's dict


@pytest.mark.parametrize("config_class", ["MistralConfig", "Qwen2Config"])
def test_mistral_and_qwen2_fall_out_of_the_llama_layout(config_class):
    transformers = _hf().transformers
    config = getattr(transformers, config_class)(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=88, vocab_size=64,
                                                 max_position_embeddings=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert tensor_numels(ModelSpec.from_config(config)) == [p.numel() for p in model.parameters()]


def test_bert_without_its_masked_lm_head_has_a_pooler():
    hf = _hf()
    config = hf.config("bert")
    model = hf.transformers.BertModel(config)
    spec = ModelSpec.from_config({**config.to_dict(), "architectures": ["BertModel"]})
    assert spec.pooler and not spec.mlm_head
    assert tensor_numels(spec) == [p.numel() for p in model.parameters()]


def test_llama_3_8b_from_its_published_config():
    spec = ModelSpec.from_config(LLAMA_3_8B)
    assert spec.num_params == 8_030_261_248
    assert str(spec).startswith("Llama of 8.03B (32 x 4096, 32 heads / 8 kv, SwiGLU 14336, context 8192")
    assert ModelSpec.from_config(LLAMA_3_8B, seq_len=2048).seq_len == 2048
    by_hand = ModelSpec(32, 4096, 32, 128256, 8192, n_kv_head=8, d_ff=14336, **LLAMA_LAYOUT)
    assert by_hand == spec
    shipped = json.loads(files("minioffload").joinpath("data/llama-3-8b.config.json").read_text())
    assert ModelSpec.from_config(shipped) == spec


@pytest.mark.parametrize("config,error,match", [
    ({**LLAMA_3_8B, "model_type": "t5"}, ValueError, r"reads gpt2, llama, mistral, qwen2, bert; got model_type 't5'"
                                                      r"\. Describe the model by hand: ModelSpec\("),
    ({"hidden_size": 64}, ValueError, "a config without model_type"),
    ({k: v for k, v in LLAMA_3_8B.items() if k != "num_hidden_layers"}, ValueError,
     "no 'num_hidden_layers' or 'n_layer'"),
    ({**LLAMA_3_8B, "head_dim": 256}, ValueError, "heads of 256"),
    ({**LLAMA_3_8B, "num_key_value_heads": 5}, ValueError, "must split into n_kv_head"),
    ("config.json", TypeError, "the dict of a config.json"),
])
def test_from_config_refuses_what_it_cannot_describe(config, error, match):
    with pytest.raises(error, match=match):
        ModelSpec.from_config(config)


def test_a_context_past_learned_positions_is_refused():
    hf = _hf()
    with pytest.raises(ValueError, match="at most 16"):
        ModelSpec.from_config(hf.config("gpt2"), seq_len=32)


@pytest.mark.parametrize("spec", [ModelSpec.of_params(7e9), ModelSpec.of_params(1.3e9, 4096),
                                  ModelSpec(2, 64, 4, 65, 32)])
def test_the_gpt_layout_keeps_todays_counts(spec):
    d = spec.d_model
    assert spec.block_params == 12 * d * d + 13 * d and spec.block_matmul_params == 12 * d * d
    assert spec.resident_params == (spec.vocab + spec.seq_len + 2) * d
    for fused in (True, False):
        s = dataclasses.replace(spec, fused_attention=fused)
        for value_bytes in (2, 4):
            today = memory.activation_bytes_per_layer(s.seq_len, 3, d, s.n_head, flash_attention=fused)
            assert s.activation_bytes_per_block(3, value_bytes) == today * value_bytes // 2
            old = BlockShape(s.seq_len, 3, d, s.n_head, value_bytes, fused)
            new = BlockShape.of(s, 3, value_bytes)
            assert (new.saved_bytes(), new.score_bytes(), new.saved_tensors(), new.forward_flops()) == \
                (old.saved_bytes(), old.score_bytes(), old.saved_tensors(), old.forward_flops())


# the measurement: one Llama block (4 heads / 2 kv, 256 wide, SwiGLU 688) and one GPT-2 block (4 heads, 256 wide),
# 2 sequences of 128 tokens, big enough that the formula's terms dominate
SIZES = {"llama": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688,
                       num_hidden_layers=2, max_position_embeddings=128),
         "gpt2": dict(n_embd=256, n_head=4, n_layer=2, n_positions=128)}
BATCH, SEQ = 2, 128


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_formula_is_what_autograd_saves_on_the_ledger(family, attention, dtype):
    """Per block, the ledger's count (chapter 7's: storages of 1024 values or more, once) is the formula's, exactly,
    but for the fused kernel's fp32 log-sum-exp (4 a s b bytes), which the formula leaves out; the norms'
    statistics are below 1024 values here, and the rotary tables, saved by every block, are counted apart."""
    from minioffload.course.saved_bytes import saved_bytes

    hf = _hf()
    torch.manual_seed(0)
    model = hf.tiny(family, dtype=dtype, attn_implementation=attention, **SIZES[family])
    blocks = model.model.layers if family == "llama" else model.transformer.h
    ids = torch.randint(0, hf.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    measured = saved_bytes(model, blocks, lambda: model(input_ids=ids, labels=ids).loss)
    spec = ModelSpec.from_config(model.config)  # the attention the model runs is in its config
    assert spec.fused_attention == (attention == "sdpa")
    value_bytes = dtype.itemsize
    formula = spec.activation_bytes_per_block(BATCH, value_bytes)
    log_sum_exp = 4 * spec.n_head * SEQ * BATCH if attention == "sdpa" else 0
    assert measured.per_block == (formula + log_sum_exp,) * 2
    assert abs(measured.per_block[0] - formula) <= 0.002 * formula
    head_dim = spec.d_model // spec.n_head
    assert measured.shared == (2 * SEQ * head_dim * value_bytes if family == "llama" else 0)  # rotary cos and sin
    if attention == "eager":
        assert saved_terms(SEQ, BATCH, spec.d_model, spec.n_head, spec.block_layout, False, value_bytes)["scores"] \
            == spec.n_head * SEQ * SEQ * BATCH * (6 if family == "llama" and value_bytes == 2 else value_bytes)


def test_a_modern_block_counts_its_own_terms():
    spec = ModelSpec.from_config(LLAMA_3_8B, seq_len=4096)
    s, b, h = 4096, 8, 4096
    # norms 2 x (4 + 2), qkv input 2, q 2, k and v 2 x 2 / 4, output 2, mlp input 2, SwiGLU 4 x 2 x 3.5: 49 s b h bytes
    assert spec.activation_bytes_per_block(b) == 49 * s * b * h
    block = BlockShape.of(spec, b)
    assert block.saved_bytes() == 49 * s * b * h and block.saved_tensors() == 14 + 2 + 1
    assert block.forward_flops() == 2 * s * b * spec.block_matmul_params + block.core_flops()


def test_a_llama_spec_flows_through_the_step_model_and_the_planner():
    spec = ModelSpec.from_config({**LLAMA_3_8B, "num_hidden_layers": 4, "hidden_size": 1024,
                                  "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "vocab_size": 32000}, seq_len=1024)
    work = spec.workload(4 * 1024)
    assert work.num_params == spec.num_params and work.resident_params == 2 * 32000 * 1024 + 1024
    plans = planner.search(spec, profiles.preset("rtx4090"), planner.Limits(batch=4, nvme_bytes=0, host_bytes=64 * GB))
    best = plans[0]
    assert best.model == spec and best.step_s > 0
    assert best.memory["device"] > spec.num_params * 2
