"""Graders for Lab 6, "Past host memory": aligned block I/O with O_DIRECT (6.1), the crash-safe commit of a new
version (6.2), the three-stage read-update-write pipeline (6.3), and the bytes per tier with the optimizer state on
NVMe (6.4).

Task 6.1 runs on a real file in a temporary folder under the current directory (not /tmp, which may be tmpfs,
where O_DIRECT is refused), opened with O_DIRECT where the filesystem allows it. It also logs every positioned
read and write, so that a call O_DIRECT refuses with EINVAL, or would refuse, is named with the rule it breaks.

Task 6.2 (the commit under simulated power cuts) is graded in lab06_commit.py, Task 6.3 (the pipeline) in
lab06_pipeline.py; they share this module's scratch folder and patching helpers. Task 6.4 adds up the parts of
`memory.footprint` tier by tier, so that this file does not hold the task's answer.
Verdicts carry counts and sizes, never timings, so they are the same on every run.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...pinned import ALIGNMENT, aligned_empty
from ...predict.memory import GB, MODELS, PRECISIONS, TIERS, footprint
from .grading import grader


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _direct_works(directory: Path) -> bool:
    """Whether this filesystem accepts an O_DIRECT write of one aligned page (tmpfs and some others refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [memoryview(aligned_empty(ALIGNMENT, pin=False).numpy())], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@contextmanager
def _scratch() -> Iterator[tuple[Path, bool]]:
    """A temporary folder on the current directory's filesystem (the system's if O_DIRECT works only there),
    removed afterwards, and whether O_DIRECT works in it."""
    folder, direct = None, False
    for parent in (os.getcwd(), tempfile.gettempdir()):
        try:
            candidate = Path(tempfile.mkdtemp(prefix=".lab06-", dir=parent))
        except OSError:
            continue
        if _direct_works(candidate):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            folder, direct = candidate, True
            break
        if folder is None:
            folder = candidate  # the first writable one, in case no filesystem here takes O_DIRECT
        else:
            shutil.rmtree(candidate, ignore_errors=True)
    assert folder is not None, "the check needs a writable folder: run it from a folder you can write in"
    try:
        yield folder, direct
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _patched(replacements: dict[str, Callable]) -> Iterator[dict[str, Callable]]:
    """Replace os functions for calls from this thread only; other threads get the real ones."""
    real = {name: getattr(os, name) for name in replacements}
    owner = threading.get_ident()

    def route(name: str) -> Callable:
        def call(*args, **kwargs):
            spy = replacements[name] if threading.get_ident() == owner else real[name]
            return spy(*args, **kwargs)
        return call

    try:
        for name in replacements:
            setattr(os, name, route(name))
        yield real
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


def _first_difference(a: bytes, b: bytes) -> int:
    same = np.frombuffer(a[:len(b)], np.uint8) == np.frombuffer(b[:len(a)], np.uint8)
    return int(np.argmin(same)) if not same.all() else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# Task 6.1: aligned block I/O

BLOCK_CASES = (  # (block_size, nbytes): four multiples of 4096, the rest with a partial last page
    (16384, 1), (16384, 1000), (16384, 4096), (16384, 4097), (16384, 16384), (16384, 16384 + 5000),
    (16384, 3 * 16384), (16384, 5 * 16384 + 123), (4096, 12345), (65536, 3 * 65536), (65536, 200_000),
)
POSITIONED = ("pwritev", "preadv", "pwrite", "pread")


@dataclass
class _Call:
    name: str
    offset: int | None
    buffers: list[tuple[int | None, int]]  # (address or None if unknown, length) per buffer

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.buffers)


def _buffer(buffer) -> tuple[int | None, int]:
    try:
        view = memoryview(buffer)
    except TypeError:
        return None, 0
    if not view.c_contiguous:
        return None, view.nbytes
    if view.nbytes == 0:
        return 0, 0
    return int(np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                             np.uint8).ctypes.data), view.nbytes


def _record(name: str, args: tuple, kwargs: dict) -> _Call:
    if name in ("pwritev", "preadv"):
        buffers = args[1] if len(args) > 1 else kwargs.get("buffers", [])
        offset = args[2] if len(args) > 2 else None
        return _Call(name, offset, [_buffer(b) for b in buffers])
    if name == "pwrite":
        return _Call(name, args[2] if len(args) > 2 else None, [_buffer(args[1])])
    return _Call(name, args[2] if len(args) > 2 else None, [(None, args[1] if len(args) > 1 else 0)])  # pread


