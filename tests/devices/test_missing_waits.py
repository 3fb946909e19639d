"""A wait left out of any path of the runtime is caught by the strict simulator in every run: `HazardError` where the
unordered work is issued, naming the streams, however the threads happen to be scheduled (no jitter, no luck).

Each case plants one mistake: one call to a wait, in one function of the runtime, does nothing. The same run
without the plant is clean, so the error is the plant's.
"""

import sys

import pytest
import torch

from minioffload.devices import device
from minioffload.devices.hazards import HazardError
from minioffload.devices.sim import SimDevice
from minioffload.devices.sim_streams import SimEvent, SimStream
from minioffload.engine import OffloadAdam
from minioffload.engine.delayed import DelayedUpdate
from minioffload.engine.device_path import DevicePath
from minioffload.engine.gradients import GradientPath
from minioffload.model.activations import Activations
from minioffload.model.gpt import GPT, GPTConfig
from minioffload.model.streaming import ParamStreamer

CFG = GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=2, n_embd=32)


def plant(monkeypatch, owner, method: str, inside) -> None:
    """`owner.method` does nothing when called from the function `inside` (a wait left out there); elsewhere it
    works as before."""
    real = getattr(owner, method)
    code = inside.__code__

    def maybe(*args, **kwargs):
        if sys._getframe(1).f_code is code:
            return None
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, method, maybe)


