"""Grader for Lab 8's Task 8.1: a block's weights sent home, fetched with their event, and released. The learner's
`send_home`, `fetch` and `release` stream a three-block GPT's weights through two forwards and backwards on the
strict sim with jitter, one block ahead, in the order ParamStreamer follows at prefetch=1 (the harness `_Streamed`
decides when each is called, and makes the compute wait for a block's event before it runs, as the runtime does);
then one block is fetched and let go before it ran, as the runtime does to make room. Every call goes through a
watch on the device that notes each copy, event, wait and free, so that a missing step is named as it happens
(before it could corrupt memory). The losses and gradients must equal a run without streaming bit for bit, and the
ledger must be back to the resident weights once every block is released. The harness keeps to the device's public
interface, not to ParamStreamer's private methods, which are free to change. Tasks 8.2 and 8.3: lab08.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ...devices.hazards import HazardError
from ...pinned import is_pinned
from .grading import grader, sim_device
from .lab08 import JITTER, _batch, _gpt

N_LAYER, STEPS = 3, 2
H2D = "h2d"  # the name the watch gives the copy stream


def _raw(x):
    return getattr(x, "_raw", x)


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _has_memory(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


@dataclass
class _Call:
    """What one call of the learner's send_home, fetch or release did, in order."""

    kind: str
    steps: list = field(default_factory=list)  # ("compute->", stream) | ("copy", stream, count) | ("wait", what)


class _Stream:
    def __init__(self, watch: _Watch, raw, name: str):
        self._watch, self._raw, self.name = watch, raw, name

    def wait(self, event) -> None:
        self._raw.wait(_raw(event))

    def synchronize(self) -> None:
        self._watch.note(("wait", f"{self.name}.synchronize()"))
        self._raw.synchronize()
        self._watch.host_saw(self.name, self._watch.counts.get(self.name, 0))

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def __repr__(self) -> str:
        return f"stream {self.name!r}"


class _Event:
    def __init__(self, watch: _Watch, raw):
        self._watch, self._raw, self.mark = watch, raw, None

    def record(self, stream=None) -> None:
        name = stream.name if isinstance(stream, _Stream) else "default"
        self.mark = (name, self._watch.counts.get(name, 0))
        self._raw.record(_raw(stream) if stream is not None else self._watch._dev.default_stream)

    def synchronize(self, *args, **kwargs) -> None:
        self._watch.note(("wait", "event.synchronize()"))
        self._raw.synchronize(*args, **kwargs)
        if self.mark:
            self._watch.host_saw(*self.mark)

    def query(self) -> bool:
        return self._raw.query()

    def __getattr__(self, name):
        return getattr(self._raw, name)


