"""Graders for Lab 4, "Offloading the optimizer", Tasks 4.1 and 4.2: the gradient hook and the
update-and-upload loop (4.3 and 4.4 are graded in lab04_clip.py).

The lab states each task as properties that must hold, not as calls to make, and these graders check
the properties, so that any order of calls that satisfies them passes. Tasks 4.1 and 4.2 run the
learner's code on the simulated device with jitter and a slow link, so that a copy is still in flight
when the grader looks: an event that does not follow its copy shows up as a wrong value. The grader
also wraps the methods of its own device object (copy, event, ...) and logs each call with the state
it saw (was the gradient device memory, which subgroups were updated), so that a failure names the
property that did not hold, and so that an ordering the simulator cannot turn into a wrong value (a
copy ordered after the compute that wrote its source) is still checked. Verdicts carry counts and
sizes, never timings, so they are the same on every run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch import nn

from ...devices import Link
from ...units import format_bytes
from .grading import grader, sim_device

JITTER = 2e-4  # s: each stream op starts up to this late
SLOW_LINK = Link(bandwidth=4e6, latency=1e-3)  # every copy takes over 1 ms: still in flight when the host looks
SENTINEL = -7.0  # staging and device buffers are filled with this: "never written"




def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _stream_name(stream) -> str:
    return repr(getattr(stream, "name", stream))


class _Spy:
    """Logs the device calls made on `dev` (one grader-owned device object), holding no tensors."""

    def __init__(self, dev):
        self.dev, self.log, self.events = dev, [], set()
        real = {name: getattr(dev, name) for name in ("copy", "adopt", "stream_waits_for_compute", "event",
                                                        "synchronize")}

        def copy(dst, src, stream=None, name=None):
            if isinstance(src, torch.Tensor) and not dev.is_device(src) and not dev.is_device(dst):
                raise AssertionError("a gradient was copied while the device did not count it as its memory: "
                                     "while its copy is queued, a gradient must count in dev.ledger (on the sim, "
                                     "autograd's gradients are ordinary CPU tensors until dev.adopt counts them)")
            self.log.append(("copy", _storage(dst), dst.data_ptr(), src.data_ptr(), stream))
            real["copy"](dst, src, stream, name)

        def adopt(tensor, name="tensor"):
            self.log.append(("adopt", _storage(tensor)))
            return real["adopt"](tensor, name)

        def stream_waits_for_compute(stream):
            self.log.append(("wait compute", stream))
            real["stream_waits_for_compute"](stream)

        def synchronize():
            self.log.append(("sync",))
            real["synchronize"]()

        def event():
            ev = real["event"]()
            record, sync = ev.record, ev.synchronize

            def spied_record(stream):
                self.log.append(("record", id(ev), stream))
                record(stream)

            def spied_synchronize(timeout=60.0):
                self.log.append(("sync",))
                sync(timeout)

            ev.record, ev.synchronize = spied_record, spied_synchronize
            self.events.add(id(ev))
            self.log.append(("event", id(ev)))
            return ev

        dev.copy, dev.adopt, dev.stream_waits_for_compute = copy, adopt, stream_waits_for_compute
        dev.event, dev.synchronize = event, synchronize

    def recorded_on(self, event) -> list:
        """The streams `event` was recorded on, in order."""
        return [entry[2] for entry in self.log if entry[0] == "record" and entry[1] == id(event)]


# ---------------------------------------------------------------------------------------------
# Task 4.1: the gradient hook

HOOK_SEEDS = (0, 1, 2)


def _hook_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))


def _hook_problems(log: list, stream, staging_ptrs: dict[int, int], names: dict[int, str]) -> list[str]:
    """Which property each hook call broke, read from the device-call log (first problems first)."""
    problems = []
    segments, current = [], None
    for entry in log:
        if entry[0] == "hook start":
            current = (entry[1], entry[2], [])
        elif entry[0] == "hook end":
            segments.append(current)
            current = None
        elif current is not None:
            current[2].append(entry)
    for index, _grad_ptr, calls in segments:
        who = f"the hook for {names[index]}"
        copies = [i for i, c in enumerate(calls) if c[0] == "copy"]
        if len(copies) != 1:
            problems.append(f"{who} made {len(copies)} copies; each gradient goes to the host once, into "
                            "staging[param] (dev.copy(dst, src, stream))")
            continue
        at = copies[0]
        _, dst_storage, dst_ptr, src_ptr, copy_stream = calls[at]
        if dst_ptr != staging_ptrs[index]:
            problems.append(f"{who} copied into something other than staging[param], where the step reads it")
        if copy_stream is not stream:
            where = "the default stream" if copy_stream is None else f"stream {_stream_name(copy_stream)}"
            problems.append(f"{who} put its copy on {where}, not on the stream you were given "
                            f"({_stream_name(stream)}): the copies must run there, beside backward's compute, and "
                            "the step's events are about that stream")
        if not any(c[0] == "wait compute" and c[1] is stream for c in calls[:at]):
            problems.append(f"{who}: the copy was not ordered after the compute that wrote the gradient, so on a GPU "
                            "the copy stream could read it before backward has finished writing it "
                            "(dev.stream_waits_for_compute(stream) orders a stream after the compute issued so far; "
                            "the sim cannot show this as a wrong value, so the check looks for that ordering)")
        records = [(n, c) for n, c in enumerate(calls) if c[0] == "record"]
        if not records:
            problems.append(f"{who} marked no point after its copy: the step waits on the pending event before it "
                            "reads staging[param], so the event must be recorded on the copy's stream after the copy")
        elif not any(c[2] is stream for n, c in records if n > at):
            before = any(n < at for n, _ in records)
            problems.append(f"{who} recorded its event " + ("before the copy, so it marks a point before the copy "
                            "and fires first" if before else "on another stream, so it fires without waiting "
                            "for the copy") + ": the event must mark a point after the copy, on its stream")
        if any(c[0] == "sync" for c in calls):
            problems.append(f"{who} blocked the host until its copy was done (a synchronize inside the hook): "
                            "backward would stall at every gradient; the hook must return with the copy queued")
    return problems


def _hook_trial(fn: Callable, seed: int) -> tuple[int, int]:
    """One backward with the learner's hook on a jittered sim device; returns (parameters, parameter bytes)."""
    torch.manual_seed(100 + seed)
    model = _hook_model()
    reference = _hook_model()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    reference(x).square().mean().backward()
    expected = [p.grad for p in reference.parameters()]
    names = dict(enumerate(f"parameter {name} {tuple(p.shape)}" for name, p in model.named_parameters()))
    with sim_device(jitter=JITTER, seed=seed, d2h=SLOW_LINK) as dev:
        params = dev.place(model.parameters())
        param_bytes = dev.ledger.used("device")
        staging = {p: dev.host_empty(tuple(p.shape)).fill_(SENTINEL) for p in params}  # pinned host buffers
        staging_ptrs = {i: staging[p].data_ptr() for i, p in enumerate(params)}
        index_of = {id(p): i for i, p in enumerate(params)}
        stream = dev.stream("grad d2h")
        pending: list = []
        spy = _Spy(dev)
        hook = fn(dev, stream, staging, pending)
        assert callable(hook), f"make_grad_hook returned {type(hook).__name__}; return the function hook(param)"

        def spied_hook(param):
            i = index_of[id(param)]
            spy.log.append(("hook start", i, _storage(param.grad) if param.grad is not None else None))
            hook(param)
            spy.log.append(("hook end", i))

        for p in params:
            p.register_post_accumulate_grad_hook(spied_hook)
        model(x).square().mean().backward()

        problems = _hook_problems(spy.log, stream, staging_ptrs, names)
        still = [names[i] for i, p in enumerate(params) if p.grad is not None]
        assert not still, (f"after backward, {len(still)} of {len(params)} parameters still hold .grad (first: "
                           f"{still[0]}): once its copy is queued, a parameter must let go of its gradient "
                           "(param.grad = None), so the device memory can go; the queued copy holds its own reference "
                           "until it is done")
        assert isinstance(pending, list) and len(pending) == len(params), (
            f"pending holds {len(pending) if isinstance(pending, list) else type(pending).__name__} items after a "
            f"backward over {len(params)} parameters; it must hold one (param, event) per gradient")
        for n, item in enumerate(pending):
            ok = isinstance(item, tuple) and len(item) == 2 and id(item[0]) in index_of
            assert ok, f"pending[{n}] is {item!r:.60}; expected a tuple (param, event)"
            assert id(item[1]) in spy.events, (
                f"pending[{n}] holds {type(item[1]).__name__} where the event should be: an event of the device "
                "(dev.event()) that marks a point after the copy on its stream")
            assert spy.recorded_on(item[1]), (f"pending[{n}]'s event was never recorded, so it marks no point after "
                                              "the copy: record it on the copy's stream")
        assert len({id(p) for p, _ in pending}) == len(params) and len({id(e) for _, e in pending}) == len(params), (
            "pending must hold each parameter once, each with its own event (one event per copy), so that the "
            "step can read each staging buffer as soon as its own copy has landed")
        for param, event in pending:  # what a step does: wait for one copy, then read its staging buffer
            event.synchronize()
            i = index_of[id(param)]
            got, want = staging[param].clone(), expected[i]  # one look: a late copy may land any moment
            if torch.allclose(got, want, rtol=1e-6, atol=1e-7):
                continue
            if torch.all(got == SENTINEL):
                symptom = (f"when the event of {names[i]} had fired, its staging buffer was still unwritten: the "
                           "event does not follow the copy")
            else:
                symptom = f"staging for {names[i]} does not hold its gradient"
            raise AssertionError(f"seed {seed}: {symptom}" + (f"; {problems[0]}" if problems else ""))
        if problems:
            raise AssertionError(f"seed {seed}: the gradients arrived, but {problems[0]}")
        gc.collect()
        left = dev.ledger.used("device") - param_bytes
        assert left == 0, (
            f"once every copy was done and .grad dropped, device memory held {format_bytes(left)} more than the "
            f"{format_bytes(param_bytes)} of parameters: something still references a gradient, so the device cannot "
            "free it (keep none yourself: the queued copy keeps its source alive until it has run)")
    return len(params), param_bytes


