"""The bytes one transformer block keeps for its backward pass, term by term: Korthikanti et al.'s count (2022) of a
GPT block, and the same count for the modern block of Llama, Mistral and Qwen2 (RMSNorm, SwiGLU, grouped-query
attention, rotary positions, no dropout) as Hugging Face's transformers runs them.

    llama = BlockLayout(kv_heads=8, ffn=14336, gated_mlp=True, norm="rmsnorm", dropout=False, fp32_softmax=True)
    saved_terms(2048, 4, 4096, 32, llama)          # {term: bytes} of one Llama-3-8B block, 4 x 2048 tokens, bf16
    block_saved_bytes(2048, 4, 4096, 32, llama)    # their sum (ModelSpec.activation_bytes_per_block answers it)

With s tokens per sequence, b sequences, h = hidden, f = ffn, a heads, r = kv_heads / heads and v bytes per value,
every term is one tensor autograd saves (views of one storage once; weights are not activations):

    norm input            LayerNorm: its input, v s b h. RMSNorm: an fp32 copy of its input, 4 s b h whatever v
                          (transformers' RMSNorm computes in fp32), and the normalized values before the weight
                          multiplies them, v s b h (the weight's gradient needs them). Two norms per block.
    qkv input             the norm's output, kept once by the q, k and v projections, v s b h
    q, k and v            fused attention: q v s b h, k and v 2 r v s b h (narrower with GQA; q and k after rotary);
                          written out: 3 v s b h (k and v repeated to every head, as transformers' eager attention
                          does), q and k^T kept by q k^T, v by the product with the probabilities
    attention output      the output projection's input, v s b h (a fused kernel keeps the same tensor)
    scores                written out only: the softmax's output, v a s^2 b; with dropout also its 1-byte mask and
                          the dropped-out probabilities (Korthikanti's 5 a s^2 b at v = 2); with `fp32_softmax`
                          (transformers' Llama family's eager attention) the fp32 probabilities and their cast to
                          v bytes, (4 + v) per score below fp32
    mlp input             the second norm's output, kept once by the MLP's first matrices, v s b h
    mlp                   plain: the activation's input and the second matrix's input, 2 v s b f (HF's "gelu_new" is
                          written out elementwise and keeps three tensors more: 0.5 x, tanh(...), 1 + tanh(...));
                          gated (SwiGLU): the gate (SiLU's input), SiLU's output, up, and their product (the down
                          projection's input), 4 v s b f
    dropout masks         with dropout: after the attention and after the MLP, 1 byte per value at v = 2

Left out, as Korthikanti et al. leave them out: the norms' statistics (s b values each), a fused attention kernel's
log-sum-exp (fp32, a s b), and the rotary cos/sin tables (2 s h / a values, computed once per forward and shared by
every block). The masks scale with v like the rest (2 bytes at fp32, where torch's bool masks take 1), so a GPT
block's count is exactly `memory.activation_bytes_per_layer` x v / 2 at every value size.

What this is not: a measurement (course/saved_bytes.py counts what autograd saves), nor the policies' costs
(activation_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass

NORMS = ("layernorm", "rmsnorm")
WRITTEN_OUT_ACTIVATIONS = {"gelu_new": 3}  # extra s b f tensors an activation written out elementwise keeps


@dataclass(frozen=True)
class BlockLayout:
    """What a block is made of, beyond its width and heads; the defaults are a GPT block (Korthikanti et al.'s).

    kv_heads: key/value heads (grouped-query attention; None: as many as the query heads). ffn: the MLP's inner
    width (None: 4 x hidden). gated_mlp: SwiGLU's gate, up and down matrices. norm: "layernorm" or "rmsnorm".
    dropout: the block drops out (its masks are kept). fp32_softmax: a written-out attention computes its softmax in
    fp32 and casts it (transformers' Llama family). activation: the MLP's, by transformers' name ("gelu_new" is
    written out elementwise and keeps more)."""

    kv_heads: int | None = None
    ffn: int | None = None
    gated_mlp: bool = False
    norm: str = "layernorm"
    dropout: bool = True
    fp32_softmax: bool = False
    activation: str = "gelu"

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        for name in ("kv_heads", "ffn"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"BlockLayout.{name} must be a positive int or None, got {value!r}")


GPT_BLOCK = BlockLayout()


def saved_terms(seq_len: int, batch_size: int, hidden: int, heads: int, layout: BlockLayout = GPT_BLOCK,
                fused_attention: bool = True, value_bytes: int = 2) -> dict[str, int]:
    """The bytes of each term above for one block of `layout` (module docstring)."""
    for value, what in ((seq_len, "seq_len"), (batch_size, "batch_size"), (hidden, "hidden"), (heads, "heads")):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    kv_heads = heads if layout.kv_heads is None else layout.kv_heads
    ffn = 4 * hidden if layout.ffn is None else layout.ffn
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must split into heads ({heads}), and heads into kv_heads ({kv_heads})")
    if value_bytes not in (2, 4):
        raise ValueError(f"value_bytes must be 2 (16-bit) or 4 (fp32), got {value_bytes!r}")
    v, sbh, sbf = value_bytes, seq_len * batch_size * hidden, seq_len * batch_size * ffn
    norm = v * sbh if layout.norm == "layernorm" else (4 + v) * sbh
    terms = {"attention norm": norm, "qkv input": v * sbh}
    if fused_attention:
        terms["q, k and v"] = v * sbh + 2 * v * sbh * kv_heads // heads
        terms["scores"] = 0
    else:
        terms["q, k and v"] = 3 * v * sbh
        softmax = (4 + (v if v != 4 else 0)) if layout.fp32_softmax else v
        terms["scores"] = heads * seq_len * seq_len * batch_size * (softmax + (v // 2 + v if layout.dropout else 0))
    terms["attention output"] = v * sbh
    terms["mlp norm"] = norm
    terms["mlp input"] = v * sbh
    terms["mlp"] = ((4 if layout.gated_mlp else 2) + WRITTEN_OUT_ACTIVATIONS.get(layout.activation, 0)) * v * sbf
    terms["dropout masks"] = 2 * (v // 2) * sbh if layout.dropout else 0
    return terms


def block_saved_bytes(seq_len: int, batch_size: int, hidden: int, heads: int, layout: BlockLayout = GPT_BLOCK,
                      fused_attention: bool = True, value_bytes: int = 2) -> int:
    """Bytes one block keeps for backward: the sum of `saved_terms`."""
    return sum(saved_terms(seq_len, batch_size, hidden, heads, layout, fused_attention, value_bytes).values())