class _Watch:
    """The sim device as the learner's functions and the runtime see it: every call passes through, and the ones
    the checks need are noted (copies with their place on their stream, events, waits, frees)."""

    def __init__(self, dev):
        self._dev = dev
        self.counts: dict[str, int] = {}
        self.host_seen: dict[str, int] = {}  # stream -> the last copy on it the host (compute) has waited for
        self.landing: dict[int, tuple[str, int]] = {}  # storage address -> the last copy into it
        self.call: _Call | None = None
        self.failure: str | None = None

    def __getattr__(self, name):
        return getattr(self._dev, name)

    def fail(self, message: str) -> None:
        """Fail now; remembered too, in case autograd hands the error up as something else."""
        if self.failure is None:
            self.failure = message
        raise AssertionError(message)

    def run(self, kind: str, fn: Callable, *args) -> tuple[object, _Call]:
        self.call = _Call(kind)
        try:
            return fn(*args), self.call
        finally:
            self.call = None

    def note(self, step) -> None:
        if self.call is not None:
            self.call.steps.append(step)

    def host_saw(self, stream: str, count: int) -> None:
        self.host_seen[stream] = max(self.host_seen.get(stream, 0), count)

    def stream(self, name: str = "stream") -> _Stream:
        return _Stream(self, self._dev.stream(name), H2D if "h2d" in name else name)

    def event(self) -> _Event:
        return _Event(self, self._dev.event())

    def stream_waits_for_compute(self, stream) -> None:
        self.note(("compute->", getattr(stream, "name", "default")))
        self._dev.stream_waits_for_compute(_raw(stream))

    def compute_waits_for(self, event) -> None:
        self.note(("wait", "dev.compute_waits_for(event)"))
        self._dev.compute_waits_for(_raw(event))
        if isinstance(event, _Event) and event.mark:
            self.host_saw(*event.mark)

    def synchronize(self) -> None:
        self.note(("wait", "dev.synchronize()"))
        self._dev.synchronize()
        for name, count in self.counts.items():
            self.host_saw(name, count)

    def copy(self, dst, src, stream=None, name=None) -> None:
        stream_name = getattr(stream, "name", "default")
        if self.call is not None and self.call.kind == "fetch":
            self._check_fetch_copy(dst, src, stream_name)
        self.counts[stream_name] = self.counts.get(stream_name, 0) + 1
        self.landing[_address(dst)] = (stream_name, self.counts[stream_name])
        self.note(("copy", stream_name, self.counts[stream_name]))
        self._dev.copy(dst, src, _raw(stream), name=name)

    def _check_fetch_copy(self, dst, src, stream_name: str) -> None:
        shape = tuple(dst.shape)
        if stream_name != H2D:
            self.fail(f"fetch copied a weight {shape} on stream {stream_name!r}: the copies go on the h2d stream it "
                      "is given, where they run beside the compute (a prefetch overlaps the block computing now)")
        if not _has_memory(dst):
            self.fail(f"fetch copied into a weight {shape} that has no memory: give it its memory back first, "
                      "dev.restore_storage(p), then copy")
        if isinstance(dst, nn.Parameter) and dst.requires_grad:
            self.fail(f"fetch copied into the Parameter {shape} itself: autograd refuses an in-place write to a leaf "
                      "that requires grad, and the copy runs on the stream's thread, where you would not see it. "
                      "Copy into p.data")
        if not is_pinned(src):
            self.fail(f"fetch copied a weight {shape} from pageable host memory: from pageable memory a copy is "
                      "slower and blocks the host until it is done. Copy from the pinned home")
        if ("compute->", H2D) not in self.call.steps:
            self.fail("fetch issued a copy without dev.stream_waits_for_compute(h2d) before it: the memory "
                      "restore_storage hands out may be what the compute stream is still reading (a block released "
                      "a moment ago), and on a GPU the h2d stream does not wait for the compute by itself")

    def free_storage(self, tensor) -> None:
        landing = self.landing.pop(_address(tensor), None)
        if landing is not None and self.host_seen.get(landing[0], 0) < landing[1]:
            who = self.call.kind if self.call is not None else "the runtime"
            self.fail(f"{who} freed a weight {tuple(tensor.shape)} before its copy had landed: a block prefetched "
                      "and let go before it ran (the runtime does that to make room) still has its copies in "
                      "flight. Wait for its event first, dev.compute_waits_for(arrived), then free")
        self._dev.free_storage(tensor)


def _check_homes(watch: _Watch, params: list, homes, values: list[torch.Tensor]) -> None:
    if not isinstance(homes, (list, tuple)) or len(homes) != len(params):
        watch.fail(f"send_home returned {homes!r:.60}; expected a list of {len(params)} host tensors, one per "
                   "parameter, in order")
    for p, home, value in zip(params, homes, values, strict=True):
        shape = tuple(p.shape)
        if not isinstance(home, torch.Tensor) or tuple(home.shape) != shape or home.dtype != p.dtype:
            watch.fail(f"send_home returned {type(home).__name__} as the home of a weight {shape} {p.dtype}; "
                       "expected a host tensor of the same shape and dtype")
        if watch.is_device(home):
            watch.fail(f"send_home returned a device tensor as the home of a weight {shape}: homes live in host "
                       "memory, dev.host_empty(shape, dtype)")
        if not _has_memory(home) or _address(home) == _address(p):
            watch.fail(f"the home of a weight {shape} shares the parameter's memory: take new host memory "
                       "(dev.host_empty) and copy the weight into it")
        if not is_pinned(home):
            watch.fail(f"send_home made the home of a weight {shape} in pageable host memory: take pinned memory "
                       "(dev.host_empty), or every fetch is a slower copy that blocks the host")
        if not torch.equal(home, value):
            watch.fail(f"the home of a weight {shape} does not hold its weights: copy each weight into its home "
                       "before freeing it on the device")
        if _has_memory(p):
            watch.fail(f"send_home left a weight {shape} on the device: once it is home, free its memory with "
                       "dev.free_storage(p) (the tensor stays, so the model still holds it)")


