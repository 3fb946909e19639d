"""Measure this machine: memory bandwidth, copy bandwidth and costs, matmul FLOP/s, CPU Adam rate, disk rates.

`host_memory_bandwidth()` times a large host copy; `adam_roofline()` a kernel with Adam's access pattern.
`copy_bandwidth(dev, ...)` times host<->device copies of a range of sizes from pinned and from pageable
memory, on the sim device (where the result follows its link model, plus the real cost of queuing work) or
on a real GPU (where it is the PCIe or NVLink-C2C link); `copy_costs(dev)` the fixed cost of one small copy.
`matmul_flops()`, `cpu_adam_rate()` and `disk_bandwidth(dir)` time the rest. `profiles.probe()` collects
these into a profile of this machine beside the cited presets of the hardware table.

`fetch_cost`, `pack_cost` and `grad_cost` time what one streamed block, saved tensor or gradient adds to a pass;
`subgroup_cost` what one more subgroup adds to OffloadAdam's step.

What this is not: a benchmark suite. Each function runs a few repeats and reports the median (copies and the per-call
costs: the fastest); `bench/` is where contenders are compared side by side.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable

import numba
import numpy as np
import torch
from numba import prange

from ..units import MiB


def _times(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first touch, allocator, thread start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(fn, repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


def _fastest_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls: for a copy that waits on a clock of its own (the sim's link), other work
    on the host only ever adds time, so the fastest run is the copy itself."""
    return min(_times(fn, repeats))


def host_memory_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """Bytes per second a host-to-host copy moves, counting the read and the write (2 x nbytes per copy)."""
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes} and {repeats}")
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), repeats)


DEFAULT_SIZES = tuple(2**k for k in range(16, 27, 2))  # 64 KiB ... 64 MiB


