"""Graders for the capstone's Tasks C.1 and C.2 (ZeRO-3-style offload on two gloo ranks); Task C.3: capstone_zero3.py.

Task C.1, `link_bytes(resident, block, layers, world, element_size)`: the bytes over each rank's own host link in one
step. Checked, for models of several shapes and rank counts, against the step model (predict/stepmodel.py) run on
the model one rank sees: its shard of the resident weights and of every block, streamed block by block with no
prefetch (each block fetched for its forward and again for its backward, every gradient copied down), plus the
resident shard going up once, which the step model leaves out (it keeps resident weights on the device).

Task C.2, `reduce_scatter_grads(comm, dev, grads, staging, d2h)`: one unit's gradients summed over the ranks, each rank
keeping its own padded slice in pinned memory. Run on 2 and 3 gloo ranks (capstone_gloo.GlooGroup) with strict sim
devices and a slow link; the gradients are small integers, so every summation order gives the same bits.

What this is not: the ZeRO-3 step itself (capstone_zero3.py), or a timing of anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...devices.common import Link
from ...machine.profiles import preset
from ...predict import stepmodel
from ...predict.step_config import StepConfig, Workload
from .capstone_gloo import GlooGroup
from .grading import grader

PRECISION = {4: "fp32", 2: "mixed_bf16"}  # bytes per element -> the step model's precision of weights and gradients
SHAPES = ((8384, 49984, 4, 2, 4), (8384, 49984, 4, 1, 4), (1001, 333, 3, 3, 2), (0, 4097, 2, 4, 4),
          (75, 10, 6, 2, 2), (7, 1_000_003, 1, 8, 2))  # (resident, block, layers, world, element_size)


def shard(numel: int, world: int) -> int:
    """Elements of one rank's slice when `numel` is padded to a multiple of `world`."""
    return -(-numel // world)


def predicted_link_bytes(resident: int, block: int, layers: int, world: int, element_size: int) -> float:
    """The step model's bytes per step over one rank's link, for the model made of that rank's shards."""
    k_res, k_block = shard(resident, world), shard(block, world)
    work = Workload(k_res + layers * k_block, 1024, PRECISION[element_size], 8 * layers + 4, num_layers=layers,
                    resident_params=k_res)
    prediction = stepmodel.predict(work, preset("h100-sxm"), StepConfig(params_on="host", prefetch=0))
    return prediction.rank_link_bytes[0] + k_res * element_size  # + the resident shard, gathered once per step


def _hint(got: float, resident: int, block: int, layers: int, world: int, size: int) -> str:
    k_res, k_block = shard(resident, world), shard(block, world)
    guesses = {  # what a plausible slip gives, computed for this case
        "the elements divided by the ranks without padding (a rank's slice is the padded size over the ranks)":
            (2 * resident + 3 * layers * block) * size / world,
        "each block fetched once a step (it is released after its forward and fetched again for its backward)":
            (2 * k_res + 2 * layers * k_block) * size,
        "the whole gradients down every link (each rank copies down only its own slice of the sums)":
            (k_res + 2 * layers * k_block + resident + layers * block) * size,
        "the whole weights up every link (a rank uploads its own slice; the others arrive over the network)":
            (resident + 2 * layers * block + k_res + layers * k_block) * size,
        "the resident weights fetched twice (they are gathered once and held through the step)":
            (3 * k_res + 3 * layers * k_block) * size,
    }
    for why, value in guesses.items():
        if abs(got - value) < 0.5 and abs(value - predicted_link_bytes(resident, block, layers, world, size)) >= 0.5:
            return f": that is {why}"
    return ""


@grader("C.1", nothing_to_refuse="the step model refuses ranks with streamed weights, so no runtime function "
                                 "computes this figure")
def check_link_bytes(fn: Callable) -> str:
    for resident, block, layers, world, size in SHAPES:
        got = fn(resident, block, layers, world, size)
        call = f"link_bytes({resident}, {block}, {layers}, world={world}, element_size={size})"
        if not isinstance(got, (list, tuple)) or len(got) != world:
            raise AssertionError(f"{call} returned {got!r:.80}; expected a list of {world} numbers, one per rank")
        want = predicted_link_bytes(resident, block, layers, world, size)
        for rank, value in enumerate(got):
            if not isinstance(value, (int, float)) or abs(value - want) >= 0.5:
                hint = _hint(value, resident, block, layers, world, size) if isinstance(value, (int, float)) else ""
                raise AssertionError(f"{call}: rank {rank} gets {value!r:.40}, the step model {want:,.0f} B per "
                                     f"step{hint}")
    return f"{len(SHAPES)} models on 1 to 8 ranks: each rank's link bytes per step as the step model predicts them"


# Task C.2 ----------------------------------------------------------------------------------------

LINK = Link(bandwidth=2e9, latency=0.03)  # a copy down takes 30 ms: an event recorded too early is reached first
CASES = ((2, (1001, 37, 5), torch.float32, 41), (3, (4096 + 5, 64), torch.bfloat16, 42), (2, (63,), torch.float32, 43))
# (ranks, the unit's parameters' elements, dtype, seed)


def _grads(numels, world: int, dtype, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)  # small integers: any order of summing gives the same bits
    return [[torch.randint(-8, 9, (n,), generator=gen).to(dtype) for n in numels] for _ in range(world)]


def _run_c2(fn: Callable, world: int, numels, dtype, seed: int) -> None:
    numel, k = sum(numels), shard(sum(numels), world)
    grads = _grads(numels, world, dtype, seed)
    total = torch.zeros(world * k, dtype=dtype)
    total[:numel] = sum(torch.cat(g) for g in grads)
    call = f"reduce_scatter_grads on {world} ranks ({numel:,} elements in {str(dtype).removeprefix('torch.')}, " \
           f"slices of {k:,})"
    with GlooGroup(world, strict=True, d2h=LINK) as group:
        devs = group.devices
        mine = [[devs[r].adopt(g.clone(), "grad") for g in grads[r]] for r in range(world)]
        staging = [devs[r].host_empty(k, dtype).fill_(float("nan")) for r in range(world)]
        streams = [dev.stream("d2h") for dev in devs]
        events = group.run(lambda rank, comm: fn(comm, devs[rank], mine[rank], staging[rank], streams[rank]))
        for rank, event in enumerate(events):
            if not hasattr(event, "synchronize"):
                raise AssertionError(f"{call}: rank {rank} returned {event!r:.60}; expected the event after which "
                                     "its copy has landed")
            event.synchronize()
            want = total[rank * k:(rank + 1) * k]
            if not torch.equal(staging[rank], want):
                nan = int(staging[rank].isnan().sum())
                raise AssertionError(f"{call}: rank {rank}'s staging " + (
                    f"has {nan:,} of {k:,} elements not landed when its event was reached: record the event on the "
                    "copy stream after the copy" if nan else
                    f"does not hold slice [{rank * k}:{(rank + 1) * k}] of the padded sum over the ranks"
                    + ("; it holds another rank's slice" if any(torch.equal(staging[rank], total[q * k:(q + 1) * k])
                                                             for q in range(world)) else "")))
        for rank, dev in enumerate(devs):
            dev.synchronize()
            down = sum(span.nbytes for span in dev.trace.on("d2h"))
            if down != k * total.element_size():
                raise AssertionError(f"{call}: rank {rank}'s link carried {down:,} B, expected its slice, "
                                     f"{k * total.element_size():,} B" + (
                                         ": a host-side copy_ of device memory is not a copy over the link; use "
                                         "dev.copy on the d2h stream" if down == 0 else ""))
            ring = (world - 1) * world * k * total.element_size() / world
            if abs(group.received[rank] - ring) > 0.5:
                raise AssertionError(f"{call}: {group.received[rank]:,.0f} B reached rank {rank} over the network, "
                                     f"a reduce-scatter moves {ring:,.0f}" + (
                                         ": that is twice, an all-reduce (every rank gets every sum)"
                                         if abs(group.received[rank] - 2 * ring) < 0.5 else ""))


@grader("C.2", nothing_to_refuse="the runtime has no reduce-scatter into a pinned slice: its shards are whole "
                                 "subgroups, reduced into their owner")
def check_reduce_scatter(fn: Callable) -> str:
    for case in CASES:
        _run_c2(fn, *case)
    return (f"{len(CASES)} units on 2 and 3 gloo ranks, fp32 and bf16: each rank's slice of the sums in its pinned "
            "staging when its event is reached, its link carrying only that slice, the network a reduce-scatter's")
