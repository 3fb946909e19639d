"""OffloadAdam's state, read and restored: its master weights and pinned bytes, the NVMe tier's state read back, and
the checkpoint: what `state_dict()` saves and how `load_state_dict()` puts it back.

The truth of an offloaded run is on the host (or the disk): per parameter its step count, fp32 master
weights and moments. A checkpoint holds those (in param_groups order, as CPU tensors), the param groups'
settings, the loss-scale state, the small parameters kept on the device (torch's AdamW state) and, with
a delayed update, which parameters' weights it had not sent yet (`unsent`), so that a checkpoint loaded
together with the model's own state_dict (whose weights are one update behind) continues bit for bit.

Sharded (chapter 10): each rank saves the parameters it owns, under the same indices as one process would, and
loads those it owns from any checkpoint that has them: train/checkpoint.py puts the ranks' parts in one directory with
torch.distributed.checkpoint, and loads them onto any number of ranks.

What this is not: a file format or an asynchronous checkpoint (chapter 11).
"""

from __future__ import annotations

from ..layout import STATE, Where
from .delayed import DelayedUpdate


def master_weights(opt) -> list:
    """The fp32 master copy of each trainable parameter of `opt`, in the order it holds them (after its update work)."""
    opt.quiesce()
    on_disk = read_state(opt, "master")  # NVMe tier: copies read from the disk
    flat = {id(sub): on_disk[id(sub)]["master"] if id(sub) in on_disk else sub.buffers.get("master")
            for sub in opt.subgroups}
    if opt.shard is not None:  # a collective: every rank calls it, and each subgroup comes from its owner
        for index, sub in enumerate(opt.subgroups):
            flat[id(sub)] = opt.shard.broadcast_host(flat[id(sub)], sub.numel, index)
    return [slot.shaped(flat[id(slot.subgroup)]) for slot in opt.packing.slots.values()]


def pinned_bytes(opt) -> int:
    """The pinned host memory `opt` holds: its subgroups' buffers, the NVMe tier's working sets and the gradients'
    sets, each storage counted once (device-held buffers left out)."""
    tensors = [t for sub in opt.subgroups for t in sub.held().values()]
    for part in (opt.nvme, opt.spill):
        tensors += [t for one in (part.sets if part is not None else []) for t in one.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if not opt.dev.is_device(t)}
    return sum(storages.values())


def read_state(opt, *names: str) -> dict:
    """NVMe tier: {id(subgroup): {name: a fresh host tensor read from the disk}} ({} without the tier)."""
    if opt.nvme is None:
        return {}
    opt.nvme.drain()
    out = {}
    for sub in opt.packing.on_cpu():
        out[id(sub)] = {name: opt.dev.host_empty(sub.numel) for name in names}
        for name in names:
            opt.swapper.read(opt.nvme.key(sub, name), into=out[id(sub)][name]).result()
    return out


def save(opt) -> dict:
    """The state of `opt` (an OffloadAdam), after its update work has finished."""
    opt.quiesce()
    packing = opt.packing
    on_disk = read_state(opt, *STATE)
    state = {}
    for index, slot in enumerate(packing.slots.values()):
        if not packing.mine(slot.subgroup):
            continue  # another rank's part
        buffers = on_disk.get(id(slot.subgroup), slot.subgroup.buffers)
        state[index] = {"step": slot.step, "shape": tuple(slot.param.shape),
                        **{name: slot.view(buffers[name]).to("cpu", copy=True) for name in STATE}}
    return {"state": state, **settings(opt)}


def settings(opt) -> dict:
    """What a state dict holds besides the per-parameter tensors: the groups' settings, the loss scale, the
    delayed update's unsent parameters (by index) and the kept parameters' torch state."""
    slots = list(opt.packing.slots.values())
    unsent = {id(slot) for slot in opt.delayed.unsent} if opt.delayed else set()
    return {"params": len(slots),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "loss_scale": {"scale": opt.scale, "clean_steps": opt.clean_steps, "skipped": opt.skipped_steps},
            "updates": opt.updates,
            "unsent": [i for i, slot in enumerate(slots) if id(slot) in unsent],
            "kept_shapes": [tuple(p.shape) for p in opt.kept],
            "kept": None if opt.kept_optimizer is None else opt.kept_optimizer.state_dict()}


