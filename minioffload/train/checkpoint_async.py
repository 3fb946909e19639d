"""Lazy asynchronous checkpoints of an offloaded run (chapter 11, after DataStates-LLM): `save()` returns at once, a
background writer writes the training state while the next forward and backward run, and the next optimizer step
waits only if the writer has not yet captured the state that step would overwrite.

    ckpt = AsyncCheckpointer("ckpt", model, opt)             # opt: an OffloadAdam (host or NVMe tier)
    ckpt.save(step, extra={"data_position": k})              # after opt.step(); returns at once
    ...                                                      # training goes on
    ckpt.wait()                                              # the last checkpoint is complete (or raise its error)
    step, extra = load_latest("ckpt", model, opt)            # the newest complete one; resume bit for bit

Why it can be lazy: between one `opt.step()` and the next nothing changes the optimizer's state or the model's
weights (forward and backward read them; only the update writes them). So the writer reads the live host buffers
directly, with no copy, and a step pre-hook on the optimizer holds the next update until the writer has
captured them. What lives on the device (the model's tensors that are not offloaded parameters, the kept small
parameters' AdamW state, a resident hybrid subgroup's state) is snapshotted by `save()` itself: copies into pinned
host buffers (made at the first save, reused by every later one) queued on a side stream ("checkpoint d2h") after
the compute issued so far, and an event the writer waits for before it writes them. `save()` only issues them: it
never waits for the device, and nothing goes through the default stream, where it would queue behind training.
Written per checkpoint, in a directory `step{N:08d}/`:
    subgroup{i}/master, exp_avg, exp_avg_sq   each CPU subgroup's fp32 state, through a Swapper (O_DIRECT, checksums);
                                              with the NVMe tier, the tier's current files hard-linked (not copied:
                                              the Swapper replaces a linked slot file instead of rewriting it) where
                                              the file system allows, copied otherwise
    meta.pt                                   step counts, settings, loss scale, the delayed update's unsent weights,
                                              the model's tensors that are not offloaded parameters, RNG states, extra
    MANIFEST.json                             written last, atomically (temporary file, fsync, rename, fsync of the
                                              directory): a directory without it is an unfinished checkpoint; it
                                              lists every file's size and meta.pt's checksum (the subgroup files
                                              have theirs in the Swapper's index), checked before anything loads
At most one checkpoint is in flight: a `save()` while one is writing waits for it. The newest `keep` complete
checkpoints stay; older ones are removed after a new one commits.

A write that fails (a directory gone, a full disk) does not stop training: the step pre-hook lets the update go on,
the error (naming the path) is raised by the next `save()` or `wait()`, and the last complete checkpoint stays
loadable.

What this is not: a sharded checkpoint (train/checkpoint.py writes one with torch.distributed.checkpoint), nor a format
for other frameworks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch

from ..engine import state as engine_state
from ..kernels.checksum import file_checksum
from ..layout import STATE, Where
from ..nvme.swapper import SwapIOError, Swapper, fsync_path

MANIFEST = "MANIFEST.json"


class AsyncCheckpointer:
    """Writes checkpoints of `model` and `opt` (an OffloadAdam) into `directory` in the background."""

    def __init__(self, directory, model: torch.nn.Module, opt, keep: int = 2, workers: int = 4):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (complete checkpoints to keep), got {keep!r}")
        if getattr(opt, "shard", None) is not None:
            raise ValueError("a sharded OffloadAdam saves with minioffload.train.checkpoint "
                             "(torch.distributed.checkpoint); "
                             "AsyncCheckpointer writes one process's state")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model, self.opt, self.keep, self.workers = model, opt, keep, workers
        self._thread: threading.Thread | None = None
        self._captured = threading.Event()
        self._captured.set()
        self._error: BaseException | None = None
        self.blocked_s = 0.0  # time the training loop spent waiting for the writer (save() and the step pre-hook)
        self.last: dict | None = None  # the last checkpoint written: step, path, seconds to capture and to commit
        self.snapshot = Snapshot(opt.dev)
        self._hook = opt.register_step_pre_hook(self._before_step)

    # the training loop's side -----------------------------------------------------------------------------
    def save(self, step: int, extra: dict | None = None) -> None:
        """Start a checkpoint of the state after update `step`; returns once the writer has started (after the
        previous checkpoint has finished). Raises the previous checkpoint's error, if it failed."""
        started = time.perf_counter()
        self.wait()
        self.blocked_s += time.perf_counter() - started
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        path = self.directory / f"step{step:08d}"
        self.snapshot.take(_device_state(self.model, self.opt))  # queued; the writer waits for it
        self._captured.clear()
        self._thread = threading.Thread(target=self._write, args=(step, path, dict(extra or {}), rng),
                                        name="checkpoint writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the checkpoint in flight; raise its error (naming the path), if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the checkpoint in flight and remove the step pre-hook."""
        try:
            self.wait()
        finally:
            self._hook.remove()

    def _before_step(self, *_args) -> None:
        """The optimizer's step pre-hook: the update waits until the writer has read the state it overwrites."""
        if not self._captured.is_set():
            started = time.perf_counter()
            self._captured.wait()
            self.blocked_s += time.perf_counter() - started

    # the writer's side ------------------------------------------------------------------------------------
    def _write(self, step: int, path: Path, extra: dict, rng: dict) -> None:
        started = time.perf_counter()
        try:
            # first: until the snapshot has landed, the next update must not write what it reads (and on a failure
            # below, the `finally` lets that update go)
            self.snapshot.wait()
            if path.exists():
                shutil.rmtree(path)  # an unfinished checkpoint of the same step, from a run that died
            captured_s = self._capture(step, path, extra, rng)
            _commit_manifest(path, {"step": step, "format": 2, "time": time.time(),
                                    "checksums": {"meta.pt": file_checksum(path / "meta.pt")}})
            self._prune()
            self.last = {"step": step, "path": str(path), "capture_s": captured_s,
                         "total_s": time.perf_counter() - started}
        except BaseException as err:  # noqa: BLE001 - raised by the next save() or wait()
            self._error = err if isinstance(err, OSError) else RuntimeError(f"checkpoint {path} failed: {err}")
        finally:
            self._captured.set()  # never leave the update waiting, even after a failure

    def _capture(self, step: int, path: Path, extra: dict, rng: dict) -> float:
        """Write everything the next update would change; then release it. Returns the seconds it took."""
        started = time.perf_counter()
        opt = self.opt
        opt.join_update()  # a delayed update of this step may still be running behind step()
        if opt.device_path is not None:
            opt.device_path.wait()  # the hybrid path's state is back in host memory (or written on the device)
        if opt.nvme is not None:
            opt.nvme.drain()  # the tier's last writes are durable: its current files are this step's
        path.mkdir(parents=True)
        layout = []
        with Swapper(path, workers=self.workers) as swapper:
            swapper.trace = opt.dev.trace  # its writes show on the nvme_write lane, beside the next step's work
            writes = []
            for index, sub in enumerate(opt.subgroups):
                layout.append({"subgroup": index, "numel": sub.numel,
                               "slots": [[slot.offset, slot.numel] for slot in sub.slots]})
                for name in STATE:
                    key = f"subgroup{index}/{name}"
                    if opt.nvme is not None and sub.where == Where.CPU:
                        _link_or_copy(opt.swapper, opt.nvme.key(sub, name), swapper, key)
                        continue
                    source = sub.buffers[name]
                    if opt.dev.is_device(source):  # a resident subgroup's state: its snapshot in pinned memory
                        source = self.snapshot.pinned(key)
                    writes.append(swapper.write(key, source))
            for future in writes:
                future.result()
        torch.save({"step": step, "extra": extra, "rng": rng, "layout": layout,
                    "optimizer": _settings(opt, self.snapshot),
                    "model": _model_tensors(self.model, opt, self.snapshot)}, path / "meta.pt")
        fsync_path(path / "meta.pt")
        self._captured.set()
        return time.perf_counter() - started

    def _prune(self) -> None:
        for old in complete(self.directory)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def load_latest(directory, model: torch.nn.Module, opt) -> tuple[int, dict]:
    """Load the newest complete checkpoint under `directory` into `model` and `opt` (built as when it was saved);
    returns (step, extra). One whose bytes are corrupt is skipped, with a warning, for the one before it.
    FileNotFoundError when there is none."""
    done = complete(Path(directory))
    if not done:
        raise FileNotFoundError(f"no complete checkpoint (a step directory with {MANIFEST}) under {directory}")
    for path in reversed(done[1:]):
        try:
            return load(path, model, opt)
        except CorruptCheckpoint as err:
            warnings.warn(f"{err}; loading the one before it", RuntimeWarning, stacklevel=2)
    return load(done[0], model, opt)


class CorruptCheckpoint(ValueError):
    """A complete checkpoint whose bytes differ from those written (a checksum differs); nothing was loaded."""


def load(path, model: torch.nn.Module, opt) -> tuple[int, dict]:
    """Load the checkpoint in `path` (a step directory); returns (step, extra)."""
    path = Path(path)
    if path.resolve() not in [done.resolve() for done in complete(path.parent)]:
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST}, or a file it lists is missing "
                                "or cut short): load an earlier one (load_latest finds it)")
    written = json.loads((path / MANIFEST).read_text()).get("checksums", {}).get("meta.pt")
    if written is not None and file_checksum(path / "meta.pt") != written:
        raise CorruptCheckpoint(f"{path / 'meta.pt'} is corrupt (its checksum is not the one written): load an "
                                "earlier checkpoint (load_latest does)")
    meta = torch.load(path / "meta.pt", weights_only=False)
    state = {}
    with Swapper(path) as swapper:
        slots = [(entry["subgroup"], offset, numel) for entry in meta["layout"] for offset, numel in entry["slots"]]
        flat = {}
        for entry in meta["layout"]:
            for name in STATE:
                buffer = opt.dev.host_empty(entry["numel"])
                key = f"subgroup{entry['subgroup']}/{name}"
                try:
                    swapper.read(key, into=buffer).result()  # checksum verified
                except SwapIOError as err:
                    if "checksum mismatch" not in str(err):
                        raise
                    raise CorruptCheckpoint(f"{path}: {err}") from err
                flat[entry["subgroup"], name] = buffer
    settings = meta["optimizer"]
    for index, (sub, offset, numel) in enumerate(slots):
        state[index] = {"step": settings["steps"][index], "shape": tuple(settings["shapes"][index]),
                        **{name: flat[sub, name][offset:offset + numel].clone() for name in STATE}}
    missing, unexpected = model.load_state_dict(meta["model"], strict=False)
    offloaded = {name for name, p in model.named_parameters() if p in opt.packing.slots}
    if unexpected or set(missing) - offloaded:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {sorted(set(missing) - offloaded)}, "
                         f"unexpected {sorted(unexpected)}")
    opt.load_state_dict({**settings["state_dict"], "state": state})  # uploads the masters into the model
    torch.set_rng_state(meta["rng"]["cpu"])
    if meta["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(meta["rng"]["cuda"])
    return meta["step"], meta["extra"]


# the pieces ----------------------------------------------------------------------------------------------
class Snapshot:
    """Copies of device tensors in pinned host memory, taken on a side stream without blocking the host.

        snapshot = Snapshot(dev)
        snapshot.take({"model/wte.weight": tensor, ...})   # training thread: queued after the compute issued so far
        snapshot.wait()                                    # writer thread: the copies have landed
        snapshot.pinned(key), snapshot.host(key, tensor)   # the copy (a host tensor as it is)

    One pinned buffer per key, made at its first `take` and reused by every later one (a new one only if the tensor's
    shape or dtype changed): the caller must be done reading the last snapshot before it takes the next."""

    def __init__(self, dev):
        self.dev = dev
        self.stream = dev.stream("checkpoint d2h")
        self.buffers: dict[str, torch.Tensor] = {}  # key -> pinned host buffer, the tensor's shape and dtype
        self._copied = None  # event after the last take's copies
        self._taken: set[str] = set()

    def take(self, tensors: dict[str, torch.Tensor]) -> None:
        """Queue a copy of each device tensor among `tensors` into its pinned buffer; returns at once."""
        on_device = {key: t for key, t in tensors.items() if self.dev.is_device(t)}
        self._taken, self._copied = set(on_device), None
        if not on_device:
            return
        # the step's updates (the kept AdamW, the hybrid path, a delayed update's uploads: step() made the compute
        # stream wait for those) are done before these copies read
        self.dev.stream_waits_for_compute(self.stream)
        for key, tensor in on_device.items():
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = self.buffers[key] = self.dev.host_empty(tuple(tensor.shape), tensor.dtype)
            self.dev.copy(buffer, tensor.detach(), self.stream, name="d2h checkpoint")
        self._copied = self.dev.event()
        self._copied.record(self.stream)

    def wait(self) -> None:
        """Block until the last take's copies have landed (any thread)."""
        if self._copied is not None:
            self._copied.synchronize()

    def pinned(self, key: str) -> torch.Tensor:
        """The pinned buffer holding the last take's copy of `key` (call `wait` first)."""
        if key not in self._taken:
            raise RuntimeError(f"the checkpoint needs {key!r} from the device, and save() did not snapshot it: "
                               "_device_state must list every device tensor the writer reads")
        self.dev.uses(f"the checkpoint writer reading the snapshot of {key!r}", reads=[self.buffers[key]])  # strict sim
        return self.buffers[key]

    def host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A compact host copy of `tensor`: of its snapshot when it is a device tensor, else of itself."""
        if self.dev.is_device(tensor):
            return self.pinned(key).clone()
        return tensor.detach().to("cpu", copy=True)


def _device_state(model: torch.nn.Module, opt) -> dict[str, torch.Tensor]:
    """What a checkpoint may read from the device, by the keys `_settings` and `_model_tensors` look up: the model's
    tensors that are not offloaded parameters (with a delayed update, all of them: which are unsent is known only once
    the update in flight has joined), the kept parameters' AdamW state and the resident subgroups' state."""
    tensors = {}
    maybe_unsent = opt.delayed is not None
    offloaded = {id(p) for p in opt.packing.slots}
    params = dict(model.named_parameters())
    for name, tensor in model.state_dict().items():
        if maybe_unsent or not (name in params and id(params[name]) in offloaded):
            tensors[f"model/{name}"] = tensor
    if opt.kept_optimizer is not None:
        for index, entry in opt.kept_optimizer.state_dict()["state"].items():
            for name, value in entry.items():
                if torch.is_tensor(value):
                    tensors[f"kept/{index}/{name}"] = value
    for index, sub in enumerate(opt.subgroups):
        if sub.where != Where.CPU:
            tensors.update({f"subgroup{index}/{name}": sub.buffers[name] for name in STATE})
    return {key: tensor for key, tensor in tensors.items() if opt.dev.is_device(tensor)}


def _settings(opt, snapshot: Snapshot) -> dict:
    """What opt.state_dict() holds besides the per-parameter tensors (written from the live buffers instead); the
    kept parameters' AdamW state from the snapshot."""
    slots = list(opt.packing.slots.values())
    settings = engine_state.settings(opt)
    if settings["kept"] is not None:
        state = settings["kept"]["state"]
        for index, entry in state.items():
            state[index] = {name: snapshot.host(f"kept/{index}/{name}", value) if torch.is_tensor(value) else value
                            for name, value in entry.items()}
    return {"steps": [slot.step for slot in slots], "shapes": [tuple(slot.param.shape) for slot in slots],
            "state_dict": settings}


def _model_tensors(model: torch.nn.Module, opt, snapshot: Snapshot) -> dict:
    """The model's state dict without the offloaded parameters (their masters are the checkpoint's); a delayed
    update's unsent parameters are kept: their weights on the device are one update behind their masters."""
    unsent = {id(slot.param) for slot in opt.delayed.unsent} if opt.delayed else set()
    offloaded = {id(p) for p in opt.packing.slots if id(p) not in unsent}
    params = dict(model.named_parameters())
    return {name: snapshot.host(f"model/{name}", tensor) for name, tensor in model.state_dict().items()
            if not (name in params and id(params[name]) in offloaded)}


def _link_or_copy(source: Swapper, source_key: str, target: Swapper, key: str) -> None:
    """Put `source`'s current version of `source_key` into `target` under `key`: a hard link where the file system
    allows (the bytes are not copied), else a copy; the entry (size, dtype, checksum) follows it into the index."""
    entry = dict(source.index[source_key])
    file = source.current_file(source_key)
    linked = target._file(key, entry["slot"])
    try:
        os.link(file, linked)
    except OSError:  # another file system, or links refused: copy the bytes
        shutil.copyfile(file, linked)
        fsync_path(linked)
    target._commit({key: entry})


def complete(directory: Path) -> list[Path]:
    """The step directories under `directory` whose manifest is committed and whose listed files are all there with
    their sizes, oldest step first (by number: step100000000 comes after step99999999)."""
    found = []
    for path in Path(directory).glob("step*") if Path(directory).is_dir() else []:
        match = re.fullmatch(r"step(\d+)", path.name)
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
            whole = all((path / name).stat().st_size == size for name, size in files.items())
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unfinished, torn, or a file gone
        if match and whole:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _commit_manifest(path: Path, manifest: dict) -> None:
    """Write MANIFEST.json last, listing every file of the checkpoint with its size; a crash at any point leaves
    no manifest or the whole one."""
    files = {str(f.relative_to(path).as_posix()): f.stat().st_size for f in sorted(path.rglob("*"))
             if f.is_file() and not f.name.startswith(MANIFEST)}
    temporary = path / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps({**manifest, "files": files}))
    fsync_path(temporary)
    os.replace(temporary, path / MANIFEST)
    fsync_path(path)  # the directory entry of the rename
