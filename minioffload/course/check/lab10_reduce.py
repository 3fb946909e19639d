"""Grader for Lab 10's Task 10.2: each subgroup's gradients packed, summed into the rank that owns it, and copied by
that rank alone into its pinned staging. Task 10.1: lab10.py; Task 10.3: lab10_gather.py.

The learner's `reduce_to_owners(comm, dev, grads, owners, staging, d2h)` runs on 2, 3 and 4 ranks on threads
(lab10_ranks.ThreadGroup), each rank with its own strict sim device whose device-to-host link has a long latency, so
that a copy still in flight when the returned events are reached shows as NaN (the strict sim fills a pinned
destination with NaN while a copy into it runs). Every rank is given a NaN-filled staging buffer for every subgroup,
so that the grader sees which were written. What must hold: the owner's staging equals the sum over ranks of the
subgroup's packed gradients (summed in rank order, as the group does: bitwise), no other rank's staging is written,
each rank's d2h lane in its trace carries exactly the bytes of the subgroups it owns, and each rank receives sums
for its own subgroups only (the group counts them). Verdicts carry counts and sizes, never timings.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...devices.common import Link
from ...layout import shard_owners
from .grading import grader
from .lab10_ranks import ThreadGroup

LINK = Link(bandwidth=2e9, latency=0.03)  # a copy takes 30 ms: one not waited for is caught in flight
SUBGROUPS = (  # the parameter shapes of each subgroup, in order
    ((16, 8), (16,)), ((24, 8),), ((4, 4), (4,), (4,)), ((100,),), ((7, 3),), ((8, 8), (8,)), ((50,),),
)
WORLDS = ((2, 20), (3, 30), (4, 40))  # (ranks, seed)


def sizes() -> list[int]:
    return [sum(math.prod(shape) for shape in shapes) for shapes in SUBGROUPS]


def packed(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _gradients(world: int, seed: int) -> list[list[list[torch.Tensor]]]:
    """grads[rank][subgroup] = that subgroup's gradients on that rank, in parameter order (host tensors)."""
    gen = torch.Generator().manual_seed(seed)
    return [[[torch.randn(shape, generator=gen) * 2.0 ** rank for shape in shapes] for shapes in SUBGROUPS]
            for rank in range(world)]


def _describe(tensor: torch.Tensor, want: torch.Tensor) -> str:
    bad = (tensor != want) & ~(tensor.isnan() & want.isnan())
    index = int(bad.nonzero()[0]) if bad.any() else 0
    return f"element {index} is {tensor[index].item():.6g}, expected {want[index].item():.6g}"


def _owner_hint(index: int, got: torch.Tensor, want: torch.Tensor, mine: list[torch.Tensor],
                everyone: list[list[torch.Tensor]], owner: int, world: int) -> str:
    where = f"rank {owner}'s staging of subgroup {index} (rank {owner} owns it, {world} ranks)"
    if got.isnan().all():
        return (f"{where} was never written: after the sum, the owner copies the packed buffer into staging[i] "
                "with dev.copy on the copy stream")
    if torch.equal(got, packed(mine)):
        return (f"{where} holds rank {owner}'s own gradients, not the sum over the {world} ranks: sum the packed "
                "buffer into the subgroup's owner (the collective's root is owners[i]) before the owner copies it")
    reversed_sum = packed(list(reversed(everyone[0])))
    for grads in everyone[1:]:
        reversed_sum = reversed_sum + packed(list(reversed(grads)))
    if len(everyone[0]) > 1 and torch.equal(got, reversed_sum):
        return (f"{where} holds the sum with the parameters packed in another order: pack them in the subgroup's "
                "order (grads[i][0] first), each flattened, as the engine's staging lays them out")
    return f"{where}: {_describe(got, want)}. It must be the sum over the ranks of the packed gradients"