def _check_fetch(watch: _Watch, call: _Call, params: list, arrived) -> None:
    copies = [step for step in call.steps if step[0] == "copy"]
    if len(copies) != len(params):
        watch.fail(f"fetch made {len(copies)} copies for a block of {len(params)} weights: copy each home into its "
                   "parameter once")
    waits = [step[1] for step in call.steps if step[0] == "wait"]
    if waits:
        watch.fail(f"fetch waited for its copies ({waits[0]}): a fetch is also a prefetch, issued while another "
                   "block computes, and waiting there stalls that block. Return the event: the runtime makes the "
                   "block wait for it just before the block runs")
    if not isinstance(arrived, _Event):
        watch.fail(f"fetch returned {arrived!r:.60}; expected the event recorded on h2d after the copies, which the "
                   "block's compute waits for (dev.compute_waits_for) just before the block runs")
    if arrived.mark is None:
        watch.fail("fetch returned an event it never recorded: record it on h2d after the copies (a wait on it "
                   "would wait for nothing)")
    stream, count = arrived.mark
    if stream != H2D:
        watch.fail(f"fetch recorded its event on stream {stream!r}, not on h2d where the copies run: waiting for it "
                   "does not wait for them, and the block would compute before its weights landed")
    if count < max(step[2] for step in copies):
        watch.fail("fetch recorded its event before its copies: the block would compute on weights still arriving "
                   "(NaN on the strict sim). Record it after the last copy")


def _check_release(watch: _Watch, call: _Call, params: list) -> None:
    whole = [step[1] for step in call.steps if step[0] == "wait" and step[1].endswith("synchronize()")
             and step[1] != "event.synchronize()"]
    if whole:
        watch.fail(f"release waited with {whole[0]}: that waits for every copy queued, the next blocks' prefetches "
                   "too; wait for this block's event alone, dev.compute_waits_for(arrived)")
    for p in params:
        if _has_memory(p):
            watch.fail(f"release left a weight {tuple(p.shape)} with its memory: free it with dev.free_storage(p) "
                       "(the tensor stays, for the views of it autograd saved; its memory goes)")


class _Streamed:
    """A GPT whose blocks' weights go home and come back through the learner's functions, one block ahead, in the
    order ParamStreamer follows at prefetch=1 once it has recorded it: before block i's forward, block i is made
    ready (fetched if it is not on its way, then the compute waits for its event) and block i + 1 is fetched;
    after it, block i is released, except the last, whose backward comes next. In the backward, when the gradient
    of block i's input arrives, its backward is done: it is released, block i - 1 made ready and block i - 2
    fetched. The compute's waits are the harness's, as they are the runtime's."""

    def __init__(self, model: nn.Module, watch: _Watch, ops: tuple[Callable, Callable, Callable]):
        self.watch, (self._send_home, self._fetch, self._release) = watch, ops
        self.params = [list(block.parameters()) for block in model.blocks]
        self.homes = []
        for params in self.params:
            values = [p.detach().clone() for p in params]
            homes, _ = watch.run("send_home", self._send_home, watch, list(params))
            _check_homes(watch, params, homes, values)
            self.homes.append(list(homes))
        self.h2d = watch.stream("stream weights h2d")
        self.arrived: dict[int, object] = {}  # blocks on the device (or on their way), with their events
        self.fetches = 0
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(functools.partial(self._before, i))
            block.register_forward_hook(functools.partial(self._after, i))

    def bring(self, i: int) -> None:
        """Start block i's copies up, unless it is on the device or on its way."""
        if 0 <= i < len(self.params) and i not in self.arrived:
            arrived, call = self.watch.run("fetch", self._fetch, self.watch, list(self.params[i]),
                                           list(self.homes[i]), self.h2d)
            _check_fetch(self.watch, call, self.params[i], arrived)
            self.arrived[i] = arrived
            self.fetches += 1

    def ready(self, i: int) -> None:
        """Block i computes next: its copies must have landed."""
        self.bring(i)
        self.watch.compute_waits_for(self.arrived[i])

    def let_go(self, i: int) -> None:
        if i in self.arrived:
            _, call = self.watch.run("release", self._release, self.watch, list(self.params[i]), self.arrived.pop(i))
            _check_release(self.watch, call, self.params[i])

    def _before(self, i: int, _module, args) -> None:
        self.ready(i)
        self.bring(i + 1)
        if torch.is_grad_enabled() and args[0].requires_grad:
            args[0].register_hook(lambda grad: self._backward_done(i))

    def _after(self, i: int, _module, _args, out) -> None:
        if i < len(self.params) - 1:
            self.let_go(i)
        elif torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: self._backward_next(i))

    def _backward_next(self, i: int) -> None:
        self.ready(i)
        self.bring(i - 1)

    def _backward_done(self, i: int) -> None:
        self.let_go(i)
        if i > 0:
            self._backward_next(i - 1)


