"""Lazy asynchronous checkpoints (train/checkpoint_async.py): a resumed run continues bit for bit, a checkpoint
never mixes two steps, a run killed while one is in flight resumes from the last complete one, a failed write loses
nothing, and the device state is snapshotted on a side stream without holding the training loop. On a GPU (marked
`gpu`): `train` resumed from either kind of checkpoint continues as the run that never stopped."""

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import HYPER, Toy, batch, loss_of, on_sim

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.layout import STATE, Where
from minioffload.nvme.swapper import SwapIOError, Swapper
from minioffload.train import checkpoint_async
from minioffload.train.checkpoint_async import AsyncCheckpointer, load_latest
from minioffload.train.loop import TrainConfig
from minioffload.train.loop import train as train_run

OPTIONS = {"plain": {}, "clipped, scaled, kept": {"max_grad_norm": 0.05, "loss_scale": "dynamic",
                                                  "min_offload_numel": 20},
           "delayed": {"delay_updates_after": 1}, "stride": {"stride": 2}, "speculative": {"speculative": True}}


def make(dev, **options):
    torch.manual_seed(0)
    model = on_sim(Toy(width=16), dev)
    return model, OffloadAdam(model.parameters(), dev, subgroup_numel=300, **options, **HYPER)


def train(model, opt, steps):
    for step in steps:
        opt.scale_loss(loss_of(model, *batch(step), use_side=step % 2 == 0)).backward()
        opt.step()
        opt.zero_grad()


def weights(model, opt):
    opt.flush()
    return [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.master_weights()]


@pytest.mark.parametrize("option", OPTIONS)
def test_a_run_resumed_from_an_async_checkpoint_continues_bit_for_bit(option, tmp_path):
    with device("sim") as dev:
        model, opt = make(dev, **OPTIONS[option])
        ckpt = AsyncCheckpointer(tmp_path, model, opt)
        train(model, opt, range(3))
        ckpt.save(3, extra={"next": 3})
        train(model, opt, range(3, 6))  # the checkpoint is written while these run
        ckpt.close()
        straight = weights(model, opt)
        assert ckpt.last["step"] == 3
    with device("sim") as dev:
        model, opt = make(dev, **OPTIONS[option])
        step, extra = load_latest(tmp_path, model, opt)
        assert (step, extra) == (3, {"next": 3})
        train(model, opt, range(3, 6))
        assert all(torch.equal(a, b) for a, b in zip(straight, weights(model, opt), strict=True))


def test_the_next_update_waits_for_the_capture_and_the_checkpoint_holds_one_step(tmp_path, monkeypatch):
    """A slow disk: the writer is still reading the live state when the next step() comes. The step must wait, and
    the checkpoint must hold the state after step 2, not a mix of steps 2 and 3."""
    write = Swapper.write

    def slow(self, key, tensor):
        time.sleep(0.02)
        return write(self, key, tensor)

    monkeypatch.setattr(Swapper, "write", slow)
    with device("sim") as dev:
        model, opt = make(dev)
        ckpt = AsyncCheckpointer(tmp_path, model, opt)
        train(model, opt, range(2))
        at_save = weights(model, opt)
        ckpt.save(2)
        train(model, opt, [2])  # its step() waits for the capture
        assert ckpt.blocked_s > 0
        ckpt.close()
    with device("sim") as dev:
        model, opt = make(dev)
        load_latest(tmp_path, model, opt)
        assert all(torch.equal(a, b) for a, b in zip(at_save, weights(model, opt), strict=True))


def test_a_failed_write_names_the_path_and_loses_nothing(tmp_path, monkeypatch):
    with device("sim") as dev:
        model, opt = make(dev)
        ckpt = AsyncCheckpointer(tmp_path, model, opt)
        train(model, opt, range(2))
        ckpt.save(2)
        ckpt.wait()
        write = Swapper.write

        def full(self, key, tensor):
            if "step00000003" in str(self.directory):
                raise SwapIOError(f"no space left on the device writing {self.directory / key}", self.directory, key)
            return write(self, key, tensor)

        monkeypatch.setattr(Swapper, "write", full)
        train(model, opt, [2])
        ckpt.save(3)
        train(model, opt, [3])  # the update is not held by a writer that failed
        with pytest.raises(SwapIOError, match="step00000003"):
            ckpt.save(4)
        monkeypatch.setattr(Swapper, "write", write)
        ckpt.save(4)  # the next one works again
        ckpt.close()
        after = weights(model, opt)
    complete = sorted(p.parent.name for p in tmp_path.glob("step*/MANIFEST.json"))
    assert complete == ["step00000002", "step00000004"]
    with device("sim") as dev:
        model, opt = make(dev)
        assert load_latest(tmp_path, model, opt)[0] == 4
        assert all(torch.equal(a, b) for a, b in zip(after, weights(model, opt), strict=True))


