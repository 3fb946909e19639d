"""Grader for the capstone's Task C.3: ZeRO-3-style offload on two gloo ranks, against one process. Tasks C.1 and C.2:
capstone.py.

The learner's `zero3_rank(comm, dev, model, batches, lr)` runs on every rank of a `GlooGroup(2)` (capstone_gloo.py:
threads, real gloo process groups, strict sim devices), each rank with its own copy of a 4-layer course GPT on the
host and its own micro-batch of each step. It returns, for each unit (the parameters outside the blocks, then each
block), its slice of the fp32 master weights and of Adam's two moments. What must hold:

- bits: the slices, put together in rank order, are the master weights and moments of one process that accumulates
  both ranks' micro-batches (each loss divided by 2) with `OffloadAdam(min_offload_numel=0)`, bit for bit;
- link: each rank's trace carries per step what the step model predicts for its shards (capstone.predicted_link_bytes);
- network: what reaches each rank over gloo is an all-gather per fetch and a reduce-scatter per unit, no more;
- device: each rank's peak of device memory (its ledger: weights, gradients, buffers; activations are not counted)
  stays within the budget, the resident weights and three blocks' weights.

`run_ranks` is the harness, shared with the notebook's last cell. What this is not: a test of speed; the one-process
reference is computed once and kept (it does not depend on the learner's code).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator

import torch

from ...engine.optimizer import OffloadAdam
from ...model.gpt import GPT, GPTConfig
from .capstone import predicted_link_bytes, shard
from .capstone_gloo import GlooGroup
from .grading import grader, sim_device

WORLD, STEPS, LAYERS, VOCAB, BATCH, SEQ, LR = 2, 3, 4, 65, 4, 32, 3e-3
KEYS = ("master", "exp_avg", "exp_avg_sq")


def capstone_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, n_layer=LAYERS))


def capstone_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[step][rank]: (x, y), (BATCH, SEQ) token ids."""
    gen = torch.Generator().manual_seed(1)
    def draw() -> torch.Tensor:
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return [[(draw(), draw()) for _ in range(WORLD)] for _ in range(STEPS)]


def units_of(model: GPT) -> list[list[torch.nn.Parameter]]:
    """Unit 0: the parameters outside the blocks, in model.parameters() order; unit i + 1: block i's."""
    inside = {id(p) for block in model.blocks for p in block.parameters()}
    return [[p for p in model.parameters() if id(p) not in inside], *(list(b.parameters()) for b in model.blocks)]


