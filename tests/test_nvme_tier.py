"""OffloadAdam with its state on NVMe: the same training as the host tier, pipelined I/O, checkpoints."""

import pytest
import torch
from helpers import HYPER, Toy, assert_resumes_bit_for_bit, fresh, on_sim, train

from minioffload.device import device
from minioffload.nvme import Swapper
from minioffload.offload import OffloadAdam


def run(tmp_path=None, steps=4, micro_batches=2, clip=0.5, dtype=torch.float32, buffers=3):
    torch.manual_seed(0)
    model = Toy().to(dtype)
    swapper = Swapper(tmp_path, block_size=8192, workers=2) if tmp_path else None
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=clip,
                          swapper=swapper, nvme_buffers=buffers, **HYPER)
        losses = train(model, opt, steps, micro_batches, use_side=lambda step: step % 2 == 1)
        masters = [m.clone() for m in opt.master_weights()]
        spans = {lane: list(dev.trace.on(lane)) for lane in ("nvme_read", "nvme_write", "cpu")}
    if swapper:
        swapper.close()
    return losses, masters, [p.detach().clone() for p in model.parameters()], spans, opt


@pytest.mark.parametrize("dtype, buffers", [(torch.float32, 3), (torch.bfloat16, 4)])
def test_the_nvme_tier_trains_exactly_like_the_host_tier(tmp_path, dtype, buffers):
    host = run(dtype=dtype)
    nvme = run(tmp_path, dtype=dtype, buffers=buffers)
    assert host[0] == nvme[0]  # the same kernels in the same order: bit for bit
    assert all(torch.equal(a, b) for a, b in zip(host[1] + host[2], nvme[1] + nvme[2], strict=True))
    opt = nvme[4]
    assert len(opt.subgroups) > 3 and all("master" not in sub.buffers for sub in opt.subgroups)  # not in RAM
    assert len(opt.swapper.keys()) == 3 * len(opt.subgroups)


def test_reads_and_writes_carry_12_bytes_per_param_and_overlap_the_update(tmp_path):
    _, _, _, spans, opt = run(tmp_path, steps=2, micro_batches=1, clip=None)
    params = sum(sub.numel for sub in opt.subgroups)
    written = sum(s.nbytes for s in spans["nvme_write"])
    assert written == 12 * params * 3  # the initial state, then two steps (every subgroup got a gradient)
    read = sum(s.nbytes for s in spans["nvme_read"])
    assert read >= 12 * params * 2
    # subgroup k+1 is read while subgroup k is updated
    overlaps = sum(any(r.start < c.end and c.start < r.end for c in spans["cpu"]) for r in spans["nvme_read"])
    assert overlaps > 0


def test_a_checkpoint_of_the_nvme_tier_resumes_bit_for_bit(tmp_path):
    def make(dev, name):
        (tmp_path / name).mkdir()
        return fresh(dev, swapper=Swapper(tmp_path / name))

    assert_resumes_bit_for_bit(make)


@pytest.mark.parametrize("options, match", [
    ({"nvme_buffers": 2}, "nvme_buffers must be at least 3"),
    ({"stride": 2}, "does not combine"),
    ({"delay_updates_after": 0}, "does not combine"),
])
def test_bad_nvme_settings_are_refused(sim, tmp_path, options, match):
    with Swapper(tmp_path) as swapper:
        model = on_sim(Toy(), sim)
        with pytest.raises(ValueError, match=match):
            OffloadAdam(model.parameters(), sim, swapper=swapper, **options)
