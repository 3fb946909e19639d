"""How the training loop (minioffload/train/loop.py) talks to the device: it reads the loss once per step, and sends
its batches up from pinned buffers on a copy stream, so that on a GPU the host runs ahead of compute."""

import sys

import pytest
import torch

from minioffload.devices.sim import SimDevice
from minioffload.model.gpt import GPT
from minioffload.pinned import is_pinned
from minioffload.train import loop
from minioffload.train.batches import BatchUploads
from minioffload.train.loop import TrainConfig, train

SHORT = dict(device="sim", model="tiny", block_size=16, batch_size=4, lr=3e-3, eval_every=100, progress=False)


def test_the_loss_is_read_from_the_device_once_per_step_with_the_same_numbers(tmp_path, monkeypatch):
    """float(loss) per micro-batch makes the host wait for each forward (on a GPU, for all the compute queued before
    it); one read per step keeps the run-ahead. The step losses are the same numbers, summed in the same order."""
    reads, evaluating, micro_losses = [], [False], []

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename == loop.__file__ and not evaluating[0]:
                reads.append(name)
            return original(self, *args, **kwargs)
        return counted

    for name in ("__float__", "item", "tolist"):  # every way a tensor's value reaches the host as a number
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    val_loss = loop._val_loss

    def flagged(*args):  # the validation losses are read per batch, at evaluations only: not counted
        evaluating[0] = True
        try:
            return val_loss(*args)
        finally:
            evaluating[0] = False

    monkeypatch.setattr(loop, "_val_loss", flagged)
    forward = GPT.forward

    def recorded(model, *args, **kwargs):
        logits, loss = forward(model, *args, **kwargs)
        if model.training:
            micro_losses.append(loss.detach().clone())
        return logits, loss

    monkeypatch.setattr(GPT, "forward", recorded)
    steps, accum = 3, 3
    result = train(TrainConfig(steps=steps, grad_accum=accum, out_dir=str(tmp_path), **SHORT))
    assert len(reads) == steps, reads
    expected = []
    for step in range(steps):
        total = 0.0
        for loss in micro_losses[step * accum:(step + 1) * accum]:
            total += float(loss) / accum  # what the loop always computed, micro-batch by micro-batch
        expected.append(total)
    assert result.losses == expected


def test_batches_go_up_from_pinned_buffers_on_a_copy_stream(tmp_path, monkeypatch):
    """A device whose compute cannot read host memory (a GPU: `to_device` copies, synchronously from pageable memory)
    gets each micro-batch through pinned buffers reused every step, on the "h2d batch" stream, never through
    to_device or the default stream; the strict sim checks every wait, and the losses are the sim's own."""
    direct = train(TrainConfig(steps=3, grad_accum=2, out_dir=str(tmp_path / "direct"), **SHORT))
    to_device, copies = [], []

    def copying(dev, tensor):  # as CudaDevice.to_device: a new tensor, copied
        to_device.append(tensor)
        return tensor.clone()

    copy = SimDevice.copy

    def spy(dev, dst, src, stream=None, name=None):
        if name == "h2d batch":
            copies.append({"stream": (stream or dev.default_stream).name, "src": src, "dst": dst,
                           "on_device": dev.is_device(dst)})
        return copy(dev, dst, src, stream, name)

    drawn = {}  # id -> every tensor batches() made (held, so that no id is reused)
    draw = loop.batches

    def recorded(*args, **kwargs):
        pair = draw(*args, **kwargs)
        drawn.update((id(t), t) for t in pair)
        return pair

    monkeypatch.setattr(loop, "batches", recorded)
    monkeypatch.setattr(SimDevice, "to_device", copying)
    monkeypatch.setattr(SimDevice, "copy", spy)
    uploaded = train(TrainConfig(steps=3, grad_accum=2, out_dir=str(tmp_path / "uploaded"), **SHORT))
    assert uploaded.losses == direct.losses
    batches_sent = [t for t in to_device if drawn.get(id(t)) is t]
    assert len(batches_sent) == 2 * loop.EVAL_BATCHES  # the validation batches, once: no training batch
    assert len(copies) == 3 * 2 * 2  # steps x micro-batches x (inputs, targets)
    assert all(c["stream"] == "h2d batch" and is_pinned(c["src"]) and c["on_device"] for c in copies)
    assert len({c["src"].data_ptr() for c in copies}) == len({c["dst"].data_ptr() for c in copies}) == 4  # reused


def test_batch_uploads_refuse_a_step_of_another_shape(sim):
    uploads = BatchUploads(sim, 1, direct=False)
    uploads.send([(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))])
    x, _ = uploads.get(0)
    assert sim.is_device(x) and x.shape == (2, 3)
    with pytest.raises(ValueError, match="every step's batches have one shape"):
        uploads.send([(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))])
    with pytest.raises(ValueError, match="made for 1 micro-batches per step, got 2"):
        uploads.send([(torch.zeros(2, 3, dtype=torch.long),) * 2] * 2)
    assert BatchUploads(sim, 1).direct  # the sim's compute reads host memory: no copies


def test_batch_uploads_order_their_copies_against_compute_with_no_synchronize_between_steps(sim):
    """The loop synchronizes at each step's end, but the uploads do not lean on it: a step's copies wait for the
    compute that read the device buffers in the last step (else the strict sim raises), and each forward reads its
    own micro-batch."""
    uploads = BatchUploads(sim, 2, direct=False)
    for step in range(3):
        pairs = [(torch.full((2, 3), 10 * step + k), torch.full((2, 3), 10 * step + k + 5)) for k in range(2)]
        uploads.send(pairs)
        for k, (x, y) in enumerate(pairs):
            on_device = uploads.get(k)
            assert all(sim.is_device(t) for t in on_device)
            assert torch.equal(on_device[0], x) and torch.equal(on_device[1], y)
