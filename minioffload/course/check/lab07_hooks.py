"""Grader for Lab 7's Task 7.1: saved-tensor hooks that send a block's activations to the host and bring them back
with events. It runs a two-block GPT's forward and backward with the learner's hooks around each block, on the strict
sim with jitter, through a watch on the device: every copy, event, wait and keep_alive the hooks make is noted, so that
a missing step is named. A missing wait of the H2D stream on the D2H event is the strict sim's own HazardError. The
gradients must equal a run without hooks bit for bit, and the copies each way must be as many, and as large, as the
runtime's `Activations(..., "offload")` makes for the same model. Tasks 7.2 and 7.3: lab07.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...devices.hazards import HazardError
from ...model.activations import Activations
from ...model.gpt import GPT
from ...pinned import is_pinned
from .grading import grader, sim_device
from .lab07 import JITTER, MIN_NUMEL, _batch, _gpt, _storage

# ---------------------------------------------------------------------------------------------
# Task 7.1: saved-tensor hooks with events

def _raw(x):
    return getattr(x, "_raw", x)


@dataclass
class _Call:
    """What one call of the learner's pack or unpack did, in order."""

    kind: str
    steps: list = field(default_factory=list)  # ("compute->", stream) | ("copy", copy) | ("keep", stream, ptr)
    #                                             | ("record", stream, count)


@dataclass
class _Copy:
    direction: str
    stream: str
    count: int  # the copy's place on its stream (1, 2, ...)
    dst: torch.Tensor
    src: torch.Tensor


class _Stream:
    def __init__(self, watch: _Watch, raw, name: str):
        self._watch, self._raw, self.name = watch, raw, name

    def wait(self, event) -> None:
        self._raw.wait(_raw(event))

    def synchronize(self) -> None:
        self._raw.synchronize()
        self._watch.host_saw(self.name, self._watch.counts[self.name])

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
        self._watch.note(("record", name, self.mark[1]))
        self._raw.record(_raw(stream) if stream is not None else self._watch._dev.default_stream)

    def synchronize(self, *args, **kwargs) -> None:
        self._raw.synchronize(*args, **kwargs)
        if self.mark:
            self._watch.host_saw(*self.mark)

    def query(self) -> bool:
        return self._raw.query()

    def __getattr__(self, name):
        return getattr(self._raw, name)


class _Watch:
    """The sim device as the learner's hooks see it: every call passes through, and the ones the checks need are
    noted (copies with their place on their stream, events, compute waits, keep_alive)."""

    def __init__(self, dev):
        self._dev = dev
        self.counts: dict[str, int] = {}
        self.host_seen: dict[str, int] = {}  # stream -> the last op on it the host (compute) has waited for
        self.call: _Call | None = None
        self.copies: list[_Copy] = []

    def __getattr__(self, name):
        return getattr(self._dev, name)

    def note(self, step) -> None:
        if self.call is not None:
            self.call.steps.append(step)

    def host_saw(self, stream: str, count: int) -> None:
        self.host_seen[stream] = max(self.host_seen.get(stream, 0), count)

    def event(self) -> _Event:
        return _Event(self, self._dev.event())

    def stream_waits_for_compute(self, stream) -> None:
        self.note(("compute->", getattr(stream, "name", "default")))
        self._dev.stream_waits_for_compute(_raw(stream))

    def compute_waits_for(self, event) -> None:
        self._dev.compute_waits_for(_raw(event))
        if isinstance(event, _Event) and event.mark:
            self.host_saw(*event.mark)

    def synchronize(self) -> None:
        self._dev.synchronize()
        for name, count in self.counts.items():
            self.host_saw(name, count)

    def keep_alive(self, tensor, stream) -> None:
        self.note(("keep", getattr(stream, "name", "default"), _storage(tensor)))
        self._dev.keep_alive(tensor, _raw(stream))

    def copy(self, dst, src, stream=None, name=None) -> None:
        to_device, from_device = self._dev.is_device(dst), self._dev.is_device(src)
        if not to_device and not from_device and self.call is not None and self.call.kind == "pack":
            raise AssertionError(
                f"pack copied a saved tensor {tuple(src.shape)} that the sim does not count as device memory: "
                "autograd made it on the device, and the sim counts it only once you call dev.adopt(tensor) "
                "(before the copy)")
        stream_name = getattr(stream, "name", "default")
        self.counts[stream_name] = self.counts.get(stream_name, 0) + 1
        copy = _Copy("d2h" if from_device and not to_device else "h2d" if to_device and not from_device else "d2d",
                     stream_name, self.counts[stream_name], dst, src)
        self.copies.append(copy)
        self.note(("copy", copy))
        self._dev.copy(dst, src, _raw(stream), name=name)


