"""OffloadAdam with its state on NVMe: the same training as the host tier, pipelined I/O, checkpoints, and the
cache-friendly order (the same weights, fewer reads, as many as the model predicts)."""

import pytest
import torch
from helpers import HYPER, Toy, assert_resumes_bit_for_bit, batch, fresh, loss_of, on_sim, train

from minioffload.devices import device
from minioffload.engine.nvme_tier import reads_avoided_fraction
from minioffload.engine.optimizer import OffloadAdam
from minioffload.nvme.swapper import Swapper


def run(tmp_path=None, steps=4, micro_batches=2, clip=0.5, dtype=torch.float32, buffers=3, swapper=None,
        use_side=lambda step: step % 2 == 1, **options):
    torch.manual_seed(0)
    model = Toy().to(dtype)
    swapper = swapper or (Swapper(tmp_path, block_size=8192, workers=2) if tmp_path else None)
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=clip,
                          swapper=swapper, nvme_buffers=buffers, **options, **HYPER)
        losses = train(model, opt, steps, micro_batches, use_side=use_side)
        if opt.nvme is not None:
            opt.nvme.drain()  # every write on its lane; then only the tier's own I/O is in the spans
        spans = {lane: list(dev.trace.on(lane)) for lane in ("nvme_read", "nvme_write", "cpu")}
        masters = [m.clone() for m in opt.master_weights()]
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
    _, _, _, spans, opt = run(tmp_path, steps=2, micro_batches=1, clip=None, nvme_order="forward")
    params = sum(sub.numel for sub in opt.subgroups)
    written = sum(s.nbytes for s in spans["nvme_write"])
    assert written == 12 * params * 3  # the initial state, then two steps (every subgroup got a gradient)
    read = sum(s.nbytes for s in spans["nvme_read"])
    assert read >= 12 * params * 2
    # subgroup k+1 is read while subgroup k is updated
    overlaps = sum(any(r.start < c.end and c.start < r.end for c in spans["cpu"]) for r in spans["nvme_read"])
    assert overlaps > 0
    assert (opt.nvme.bytes_read, opt.nvme.bytes_written, opt.nvme.reads_avoided) == (read, written, 0)  # counted


@pytest.mark.parametrize("options", [{"max_grad_norm": 0.5}, {"max_grad_norm": None, "loss_scale": "dynamic"},
                                     {"max_grad_norm": 0.5, "loss_scale": 256.0}])
def test_the_alternate_order_gives_the_same_weights_bit_for_bit_and_reads_less(tmp_path, options):
    clip = options.pop("max_grad_norm")
    runs = {}
    for order in ("forward", "alternate"):
        (tmp_path / order).mkdir()
        runs[order] = run(tmp_path / order, steps=5, clip=clip, dtype=torch.bfloat16, nvme_order=order, **options)
    forward, alternate = runs["forward"], runs["alternate"]
    assert forward[0] == alternate[0]
    assert all(torch.equal(a, b) for a, b in zip(forward[1] + forward[2], alternate[1] + alternate[2], strict=True))
    tiers = forward[4].nvme, alternate[4].nvme
    assert tiers[0].reads_avoided == 0 and tiers[1].reads_avoided > 0
    assert tiers[1].bytes_read < tiers[0].bytes_read and tiers[1].bytes_written == tiers[0].bytes_written
    assert tiers[1].bytes_read == sum(s.nbytes for s in alternate[3]["nvme_read"])  # the counter is the disk's


def visit_counts(directory, buffers: int, order: str, steps: int = 4) -> tuple[list, int, int]:
    """Each step's VisitCounts, every subgroup getting a gradient every step; the subgroups and their parameters."""
    torch.manual_seed(0)
    model = Toy()
    with device("sim") as dev, Swapper(directory, block_size=8192, workers=2) as swapper:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, swapper=swapper,
                          nvme_buffers=buffers, nvme_order=order, **HYPER)
        counts = []
        for step in range(steps):
            loss_of(model, *batch(step), use_side=True).backward()
            opt.step()
            opt.zero_grad()
            counts.append(opt.nvme.last_visit)
        opt.nvme.drain()
        return counts, len(opt.packing.on_cpu()), sum(sub.numel for sub in opt.packing.on_cpu())


@pytest.mark.parametrize("buffers", [3, 4, 6])
@pytest.mark.parametrize("order", ["forward", "alternate"])
def test_the_reads_avoided_per_step_are_what_the_model_predicts(tmp_path, buffers, order):
    counts, subgroups, params = visit_counts(tmp_path, buffers, order)
    predicted = reads_avoided_fraction(subgroups, buffers, order) * subgroups
    for visit in counts[1:]:  # the steady state (the first visit finds what the initial stores left)
        assert visit.subgroups == visit.reads + visit.reads_avoided == subgroups
        assert visit.reads_avoided == pytest.approx(predicted)
        assert visit.bytes_written == 12 * params
        assert (visit.bytes_read < 12 * params) == (predicted > 0)
        assert (visit.bytes_read == 0) == (predicted == subgroups)


@pytest.mark.parametrize("subgroups, sets, order, message", [
    (0, 3, "alternate", "subgroups must be an int >= 1"), (4, 2, "alternate", "sets must be an int >= 3"),
    (4, 3, "backward", "order must be one of"),
])
def test_the_model_refuses_bad_input(subgroups, sets, order, message):
    with pytest.raises(ValueError, match=message):
        reads_avoided_fraction(subgroups, sets, order)


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
