"""The offload engine: `OffloadAdam` (optimizer.py) and the parts its step calls: the gradient path (gradients.py,
buckets.py), the device weights and their uploads (weights.py), the speculative update (speculative.py), the delayed
update (delayed.py), the hybrid update's device side (hybrid.py, device_path.py), the NVMe tier (nvme_tier.py), the
sharded step (sharded.py, sharding.py) and the checkpoint's state (state.py).

What this is not: a device backend, a disk, a model or a training loop: those are given to it (a `Device`, a
swapper, the parameters).
"""

from .optimizer import OffloadAdam

__all__ = ["OffloadAdam"]
