"""The calculator and the engine agree: the bytes `memory.engine_bytes` predicts per tier are the bytes a real
OffloadAdam allocates, for every precision and option."""

import pytest
import torch

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.nvme.swapper import Swapper
from minioffload.predict import memory

SHAPES = [(48, 40), (40,), (64, 48), (48,), (40, 64), (40,), (300,), (7, 9)]  # uneven, so packing matters
OPTIONS = {"plain": {}, "delayed": {"delay_updates_after": 0}, "static split": {"gpu_fraction": 0.5},
           "streamed split": {"stride": 2}, "nvme": {"nvme": True},
           "speculative, buckets": {"speculative": True, "bucket_numel": 100},
           "nvme, gradients there too": {"nvme": True, "grads_on": "nvme", "grad_buffers": 2}}


def host_bytes(opt: OffloadAdam) -> int:
    """Pinned host bytes the optimizer holds: every buffer of every subgroup and of the NVMe working sets, each
    storage counted once (device-held buffers excluded)."""
    tensors = [t for sub in opt.subgroups for t in sub.held().values()]
    if opt.nvme is not None:
        tensors += [t for working_set in opt.nvme.sets for t in working_set.values()]
    if opt.spill is not None:
        tensors += [t for spill_set in opt.spill.sets for t in spill_set.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if not opt.dev.is_device(t)}
    return sum(storages.values())


def disk_bytes(directory) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file() and "index" not in path.name)


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16"])
@pytest.mark.parametrize("option", OPTIONS)
def test_engine_allocates_exactly_what_the_calculator_says(precision, option, tmp_path):
    torch.manual_seed(0)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in SHAPES]
    options = dict(OPTIONS[option])
    nvme = options.pop("nvme", False)
    with device("sim") as dev:
        dev.place(params)
        swapper = Swapper(tmp_path) if nvme else None
        opt = OffloadAdam(params, dev, subgroup_numel=4000, swapper=swapper, **options)
        # one step, so the swapper has written both versions of every file
        sum((p.float() * 0.5).sum() for p in params).backward()
        opt.step()
        opt.flush()
        sum((p.float() * 0.5).sum() for p in params).backward()
        opt.step()
        opt.flush()
        dev.synchronize()
        predicted = memory.engine_bytes(
            [p.numel() for p in params], precision, optimizer_on="nvme" if nvme else "host", subgroup_numel=4000,
            delay_updates_after=options.get("delay_updates_after"), gpu_fraction=options.get("gpu_fraction"),
            stride=options.get("stride"),
            speculative=options.get("speculative", False), grads_on=options.get("grads_on", "host"),
            grad_buffers=options.get("grad_buffers", 3),
            scratch_sets=opt.device_path.sets if opt.device_path is not None else 3)
        assert len(opt.subgroups) > 2
        assert host_bytes(opt) == predicted["host"]
        # device: the weights (adopted) and whatever the hybrid path allocated; gradients are freed by now
        assert dev.ledger.used("device") == predicted["device"]
        if nvme:
            swapper.close()
            assert disk_bytes(tmp_path) == predicted["nvme"]


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16"])
def test_engine_bytes_per_param_is_the_footprints_for_a_large_model(precision):
    numels = [1 << 20] * 64
    fp = memory.footprint(precision, "adam", "optimizer_cpu")
    got = memory.engine_bytes(numels, precision)
    assert got["host"] == fp.bytes(sum(numels), "host")
    assert got["device"] == fp.bytes(sum(numels), "device")
    delayed = memory.engine_bytes(numels, precision, delay_updates_after=0)
    fp_delayed = memory.footprint(precision, "adam", "optimizer_cpu", delay=True)
    assert delayed["host"] == fp_delayed.bytes(sum(numels), "host")
    speculative = memory.engine_bytes(numels, precision, speculative=True)
    fp_speculative = memory.footprint(precision, "adam", "optimizer_cpu", speculative=True)
    assert speculative["host"] == fp_speculative.bytes(sum(numels), "host") == got["host"] + 12 * sum(numels)
