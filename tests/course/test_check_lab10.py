"""Lab 10 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO; the ranks' stand-in
(lab10_ranks.ThreadGroup) behaves as torch.distributed's calls do; Task 10.4's cases are what its statement says."""

import dataclasses

import pytest
import torch
from grader_harness import (
    assert_fails,
    assert_passes,
    mistakes_fail,
    reference_passes,
    same_verdict_every_run,
    stubs_are_todo,
)

import minioffload.course.check.lab10  # noqa: F401  (registers Tasks 10.1 to 10.3; the package, 10.4)
from minioffload.course.check.lab10_ranks import CollectiveMismatch, ThreadGroup

# Task 10.1 -------------------------------------------------------------------------------------


def owners_with(*, key="fewest", ties="lowest", order="given", mutate=False, shuffle=False):
    """A correct owners(), with switches that turn it into one plausible mistake at a time."""
    calls = [0]

    def owners(sizes, ranks):
        calls[0] += 1
        if key == "round robin":
            return [i % ranks for i in range(len(sizes))]
        held, counts, out = [0] * ranks, [0] * ranks, [0] * len(sizes)
        indices = list(range(len(sizes)))
        if order == "largest first":
            indices.sort(key=lambda i: -sizes[i])
        elif order == "smallest first":
            indices.sort(key=lambda i: sizes[i])
        elif order == "largest first, equal sizes later first":
            indices.sort(key=lambda i: (-sizes[i], -i))
        for i in indices:
            def load(r, i=i):
                return {"fewest": held[r], "count": counts[r], "most": -held[r]}[key]
            tie = -1 if ties == "highest" or (shuffle and calls[0] % 2 == 0) else 1
            rank = min(range(ranks), key=lambda r: (load(r), tie * r))
            out[i] = rank
            held[rank] += sizes[i]
            counts[rank] += 1
        if mutate:
            sizes.sort()
        return out
    return owners


# Task 10.2 -------------------------------------------------------------------------------------

def reduce_with(*, owner_only=True, collective="reduce", event_after=True, every_subgroup=True, device_copy=True,
                order="given", root="owner"):
    def reduce_to_owners(comm, dev, grads, owners, staging, d2h):
        rank, world = comm.get_rank(), comm.get_world_size()
        events = []
        for i, owner in enumerate(owners):
            if not every_subgroup and owner != rank:
                continue
            parts = grads[i] if order == "given" else list(reversed(grads[i]))
            flat = dev.adopt(torch.cat([g.reshape(-1) for g in parts]), "grad bucket")
            if collective == "reduce":
                comm.reduce(flat, dst=owner if root == "owner" else i % world)
            elif collective == "all_reduce":
                comm.all_reduce(flat)
            if owner == rank or not owner_only:
                dev.stream_waits_for_compute(d2h)
                done = dev.event()
                if not event_after:
                    done.record(d2h)
                if device_copy:
                    dev.copy(staging[i], flat, d2h)
                else:
                    staging[i].copy_(flat)
                if event_after:
                    done.record(d2h)
                events.append(done)
        return events
    return reduce_to_owners


# Task 10.3 -------------------------------------------------------------------------------------

def gather_with(*, wait=True, collective="all_gather", upload=True, slot="mine", whole=True):
    def gather_block(comm, dev, shard, h2d):
        rank, world = comm.get_rank(), comm.get_world_size()
        k = shard.numel()
        flat = dev.empty(world * k, shard.dtype, "block")
        if collective == "all_reduce":
            flat.zero_()
        where = rank if slot == "mine" else world - 1 - rank
        mine = flat[where * k:(where + 1) * k]
        if upload:
            dev.stream_waits_for_compute(h2d)
            dev.copy(mine, shard, h2d)
            landed = dev.event()
            landed.record(h2d)
            if wait:
                dev.compute_waits_for(landed)
        if collective == "all_gather":
            comm.all_gather_into_tensor(flat, mine if upload else shard)
        elif collective == "all_reduce":
            comm.all_reduce(flat)
        else:  # one broadcast per rank: right, and the same bytes reach each rank
            for src in range(world):
                at = src if slot == "mine" else world - 1 - src
                comm.broadcast(flat[at * k:(at + 1) * k], src=src)
        return flat if whole else mine
    return gather_block


# Task 10.4 -------------------------------------------------------------------------------------