def test_only_the_newest_complete_checkpoints_stay_and_bad_input_is_refused(tmp_path):
    with device("sim") as dev:
        model, opt = make(dev)
        ckpt = AsyncCheckpointer(tmp_path, model, opt, keep=2)
        for step in range(4):
            train(model, opt, [step])
            ckpt.save(step + 1)
        ckpt.close()
        assert sorted(p.name for p in tmp_path.glob("step*")) == ["step00000003", "step00000004"]
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            AsyncCheckpointer(tmp_path, model, opt, keep=0)
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            load_latest(tmp_path / "nothing", model, opt)
        (tmp_path / "step00000004" / checkpoint_async.MANIFEST).unlink()  # as if the run died before the commit
        assert load_latest(tmp_path, model, opt)[0] == 3
        (tmp_path / "step100000000").mkdir()  # a later step that sorts first as a string: compared as a number
        (tmp_path / "step100000000" / checkpoint_async.MANIFEST).write_text('{"files": {}}')
        assert checkpoint_async.complete(tmp_path)[-1].name == "step100000000"
        (tmp_path / "step100000000" / checkpoint_async.MANIFEST).write_text('{"files": {"meta.pt": 10}}')
        meta = tmp_path / "step00000003" / "meta.pt"
        meta.write_bytes(meta.read_bytes()[:-1])  # a listed file cut short: not complete
        assert checkpoint_async.complete(tmp_path) == []
        with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
            checkpoint_async.load(tmp_path / "step00000003", model, opt)


@pytest.mark.parametrize("file", ["meta.pt", "subgroup0/master"])
def test_a_flipped_byte_is_refused_and_the_checkpoint_before_it_loads(file, tmp_path):
    """meta.pt (RNG states, kept parameters and their AdamW state) is checksummed in the manifest, the subgroup files
    in the Swapper's index: a corrupt newest checkpoint changes nothing and load_latest takes the one before it."""
    with device("sim") as dev:
        model, opt = make(dev, min_offload_numel=20)
        ckpt = AsyncCheckpointer(tmp_path, model, opt)
        for step in range(2):
            train(model, opt, [step])
            ckpt.save(step + 1)
        ckpt.close()
        before = weights(model, opt)
        target = tmp_path / "step00000002" / file.replace("/", "%2f")
        target = target if target.exists() else target.with_name(target.name + ".0")  # the Swapper's file of a key
        data = bytearray(target.read_bytes())
        data[100] ^= 0x01  # one bit, within the values, same size: the manifest's sizes still match
        target.write_bytes(bytes(data))
        with pytest.raises(checkpoint_async.CorruptCheckpoint, match="corrupt|checksum"):
            checkpoint_async.load(tmp_path / "step00000002", model, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, weights(model, opt), strict=True))  # nothing changed
        with pytest.warns(RuntimeWarning, match="loading the one before it"):
            assert load_latest(tmp_path, model, opt)[0] == 1


