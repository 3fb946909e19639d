"""The NVMe swapper: bit-exact round trips, concurrency, crash safety, integrity, full disks, bad input."""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from minioffload.nvme.swapper import SwapIOError, Swapper
from minioffload.pinned import aligned_empty

ROOT = Path(__file__).resolve().parents[2]


def buffer(numel, dtype=torch.float32):
    return aligned_empty(numel * torch.empty(0, dtype=dtype).element_size(), pin=False).view(dtype)


def filled(numel, dtype=torch.float32, seed=0):
    out = buffer(numel, dtype)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        out.copy_(torch.randn(numel, generator=g).to(dtype))
    else:
        out.copy_(torch.randint(-1000, 1000, (numel,), generator=g).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("numel", [1, 1023, 2048, (1 << 16) + 3])
def test_round_trip_is_bit_exact(tmp_path, dtype, numel):
    with Swapper(tmp_path, block_size=8192, workers=3) as swap:
        data = filled(numel, dtype)
        swap.write("t", data).result()
        back = buffer(numel, dtype)
        swap.read("t", into=back).result()
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8))


def test_many_concurrent_keys_and_overwrites(tmp_path):
    with Swapper(tmp_path, block_size=4096, workers=4) as swap:
        first = {f"k{i}": filled(5000 + 97 * i, seed=i) for i in range(16)}
        futures = [swap.write(k, v) for k, v in first.items()]
        second = {k: filled(v.numel(), seed=100 + i) for i, (k, v) in enumerate(first.items())}
        futures += [swap.write(k, v) for k, v in second.items()]  # queued behind the first write of each key
        for f in futures:
            f.result()
        reads = {k: buffer(v.numel()) for k, v in second.items()}
        for f in [swap.read(k, into=reads[k]) for k in reads]:
            f.result()
        assert all(torch.equal(reads[k], second[k]) for k in reads)
        assert sorted(swap.keys()) == sorted(first)
    reopened = Swapper(tmp_path)  # the index on disk knows every key
    back = buffer(first["k3"].numel())
    reopened.read("k3", into=back).result()
    assert torch.equal(back, second["k3"])
    reopened.close()


def test_a_flipped_byte_is_detected(tmp_path):
    with Swapper(tmp_path, block_size=4096) as swap:
        swap.write("w", filled(3000)).result()
        path = tmp_path / f"w.{swap.index['w']['slot']}"
    with open(path, "r+b") as f:
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 0x10]))
    with Swapper(tmp_path) as swap:
        with pytest.raises(SwapIOError, match=r"checksum mismatch reading 'w' from .*w\.0"):
            swap.read("w", into=buffer(3000)).result()
    with Swapper(tmp_path, verify=False) as swap:
        swap.read("w", into=buffer(3000)).result()  # unchecked reads are the caller's choice


