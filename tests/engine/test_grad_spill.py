"""Gradients on NVMe (engine/grad_spill.py): the same training, bit for bit, as gradients summed in host memory, with
host memory holding a few pinned sets instead of a gradient per parameter; the drive traffic it costs, counted."""

import re

import pytest
import torch
from helpers import HYPER, Toy, batch, loss_of, on_sim, train

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.nvme.swapper import Swapper


def run(tmp_path, grads_on="host", steps=3, micro_batches=2, clip=0.5, dtype=torch.float32,
        use_side=lambda step: step % 2 == 1, **options):
    torch.manual_seed(0)
    model = Toy().to(dtype)
    (tmp_path / grads_on).mkdir(exist_ok=True)
    swapper = Swapper(tmp_path / grads_on, block_size=8192, workers=2)
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=clip,
                          swapper=swapper, grads_on=grads_on, **options, **HYPER)
        losses = train(model, opt, steps, micro_batches, use_side=use_side)
        masters = [m.clone() for m in opt.master_weights()]
        held = [dict(sub.buffers) for sub in opt.subgroups]
    swapper.close()
    return losses, masters, [p.detach().clone() for p in model.parameters()], opt, held


def with_optimizer(tmp_path, grads_on, body, **options):
    """The seeded Toy on the sim with an OffloadAdam over a fresh drive (small subgroups, two gradient sets): what
    `body(model, opt)` returns, and the masters after it."""
    torch.manual_seed(0)
    model = Toy()
    (tmp_path / grads_on).mkdir()
    swapper = Swapper(tmp_path / grads_on, block_size=8192, workers=2)
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=0.5,
                          swapper=swapper, grads_on=grads_on, grad_buffers=2, **options, **HYPER)
        result = body(model, opt)
        masters = [m.clone() for m in opt.master_weights()]
    swapper.close()
    return result, masters


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True))


@pytest.mark.parametrize("dtype, sets", [(torch.float32, 2), (torch.bfloat16, 2), (torch.bfloat16, 3)])
def test_gradients_on_nvme_train_bit_for_bit_like_gradients_in_host_memory(tmp_path, dtype, sets):
    host = run(tmp_path, dtype=dtype)
    spilled = run(tmp_path, "nvme", dtype=dtype, grad_buffers=sets)
    assert same(host, spilled)
    opt = spilled[3]
    assert len(opt.subgroups) > sets  # more subgroups than sets: sets were handed over
    assert all(held == {} for held in spilled[4])  # between steps no subgroup holds a gradient in host memory
    assert all(held.get("grad") is not None for held in host[4])  # (the host path does)
    assert all(f"subgroup{i}/grad" in opt.swapper.keys() for i in range(len(opt.subgroups)))


@pytest.mark.parametrize("options", [{"loss_scale": 256.0}, {"loss_scale": "dynamic", "growth_interval": 2},
                                     {"max_grad_norm": None}])
def test_loss_scaling_and_no_clipping_match_too(tmp_path, options):
    options = dict(options)  # the parameter's own dict is shared between runs
    clip = options.pop("max_grad_norm", 0.5)
    host = run(tmp_path, clip=clip, steps=4, **options)
    spilled = run(tmp_path, "nvme", clip=clip, steps=4, grad_buffers=2, **options)
    assert same(host, spilled)
    assert host[3].skipped_steps == spilled[3].skipped_steps


def test_overflowing_steps_are_skipped_and_their_gradients_dropped(tmp_path):
    """A loss scale of 1e40 overflows fp32 gradients: those steps are skipped (halving the scale each time) until it
    is small enough, and a step's gradients never add to a skipped step's (the drive's partial sums are forgotten)."""
    def scaled_steps(model, opt):
        opt.loss_scale.scale = 1e40  # past fp32's largest: inf gradients until halved
        for step in range(8):
            for micro in range(2):
                opt.scale_loss(loss_of(model, *batch(100 * step + micro)) / 2).backward()
            opt.step()
            opt.zero_grad()
        return opt.skipped_steps

    (host_skipped, host), (skipped, spilled) = [with_optimizer(tmp_path, where, scaled_steps, loss_scale="dynamic")
                                                 for where in ("host", "nvme")]
    assert 0 < skipped == host_skipped < 8  # some skipped, then some updated
    assert all(torch.equal(a, b) for a, b in zip(host, spilled, strict=True))


