"""The swapper's index commits: writes ready together share one commit, scratch writes (durable=False) commit
nothing of their own, and neither kind loses the other's entries."""

import json
import threading
import time

import torch

import minioffload.nvme.index as index_module
import minioffload.nvme.swapper as swapper_module
from minioffload.nvme.swapper import INDEX, Swapper
from minioffload.pinned import aligned_empty


def filled(numel, value):
    out = aligned_empty(numel * 4, pin=False).view(torch.float32)
    out.fill_(value)
    return out


def on_disk_index(swap):
    return json.loads((swap.directory / INDEX).read_text())


def test_writes_ready_together_share_one_index_commit(tmp_path, monkeypatch):
    commits = []
    original = Swapper._commit

    def counting(self, entries):
        commits.append(sorted(entries))
        original(self, entries)

    monkeypatch.setattr(Swapper, "_commit", counting)
    with Swapper(tmp_path) as swap:
        gate = threading.Event()
        swap._commits.submit(gate.wait)  # the commit thread busy: every write's data lands, none is committed yet
        futures = [swap.write(f"k{i}", filled(1024, i)) for i in range(8)]
        deadline = time.monotonic() + 60
        while len(swap._pending) < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(swap._pending) == 8 and not any(f.done() for f in futures)
        gate.set()
        for future in futures:
            future.result()
        assert commits == [[f"k{i}" for i in range(8)]]  # one commit for the eight
        assert sorted(on_disk_index(swap)) == [f"k{i}" for i in range(8)]
        for i in range(8):
            back = filled(1024, -1)
            swap.read(f"k{i}", back).result()
            assert torch.equal(back, filled(1024, i))


def test_a_scratch_write_reads_back_without_a_commit_of_its_own(tmp_path, monkeypatch):
    commits = []
    original = Swapper._commit
    monkeypatch.setattr(Swapper, "_commit", lambda self, entries: (commits.append(sorted(entries)),
                                                                   original(self, entries)))
    fsyncs = []
    with Swapper(tmp_path) as swap:
        swap.write("durable", filled(512, 1.0)).result()
        real_fsync = swapper_module.os.fsync
        monkeypatch.setattr(swapper_module.os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
        swap.write("scratch", filled(512, 2.0), durable=False).result()
        assert fsyncs == [] and commits == [["durable"]]  # no fsync, no index commit
        assert "scratch" not in on_disk_index(swap) and "scratch" in swap.keys()
        back = filled(512, 0.0)
        swap.read("scratch", back).result()  # checksummed like any read
        assert torch.equal(back, filled(512, 2.0))
        # a second scratch version goes to the other slot and replaces the first in memory
        swap.write("scratch", filled(512, 3.0), durable=False).result()
        swap.read("scratch", back).result()
        assert torch.equal(back, filled(512, 3.0))


def test_a_commit_keeps_the_scratch_entries_indexed_while_it_wrote(tmp_path, monkeypatch):
    with Swapper(tmp_path) as swap:
        entered, release = threading.Event(), threading.Event()
        real_dump = index_module.json.dump

        def slow_dump(index, f):  # the commit has read the index: a scratch write lands before it is replaced
            entered.set()
            release.wait(60)
            real_dump(index, f)

        monkeypatch.setattr(index_module.json, "dump", slow_dump)
        durable = swap.write("state", filled(256, 1.0))
        assert entered.wait(60)
        swap.write("grad", filled(256, 2.0), durable=False).result()
        release.set()
        durable.result()
        assert {"state", "grad"} <= set(swap.keys())
        back = filled(256, 0.0)
        swap.read("grad", back).result()
        assert torch.equal(back, filled(256, 2.0))
