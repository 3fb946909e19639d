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


@pytest.mark.parametrize("policy", ["offload", "offload_input"])
def test_a_forward_that_outruns_the_link_holds_at_most_two_sets(policy):
    # the planner counts two offloaded sets on the device (one leaving beside the next block's forward, one being
    # made); copies slower than the compute must not pile more up, in the forward or at the turn into the backward
    from minioffload.devices import Link

    def peaks(gbps):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=5, n_head=2, n_embd=64))
        with device("sim", h2d=Link(gbps * 1e9), d2h=Link(gbps * 1e9)) as dev:
            dev.place(model)
            acts = Activations(model.blocks, policy, dev)
            base = dev.ledger.used("device")
            _, loss = model(*batch(0))
            forward = dev.ledger.peak("device") - base
            one_set = sum(ref().host.nbytes for ref in acts._waiting[0])
            loss.backward()
            dev.synchronize()
            return forward, dev.ledger.peak("device") - base, one_set

    slow_forward, slow_step, one_set = peaks(0.02)  # a block's copy takes far longer than its forward
    _, fast_step, _ = peaks(50.0)
    assert slow_forward <= 2 * one_set + (64 << 10), (slow_forward, one_set)
    assert slow_step <= fast_step + (64 << 10), (slow_step, fast_step)


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
        with pytest.raises(ValueError, match="appears more than once"):
            Activations([model.blocks[0], model.blocks[1], model.blocks[0]], "offload", dev)
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
        assert not acts._pending()  # nothing waits for a backward that never comes: the next forward starts clean


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


def test_weights_moved_after_the_policy_was_set_are_still_not_offloaded(sim):
    """An optimizer may put the weights in new storage after the policy is set (OffloadAdam gathers them into one
    flat buffer): offload still moves only activations. It used to recognise the weights it saw at construction, and
    copied each block's weights out and back every step (3 MiB a block of the planner's 'medium' GPT, beyond its
    plan)."""
    block = sim.place(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)))
    acts = Activations([block], "offload", sim, min_numel=0)
    old = [p.data for p in block.parameters()]  # held: a freed storage's address may be the next one's
    for p in block.parameters():  # new storage, the same values
        p.data = sim.adopt(p.data.clone(), "moved weight")
    x = sim.adopt(torch.randn(64, 16), "x")
    loss = block(x).sum()
    shapes = sorted(tuple(packed.host.shape) for refs in acts._waiting.values() for ref in refs
                    if (packed := ref()) is not None)
    weights = {shape for p in block.parameters() for shape in (tuple(p.shape), tuple(p.shape)[::-1])}  # or W^T
    assert shapes and not weights & set(shapes), f"offloaded the weights: {shapes}"
    del old
    loss.backward()
    sim.synchronize()
    acts.remove()


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


# Other models and other calls: what PyTorch's and DeepSpeed's own checkpoint tests ask of a policy ------------------
def _mlp_blocks(n=3, width=64, seed=0):
    """Linear -> ReLU -> Linear: the ReLU saves its output and the next Linear saves the same tensor again."""
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                                   torch.nn.Linear(width, width)) for _ in range(n))


def _gradients(policy, call, frozen_input=False, slow_pool=False):
    """call(loss, x, params) -> gradients, for three MLP blocks under `policy` on the strict sim. slow_pool: each
    pinned buffer is handed out only after every queued copy has run (pinned allocation
    is slow on a GPU host), so a saved tensor's first copy is done before its second save."""
    blocks = _mlp_blocks()
    with device("sim") as dev:
        dev.place(blocks)
        acts = Activations(blocks, policy, dev, min_numel=1)
        if slow_pool and acts.arena is not None:
            take = acts.arena.take

            def slow_take(*args):
                dev.synchronize()
                return take(*args)
            acts.arena.take = slow_take
        x = torch.randn(32, 64, requires_grad=not frozen_input)
        h = x
        for block in blocks:
            h = block(h)
        grads = call(h.square().sum(), x, list(blocks.parameters()))
        dev.synchronize()
        acts.remove()
        return grads


