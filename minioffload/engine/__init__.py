"""The offload engine: `OffloadAdam` (optimizer.py), whose step reads top to bottom and calls its parts, each made with
what it reads: what every part reads (packing.py), the memory made at construction (buffers.py), the gradient path
(gradients.py, buckets.py), the device weights and their uploads (weights.py), the speculative update (speculative.py),
the delayed update (delayed.py), the hybrid update's device side (device_path.py), the NVMe tier (nvme_tier.py), a
rank's sharded step (sharded.py, with the collectives in sharding.py) and the checkpoint's state (state.py).

What this is not: a device backend, a disk, a model or a training loop: those are given to it (a `Device`, a
swapper, the parameters, a streamer).
"""

from .optimizer import OffloadAdam

__all__ = ["OffloadAdam"]