def test_accumulation_reads_back_each_partial_sum_once_and_writes_each_sum_once(tmp_path):
    """Every subgroup gets a gradient in every backward (no side branch) and subgroups complete one after another: a
    subgroup's sum goes to the drive once per micro-batch, and every micro-batch after the first reads it back."""
    steps, micro = 2, 3
    losses, _, _, opt, _ = run(tmp_path, "nvme", steps=steps, micro_batches=micro, use_side=lambda step: True,
                               grad_buffers=2)
    params = sum(sub.numel for sub in opt.subgroups)
    assert opt.spill.bytes_written == 4 * params * micro * steps
    assert opt.spill.bytes_read == 4 * params * (micro - 1) * steps
    # the update reads each subgroup's gradient with its state: 16 B/param per step
    assert opt.nvme.total.bytes_read == 16 * params * steps


def test_zero_grad_without_a_step_drops_the_gradients_on_the_drive(tmp_path):
    def drop_then_train(model, opt):
        train(model, opt, 1, 2)
        for seed in (7, 8):  # two backwards, then dropped
            loss_of(model, *batch(seed)).backward()
        opt.zero_grad()
        return train(model, opt, 2, 2)

    host, spilled = [with_optimizer(tmp_path, where, drop_then_train) for where in ("host", "nvme")]
    assert host[0] == spilled[0] and all(torch.equal(a, b) for a, b in zip(host[1], spilled[1], strict=True))


@pytest.mark.parametrize("options, words", [
    ({}, "optimizer_on='nvme'"),
    ({"swapper": True, "bucket_numel": 64}, "grads_on='nvme' runs the synchronous CPU update"),
    ({"swapper": True, "grad_buffers": 1}, "grad_buffers must be at least 2"),
    ({"swapper": True, "grads_on": "disk"}, "grads_on must be 'host' or 'nvme'"),
])
def test_what_gradients_on_nvme_cannot_run_is_refused_by_name(tmp_path, options, words):
    options = {"grads_on": "nvme", **options}
    swapper = Swapper(tmp_path) if options.pop("swapper", False) else None
    model = Toy()
    with device("sim") as dev:
        params = list(on_sim(model, dev).parameters())
        with pytest.raises(ValueError, match=re.escape(words)):
            OffloadAdam(params, dev, swapper=swapper, **options)
        loss_of(model, *batch(0)).backward()  # no hook of a refused optimizer takes the gradients away
        assert all(p.grad is not None for p in params if p.requires_grad and p is not model.side.weight
                   and p is not model.side.bias)
    if swapper:
        swapper.close()


def test_with_everything_on_nvme_the_pinned_peak_does_not_grow_with_depth(tmp_path):
    """Weights streamed from the drive, the state and the gradients there: what a step pins (working sets, gradient
    sets, the streamer's bounce and write buffers) is a few subgroups' and blocks' worth, the same for 8 blocks as
    for 3."""
    from minioffload.model.gpt import GPT, GPTConfig
    from minioffload.model.streaming import ParamStreamer
    from minioffload.pinned import HostBudget

    def peak(layers):
        torch.manual_seed(0)
        net = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=layers, n_head=2, n_embd=32)).to(torch.bfloat16)
        (tmp_path / str(layers)).mkdir()
        swapper = Swapper(tmp_path / str(layers), block_size=8192, workers=2)
        with device("sim") as dev, HostBudget(None) as pinned:
            streamer = ParamStreamer(net, dev, prefetch=1, home="nvme", swapper=swapper)
            opt = OffloadAdam(net.parameters(), dev, subgroup_numel=2048, max_grad_norm=1.0, swapper=swapper,
                              streamer=streamer, grads_on="nvme", grad_buffers=2, **HYPER)
            for step in range(2):
                for micro in range(2):
                    idx, targets = batch(10 * step + micro, n=2, seq=8)
                    net(dev.to_device(idx), dev.to_device(targets))[1].backward()
                opt.step()
                opt.zero_grad()
            opt.close()
        swapper.close()
        return pinned.peak

    assert peak(8) == peak(3) > 0
