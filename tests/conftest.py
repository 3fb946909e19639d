"""The test suite runs the simulated device in strict mode: it behaves as a GPU punishes mistakes (device memory
from empty() is NaN until written), so a test that passes here does not pass by the sim's kindness.

Shared fixtures live here; shared helpers (the toy model, its batches, the training loop) in `helpers.py`."""

import os

os.environ.setdefault("MINIOFFLOAD_SIM_STRICT", "1")  # before anything imports minioffload

import pytest  # noqa: E402

from minioffload.devices import device  # noqa: E402


@pytest.fixture
def sim():
    """A fresh sim device (strict, as the whole suite runs), closed after the test."""
    with device("sim") as dev:
        yield dev


@pytest.fixture
def fake_cudart(monkeypatch):
    """Pinned memory as on a CUDA machine, with a fake cudart (helpers.FakeCudart) recording what is locked."""
    import torch
    from helpers import FakeCudart

    from minioffload import pinned

    cudart = FakeCudart()
    monkeypatch.setattr(pinned, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)  # torch's own answer on a CPU-only build
    return cudart