def diagnose_with(*, always=None, naive_rate=False, profile_as_given=False, recipe=False, subgroups_only=False,
                  tokens_over=False, numel_over=False, extra_key=False, bare=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time."""
    def diagnose_ranks(hw, run, predict):
        trace, work, config, limits = run["trace"], run["work"], run["config"], run["limits"]
        spans = trace.on("net")
        fixed = min(s.duration for s in spans if not s.nbytes)  # the norm's all-reduce: no bytes, the fixed cost
        moved = [s for s in spans if s.nbytes]
        seconds = sum(s.duration - (0.0 if naive_rate else fixed) for s in moved)
        rate = sum(s.nbytes for s in moved) / seconds
        links = run["rank_link_bytes"]
        if always:
            cause = always
        elif fixed > 2 * hw.collective_latency and not naive_rate:
            cause = "latency"
        elif rate < hw.interconnect / 2:
            cause = "interconnect"
        elif max(links) > 1.2 * min(links):
            cause = "imbalance"
        else:
            cause = "latency"
        if bare:
            return cause
        if recipe:  # one fix per cause, whatever the case
            return cause, {"latency": {"subgroup_numel": 1 << 26}, "imbalance": {"subgroup_numel": 1 << 22},
                           "interconnect": {"tokens": limits["max_tokens"]}}[cause]
        if tokens_over and cause == "interconnect":
            return cause, {"tokens": 2 * limits["max_tokens"]}
        if numel_over and cause == "latency":
            return cause, {"subgroup_numel": 1 << 30}
        believed = hw if profile_as_given else hw.replace(collective_latency=fixed, interconnect=rate)
        low, high = limits["min_subgroup_numel"], limits["max_subgroup_numel"]
        sizes = [1 << e for e in range(20, 29) if low <= 1 << e <= high]
        tokens = [work.tokens] if subgroups_only else [work.tokens, limits["max_tokens"]]

        def tokens_per_s(numel, t):
            step = predict(believed, dataclasses.replace(work, tokens=t), config.replace(subgroup_numel=numel))
            return t / step.step_s

        numel, t = max(((n, t) for n in sizes for t in tokens), key=lambda pair: tokens_per_s(*pair))
        fix = {"subgroup_numel": numel, "tokens": t}
        if extra_key:
            fix["ranks"] = 8
        return cause, fix
    return diagnose_ranks


LARGEST = "largest first"
REFERENCE = {"10.1": owners_with(order=LARGEST), "10.2": reduce_with(), "10.3": gather_with(), "10.4": diagnose_with()}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("10.1", owners_with(), "that is the engine's map, the subgroups taken in their given order"),
    ("10.1", owners_with(key="round robin"), "round robin"),
    ("10.1", owners_with(order=LARGEST, ties="highest"), "ties go to the lowest rank"),
    ("10.1", owners_with(order=LARGEST, key="count"), "balances the number of subgroups per rank"),
    ("10.1", owners_with(order="smallest first"), "smallest first"),
    ("10.1", owners_with(order="largest first, equal sizes later first"), "take the one given first"),
    ("10.1", owners_with(order=LARGEST, key="most"), "no subgroup, though there are"),
    ("10.1", owners_with(order=LARGEST, mutate=True), "changed its list of sizes"),
    ("10.1", owners_with(order=LARGEST, shuffle=True), "must be the same every time"),
    ("10.1", lambda sizes, ranks: [0] * len(sizes), "no subgroup, though there are"),
    ("10.2", reduce_with(owner_only=False), "only the owner copies"),
    ("10.2", reduce_with(collective="all_reduce"), "An all_reduce gives every rank every sum"),
    ("10.2", reduce_with(collective="none"), "not the sum over the"),
    ("10.2", reduce_with(root="i % world"), "the collective's root is owners[i]"),
    ("10.2", reduce_with(event_after=False), "had not landed when the events you returned were reached"),
    ("10.2", reduce_with(device_copy=False), "a host-side copy_ of device memory"),
    ("10.2", reduce_with(order="reversed"), "packed in another order"),
    ("10.2", reduce_with(every_subgroup=False), "same collectives in the same order"),
    ("10.3", gather_with(wait=False), "make the compute wait for the copy's event"),
    ("10.3", gather_with(collective="all_reduce"), "twice what an all-gather does"),
    ("10.3", gather_with(upload=False), "a collective takes tensors on the rank's own device"),
    ("10.3", gather_with(collective="broadcast", slot="mirrored"), "the all-gather's rank order"),
    ("10.3", gather_with(whole=False), "expected the whole padded block"),
    ("10.4", diagnose_with(always="imbalance"), "the ranks own even shares"),
    ("10.4", diagnose_with(always="interconnect"), "each of the 585 collectives pays that fixed cost"),
    ("10.4", diagnose_with(naive_rate=True), "each of the 585 collectives pays that fixed cost"),
    ("10.4", diagnose_with(always="latency"), "the bytes are slow, not the count"),
    ("10.4", diagnose_with(profile_as_given=True), "check a fix with what the trace measured"),
    ("10.4", diagnose_with(recipe=True), "82% of the plan's 107,090 (at least 90%)"),
    ("10.4", diagnose_with(subgroups_only=True), "case 2 (interconnect, rightly)"),
    ("10.4", diagnose_with(tokens_over=True), "at most 32768 tokens"),
    ("10.4", diagnose_with(numel_over=True), "the run takes subgroups of 1,048,576 to 268,435,456 elements"),
    ("10.4", diagnose_with(extra_key=True), "a fix may change only"),
    ("10.4", diagnose_with(bare=True), "return (cause, fix)"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("10.1", "10.2", "10.3", "10.4"))


def test_one_broadcast_per_rank_is_a_right_gather_too():
    assert_passes("10.3", gather_with(collective="broadcast"))


def test_a_rank_that_skips_a_collective_fails_with_its_own_frames():
    verdict = assert_fails("10.2", reduce_with(every_subgroup=False), "CollectiveMismatch")
    assert "in reduce_to_owners" in verdict.traceback and "comm.reduce" in verdict.traceback
    frames = [line for line in verdict.traceback.splitlines() if line.startswith("  File ")]
    assert not any("lab10_ranks" in f or "lab10_reduce" in f for f in frames)  # the grader's are not the learner's


def test_a_crash_on_one_rank_is_reported_not_the_others_waiting():
    def crashes_on_rank_1(comm, dev, shard, h2d):
        if comm.get_rank() == 1:
            return {}["missing"]
        return gather_with()(comm, dev, shard, h2d)

    verdict = assert_fails("10.3", crashes_on_rank_1, "KeyError")
    assert "crashes_on_rank_1" in verdict.traceback


# the ranks' stand-in ---------------------------------------------------------------------------


def test_collectives_sum_in_rank_order_and_gather_in_rank_order():
    with ThreadGroup(3) as group:
        def work(rank, comm):
            dev = group.devices[rank]
            x = dev.adopt(torch.full((4,), float(rank + 1)))
            comm.reduce(x, dst=2)
            y = dev.adopt(torch.full((2,), 10.0 * rank))
            comm.all_reduce(y)
            z = dev.adopt(torch.full((1,), float(rank)))
            comm.broadcast(z, src=1)
            out = dev.empty(6)
            comm.all_gather_into_tensor(out, dev.adopt(torch.full((2,), float(rank))))
            return x.tolist(), y.tolist(), z.item(), out.tolist()

        results = group.run(work)
    assert [r[0] for r in results] == [[1.0] * 4, [2.0] * 4, [6.0] * 4]  # only the root's is summed
    assert all(r[1] == [30.0, 30.0] and r[2] == 1.0 for r in results)
    assert all(r[3] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0] for r in results)
    assert group.summed == [8, 8, 24]  # the all-reduce's sum on every rank, the reduce's on its root
    # reduce (all but the rank after the root in the ring), all-reduce 2 (N-1)/N, broadcast (not the root), gather
    assert group.received == pytest.approx([0 + 32 / 3 + 4 + 16, 16 + 32 / 3 + 0 + 16, 16 + 32 / 3 + 4 + 16])


@pytest.mark.parametrize("mismatch, phrase", [
    (lambda rank, comm, t: comm.reduce(t, dst=rank), "rank 0 called reduce((3,) float32, dst=0); rank 1 called"),
    (lambda rank, comm, t: comm.all_reduce(t) if rank else comm.broadcast(t, src=0), "rank 1 called all_reduce"),
    (lambda rank, comm, t: None if rank else comm.all_reduce(t), "rank 1 returned while rank 0 called all_reduce"),
])
def test_ranks_that_diverge_raise_instead_of_hanging(mismatch, phrase):
    with ThreadGroup(2) as group, pytest.raises(CollectiveMismatch, match=r"same collectives in the same order") as err:
        group.run(lambda rank, comm: mismatch(rank, comm, group.devices[rank].adopt(torch.ones(3))))
    assert phrase in str(err.value)


def test_a_collective_takes_device_tensors_only():
    with ThreadGroup(2) as group, pytest.raises(ValueError, match="rank's own device"):
        group.run(lambda rank, comm: comm.all_reduce(torch.ones(3)))
