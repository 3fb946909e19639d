"""The disk tier: the `Swapper` (tensors to files and back with O_DIRECT, checksums and crash-safe commits, swapper.py),
its index (index.py), one swapper over several paths (multipath.py) and the measurement of a directory (tune.py).

What this is not: a policy. The engine decides what goes to disk and when (engine/nvme_tier.py).
"""

from .multipath import MultiPathSwapper
from .swapper import SwapIOError, Swapper

__all__ = ["MultiPathSwapper", "SwapIOError", "Swapper"]