def _run_case(fn: Callable, world: int, seed: int) -> None:
    host_grads = _gradients(world, seed)
    numels = sizes()
    owners = shard_owners(numels, world)
    expected = []
    for i in range(len(SUBGROUPS)):
        total = packed(host_grads[0][i]).clone()
        for rank in range(1, world):
            total += packed(host_grads[rank][i])  # in rank order, as the group sums
        expected.append(total)
    with ThreadGroup(world, strict=True, d2h=LINK) as group:
        devs = group.devices
        grads = [[[devs[r].adopt(g.clone(), "grad") for g in sub] for sub in host_grads[r]] for r in range(world)]
        staging = [[devs[r].host_empty(n).fill_(float("nan")) for n in numels] for r in range(world)]
        streams = [dev.stream("d2h") for dev in devs]
        results = group.run(lambda rank, comm: fn(comm, devs[rank], grads[rank], owners, staging[rank],
                                                  streams[rank]))
        for rank, events in enumerate(results):
            if isinstance(events, dict):
                events = list(events.values())
            if not isinstance(events, (list, tuple)) or not all(hasattr(e, "synchronize") for e in events):
                raise AssertionError(f"with {world} ranks, rank {rank} returned {events!r:.80}; expected the list of "
                                     "events recorded after its copies (the engine waits on them before it reads "
                                     "the staging)")
            for event in events:
                event.synchronize()
        early = [[buffer.clone() for buffer in staging[r]] for r in range(world)]  # when the events say done
        for dev in devs:
            dev.synchronize()
        own = [sum(n * 4 for n, o in zip(numels, owners, strict=True) if o == r) for r in range(world)]
        down = [sum(s.nbytes for s in dev.trace.on("d2h")) for dev in devs]
        for rank in range(world):
            for i, owner in enumerate(owners):
                got = staging[rank][i]
                if rank != owner and not got.isnan().all():
                    raise AssertionError(
                        f"with {world} ranks, rank {rank} wrote its staging of subgroup {i}, which rank {owner} owns: "
                        f"only the owner copies a subgroup's sum to the host, so each link carries 1/{world} of the "
                        f"gradients (rank {rank}'s carried {down[rank]:,} B down; the subgroups it owns are "
                        f"{own[rank]:,} B)")
                if rank == owner and not torch.equal(got, expected[i]):
                    raise AssertionError(_owner_hint(i, got, expected[i], host_grads[rank][i],
                                                     [host_grads[r][i] for r in range(world)], owner, world))
                if rank == owner and not torch.equal(early[rank][i], expected[i]):
                    raise AssertionError(
                        f"with {world} ranks, subgroup {i}'s copy into rank {owner}'s staging had not landed when "
                        "the events you returned were reached: record each event on the copy stream after its copy, "
                        "so that the engine's wait on it covers the copy")
        for rank in range(world):
            if down[rank] != own[rank]:
                how = (" (a host-side copy_ of device memory is not a copy on a stream: use dev.copy(staging, flat, "
                       "stream))" if down[rank] == 0 else "")
                raise AssertionError(f"with {world} ranks, rank {rank}'s trace shows {down[rank]:,} B over its "
                                     f"device-to-host link; the subgroups it owns are {own[rank]:,} B{how}")
            if group.summed[rank] != own[rank]:
                raise AssertionError(
                    f"with {world} ranks, rank {rank} received sums of {group.summed[rank]:,} B of gradients; the "
                    f"subgroups it owns are {own[rank]:,} B. An all_reduce gives every rank every sum (and moves "
                    "twice the bytes of a reduce-scatter); a reduce to the owner gives each rank only its own "
                    f"1/{world} ({'; '.join(group.calls[rank][:2])}, ...)")


@grader("10.2", rebuilds=("minioffload.engine.sharded.ShardedSteps.reduce",))
def reduce_to_owners(fn: Callable) -> str:
    """fn(comm, dev, grads, owners, staging, d2h) -> the events recorded after this rank's copies."""
    for world, seed in WORLDS:
        _run_case(fn, world, seed)
    numels = sizes()
    return (f"{len(SUBGROUPS)} subgroups ({sum(numels):,} gradients) on {', '.join(str(w) for w, _ in WORLDS)} "
            "ranks: each owner's staging holds the sum over the ranks, bitwise, once its events are reached; no other "
            "rank's staging is written; each rank's link carries, and each rank receives summed, exactly the bytes "
            "of the subgroups it owns")
