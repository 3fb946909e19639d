"""How fast a directory's drive reads and writes through the Swapper: one measurement, and a sweep of block size x
workers (like DeepSpeed's ds_nvme_tune) to pick the Swapper's settings for that drive.

What this is not: fio; bench/swapper.py compares the two on the same files.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..pinned import aligned_empty
from .swapper import Swapper


def measure(directory: str | Path, data: torch.Tensor, back: torch.Tensor, **options) -> dict:
    """One durable write of `data` and one read into `back` with a Swapper(directory, **options): GB/s each."""
    nbytes = data.numel() * data.element_size()
    with Swapper(directory, **{"verify": False, **options}) as swap:
        start = time.perf_counter()
        swap.write("measure", data).result()
        written = time.perf_counter()
        swap.read("measure", into=back).result()
        read = time.perf_counter()
    return {"write_GBps": nbytes / (written - start) / 1e9, "read_GBps": nbytes / (read - written) / 1e9}


def tune(directory: str | Path, block_sizes=(1 << 18, 1 << 20, 1 << 22), workers=(1, 2, 4, 8),
         file_bytes: int = 256 << 20, progress: bool = False) -> dict:
    """Sweep block size x worker count on `directory` (like DeepSpeed's ds_nvme_tune): write then read one
    file of `file_bytes` per setting, durable writes and unverified reads, so the disk is what is measured.
    Returns {"rows": [{block_size, workers, write_GBps, read_GBps}], "best_write": row, "best_read": row}."""
    scratch = Path(directory) / ".minioffload-tune"
    scratch.mkdir(exist_ok=True)
    data = aligned_empty(file_bytes, pin=False)
    data.copy_(torch.randint(0, 256, (file_bytes,), dtype=torch.uint8))  # not zeros: some disks compress
    back = aligned_empty(file_bytes, pin=False)
    settings = [(b, w) for b in block_sizes for w in workers]
    if progress:
        try:
            from tqdm.auto import tqdm  # the course extra installs it; without it, no bar
        except ImportError:
            pass
        else:
            settings = tqdm(settings, desc="tune", unit="setting")
    rows = []
    try:
        for block_size, count in settings:
            rows.append({"block_size": block_size, "workers": count,
                         **measure(scratch, data, back, block_size=block_size, workers=count)})
    finally:
        for path in scratch.iterdir():
            path.unlink()
        scratch.rmdir()
    return {"rows": rows, "best_write": max(rows, key=lambda r: r["write_GBps"]),
            "best_read": max(rows, key=lambda r: r["read_GBps"])}
