"""Where a run writes: a directory checked before any work starts, with a message naming the problem and the fix.

    out = usable_directory("runs/demo", "out_dir", need_bytes=10 * MiB)   # ValueError naming the fix, or the path

What this is not: a lock (another process may fill the disk after the check: the writers report that themselves).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .units import format_bytes


def usable_directory(path: str | Path, what: str, need_bytes: int = 0) -> Path:
    """Check that `path` is a directory this user can write to, or can be made one, with `need_bytes` free on its
    file system. Changes nothing (a missing directory is made by the run, not here). Refusals raise ValueError
    naming `what`, the path and what to change."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory: choose a directory, or remove the file")
    existing = next(p for p in (path, *path.parents) if p.exists())  # the directory itself, or where it would go
    if not existing.is_dir():
        raise ValueError(f"{what} {path} cannot be created: {existing} is a file; choose a path under a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):  # what counts is whether a file can be made there, not mode bits
            pass
    except OSError as err:
        where = "" if existing == path else f" (nor can it be created in {existing})"
        raise ValueError(f"{what} {path} is not a directory this user can write to{where}: {err.strerror}; choose "
                         "another, or change its permissions") from None
    free = shutil.disk_usage(existing).free
    if need_bytes > free:
        raise ValueError(f"{what} {path} has {format_bytes(free)} free and the run writes about "
                         f"{format_bytes(need_bytes)}: free space there, or choose a directory on a larger disk")
    return path