def check(opt, state_dict: dict) -> None:
    """Refuse a checkpoint of another model (ValueError naming what differs); changes nothing."""
    slots = list(opt.packing.slots.values())
    saved = state_dict.get("state", {})
    groups = state_dict.get("param_groups", [])
    total = state_dict.get("params", len(saved))
    if total != len(slots) or len(groups) != len(opt.param_groups):
        raise ValueError(f"checkpoint holds {total} parameters in {len(groups)} groups; this optimizer has "
                         f"{len(slots)} in {len(opt.param_groups)}: is it from another model?")
    owned = [index for index, slot in enumerate(slots) if opt.packing.mine(slot.subgroup)]
    missing = [index for index in owned if index not in saved]
    if missing:
        raise ValueError(f"checkpoint lacks parameters {missing[:8]}{' ...' if len(missing) > 8 else ''} that this "
                         "optimizer updates: it is one rank's part; load the whole sharded checkpoint "
                         "(minioffload.train.checkpoint.load) instead")
    for index in owned:
        slot = slots[index]
        if tuple(saved[index]["shape"]) != tuple(slot.param.shape):
            raise ValueError(f"checkpoint parameter {index} has shape {tuple(saved[index]['shape'])}, this "
                             f"model's has {tuple(slot.param.shape)}: is it from another model?")
    kept_shapes = [tuple(shape) for shape in state_dict.get("kept_shapes", [])]
    if kept_shapes != [tuple(p.shape) for p in opt.kept]:
        raise ValueError(f"checkpoint keeps {len(kept_shapes)} small parameters on the device, this optimizer "
                         f"{len(opt.kept)} (or their shapes differ): same model and min_offload_numel?")


def load(opt, state_dict: dict) -> None:
    """Restore `state_dict` into `opt`. The model's weights are set to the masters, rounded to their dtype,
    except those a delayed update had not sent when the checkpoint was taken: with delayed updates on, they
    are sent at the next step(), as they would have been (load the model's state_dict as well)."""
    opt.quiesce()
    packing = opt.packing
    check(opt, state_dict)
    if opt.device_path is not None:
        opt.device_path.cancel()  # state a backward brought in is the old state: fetch it again
    if opt.weights.uploaded is not None:
        opt.weights.uploaded.synchronize()  # the last upload may still read the masters written below
    packing.dev.uses("loading a checkpoint", writes=[sub.buffers[name] for sub in packing.subgroups
                                                       if packing.mine(sub) for name in STATE if name in sub.buffers])
    slots = list(packing.slots.values())
    saved = state_dict["state"]
    for group, saved_group in zip(opt.param_groups, state_dict["param_groups"], strict=True):
        group.update(saved_group)
    positions = {id(slot): index for index, slot in enumerate(slots)}
    for index, slot in enumerate(slots):
        if not packing.mine(slot.subgroup):
            continue
        slot.step = saved[index]["step"]
        if opt.nvme is None or slot.subgroup.where != Where.CPU:
            for name in STATE:
                slot.view(slot.subgroup.buffers[name]).copy_(saved[index][name])
    if opt.shard is not None:
        _share_weights(opt, saved, positions)
    elif opt.nvme is not None:  # NVMe tier: each subgroup's state goes to the disk and its weights up
        for sub in opt.nvme.visit(packing.on_cpu()):
            for slot in sub.slots:
                for name in STATE:
                    slot.view(sub.buffers[name]).copy_(saved[positions[id(slot)]][name])
            opt.weights.upload(sub.slots)
    if opt.kept_optimizer is not None:
        opt.kept_optimizer.load_state_dict(state_dict["kept"])
    scale = state_dict["loss_scale"]
    loss_scale = opt.loss_scale
    loss_scale.scale, loss_scale.clean_steps, loss_scale.skipped_steps = (scale["scale"], scale["clean_steps"],
                                                                          scale["skipped"])
    opt.updates = state_dict.get("updates", 0)
    unsent = set(state_dict.get("unsent", [])) if opt.delayed else set()
    if opt.delayed:
        opt.delayed.unsent = [slot for index, slot in enumerate(slots) if index in unsent]
        for slot in opt.delayed.unsent:
            DelayedUpdate.stash(slot)
    if opt.nvme is None and opt.shard is None:
        opt.weights.upload([slot for index, slot in enumerate(slots)
                     if index not in unsent and slot.subgroup.where == Where.CPU])
    for slot in slots:
        if slot.subgroup.where != Where.CPU:  # updated on the device: its weights are written directly
            slot.param.data.copy_(packing.master(slot))
    if opt.streamer is not None:
        opt.streamer.updated()  # streamed weights: written home
    opt.weights.sent()
    opt.next_forward_waits()


def _share_weights(opt, saved: dict, positions: dict) -> None:
    """Sharded: each owner's state to its disk (NVMe tier), its weights up and broadcast to every rank."""
    if opt.streamer is not None:
        opt.streamer.quiesce()  # homes change below
    sharded, packing = opt.sharded, opt.packing
    gather = sharded.gather()
    own = opt.nvme.visit(packing.on_cpu()) if opt.nvme is not None else packing.on_cpu()
    for sub in sharded.interleave(own, {id(slot) for slot in packing.slots.values()}, gather):
        if opt.nvme is not None:
            for slot in sub.slots:
                for name in STATE:
                    slot.view(sub.buffers[name]).copy_(saved[positions[id(slot)]][name])
        sharded.send_subgroup(sub, gather)
    gather.finish()