def _broken_rule(call: _Call, block_size: int, nbytes: int) -> str | None:
    """Which O_DIRECT rule (or block rule) a call breaks, said so that a learner can fix it; None if none."""
    where = f"os.{call.name} at offset {call.offset}"
    if call.name == "pread":
        return (f"{where}: os.pread returns a new bytes object, which is not page-aligned memory: read with "
                "os.preadv into the buffer (or into an aligned bounce buffer)")
    if any(address is None or address % ALIGNMENT for address, _ in call.buffers):
        return (f"{where} was given memory at an address that is not a multiple of {ALIGNMENT}: O_DIRECT moves "
                "whole pages from aligned memory. A bytes object, a bytearray or a slice that starts inside a page "
                "is not aligned; use a slice of the buffer at a block offset, or an aligned bounce buffer "
                "(aligned_empty)")
    if call.nbytes % ALIGNMENT:
        action = ("padded with zeros" if call.name.startswith("pwrite") else
                  "then copy only the bytes that belong to the data out of it")
        return (f"{where} moved {call.nbytes} bytes, not a multiple of {ALIGNMENT}: the partial last block must "
                f"go through an aligned bounce buffer of padded(length) bytes, {action}")
    if call.offset is None or call.offset % ALIGNMENT:
        return f"{where}: file offsets must be multiples of {ALIGNMENT}: blocks start at 0, block_size, ..."
    if call.nbytes > block_size:
        return (f"{where} moved {call.nbytes} bytes in one call: move one block per call, at most block_size "
                f"({block_size}) bytes")
    if call.offset + call.nbytes > _padded(nbytes):
        return f"{where} moved {call.nbytes} bytes, past the padded end of the data ({_padded(nbytes)} bytes)"
    return None


def _run_blocks(fn: Callable, write: bool, path: Path, direct: bool, buffer: memoryview, nbytes: int,
                block_size: int, what: str) -> list[_Call]:
    """Run one write or read on an fd the grader opens (with O_DIRECT if it can); return the positioned calls."""
    calls: list[_Call] = []

    def spy(name: str) -> Callable:
        def call(*args, **kwargs):
            calls.append(_record(name, args, kwargs))
            return real[name](*args, **kwargs)
        return call

    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    try:
        with _patched({name: spy(name) for name in POSITIONED}) as real:
            fn(write, fd, buffer, nbytes, block_size)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        broken = next((rule for c in calls if (rule := _broken_rule(c, block_size, nbytes))), None)
        raise AssertionError(f"{what}: O_DIRECT refused a call with EINVAL (invalid argument). "
                             + (broken or f"Every buffer address, length and file offset must be a multiple of "
                                f"{ALIGNMENT}; read and write with os.preadv/os.pwritev on aligned memory")) from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    for c in calls:
        rule = _broken_rule(c, block_size, nbytes)
        assert rule is None, f"{what}: {rule}"
    return calls


def _require_calls(calls: list[_Call], write: bool, what: str) -> None:
    wanted = "os.pwritev(fd, [chunk], offset)" if write else "os.preadv(fd, [chunk], offset)"
    assert calls, f"{what}: no positioned read or write was seen: use {wanted}, called through the os module"


def _aligned(nbytes: int, fill: int | bytes) -> np.ndarray:
    array = aligned_empty(_padded(nbytes), pin=False).numpy()
    if isinstance(fill, int):
        array[:] = fill
    else:
        array[:nbytes] = np.frombuffer(fill, np.uint8)
    return array