def test_device_state_is_snapshotted_on_a_side_stream_into_pinned_buffers_reused_by_every_save(tmp_path, monkeypatch):
    """What lives on the device (a resident hybrid subgroup's state, kept parameters and their AdamW state, a frozen
    parameter) is copied by save() on the "checkpoint d2h" stream, after the compute issued so far, into pinned
    buffers that every save reuses; save() never waits for the device; the checkpoint holds the values at save time."""
    from minioffload.devices.sim_streams import SimEvent
    from minioffload.pinned import is_pinned

    host_waits, saving, trainer = [], False, threading.current_thread()  # the trainer's waits while save() runs
    synchronize = SimEvent.synchronize

    def watched(event, *args, **kwargs):
        if saving and threading.current_thread() is trainer:
            host_waits.append(event)
        return synchronize(event, *args, **kwargs)

    monkeypatch.setattr(SimEvent, "synchronize", watched)
    with device("sim") as dev:
        model, opt = make(dev, min_offload_numel=20, gpu_fraction=0.5)
        copies = []
        real_copy = dev.copy

        def spy(dst, src, stream=None, name=None):
            copies.append({"stream": (stream or dev.default_stream).name, "dst": dst, "src": src})
            return real_copy(dst, src, stream, name)

        monkeypatch.setattr(dev, "copy", spy)
        ckpt = AsyncCheckpointer(tmp_path, model, opt)
        train(model, opt, range(2))
        kept_state = [t for state in opt.kept_optimizer.state.values() for t in state.values() if t.numel() > 1]
        for tensor in kept_state:
            dev.adopt(tensor, "kept AdamW state")  # the sim's AdamW makes them in host memory: count them as device's
        kept = [p for p in opt.kept]
        dev.uses("the kept parameters' update", writes=kept)  # as on a GPU: compute wrote them, copies must wait for it
        on_device = [*kept, *kept_state, model.frozen,
                     *(sub.buffers[name] for sub in opt.subgroups if sub.where != Where.CPU for name in STATE)]
        assert len(kept) == 2 and kept_state and any(sub.where != Where.CPU for sub in opt.subgroups)
        at_save = copy.deepcopy(opt.state_dict()), {name: t.clone() for name, t in model.state_dict().items()}
        saves = []
        for step in (2, 3):
            copies.clear()
            saving = True
            ckpt.save(step)
            saving = False
            snapshot = [c for c in copies if c["stream"] == "checkpoint d2h"]
            assert {c["src"].data_ptr() for c in snapshot} == {t.data_ptr() for t in on_device}
            assert all(is_pinned(c["dst"]) for c in snapshot) and len(snapshot) == len(copies)  # none on another stream
            assert host_waits == []  # issued, not waited for
            saves.append({key: buffer.data_ptr() for key, buffer in ckpt.snapshot.buffers.items()})
            train(model, opt, [step])  # changes every tensor above while the checkpoint is written
        ckpt.close()
        assert saves[0] == saves[1] and len(saves[0]) == len(on_device)  # the same pinned buffers, reused
    with device("sim") as dev:
        model, opt = make(dev, min_offload_numel=20, gpu_fraction=0.5)
        checkpoint_async.load(tmp_path / "step00000002", model, opt)
        state, model_state = opt.state_dict(), model.state_dict()
    for index, entry in at_save[0]["state"].items():
        assert all(torch.equal(entry[name], state["state"][index][name]) for name in STATE), index
    for index, entry in at_save[0]["kept"]["state"].items():
        assert all(torch.equal(value, state["kept"]["state"][index][name]) for name, value in entry.items())
    assert all(torch.equal(tensor, model_state[name]) for name, tensor in at_save[1].items()
               if name in ("frozen", "mlp.2.bias", "side.bias"))


KILLED = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from helpers import HYPER, Toy, batch, loss_of, on_sim
    from minioffload.train.checkpoint_async import AsyncCheckpointer, complete, load_latest
    from minioffload.devices import device
    from minioffload.engine.optimizer import OffloadAdam

    def run(directory, steps):  # from the newest complete checkpoint in `directory`, if there is one
        with device("sim") as dev:
            torch.manual_seed(0)
            model = on_sim(Toy(width=64), dev)
            opt = OffloadAdam(model.parameters(), dev, subgroup_numel=4096, max_grad_norm=1.0, **HYPER)
            ckpt = AsyncCheckpointer(directory, model, opt, keep=3)
            start = load_latest(directory, model, opt)[0] if complete(ckpt.directory) else 0
            for step in range(start, steps):
                loss_of(model, *batch(step)).backward()
                opt.step()
                opt.zero_grad()
                ckpt.save(step + 1)
                print("saved", step + 1, flush=True)
            ckpt.close()
            torch.save([p.detach().clone() for p in model.parameters()], directory + "/final.pt")

    steps, directories = int(sys.argv[1]), sys.argv[2:]
    for directory in directories:  # one process finishes several runs: each starts from a fresh device and model
        run(directory, steps)