@grader("4.1", rebuilds=(
    "minioffload.engine.optimizer.OffloadAdam._on_grad",
    "minioffload.engine.gradients.GradientPath.offload",
))
def grad_hook(fn: Callable) -> str:
    """fn(dev, stream, staging, pending) -> hook(param) for register_post_accumulate_grad_hook."""
    for seed in HOOK_SEEDS:
        num, param_bytes = _hook_trial(fn, seed)
    return (f"{len(HOOK_SEEDS)} jittered backwards x {num} parameters: one D2H copy and one event per gradient on "
            f"your stream, staging equal to torch's gradients, every .grad released, device memory back to the "
            f"{format_bytes(param_bytes)} of parameters")


# ---------------------------------------------------------------------------------------------
# Task 4.2: update each subgroup, upload it while the next one is updated

SHAPES = ((32, 16), (32,), (24, 32), (24,), (16, 24), (16,), (16,), (16,))
LAYOUTS = (  # (subgroups as lists of parameter indices, lr, weight_decay, jitter seed)
    ([[0, 1], [2, 3], [4, 5, 6, 7]], 1e-2, 0.01, 0),
    ([[0, 1], [2, 3], [4, 5, 6, 7]], 1e-2, 0.01, 1),
    ([[0, 1, 2, 3, 4, 5, 6, 7]], 3e-3, 0.1, 2),
)
UPDATE_STEPS = 3
STATE = ("master", "exp_avg", "exp_avg_sq")


