"""One device interface, two backends: a real CUDA GPU and a simulated GPU on the CPU.

    dev = device("auto")                 # cuda when available, else sim; says which
    copy = dev.stream("h2d")             # streams run their work in order, concurrently with each other
    x = dev.empty((1024, 1024))          # device memory (counted in dev.ledger's "device" tier)
    host = dev.host_empty((1024, 1024))  # pinned host memory
    dev.copy(x, host, copy)              # enqueued; returns at once when `host` is pinned
    ready = dev.event(); ready.record(copy)
    compute = dev.stream("compute"); compute.wait(ready)
    dev.launch(compute, torch.mul, x, 2, out=x)   # runs after the copy, never before
    dev.synchronize(); print(dev.trace.summary())

Both backends record every op as a span in `dev.trace` (lanes "h2d", "compute", "d2h") and count
device memory in `dev.ledger`. The simulated device is in `devices/sim.py`, the CUDA one in
`devices/cuda.py`; devices/common.py what they share, and
devices/protocol.py the interface both implement (what the engine and the chapters may use); this file
picks one. Not here: multi-GPU, graphs, peer copies.
"""

from __future__ import annotations

import warnings

import torch

from .common import Link
from .protocol import Device

__all__ = ["Device", "Link", "device"]


def device(kind: str = "auto", **options):
    """A device: "cuda", "sim", or "auto" (cuda when torch sees a GPU, else sim; prints which).

    Options go to the backend: for sim, see `SimDevice`; for cuda, `index`.
    """
    if kind not in ("auto", "cuda", "sim"):
        raise ValueError(f"unknown device kind {kind!r}; choose 'auto', 'cuda' or 'sim'")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "sim"
        print(f"minioffload: using the {kind} device"
              + ("" if kind == "cuda" else " (no CUDA GPU found: a simulated GPU on the CPU)"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device('cuda') needs a CUDA GPU and a CUDA build of torch; use device('sim') "
                               "to run on the CPU")
        sim_only = {"memory_bytes", "h2d", "d2h", "jitter", "seed", "pageable_slowdown", "switch_interval",
                    "adam_rate", "strict", "lags"}
        if sim_only & options.keys():
            warnings.warn(f"options {sorted(sim_only & options.keys())} only apply to the sim device; ignored",
                          stacklevel=2)
            options = {k: v for k, v in options.items() if k not in sim_only}
        from .cuda import CudaDevice
        return CudaDevice(**options)
    from .sim import SimDevice
    return SimDevice(**options)
