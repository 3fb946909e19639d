"""On a GPU, a copy on a copy stream that overwrites the weights must wait for the compute already queued (backward
may still read them). The sim runs compute on the host, so such a race cannot show as a wrong number here: these
tests record the engine's device calls and check the order instead."""

import pytest
from helpers import batch, fresh, loss_of


def recorded(dev, params):
    """Log ("compute",), ("wait", stream) and ("copy into weights", stream) as the engine calls the device."""
    log, weights = [], {p.data_ptr() for p in params}
    waits, copy = dev.stream_waits_for_compute, dev.copy

    def logged_wait(stream):
        log.append(("wait", stream.name))
        waits(stream)

    def logged_copy(dst, src, stream=None, name=None):
        if dst.data_ptr() in weights:
            log.append(("copy into weights", (stream or dev.default_stream).name))
        copy(dst, src, stream, name)

    dev.stream_waits_for_compute, dev.copy = logged_wait, logged_copy
    return log


def unordered_copies(log):
    """Copies into the weights with no wait of their stream for compute since the last compute."""
    waited, bad = set(), []
    for entry in log:
        if entry[0] == "compute":
            waited.clear()
        elif entry[0] == "wait":
            waited.add(entry[1])
        elif entry[1] not in waited:
            bad.append(entry)
    return bad


@pytest.mark.parametrize("options", [{}, {"delay_updates_after": 1}], ids=["synchronous", "delayed"])
def test_every_copy_into_the_weights_waits_for_compute(sim, options):
    model, opt = fresh(sim, **options)
    log = recorded(sim, list(model.parameters()))
    for step in range(4):
        log.append(("compute",))  # forward and backward are queued compute from here on
        loss_of(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    state = opt.state_dict()
    log.append(("compute",))
    loss_of(model, *batch(9)).backward()
    opt.load_state_dict(state)
    sim.synchronize()
    assert any(entry[0] == "copy into weights" for entry in log)
    assert unordered_copies(log) == []