def _streamed_bytes(dev, model: nn.Module) -> int:
    """Device bytes the ledger counts beyond the weights outside the blocks: the streamed ones on the device."""
    inside = {id(p) for block in model.blocks for p in block.parameters()}
    return dev.ledger.used("device") - sum(p.numel() * p.element_size() for p in model.parameters()
                                           if id(p) not in inside)


def _passes(model: nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    x, y = _batch()
    losses = []
    for _ in range(STEPS):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()]


def _link(trace) -> tuple[int, int]:
    spans = trace.on("h2d")
    return len(spans), sum(s.nbytes for s in spans)


@grader("8.1", rebuilds=(
    "minioffload.model.streaming.ParamStreamer._land",
    "minioffload.model.streaming.ParamStreamer._start",
    "minioffload.model.streaming.ParamStreamer._release",
    "minioffload.model.streaming.ParamStreamer._make_home",
))
def fetch_and_release(fn: Callable) -> str:
    """fn() -> (send_home, fetch, release): send_home(dev, params) -> homes; fetch(dev, params, homes, h2d) -> the
    event after the copies; release(dev, params, arrived)."""
    ops = fn()
    if not (isinstance(ops, (tuple, list)) and len(ops) == 3 and all(map(callable, ops))):
        raise AssertionError(f"expected (send_home, fetch, release), got {ops!r:.80}")
    with sim_device(strict=True) as dev:
        want_losses, want_grads = _passes(dev.place(_gpt(N_LAYER)))
    with sim_device(strict=True, jitter=JITTER, seed=81) as dev:
        model = dev.place(_gpt(N_LAYER))
        watch = _Watch(dev)
        try:
            streamed = _Streamed(model, watch, tuple(ops))
            if _streamed_bytes(dev, model):
                watch.fail(f"after send_home the ledger still counts {_streamed_bytes(dev, model):,} bytes of "
                           "block weights on the device: free them with dev.free_storage(p), which tells the ledger")
            resident = dev.ledger.used("device")
            losses, grads = _passes(model)
            if _streamed_bytes(dev, model):
                watch.fail(f"with every block released, the ledger still counts {_streamed_bytes(dev, model):,} "
                           "bytes of streamed weights on the device: free them with dev.free_storage(p), which "
                           "tells the ledger")
            streamed.bring(0)  # a prefetch ...
            streamed.let_go(0)  # ... let go before it ran, as the runtime does to make room
            dev.synchronize()
        except HazardError as err:
            raise AssertionError(f"the strict sim refused a copy: {err}") from None
        except Exception as err:
            if watch.failure is not None:
                raise AssertionError(watch.failure) from None
            if isinstance(err.__cause__, HazardError):
                raise AssertionError(f"the strict sim refused a copy: {err.__cause__}") from None
            raise
        copies, nbytes = _link(dev.trace)
    if losses != want_losses or any(not torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True)):
        nan = any(g.isnan().any() for g in grads) or any(loss != loss for loss in losses)
        bad = "NaN (device memory read before a copy wrote it)" if nan else "different values"
        raise AssertionError(f"the streamed run's losses or gradients differ from a run without streaming: {bad}; "
                             "each parameter must get back exactly its own home's weights")
    return (f"send_home, fetch and release streamed a {N_LAYER}-block GPT's weights, one block ahead, through "
            f"{STEPS} forwards and backwards on the strict sim with jitter: {streamed.fetches} fetches, {copies} "
            f"copies up ({nbytes:,} bytes); losses and gradients bit for bit as without streaming; every copy "
            "after the compute, every block computed after its event and freed after its copies; the ledger back to "
            f"the {resident:,} bytes of resident weights once every block was released")
