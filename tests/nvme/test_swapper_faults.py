"""The swapper under damage: an index that is valid JSON but wrong (fuzzed), files truncated or corrupted, a full
disk (a small ext4 file system, loop-mounted: needs root and mkfs.ext4, as CI has), and a writer killed at random
points. After each fault every committed key reads back verified, or the error names the key and the file."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minioffload.nvme.swapper import INDEX, SwapIOError, Swapper
from minioffload.pinned import aligned_empty

ROOT = Path(__file__).resolve().parents[2]


def tensor(n: int, value: float) -> torch.Tensor:
    t = aligned_empty(4 * n, pin=False).view(torch.float32)
    t.fill_(value)
    return t


def stored(directory: Path, keys=("a", "b")) -> dict:
    """A swap directory holding `keys` (1000 floats each); its index as a dict."""
    with Swapper(directory, direct=False) as swap:
        for i, key in enumerate(keys):
            swap.write(key, tensor(1000, i + 1.0)).result()
    return json.loads((directory / INDEX).read_text())


# ------------------------------------------------------------------------------------------------
# the index: fuzzed content, named errors

ENTRY_FIELDS = ("slot", "nbytes", "dtype", "shape", "checksum")
ODD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True),
                       st.text(max_size=8), st.lists(st.integers(-2, 2000), max_size=3),
                       st.sampled_from(["torch.float32", "torch.complex64", "float32"]), st.builds(dict))


@st.composite
def damaged_indexes(draw, good: dict):
    index = json.loads(json.dumps(good))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "drop", "entry", "whole", "key"]))
        key = draw(st.sampled_from(sorted(index))) if isinstance(index, dict) and index else None
        if kind == "field" and key is not None and isinstance(index[key], dict):
            index[key][draw(st.sampled_from(ENTRY_FIELDS))] = draw(ODD_VALUES)
        elif kind == "drop" and key is not None and isinstance(index[key], dict):
            index[key].pop(draw(st.sampled_from(ENTRY_FIELDS)), None)
        elif kind == "entry" and key is not None:
            index[key] = draw(ODD_VALUES)
        elif kind == "key" and isinstance(index, dict):
            index[draw(st.text(min_size=1, max_size=5))] = json.loads(json.dumps(good["a"]))
        elif kind == "whole":
            index = draw(st.one_of(ODD_VALUES, st.lists(st.integers(), max_size=2)))
    return index


@pytest.fixture(scope="module")
def good_store(tmp_path_factory):
    directory = tmp_path_factory.mktemp("good")
    return directory, stored(directory)


# derandomized for a repeatable CI; random seeds found the unhashable-dtype case, now handled, and nothing more
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_index_is_refused_naming_what_is_wrong(good_store, tmp_path_factory, data):
    source, good = good_store
    directory = tmp_path_factory.mktemp("damaged")
    for file in source.iterdir():
        shutil.copy(file, directory)
    index = data.draw(damaged_indexes(good))
    (directory / INDEX).write_text(json.dumps(index))
    try:
        swap = Swapper(directory, direct=False)
    except SwapIOError as err:
        assert str(directory / INDEX) in str(err) and ("restore" in str(err))
        if isinstance(index, dict) and err.key:
            assert repr(err.key) in str(err)
        return
    with swap:  # accepted: then every key reads back verified or names itself
        for key, entry in swap.index.items():
            buffer = aligned_empty(max(entry["nbytes"], 4), pin=False).view(torch.uint8)[:entry["nbytes"]]
            try:
                swap.read(key, into=buffer.view(getattr(torch, entry["dtype"].split(".")[1]))).result()
            except (SwapIOError, ValueError) as err:
                assert repr(key) in str(err)


def test_missing_and_truncated_files_name_the_key_and_the_file(tmp_path):
    index = stored(tmp_path)
    file_a = tmp_path / f"a.{index['a']['slot']}"
    os.truncate(file_a, 100)
    with pytest.raises(SwapIOError, match=rf"damaged at key 'a': its file {file_a} is truncated: 100 bytes"):
        Swapper(tmp_path, direct=False)
    file_a.unlink()
    with pytest.raises(SwapIOError, match=rf"key 'a': its file {file_a} is missing"):
        Swapper(tmp_path, direct=False)
    (tmp_path / INDEX).write_text(json.dumps({"a": {k: v for k, v in index["a"].items() if k != "dtype"}}))
    with pytest.raises(SwapIOError, match="key 'a': its entry lacks dtype"):
        Swapper(tmp_path, direct=False)


def test_a_short_read_is_named_as_one(tmp_path):
    stored(tmp_path)
    with Swapper(tmp_path, direct=False) as swap:
        os.truncate(tmp_path / f"a.{swap.index['a']['slot']}", 0)  # truncated after the index was checked
        with pytest.raises(SwapIOError, match=r"short read of 'a' .*shorter than the index says"):
            swap.read("a", into=tensor(1000, 0.0)).result()


# ------------------------------------------------------------------------------------------------
# a real file system: full disk, killed writers

def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def test_a_full_disk_gives_its_space_back_and_keeps_every_previous_version(small_ext4):
    swap_dir = small_ext4 / "swap"
    swap_dir.mkdir()
    filler = small_ext4 / "filler"
    mib = 1 << 18  # floats in 1 MiB
    with Swapper(swap_dir) as swap:
        for i in range(4):
            swap.write(f"k{i}", tensor(mib, float(i))).result()  # 4 keys of 1 MiB
        # fill the disk to leave ~1.5 MiB: a new 4 MiB key cannot fit
        with open(filler, "wb") as f:
            f.write(b"\0" * (free_bytes(small_ext4) - (3 << 19)))
            f.flush()
            os.fsync(f.fileno())
        before = free_bytes(small_ext4)
        with pytest.raises(SwapIOError, match="'big'.*the disk is full.*previous version is intact"):
            swap.write("big", tensor(4 * mib, 9.0)).result()
        assert free_bytes(small_ext4) >= before - 64 * 1024, "the failed write kept space"
        assert not list(swap_dir.glob("big.*")) and not list(swap_dir.glob(f".{INDEX}.tmp"))
        for i in range(4):  # every previous version reads back, verified
            assert torch.equal(swap.read(f"k{i}", into=tensor(mib, -1.0)).result(), tensor(mib, float(i)))
        # rewrites of existing keys need at most their second slot's space: fill what is left, then rewrite
        filler.unlink()
        for i in range(4):
            swap.write(f"k{i}", tensor(mib, 10.0 + i)).result()
        swap.write("big", tensor(4 * mib, 9.0)).result()  # space freed: the write that failed now succeeds
    with Swapper(swap_dir) as again:  # and the index on disk says the same
        assert torch.equal(again.read("big", into=tensor(4 * mib, 0.0)).result(), tensor(4 * mib, 9.0))
        assert torch.equal(again.read("k3", into=tensor(mib, 0.0)).result(), tensor(mib, 13.0))


WRITER = textwrap.dedent("""
    import sys, torch
    from minioffload.nvme.swapper import Swapper
    from minioffload.pinned import aligned_empty
    swap = Swapper(sys.argv[1])
    version = 0
    while True:
        version += 1
        for key in ("x", "y", "z"):
            t = aligned_empty(4 * 300_000, pin=False).view(torch.float32)
            t.fill_(version)
            swap.write(key, t).result()
        print(version, flush=True)
""")


def test_a_writer_killed_at_any_point_leaves_every_committed_key_readable(small_ext4):
    swap_dir = small_ext4 / "killed"
    swap_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    delays = (0.0, 0.05, 0.13, 0.31, 0.57)
    for delay in delays:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(swap_dir)], env=env, stdout=subprocess.PIPE,
                                  text=True)
        assert writer.stdout.readline()  # one full version committed
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        with Swapper(swap_dir) as swap:  # the index checks out on open
            for key in ("x", "y", "z"):
                value = swap.read(key, into=tensor(300_000, -1.0)).result()  # verified against its checksum
                assert torch.all(value == value[0]) and value[0] >= 1