@grader("6.1", rebuilds=(
    "minioffload.nvme.swapper.Swapper._write_range",
    "minioffload.nvme.swapper.Swapper._read_range",
    "minioffload.nvme.swapper.Swapper.write",
    "minioffload.nvme.swapper.Swapper.read",
))
def block_io(fn: Callable) -> str:
    """fn(write, fd, buffer, nbytes, block_size): write_blocks(fd, buffer, block_size) if write, else
    read_blocks(fd, buffer, nbytes, block_size); buffer is a memoryview of nbytes aligned bytes."""
    rng = random.Random(61)
    with _scratch() as (folder, direct):
        for number, (block_size, nbytes) in enumerate(BLOCK_CASES):
            data = rng.randbytes(nbytes)
            path = folder / f"case{number}"
            what = f"write_blocks({nbytes} bytes, block_size={block_size})"
            source = _aligned(nbytes, data)
            calls = _run_blocks(fn, True, path, direct, memoryview(source)[:nbytes], nbytes, block_size, what)
            stored = path.read_bytes()
            assert len(stored) == _padded(nbytes), (
                f"{what} left a file of {len(stored)} bytes; expected {_padded(nbytes)}, the data padded to a "
                f"multiple of {ALIGNMENT}" + (": the partial last block goes through an aligned bounce buffer, "
                                              "written whole" if len(stored) < _padded(nbytes) else ""))
            if stored[:nbytes] != data:
                at = _first_difference(stored[:nbytes], data)
                raise AssertionError(f"{what}: the file differs from the data from byte {at} on (the block at "
                                     f"offset {at // block_size * block_size})")
            assert not any(stored[nbytes:]), (
                f"{what}: the padding after the data is not zeros: zero the bounce buffer before copying the "
                "partial block in (aligned_empty's memory is not cleared), or stale bytes end up on the drive")
            _require_calls(calls, True, what)

            what = f"read_blocks({nbytes} bytes, block_size={block_size})"
            path.write_bytes(data + b"\xee" * (_padded(nbytes) - nbytes))  # padding that must not come back
            into = _aligned(nbytes, 0xAB)
            calls = _run_blocks(fn, False, path, direct, memoryview(into)[:nbytes], nbytes, block_size, what)
            got = into[:nbytes].tobytes()
            if got != data:
                at = _first_difference(got, data)
                last = (nbytes - 1) // block_size * block_size
                hint = (": the partial last block is read padded into a bounce buffer, then its first "
                        "nbytes - offset bytes are copied into the buffer" if at >= last and nbytes % ALIGNMENT else
                        ": read every block, at offsets 0, block_size, 2 * block_size, ...")
                raise AssertionError(f"{what}: the buffer differs from the file from byte {at} on{hint}")
            _require_calls(calls, False, what)
    multiples = sum(1 for _, n in BLOCK_CASES if n % ALIGNMENT == 0)
    sizes = [n for _, n in BLOCK_CASES]
    blocks = sorted({b for b, _ in BLOCK_CASES})
    return (f"{len(BLOCK_CASES)} sizes from {min(sizes)} B to {max(sizes) // 1024} KiB ({multiples} of them "
            f"multiples of {ALIGNMENT}), blocks of {blocks[0] // 1024}-{blocks[-1] // 1024} KiB: files bit-exact and "
            f"padded with zeros to whole pages, reads bit-exact, every call's address, length and offset a multiple "
            f"of {ALIGNMENT} (the file opened with O_DIRECT where the filesystem allows it)")


# ---------------------------------------------------------------------------------------------
# Task 6.4: bytes per tier with the optimizer state on NVMe


def _from_parts(num_params: float, precision: str, placement: str = "optimizer_nvme") -> dict[str, int]:
    """Bytes on each tier, added up from the footprint's parts (each part's bytes per parameter, on its tier)."""
    totals = dict.fromkeys(TIERS, 0)
    for part in footprint(precision, "adam", placement).parts:
        totals[part.tier] += part.bytes_per_param * round(num_params)
    return totals


def _parts_by_tier(precision: str) -> str:
    parts = footprint(precision, "adam", "optimizer_nvme").parts
    return "; ".join(f"{tier}: " + (" + ".join(f"{p.name} {p.bytes_per_param}" for p in parts if p.tier == tier)
                                    or "nothing") for tier in TIERS)


@grader("6.4", nothing_to_refuse="it composes memory.footprint, as the task asks")
def bytes_per_tier(fn: Callable) -> str:
    """fn(num_params, precision="mixed_bf16") -> {"device": bytes, "host": bytes, "nvme": bytes} with Adam."""
    cases = [(n, None) for n in MODELS.values()] + [(n, p) for n in (1.5e9, 13e9, 175e9) for p in PRECISIONS]
    for num_params, precision in cases:
        call = f"bytes_per_tier({num_params:.3g}" + (")" if precision is None else f", {precision!r})")
        got = fn(num_params) if precision is None else fn(num_params, precision)
        want = _from_parts(num_params, precision or "mixed_bf16")
        assert isinstance(got, dict) and set(got) == set(TIERS), (
            f"{call} returned {got!r:.80}; expected a dict with the three tiers {list(TIERS)}, zeros included")
        if got == want:
            continue
        if got == _from_parts(1, precision or "mixed_bf16"):
            hint = "those are bytes per parameter: Footprint.bytes(num_params, tier) multiplies by the count"
        elif got == _from_parts(num_params, precision or "mixed_bf16", "optimizer_cpu"):
            hint = "that is ZeRO-Offload's placement, the state in host memory: use placement='optimizer_nvme'"
        elif precision is None and got == _from_parts(num_params, "fp32"):
            hint = "the default precision is 'mixed_bf16'"
        else:
            hint = (f"the parts of the footprint, in bytes per parameter: {_parts_by_tier(precision or 'mixed_bf16')} "
                    "(memory.footprint with placement 'optimizer_nvme')")
        raise AssertionError(f"{call} returned {got!r:.100}, expected {want}: {hint}")
    example = fn(MODELS["GPT-3 13B"])
    shown = ", ".join(f"{tier} {example[tier] / GB:.1f} GB" for tier in TIERS)
    return f"{len(cases)} cases match; GPT-3 13B in mixed bf16 with Adam's state on NVMe: {shown}"