def _check_pack(call: _Call, tensor: torch.Tensor, weights: set[int]) -> None:
    shape = tuple(tensor.shape)
    copies = [step[1] for step in call.steps if step[0] == "copy"]
    if _storage(tensor) in weights:
        assert not copies, (
            f"pack copied a parameter (a view {shape} of a weight) to the host: parameters stay on the device, they "
            "are the model's. A saved weight is often a view (weight.t()), not the Parameter itself: compare "
            "storages, tensor.untyped_storage().data_ptr(), with the parameters'")
        return
    if tensor.numel() < MIN_NUMEL:
        assert not copies, (f"pack copied a saved tensor of {tensor.numel()} elements {shape}: tensors under "
                            f"{MIN_NUMEL} elements stay on the device (a copy costs more than it saves)")
        return
    down = [c for c in copies if c.direction == "d2h"]
    assert down, f"pack made no D2H copy of a saved activation {shape}: it must go to pinned host memory"
    assert len(copies) == 1, f"pack made {len(copies)} copies of one saved activation {shape}; one D2H copy is enough"
    copy = down[0]
    assert copy.stream == "d2h", f"pack copied on stream {copy.stream!r}; the D2H copies go on the d2h stream"
    assert is_pinned(copy.dst), ("pack copied into pageable host memory: take pinned memory (dev.host_empty), or the "
                                 "copy is slower and blocks the host")
    at = call.steps.index(("copy", copy))
    assert ("compute->", "d2h") in call.steps[:at], (
        "pack issued its D2H copy without dev.stream_waits_for_compute(d2h) before it: on a GPU the d2h stream does "
        "not wait for the compute stream, and could copy the activation before the kernel that writes it has run")
    after = call.steps[at + 1:]
    assert any(s[0] == "keep" and s[1] == "d2h" and s[2] == _storage(copy.src) for s in after), (
        "pack did not keep the copy's source alive: call dev.keep_alive(source, d2h) after the copy, or autograd "
        "frees the activation (its caller drops it once packed) and the allocator may hand it out while the copy "
        "still reads it")
    assert any(s[0] == "record" and s[1] == "d2h" and s[2] >= copy.count for s in after), (
        "pack recorded no event on d2h after its copy: unpack needs one, for the h2d stream to wait for before it "
        "reads the host copy")


def _check_unpack(watch: _Watch, packed, result) -> None:
    if isinstance(packed, torch.Tensor) and result is packed:
        return  # a parameter or a small tensor, left where it was
    assert isinstance(result, torch.Tensor), f"unpack returned {type(result).__name__}; expected a tensor"
    assert watch.is_device(result), (
        f"unpack returned a host tensor {tuple(result.shape)}: backward's compute runs on the device. Copy it into "
        "fresh device memory (dev.empty) on the h2d stream and return that")
    ptr = _storage(result)
    arrived = [c for c in watch.copies if c.direction == "h2d" and _storage(c.dst) == ptr]
    assert arrived, (f"unpack returned a device tensor {tuple(result.shape)} that no H2D copy wrote: bring the host "
                     "copy back with dev.copy(device_tensor, host, h2d)")
    copy = arrived[-1]
    assert watch.host_seen.get(copy.stream, 0) >= copy.count, (
        "unpack returned its tensor before the compute waited for the H2D copy: record an event on h2d after the "
        "copy and call dev.compute_waits_for(event), or backward reads the tensor while it is still arriving")


