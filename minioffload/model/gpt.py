"""A small GPT, a character tokenizer and a bundled public-domain text: the workload the course offloads.

    cfg = GPTConfig.preset("tiny", vocab_size=tok.vocab_size)
    model = GPT(cfg)                       # token + position embeddings, pre-LayerNorm blocks, tied LM head
    logits, loss = model(x, y)             # x, y: (batch, time) int64 token ids
    text = load_text()                     # ~42 KB of US founding documents and Lincoln, bundled in minioffload/data
    tok = CharTokenizer(text)              # one token per distinct character
    train, val = train_val_split(torch.tensor(tok.encode(text)))
    x, y = batches(train, cfg.block_size, batch_size=16, generator=torch.Generator().manual_seed(0))

The presets (parameter counts with the bundled corpus's 74-character vocabulary):

    tiny            2 layers,  64 wide, context   64    ~0.11M   trains hundreds of steps a minute on 2 CPU cores
    small           6 layers, 128 wide, context  128    ~1.2M
    medium          8 layers, 320 wide, context  256    ~10M
    gpt2-small-ish 12 layers, 768 wide, context 1024    ~86M     GPT-2 small's body (124M with its 50257-token
                                                                 vocabulary); for memory accounting, not CPU training

With `tie_weights=True` (the default) the LM head's weight IS the token embedding's Parameter: one tensor
reached from two modules. `model.parameters()` yields it once; an offload engine that walks modules instead
of parameters must notice the sharing, or it will copy, update and count that tensor twice.

`PaddedStack` is not a language model: linear layers whose compute takes a modelled time (a GPU's, beside the
host), for the benchmarks and chapters that need the device's compute not to use the host's cores.

What this is not: a tuned model (no flash-attention switches, no KV cache, no weight-decay groups, no
checkpoint loading); a BPE tokenizer; a data pipeline (the whole corpus is one in-memory tensor).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# configuration

_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": dict(block_size=128, n_layer=6, n_head=4, n_embd=128),
    "medium": dict(block_size=256, n_layer=8, n_head=8, n_embd=320),
    "gpt2-small-ish": dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. `block_size` is the context length; `n_embd` must divide evenly into `n_head` heads."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True  # biases in the Linear layers and LayerNorms
    tie_weights: bool = True  # the LM head shares the token embedding's weight

    def __post_init__(self) -> None:
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"each head gets n_embd // n_head channels"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides) -> GPTConfig:
        """A named size ("tiny", "small", "medium", "gpt2-small-ish"); keyword overrides replace any field."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(_PRESETS)}")
        return cls(vocab_size=vocab_size, **{**_PRESETS[name], **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        return list(_PRESETS)

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# the model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v for all heads in one matmul
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.proj(y))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal: the part whose saved tensors grow with T^2 (chapter 7's selective
        recomputation recomputes this alone)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=True)


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU, narrow back."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One transformer layer, pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Modules, in the order a forward pass meets them: `tok_emb`, `pos_emb`, `drop`, `blocks[0..n_layer-1]`,
    `ln_f`, `lm_head`. With `cfg.tie_weights`, `lm_head.weight is tok_emb.weight`.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, two users
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's scheme: N(0, 0.02) weights, zero biases, and the projections that write into the residual
        stream scaled down by sqrt(2 * n_layer) so the stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 with T <= block_size. Returns logits (B, T, vocab_size) and the mean
        cross-entropy of predicting targets (None without targets)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}; crop the input")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            # in fp32 whatever the model's dtype: a bf16 loss is rounded to 8 bits (0.03 at a loss of 4), and its
            # log-softmax over the vocabulary with it
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters, each shared tensor counted once. `exclude_embeddings` leaves out the token and
        position tables (tied, the LM head goes with the token table; untied, it is still counted)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared Parameter once
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel() + self.pos_emb.weight.numel()
        return n

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, T) and return (B, T + max_new_tokens).

        Sampling happens on the generator's device (the CPU for a default `torch.Generator()`), so a seeded
        generator gives the same tokens for the same model wherever the model lives. Runs in eval mode
        (no dropout) and restores the previous mode after."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -self.cfg.block_size :]
                logits, _ = self(context)
                logits = logits[:, -1, :] / temperature  # (B, vocab_size)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits.float(), dim=-1)
                sample_device = generator.device if generator is not None else probs.device
                nxt = torch.multinomial(probs.to(sample_device), 1, generator=generator)  # (B, 1)
                idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        finally:
            self.train(was_training)
        return idx


