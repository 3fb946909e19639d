"""The swapper's index (index.json): what a well-formed entry is, the checks it must pass when a swapper opens, and
how the file is replaced atomically.

    {"key": {"slot": 0 | 1, "nbytes": int, "dtype": "torch.float32", "shape": [..], "checksum": "<xxh3-64 hex>"}}

    index = load(directory, file_of)   # checked: every entry well formed, its slot file there and long enough
    replace(directory, index)          # write a temporary file, fsync, rename over index.json, fsync the directory

`entry_problem` and `file_problem` say, in words, what is wrong with an entry or the slot file it points to; `load`
turns a problem into a SwapIOError naming the index, the key and the fix.

What this is not: when the index is committed (the Swapper decides: once for every write whose data is durable).
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..pinned import ALIGNMENT

INDEX = "index.json"
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


class SwapIOError(OSError):
    """A read or write that failed on the disk (no space, I/O error, permission, bad checksum). The previous
    version of the key is intact."""

    def __init__(self, message: str, path: Path, key: str, cause: BaseException | None = None):
        super().__init__(getattr(cause, "errno", None) or errno.EIO, message)
        self.path, self.key, self.cause = path, key, cause

    def __str__(self) -> str:
        return self.strerror


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (a rename into it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(directory: Path, file_of: Callable[[str, int], Path]) -> dict:
    """The index, checked: every entry well formed and its slot file (`file_of(key, slot)`) present and long enough.
    A damaged index raises SwapIOError naming the index, the key and the file, before anything is read or written."""
    path = directory / INDEX
    if not path.exists():
        return {}
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SwapIOError(f"cannot read the swap index {path}: {err}; restore it, or point the swapper at an "
                          "empty directory", path, "", err) from err
    if not isinstance(index, dict):
        raise SwapIOError(f"the swap index {path} holds a {type(index).__name__}, not a table of keys: it is "
                          "damaged; restore it, or point the swapper at an empty directory", path, "")
    for key, entry in index.items():
        problem = entry_problem(entry) or file_problem(file_of(key, entry["slot"]), entry)
        if problem:
            raise SwapIOError(f"the swap index {path} is damaged at key {key!r}: {problem}; restore the index "
                              "and its files, or point the swapper at an empty directory", path, key)
    return index


def replace(directory: Path, index: dict) -> None:
    """Replace index.json by `index`, atomically: write, fsync, rename over the old one (the commit), fsync the
    directory. A failure before the rename removes the temporary file and changes nothing."""
    temporary = directory / f".{INDEX}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, directory / INDEX)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk gets its blocks back
        raise
    fsync_path(directory)  # the directory entry of the rename