def _hooked(model: GPT, dev, make_hooks: Callable | None) -> tuple[list[torch.Tensor], _Watch | None]:
    """Gradients of one forward and backward, with the learner's hooks around each block (None: no hooks)."""
    watch = None
    if make_hooks is not None:
        watch = _Watch(dev)
        d2h = _Stream(watch, dev.stream("d2h"), "d2h")
        h2d = _Stream(watch, dev.stream("h2d"), "h2d")
        weights = {_storage(p) for p in model.parameters()}
        hooks = make_hooks(watch, d2h, h2d, list(model.parameters()))
        assert isinstance(hooks, (tuple, list)) and len(hooks) == 2 and all(map(callable, hooks)), (
            f"make_hooks returned {hooks!r:.60}; expected a pair of functions (pack, unpack)")
        learner_pack, learner_unpack = hooks

        def pack(tensor):
            watch.call = _Call("pack")
            try:
                packed = learner_pack(tensor)
                _check_pack(watch.call, tensor, weights)
            finally:
                watch.call = None
            return packed

        def unpack(packed):
            watch.call = _Call("unpack")
            try:
                result = learner_unpack(packed)
                _check_unpack(watch, packed, result)
            finally:
                watch.call = None
            return result

        for block in model.blocks:
            def run(*args, _forward=block.forward, **kwargs):
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    return _forward(*args, **kwargs)
            block.forward = run
    _, loss = model(*_batch())
    loss.backward()
    dev.synchronize()
    return [p.grad.clone() for p in model.parameters()], watch


def _link(trace, lane: str) -> tuple[int, int]:
    spans = trace.on(lane)
    return len(spans), sum(s.nbytes for s in spans)


@grader("7.1", rebuilds=(
    "minioffload.model.activations.Activations._pack",
    "minioffload.model.activations.Activations._unpack",
))
def offload_hooks(make_hooks: Callable) -> str:
    """make_hooks(dev, d2h, h2d, params) -> (pack, unpack) for torch.autograd.graph.saved_tensors_hooks."""
    with sim_device(strict=True) as dev:
        model = _gpt(2)
        dev.place(model)
        kept, _ = _hooked(model, dev, None)
    with sim_device(strict=True) as dev:
        model = _gpt(2)
        dev.place(model)
        Activations(model.blocks, "offload", dev, min_numel=MIN_NUMEL)
        _hooked(model, dev, None)
        want_down, want_up = _link(dev.trace, "d2h"), _link(dev.trace, "h2d")
    with sim_device(strict=True, jitter=JITTER, seed=71) as dev:
        model = _gpt(2)
        dev.place(model)
        try:
            grads, _ = _hooked(model, dev, make_hooks)
        except HazardError as err:
            raise AssertionError(f"the strict sim refused a copy: {err}. (The h2d stream must wait for the event "
                                 "recorded after the D2H copy before it reads the host copy.)") from None
        except RuntimeError as err:
            if isinstance(err.__cause__, HazardError):
                raise AssertionError(f"the strict sim refused a copy: {err.__cause__}") from None
            raise
        down, up = _link(dev.trace, "d2h"), _link(dev.trace, "h2d")
    assert down == want_down, (
        f"{down[0]} D2H copies ({down[1]:,} bytes) where the runtime's offload makes {want_down[0]} "
        f"({want_down[1]:,} bytes): one per saved activation of {MIN_NUMEL}+ elements, none for parameters")
    assert up == want_up, (f"{up[0]} H2D copies ({up[1]:,} bytes) for {down[0]} D2H copies ({down[1]:,} bytes): each "
                           "activation that went down comes back once")
    for i, (g, k) in enumerate(zip(grads, kept, strict=True)):
        if not torch.equal(g, k):
            bad = "NaN (device memory read before it was written)" if g.isnan().any() else "different values"
            raise AssertionError(f"the gradient of parameter {i} {tuple(g.shape)} differs from a run without hooks: "
                                 f"{bad}; unpack must give back exactly what pack received")
    return (f"{down[0]} saved activations of a 2-block GPT went to pinned host memory and came back "
            f"({down[1]:,} bytes each way, as the runtime's offload) on the strict sim with jitter; every copy ordered "
            "by events; gradients bit for bit as without hooks")
