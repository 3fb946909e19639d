"""The model of activation policies: its byte counts are chapter 1's formula, its times follow FLOPs and the link."""

import pytest
import torch

from minioffload.machine import profiles
from minioffload.predict import activation_cost as ac
from minioffload.predict import memory

BLOCK = ac.BlockShape(seq_len=2048, batch_size=4, hidden=1024, heads=16, fused_attention=False)
FUSED = ac.BlockShape(seq_len=2048, batch_size=4, hidden=1024, heads=16)  # the default: torch's SDPA


def test_bytes_held_follow_chapter_one():
    costs = ac.policy_costs(BLOCK, profiles.preset("h100-sxm"))
    assert costs["keep"].device_bytes == memory.activation_bytes_per_layer(2048, 4, 1024, 16)
    assert costs["recompute"].device_bytes == memory.activation_bytes_per_layer(2048, 4, 1024, 16,
                                                                                 checkpointing=True)
    assert costs["selective"].device_bytes == memory.activation_bytes_per_layer(2048, 4, 1024, 16,
                                                                                 flash_attention=True)
    assert costs["offload"].device_bytes == 0 and costs["offload"].link_bytes == costs["keep"].device_bytes
    fp32 = ac.BlockShape(2048, 4, 1024, 16, value_bytes=4, fused_attention=False)
    assert fp32.saved_bytes() == 2 * BLOCK.saved_bytes()


def test_a_fused_kernel_keeps_no_scores_and_selective_then_saves_nothing():
    hw = profiles.preset("h100-sxm")
    fused = ac.policy_costs(FUSED, hw)
    assert FUSED.score_bytes() == 0
    assert fused["keep"].device_bytes == memory.activation_bytes_per_layer(2048, 4, 1024, 16, flash_attention=True)
    assert fused["offload"].link_bytes == fused["keep"].device_bytes < ac.policy_costs(BLOCK, hw)["keep"].device_bytes
    assert fused["selective"].device_bytes == fused["keep"].device_bytes and fused["selective"].extra_s > 0
    # the scores are what made offload slow to hide: without them it hides at a lower bandwidth
    assert ac.offload_hidden_link(FUSED, hw) < ac.offload_hidden_link(BLOCK, hw)
    # selective is never the best: whatever budget keep misses, selective misses too
    for budget in (fused["keep"].device_bytes, fused["keep"].device_bytes - 1, fused["recompute"].device_bytes, 0):
        assert ac.best_policy(FUSED, hw, budget).policy != "selective"
    assert ac.best_policy(BLOCK, hw, ac.policy_costs(BLOCK, hw)["selective"].device_bytes).policy == "selective"


def test_times_follow_the_flops_and_the_link():
    hw = profiles.preset("h100-sxm")
    costs = ac.policy_costs(BLOCK, hw, mfu=0.5)
    forward = BLOCK.forward_flops() / (0.5 * hw.peak_flops_bf16)
    assert costs["recompute"].extra_s == pytest.approx(forward)
    assert costs["keep"].extra_s == 0 and costs["selective"].extra_s < costs["recompute"].extra_s
    hooks = BLOCK.saved_tensors() * hw.pack_overhead  # host time no link hides
    fast = hw.replace(link_h2d=1e15, link_d2h=1e15, link_latency=1e-12)
    assert ac.policy_costs(BLOCK, fast)["offload"].extra_s == pytest.approx(hooks)  # the copies hidden under compute
    slow = hw.replace(link_h2d=1e9, link_d2h=1e9)
    assert ac.policy_costs(BLOCK, slow)["offload"].extra_s > costs["recompute"].extra_s  # the link loses
    above = ac.offload_hidden_link(BLOCK, hw)
    at = hw.replace(link_h2d=1.01 * above, link_d2h=1.01 * above, link_latency=1e-12)
    assert ac.policy_costs(BLOCK, at)["offload"].extra_s == pytest.approx(hooks)
    below = hw.replace(link_h2d=0.99 * above, link_d2h=0.99 * above, link_latency=1e-12)
    assert ac.policy_costs(BLOCK, below)["offload"].extra_s > hooks * 1.0001


def test_each_saved_tensor_costs_its_hooks_and_a_copy_latency():
    hw = profiles.preset("h100-sxm").replace(link_h2d=1e9, link_d2h=1e9)  # the copies exposed
    base = ac.policy_costs(BLOCK, hw)["offload"].extra_s
    slower_hooks = ac.policy_costs(BLOCK, hw.replace(pack_overhead=hw.pack_overhead + 1e-3))["offload"].extra_s
    assert slower_hooks - base == pytest.approx(BLOCK.saved_tensors() * 1e-3)
    longer = ac.policy_costs(BLOCK, hw.replace(link_latency=hw.link_latency + 1e-3))["offload"].extra_s
    assert longer - base == pytest.approx(2 * BLOCK.saved_tensors() * 1e-3)  # down and up, one copy per tensor


@pytest.mark.parametrize("batch, seq, hidden, heads", [(8, 64, 256, 8), (2, 512, 256, 8), (1, 16, 64, 4),
                                                       (4, 8, 64, 2)])
def test_the_saved_tensor_count_is_what_a_gpt_block_saves(batch, seq, hidden, heads):
    """BlockShape.saved_tensors against the tensors the course GPT's block saves for backward that offload would move
    (not weights, not empty, at least Activations' min_numel values)."""
    from minioffload.model.gpt import Block, GPTConfig

    block = Block(GPTConfig(vocab_size=16, block_size=seq, n_layer=1, n_head=heads, n_embd=hidden))
    weights = {p.untyped_storage()._cdata for p in block.parameters()}
    moved = []

    def pack(tensor):
        if tensor.numel() >= ac.MIN_NUMEL and tensor.untyped_storage()._cdata not in weights:
            moved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(torch.randn(batch, seq, hidden, requires_grad=True))
    assert len(moved) == ac.BlockShape(seq, batch, hidden, heads).saved_tensors()


def test_the_best_policy_is_the_fastest_that_fits():
    hw = profiles.preset("gh200")
    assert ac.best_policy(BLOCK, hw, device_budget=1e12).policy == "keep"
    tight = ac.best_policy(BLOCK, hw, device_budget=0)
    assert tight.device_bytes == 0 and tight.policy in ("offload", "offload_input")
    assert ac.best_policy(BLOCK, hw, device_budget=-1) is None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must be divisible"):
        ac.BlockShape(128, 1, 100, 3)
    with pytest.raises(ValueError, match="value_bytes must be 2"):
        ac.BlockShape(128, 1, 128, 4, value_bytes=3)
    with pytest.raises(ValueError, match="fused_attention must be True or False"):
        ac.BlockShape(128, 1, 128, 4, fused_attention="yes")
    with pytest.raises(ValueError, match="mfu"):
        ac.policy_costs(BLOCK, profiles.preset("h100-sxm"), mfu=0)