# ---------------------------------------------------------------------------------------------
# tokenizer and data


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each wait a given time, the GIL released."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class PaddedStack(nn.Module):
    """Square linear layers whose forward and backward take modelled times on the "device": beside its small real
    work each layer sleeps for its share of `forward_s` and `backward_s` (seconds for the whole stack), using no
    core. On the simulated device a real model's compute runs on the host's own cores and competes with the CPU
    update; this stand-in for a GPU's compute leaves them to the host, as on a server. Chapter 4's speculative
    update and its benchmark need the two side by side. In backward each layer sleeps first, then its weight's
    gradient is made: ready when the layer's modelled time is over, as a GPU's would be.

        model = PaddedStack(width=1024, layers=10, forward_s=0.01, backward_s=0.02)   # ~10.5M parameters
        loss = model(torch.randn(4, 1024)).square().mean()
    """

    def __init__(self, width: int = 1024, layers: int = 10, forward_s: float = 0.0, backward_s: float = 0.0):
        super().__init__()
        if forward_s < 0 or backward_s < 0:
            raise ValueError(f"forward_s and backward_s are seconds >= 0, got {forward_s}, {backward_s}")
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        share = 1 / len(self.layers)
        for layer in self.layers:
            x = _Sleep.apply(torch.tanh(layer(x)), self.forward_s * share, self.backward_s * share)
        return x


class CharTokenizer:
    """One token per distinct character of the text it is built from; ids follow sorted character order."""

    def __init__(self, text: str):
        if not text:
            raise ValueError("CharTokenizer needs a non-empty text to take its characters from")
        self.chars: list[str] = sorted(set(text))
        self._stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        stoi = self._stoi
        try:
            return [stoi[ch] for ch in text]
        except KeyError as e:
            ch = e.args[0]
            raise ValueError(
                f"character {ch!r} (U+{ord(ch):04X}) at position {text.index(ch)} is not in this tokenizer's "
                f"vocabulary of {self.vocab_size} characters; build the tokenizer from a text that contains it"
            ) from None

    def decode(self, ids) -> str:
        chars = self.chars
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(chars):
                raise ValueError(f"token id {i} is out of range for a vocabulary of {len(chars)} characters")
            out.append(chars[i])
        return "".join(out)


# The bundled texts, in the order `load_text("default")` joins them (see minioffload/data/README.md).
TEXTS: tuple[str, ...] = (
    "declaration_of_independence",
    "us_constitution",
    "bill_of_rights",
    "gettysburg_address",
    "lincoln_second_inaugural",
)
SEPARATOR = "\n\n* * *\n\n"  # the line that separates two works in the default corpus


def load_text(name: str = "default") -> str:
    """A bundled text by file stem (see `TEXTS`), or "default": all of them, joined by a "* * *" line.
    Read from the installed package (importlib.resources); nothing is downloaded."""
    folder = resources.files("minioffload") / "data"
    if name == "default":
        return SEPARATOR.join(load_text(n).strip("\n") for n in TEXTS) + "\n"
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}; choose 'default' or one of {list(TEXTS)}")
    return (folder / f"{name}.txt").read_text(encoding="utf-8")


def train_val_split(tokens, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token sequence into (train, val): the first 1 - val_fraction and the rest. No shuffling,
    so validation text is text the model never saw."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    n_train = int(len(tokens) * (1.0 - val_fraction))
    if n_train == 0 or n_train == len(tokens):
        raise ValueError(f"{len(tokens)} tokens with val_fraction={val_fraction} leave one split empty")
    return tokens[:n_train], tokens[n_train:]


def batches(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows of `block_size` consecutive tokens from a 1-D tensor.

    Returns x, y, each (batch_size, block_size) int64 on data's device, with y[:, t] == x[:, t + 1] inside a
    window (y is the next token of x). Offsets are drawn with `generator` on the CPU, so a seed fixes them."""
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D token tensor, got shape {tuple(data.shape)}")
    if block_size <= 0 or batch_size <= 0:
        raise ValueError(f"block_size and batch_size must be positive, got {block_size} and {batch_size}")
    if len(data) <= block_size:
        raise ValueError(f"data has {len(data)} tokens; need more than block_size={block_size}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (batch_size,) CPU
    offsets = (starts[:, None] + torch.arange(block_size)).to(data.device)  # (batch_size, block_size)
    return data[offsets].long(), data[offsets + 1].long()
