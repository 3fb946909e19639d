"""The model of activation policies (chapter 7): what each costs in device memory, link bytes and time, per block.

    block = BlockShape(seq_len=2048, batch_size=8, hidden=4096, heads=32)
    block = BlockShape.of(ModelSpec.from_config(llama_config), batch_size=8)    # any model's block: its layout
    costs = policy_costs(block, profiles.preset("h100-sxm"))    # policy -> PolicyCost
    best_policy(block, hw, device_budget=2 * GiB)                # the fastest that fits

One block's forward takes F = flops / (mfu x peak) and its backward 2F. Per policy:

    keep           holds every saved tensor (Korthikanti et al.'s 34 s b h + 5 a s^2 b bytes, or 34 s b h with fused
                   attention, which keeps no scores; another layout's count from block_activations.py); no extra time
    recompute      holds the input (2 s b h); one more forward in backward: + F
    selective      holds all but the attention scores; recomputes the attention core: + its FLOPs' time (with fused
                   attention there are no scores to drop: it holds what keep holds and only adds time)
    offload        holds nothing between forward and backward; its bytes go down during the next block's
                   forward and come back during the previous block's backward: + max(0, bytes / link - F) down
                   and + max(0, bytes / link - 2F) up, each of its n saved tensors one copy (n x latency more
                   on the link), and n x pack_overhead of host time that nothing hides (the hooks and copy issues
                   run on the thread that runs the block)
    offload_input  recompute, with the input offloaded as well: + F and the input's copies, hidden the same way

What this is not: the runtime (model/activations.py), nor a schedule of the whole step (stepmodel.py); it prices one
block in the middle of a deep stack, where there is a neighbour to hide each copy under.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..machine.profiles import Hardware
from .block_activations import GPT_BLOCK, BlockLayout, saved_terms
from .memory import activation_bytes_per_layer

MIN_NUMEL = 1024  # model.activations.Activations' default: smaller saved tensors stay on the device

POLICIES = ("keep", "recompute", "selective", "offload", "offload_input")


@dataclass(frozen=True)
class BlockShape:
    """One GPT block's work: `batch_size` sequences of `seq_len` tokens, `hidden` wide, `heads` heads; values of
    `value_bytes` (2: bf16/fp16, as Korthikanti et al. count; the byte counts scale with it). `fused_attention`:
    the attention core is one kernel that keeps no scores (torch's scaled_dot_product_attention, the default, as
    models.GPT runs it); False for softmax(q k^T) v written out, which keeps 5 a s^2 b bytes of them. `layout`: what
    the block is made of (block_activations.BlockLayout: a GPT's by default; `BlockShape.of(spec, ...)` takes a
    ModelSpec's)."""

    seq_len: int
    batch_size: int
    hidden: int
    heads: int
    value_bytes: int = 2
    fused_attention: bool = True
    layout: BlockLayout = GPT_BLOCK

    def __post_init__(self) -> None:
        activation_bytes_per_layer(self.seq_len, self.batch_size, self.hidden, self.heads)  # its checks
        if not isinstance(self.layout, BlockLayout):
            raise ValueError(f"layout must be a block_activations.BlockLayout, got {self.layout!r}")
        saved_terms(self.seq_len, self.batch_size, self.hidden, self.heads, self.layout)  # the layout's checks
        if self.value_bytes not in (2, 4):
            raise ValueError(f"value_bytes must be 2 (16-bit) or 4 (fp32), got {self.value_bytes!r}")
        if not isinstance(self.fused_attention, bool):
            raise ValueError(f"fused_attention must be True or False, got {self.fused_attention!r}")

    @classmethod
    def of(cls, model, batch_size: int, value_bytes: int = 2) -> BlockShape:
        """One block of `model` (a shapes.ModelSpec) at its context, `batch_size` sequences, with its layout."""
        return cls(model.seq_len, batch_size, model.d_model, model.n_head, value_bytes, model.fused_attention,
                   model.block_layout)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size

    def _terms(self) -> dict[str, int]:
        return saved_terms(self.seq_len, self.batch_size, self.hidden, self.heads, self.layout, self.fused_attention,
                           self.value_bytes)

    def saved_bytes(self) -> int:
        """What `keep` holds: the layout's count (block_activations.py; a GPT's is Korthikanti et al.'s, without the
        scores when attention is fused), at the value size."""
        return sum(self._terms().values())

    def score_bytes(self) -> int:
        """The attention scores' share of `saved_bytes` (softmax output, its mask, the dropped scores); none when
        attention is fused."""
        return self._terms()["scores"]

    def input_bytes(self) -> int:
        return self.tokens * self.hidden * self.value_bytes

    def saved_tensors(self, min_numel: int = MIN_NUMEL) -> int:
        """How many tensors the block's forward saves that offload moves (those of at least `min_numel` values,
        weights aside), as the course GPT block saves them: eleven activations (nine of s b h values, two of 4 s b h),
        the two LayerNorms' means and inverse deviations (s b values each), and the attention's log-sum-exp (a s b)
        when fused, or Korthikanti et al.'s three tensors of scores (a s^2 b) when not. Another layout (a gated MLP or
        RMSNorm): its formula's tensors (block_activations.py), each norm's statistics of s b values, and the
        log-sum-exp or its tensors of scores."""
        layout = self.layout
        if layout.gated_mlp or layout.norm != "layernorm":
            norms = 2 * (2 if layout.norm == "rmsnorm" else 1)
            big = norms + 1 + 3 + 1 + 1 + (4 if layout.gated_mlp else 2)  # + qkv input, q k v, output, mlp input
            scores = 1 + (layout.fp32_softmax and self.value_bytes != 4) + 2 * layout.dropout
            small = (2 if layout.norm == "rmsnorm" else 4) * (self.tokens >= min_numel)
        else:
            big, scores, small = 11, 3, 4 * (self.tokens >= min_numel)
        if self.fused_attention:
            return big + small + (self.heads * self.tokens >= min_numel)
        return big + small + scores * (self.heads * self.seq_len * self.tokens >= min_numel)

    def forward_flops(self) -> float:
        """The block's matmuls (2 FLOPs per weight per token: a GPT's 12 h^2 weights; q and the output projection h^2
        each, k and v h x its kv width, the MLP's two or three h x ffn) and the attention core (q k^T and its product
        with v: 4 s h per token)."""
        layout, h = self.layout, self.hidden
        kv = h * (layout.kv_heads or self.heads) // self.heads
        weights = 2 * h * h + 2 * h * kv + (3 if layout.gated_mlp else 2) * h * (layout.ffn or 4 * h)
        return 2 * self.tokens * weights + self.core_flops()

    def core_flops(self) -> float:
        return 4 * self.tokens * self.seq_len * self.hidden


@dataclass(frozen=True)
class PolicyCost:
    policy: str
    device_bytes: int  # held on the device between the block's forward and its backward
    link_bytes: int  # each way
    extra_s: float  # step time added to keeping everything

    def __str__(self) -> str:
        return (f"{self.policy:<14}{self.device_bytes / 2**20:>10.1f} MiB held{self.link_bytes / 2**20:>10.1f} MiB "
                f"each way  +{self.extra_s * 1e3:.2f} ms")


def _exposed(nbytes: int, bandwidth: float, latency: float, hidden_under: float) -> float:
    """Copy time not hidden under `hidden_under` seconds of compute (0 for no bytes)."""
    return max(0.0, latency + nbytes / bandwidth - hidden_under) if nbytes else 0.0


def policy_costs(block: BlockShape, hw: Hardware, mfu: float = 0.4) -> dict[str, PolicyCost]:
    """Every policy's device memory, link bytes and added time for `block` on `hw`, forward and backward at
    `mfu` of the peak of the block's precision."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    rate = mfu * hw.peak_flops("fp32" if block.value_bytes == 4 else "bf16")
    forward = block.forward_flops() / rate
    saved, scores, x = block.saved_bytes(), block.score_bytes(), block.input_bytes()
    tensors = block.saved_tensors()
    down = _exposed(saved, hw.link_d2h, tensors * hw.link_latency, forward)
    up = _exposed(saved, hw.link_h2d, tensors * hw.link_latency, 2 * forward)
    x_down = _exposed(x, hw.link_d2h, hw.link_latency, forward)
    x_up = _exposed(x, hw.link_h2d, hw.link_latency, 2 * forward)
    return {
        "keep": PolicyCost("keep", saved, 0, 0.0),
        "recompute": PolicyCost("recompute", x, 0, forward),
        "selective": PolicyCost("selective", saved - scores, 0, block.core_flops() / rate),
        "offload": PolicyCost("offload", 0, saved, down + up + tensors * hw.pack_overhead),
        "offload_input": PolicyCost("offload_input", 0, x, forward + x_down + x_up + hw.pack_overhead),
    }


def best_policy(block: BlockShape | None, hw: Hardware | None, device_budget: float, mfu: float = 0.4,
                costs: dict[str, PolicyCost] | None = None) -> PolicyCost | None:
    """The policy that adds the least time among those that hold at most `device_budget` bytes (ties: less held);
    None when none fits. `costs`: the policies priced already (policy_costs' result; block and hw are then unused)."""
    if costs is None:
        costs = policy_costs(block, hw, mfu)
    fits = [c for c in costs.values() if c.device_bytes <= device_budget]
    return min(fits, key=lambda c: (c.extra_s, c.device_bytes)) if fits else None


def offload_hidden_link(block: BlockShape, hw: Hardware, mfu: float = 0.4) -> float:
    """The link bandwidth (bytes/s each way) above which offloading this block costs no time: its bytes go down
    under one forward (the tighter of the two windows)."""
    rate = mfu * hw.peak_flops("fp32" if block.value_bytes == 4 else "bf16")
    return block.saved_bytes() / (block.forward_flops() / rate)
