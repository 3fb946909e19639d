"""A training run's checkpoint in one directory, written by every rank with torch.distributed.checkpoint (DCP).

    checkpoint.save("ckpt/step100", model, opt, extra={"step": 100})   # every rank calls it (or one process)
    extra = checkpoint.load("ckpt/step100", model, opt)                # on any number of ranks
    checkpoint.export("ckpt/step100", "step100.pt")                    # the whole state in one torch.save file

What goes in: the model's state dict (the same on every rank: DCP writes it once) and OffloadAdam's
(engine/state.py), whose per-parameter entries each rank fills only for the parameters it owns, under the
indices one process would use. So the parts written by N ranks fit together, and M ranks loading it each ask
DCP for exactly the parameters they own under their own shard map: a checkpoint saved on 2 ranks loads on 1,
and the other way round. `extra` holds anything small the loop needs back (the step, the data position).

A save never writes over the last good checkpoint: DCP writes into `PATH.saving`, and once every rank is done, rank 0
renames the old `PATH` to `PATH.previous`, `PATH.saving` to `PATH`, and removes `PATH.previous`. A rank that dies at
any point leaves `PATH` (or, between the two renames, `PATH.previous`) whole, never a mix of two steps; `load`
reads whichever is there (`committed`). Before the renames rank 0 writes CHECKSUMS.json, a checksum of every file;
`load` checks them all before it changes anything, so a flipped byte is refused, not loaded.

What this is not: asynchronous (chapter 11 overlaps the write with training), nor a copy of the NVMe tier's
files (the state is read from them and written into the checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

from ..kernels.checksum import file_checksum
from ..nvme.swapper import fsync_path


def _state(model, opt, extra: dict | None) -> dict:
    optimizer = opt.state_dict()
    optimizer["state"] = {str(index): entry for index, entry in optimizer["state"].items()}  # DCP's keys are str
    return {"model": model.state_dict(), "optimizer": optimizer, "extra": dict(extra or {})}


def save(path, model, opt, extra: dict | None = None) -> Path:
    """Write the state of `model` and `opt` (an OffloadAdam, sharded or not) into directory `path`; a collective
    when torch.distributed is initialised (every rank calls it). Returns the path."""
    path = Path(path)
    state = _state(model, opt, extra)
    staging, previous = _beside(path, "saving"), _beside(path, "previous")
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first and staging.exists():
        shutil.rmtree(staging)  # a save that died before its commit
    _barrier()
    try:
        with warnings.catch_warnings():  # one process without a group: DCP says it runs without one, as it should
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(staging))
    except CheckpointException as err:  # every rank gets it: DCP gathers the failures
        if first:
            shutil.rmtree(staging, ignore_errors=True)  # its space back (a full disk)
        cause = [line for line in str(err).strip().splitlines() if line.strip()][-1:] or [type(err).__name__]
        raise RuntimeError(f"saving the checkpoint into {staging} failed ({cause[0].strip()[:300]}); {path} still "
                           "holds the last one saved") from None
    _barrier()  # every rank's files are written
    if first:
        _write_checksums(staging)
        if previous.exists():
            shutil.rmtree(previous)
        if path.exists():
            os.replace(path, previous)
        os.replace(staging, path)
        fsync_path(path.parent)  # the renames are durable before the old copy goes
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()
    return path


def committed(path) -> Path | None:
    """The directory that holds the checkpoint last saved at `path`: `path` itself, or `PATH.previous` if a save died
    between its two renames; None when there is none."""
    path = Path(path)
    return next((where for where in (path, _beside(path, "previous")) if (where / ".metadata").is_file()), None)


CHECKSUMS = "CHECKSUMS.json"


def _checksums(path: Path) -> dict[str, str]:
    return {f.name: file_checksum(f) for f in sorted(path.iterdir())
            if f.is_file() and not f.name.startswith(CHECKSUMS)}


def _write_checksums(path: Path) -> None:
    temporary = path / (CHECKSUMS + ".tmp")
    temporary.write_text(json.dumps(_checksums(path)))
    fsync_path(temporary)
    os.replace(temporary, path / CHECKSUMS)


def _verify(path: Path) -> None:
    """Every file the save wrote is there with its bytes (a checkpoint saved before checksums were kept: unchecked)."""
    listed = path / CHECKSUMS
    if not listed.is_file():
        return
    want, got = json.loads(listed.read_text()), _checksums(path)
    bad = sorted(name for name in want if got.get(name) != want[name])
    if bad:
        raise ValueError(f"{path} is corrupt: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not as written "
                         "(checksum differs, or missing); nothing was loaded. Load another checkpoint")


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(f"{path.name}.{suffix}")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(path, model, opt) -> dict:
    """Load a checkpoint written by `save` on any number of ranks into `model` and `opt`; returns its `extra`.
    Refuses (changing nothing) a directory without a checkpoint, or one of another model."""
    if committed(path) is None:
        raise ValueError(f"{path} holds no checkpoint (no .metadata file): give the directory checkpoint.save wrote")
    path = committed(path)
    _verify(path)
    state = _state(model, opt, None)  # what this rank needs, in the right shapes: DCP fills it in place
    state["model"] = {key: value.clone() for key, value in state["model"].items()}  # the model changes last
    state["extra"] = {key: None for key in _saved_extra_keys(path)}
    if state["optimizer"].get("kept") is not None:  # a fresh optimizer's AdamW has no state yet to be filled
        state["optimizer"]["kept"]["state"] = _saved_kept_state(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:  # DCP names the key that differs: say what that means
        lines = str(err).strip().splitlines() or [type(err).__name__]
        raise ValueError(f"{path} does not match this model and optimizer ({lines[-1][:300]}): is it from "
                         "another model or optimizer setting?") from err
    state["optimizer"]["state"] = {int(index): entry for index, entry in state["optimizer"]["state"].items()}
    opt.load_state_dict(state["optimizer"])  # checks shapes before it changes anything
    model.load_state_dict(state["model"])
    if dist.is_initialized():
        dist.barrier()
    return state["extra"]


def _saved_extra_keys(path: Path) -> list[str]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return sorted({key.split(".", 2)[1] for key in metadata.state_dict_metadata if key.startswith("extra.")})


def _saved_kept_state(path: Path) -> dict:
    """Places, shaped as the checkpoint's, for the AdamW state of the small parameters kept on the device: DCP loads
    only the keys it is given, and the optimizer it loads into has made none of them yet."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "optimizer.kept.state."
    state: dict[int, dict] = {}
    for key, saved in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if key.startswith(prefix):
            index, name = key[len(prefix):].split(".", 1)
            state.setdefault(int(index), {})[name] = (torch.empty(saved.size, dtype=saved.properties.dtype)
                                                      if isinstance(saved, TensorStorageMetadata) else None)
    return state


def export(path, out_file) -> Path:
    """The whole checkpoint in one `torch.save` file (nested dicts, as `save` was given them); no group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out_file = Path(out_file)
    dcp_to_torch_save(str(path), str(out_file))
    return out_file


def load_exported(out_file) -> dict:
    """An exported checkpoint's state, {"model": ..., "optimizer": ..., "extra": ...}, ready for
    `model.load_state_dict` and `opt.load_state_dict` in one process."""
    state = torch.load(out_file, weights_only=False)
    state["optimizer"]["state"] = {int(index): entry for index, entry in state["optimizer"]["state"].items()}
    return state
