"""Grader for Lab 10's Task 10.3: a block's weights gathered before it runs, each rank holding 1/N of them (ZeRO-3 /
FSDP style). Tasks 10.1 and 10.2: lab10.py and lab10_reduce.py.

The learner's `gather_block(comm, dev, shard, h2d)` runs on 2, 3 and 4 ranks on threads (lab10_ranks.ThreadGroup),
for blocks whose size is not a multiple of the ranks (the shards are padded with zeros), in fp32 and bf16. Each rank's
strict sim device hands out NaN-filled memory and its host-to-device link has a long latency, so a collective that
reads a rank's slice before that rank's upload landed gathers NaN. What must hold, once the ranks return and their
devices are synchronized: every rank holds the whole padded block on its device, bitwise; each rank's h2d lane in
its trace carries exactly its own shard; and what reaches each rank from the others is the other N-1 shards, as an
all-gather moves them (the group counts them; an all-reduce moves twice that). Verdicts carry counts and sizes, never
timings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...devices.common import Link
from .grading import grader
from .lab10_ranks import ThreadGroup

LINK = Link(bandwidth=2e9, latency=0.03)  # an upload takes 30 ms: a collective that does not wait reads NaN
CASES = ((2, 1001, torch.float32, 31), (3, 4096 + 5, torch.bfloat16, 32), (4, 37, torch.float32, 33))
# (ranks, the block's elements, its dtype, seed)


def padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def _block(numel: int, world: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The whole block, flat, padded with zeros to a multiple of `world` (host)."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.zeros(padded(numel, world), dtype=dtype)
    full[:numel] = torch.randn(numel, generator=gen).to(dtype)
    return full


def _slice_hint(got: torch.Tensor, full: torch.Tensor, rank: int, world: int) -> str:
    k = full.numel() // world
    q = next(q for q in range(world) if not torch.equal(got[q * k:(q + 1) * k], full[q * k:(q + 1) * k]))
    part, want = got[q * k:(q + 1) * k], full[q * k:(q + 1) * k]
    where = f"on rank {rank} of {world}, elements [{q * k}:{(q + 1) * k}] (rank {q}'s shard)"
    if part.isnan().all():
        if q == rank:
            return f"{where} were never written: this rank's shard goes up its own link into its slice"
        return (f"{where} are NaN: rank {q}'s slice was gathered before its upload landed. The collective reads the "
                "device buffer, so the upload must be done first: record an event after the copy and wait for it "
                "(dev.compute_waits_for(event), or event.synchronize()) before the collective")
    for p in range(world):
        if p != q and torch.equal(part, full[p * k:(p + 1) * k]):
            return (f"{where} hold rank {p}'s shard: rank q's shard belongs at [q*k:(q+1)*k], the all-gather's "
                    "rank order (the same place as in the block)")
    bad = int((part.view(torch.int16 if part.element_size() == 2 else torch.int32)
               != want.view(torch.int16 if want.element_size() == 2 else torch.int32)).nonzero()[0])
    return f"{where} differ: element {q * k + bad} is {part[bad].item():.6g}, expected {want[bad].item():.6g}"


def _run_case(fn: Callable, world: int, numel: int, dtype: torch.dtype, seed: int) -> None:
    full = _block(numel, world, dtype, seed)
    k = full.numel() // world
    nbytes = k * full.element_size()
    with ThreadGroup(world, strict=True, h2d=LINK) as group:
        devs = group.devices
        shards = [devs[r].host_empty(k, dtype) for r in range(world)]
        for r, shard in enumerate(shards):
            shard.copy_(full[r * k:(r + 1) * k])
        streams = [dev.stream("h2d") for dev in devs]
        results = group.run(lambda rank, comm: fn(comm, devs[rank], shards[rank], streams[rank]))
        for dev in devs:
            dev.synchronize()
        call = f"gather_block on {world} ranks ({numel:,} elements in {str(dtype).removeprefix('torch.')}, shards " \
               f"of {k:,})"
        for rank, got in enumerate(results):
            if not isinstance(got, torch.Tensor) or got.numel() != full.numel() or got.dtype != dtype:
                shown = f"{tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}" \
                    if isinstance(got, torch.Tensor) else f"{got!r:.60}"
                raise AssertionError(f"{call}: rank {rank} returned {shown}; expected the whole padded block, a "
                                     f"device tensor of {full.numel():,} elements ({world} x the shard) in "
                                     f"{str(dtype).removeprefix('torch.')}")
            if not devs[rank].is_device(got):
                raise AssertionError(f"{call}: rank {rank} returned a host tensor; the block must end on the rank's "
                                     "device (dev.empty), where the forward reads it")
            if not torch.equal(got.reshape(-1), full):
                raise AssertionError(f"{call}: {_slice_hint(got.reshape(-1), full, rank, world)}")
        for rank, dev in enumerate(devs):
            up = sum(s.nbytes for s in dev.trace.on("h2d"))
            if up != nbytes:
                raise AssertionError(f"{call}: rank {rank}'s trace shows {up:,} B over its host-to-device link; its "
                                     f"shard is {nbytes:,} B. Each rank sends only its own 1/{world} up; the other "
                                     "shards arrive over the network")
            others = (world - 1) * nbytes
            if group.received[rank] != others:
                twice = " (an all-reduce moves twice what an all-gather does)" \
                    if group.received[rank] == 2 * others else ""
                raise AssertionError(f"{call}: {group.received[rank]:,.0f} B reached rank {rank} from the others "
                                     f"({'; '.join(group.calls[rank][:3])}); the other ranks' shards are "
                                     f"{others:,} B{twice}: gather them, each rank's shard into its slice")


@grader("10.3", nothing_to_refuse=(
    "a variant: the runtime broadcasts each subgroup's new weights from its owner (ShardedSteps.send_subgroup); "
    "no runtime function all-gathers a block"))
def gather_block(fn: Callable) -> str:
    """fn(comm, dev, shard, h2d) -> this rank's device tensor holding the whole (padded) block."""
    for world, numel, dtype, seed in CASES:
        _run_case(fn, world, numel, dtype, seed)
    shown = ", ".join(f"{n:,} {str(d).removeprefix('torch.')} on {w} ranks" for w, n, d, _ in CASES)
    return (f"{len(CASES)} blocks ({shown}): every rank holds the whole padded block, bitwise, having sent only its "
            "own shard up its link and received the other shards once")
