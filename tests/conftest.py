"""The test suite runs the simulated device in strict mode: it behaves as a GPU punishes mistakes (device memory
from empty() is NaN until written), so a test that passes here does not pass by the sim's kindness.

Shared fixtures live here; shared helpers (the toy model, its batches, the training loop) in `helpers.py`."""

import os

os.environ.setdefault("MINIOFFLOAD_SIM_STRICT", "1")  # before anything imports minioffload

import shutil  # noqa: E402
import subprocess  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from minioffload.devices import device  # noqa: E402

# Property tests draw the same examples on every run: the suite passes or fails by the code, not by the draw (a rare
# input that breaks a property is found by running them with HYPOTHESIS_PROFILE=explore, then kept as an example).
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture
def sim():
    """A fresh sim device (strict, as the whole suite runs), closed after the test."""
    with device("sim") as dev:
        yield dev


@pytest.fixture
def fake_cudart(monkeypatch):
    """Pinned memory as on a CUDA machine, with a fake cudart (helpers.FakeCudart) recording what is locked."""
    import torch
    from helpers import FakeCudart

    from minioffload import pinned

    cudart = FakeCudart()
    monkeypatch.setattr(pinned, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)  # torch's own answer on a CPU-only build
    return cudart


# a real file system to fill: the swapper's and the checkpoints' full-disk tests
def _can_mount() -> str | None:
    if os.geteuid() != 0:
        return "needs root to loop-mount a file system"
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        return "needs mkfs.ext4 and mount"
    return None


@pytest.fixture
def small_ext4(tmp_path):
    """A 24 MiB ext4 file system, mounted at a fresh directory; unmounted and removed after the test."""
    reason = _can_mount()
    if reason:
        pytest.skip(reason)
    image, mountpoint = tmp_path / "fs.img", Path("/mnt") / f"minioffload-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["truncate", "-s", "24M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mountpoint.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], capture_output=True, text=True)
    if mounted.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot loop-mount here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False)
        mountpoint.rmdir()
