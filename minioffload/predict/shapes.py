"""The shape of a GPT (`ModelSpec`): its blocks, width, heads, vocabulary and context, and what follows from them:
parameters per block and outside the blocks, the parameter tensors' sizes in the model's order, one step's
`Workload` for the step model; and GPT-3's shape family (Brown et al. 2020, Table 2.1: `shape`, `shape_for`, `Shape`
with GPT-3's vocabulary and context), interpolated between the table's rows and extrapolated beyond 175B.

    spec = ModelSpec.of_params(70e9, seq_len=4096)      # a GPT-3-family shape of about 70B parameters
    spec = ModelSpec.of_preset("small")                 # one of the course's GPTs (models.GPTConfig presets)
    tensor_numels(spec)                                 # [vocab x d, seq_len x d, per block 12 tensors ..., d, d]

What this is not: the GPT itself (model/gpt.py builds it), nor where its state lives (options.Placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from .step_config import Workload


def tensor_numels(model: ModelSpec) -> list[int]:
    """The parameters' sizes in models.GPT's order: embeddings, each block (LayerNorm, QKV, projection, LayerNorm,
    MLP in and out, with biases), the final LayerNorm; the head is tied to the token embedding."""
    d = model.d_model
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [model.vocab * d, model.seq_len * d, *block * model.n_layer, d, d]


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: `n_layer` blocks `d_model` wide with `n_head` heads, a vocabulary of `vocab` tokens, context
    `seq_len`, biases and a tied head (models.GPT and GPT-3's layout). `preset`: the course GPT it is, if any.
    `fused_attention`: its attention is one fused kernel that keeps no attention scores for backward (torch's
    `scaled_dot_product_attention`, which models.GPT calls; flash attention); False for an attention written out as
    softmax(q k^T) v, which keeps them."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    preset: str | None = None
    fused_attention: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"ModelSpec: d_model ({self.d_model}) must split into n_head ({self.n_head}) heads")
        if not isinstance(self.fused_attention, bool):
            raise ValueError(f"ModelSpec.fused_attention must be True or False, got {self.fused_attention!r}")

    @property
    def block_params(self) -> int:
        """Attention (4 d^2 + 4 d), MLP (8 d^2 + 5 d), two LayerNorms (4 d)."""
        return 12 * self.d_model ** 2 + 13 * self.d_model

    @property
    def resident_params(self) -> int:
        """Token and position embeddings (the head is tied to the first) and the final LayerNorm."""
        return (self.vocab + self.seq_len + 2) * self.d_model

    @property
    def num_params(self) -> int:
        return self.n_layer * self.block_params + self.resident_params

    @property
    def block_tensors(self) -> int:
        """Tensors per block as the step model counts them: the blocks' share of num_tensors, by parameters."""
        return max(1, round(self.num_tensors * self.block_params / self.num_params))

    @property
    def num_tensors(self) -> int:
        return len(tensor_numels(self))  # per block: 4 Linear (weight, bias) and 2 LayerNorm (weight, bias)

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

    def __str__(self) -> str:
        what = f"GPT '{self.preset}'" if self.preset else "GPT"
        return f"{what} of {self.num_params / 1e9:.3g}B ({self.n_layer} x {self.d_model}, {self.n_head} heads, " \
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
