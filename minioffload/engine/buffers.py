"""The memory OffloadAdam holds, made once at construction: where each subgroup is updated, and its buffers.

    device_path, nvme = allocate(packing, options, weights, swapper)

A subgroup the CPU updates gets pinned fp32 buffers (master, exp_avg, exp_avg_sq and the accumulated gradient;
with a swapper only the gradient, its state goes to files through the NVMe tier; with gradients on NVMe too, none:
grad_spill.py lends it a set) and a pinned staging buffer per
dtype (gradients arrive there, 16-bit weights leave from there; a delayed update's weights wait in upload buffers of
their own). With a hybrid split, the device path (device_path.py) takes the resident and streamed subgroups' device
memory first, so a split that does not fit fails before any state is made or moved. An fp32 streamed weight needs
no home of its own: `share_homes` makes the master it.

What this is not: the packing of parameters into subgroups (layout.pack) or what the buffers are used for.
"""

from __future__ import annotations

import torch

from .. import layout
from ..layout import STATE, Subgroup, Where
from ..options import OffloadOptions
from .buckets import make_buckets
from .device_path import DevicePath
from .nvme_tier import NvmeTier
from .packing import Packing
from .weights import WeightUploads


def allocate(packing: Packing, options: OffloadOptions, weights: WeightUploads, swapper=None,
             grads_on_nvme: bool = False) -> tuple[DevicePath | None, NvmeTier | None]:
    """Mark where each subgroup is updated and give it its buffers; the device path and the NVMe tier, if any."""
    dev, subgroups = packing.dev, packing.subgroups
    resident, streamed = layout.split_indices(len(subgroups), options.gpu_fraction, options.stride)
    for index in resident:
        subgroups[index].where = Where.RESIDENT
    for index in streamed:
        subgroups[index].where = Where.STREAMED
    for sub in packing.on_cpu():  # one subgroup at a time, before the device path takes its memory
        weights.flatten(sub)
    # a split that does not fit fails here, before any state is made or moved
    device_path = DevicePath(dev, subgroups) if resident or streamed else None
    for sub in subgroups:
        if not packing.mine(sub):  # another rank's: its state and staging live there
            continue
        if sub.where == Where.RESIDENT:  # the device path holds its buffers; the master starts as the weights
            for slot in sub.slots:
                slot.view(sub.buffers["master"]).copy_(slot.param.detach().reshape(-1))
            continue
        if sub.where == Where.STREAMED:  # state on the host; gradients and the update on the device
            sub.buffers = host_buffers(dev, sub.numel, STATE)
            initial_state(packing, sub, sub.buffers)
            continue
        if grads_on_nvme:  # its gradient and staging are lent by the spill's sets (grad_spill.py), its state on disk
            continue
        on_host = ("grad",) if swapper is not None else (*STATE, "grad")  # NVMe: the state goes to disk
        sub.buffers = host_buffers(dev, sub.numel, on_host)
        if options.bucket_numel is not None and packing.shard is None:
            sub.buckets = make_buckets(sub.slots, options.bucket_numel)
        for dtype in {s.param.dtype for s in sub.slots}:  # gradients arrive here, 16-bit weights leave
            sub.staging["staging", dtype] = dev.host_empty(sub.numel, dtype)
            if options.delayed:  # ... except with delayed updates: their weights wait in upload buffers
                sub.staging["upload", dtype] = dev.host_empty(sub.numel, dtype)
        if swapper is None:
            initial_state(packing, sub, sub.buffers)
    nvme = None
    if swapper is not None and packing.on_cpu():
        order = "forward" if packing.shard is not None else options.nvme_order  # sharded: in order
        nvme = NvmeTier(swapper, dev, packing.h2d, packing.on_cpu(), options.nvme_buffers, order,
                        extra=("grad",) if grads_on_nvme else ())
        for sub in packing.on_cpu():
            nvme.store(sub, lambda views, sub=sub: initial_state(packing, sub, views))
    return device_path, nvme


def share_homes(packing: Packing) -> None:
    """An fp32 streamed weight needs no copy of its own at home: the master is it (Tiny-Pipe's point). Not with
    the NVMe tier (the masters are in files) or a shard (a rank holds the masters of its own subgroups only)."""
    for slot in packing.slots.values():
        if slot.param.dtype == torch.float32 and packing.streamed(slot):
            packing.streamer.share_home(slot.param, packing.master(slot))


def host_buffers(dev, numel: int, names) -> dict:
    """Pinned fp32 buffers; every one but the master starts at zero (moments, accumulated gradient)."""
    buffers = {name: dev.host_empty(numel) for name in names}
    for name, buffer in buffers.items():
        if name != "master":
            buffer.zero_()
    return buffers


def initial_state(packing: Packing, sub: Subgroup, views: dict) -> None:
    """The state before the first step: the master is the weights (a streamed one's from its home), moments zero."""
    for slot in sub.slots:
        weights = packing.streamer.host_value(slot.param) if packing.streamed(slot) else slot.param.detach()
        slot.view(views["master"]).copy_(weights.reshape(-1).float().cpu())
    views["exp_avg"].zero_()
    views["exp_avg_sq"].zero_()
