"""Activation policies: every policy trains exactly like keeping everything; offloading moves the saved tensors
over the link and back ahead of their block; bad input is refused before anything changes."""

import pytest
import torch
from helpers import keep_gpu_busy

from minioffload.devices import device
from minioffload.model.activations import POLICIES, Activations
from minioffload.model.gpt import GPT, GPTConfig

VOCAB, BLOCK = 40, 32


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=3, n_head=2, n_embd=32))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, BLOCK), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(policy, steps=3, jitter=0.0, **options):
    """Weights and gradients after `steps` AdamW steps with `policy` on the blocks; and the device's trace."""
    model = tiny_gpt()
    with device("sim", jitter=jitter, seed=1) as dev:
        dev.place(model)
        acts = Activations(model.blocks, policy, dev, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(steps):
            _, loss = model(*batch(step))
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        dev.synchronize()
        acts.remove()
        return [p.detach().clone() for p in model.parameters()], grads, dev.trace


@pytest.fixture(scope="module")
def kept():
    return train("keep")


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "keep"])
def test_every_policy_trains_bit_for_bit_like_keep(kept, policy):
    weights, grads, _ = train(policy)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept[1], strict=True)), policy
    assert all(torch.equal(a, b) for a, b in zip(weights, kept[0], strict=True)), policy


def test_offload_under_jitter_and_a_mixed_list_with_a_bounded_pool(kept):
    weights, _, trace = train(["offload", "offload_input", "selective"], jitter=2e-4, pool_bytes=8 << 20)
    assert all(torch.equal(a, b) for a, b in zip(weights, kept[0], strict=True))
    down = [s for s in trace.on("d2h") if s.name.startswith("d2h activation")]
    up = [s for s in trace.on("h2d") if s.name.startswith("h2d activation")]
    assert down and len(down) == len(up)  # every tensor that left came back
    assert {s.name.split()[-1] for s in down} == {"0", "1"}  # blocks 0 and 1; block 2 keeps on the device


def test_the_next_block_is_fetched_during_this_ones_backward():
    model = tiny_gpt()
    with device("sim") as dev:
        dev.place(model)
        acts = Activations(model.blocks, "offload", dev)
        _, loss = model(*batch(0))
        order = []
        original = acts._fetch
        acts._fetch = lambda index: (order.append(index) if acts._waiting.get(index) else None, original(index))
        loss.backward()
        dev.synchronize()
    fetched = [i for i in order if i is not None]
    assert fetched == [2, 1, 0], fetched  # the last block first, each next one while the one before is in backward


def test_each_policy_holds_at_most_its_budget_after_the_forward():
    def peak(policy):
        model = tiny_gpt()
        with device("sim") as dev:
            dev.place(model)
            acts = Activations(model.blocks, policy, dev)
            before = dev.ledger.used("device")
            with torch.autograd.graph.saved_tensors_hooks(lambda t: dev.adopt(t, "saved") if t.numel() >= 1024
                                                          else t, lambda t: t):
                _, loss = model(*batch(0))
            dev.synchronize()  # the offload copies have landed: their device sources are freed
            held = dev.ledger.used("device") - before  # what the forward left on the device for backward
            loss.backward()
            dev.synchronize()
            acts.remove()
            return held

    held = {policy: peak(policy) for policy in POLICIES}
    keep = held["keep"]
    budgets = {"keep": keep, "selective": keep, "offload": keep / 2, "recompute": keep / 3, "offload_input": keep / 3}
    assert all(held[policy] <= budgets[policy] for policy in POLICIES), held


@pytest.mark.parametrize("policy, blocks, says", [
    ("fast", 3, "unknown activation policy 'fast'"),
    (["keep", "offload"], 3, "2 policies for 3 blocks"),
])
def test_bad_input_is_refused_and_nothing_changes(policy, blocks, says):
    model = tiny_gpt()
    with device("sim") as dev:
        with pytest.raises(ValueError, match=says):
            Activations(model.blocks[:blocks], policy, dev)
        with pytest.raises(ValueError, match="pool_bytes must be a positive int"):
            Activations(model.blocks, "offload", dev, pool_bytes=0)
        assert all("forward" not in vars(b) for b in model.blocks)
        with pytest.raises(ValueError, match="no attn.core"):
            Activations([torch.nn.Linear(4, 4)], "selective", dev)
        acts = Activations(model.blocks, "recompute", dev)
        with pytest.raises(ValueError, match="already has a policy"):
            Activations(model.blocks, "offload", dev)
        acts.remove()
        assert all("forward" not in vars(b) for b in model.blocks)


