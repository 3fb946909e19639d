"""A tensor's bytes and their checksum (xxh3, 64 bits): what the swapper stores beside each file and what the
simulated device compares to catch a source changed while a copy still reads it; and a file's (the checkpoints').

What this is not: a cryptographic hash, or a check of values (two tensors with equal values and other bytes differ).
"""

from __future__ import annotations

import torch
import xxhash


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (any dtype, bf16 included)."""
    return memoryview(tensor.detach().view(torch.uint8).numpy()).cast("B") if tensor.numel() else memoryview(b"")


def checksum(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(bytes_of(tensor.reshape(-1)))


def file_checksum(path, chunk: int = 64 << 20) -> str:
    """The same checksum of a file's bytes, read a chunk at a time (a checkpoint's files can be larger than memory
    can spare)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
