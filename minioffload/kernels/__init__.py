"""The arithmetic kernels, each a function over flat buffers: CPU Adam from NumPy to fused Numba (adam.py), 16-bit
floats as raw bits (lowp.py), a gradient's sum of squares (gradnorm.py), a CuPy AdamW for the device (gpu_adam.py) and
the checksum of a tensor's bytes (checksum.py).

What this is not: anything that knows of subgroups, streams, devices or files.
"""
