"""The swapper's index (index.json): what a well-formed entry is, and the checks it must pass when a swapper opens.

    {"key": {"slot": 0 | 1, "nbytes": int, "dtype": "torch.float32", "shape": [..], "checksum": "<xxh3-64 hex>"}}

`entry_problem` and `file_problem` say, in words, what is wrong with an entry or the slot file it points to; the
Swapper (nvme/swapper.py) turns a problem into a SwapIOError naming the index, the key and the fix.

What this is not: the commit of the index (Swapper._commit writes it atomically).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..pinned import ALIGNMENT

DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                           torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def entry_problem(entry) -> str | None:
    """What is wrong with one index entry ({"slot", "nbytes", "dtype", "shape", "checksum"}), or None."""
    if not isinstance(entry, dict):
        return f"its entry is a {type(entry).__name__}, not a table"
    missing = [name for name in ("slot", "nbytes", "dtype", "shape", "checksum") if name not in entry]
    if missing:
        return f"its entry lacks {', '.join(missing)}"
    slot, nbytes, dtype, shape = entry["slot"], entry["nbytes"], entry["dtype"], entry["shape"]
    if slot not in (0, 1) or isinstance(slot, bool):
        return f"slot is {slot!r}, not 0 or 1"
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        return f"nbytes is {nbytes!r}, not a size in bytes"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return f"dtype is {dtype!r}, not one the swapper stores"
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        return f"shape is {shape!r}, not a list of sizes"
    if math.prod(shape) * DTYPES[dtype].itemsize != nbytes:
        return f"shape {shape} of {dtype} is not {nbytes} bytes"
    if not isinstance(entry["checksum"], str):
        return f"checksum is {entry['checksum']!r}, not a string"
    return None


def file_problem(file: Path, entry: dict) -> str | None:
    """What is wrong with the slot file an entry points to, or None."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return f"its file {file} is missing"
    except OSError as err:
        return f"its file {file} cannot be read ({err.strerror})"
    if size < padded(entry["nbytes"]):
        return f"its file {file} is truncated: {size} bytes, the index says {padded(entry['nbytes'])}"
    return None
