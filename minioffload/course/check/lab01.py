"""Graders for Lab 1, "The memory wall": each compares a learner's function with `minioffload.memory`."""

from __future__ import annotations

import math
from collections.abc import Callable

from ... import memory, profiles
from .grading import grader

# GPU and host sizes of the course's hardware table (profiles.PRESETS), smallest first.
GPU_BYTES = sorted({hw.device_memory for hw in profiles.PRESETS.values()})
HOST_BYTES = sorted({hw.host_memory for hw in profiles.PRESETS.values()})


@grader("1.1")
def bytes_per_param(fn: Callable) -> str:
    """fn(precision, optimizer) -> bytes per parameter with everything on the device."""
    for precision in memory.PRECISIONS:
        for optimizer in memory.OPTIMIZERS:
            expected = memory.footprint(precision, optimizer, "device")
            got = fn(precision, optimizer)
            parts = " + ".join(f"{p.name} {p.bytes_per_param}" for p in expected.parts)
            assert got == expected.per_param(), (
                f"bytes_per_param({precision!r}, {optimizer!r}) returned {got!r}, "
                f"expected {expected.per_param()} ({parts})")
    return (f"all {len(memory.PRECISIONS) * len(memory.OPTIMIZERS)} precision x optimizer pairs match; "
            f"mixed-precision Adam = {fn('mixed_bf16', 'adam')} B/param")


ACTIVATION_CASES = [  # (seq_len, batch_size, hidden, num_heads)
    (1024, 1, 768, 12), (2048, 8, 4096, 32), (128, 64, 512, 8), (4096, 2, 12288, 96), (1, 1, 64, 1),
]


@grader("1.2")
def activation_bytes(fn: Callable) -> str:
    """fn(seq_len, batch_size, hidden, num_heads, checkpointing) -> bytes per layer."""
    for case in ACTIVATION_CASES:
        for checkpointing in (False, True):
            expected = memory.activation_bytes_per_layer(*case, checkpointing=checkpointing)
            got = fn(*case, checkpointing)
            assert got == expected, (
                f"activation_bytes{(*case, checkpointing)} returned {got!r}, expected {expected} "
                f"({'2*s*b*h' if checkpointing else '34*s*b*h + 5*a*s^2*b'})")
    big = ACTIVATION_CASES[1]
    ratio = fn(*big, False) / fn(*big, True)
    return f"{2 * len(ACTIVATION_CASES)} cases match; checkpointing saves {ratio:.0f}x at s=2048, h=4096"


@grader("1.3")
def largest_model(fn: Callable) -> str:
    """fn(gpu_bytes, precision, placement) -> the largest whole number of parameters that fits."""
    for gpu_bytes in GPU_BYTES:
        for precision in memory.PRECISIONS:
            for placement in ("device", "optimizer_cpu"):
                fp = memory.footprint(precision, "adam", placement)
                expected = math.floor(memory.max_params_that_fit(gpu_bytes, fp))
                got = fn(gpu_bytes, precision, placement)
                assert isinstance(got, int), f"return a whole number of parameters (int), got {got!r}"
                assert got == expected, (
                    f"largest_model({gpu_bytes / memory.GB:.0f} GB, {precision!r}, {placement!r}) returned "
                    f"{got:,}, expected {expected:,} ({fp.per_param('device')} B/param on the device)")
    h100 = profiles.preset("h100-sxm")
    best = fn(h100.device_memory, "mixed_bf16", "optimizer_cpu")
    return (f"all cases match; with the optimizer on the CPU the {h100.name} ({h100.device_memory / memory.GB:.0f} GB) "
            f"holds {best / 1e9:.0f}B parameters")


@grader("1.4")
def first_placement(fn: Callable) -> str:
    """fn(num_params, device_bytes, host_bytes) -> the least offloaded placement that fits, or None (the host
    bytes the engine allocates: `memory.footprint`)."""
    cases = 0
    for name, num_params in {**memory.MODELS, "70B": 70e9}.items():
        for gpu_bytes in GPU_BYTES:
            for host_bytes in (None, *HOST_BYTES):
                expected = memory.first_placement_that_fits(num_params, gpu_bytes, host_bytes=host_bytes)
                got = fn(num_params, gpu_bytes, host_bytes)
                host = "unbounded" if host_bytes is None else f"{host_bytes / memory.GiB:.0f} GiB"
                assert got == expected, (
                    f"{name} on a {gpu_bytes / memory.GB:.0f} GB GPU with host memory {host}: "
                    f"returned {got!r}, expected {expected!r} (host bytes per parameter of each placement: "
                    + ", ".join(f"{p} {memory.footprint('mixed_bf16', 'adam', p).per_param('host')}"
                                for p in memory.PLACEMENTS) + ")")
                cases += 1
    return f"{cases} model x GPU x host cases match"
