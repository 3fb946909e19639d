"""Capstone verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO; the gloo ranks
(capstone_gloo.GlooGroup) run real gloo collectives and stop, instead of hanging, when ranks diverge."""

import pytest
import torch
import torch.nn.functional as F
from grader_harness import mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

import minioffload.course.check.capstone  # noqa: F401  (registers Tasks C.1 and C.2)
import minioffload.course.check.capstone_zero3  # noqa: F401  (registers Task C.3)
from minioffload.course.check.capstone_gloo import GlooGroup
from minioffload.course.check.lab10_ranks import CollectiveMismatch
from minioffload.kernels.adam import adam_fused

# Task C.1 ---------------------------------------------------------------------------------------


def bytes_with(*, pad=True, block_fetches=2, resident_fetches=1, grads="slice"):
    def link_bytes(resident, block, layers, world, element_size):
        def part(n):
            return -(-n // world) if pad else n / world
        up = resident_fetches * part(resident) + block_fetches * layers * part(block)
        down = part(resident) + layers * part(block) if grads == "slice" else resident + layers * block
        return [(up + down) * element_size] * world
    return link_bytes


# Task C.2 ---------------------------------------------------------------------------------------

def scatter_with(*, collective="reduce_scatter", event_after=True, device_copy=True, pad=True, slot="mine"):
    def reduce_scatter_grads(comm, dev, grads, staging, d2h):
        rank, world, k = comm.get_rank(), comm.get_world_size(), staging.numel()
        numel = sum(g.numel() for g in grads)
        parts = [g.reshape(-1) for g in grads] + ([torch.zeros(world * k - numel, dtype=staging.dtype)] if pad else [])
        flat = dev.adopt(torch.cat(parts), "grads")
        if collective == "reduce_scatter":
            out = dev.empty(k, staging.dtype, "my slice")
            comm.reduce_scatter_tensor(out, flat)
        else:
            comm.all_reduce(flat)
            at = rank if slot == "mine" else world - 1 - rank
            out = flat[at * k:(at + 1) * k]
        done = dev.event()
        dev.stream_waits_for_compute(d2h)
        if not event_after:
            done.record(d2h)
        if device_copy:
            dev.copy(staging, out, d2h)
            dev.keep_alive(out, d2h)
        else:
            staging.copy_(out)
        if event_after:
            done.record(d2h)
        return done
    return reduce_scatter_grads


# Task C.3 ---------------------------------------------------------------------------------------

def zero3_with(*, scale=True, release=True, refetch=True, collective="reduce_scatter", weight_decay=0.01):
    gather_done = {}

    def gather(comm, dev, shard, h2d):
        rank, world, k = comm.get_rank(), comm.get_world_size(), shard.numel()
        flat = dev.empty(world * k, shard.dtype, "unit")
        mine = flat[rank * k:(rank + 1) * k]
        dev.stream_waits_for_compute(h2d)
        dev.copy(mine, shard, h2d)
        landed = dev.event()
        landed.record(h2d)
        dev.compute_waits_for(landed)
        comm.all_gather_into_tensor(flat, mine)
        return flat

    def zero3_rank(comm, dev, model, batches, lr):
        rank, world = comm.get_rank(), comm.get_world_size()
        blocks = list(model.blocks)
        inside = {id(p) for b in blocks for p in b.parameters()}
        units = [[p for p in model.parameters() if id(p) not in inside], *(list(b.parameters()) for b in blocks)]
        shapes = [[p.shape for p in unit] for unit in units]
        h2d, d2h = dev.stream("h2d"), dev.stream("d2h")
        state = []
        for unit in units:
            numel = sum(p.numel() for p in unit)
            k = -(-numel // world)
            full = torch.zeros(world * k)
            full[:numel] = torch.cat([p.detach().reshape(-1) for p in unit])
            state.append([dev.host_empty(k).copy_(full[rank * k:(rank + 1) * k]), torch.zeros(k), torch.zeros(k),
                          dev.host_empty(k)])
            for p in unit:
                p.data = torch.empty(0)

        def fetch(u):
            flat = gather(comm, dev, state[u][0], h2d)
            at = 0
            for p, shape in zip(units[u], shapes[u], strict=True):
                p.data = flat[at:at + shape.numel()].view(shape)
                at += shape.numel()
            gather_done[rank] = gather_done.get(rank, 0) + 1

        def drop(u):
            for p in units[u]:
                p.data, p.grad = torch.empty(0), None

        def scatter(u):
            k = state[u][0].numel()
            numel = sum(p.numel() for p in units[u])
            flat = dev.adopt(torch.cat([p.grad.reshape(-1) for p in units[u]] + [torch.zeros(world * k - numel)]))
            if collective == "reduce_scatter":
                out = dev.empty(k, torch.float32, "my grads")
                comm.reduce_scatter_tensor(out, flat)
            else:
                comm.all_reduce(flat)
                out = flat[rank * k:(rank + 1) * k]
            dev.stream_waits_for_compute(d2h)
            dev.copy(state[u][3], out, d2h)
            dev.keep_alive(out, d2h)
            done = dev.event()
            done.record(d2h)
            return done

        for step, (x, y) in enumerate(batches, 1):
            B, T = x.shape
            fetch(0)
            inputs = []
            with torch.no_grad():
                h = model.drop(model.tok_emb(x) + model.pos_emb(torch.arange(T)))
                for i, block in enumerate(blocks):
                    fetch(i + 1)
                    inputs.append(h)
                    h = block(h)
                    if release and refetch:
                        drop(i + 1)
            h = h.detach().requires_grad_()
            loss = F.cross_entropy(model.lm_head(model.ln_f(h)).view(B * T, -1), y.reshape(B * T))
            (loss / world if scale else loss).backward()
            grad, events = h.grad, {}
            for i in reversed(range(len(blocks))):
                if refetch:
                    fetch(i + 1)
                x_i = inputs[i].detach().requires_grad_()
                blocks[i](x_i).backward(grad)
                grad = x_i.grad
                if i + 2 in events:
                    events[i + 2].synchronize()  # one gradient slice in flight at a time: a bounded peak
                events[i + 1] = scatter(i + 1)
                drop(i + 1)
            model.drop(model.tok_emb(x) + model.pos_emb(torch.arange(T))).backward(grad)
            events[0] = scatter(0)
            drop(0)
            for u, (master, exp_avg, exp_avg_sq, grads) in enumerate(state):
                events[u].synchronize()
                adam_fused(master, grads, exp_avg, exp_avg_sq, step=step, lr=lr, weight_decay=weight_decay)
        return [tuple(s[:3]) for s in state]
    return zero3_rank


REFERENCE = {"C.1": bytes_with(), "C.2": scatter_with(), "C.3": zero3_with()}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("C.1", bytes_with(pad=False), "without padding"),
    ("C.1", bytes_with(block_fetches=1), "each block fetched once a step"),
    ("C.1", bytes_with(grads="whole"), "the whole gradients down every link"),
    ("C.1", bytes_with(resident_fetches=2), "the resident weights fetched twice"),
    ("C.1", lambda resident, block, layers, world, size: [0.0], "expected a list of 2 numbers"),
    ("C.2", scatter_with(event_after=False), "not landed when its event was reached"),
    ("C.2", scatter_with(collective="all_reduce"), "twice, an all-reduce"),
    ("C.2", scatter_with(collective="all_reduce", slot="mirrored"), "another rank's slice"),
    ("C.2", scatter_with(device_copy=False), "a host-side copy_ of device memory"),
    ("C.2", scatter_with(pad=False), "reduce_scatter_tensor needs an input of world size"),
    ("C.3", zero3_with(scale=False), "so your gradients are the ranks' sum"),
    ("C.3", zero3_with(weight_decay=0.0), "OffloadAdam's settings (weight_decay=0.01)"),
    ("C.3", zero3_with(release=False), "over the budget"),
    ("C.3", zero3_with(refetch=False), "the step model predicts"),
    ("C.3", zero3_with(collective="all_reduce"), "over the network"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("C.1", "C.2", "C.3"))


# the gloo ranks ---------------------------------------------------------------------------------


def test_gloo_collectives_sum_scatter_and_gather():
    with GlooGroup(2) as group:
        def work(rank, comm):
            dev = group.devices[rank]
            inp = dev.adopt(torch.arange(4, dtype=torch.float32) * (rank + 1))
            out = dev.empty(2)
            comm.reduce_scatter_tensor(out, inp)
            gathered = dev.empty(4)
            comm.all_gather_into_tensor(gathered, out)
            return out.tolist(), gathered.tolist()
        results = group.run(work)
    assert results == [([0.0, 3.0], [0.0, 3.0, 6.0, 9.0]), ([6.0, 9.0], [0.0, 3.0, 6.0, 9.0])]
    assert group.received == [16.0, 16.0]  # half of each 16-byte buffer, twice


def test_gloo_ranks_that_diverge_raise_instead_of_hanging():
    with GlooGroup(2) as group, pytest.raises(CollectiveMismatch, match="same collectives in the same order"):
        def work(rank, comm):
            t = group.devices[rank].adopt(torch.ones(3))
            comm.all_reduce(t) if rank else comm.broadcast(t, src=0)
        group.run(work, timeout_s=10)


def test_a_right_zero3_is_bit_equal_however_many_threads_torch_has():
    # several intra-op threads change the order in which the embedding's backward adds repeated rows: the grader runs
    # the ranks and the one process on one thread, so a laptop's thread count cannot fail a right answer
    from minioffload.course import check
    from minioffload.course.check import capstone_zero3
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    capstone_zero3.one_process.cache_clear()
    try:
        verdict = check.grade("C.3", zero3_with())
        assert verdict.passed, str(verdict)
        assert torch.get_num_threads() == 2  # and the learner's setting is given back
    finally:
        torch.set_num_threads(before)
        capstone_zero3.one_process.cache_clear()
