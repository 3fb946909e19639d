"""The three-stage chunk pipeline: copy a chunk in (H2D), compute on it, copy the result out (D2H).

Three versions with one signature, from slowest to fastest, each checked against `reference`:

    serial          one stream: H2D k, compute k, D2H k, then chunk k+1. Nothing overlaps.
    single_buffer   three streams but one device buffer each way: chunk k+1 cannot arrive before
                    compute k has read chunk k, so compute never overlaps a copy; only the H2D of
                    k+1 and the D2H of k overlap: 2 stage times per chunk instead of 3.
    overlapped      three streams and `buffers` device buffers each way: H2D of chunk k+1, compute
                    on chunk k and D2H of chunk k-1 run at once.

Who waits on whom (the rules; `WAITS` names them so a lab or a test can drop one):

    compute_after_h2d       compute k waits until chunk k has arrived
    d2h_after_compute       D2H k waits until compute k has written its result
    h2d_after_compute       H2D k+B waits until compute k has finished reading input buffer k % B
    compute_after_d2h       compute k+B waits until D2H k has finished reading output buffer k % B
    (the host waits for every D2H before it reads the results: `dev.synchronize()`)

What this is not: a general scheduler. Later chapters use the same pattern for optimizer subgroups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

WAITS = frozenset({"compute_after_h2d", "d2h_after_compute", "h2d_after_compute", "compute_after_d2h"})

Kernel = Callable[[torch.Tensor, torch.Tensor], object]  # kernel(input, out): writes out from input


def reference(chunks_in: Sequence[torch.Tensor], kernel: Kernel) -> list[torch.Tensor]:
    """What every version must produce: the kernel applied to each chunk, on the host."""
    results = []
    for chunk in chunks_in:
        out = torch.empty_like(chunk)
        kernel(chunk, out)
        results.append(out)
    return results


def serial(dev, chunks_in, chunks_out, kernel: Kernel, kernel_seconds: float | None = None) -> None:
    """Everything on one stream, one buffer each way: in-order, so no events are needed."""
    stream = dev.stream("serial")
    d_in, d_out = dev.empty(chunks_in[0].shape, chunks_in[0].dtype, "in"), dev.empty(
        chunks_in[0].shape, chunks_in[0].dtype, "out")
    for k, (host_in, host_out) in enumerate(zip(chunks_in, chunks_out, strict=True)):
        dev.copy(d_in, host_in, stream, name=f"h2d {k}")
        dev.launch(stream, kernel, d_in, d_out, name=f"compute {k}", duration=kernel_seconds)
        dev.copy(host_out, d_out, stream, name=f"d2h {k}")
    dev.synchronize()


def overlapped(dev, chunks_in, chunks_out, kernel: Kernel, kernel_seconds: float | None = None,
               buffers: int = 2, waits: frozenset[str] = WAITS) -> None:
    """Three streams, `buffers` device buffers each way, and the events in `waits` between them."""
    unknown = set(waits) - WAITS
    if unknown:
        raise ValueError(f"unknown waits {sorted(unknown)}; the rules are {sorted(WAITS)}")
    if buffers < 1:
        raise ValueError(f"buffers must be at least 1, got {buffers}")
    h2d, compute, d2h = dev.stream("h2d"), dev.stream("compute"), dev.stream("d2h")
    shape, dtype = chunks_in[0].shape, chunks_in[0].dtype
    d_in = [dev.empty(shape, dtype, f"in{b}") for b in range(buffers)]
    d_out = [dev.empty(shape, dtype, f"out{b}") for b in range(buffers)]
    arrived, computed, departed = [], [], []  # one event per chunk and stage
    for k, (host_in, host_out) in enumerate(zip(chunks_in, chunks_out, strict=True)):
        b = k % buffers
        if "h2d_after_compute" in waits and k >= buffers:
            h2d.wait(computed[k - buffers])
        dev.copy(d_in[b], host_in, h2d, name=f"h2d {k}")
        arrived.append(dev.event())
        arrived[k].record(h2d)

        if "compute_after_h2d" in waits:
            compute.wait(arrived[k])
        if "compute_after_d2h" in waits and k >= buffers:
            compute.wait(departed[k - buffers])
        dev.launch(compute, kernel, d_in[b], d_out[b], name=f"compute {k}", duration=kernel_seconds)
        computed.append(dev.event())
        computed[k].record(compute)

        if "d2h_after_compute" in waits:
            d2h.wait(computed[k])
        dev.copy(host_out, d_out[b], d2h, name=f"d2h {k}")
        departed.append(dev.event())
        departed[k].record(d2h)
    dev.synchronize()


def single_buffer(dev, chunks_in, chunks_out, kernel: Kernel, kernel_seconds: float | None = None) -> None:
    """Three streams, one buffer each way: correct, and at best 1.5x faster than serial."""
    overlapped(dev, chunks_in, chunks_out, kernel, kernel_seconds, buffers=1)


VERSIONS = {"serial": serial, "single_buffer": single_buffer, "overlapped": overlapped}
