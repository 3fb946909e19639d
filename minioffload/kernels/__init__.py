"""The arithmetic kernels, each a function over flat buffers: CPU Adam from NumPy to fused Numba (adam.py), 16-bit
floats as raw bits (lowp.py), a gradient's sum of squares (gradnorm.py), a CuPy AdamW for the device (gpu_adam.py) and
the checksum of a tensor's bytes (checksum.py).

What this is not: anything that knows of subgroups, streams, devices or files.
"""

import numba
import torch

# Numba's thread pool (its OpenMP layer: the one safe to call from several threads at once) sets the process's
# OpenMP thread count to its own when it starts, and torch computes on the same OpenMP runtime. Started lazily, it
# would switch torch mid-run: a process started with OMP_NUM_THREADS=1 ran its first step on one thread and the
# rest on every core, and its matrix products then differed in the last bits from a process that resumed it. Start
# the pool now and give torch its own count back; Numba's kernels still use Numba's.
_torch_threads = torch.get_num_threads()
numba.get_num_threads()  # starts the pool
torch.set_num_threads(_torch_threads)
