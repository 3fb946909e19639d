"""The model of activation policies (chapter 7): what each costs in device memory, link bytes and time, per block.

    block = BlockShape(seq_len=2048, batch_size=8, hidden=4096, heads=32)
    costs = policy_costs(block, profiles.preset("h100-sxm"))    # policy -> PolicyCost
    best_policy(block, hw, device_budget=2 * GiB)                # the fastest that fits

One block's forward takes F = flops / (mfu x peak) and its backward 2F. Per policy:

    keep           holds every saved tensor (Korthikanti et al.'s 34 s b h + 5 a s^2 b bytes, or 34 s b h with fused
                   attention, which keeps no scores); no extra time
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
from .memory import activation_bytes_per_layer

MIN_NUMEL = 1024  # model.activations.Activations' default: smaller saved tensors stay on the device

POLICIES = ("keep", "recompute", "selective", "offload", "offload_input")


@dataclass(frozen=True)
class BlockShape:
    """One GPT block's work: `batch_size` sequences of `seq_len` tokens, `hidden` wide, `heads` heads; values of
    `value_bytes` (2: bf16/fp16, as Korthikanti et al. count; the byte counts scale with it). `fused_attention`:
    the attention core is one kernel that keeps no scores (torch's scaled_dot_product_attention, the default, as
    models.GPT runs it); False for softmax(q k^T) v written out, which keeps 5 a s^2 b bytes of them."""

    seq_len: int
    batch_size: int
    hidden: int
    heads: int
    value_bytes: int = 2
    fused_attention: bool = True

    def __post_init__(self) -> None:
        activation_bytes_per_layer(self.seq_len, self.batch_size, self.hidden, self.heads)  # its checks
        if self.value_bytes not in (2, 4):
            raise ValueError(f"value_bytes must be 2 (16-bit) or 4 (fp32), got {self.value_bytes!r}")
        if not isinstance(self.fused_attention, bool):
            raise ValueError(f"fused_attention must be True or False, got {self.fused_attention!r}")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size

    def saved_bytes(self) -> int:
        """What `keep` holds: Korthikanti et al.'s count (without the scores when attention is fused), scaled to the
        value size."""
        return activation_bytes_per_layer(self.seq_len, self.batch_size, self.hidden, self.heads,
                                          flash_attention=self.fused_attention) * self.value_bytes // 2

    def score_bytes(self) -> int:
        """The attention scores' share of `saved_bytes` (softmax output, its mask, the dropped scores); none when
        attention is fused."""
        if self.fused_attention:
            return 0
        return 5 * self.heads * self.seq_len ** 2 * self.batch_size * self.value_bytes // 2

    def input_bytes(self) -> int:
        return self.tokens * self.hidden * self.value_bytes

    def saved_tensors(self, min_numel: int = MIN_NUMEL) -> int:
        """How many tensors the block's forward saves that offload moves (those of at least `min_numel` values,
        weights aside), as the course GPT block saves them: eleven activations (nine of s b h values, two of 4 s b h),
        the two LayerNorms' means and inverse deviations (s b values each), and the attention's log-sum-exp (a s b)
        when fused, or Korthikanti et al.'s three tensors of scores (a s^2 b) when not."""
        small = 4 * (self.tokens >= min_numel)
        if self.fused_attention:
            return 11 + small + (self.heads * self.tokens >= min_numel)
        return 11 + small + 3 * (self.heads * self.seq_len * self.tokens >= min_numel)

    def forward_flops(self) -> float:
        """The block's matmuls (12 h^2 weights: 2 FLOPs each per token) and the attention core (q k^T and its product
        with v: 4 s h per token)."""
        return 24 * self.tokens * self.hidden ** 2 + self.core_flops()

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