def copy_bandwidth(dev, sizes: Iterable[int] = DEFAULT_SIZES, pinned: bool = True, direction: str = "h2d",
                   repeats: int = 5) -> list[dict]:
    """One row per size: {"bytes", "direction", "pinned", "seconds", "bytes_per_s"} (the fastest of `repeats`: a
    busy host wakes the waiting thread late and only ever adds time).

    Each timed copy is issued and then waited for (`dev.synchronize()`), so small copies pay the fixed
    cost of a launch, as they do on a GPU.
    """
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    stream = dev.stream(f"bandwidth {direction}")
    rows = []
    for nbytes in sizes:
        if nbytes < 4 or nbytes % 4:
            raise ValueError(f"sizes must be positive multiples of 4 bytes, got {nbytes}")
        host = dev.host_empty(nbytes // 4, pinned=pinned)
        on_device = dev.empty(nbytes // 4, name="bandwidth probe")
        dst, src = (on_device, host) if direction == "h2d" else (host, on_device)

        def one_copy(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
            dev.copy(dst, src, stream)
            dev.synchronize()

        seconds = _fastest_seconds(one_copy, repeats)
        rows.append({"bytes": nbytes, "direction": direction, "pinned": pinned, "seconds": seconds,
                     "bytes_per_s": nbytes / seconds})
        del host, on_device, dst, src, one_copy  # free the device buffer before the next size
    return rows


def copy_bandwidth_sweep(dev, sizes: Iterable[int] = DEFAULT_SIZES, repeats: int = 5) -> list[dict]:
    """`copy_bandwidth` for both directions, from pinned and from pageable memory."""
    sizes = list(sizes)
    return [row for direction in ("h2d", "d2h") for pinned in (True, False)
            for row in copy_bandwidth(dev, sizes, pinned, direction, repeats)]


@numba.njit(parallel=True, nogil=True, cache=True)
def _seven_streams(param, grad, exp_avg, exp_avg_sq):
    # Adam's memory traffic with almost no arithmetic: read 4 arrays, write 3 (28 B per element).
    for i in prange(param.size):
        g = grad[i]
        param[i] += g
        exp_avg[i] += g
        exp_avg_sq[i] += g


def adam_roofline(num_params: int = 50_000_000, repeats: int = 5) -> float:
    """Bytes per second of a STREAM-like kernel with Adam's access pattern (4 reads, 3 writes per element).

    The fastest an fp32 Adam that moves 28 B per parameter can go on this machine is this figure
    divided by 28. Runs on the threads `numba.set_num_threads` allows. Arrays of `num_params` fp32
    (4 of them: 800 MB at the default) must be much larger than the caches to measure memory.
    """
    if num_params <= 0 or repeats <= 0:
        raise ValueError(f"num_params and repeats must be positive, got {num_params} and {repeats}")
    arrays = [np.ones(num_params, np.float32) for _ in range(4)]
    seconds = _median_seconds(lambda: _seven_streams(*arrays), repeats)
    return 28 * num_params / seconds


def cpu_adam_rate(num_params: int = 20_000_000, repeats: int = 3, threads: int | None = None) -> float:
    """Params per second of chapter 3's fused fp32 AdamW (`adam.adam_fused`) on `threads` threads (default: all
    numba allows)."""
    from ..kernels.adam import adam_fused

    if num_params <= 0 or repeats <= 0:
        raise ValueError(f"num_params and repeats must be positive, got {num_params} and {repeats}")
    param, grad = np.ones(num_params, np.float32), np.full(num_params, 1e-3, np.float32)
    exp_avg, exp_avg_sq = np.zeros_like(param), np.zeros_like(param)
    steps = iter(range(1, 1 << 30))
    before = numba.get_num_threads()
    numba.set_num_threads(threads or numba.config.NUMBA_NUM_THREADS)
    try:
        seconds = _median_seconds(lambda: adam_fused(param, grad, exp_avg, exp_avg_sq, step=next(steps), lr=1e-3),
                                  repeats)
    finally:
        numba.set_num_threads(before)
    return num_params / seconds


def matmul_flops(n: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n matmul in `dtype` on this CPU (2 n^3 per product): the sim device's peak compute.
    A peak, so the fastest of `repeats` (a busy machine slows some of them). A CPU with bf16 matrix units runs
    bf16 matmuls far faster than fp32 ones; one without them, far slower."""
    if n <= 0 or repeats <= 0:
        raise ValueError(f"n and repeats must be positive, got {n} and {repeats}")
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def disk_bandwidth(directory, nbytes: int = 64 * MiB, keys: int = 12, tries: int = 3) -> dict:
    """{"read", "write"} bytes/s through the Swapper (O_DIRECT, checksums, durable commits) in `directory`,
    as the NVMe tier uses it: `nbytes` split into `keys` files written three at a time, then read back three at
    a time. Per-file commits (fsync, index) are included: this is the rate the runtime gets, below a
    drive's sequential figure. The best of `tries` passes: a shared drive only ever slows a pass down (one pass
    here measured writes anywhere from 0.36 to 1.6 GB/s)."""
    from ..nvme.swapper import Swapper
    from ..pinned import aligned_empty

    if keys < 1 or nbytes < keys * 4096 or tries < 1:
        raise ValueError(f"need keys >= 1, tries >= 1 and at least 4 KiB per key, got nbytes={nbytes}, keys={keys}, "
                         f"tries={tries}")
    per_key = nbytes // keys // 4096 * 4096
    data = [aligned_empty(per_key, pin=False) for _ in range(keys)]
    for buffer in data:
        buffer.copy_(torch.randint(0, 256, (per_key,), dtype=torch.uint8))  # not zeros: some drives compress
    read_s = write_s = math.inf
    with Swapper(directory) as swap:
        for _ in range(tries):
            start = time.perf_counter()
            for first in range(0, keys, 3):
                for future in [swap.write(f"k{i}", data[i]) for i in range(first, min(keys, first + 3))]:
                    future.result()
            written = time.perf_counter()
            for first in range(0, keys, 3):
                for future in [swap.read(f"k{i}", into=data[i]) for i in range(first, min(keys, first + 3))]:
                    future.result()
            read_s, write_s = min(read_s, time.perf_counter() - written), min(write_s, written - start)
    total = per_key * keys
    return {"read": total / read_s, "write": total / write_s, "bytes_per_file": per_key}


def file_costs(directory, files: int = 8) -> dict:
    """{"read", "write"}: seconds one file operation through the Swapper costs beyond its bytes, the median over `files`
    4 KiB files taken one at a time. A write's is its durable commit (the data's fsync, the index written, fsynced and
    renamed over, the directory fsynced); a read's its open, checksum and bookkeeping. Every subgroup's state and
    every streamed block read from or written to the drive pays it once, so small pieces cost more than their bytes."""
    from ..nvme.swapper import Swapper
    from ..pinned import aligned_empty

    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    data = aligned_empty(4096, pin=False)
    data.copy_(torch.randint(0, 256, (4096,), dtype=torch.uint8))
    writes, reads = [], []
    with Swapper(directory) as swap:
        swap.write("warm-up", data).result()
        for i in range(files):
            start = time.perf_counter()
            swap.write(f"f{i}", data).result()
            writes.append(time.perf_counter() - start)
        for i in range(files):
            start = time.perf_counter()
            swap.read(f"f{i}", into=data).result()
            reads.append(time.perf_counter() - start)
    return {"read": statistics.median(reads), "write": statistics.median(writes)}


def copy_costs(dev, copies: int = 200, numel: int = 1024, tries: int = 3) -> dict:
    """The fixed costs of one small copy on `dev`, as the offload engine issues it for each gradient: {"issue":
    host seconds to count the tensor, order the copy after compute, enqueue it and record its event;
    "latency": seconds each copy takes on its stream beyond bytes / bandwidth}. Many small copies pay these,
    not bandwidth: the reason to copy per subgroup or bucket rather than per tensor. The best of `tries`
    (a busy machine only ever adds to either)."""
    if copies <= 0 or numel <= 0 or tries <= 0:
        raise ValueError(f"copies, numel and tries must be positive, got {copies}, {numel} and {tries}")
    stream = dev.stream("copy costs")
    host = dev.host_empty(numel)
    on_device = dev.empty(numel, name="copy cost probe")
    dev.copy(on_device, host, stream)  # warm-up
    dev.synchronize()
    bandwidth = dev.links["d2h"].bandwidth if hasattr(dev, "links") else float("inf")
    issue = latency = math.inf
    for _ in range(tries):
        sources = [torch.ones(numel) for _ in range(copies)]
        start = time.perf_counter()
        for source in sources:
            dev.adopt(source, "copy cost probe")
            dev.stream_waits_for_compute(stream)
            dev.copy(host, source, stream)
            dev.event().record(stream)
        issued = time.perf_counter()
        dev.synchronize()
        done = time.perf_counter()
        issue = min(issue, (issued - start) / copies)
        latency = min(latency, max(0.0, (done - start) / copies - 4 * numel / bandwidth))
        del sources
    return {"issue": issue, "latency": latency}



def _chain(blocks: int, width: int) -> torch.nn.Sequential:
    """`blocks` blocks of one Linear and a tanh: each block's forward a matmul; it saves two tensors for backward."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(blocks)])


def _one_pass(dev, model, x: torch.Tensor) -> None:
    model(x).sum().backward()
    dev.synchronize()


def _extra_seconds(dev, plain, changed, x: torch.Tensor, repeats: int) -> float:
    """What a forward + backward pass of `changed` takes beyond one of `plain` (the same chain), both on `x`: the
    passes alternate and each keeps its fastest (after a round that warms both up), so a minute in which the shared
    machine runs slower falls on both instead of passing for a cost."""
    times = {plain: [], changed: []}
    for _ in range(repeats + 1):
        for model, seconds in times.items():
            start = time.perf_counter()
            _one_pass(dev, model, x)
            seconds.append(time.perf_counter() - start)
    return max(min(times[changed][1:]) - min(times[plain][1:]), 1e-7)


def fetch_cost(dev, blocks: int = 12, width: int = 256, batch: int = 512, repeats: int = 7) -> float:
    """Seconds one streamed block's fetch and release add to a step on `dev`, beyond its bytes: a chain of `blocks`
    small blocks with its weights streamed from pinned host memory (ParamStreamer, prefetch 1) against the same chain
    resident, over the fetches a pass makes. Each block computes long enough to hide its copy; give `dev` a fast link,
    so that what is left is each fetch's hooks, allocation, copy issue, wait and free."""
    from ..model.streaming import ParamStreamer

    x = dev.adopt(torch.randn(batch, width), "probe input")
    resident, model = dev.place(_chain(blocks, width)), _chain(blocks, width)
    streamer = ParamStreamer(model, dev, prefetch=1, blocks=list(model))
    try:
        _one_pass(dev, model, x)  # the first pass records the order of uses
        before = streamer.fetches
        _one_pass(dev, model, x)
        fetches = streamer.fetches - before
        return _extra_seconds(dev, resident, model, x, repeats) / max(fetches, 1)
    finally:
        streamer.remove()


def grad_cost(dev, blocks: int = 12, width: int = 256, batch: int = 512, repeats: int = 7) -> float:
    """Seconds one gradient adds to backward on `dev` when OffloadAdam takes it, beyond its bytes: a chain of `blocks`
    small blocks with an OffloadAdam attached (its hooks copy each gradient out as backward makes it, and the passes
    accumulate, as micro-batches do) against the same chain without, over its parameter tensors. Give `dev` a fast
    link, so that what is left is each gradient's hook, its bookkeeping, its copy's issue and its event."""
    from ..engine.optimizer import OffloadAdam

    x = dev.adopt(torch.randn(batch, width), "probe input")
    plain, offloaded = dev.place(_chain(blocks, width)), dev.place(_chain(blocks, width))
    opt = OffloadAdam(offloaded.parameters(), dev)
    try:
        return _extra_seconds(dev, plain, offloaded, x, repeats) / sum(1 for _ in offloaded.parameters())
    finally:
        opt.close()


def pack_cost(dev, blocks: int = 12, width: int = 256, batch: int = 512, repeats: int = 7) -> float:
    """Seconds one saved tensor's offload and return add to a step on `dev`, beyond its bytes: a chain of `blocks`
    small blocks under the 'offload' policy (Activations) against the same chain keeping its saves, over the tensors a
    pass packs. Give `dev` a fast link: what is left is each tensor's hooks, pooled buffer, two copy issues, waits."""
    from ..model.activations import Activations

    x = dev.adopt(torch.randn(batch, width), "probe input")
    plain, model = dev.place(_chain(blocks, width)), dev.place(_chain(blocks, width))
    acts = Activations(list(model), "offload", dev)
    try:
        loss = model(x).sum()  # count the tensors one forward packs: they wait for backward until it runs
        packed = sum(len(refs) for refs in acts._waiting.values())
        loss.backward()
        dev.synchronize()
        return _extra_seconds(dev, plain, model, x, repeats) / max(packed, 1)
    finally:
        acts.remove()


def subgroup_cost(dev, blocks: int = 12, width: int = 256, batch: int = 64, repeats: int = 7) -> float:
    """Seconds one more subgroup adds to OffloadAdam's step() on `dev`, beyond its parameters: the same chain of
    `blocks` blocks updated as one subgroup and as one subgroup per tensor (its CPU Adam over the same bytes either
    way), steps alternating, each keeping its fastest, over the extra subgroups. What is left is each subgroup's Adam
    call and its trace span, the zeroing of its gradient, its upload's issue and event, and its bookkeeping."""
    from ..engine.optimizer import OffloadAdam

    x = dev.adopt(torch.randn(batch, width), "probe input")
    models = [dev.place(_chain(blocks, width)) for _ in range(2)]
    numel = sum(p.numel() for p in models[0].parameters())
    opts = [OffloadAdam(models[0].parameters(), dev, subgroup_numel=numel),
            OffloadAdam(models[1].parameters(), dev, subgroup_numel=1)]  # one tensor per subgroup
    times: list[list[float]] = [[], []]
    try:
        for _ in range(repeats + 1):  # the first round warms both up
            for model, opt, seconds in zip(models, opts, times, strict=True):
                _one_pass(dev, model, x)
                start = time.perf_counter()
                opt.step()
                dev.synchronize()
                seconds.append(time.perf_counter() - start)
                opt.zero_grad()
        extra = len(opts[1].subgroups) - len(opts[0].subgroups)
        return max(min(times[1][1:]) - min(times[0][1:]), 1e-7) / extra
    finally:
        for opt in opts:
            opt.close()
