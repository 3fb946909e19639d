"""Helpers shared by the unit tests (fixtures are in conftest.py).

- `Toy`: a tiny language model with the odd cases an optimizer must handle (a tied head, a branch that only
  sometimes gets a gradient, a frozen parameter); `batch` and `loss_of` feed it, `HYPER` is the AdamW setting.
- `on_sim`: put a model on a device (counted in its ledger); `fresh`: the seeded Toy on a device with its
  OffloadAdam, as the checkpoint tests start.
- `train`: the plain training loop (accumulation, clipping for torch's reference).
- `assert_resumes_bit_for_bit`: a checkpoint taken mid-run continues exactly like the run that never stopped.
"""

import torch
from torch import nn

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class Toy(nn.Module):
    """Embedding -> MLP -> a head tied to the embedding; an unused branch and a frozen bias for the odd cases."""

    def __init__(self, vocab=11, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.side = nn.Linear(width, width)  # used only when asked: a parameter that sometimes gets no gradient
        self.frozen = nn.Parameter(torch.zeros(width), requires_grad=False)

    def forward(self, idx, use_side=False):
        h = self.embed(idx)
        h = h + self.mlp(h) + self.frozen
        if use_side:
            h = h + self.side(h)
        return h @ self.embed.weight.T  # tied head


def batch(seed, n=8, seq=6, vocab=11):
    """(inputs, targets) for Toy, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, vocab, (n, seq), generator=g)


def loss_of(model, idx, targets, use_side=False):
    """Toy's cross-entropy, in fp32 whatever the model's dtype."""
    logits = model(idx, use_side)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def on_sim(model, dev):
    """`model` with its parameters placed on `dev` (counted in its ledger as "param")."""
    return dev.place(model)


def train(model, opt, steps, micro_batches=1, use_side=lambda step: False, clip=None):
    """`steps` optimizer steps on the seeded batches (micro-batch m of step s: `batch(100 * s + m)`); the losses."""
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            idx, targets = batch(100 * step + micro)
            loss = loss_of(model, idx, targets, use_side(step)) / micro_batches
            loss.backward()
            total += loss.item()
        if clip is not None:  # torch's reference clips here; OffloadAdam clips inside step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def fresh(dev, **options):
    """The seeded Toy on `dev` with its OffloadAdam (small subgroups), as every checkpoint test starts."""
    torch.manual_seed(0)
    model = on_sim(Toy(), dev)
    return model, OffloadAdam(model.parameters(), dev, subgroup_numel=300, **options, **HYPER)


def assert_resumes_bit_for_bit(make):
    """`make(dev, name)` -> (model, optimizer), seeded alike: four straight steps equal two, a checkpoint into a
    fresh pair, and two more."""
    with device("sim") as dev:
        straight, opt = make(dev, "straight")
        train(straight, opt, 4)
        first, opt = make(dev, "first")
        train(first, opt, 2)
        saved = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "opt": opt.state_dict()}
        resumed, opt = make(dev, "resumed")
        resumed.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        for step in range(2, 4):
            loss_of(resumed, *batch(100 * step)).backward()
            opt.step()
            opt.zero_grad()
        dev.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))


def keep_gpu_busy(cycles: int = 20_000_000) -> None:
    """Queue a spin on the GPU's current stream (about 10-20 ms): the work the host issues next runs that much later,
    so the host runs ahead of the GPU as it does in real training, and a missing wait reads or writes too early."""
    torch.cuda._sleep(cycles)


class FakeCudart:
    """torch.cuda.cudart() stand-in for pinned memory on a CPU-only machine: records page-locking calls (`calls`)
    and what is locked (`locked`: address -> bytes); `refuse` makes cudaHostRegister fail."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.locked: dict[int, int] = {}
        self.refuse = False

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        self.locked[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0 if self.locked.pop(address, None) is not None else 712  # cudaErrorHostMemoryNotRegistered
