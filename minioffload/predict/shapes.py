"""The shape of a GPT (`ModelSpec`): its blocks, width, heads, vocabulary and context, and what follows from them:
parameters per block and outside the blocks, the parameter tensors' sizes in the model's order, one step's
`Workload` for the step model.

    spec = ModelSpec.of_params(70e9, seq_len=4096)      # a GPT-3-family shape of about 70B parameters
    spec = ModelSpec.of_preset("small")                 # one of the course's GPTs (models.GPTConfig presets)
    tensor_numels(spec)                                 # [vocab x d, seq_len x d, per block 12 tensors ..., d, d]

What this is not: the GPT itself (model/gpt.py builds it), nor where its state lives (options.Placement).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    `seq_len`, biases and a tied head (models.GPT and GPT-3's layout). `preset`: the course GPT it is, if any."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    preset: str | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"ModelSpec: d_model ({self.d_model}) must split into n_head ({self.n_head}) heads")

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
    def num_tensors(self) -> int:
        return len(tensor_numels(self))  # per block: 4 Linear (weight, bias) and 2 LayerNorm (weight, bias)

    def workload(self, tokens: int, precision: str = "mixed_bf16", recompute: bool = False) -> Workload:
        """One step of `tokens` tokens of this model, for the step model."""
        return Workload(self.num_params, tokens, precision, self.num_tensors, recompute, self.n_layer,
                        self.resident_params)

    @classmethod
    def of_params(cls, num_params: float, seq_len: int = 2048, vocab: int = 50257) -> ModelSpec:
        """GPT-3's shape family (streaming_cost.shape_for) at about `num_params` parameters."""
        from .streaming_cost import shape_for

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
