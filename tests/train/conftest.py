"""Fixtures of the training tests (the suite's are in tests/conftest.py)."""

import pytest
from helpers import keep_gpu_busy

from minioffload.model.gpt import GPT


@pytest.fixture
def lagging_gpu(monkeypatch):
    """Before every training forward on a GPU, queue a spin there: the GPU runs behind the host, as in training, so a
    copy or an update not ordered after the work it depends on reads or writes too early. No effect on the sim."""
    forward = GPT.forward

    def lagging(model, idx, *args, **kwargs):
        if idx.is_cuda and model.training:
            keep_gpu_busy()
        return forward(model, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", lagging)
