"""The shape of a transformer (`ModelSpec`): its blocks, width, heads, vocabulary and context, and the layout of
its block (the course's GPT and GPT-3 by default; Llama's RMSNorm, SwiGLU, grouped-query attention and rotary
positions; BERT's encoder), and what follows from them: parameters per block and outside the blocks, the parameter
tensors' sizes in the model's order, the activations one block keeps, one step's `Workload` for the step model; and
GPT-3's shape family (Brown et al. 2020, Table 2.1: `shape`, `shape_for`, `Shape` with GPT-3's vocabulary and
context), interpolated between the table's rows and extrapolated beyond 175B.

    spec = ModelSpec.of_params(70e9, seq_len=4096)      # a GPT-3-family shape of about 70B parameters
    spec = ModelSpec.of_preset("small")                 # one of the course's GPTs (models.GPTConfig presets)
    spec = ModelSpec.from_config(json.load(open("config.json")))    # a Hugging Face model (hf_shapes.py)
    spec = ModelSpec(16, 2048, 32, 128256, 8192, n_kv_head=8, d_ff=8192, **LLAMA_LAYOUT)    # one by hand
    tensor_numels(spec)                                 # [vocab x d, seq_len x d, per block 12 tensors ..., d, d]

What this is not: the model itself (model/gpt.py builds the course's GPT), nor where its state lives
(options.Placement), nor the activation formula (block_activations.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from .block_activations import NORMS, BlockLayout, block_saved_bytes
from .step_config import Workload

# family -> how str() names it; the family also sets the parameters' order (tensor_numels)
FAMILIES = {"gpt": "GPT", "gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "bert": "BERT"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
POSITIONS = ("learned", "rotary")
# a Llama's fields (Llama 2 and 3, Mistral) beyond its sizes: ModelSpec(..., n_kv_head=..., d_ff=..., **LLAMA_LAYOUT)
LLAMA_LAYOUT = dict(family="llama", gated_mlp=True, norm="rmsnorm", qkv_bias=False, attn_out_bias=False,
                    mlp_bias=False, tied_head=False, positions="rotary", dropout=False, activation="silu")


def tensor_numels(model: ModelSpec) -> list[int]:
    """The parameters' sizes in the model's order (`model.parameters()`, a tied head once). GPT (models.GPT, GPT-2):
    embeddings, each block (norm, QKV in one matrix, projection, norm, MLP in and out, biases after their weights),
    the final norm. Llama: the token embedding, each block (q, k, v, o, gate, up, down, the two norms), the final
    norm, the head unless tied. BERT: the embeddings and their norm, each block (q, k, v, o, norm, MLP in and out,
    norm), the pooler, the masked-LM head (its output bias, then its transform)."""
    d, f, kv = model.d_model, model.ffn_width, model.kv_heads * (model.d_model // model.n_head)

    def linear(rows: int, cols: int, bias: bool) -> list[int]:
        return [rows * cols, rows] if bias else [rows * cols]

    norm = [d, d] if model.norm == "layernorm" else [d]
    mlp_in = [*linear(f, d, model.mlp_bias), *linear(f, d, model.mlp_bias)] if model.gated_mlp else \
        linear(f, d, model.mlp_bias)
    mlp = [*mlp_in, *linear(d, f, model.mlp_bias)]
    out = linear(d, d, model.attn_out_bias)
    if model.family in LLAMA_FAMILY:
        qkv = [*linear(d, d, model.qkv_bias), *linear(kv, d, model.qkv_bias), *linear(kv, d, model.qkv_bias)]
        block = [*qkv, *out, *mlp, *norm, *norm]
    elif model.family == "bert":
        qkv = [*linear(d, d, model.qkv_bias), *linear(kv, d, model.qkv_bias), *linear(kv, d, model.qkv_bias)]
        block = [*qkv, *out, *norm, *mlp, *norm]
    else:
        block = [*norm, *linear(d + 2 * kv, d, model.qkv_bias), *out, *norm, *mlp]
    embeddings = [model.vocab * d]
    if model.positions == "learned":
        embeddings.append(model.position_rows * d)
    if model.token_types:
        embeddings.append(model.token_types * d)
    embeddings += norm if model.embedding_norm else []
    after = [*(norm if model.final_norm else []), *([] if model.tied_head else [model.vocab * d])]
    after += linear(d, d, True) if model.pooler else []
    after += [model.vocab, *linear(d, d, True), *norm] if model.mlm_head else []
    return [*embeddings, *block * model.n_layer, *after]


@dataclass(frozen=True)
class ModelSpec:
    """A transformer: `n_layer` blocks `d_model` wide with `n_head` heads, a vocabulary of `vocab` tokens, context
    `seq_len`. `preset`: the course GPT it is, if any. `fused_attention`: its attention is one fused kernel that keeps
    no attention scores for backward (torch's `scaled_dot_product_attention`, which models.GPT calls; flash
    attention); False for an attention written out as softmax(q k^T) v, which keeps them.

    The rest is the layout, by default models.GPT's and GPT-3's (biases, LayerNorm, a tied head, learned positions):
    n_kv_head      key/value heads, grouped-query attention (None: n_head)
    d_ff           the MLP's inner width (None: 4 d_model)
    gated_mlp      SwiGLU: gate, up and down matrices (else two)
    norm           "layernorm" (weight and bias) or "rmsnorm" (weight)
    qkv_bias, attn_out_bias, mlp_bias    biases on q/k/v, on the attention's output projection, on the MLP's matrices
    tied_head      the LM head is the token embedding (else a vocab x d_model matrix of its own)
    positions      "learned" (a table of n_positions rows, None: seq_len) or "rotary" (no parameters)
    final_norm     a norm after the last block (BERT's post-norm encoder has none)
    dropout        the blocks drop out: the activation count keeps the masks (Korthikanti et al.'s count)
    activation     the MLP's, by transformers' name (its written-out "gelu_new" keeps more for backward)
    token_types, embedding_norm, pooler, mlm_head      BERT: token-type embedding rows, a norm on the embeddings,
                   the pooler (d x d with bias), the masked-LM head's transform (d x d, a norm) and output bias
    family         what it is: "gpt", "gpt2", "llama", "mistral", "qwen2", "bert" (names it; orders its tensors)"""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    preset: str | None = None
    fused_attention: bool = True
    n_kv_head: int | None = None
    d_ff: int | None = None
    gated_mlp: bool = False
    norm: str = "layernorm"
    qkv_bias: bool = True
    attn_out_bias: bool = True
    mlp_bias: bool = True
    tied_head: bool = True
    positions: str = "learned"
    n_positions: int | None = None
    final_norm: bool = True
    dropout: bool = True
    activation: str = "gelu"
    token_types: int = 0
    embedding_norm: bool = False
    pooler: bool = False
    mlm_head: bool = False
    family: str = "gpt"

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        for name in ("n_kv_head", "d_ff", "n_positions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelSpec.{name} must be a positive int or None (the default), got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"ModelSpec: d_model ({self.d_model}) must split into n_head ({self.n_head}) heads")
        if self.n_head % self.kv_heads:
            raise ValueError(f"ModelSpec: n_head ({self.n_head}) must split into n_kv_head ({self.kv_heads}) groups")
        for name in ("fused_attention", "gated_mlp", "qkv_bias", "attn_out_bias", "mlp_bias", "tied_head",
                     "final_norm", "dropout", "embedding_norm", "pooler", "mlm_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelSpec.{name} must be True or False, got {getattr(self, name)!r}")
        for name, allowed in (("norm", NORMS), ("positions", POSITIONS), ("family", tuple(FAMILIES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelSpec.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if isinstance(self.token_types, bool) or not isinstance(self.token_types, int) or self.token_types < 0:
            raise ValueError(f"ModelSpec.token_types must be an int >= 0, got {self.token_types!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_width(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (0 with rotary positions)."""
        if self.positions != "learned":
            return 0
        return self.seq_len if self.n_positions is None else self.n_positions

    @property
    def block_matmul_params(self) -> int:
        """The weights of a block's matrices: q and the output projection (d^2 each), k and v (d x kv width each),
        the MLP's two or three (d x d_ff each). A GPT's: 12 d^2."""
        d, kv = self.d_model, self.kv_heads * (self.d_model // self.n_head)
        return 2 * d * d + 2 * d * kv + (3 if self.gated_mlp else 2) * d * self.ffn_width

    @property
    def block_params(self) -> int:
        """The matrices (block_matmul_params), their biases and two norms. A GPT's: 12 d^2 + 13 d."""
        d, f, kv = self.d_model, self.ffn_width, self.kv_heads * (self.d_model // self.n_head)
        biases = self.qkv_bias * (d + 2 * kv) + self.attn_out_bias * d
        biases += self.mlp_bias * ((2 if self.gated_mlp else 1) * f + d)
        return self.block_matmul_params + biases + 2 * self._norm_params

    @property
    def resident_params(self) -> int:
        """Everything outside the blocks: embeddings (token, positions, token types, their norm), the final norm, the
        head unless tied to the token embedding, BERT's pooler and masked-LM head."""
        d = self.d_model
        params = (self.vocab + self.position_rows + self.token_types) * d
        params += self._norm_params * (self.embedding_norm + self.final_norm)
        params += 0 if self.tied_head else self.vocab * d
        params += (d * d + d) * self.pooler
        params += (self.vocab + d * d + d + self._norm_params) * self.mlm_head
        return params

    @property
    def _norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    @property
    def num_params(self) -> int:
        return self.n_layer * self.block_params + self.resident_params

    @property
    def block_tensors(self) -> int:
        """Tensors per block as the step model counts them: the blocks' share of num_tensors, by parameters."""
        return max(1, round(self.num_tensors * self.block_params / self.num_params))

    @property
    def num_tensors(self) -> int:
        return len(tensor_numels(self))  # a GPT block: 4 Linear (weight, bias) and 2 LayerNorm (weight, bias)

    @property
    def block_layout(self) -> BlockLayout:
        """The block as the activation formula sees it (block_activations.py)."""
        return BlockLayout(self.kv_heads, self.ffn_width, self.gated_mlp, self.norm, self.dropout,
                           fp32_softmax=self.family in LLAMA_FAMILY, activation=self.activation)

    def activation_bytes_per_block(self, batch_size: int, value_bytes: int = 2, seq_len: int | None = None) -> int:
        """Bytes one block keeps for backward with `batch_size` sequences of `seq_len` tokens (default: the
        context) at `value_bytes` per value (block_activations.py's terms; for a GPT,
        memory.activation_bytes_per_layer x value_bytes / 2)."""
        return block_saved_bytes(self.seq_len if seq_len is None else seq_len, batch_size, self.d_model,
                                 self.n_head, self.block_layout, self.fused_attention, value_bytes)

    def workload(self, tokens: int, precision: str = "mixed_bf16", recompute: bool = False) -> Workload:
        """One step of `tokens` tokens of this model, for the step model."""
        return Workload(self.num_params, tokens, precision, self.num_tensors, recompute, self.n_layer,
                        self.resident_params)

    @classmethod
    def of_params(cls, num_params: float, seq_len: int = 2048, vocab: int = 50257) -> ModelSpec:
        """GPT-3's shape family (streaming_cost.shape_for) at about `num_params` parameters."""
        if not num_params >= 1e8:
            raise ValueError(f"num_params must be at least 1e8 for a GPT-3-family shape (the smallest, GPT-3 Small, "
                             f"has 125M); got {num_params!r}. For a course GPT use ModelSpec.of_preset")
        s = shape_for(num_params)
        return cls(s.n_layer, s.d_model, s.n_head, vocab, seq_len)

    @classmethod
    def of_preset(cls, name: str, block_size: int | None = None, vocab: int | None = None) -> ModelSpec:
        """A course GPT (models.GPTConfig preset) on the bundled text's characters unless `vocab` is given."""
        from ..model.gpt import CharTokenizer, GPTConfig, load_text

        if vocab is None:
            vocab = CharTokenizer(load_text()).vocab_size
        overrides = {} if block_size is None else {"block_size": block_size}
        c = GPTConfig.preset(name, vocab_size=vocab, **overrides)
        return cls(c.n_layer, c.n_embd, c.n_head, vocab, c.block_size, preset=name)

    @classmethod
    def from_config(cls, config, seq_len: int | None = None) -> ModelSpec:
        """A Hugging Face model's shape from its config: a `transformers` config object or the dict of its
        config.json (gpt2, llama, mistral, qwen2, bert; hf_shapes.py). `seq_len`: default its context."""
        from .hf_shapes import spec_fields

        return cls(**spec_fields(config, seq_len))

    def __str__(self) -> str:
        what = f"GPT '{self.preset}'" if self.preset else FAMILIES[self.family]
        heads = f"{self.n_head} heads" + (f" / {self.kv_heads} kv" if self.kv_heads != self.n_head else "")
        extra = f", SwiGLU {self.ffn_width}" if self.gated_mlp else \
            (f", MLP {self.ffn_width}" if self.ffn_width != 4 * self.d_model else "")
        return f"{what} of {self.num_params / 1e9:.3g}B ({self.n_layer} x {self.d_model}, {heads}{extra}, " \
               f"context {self.seq_len})"


# GPT-3's shape family (chapter 8's streamed models, the planner's models of a size) --------------------
VOCAB, CONTEXT = 50257, 2048
# name -> (n_layer, d_model, n_head), Brown et al. 2020, Table 2.1
GPT3 = {
    "GPT-3 Small": (12, 768, 12), "GPT-3 Medium": (24, 1024, 16), "GPT-3 Large": (24, 1536, 16),
    "GPT-3 XL": (24, 2048, 16),  # the table's 24 heads of 128 do not make 2048: 16 here
    "GPT-3 2.7B": (32, 2560, 32), "GPT-3 6.7B": (32, 4096, 32),
    "GPT-3 13B": (40, 5120, 40),  # the table's d_model 5140 does not split into 40 heads: 5120 here
    "GPT-3 175B": (96, 12288, 96),
}


@dataclass(frozen=True)
class Shape(ModelSpec):
    """A GPT of `n_layer` blocks, `d_model` wide, `n_head` heads, with GPT-3's vocabulary and context; its workload
    recomputes every block in backward."""

    vocab: int = VOCAB
    seq_len: int = CONTEXT

    def workload(self, tokens: int, precision: str = "mixed_bf16", recompute: bool = True) -> Workload:
        return super().workload(tokens, precision, recompute)

    def __str__(self) -> str:
        return f"{self.num_params / 1e9:.1f}B ({self.n_layer} x {self.d_model})"


def shape(d_model: int) -> Shape:
    """The family's shape of width `d_model` (a multiple of 128, at least 768)."""
    if d_model % 128 or d_model < 768:
        raise ValueError(f"d_model must be a multiple of 128, at least 768, got {d_model!r}")
    rows = sorted(GPT3.values(), key=lambda row: row[1])
    for n_layer, d, n_head in rows:
        if d == d_model:
            return Shape(n_layer, d, n_head)
    for (l0, d0, _), (l1, d1, _) in pairwise(rows):
        if d0 < d_model < d1:
            return Shape(round(l0 + (l1 - l0) * (d_model - d0) / (d1 - d0)), d_model, d_model // 128)
    return Shape(d_model // 128, d_model, d_model // 128)  # beyond 175B: 175B's aspect ratio


def shape_for(num_params: float) -> Shape:
    """The family's shape whose parameter count is closest to `num_params`."""
    d = 768
    while shape(d + 128).num_params <= num_params:
        d += 128
    return min(shape(d), shape(d + 128), key=lambda s: abs(s.num_params - num_params))
