"""Tiny Hugging Face models for the tests, built from configs in code (no download): GPT-2, Llama (RMSNorm, SwiGLU,
grouped-query attention, rotary positions) and BERT, each with a loss and seeded batches.

    model = tiny("llama")                        # seeded weights, dropout off, no KV cache
    loss = loss_of(model, batch("llama", seed=3))

The tests import transformers through here only; without it (the `integrations` extra) they skip.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

FAMILIES = ("gpt2", "llama", "bert")
VOCAB, SEQ, BATCH = 64, 16, 2


def config(family: str, **overrides):
    """A small config of `family` (2 blocks, 32 wide), dropout off and no KV cache, so runs compare exactly."""
    if family == "gpt2":
        fields = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        fields.update(overrides)
        return transformers.GPT2Config(**fields)
    if family == "llama":
        fields = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=88, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      tie_word_embeddings=False)
        fields.update(overrides)
        return transformers.LlamaConfig(**fields)
    if family == "bert":
        fields = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=128,
                      vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
        fields.update(overrides)
        return transformers.BertConfig(**fields)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def tiny(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """The model of `config(family)` with seeded weights, in `dtype`: a causal LM, or BERT with its masked-LM head."""
    torch.manual_seed(seed)
    cfg = config(family, **overrides)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg)
    return model.to(dtype).train()


def batch(family: str, seed: int = 0) -> dict:
    """Inputs and labels for `family`'s model, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone() if family != "bert" else torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": labels}


def loss_of(model, inputs: dict) -> torch.Tensor:
    return model(**inputs).loss
