"""Where a run writes: a directory checked before any work starts, with a message naming the problem and the fix.

    out = usable_directory("runs/demo", "out_dir", need_bytes=10 * MiB)   # made if missing; ValueError if not

What this is not: a lock (another process may fill the disk after the check: the writers report that themselves).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .units import format_bytes


def usable_directory(path: str | Path, what: str, need_bytes: int = 0) -> Path:
    """Make `path` a directory if it is not one yet, check that this user can write there and that `need_bytes` are
    free on its filesystem. Refusals raise ValueError naming `what`, the path and what to change."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory: choose a directory, or remove the file")
    blocker = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{what} {path} cannot be created: {blocker} is a file; choose a path under a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # what counts is whether a file can be made there, not mode bits
            pass
    except OSError as err:
        raise ValueError(f"{what} {path} is not a directory this user can write to ({err.strerror}): choose "
                         "another, or change its permissions") from None
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        raise ValueError(f"{what} {path} has {format_bytes(free)} free and the run writes about "
                         f"{format_bytes(need_bytes)}: free space there, or choose a directory on a larger disk")
    if not os.access(path, os.W_OK | os.X_OK):  # e.g. a read-only bind mount root can still create temp files in
        raise ValueError(f"{what} {path} is not writable by this user: choose another, or change its permissions")
    return path
