"""Run a function on N gloo ranks from a test: `run_ranks(fn, world, *args)` spawns N processes, each with its own
process group member, and returns each rank's result (or raises with the ranks' errors).

`fn(rank, world, *args)` must be a module-level function (spawned processes import it by name) and return
something torch.save can write. Every rank gets a short timeout, so a test whose ranks diverge fails, not hangs.
"""

import os
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out_dir, fn, args, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = {"ok": fn(rank, world, *args)}
    except BaseException as err:  # the parent reports every rank's error
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn, world: int, *args, timeout_s: float = TIMEOUT_S, expect_errors: bool = False):
    """Each rank's return value, in rank order. With `expect_errors`, each rank's {"ok": ...} or {"error": ...}."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world, free_port(), out_dir, fn, args, timeout_s), nprocs=world,
                           join=True, start_method="spawn")
        results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                   if (Path(out_dir) / f"rank{r}.pt").is_file()
                   else {"error": f"rank {r} exited without a result", "traceback": "(none)"} for r in range(world)]
    if expect_errors:
        return results
    errors = [f"rank {r}: {res['traceback']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res["ok"] for res in results]
