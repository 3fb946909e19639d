"""minioffload: a small, real runtime for training models larger than GPU memory.

A few vocabulary modules (units, options, layout, ledger, trace, pinned, paths) and a package per concern: kernels,
devices, nvme, model, machine, predict, engine (OffloadAdam), train, planner, cli. It needs torch, NumPy, Numba,
xxhash and SciPy alone. The course's own layer (lab graders, figures, widgets) is `minioffload.course`, which no
runtime module imports.
"""

__version__ = "0.1.0"

# The runtime's front door:  from minioffload import OffloadAdam, OffloadOptions, device, Swapper, Ledger
# `device` is bound here, eagerly; the rest is imported on first use.
from .devices import Device, device  # noqa: E402,F401

_LAZY = {"OffloadAdam": "engine", "OffloadOptions": "options", "Swapper": "nvme", "Ledger": "ledger",
         "TrainConfig": "train", "Link": "devices"}  # imported on first use
__all__ = sorted([*_LAZY, "Device", "device"])


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