def test_a_pool_too_small_names_the_fix():
    model = tiny_gpt()
    with device("sim") as dev:
        dev.place(model)
        acts = Activations(model.blocks, "offload", dev, pool_bytes=4096)
        with pytest.raises(MemoryError, match="larger pool_bytes"):
            model(*batch(0))
        assert not acts._waiting  # nothing left waiting for a backward that never comes: the next forward starts clean


class _DeviceDropoutBlock(torch.nn.Module):
    """A block whose dropout draws on the device's own generator, as dropout on a GPU does (not the CPU's)."""

    def __init__(self, dev, width=64):
        super().__init__()
        self.dev, self.fc = dev, torch.nn.Linear(width, width)

    def forward(self, x):
        keep = torch.bernoulli(torch.full_like(x, 0.5), generator=self.dev.generator)
        return torch.tanh(self.fc(x * keep * 2.0))


@pytest.mark.parametrize("policy", ["offload_input", "offload"])
def test_a_recomputed_block_replays_the_device_dropout_of_its_forward(policy):
    """offload_input runs each block again in backward: it must restore the device's random state (the one GPU
    dropout draws on), not only the CPU's, or the replay draws other masks and the gradients are wrong."""
    def grads(name):
        torch.manual_seed(0)
        with device("sim", seed=3) as dev:
            blocks = torch.nn.ModuleList(_DeviceDropoutBlock(dev) for _ in range(3))
            dev.place(blocks)
            acts = Activations(blocks, name, dev, min_numel=1)
            x = torch.randn(8, 64)
            for block in blocks:
                x = block(x)
            x.square().sum().backward()
            dev.synchronize()
            acts.remove()
            return [p.grad.clone() for p in blocks.parameters()]

    kept, other = grads("keep"), grads(policy)
    assert all(torch.equal(a, b) for a, b in zip(kept, other, strict=True))


def test_saved_tensors_off_the_device_are_left_alone(sim):
    """Fused attention saves 0-dim CPU tensors (its random seed) even on a GPU: the offload hook leaves a tensor that
    is not on the device's torch device as it is, adopting nothing."""
    block = torch.nn.Linear(4, 4)
    acts = Activations([block], "offload", sim, min_numel=0)
    elsewhere = torch.zeros((), device="meta")
    before = sim.ledger.used("device")
    assert acts._pack(0, elsewhere, force=True) is elsewhere
    assert sim.ledger.used("device") == before and not acts._waiting


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "keep"])
def test_on_cuda_every_policy_trains_like_keep_with_dropout_and_a_lagging_gpu(policy):
    """Dropout on (recomputation must replay the GPU's random draws; fused attention saves CPU tensors), a bounded
    pool, and the GPU kept busy so the host runs ahead: a prefetch into memory a queued backward still uses, or a
    read before its copy has landed, changes the gradients."""
    def run(name):
        torch.manual_seed(0)
        torch.cuda.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=3, n_head=2, n_embd=32, dropout=0.1))
        with device("cuda") as dev:
            dev.place(model)
            acts = Activations(model.blocks, name, dev, min_numel=1, pool_bytes=64 << 20)
            for step in range(2):
                x, y = (dev.to_device(t) for t in batch(step))
                keep_gpu_busy()
                model(x, y)[1].backward()
            dev.synchronize()
            acts.remove()
            return [p.grad.cpu() for p in model.parameters()]

    kept, other = run("keep"), run(policy)
    exact = policy in ("offload",)  # a copy there and back changes no bit; recomputation may take other kernels
    for a, b in zip(kept, other, strict=True):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-6), policy
