"""The torch.distributed.checkpoint path (train/checkpoint.py) under damage, as the swapper's and the async
checkpoint's suites test theirs: a save that dies part-way (at any point: killed, failed, between its two renames),
a full disk, a flipped byte. Each time the directory loads as one whole step, the step it says, or is refused naming
the file; never a mix of two steps."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import batch, fresh, loss_of

from minioffload.devices import device
from minioffload.train import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def step(model, opt, k):
    loss_of(model, *batch(100 * k)).backward()
    opt.step()
    opt.zero_grad()


def masters_after(steps: int) -> list[torch.Tensor]:
    """The optimizer's fp32 weights after `steps` steps of the seeded Toy: what a checkpoint of that step holds."""
    with device("sim") as dev:
        model, opt = fresh(dev)
        for k in range(steps):
            step(model, opt, k)
        return [m.clone() for m in opt.master_weights()]


def loaded(path) -> tuple[dict, list[torch.Tensor]]:
    with device("sim") as dev:
        model, opt = fresh(dev)
        extra = checkpoint.load(path, model, opt)
        return extra, [m.clone() for m in opt.master_weights()]


def assert_whole_step(path, steps: set[int]):
    extra, masters = loaded(path)
    assert extra["step"] in steps
    assert all(torch.equal(a, b) for a, b in zip(masters, masters_after(extra["step"]), strict=True))
    return extra["step"]


def saved_twice(path, monkeypatch, fault):
    """Step 1 saved at `path`, then step 2 saved over it with `fault` installed for the second save."""
    with device("sim") as dev:
        model, opt = fresh(dev)
        step(model, opt, 0)
        checkpoint.save(path, model, opt, extra={"step": 1})
        step(model, opt, 1)
        fault(monkeypatch)
        with pytest.raises((OSError, RuntimeError)):
            checkpoint.save(path, model, opt, extra={"step": 2})
        monkeypatch.undo()
        return model, opt


def test_a_save_that_fails_part_way_leaves_the_last_good_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    real_save = checkpoint.dcp.save

    def dies_after_writing(monkeypatch):
        def save(state, checkpoint_id):
            real_save(state, checkpoint_id=checkpoint_id)
            Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half")  # a rank's data file cut short
            raise RuntimeError("a rank died")
        monkeypatch.setattr(checkpoint.dcp, "save", save)

    model, opt = saved_twice(path, monkeypatch, dies_after_writing)
    assert assert_whole_step(path, {1, 2}) == 1
    checkpoint.save(path, model, opt, extra={"step": 2})  # the next save clears what the dead one left
    assert assert_whole_step(path, {2}) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_save_that_dies_between_its_renames_loads_the_previous_step(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    real_replace = os.replace

    def second_rename_fails(monkeypatch):
        calls = []

        def replace(src, dst):
            if Path(src).name in ("ck", "ck.saving"):  # the save's own renames, not DCP's inside it
                calls.append(src)
            if len(calls) == 2:
                raise OSError("killed between the renames")
            real_replace(src, dst)
        monkeypatch.setattr(checkpoint.os, "replace", replace)

    model, opt = saved_twice(path, monkeypatch, second_rename_fails)
    assert not path.exists() and checkpoint.committed(path) == tmp_path / "ck.previous"
    assert assert_whole_step(path, {1, 2}) == 1
    checkpoint.save(path, model, opt, extra={"step": 2})
    assert assert_whole_step(path, {2}) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_flipped_byte_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "ck"
    with device("sim") as dev:
        model, opt = fresh(dev)
        step(model, opt, 0)
        checkpoint.save(path, model, opt, extra={"step": 1})
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with device("sim") as dev:
        model, opt = fresh(dev)
        before = [m.clone() for m in opt.master_weights()]
        with pytest.raises(ValueError, match=r"corrupt: __0_0.distcp is not as written"):
            checkpoint.load(path, model, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, opt.master_weights(), strict=True))


def test_a_full_disk_fails_the_save_and_keeps_the_last_checkpoint(small_ext4):
    path = small_ext4 / "ck"
    with device("sim") as dev:
        model, opt = fresh(dev)
        step(model, opt, 0)
        checkpoint.save(path, model, opt, extra={"step": 1})
        step(model, opt, 1)
        filler = small_ext4 / "filler"
        with open(filler, "wb") as f:  # leave less than a checkpoint's size
            f.write(b"\0" * (os.statvfs(small_ext4).f_bavail * os.statvfs(small_ext4).f_frsize - 4096))
        with pytest.raises(RuntimeError, match=r"ck.saving failed .*No space left.*ck still holds the last one"):
            checkpoint.save(path, model, opt, extra={"step": 2})
    assert not (small_ext4 / "ck.saving").exists()  # its space given back
    assert assert_whole_step(path, {1}) == 1
    filler.unlink()


SAVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from helpers import batch, fresh, loss_of
    from minioffload.devices import device
    from minioffload.train import checkpoint
    with device("sim") as dev:
        model, opt = fresh(dev)
        for k in range(1000):
            loss_of(model, *batch(100 * k)).backward()
            opt.step()
            opt.zero_grad()
            checkpoint.save(sys.argv[1], model, opt, extra={"step": k + 1})
            print(k + 1, flush=True)
""")


def test_a_saver_killed_at_any_point_leaves_one_whole_step(tmp_path):
    """SIGKILL at spread-out moments of a loop that saves every step over the same directory: what loads is always
    one step, whole (the masters of exactly the step it says)."""
    path = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIOFFLOAD_SIM_STRICT": "1"}
    seen = set()
    for delay in (0.0, 0.07):
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(ROOT / "tests")], env=env,
                                 stdout=subprocess.PIPE, text=True)
        assert saver.stdout.readline()  # one save committed
        time.sleep(delay)
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        seen.add(assert_whole_step(path, set(range(1, 1001))))
    assert seen