""")


@pytest.mark.slow
def test_a_run_killed_while_a_checkpoint_is_in_flight_resumes_bit_for_bit(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(KILLED.format(tests=str(Path(__file__).parents[1])))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    steps = 12
    runs = {kill_after: tmp_path / f"killed-after-{kill_after}" for kill_after in (2, 5, 8)}
    for trial, (kill_after, run) in enumerate(runs.items()):  # saves seen before the kill: it lands in a later one
        run.mkdir()
        child = subprocess.Popen([sys.executable, str(script), str(steps), str(run)], env=env,
                                 stdout=subprocess.PIPE, text=True)
        for _ in range(kill_after):
            child.stdout.readline()
        time.sleep(0.003 * trial)  # land the kill at different points of the writer's work
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not (run / "final.pt").exists()
        assert checkpoint_async.complete(run), "the kill came before the first checkpoint was complete"
    straight = tmp_path / "straight"
    straight.mkdir()
    subprocess.run([sys.executable, str(script), str(steps), str(straight), *map(str, runs.values())], check=True,
                   env=env, capture_output=True)
    reference = torch.load(straight / "final.pt")
    for kill_after, run in runs.items():
        resumed = torch.load(run / "final.pt")
        assert all(torch.equal(a, b) for a, b in zip(reference, resumed, strict=True)), kill_after


@pytest.mark.parametrize("paths", [1, 2])
def test_the_nvme_tier_is_hard_linked_not_copied_and_resumes_bit_for_bit(paths, tmp_path):
    from minioffload.nvme.multipath import MultiPathSwapper

    def swapper(root):
        directories = [root / f"path{i}" for i in range(paths)]
        for directory in directories:
            directory.mkdir(parents=True)
        return Swapper(directories[0]) if paths == 1 else MultiPathSwapper(directories, bandwidths=[2, 1])

    with device("sim") as dev, swapper(tmp_path / "swap") as swap:
        torch.manual_seed(0)
        model = on_sim(Toy(width=16), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=300, swapper=swap, nvme_order="alternate", **HYPER)
        ckpt = AsyncCheckpointer(tmp_path / "ckpt", model, opt)
        train(model, opt, range(3))
        ckpt.save(3)
        ckpt.wait()
        linked = [f for f in (tmp_path / "ckpt" / "step00000003").iterdir() if f.name.startswith("subgroup")]
        assert linked and all(f.stat().st_nlink == 2 for f in linked)  # one inode, two names: nothing copied
        train(model, opt, range(3, 6))  # the tier writes every slot again: the linked files keep their bytes
        ckpt.close()
        straight = weights(model, opt)
    with device("sim") as dev, swapper(tmp_path / "swap2") as swap:
        torch.manual_seed(0)
        model = on_sim(Toy(width=16), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=300, swapper=swap, nvme_order="alternate", **HYPER)
        assert load_latest(tmp_path / "ckpt", model, opt)[0] == 3
        train(model, opt, range(3, 6))
        assert all(torch.equal(a, b) for a, b in zip(straight, weights(model, opt), strict=True))


# on a GPU ---------------------------------------------------------------------------------------------------------
# `train` end to end, resumed from each kind of checkpoint. Two runs on one GPU may differ by rounding (its attention
# backward may accumulate in another order from run to run): 1e-4 of a loss near 4 is far below what a lost or stale
# piece of state moves it by (one step lowers it by 0.1 to 0.3).
RESUME_TOL = 1e-4
ON_CUDA = dict(device="cuda", model="tiny", block_size=32, batch_size=8, grad_accum=2, lr=3e-3, eval_every=100,
               progress=False)


def _kept():  # small parameters kept on the device: their weights and AdamW state are device state in a checkpoint
    return TrainConfig().optimizer.replace(min_offload_numel=1000)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four steps on the GPU without a stop: what a resumed run must continue into."""
    return train_run(TrainConfig(**ON_CUDA, steps=4, optimizer=_kept(),
                                 out_dir=str(tmp_path_factory.mktemp("uninterrupted")))).losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy async", "torch.distributed.checkpoint"])
def test_on_cuda_a_resumed_train_run_continues_as_the_uninterrupted_one(lazy, uninterrupted, tmp_path, lagging_gpu):
    checkpoints = tmp_path / "ckpt"
    first = train_run(TrainConfig(**ON_CUDA, steps=2, optimizer=_kept(), checkpoint_dir=str(checkpoints),
                                  checkpoint_every=2 if lazy else None, out_dir=str(tmp_path / "first")))
    if lazy:
        assert [p.name for p in checkpoint_async.complete(checkpoints)] == ["step00000002"]
        names = {event["name"] for event in json.loads(first.paths["trace"].read_text())["traceEvents"]}
        assert "d2h checkpoint" in names  # the device state, snapshotted on the side stream
    else:
        assert (checkpoints / ".metadata").is_file()
    resumed = train_run(TrainConfig(**ON_CUDA, steps=4, optimizer=_kept(), resume=str(checkpoints),
                                    out_dir=str(tmp_path / "resumed")))
    assert first.losses == pytest.approx(uninterrupted[:2], abs=RESUME_TOL), (first.losses, uninterrupted)
    assert resumed.losses == pytest.approx(uninterrupted[2:], abs=RESUME_TOL), (resumed.losses, uninterrupted)