def _backward(loss, x, params):
    loss.backward()
    return [p.grad for p in params]


def _autograd_grad(loss, x, params):
    grads = torch.autograd.grad(loss, [x, *params])
    assert all(p.grad is None for p in params), "torch.autograd.grad wrote .grad into the parameters"
    return grads


def _gradient_penalty(loss, x, params):
    first = torch.autograd.grad(loss, params, create_graph=True)
    sum(g.square().sum() for g in first).backward()
    return [p.grad for p in params]


@pytest.mark.parametrize("call, frozen_input", [(_backward, False), (_backward, True), (_autograd_grad, False),
                                                (_gradient_penalty, False), (_gradient_penalty, True)],
                         ids=["backward", "frozen-input", "autograd.grad", "double-backward", "double-frozen"])
@pytest.mark.parametrize("policy", ["recompute", "offload", "offload_input"])
def test_policies_give_keeps_gradients_under_every_way_of_asking_for_them(policy, call, frozen_input):
    """A frozen input (a fine-tuned model's embedding), torch.autograd.grad (no .grad written), double backward (a
    gradient penalty), and one storage saved twice with a slow pinned pool: the gradients are keep's, bit for bit."""
    kept = _gradients("keep", call, frozen_input)
    got = _gradients(policy, call, frozen_input, slow_pool=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, got, strict=True))


class _TwoInputs(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x, context, *, scale=1.0):
        return torch.tanh(self.a(x) + self.b(context)) * scale


@pytest.mark.parametrize("policy", ["recompute", "offload", "offload_input"])
def test_a_block_with_two_inputs_and_keywords_runs_under_every_policy(policy, sim):
    def grads(name):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(_TwoInputs() for _ in range(2))
        sim.place(blocks)
        acts = Activations(blocks, name, sim, min_numel=1)
        x, context = torch.randn(8, 64, requires_grad=True), torch.randn(8, 64)
        for block in blocks:
            x = block(x, context, scale=0.5)
        x.sum().backward()
        sim.synchronize()
        acts.remove()
        return [p.grad for p in blocks.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads("keep"), grads(policy), strict=True))


@pytest.mark.parametrize("policy", ["offload", "offload_input"])
def test_a_forward_never_backpropagated_leaves_nothing_behind(policy):
    """A skipped loss (or an evaluation with grad on): its offloaded tensors are not fetched by the next backward,
    and a pool sized for one step serves the next step once the graph is dropped; while the old graph is still
    referenced, a pool too small says how to free it."""
    model = tiny_gpt()
    with device("sim") as dev:
        dev.place(model)
        sizing = Activations(model.blocks, policy, dev, pool_bytes=64 << 20)
        model(*batch(0))[1].backward()
        one_step = sizing.arena.used  # one forward's offloaded bytes, aligned as the pool hands them out
        sizing.remove()

        acts = Activations(model.blocks, policy, dev, pool_bytes=one_step)
        loss = model(*batch(1))[1]
        del loss  # skipped: never backpropagated
        start = len(dev.trace.on("h2d"))
        loss = model(*batch(2))[1]  # the pool starts over: the skipped step's tensors are gone with its graph
        loss.backward()
        dev.synchronize()
        up = sum(s.nbytes for s in dev.trace.on("h2d")[start:] if s.name.startswith("h2d activation"))
        down = sum(s.nbytes for s in dev.trace.on("d2h") if s.name.startswith("d2h activation")) // 3
        assert up == down  # one step's bytes came back, not two

        kept_loss = model(*batch(3))[1]  # still referenced: its tensors hold the pool
        with pytest.raises(MemoryError, match=r"del loss"):
            model(*batch(4))
        del kept_loss
        model(*batch(5))[1].backward()  # dropped: the pool serves again
        dev.synchronize()
        acts.remove()
