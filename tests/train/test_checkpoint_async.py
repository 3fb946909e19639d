"""Lazy asynchronous checkpoints (train/checkpoint_async.py): a resumed run continues bit for bit, a checkpoint
never mixes
two steps, a run killed while one is in flight resumes from the last complete one, and a failed write loses nothing."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import HYPER, Toy, batch, loss_of, on_sim

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.nvme.swapper import SwapIOError, Swapper
from minioffload.train import checkpoint_async
from minioffload.train.checkpoint_async import AsyncCheckpointer, load_latest

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


KILLED = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from helpers import HYPER, Toy, batch, loss_of, on_sim
    from minioffload.train.checkpoint_async import AsyncCheckpointer, load_latest
    from minioffload.devices import device
    from minioffload.engine.optimizer import OffloadAdam

    directory, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
    with device("sim") as dev:
        torch.manual_seed(0)
        model = on_sim(Toy(width=64), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=4096, max_grad_norm=1.0, **HYPER)
        ckpt = AsyncCheckpointer(directory, model, opt, keep=3)
        start = load_latest(directory, model, opt)[0] if resume else 0
        for step in range(start, steps):
            loss_of(model, *batch(step)).backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step + 1)
            print("saved", step + 1, flush=True)
        ckpt.close()
        torch.save([p.detach().clone() for p in model.parameters()], directory + "/final.pt")
""")


@pytest.mark.slow
def test_a_run_killed_while_a_checkpoint_is_in_flight_resumes_bit_for_bit(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(KILLED.format(tests=str(Path(__file__).parents[1])))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    steps = 12
    straight = tmp_path / "straight"
    straight.mkdir()
    subprocess.run([sys.executable, str(script), str(straight), str(steps), "fresh"], check=True, env=env,
                   capture_output=True)
    reference = torch.load(straight / "final.pt")
    for trial, kill_after in enumerate((2, 5, 8)):  # saves seen before the kill: it lands during a later one
        run = tmp_path / f"killed{trial}"
        run.mkdir()
        child = subprocess.Popen([sys.executable, str(script), str(run), str(steps), "fresh"], env=env,
                                 stdout=subprocess.PIPE, text=True)
        for _ in range(kill_after):
            child.stdout.readline()
        time.sleep(0.003 * trial)  # land the kill at different points of the writer's work
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not (run / "final.pt").exists()
        subprocess.run([sys.executable, str(script), str(run), str(steps), "resume"], check=True, env=env,
                       capture_output=True)
        resumed = torch.load(run / "final.pt")
        assert all(torch.equal(a, b) for a, b in zip(reference, resumed, strict=True)), trial


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