def _child(script: str, tmp_path: Path, **kwargs) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from minioffload.nvme.swapper import Swapper, SwapIOError
        from minioffload.pinned import aligned_empty
        swap = Swapper({str(tmp_path)!r}, block_size=1 << 16, workers=2)
        def make(numel, value):
            t = aligned_empty(numel * 4, pin=False).view(torch.float32)
            t.fill_(value)
            return t
    """) + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_a_writer_killed_mid_write_leaves_the_previous_version(tmp_path):
    child = _child("""
        swap.write("state", make(1 << 20, 1.0)).result()
        print("committed", flush=True)
        big = make(1 << 20, 2.0)
        while True:                           # rewrite until killed: some kill lands mid-write
            swap.write("state", big).result()
            big.add_(1.0)
    """, tmp_path)
    assert child.stdout.readline().strip() == "committed"
    time.sleep(0.3)
    child.send_signal(signal.SIGKILL)
    child.wait()
    with Swapper(tmp_path) as swap:
        back = buffer(1 << 20)
        swap.read("state", into=back).result()  # verified against the checksum of the indexed version
    assert back.min() == back.max() and float(back[0]) >= 1.0


def test_a_full_disk_raises_and_keeps_the_previous_version(tmp_path):
    limit = 3 << 20

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write(), not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    child = _child("""
        swap.write("state", make(1 << 18, 1.0)).result()     # 1 MiB: fits
        try:
            swap.write("state", make(1 << 20, 2.0)).result() # 4 MiB: past the limit
        except SwapIOError as err:
            print("refused:", err.key, type(err.cause).__name__, err.cause.errno)
    """, tmp_path, preexec_fn=limit_file_size)
    out, err = child.communicate(timeout=60)
    assert "refused: state OSError 27" in out, err  # EFBIG
    with Swapper(tmp_path) as swap:
        back = buffer(1 << 18)
        swap.read("state", into=back).result()
    assert bool((back == 1.0).all())


def test_bad_input_is_refused_before_any_io(tmp_path):
    with Swapper(tmp_path) as swap:
        data = filled(4096)
        swap.write("a", data).result()
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(ValueError, match="not 4096-byte aligned"):
            swap.write("b", data[1:])
        with pytest.raises(ValueError, match="not contiguous"):
            swap.write("b", data.view(64, 64).T)
        with pytest.raises(KeyError, match="no tensor stored under 'nope'"):
            swap.read("nope", into=buffer(4096))
        with pytest.raises(ValueError, match="holds 16384 bytes of torch.float32"):
            swap.read("a", into=buffer(2048))
        with pytest.raises(ValueError, match="holds 16384 bytes of torch.float32"):
            swap.read("a", into=buffer(4096, torch.int32))
        assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(FileNotFoundError, match="does not exist: create it first"):
        Swapper(tmp_path / "missing")
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4096"):
        Swapper(tmp_path, block_size=1000)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            Swapper(tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_a_filesystem_without_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch):
    import errno

    import minioffload.nvme.swapper as nvme

    real_open = os.open

    def no_direct(path, flags, *args):  # what tmpfs on older kernels and some filesystems answer
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(nvme.os, "open", no_direct)
    with pytest.warns(UserWarning, match="O_DIRECT refused"):
        swap = Swapper(tmp_path)
    assert not swap.direct
    data = filled(5000)
    swap.write("x", data).result()
    back = buffer(5000)
    swap.read("x", into=back).result()
    swap.close()
    assert torch.equal(back, data)


def test_an_unwritable_directory_is_named_with_the_fix(tmp_path, monkeypatch):
    import minioffload.nvme.swapper as nvme

    monkeypatch.setattr(nvme.os, "access", lambda path, mode: False)  # as root (CI) every directory is writable
    with pytest.raises(PermissionError, match=f"swap directory {tmp_path} is not writable by this user"):
        Swapper(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_files_checksum_read_in_chunks_is_its_bytes_checksum(tmp_path):
    from minioffload.kernels.checksum import checksum, file_checksum

    values = torch.arange(10_000, dtype=torch.float32)
    (tmp_path / "f").write_bytes(values.numpy().tobytes())
    assert file_checksum(tmp_path / "f", chunk=1000) == file_checksum(tmp_path / "f") == checksum(values)
    (tmp_path / "g").write_bytes(values.numpy().tobytes()[:-1] + b"\x01")
    assert file_checksum(tmp_path / "g", chunk=1000) != checksum(values)


def test_a_read_buffer_dies_with_its_last_reference_not_at_the_next_collection(tmp_path):
    """A future holds its read's buffer as its result; nothing else may keep the future alive (a cycle through its own
    done-callback did): pinned buffers read into are freed as soon as the caller drops them."""
    import gc
    import weakref

    swapper = Swapper(tmp_path, max_bandwidth=1e6)  # 4 ms a read: still running when its callbacks are added
    swapper.write("key", filled(1024)).result()
    gc.disable()
    try:
        into = buffer(1024)
        future = swapper.read("key", into=into)
        future.result()
        alive = weakref.ref(into)
        del into, future
        deadline = time.perf_counter() + 5  # the swapper's thread may still be leaving the function that read it
        while alive() is not None and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert alive() is None  # with the collector off, a cycle would keep it for good
    finally:
        gc.enable()
        swapper.close()
