"""Who owns which optimizer subgroup when the optimizer state is sharded over ranks, and what a ring collective
moves per rank.

    owners = shard_owners([4_194_304, 4_194_304, 1_000_000], ranks=2)   # [0, 1, 0]: ties to the lowest rank
    shard_sizes([4_194_304, 4_194_304, 1_000_000], 2)                     # [5194304, 4194304] elements per rank
    ring_bytes("reduce", 8e9, ranks=8)                                    # 7e9: bytes one rank sends (and receives)

The ownership is layout.shard_owners, the engine's (engine/sharding.py),
which the models (stepmodel, memory, plan) use too:
greedy, each subgroup in order to the rank with the fewest elements so far, ties to the lowest rank. Balanced to within
the largest subgroup (max - min <= max(sizes)) and deterministic: every rank computes the same map, with no message.

What this is not: the collectives themselves (the engine runs them on torch.distributed), nor a timing (stepmodel
divides these bytes by the profile's `interconnect`).
"""

from __future__ import annotations

from ..layout import shard_owners
from ..options import Placement, check_field

COLLECTIVES = ("reduce", "broadcast", "reduce_scatter", "all_gather", "all_reduce")


def shard_sizes(sizes: list[int], ranks: int) -> list[int]:
    """Elements each rank owns under `shard_owners`."""
    load = [0] * ranks
    for size, rank in zip(sizes, shard_owners(sizes, ranks), strict=True):
        load[rank] += size
    return load


def ring_bytes(collective: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends (and receives) in a ring `collective` of `nbytes` (the full buffer): (N - 1) / N of it
    for reduce, broadcast, reduce-scatter and all-gather (pipelined rings whose shards are whole subgroups), twice
    that for an all-reduce (a reduce-scatter then an all-gather); 0 with one rank."""
    check_field(Placement, "ranks", ranks)
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    return nbytes * (ranks - 1) / ranks * (2 if collective == "all_reduce" else 1)
