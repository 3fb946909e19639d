"""The machine: the hardware table, every figure with its source, and `probe()` of this machine (profiles.py); the
measurements probe() runs (measure.py).

What this is not: a model of a step (predict/) or a device to run on (devices/).
"""