def train(steps=2, stream=False, activations="keep", **options):
    """A tiny GPT trained by OffloadAdam on the strict sim with the paths named; returns its losses."""
    torch.manual_seed(0)
    model = GPT(CFG)
    g = torch.Generator().manual_seed(0)
    with device("sim", strict=True) as dev:
        streamer = ParamStreamer(model, dev, prefetch=1) if stream else None
        if not stream:
            dev.place(model)
        Activations(model.blocks, activations, dev, min_numel=1)
        opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=4000, streamer=streamer, **options)
        losses = []
        for _ in range(steps):
            x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
            _, loss = model(x, torch.roll(x, -1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.flush()
        dev.synchronize()
        return losses


CASES = {  # name: (what to plant, the run that needs it, what the error names)
    "gradient copy waits for backward": (
        (SimDevice, "stream_waits_for_compute", GradientPath.offload), {},
        r"the d2h copy 'd2h grad' on stream 'offload d2h' reads device tensor .* on stream 'compute'"),
    "CPU waits for the gradient copy": (
        (SimEvent, "synchronize", GradientPath.add_pending), {},
        r"the CPU adding a staged gradient reads pinned host buffer .* 'd2h grad' on stream 'offload d2h #\d+'"),
    "speculative update waits for the gradient copy": (
        (SimEvent, "synchronize", GradientPath.add_pending), {"speculative": True},
        r"the CPU adding a staged gradient reads pinned host buffer .* 'd2h grad' on stream 'offload d2h #\d+'"),
    "delayed update's weights wait for backward": (
        (SimDevice, "stream_waits_for_compute", DelayedUpdate.send), {"delay_updates_after": 0, "steps": 3},
        r"the h2d copy 'h2d weights' on stream '[\w ]+h2d' writes device tensor .* on stream 'compute'"),
    "hybrid path's Adam waits for backward": (
        (SimDevice, "stream_waits_for_compute", DevicePath.queue), {"stride": 1},
        r"the launch 'device adam .*' .* on stream 'device adam' writes device tensor 'grad#\d+'.*'compute'"),
    "hybrid path's Adam waits for its state": (
        (SimStream, "wait", DevicePath.queue), {"stride": 2},
        r"the launch 'device adam .*' writes .* which the h2d copy 'h2d master' on stream 'state h2d #\d+'"),
    "streamed block's compute waits for its fetch": (
        (SimDevice, "compute_waits_for", ParamStreamer._compute_waits), {"stream": True},
        r"block \d's forward reads device tensor 'streamed block \d#\d+' .* 'h2d block \d' on stream"),
    "activation's backward waits for its prefetch": (
        (SimDevice, "compute_waits_for", Activations._unpack), {"activations": "offload"},
        r"block \d's backward reads device tensor 'activation \d#\d+' .* 'h2d activation \d' on stream"),
    "activation's prefetch waits for compute (its memory may be what a queued backward freed)": (
        (SimDevice, "stream_waits_for_compute", Activations._fetch), {"activations": "offload"},
        r"the h2d copy 'h2d activation \d' on stream 'activations h2d' writes device tensor 'activation \d#\d+' "
        r".* which the compute stream allocated after work this stream has not waited for"),
    "streamed block's fetch waits for compute (its memory may be what a queued block freed)": (
        (SimDevice, "stream_waits_for_compute", ParamStreamer._land), {"stream": True},
        r"the h2d copy 'h2d block \d' on stream 'stream weights h2d' writes device tensor 'streamed block \d#\d+' "
        r".* which the compute stream allocated after work"),
    "activation's prefetch waits for its offload": (
        (SimEvent, "synchronize", Activations._fetch), {"activations": "offload"},
        r"the h2d copy 'h2d activation \d' on stream .* reads pinned host buffer .* 'd2h activation \d'"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_planted_missing_wait_raises_where_it_is_issued(case, monkeypatch):
    (owner, method, inside), run, message = CASES[case]
    train(**run)  # without the plant: clean
    plant(monkeypatch, owner, method, inside)
    with pytest.raises(HazardError, match=message):
        train(**run)


def test_the_uses_compute_declares_are_what_it_waited_for(sim):
    """The check itself: compute reading a copy's destination raises until compute waits for the copy's event."""
    h2d, landed = sim.stream("h2d"), sim.event()
    dst, src = sim.empty(4), sim.host_empty(4).fill_(1.0)
    sim.copy(dst, src, h2d)
    landed.record(h2d)
    with pytest.raises(HazardError, match=r"a test's forward reads device tensor .* stream 'h2d #\d+'"):
        sim.uses("a test's forward", reads=[dst])
    sim.compute_waits_for(landed)
    sim.uses("a test's forward", reads=[dst])
    # and a copy that overwrites what compute read must wait for compute
    with pytest.raises(HazardError, match="Call dev.stream_waits_for_compute"):
        sim.copy(dst, src, h2d)
    sim.stream_waits_for_compute(h2d)
    sim.copy(dst, src, h2d)
    sim.synchronize()


def test_a_lagging_gpu_lets_only_compute_use_memory_it_just_handed_out(sim):
    """With compute work not yet waited for, fresh device memory may be what that work freed (a caching allocator
    hands it out at once): a copy stream writing it must wait for compute first. Once the host has waited for the
    whole device, nothing compute queued can still use it."""
    h2d, src = sim.stream("h2d"), sim.host_empty(4).fill_(1.0)
    old = sim.empty(4)
    sim.uses("a block's backward", reads=[old])  # compute work the host has not waited for
    del old
    new = sim.empty(4)
    with pytest.raises(HazardError, match=r"the h2d copy 'h2d' on stream 'h2d' writes device tensor .* which the "
                                          r"compute stream allocated after work this stream has not waited for"):
        sim.copy(new, src, h2d)
    sim.stream_waits_for_compute(h2d)
    sim.copy(new, src, h2d)
    sim.synchronize()
    fresh = sim.empty(4)  # compute is done: nothing queued can use it
    sim.copy(fresh, src, h2d)
    sim.synchronize()


def test_without_lags_the_checker_lets_a_side_stream_write_fresh_memory():
    with device("sim", strict=True, lags=False) as dev:
        h2d, src = dev.stream("h2d"), dev.host_empty(4).fill_(1.0)
        dev.uses("a block's backward", reads=[dev.empty(4)])
        dev.copy(dev.empty(4), src, h2d)
        dev.synchronize()
    with pytest.raises(ValueError, match="pass strict=True"):
        device("sim", strict=False, lags=True)


def test_a_compute_wait_orders_compute_not_the_host(sim):
    """On a GPU `compute_waits_for(event)` makes queued compute wait, and the host runs on: the host may refill the
    copy's pinned source only once it has waited itself."""
    h2d, landed = sim.stream("h2d"), sim.event()
    dst, src = sim.empty(4), sim.host_empty(4).fill_(1.0)
    sim.copy(dst, src, h2d)
    landed.record(h2d)
    sim.compute_waits_for(landed)
    sim.uses("a block's forward", reads=[dst])  # compute reads what landed
    with pytest.raises(HazardError, match=r"the host refilling it writes pinned host buffer .* 'h2d' on stream"):
        sim.uses("the host refilling it", writes=[src])
    landed.synchronize()
    sim.uses("the host refilling it", writes=[src])
    sim.synchronize()


def test_device_memory_at_the_address_of_freed_host_memory_is_new(sim):
    """A copy's host tensor is held by the queued copy until it runs, so once freed its address holds nothing in
    flight: device memory handed out there later is new, whatever read it as host memory before (the host has not
    waited for that copy: only the allocation says it is over)."""
    h2d, other = sim.stream("h2d"), sim.stream("another")
    memory = sim.host_empty(4).fill_(1.0)
    sim.copy(sim.empty(4), memory, h2d)
    h2d._queue.join()  # the copy has run, and the checker was not told: the host never waited for it
    sim.adopt(memory)  # the same addresses, now device memory (as if the source had been freed and handed out again)
    sim.copy(memory, sim.host_empty(4).fill_(2.0), other)
    sim.synchronize()
