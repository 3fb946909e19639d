"""The per-call costs probe() measures: a streamed block's fetch, a saved tensor's offload, a gradient's hook, a
subgroup's update, a file's read and write.

Each is planted: the runtime's own step made slower by a known sleep per call must show in the measured cost (other
work on the machine only ever adds to a pass, and each cost is the fastest pass against the fastest pass)."""

import time

import pytest

from minioffload.devices import Link, device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.machine import measure
from minioffload.model.activations import Activations
from minioffload.model.streaming import ParamStreamer
from minioffload.nvme.swapper import Swapper

PLANTED = 5e-3  # s added to each call


def slowed(monkeypatch, cls, name):
    original = getattr(cls, name)

    def slower(*args, **kwargs):
        time.sleep(PLANTED)
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, slower)


def fast_sim():
    return device("sim", h2d=Link(1e12), d2h=Link(1e12), strict=False)


@pytest.mark.parametrize("cost, cls, method", [
    (measure.fetch_cost, ParamStreamer, "_start"),  # once per block fetched
    (measure.pack_cost, Activations, "_pack"),  # once per saved tensor
    (measure.grad_cost, OffloadAdam, "_on_grad"),  # once per gradient
    (measure.subgroup_cost, OffloadAdam, "_update"),  # once per subgroup updated
])
def test_a_slower_call_shows_in_its_mechanisms_cost(monkeypatch, cost, cls, method):
    with fast_sim() as dev:
        plain = cost(dev, blocks=6, width=64, batch=64, repeats=3)
        slowed(monkeypatch, cls, method)
        slow = cost(dev, blocks=6, width=64, batch=64, repeats=3)
    assert slow - plain >= 0.5 * PLANTED


def test_a_slower_commit_shows_in_the_write_cost_only(monkeypatch, tmp_path):
    slowed(monkeypatch, Swapper, "_commit")  # once per durable write
    costs = measure.file_costs(tmp_path, files=4)
    assert costs["write"] >= PLANTED and costs["read"] > 0
    with pytest.raises(ValueError, match="files must be >= 1"):
        measure.file_costs(tmp_path, files=0)