def budget_bytes(model: GPT) -> int:
    """The device budget of one rank: the resident weights and three blocks' weights (4 bytes each)."""
    units = units_of(model)
    return 4 * (sum(p.numel() for p in units[0]) + 3 * max(sum(p.numel() for p in u) for u in units[1:]))


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """torch on one CPU thread while the ranks and the one process run: with several, the embedding's backward adds
    a token's repeated rows in an order that depends on how the work was split, and bits differ that no learner
    changed (make test runs on one thread; a laptop does not)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def one_process() -> tuple[list[torch.Tensor], ...]:
    """Per unit, the flat master weights and moments after STEPS steps of one process accumulating both micro-batches
    (a tuple of three lists: master, exp_avg, exp_avg_sq)."""
    model, data = capstone_model(), capstone_batches()
    with one_cpu_thread(), sim_device(strict=False) as dev:
        dev.place(model)
        opt = OffloadAdam(model.parameters(), dev, lr=LR, min_offload_numel=0)
        for micro in data:
            for x, y in micro:
                (model(x, y)[1] / len(micro)).backward()
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()["state"]
        index = {id(p): i for i, p in enumerate(model.parameters())}
        out = tuple([torch.cat([state[index[id(p)]][key].reshape(-1) for p in unit]) for unit in units_of(model)]
                    for key in KEYS)
        opt.close()
    return out


def run_ranks(fn: Callable) -> dict:
    """Run `fn(comm, dev, model, batches, lr)` on WORLD gloo ranks; what it returned, each rank's link bytes per step,
    the bytes that reached it over the network per step, and its device peak."""
    base, data = capstone_model(), capstone_batches()
    models = [copy.deepcopy(base) for _ in range(WORLD)]
    with one_cpu_thread(), GlooGroup(WORLD, strict=True) as group:
        devs = group.devices
        returned = group.run(lambda rank, comm: fn(comm, devs[rank], models[rank], [d[rank] for d in data], LR))
        for dev in devs:
            dev.synchronize()
        return {"returned": returned, "budget": budget_bytes(base),
                "link": [sum(s.nbytes for s in dev.trace.on("h2d") + dev.trace.on("d2h")) / STEPS for dev in devs],
                "network": [b / STEPS for b in group.received], "peak": [dev.ledger.peak("device") for dev in devs],
                "sizes": [sum(p.numel() for p in unit) for unit in units_of(base)]}


def predicted(sizes: list[int]) -> tuple[float, float]:
    """(link bytes, network bytes) per step and rank: the step model for the shards; an all-gather for every fetch
    (the resident unit once, each block twice) and a reduce-scatter for every unit, each moving (N-1)/N of it."""
    link = predicted_link_bytes(sizes[0], sizes[1], len(sizes) - 1, WORLD, 4)
    padded = [WORLD * shard(n, WORLD) * 4 for n in sizes]
    moved = 2 * padded[0] + 3 * sum(padded[1:])
    return link, moved * (WORLD - 1) / WORLD


def _check_returned(returned: list, sizes: list[int]) -> None:
    for rank, got in enumerate(returned):
        if not isinstance(got, (list, tuple)) or len(got) != len(sizes):
            raise AssertionError(f"rank {rank} returned {got!r:.80}; expected a list of {len(sizes)} units, each "
                                 "(master, exp_avg, exp_avg_sq), this rank's slices")
        for u, (unit, n) in enumerate(zip(got, sizes, strict=True)):
            k = shard(n, WORLD)
            if not (isinstance(unit, (list, tuple)) and len(unit) == 3 and all(
                    isinstance(t, torch.Tensor) and t.numel() == k and t.dtype == torch.float32 for t in unit)):
                raise AssertionError(f"rank {rank}, unit {u}: expected 3 fp32 tensors of {k:,} elements (its slice of "
                                     f"{n:,} padded to a multiple of {WORLD}), got {unit!r:.80}")


def _check_bits(returned: list, sizes: list[int]) -> None:
    want = one_process()
    for u, n in enumerate(sizes):
        for j, key in enumerate(KEYS):
            got = torch.cat([returned[r][u][j].reshape(-1) for r in range(WORLD)])[:n]
            if torch.equal(got, want[j][u]):
                continue
            differ = int((got != want[j][u]).sum())
            where = "the parameters outside the blocks" if u == 0 else f"block {u - 1}"
            raise AssertionError(f"unit {u} ({where}), {key}: {differ:,} of {n:,} elements differ from one process "
                                 f"accumulating both micro-batches, after {STEPS} steps (largest difference "
                                 f"{(got - want[j][u]).abs().max().item():.3g}){_why(returned, u, n, want)}")


def _why(returned: list, u: int, n: int, want: tuple) -> str:
    """What the learner's moments say about the difference, computed for this unit."""
    def mine(j: int) -> torch.Tensor:
        return torch.cat([returned[r][u][j].reshape(-1) for r in range(WORLD)])[:n]

    def swapped(j: int) -> torch.Tensor:
        return torch.cat([returned[r][u][j].reshape(-1) for r in reversed(range(WORLD))])[:n]
    if torch.equal(swapped(0), want[0][u]):
        return ": the ranks' slices are swapped (rank r owns elements [r*k:(r+1)*k] of the padded unit)"
    ratio = _median_ratio(mine(1), want[1][u])
    if abs(ratio - WORLD) < 0.1:
        return (f": your exp_avg is about {ratio:.2f} times one process's, so your gradients are the ranks' sum; one "
                f"process divides each micro-batch's loss by {WORLD}, so the sum must be their mean")
    if abs(ratio - 1) < 0.01 and abs(_median_ratio(mine(2), want[2][u]) - 1) < 0.01:
        return (": the moments agree to within 1% and the weights do not: update with the course's fused Adam "
                "(chapter 3) and OffloadAdam's settings (weight_decay=0.01)")
    return ""


def _median_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    nonzero = want.abs() > 1e-12
    return (got[nonzero] / want[nonzero]).median().item() if nonzero.any() else 1.0


@grader("C.3", nothing_to_refuse="the engine does not shard the weights (chapter 10: ZeRO-2 only); this step is "
                                 "a design it does not contain")
def check_zero3(fn: Callable) -> str:
    run = run_ranks(fn)
    sizes = run["sizes"]
    _check_returned(run["returned"], sizes)
    _check_bits(run["returned"], sizes)
    link, network = predicted(sizes)
    for rank in range(WORLD):
        if abs(run["link"][rank] - link) > 0.5:
            raise AssertionError(f"rank {rank}'s link carried {run['link'][rank]:,.0f} B per step; the step model "
                                 f"predicts {link:,.0f} for its shards (each block up for its forward and again for "
                                 "its backward, the resident slice once, every gradient slice down once)")
        if abs(run["network"][rank] - network) > 0.5:
            raise AssertionError(f"{run['network'][rank]:,.0f} B per step reached rank {rank} over the network; an "
                                 f"all-gather per fetch and a reduce-scatter per unit move {network:,.0f}")
        if run["peak"][rank] > run["budget"]:
            raise AssertionError(f"rank {rank}'s device peaked at {run['peak'][rank]:,} B, over the budget of "
                                 f"{run['budget']:,} B (the resident weights and three blocks' weights): a gathered "
                                 "block, its gradients and their buffers go as soon as the block is done, and a "
                                 "buffer a queued copy still reads counts until the copy has run")
    return (f"{WORLD} gloo ranks, {STEPS} steps: weights and Adam moments bit for bit those of one process, "
            f"{link:,.0f} B per step over each link as the step model predicts, each device within its "
            f"{run['budget']:,} B budget")
