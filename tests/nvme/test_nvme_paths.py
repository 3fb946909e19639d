"""Multi-path NVMe (MultiPathSwapper) and the Swapper features it and the checkpoints lean on: the software throttle
that models a slower path, hard-linked slot files, current_file. The same weights as one path, a placement that is
proportional and the same in every process, a bound on requests in flight, and a path lost mid-run named."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import HYPER, Toy, on_sim, train
from hypothesis import given, settings
from hypothesis import strategies as st

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.nvme import multipath as nvme_paths
from minioffload.nvme.multipath import MultiPathSwapper, chairman_assignment
from minioffload.nvme.swapper import SwapIOError, Swapper
from minioffload.pinned import aligned_empty

FAST = 1 << 30  # bytes/s: throttles that cost a test nothing but are still in force
SLOW = 256 << 20


def tensor(numel: int, fill: float = 0.0) -> torch.Tensor:
    return aligned_empty(numel * 4, pin=False).view(torch.float32).fill_(fill)


def directories(tmp_path: Path, *names: str) -> list[Path]:
    for name in names:
        (tmp_path / name).mkdir()
    return [tmp_path / name for name in names]


def trained(swapper=None, steps=3, order="alternate", clip=0.5, use_side=lambda step: step % 2 == 1):
    """(losses, masters, weights) of the seeded Toy trained on the sim device, its state on `swapper` if given."""
    torch.manual_seed(0)
    model = Toy()
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=clip,
                          swapper=swapper, nvme_order=order, **HYPER)
        losses = train(model, opt, steps, micro_batches=2, use_side=use_side)
        masters = [m.clone() for m in opt.master_weights()]
    return losses, masters, [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True))


# the same training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["forward", "alternate"])
def test_multi_path_trains_exactly_like_one_path(tmp_path, order):
    one, fast, slow = directories(tmp_path, "one", "fast", "slow")
    with Swapper(one, block_size=8192, workers=2) as single:
        reference = trained(single, order="forward")
    paths = [Swapper(fast, block_size=8192, workers=2), Swapper(slow, block_size=8192, workers=2, max_bandwidth=SLOW)]
    with MultiPathSwapper(paths, bandwidths=[2, 1], in_flight=2) as multi:
        assert same(trained(multi, order=order), reference)
        assert same(trained(), reference)  # and the host tier
        for path, swapper in enumerate(paths):  # every subgroup's three tensors on its own path, and only there
            assert swapper.keys() and all(multi.path_of(key) == path for key in swapper.keys())
        assert sorted(multi.keys()) == sorted(single.keys())


# placement -----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6))
def test_every_prefix_of_the_placement_is_within_one_subgroup_of_its_share(bandwidths):
    shares = [b / sum(bandwidths) for b in bandwidths]
    placed = chairman_assignment(shares, 200)
    counts = [0] * len(shares)
    bound = 1 - 1 / (2 * len(shares) - 2) if len(shares) > 1 else 0
    for n, path in enumerate(placed, start=1):
        counts[path] += 1
        assert all(abs(share * n - count) <= bound + 1e-9 for share, count in zip(shares, counts, strict=True))


def test_placement_is_proportional_and_keeps_a_subgroup_together():
    paths = [SlowPath(), SlowPath(), SlowPath()]
    multi = MultiPathSwapper(paths, bandwidths=[3, 1, 2])
    placed = multi.assignment(60)
    assert [placed.count(p) for p in range(3)] == [30, 10, 20]
    for n in range(60):
        assert {multi.path_of(f"subgroup{n}/{name}") for name in ("master", "exp_avg", "exp_avg_sq")} == {placed[n]}
    assert multi.assignment(60) == placed and MultiPathSwapper(paths, bandwidths=[6, 2, 4]).assignment(60) == placed
    other = [multi.path_of(f"extra{n}/x") for n in range(300)]  # other keys: by a hash, in about the same shares
    assert all(abs(other.count(p) / 300 - share) < 0.1 for p, share in enumerate(multi.shares))
    multi.close()


def test_placement_is_the_same_in_another_process(tmp_path):
    keys = [f"subgroup{n}/master" for n in range(40)] + [f"extra{n}/x" for n in range(40)]
    code = ("import sys; from minioffload.nvme.multipath import MultiPathSwapper\n"
            "class P:\n    index = {}; trace = None\n    def write(self): pass\n    def read(self): pass\n"
            f"m = MultiPathSwapper([P(), P()], bandwidths=[2.5, 1.0])\nprint([m.path_of(k) for k in {keys!r}])")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    here = MultiPathSwapper([SlowPath(), SlowPath()], bandwidths=[2.5, 1.0])
    assert out.strip() == str([here.path_of(key) for key in keys])


def test_measured_bandwidths_are_recorded_and_a_restarted_run_finds_its_files(tmp_path, monkeypatch):
    fast, slow = directories(tmp_path, "fast", "slow")

    def paths():
        return [Swapper(fast, block_size=8192), Swapper(slow, block_size=8192, max_bandwidth=2 << 20)]

    with MultiPathSwapper(paths(), measure_bytes=256 << 10) as first:  # measured: the throttled path is slower
        assert first.bandwidths[1] < first.bandwidths[0]
        written = {f"subgroup{n}/master": tensor(1000, n) for n in range(8)}
        for future in [first.write(key, t) for key, t in written.items()]:
            future.result()
        placed = first.assignment(8)
    assert not (fast / ".minioffload-measure").exists() and (fast / nvme_paths.RECORD).exists()  # no scratch left

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again: the placement could move")

    monkeypatch.setattr(nvme_paths, "measure", no_measuring)
    with MultiPathSwapper(paths()) as again:  # a new run over the same directories
        assert again.bandwidths == first.bandwidths and again.assignment(8) == placed
        for key, t in written.items():
            assert torch.equal(again.read(key, into=tensor(1000)).result(), t)
    with pytest.raises(ValueError, match="placed with bandwidths .* Pass bandwidths=None"):
        MultiPathSwapper(paths(), bandwidths=[1, 1])
    with pytest.raises(ValueError, match="written for other paths .* in its order"):
        MultiPathSwapper(paths()[::-1])


# the throttle, the bound on requests ---------------------------------------------------------------------
def test_a_throttled_swapper_takes_at_least_nbytes_over_its_bandwidth(tmp_path):
    numel, bandwidth = 1 << 14, 4 << 20  # 64 KiB at 4 MiB/s: 15.6 ms a transfer
    data, back = tensor(numel, 1.5), tensor(numel)
    seconds = numel * 4 / bandwidth
    with Swapper(tmp_path, block_size=8192, max_bandwidth=bandwidth) as swap:
        start = time.perf_counter()
        swap.write("a", data).result()
        wrote = time.perf_counter()
        swap.read("a", into=back).result()
        read = time.perf_counter()
        both = [swap.write("b", data), swap.write("c", data)]  # one link: the second waits for the first
        for future in both:
            future.result()
        two = time.perf_counter()
    assert wrote - start >= seconds and read - wrote >= seconds and two - read >= 2 * seconds  # lower bounds only
    assert torch.equal(back, data)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "fast"])
def test_a_bad_bandwidth_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="max_bandwidth must be a positive number of bytes/s"):
        Swapper(tmp_path, max_bandwidth=bad)


class SlowPath:
    """A stand-in path: every request takes 10 ms on a pool of 16 threads, and the most running at once is kept."""

    def __init__(self):
        self.index, self.trace, self.running, self.peak = {}, None, 0, 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(16)

    def _request(self, value):
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(0.01)
        with self._lock:
            self.running -= 1
        return value

    def write(self, key, tensor):
        self.index[key] = {}
        return self._pool.submit(self._request, None)

    def read(self, key, into):
        return self._pool.submit(self._request, into)

    def keys(self):
        return sorted(self.index)

    def close(self):
        self._pool.shutdown()


def test_requests_in_flight_per_path_are_bounded_and_none_is_lost():
    paths = [SlowPath(), SlowPath()]
    multi = MultiPathSwapper(paths, bandwidths=[1, 1], in_flight=3)
    futures = [multi.write(f"subgroup{n}/master", None) for n in range(20)]
    futures += [multi.read(f"subgroup{n}/master", into=n) for n in range(20)]  # reads behind queued writes
    assert [f.result(timeout=10) for f in futures[20:]] == list(range(20))
    assert [p.peak for p in paths] == multi.peak_in_flight and max(multi.peak_in_flight) <= 3
    assert min(multi.peak_in_flight) >= 2  # the paths did run requests side by side
    multi.close()


# hard links and current_file ------------------------------------------------------------------------------
def test_a_hard_linked_slot_file_keeps_its_bytes_when_the_key_is_written_again(tmp_path):
    (tmp_path / "swap").mkdir()
    with Swapper(tmp_path / "swap", block_size=8192) as swap:
        swap.write("k", tensor(3000, 1.0)).result()
        swap.write("k", tensor(3000, 2.0)).result()
        current = swap.current_file("k")
        assert current == tmp_path / "swap" / f"k.{swap.index['k']['slot']}"
        linked_bytes = current.read_bytes()
        os.link(current, tmp_path / "checkpoint.bin")  # what a checkpoint does instead of copying
        for value in (3.0, 4.0):  # the second of these lands in the linked slot
            swap.write("k", tensor(3000, value)).result()
        assert (tmp_path / "checkpoint.bin").read_bytes() == linked_bytes
        assert torch.equal(swap.read("k", into=tensor(3000)).result(), tensor(3000, 4.0))
        assert swap.current_file("k").stat().st_nlink == 1 and swap.keys() == ["k"]
        with pytest.raises(KeyError, match="no tensor stored under 'nothing'"):
            swap.current_file("nothing")


# bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, error, message", [
    (lambda d: MultiPathSwapper([]), ValueError, "non-empty list"),
    (lambda d: MultiPathSwapper(str(d[0])), ValueError, "non-empty list"),
    (lambda d: MultiPathSwapper([d[0], d[0]], bandwidths=[1, 1]), ValueError, "the same directory is given twice"),
    (lambda d: MultiPathSwapper(d, bandwidths=[1]), ValueError, "one positive number per path .2."),
    (lambda d: MultiPathSwapper(d, bandwidths=[1, -1]), ValueError, "one positive number per path"),
    (lambda d: MultiPathSwapper(d, bandwidths=[1, 1], in_flight=0), ValueError, "in_flight must be an int >= 1"),
    (lambda d: MultiPathSwapper([d[0], 3]), TypeError, "a Swapper or a directory, got int"),
    (lambda d: MultiPathSwapper([SlowPath()]), ValueError, "cannot measure a path without a directory"),
    (lambda d: MultiPathSwapper([d[0], d[1] / "missing"], bandwidths=[1, 1]), FileNotFoundError, "does not exist"),
])
def test_bad_paths_are_refused_naming_the_fix(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        make(directories(tmp_path, "a", "b"))


def test_a_read_of_a_key_that_is_not_there_names_its_path(tmp_path):
    with MultiPathSwapper(directories(tmp_path, "a", "b"), bandwidths=[1, 1]) as multi:
        with pytest.raises(KeyError, match=r"no tensor stored under 'subgroup1/master' on path 1 \(.*b\)"):
            multi.read("subgroup1/master", into=tensor(10))


def test_a_path_removed_mid_run_is_named_and_the_state_stays_in_memory(tmp_path):
    torch.manual_seed(0)
    host_model = Toy()
    fast, slow = directories(tmp_path, "fast", "slow")
    with device("sim") as dev:  # the host tier, for what each subgroup holds after two steps
        host = OffloadAdam(on_sim(host_model, dev).parameters(), dev, subgroup_numel=300, **HYPER)
        train(host_model, host, 1, use_side=lambda step: True)
        train(host_model, host, 1, use_side=lambda step: True)
        expected = [sub.buffers["master"].clone() for sub in host.subgroups]
    torch.manual_seed(0)
    model = Toy()
    with device("sim") as dev, MultiPathSwapper([fast, slow], bandwidths=[1, 1], block_size=8192) as multi:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, swapper=multi,
                          nvme_order="alternate", **HYPER)
        train(model, opt, 1, use_side=lambda step: True)
        opt.nvme.drain()
        shutil.rmtree(slow)  # the second path disappears between steps
        with pytest.raises(SwapIOError, match="is gone") as raised:
            train(model, opt, 1, use_side=lambda step: True)
            opt.nvme.drain()
        assert str(slow) in str(raised.value)
        with pytest.raises(SwapIOError, match="is gone"):  # every write that failed is raised, in time
            opt.nvme.drain()
        unsaved = opt.nvme.unsaved
        assert unsaved and all(multi.path_of(f"subgroup{n}/master") == 1 for n in unsaved)
        for n in unsaved:  # the newest state of what could not be written is in its working set, exact
            sub = opt.subgroups[n]
            held = next(i for i, s in enumerate(opt.nvme.holds) if s is sub)
            assert torch.equal(opt.nvme.sets[held]["master"][:sub.numel], expected[n])
        with pytest.raises(SwapIOError, match=re.escape(str(slow))):  # no step goes on with the older state on disk
            train(model, opt, 1, use_side=lambda step: True)