def _subgroups(dev, params: list[nn.Parameter], layout: list[list[int]]) -> list[dict]:
    """The flat pinned host buffers of each subgroup, as OffloadAdam packs them."""
    subgroups = []
    for indices in layout:
        numel = sum(params[i].numel() for i in indices)
        sub = {name: dev.host_empty(numel).zero_() for name in ("master", "grad", "exp_avg", "exp_avg_sq")}
        sub["params"], offset = [], 0
        for i in indices:
            p = params[i]
            sub["master"][offset: offset + p.numel()].copy_(p.detach().reshape(-1))
            sub["params"].append((p, offset))
            offset += p.numel()
        subgroups.append(sub)
    return subgroups


def _update_run(fn: Callable, layout: list[list[int]], lr: float, weight_decay: float, seed: int) -> list[int]:
    """UPDATE_STEPS steps of the learner's loop against torch AdamW; returns, per step, how many subgroups
    were still to update when the first upload was enqueued."""
    g = torch.Generator().manual_seed(10 + seed)
    params = [nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(reference, lr=lr, weight_decay=weight_decay, foreach=False)
    where = {i: (k, j) for k, indices in enumerate(layout) for j, i in enumerate(indices)}
    remaining_at_first_upload = []
    with sim_device(jitter=JITTER, seed=seed, h2d=SLOW_LINK) as dev:
        dev.place(params)
        param_of_storage = {_storage(p): i for i, p in enumerate(params)}
        subgroups = _subgroups(dev, params, layout)
        h2d = dev.stream("h2d")
        spy = _Spy(dev)
        real_copy = dev.copy

        def copy(dst, src, stream=None, name=None):  # note which subgroups were updated when each upload left
            updated = [not torch.equal(sub["exp_avg"], before[k]) for k, sub in enumerate(subgroups)]
            uploads.append((param_of_storage.get(_storage(dst)), stream, updated))
            real_copy(dst, src, stream, name)

        dev.copy = copy
        h2d_synchronize = h2d.synchronize

        def spied_h2d_synchronize():
            spy.log.append(("sync",))
            h2d_synchronize()

        h2d.synchronize = spied_h2d_synchronize
        for step in range(1, UPDATE_STEPS + 1):
            for i, (p, ref) in enumerate(zip(params, reference, strict=True)):
                grad = torch.randn(p.shape, generator=g) * 10 ** (i % 3 - 1)  # scales 0.1, 1, 10
                ref.grad = grad
                k, _ = where[i]
                sub = subgroups[k]
                offset = dict((id(q), o) for q, o in sub["params"])[id(p)]
                sub["grad"][offset: offset + p.numel()].copy_(grad.reshape(-1))
            before = [sub["exp_avg"].clone() for sub in subgroups]
            uploads: list = []
            spans_before, calls_before = len(dev.trace.on("h2d")), len(spy.log)
            event = fn(dev, h2d, subgroups, step, lr, weight_decay)
            calls = spy.log[calls_before:]
            opt.step()
            what = f"step {step} ({len(layout)} subgroup{'s' * (len(layout) > 1)})"

            assert event is not None, (f"{what}: update_and_upload returned None; it must return an event that "
                                       "fires once every upload has landed, so the next forward can wait for it")
            assert id(event) in spy.events, (f"{what}: returned {type(event).__name__}; expected an event of the "
                                             "device (dev.event()) that fires once every upload has landed")
            assert len(uploads) == len(params), (f"{what}: {len(uploads)} uploads (dev.copy calls) for "
                                                 f"{len(params)} parameters; each parameter goes up once per step")
            for i, stream, updated in uploads:
                assert i is not None, (f"{what}: an upload's destination is not a parameter: the new weights go into "
                                       "param.data")
                assert stream is h2d, (f"{what}: the upload of parameter {i} went on "
                                       f"{'the default stream' if stream is None else _stream_name(stream)}, "
                                       "not on h2d, the copy stream the step uploads on")
                k = where[i][0]
                assert updated[k], (
                    f"{what}: the upload of parameter {i} (subgroup {k}) was enqueued before subgroup {k}'s "
                    "update had run, so it sends the old weights: a parameter goes up only after its own "
                    "subgroup's update")
            assert sorted(i for i, _, _ in uploads) == list(range(len(params))), (
                f"{what}: some parameters were uploaded twice and others never; each parameter goes up once")
            # from the calls made, not from what the link finished meanwhile: a busy machine can delay the host
            # until every upload is done, and the verdict must not change with it
            first_upload = next(n for n, entry in enumerate(calls) if entry[0] == "copy")
            assert ("sync",) not in calls[first_upload:], (
                f"{what}: your function waited on the host (a synchronize in the loop?) after an upload was "
                "enqueued, so the CPU sat idle while the link worked; the uploads must still be queued on return, "
                "and the caller waits on the event instead")
            streams = spy.recorded_on(event)
            assert streams, (f"{what}: the event you returned was never recorded, so it marks no point after the "
                             "uploads")
            last_record = max((n for n, entry in enumerate(calls) if entry[:2] == ("record", id(event))), default=-1)
            last_upload = max(n for n, entry in enumerate(calls) if entry[0] == "copy")
            assert streams[-1] is h2d and last_record > last_upload, (
                f"{what}: the event you returned was last recorded on {_stream_name(streams[-1])}"
                f"{'' if last_record > last_upload else ' before the last upload'}, so it can fire before all the "
                "uploads had finished: record it on h2d after the last dev.copy")
            dev.compute_waits_for(event)
            done = len(dev.trace.on("h2d")) - spans_before
            assert done == len(params), (
                f"{what}: after waiting on the event you returned, {done} of {len(params)} uploads had finished: "
                f"the event must mark a point after the last upload on h2d (it was recorded on "
                f"{_stream_name(streams[-1])})")
            for i, (p, ref) in enumerate(zip(params, reference, strict=True)):
                k, _ = where[i]
                if not torch.allclose(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6):
                    error = float((p.detach() - ref.detach()).abs().max())
                    raise AssertionError(
                        f"{what}: parameter {i} {tuple(p.shape)} on the device differs from torch AdamW (max error "
                        f"{error:.3g}): a parameter's new weights are master[offset:offset + numel] of its "
                        f"subgroup, with the offset that came with it, in its shape, after AdamW's step {step} with "
                        "the lr and weight_decay given")
            for k, sub in enumerate(subgroups):
                for p, offset in sub["params"]:
                    i = param_of_storage[_storage(p)]
                    state = opt.state[reference[i]]
                    wants = {"master": reference[i].detach(), "exp_avg": state["exp_avg"],
                             "exp_avg_sq": state["exp_avg_sq"]}
                    for name in STATE:
                        got = sub[name][offset: offset + p.numel()].view(p.shape)
                        assert torch.allclose(got, wants[name], rtol=1e-5, atol=1e-7), (
                            f"{what}: subgroup {k}'s {name!r} for parameter {i} differs from torch AdamW's: each "
                            "subgroup's flat buffers must be updated once per step, as AdamW updates them "
                            "(adam.adam_fused does that in place)")
            first = uploads[0][2]
            remaining_at_first_upload.append(len(first) - sum(first))
    return remaining_at_first_upload


@grader("4.2", rebuilds=(
    "minioffload.engine.optimizer.OffloadAdam._update",
    "minioffload.engine.weights.WeightUploads.upload",
))
def update_and_upload(fn: Callable) -> str:
    """fn(dev, h2d, subgroups, step, lr, weight_decay) -> the event recorded on h2d after the last upload."""
    remaining = []
    for layout, lr, weight_decay, seed in LAYOUTS:
        counts = _update_run(fn, layout, lr, weight_decay, seed)
        if len(layout) > 1:
            assert min(counts) > 0, (
                f"weights and state match torch, but every upload was enqueued after all {len(layout)} subgroups "
                "were updated, so the link idled while the CPU worked: a subgroup's weights must already be on "
                "their way while the CPU updates later subgroups")
            remaining.append(min(counts))
    many = LAYOUTS[0][0]
    return (f"{len(LAYOUTS)} runs x {UPDATE_STEPS} steps ({len(many)} subgroups and 1): device weights, masters and "
            f"moments match torch AdamW; each subgroup uploaded after its own update, the first while "
            f"{min(remaining)} of {len(many)} subgroups were still to update")
