"""A Hugging Face model's shape read from its config: the `ModelSpec` fields of a `transformers` config object or of
the dict of a model's config.json, for the model types whose layout ModelSpec describes (GPT-2; Llama, Mistral and
Qwen2; BERT). `ModelSpec.from_config` is the way in:

    spec = ModelSpec.from_config(json.load(open("config.json")), seq_len=4096)

Keys read (either name): hidden_size/n_embd, num_hidden_layers/n_layer, num_attention_heads/n_head,
num_key_value_heads, intermediate_size/n_inner, vocab_size, max_position_embeddings/n_positions (the default
context), tie_word_embeddings, hidden_act/activation_function, attention_bias, mlp_bias, the dropout probabilities,
BERT's type_vocab_size and architectures (BertForMaskedLM: the masked-LM head, no pooler; any other: the pooler, no
head; a task head of its own, e.g. a classifier, is not counted), and the attention a built model runs (a config
object's: "eager", written out, keeps the scores for backward; a config.json's default is the fused kernel).

What this is not: a loader (no weights, and transformers is never imported: a dict is enough), nor a way to describe
models of other layouts (mixture of experts, a head_dim apart from d_model / n_head, ...): describe those by hand,
ModelSpec(...) with its layout fields, where they fit at all.
"""

from __future__ import annotations

from collections.abc import Mapping

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "bert")
# model_type -> the biases of its q/k/v, its attention output and its MLP, when its config does not say
_BIASES = {"gpt2": (True, True, True), "llama": (False, False, False), "mistral": (False, False, False),
           "qwen2": (True, False, False), "bert": (True, True, True)}
_ACTIVATION_BY_DEFAULT = {"gpt2": "gelu_new", "llama": "silu", "mistral": "silu", "qwen2": "silu", "bert": "gelu"}
_TIED_BY_DEFAULT = {"gpt2": True, "llama": False, "mistral": False, "qwen2": False, "bert": True}
BY_HAND = ("ModelSpec(n_layer, d_model, n_head, vocab, seq_len, n_kv_head=..., d_ff=..., **LLAMA_LAYOUT) for a "
           "Llama-like decoder, or ModelSpec(...) with the layout fields its docstring lists")


def config_dict(config) -> dict:
    """The config as a dict: a mapping as it is, a transformers config object through its `to_dict()`."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"from_config takes a transformers config object or the dict of a config.json, got "
                    f"{type(config).__name__}")


def _get(cfg: dict, *names: str, default=KeyError):
    """The first of `names` the config sets (not None), else `default`; a missing required key is named."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is KeyError:
        raise ValueError(f"the {cfg.get('model_type')} config has no {' or '.join(map(repr, names))}: is it the "
                         "model's config.json?")
    return default


def spec_fields(config, seq_len: int | None = None) -> dict:
    """ModelSpec's fields for the model of `config` (module docstring), its context `seq_len` or the config's."""
    cfg = config_dict(config)
    # the attention a built model runs (a config object knows it; a config.json does not: torch's fused kernel,
    # transformers' default); written-out ("eager") attention keeps its scores for backward
    attention = getattr(config, "_attn_implementation", None) or cfg.get("attn_implementation") or "sdpa"
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        what = f"model_type {model_type!r}" if model_type else "a config without model_type"
        raise ValueError(f"ModelSpec.from_config reads {', '.join(SUPPORTED)}; got {what}. Describe the model by "
                         f"hand: {BY_HAND}")
    d = _get(cfg, "hidden_size", "n_embd")
    heads = _get(cfg, "num_attention_heads", "n_head")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and isinstance(d, int) and isinstance(heads, int) and head_dim * heads != d:
        raise ValueError(f"this {model_type} has heads of {head_dim} ({heads} heads) in a width of {d}; ModelSpec's "
                         f"heads are d_model / n_head wide. Describe it by hand: {BY_HAND}")
    context = _get(cfg, "max_position_embeddings", "n_positions", "n_ctx")
    qkv_bias, out_bias, mlp_bias = _BIASES[model_type]
    activation = _get(cfg, "hidden_act", "activation_function", default=_ACTIVATION_BY_DEFAULT[model_type])
    if "attention_bias" in cfg and model_type != "qwen2":
        qkv_bias = out_bias = bool(cfg["attention_bias"])
    fields = dict(n_layer=_get(cfg, "num_hidden_layers", "n_layer"), d_model=d, n_head=heads,
                  vocab=_get(cfg, "vocab_size"), seq_len=context if seq_len is None else seq_len,
                  d_ff=_get(cfg, "intermediate_size", "n_inner", default=None), qkv_bias=qkv_bias,
                  attn_out_bias=out_bias, mlp_bias=bool(cfg.get("mlp_bias", mlp_bias)),
                  tied_head=bool(cfg.get("tie_word_embeddings", _TIED_BY_DEFAULT[model_type])),
                  activation=activation, family=model_type, fused_attention=attention != "eager")
    if model_type in ("llama", "mistral", "qwen2"):
        fields.update(n_kv_head=_get(cfg, "num_key_value_heads", default=None), gated_mlp=True, norm="rmsnorm",
                      positions="rotary", dropout=False)
        return fields
    dropouts = ("resid_pdrop", "attn_pdrop") if model_type == "gpt2" else \
        ("hidden_dropout_prob", "attention_probs_dropout_prob")
    fields.update(n_positions=context, dropout=any(cfg.get(name, 0.1) > 0 for name in dropouts))
    if model_type == "bert":
        masked_lm = not cfg.get("architectures") or "BertForMaskedLM" in cfg["architectures"]
        fields.update(token_types=cfg.get("type_vocab_size", 2), embedding_norm=True, final_norm=False,
                      pooler=not masked_lm, mlm_head=masked_lm)
    if isinstance(context, int) and isinstance(fields["seq_len"], int) and fields["seq_len"] > context:
        raise ValueError(f"seq_len {fields['seq_len']} is longer than this {model_type}'s {context} learned "
                         f"positions: give a seq_len of at most {context}")
    return fields
